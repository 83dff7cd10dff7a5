"""The schedule algorithms, one module each; importing this package registers them.

``MODULES`` fixes the order the schedules are listed in (the front end's error
message, ``SCHEDULES``); a module missing from it fails ``tests/test_schedule_registry.py``.
"""

from __future__ import annotations

import importlib

MODULES = ("gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble", "eager_1f1b",
           "interleaved_gpipe", "gpipe_1f1b_last", "circular_reversed_backward",
           "dualpipe_v", "zero_bubble_v", "kimi_k2", "custom")

for _module in MODULES:
    importlib.import_module(f"{__name__}.{_module}")
