"""Where ``MULTIMESH_DUMP_IR_TO`` dumps and failure repros go: one place per program.

Every compiled program gets its own directory ``$MULTIMESH_DUMP_IR_TO/<name>-<n>``
(``<name>`` from the compiled function, ``<n>`` the first free index), created with
``os.mkdir``, which is atomic: two programs, two threads or two processes never
write into the same one. A failure repro goes into that directory, or without
``MULTIMESH_DUMP_IR_TO`` into a fresh ``multimesh-failed-input-*.mlir`` file in the
temporary directory.
"""

from __future__ import annotations

import os
import re
import tempfile

__all__ = ["dump_root", "program_dir", "repro_path", "REPRO_NAME"]

REPRO_NAME = "multimesh-failed-input.mlir"


def dump_root() -> str | None:
    """``$MULTIMESH_DUMP_IR_TO``, or None when unset or empty."""
    return os.environ.get("MULTIMESH_DUMP_IR_TO") or None


def _safe(name: str | None) -> str:
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", name or "").strip("_.")
    return name[:60] or "program"


def program_dir(root: str, name: str | None) -> str:
    """A new, empty directory ``root/<name>-<n>`` for one program's dumps."""
    os.makedirs(root, exist_ok=True)
    base = _safe(name)
    n = 0
    while True:
        path = os.path.join(root, f"{base}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def repro_path(directory: str | None) -> str:
    """Where to write a failing pass's input: in the program's dump directory, else a
    new file in the temporary directory (never a name another failure also uses)."""
    if directory is not None:
        return os.path.join(directory, REPRO_NAME)
    fd, path = tempfile.mkstemp(prefix="multimesh-failed-input-", suffix=".mlir")
    os.close(fd)
    return path
