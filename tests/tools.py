"""The repository's scripts (``tools/*.py``), imported by the tests that exercise them.

``tools/`` is a folder of scripts, not a package, so each is loaded from its file once
and kept in ``sys.modules`` under its own name (dataclasses and pickling need that).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module (the same object on every call)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
