"""Where ``MULTIMESH_DUMP_IR_TO`` dumps and failure repros go: one place per program.

Every compiled program gets its own directory ``$MULTIMESH_DUMP_IR_TO/<name>-<n>``
(``<name>`` from the compiled function, ``<n>`` the first free index), created with
``os.mkdir``, which is atomic: two programs, two threads or two processes never
write into the same one. A failure repro goes into that directory, or without
``MULTIMESH_DUMP_IR_TO`` into a fresh ``multimesh-failed-input-*.mlir`` file in the
repro directory: ``$MULTIMESH_REPRO_DIR``, by default ``multimesh-repros-<user>`` in the
temporary directory, which keeps the newest ``$MULTIMESH_REPRO_KEEP`` (default 20)
repros; ``MULTIMESH_REPRO_KEEP=0`` writes none.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile

from multimesh._src.errors import MultimeshValueError

__all__ = ["dump_root", "program_dir", "repro_path", "repro_dir", "repro_keep", "prune_repros",
           "NoRepro", "REPRO_NAME", "REPRO_DIR_ENV", "REPRO_KEEP_ENV", "DEFAULT_REPRO_KEEP"]

REPRO_NAME = "multimesh-failed-input.mlir"
REPRO_PREFIX = "multimesh-failed-input-"
REPRO_DIR_ENV = "MULTIMESH_REPRO_DIR"
REPRO_KEEP_ENV = "MULTIMESH_REPRO_KEEP"
DEFAULT_REPRO_KEEP = 20


def dump_root() -> str | None:
    """``$MULTIMESH_DUMP_IR_TO``, or None when unset or empty."""
    return os.environ.get("MULTIMESH_DUMP_IR_TO") or None


def _safe(name: str | None) -> str:
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", name or "").strip("_.")
    return name[:60] or "program"


def program_dir(root: str, name: str | None) -> str:
    """A new, empty directory ``root/<name>-<n>`` for one program's dumps."""
    base = _safe(name)
    n = 0
    try:
        os.makedirs(root, exist_ok=True)
        while True:
            path = os.path.join(root, f"{base}-{n}")
            try:
                os.mkdir(path)
                return path
            except FileExistsError:
                n += 1
    except OSError as e:
        raise MultimeshValueError(
            f"MULTIMESH_DUMP_IR_TO={root!r} names a directory multimesh cannot make or "
            f"write ({e.strerror or e}: {e.filename!r}); set it to a directory you can "
            f"write, or unset it to dump nothing.") from None


def _user() -> str:
    try:
        return _safe(getpass.getuser())
    except (KeyError, OSError):  # no name for this uid (a container)
        return str(os.getuid())


class NoRepro(Exception):
    """Why no repro file is written; the text completes "No repro file was written: "."""


def repro_keep() -> int:
    """``$MULTIMESH_REPRO_KEEP``: how many repros the repro directory keeps (0: none)."""
    raw = os.environ.get(REPRO_KEEP_ENV, "").strip() or str(DEFAULT_REPRO_KEEP)
    if not raw.isdigit():
        raise NoRepro(f"{REPRO_KEEP_ENV}={raw!r} is not a whole number of files to keep, 0 "
                      f"or more (the default is {DEFAULT_REPRO_KEEP})")
    return int(raw)


def repro_dir() -> str:
    """The directory repros go to without ``MULTIMESH_DUMP_IR_TO``, made if need be:
    ``$MULTIMESH_REPRO_DIR``, or ``multimesh-repros-<user>`` in the temporary directory
    (one per user, readable only by them, as it holds their programs)."""
    path = os.environ.get(REPRO_DIR_ENV) or os.path.join(tempfile.gettempdir(),
                                                         f"multimesh-repros-{_user()}")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        owner = os.stat(path).st_uid
    except OSError as e:
        raise NoRepro(f"cannot make the repro directory {path!r} ({e.strerror or e}); set "
                      f"{REPRO_DIR_ENV} to a directory you can write") from None
    if hasattr(os, "getuid") and owner != os.getuid():
        raise NoRepro(f"the repro directory {path!r} belongs to another user; set "
                      f"{REPRO_DIR_ENV} to a directory of your own")
    return path


def repro_path(directory: str | None) -> str:
    """Where to write a failing pass's input: in the program's dump directory, else a
    new file in :func:`repro_dir` (never a name another failure also uses). Raises
    :class:`NoRepro` when repros are off or cannot be written."""
    if directory is not None:
        return os.path.join(directory, REPRO_NAME)
    if repro_keep() == 0:
        raise NoRepro(f"{REPRO_KEEP_ENV}=0 turns them off")
    fd, path = tempfile.mkstemp(prefix=REPRO_PREFIX, suffix=".mlir", dir=repro_dir())
    os.close(fd)
    return path


def prune_repros(directory: str, keep: int) -> None:
    """Keep the newest ``keep`` repros in ``directory``: each ``.mlir`` file goes with
    the files named after it (``mm-match-tasks``' ``<stem>.rules.json``)."""
    stems: dict[str, float] = {}
    for entry in os.scandir(directory):
        if entry.name.startswith(REPRO_PREFIX) and entry.name.endswith(".mlir"):
            try:
                stems[entry.name[:-len(".mlir")]] = entry.stat().st_mtime
            except FileNotFoundError:  # another process pruned it
                continue
    old = set(sorted(stems, key=lambda s: (stems[s], s), reverse=True)[keep:])
    if not old:
        return
    for entry in os.scandir(directory):
        if entry.name.split(".", 1)[0] in old:
            try:
                os.remove(entry.path)
            except FileNotFoundError:
                pass
