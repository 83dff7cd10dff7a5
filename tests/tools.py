"""The repository's scripts (``tools/*.py``), imported by the tests that exercise them,
and a fresh interpreter for a test program that must start cold (:func:`run_child`).

``tools/`` is a folder of scripts, not a package, so each is loaded from its file once
and kept in ``sys.modules`` under its own name (dataclasses and pickling need that).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
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


def run_child(code: str) -> str:
    """Run ``code`` in a fresh interpreter (its own ``XLA_FLAGS``, none inherited) and
    return its stdout; it must reach its end (a crash reports both streams' tails)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-c", code + '\nprint("CHILD-OK", flush=True)\n'],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0 and "CHILD-OK" in p.stdout, (
        f"child exited with {p.returncode} (139 or -11: segfault)\n"
        f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}")
    return p.stdout
