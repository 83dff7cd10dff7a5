"""Which of ``multimesh/_src/jax_compat.py``'s shims each test file reaches.

    python tools/jax_compat_coverage.py tests/test_a.py tests/test_b.py ...

runs each file in its own pytest run (this interpreter, so run it with the jax under
test, e.g. ``/work/venvs/j012/bin/python``; the root conftest's 8 CPU devices) with
every public callable of ``jax_compat`` (its ``__all__``) wrapped to record that it was
called, then prints, per file, the shims it reached, and the shims no file reached.
Shims called only at import (the primitives' rules) are reached by every file; those
called only in subprocesses (``python -m multimesh.launch``'s workers) are not seen
here. docs/testing.md ("jax 0.12") says how this chose the subset `.ci/run` runs under
jax 0.12, which tests/test_jax_compat.py keeps covering every shim.
"""

from __future__ import annotations

import json
import subprocess
import sys

PLUGIN = "multimesh_jax_compat_recorder"


class Recorder:
    """A pytest plugin: wraps the shims before multimesh imports them."""

    def __init__(self, out: str):
        self.out = out
        self.reached: set[str] = set()

    def pytest_configure(self, config):
        from multimesh._src import jax_compat

        for name in jax_compat.__all__:
            value = getattr(jax_compat, name)
            if callable(value) and not isinstance(value, type):
                setattr(jax_compat, name, self._wrap(name, value))

    def _wrap(self, name, fn):
        def recorded(*args, **kwargs):
            self.reached.add(name)
            return fn(*args, **kwargs)
        return recorded

    def pytest_unconfigure(self, config):
        with open(self.out, "w") as f:
            json.dump(sorted(self.reached), f)


def main(files: list[str]) -> int:
    import os
    import tempfile

    from multimesh._src import jax_compat  # only for __all__ (no devices touched)

    shims = {n for n in jax_compat.__all__ if callable(getattr(jax_compat, n))
             and not isinstance(getattr(jax_compat, n), type)}
    reached_any: set[str] = set()
    for path in files:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = tmp.name
        code = ("import sys, pytest; sys.path.insert(0, 'tools'); import jax_compat_coverage as c;"
                f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {path!r}],"
                f" plugins=[c.Recorder({out!r})]))")
        rc = subprocess.call([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
        with open(out) as f:
            reached = set(json.load(f))
        os.unlink(out)
        reached_any |= reached
        print(f"{path} (pytest rc {rc}): {', '.join(sorted(reached & shims))}")
    print("reached by none:", ", ".join(sorted(shims - reached_any)) or "-")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
