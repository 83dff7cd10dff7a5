"""One persistent entry per distinct fragment, beside jax's persistent cache (issue 31).

jax keys its persistent compilation cache with the device assignment on CPU, and a
fragment's executable that jax read from that cache cannot be serialized again with its
code (jaxlib 0.10.2, docs/performance.md). So with jax's cache alone, fragments that are
one SPMD program on several submeshes each compiled in the first process, and each read
its own entry in the next. Instead, the executable XLA compiles for the first of them is
written here once, keyed by what the fragments share (the executor's ``_shape_key``:
the text with mesh names made canonical, the donations, the layouts relative to the
fragment's devices) and by the jax, jaxlib and device kind that compiled it; a later
process reads that one entry and loads it onto every submesh that runs the program.
The shared-blocks plan (:mod:`.shared_blocks`: which fragments run as pieces) is kept
likewise, in a folder of its own (:data:`SPLIT_PLANS`), so a restarted process does not
match the fragments again.

Entries live in ``<jax_compilation_cache_dir>/multimesh/``, written atomically, only
where jax's cache is on, the directory is local, and XLA took at least
``jax_persistent_cache_min_compile_time_secs`` (as jax's own entries). An entry that
cannot be read or loaded is ignored (the fragment compiles).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
import zlib
from pathlib import Path

import jax
import jaxlib.version as jaxlib_version

from multimesh._src import jax_compat

__all__ = ["EXECUTABLES", "SPLIT_PLANS", "directory", "entry_key", "read", "write", "reads", "writes"]

EXECUTABLES, SPLIT_PLANS = "multimesh", "multimesh-split-plans"
"""The folders under jax's cache directory: fragments' executables, and the shared-blocks
plans (:mod:`.shared_blocks`: which fragments run as pieces)."""
_counts = {(EXECUTABLES, "reads"): 0, (EXECUTABLES, "writes"): 0,
           (SPLIT_PLANS, "reads"): 0, (SPLIT_PLANS, "writes"): 0}
_lock = threading.Lock()


def directory(folder: str = EXECUTABLES) -> Path | None:
    """Where entries live, or None when jax's persistent cache is off or not local."""
    if not jax_compat.persistent_cache_on():
        return None
    root, _ = jax_compat.persistent_cache_settings()
    if "://" in root:  # gs://, ...: jax's own entries only
        return None
    return Path(root) / folder


def entry_key(shape_key: tuple, device) -> str:
    """The entry's name: a hash of the fragment's shape key and what compiled it."""
    what = (shape_key, jax.__version__, jaxlib_version.__version__, device.platform,
            device.device_kind, getattr(device.client, "platform_version", ""))
    return hashlib.sha256(repr(what).encode("utf-8", "surrogatepass")).hexdigest()


def read(key: str, folder: str = EXECUTABLES) -> bytes | None:
    """The executable stored under ``key``, or None."""
    d = directory(folder)
    if d is None:
        return None
    try:
        data = zlib.decompress((d / key).read_bytes())
    except (OSError, zlib.error):
        return None
    with _lock:
        _counts[folder, "reads"] += 1
    return data


def write(key: str, executable: bytes, compile_seconds: float,
          folder: str = EXECUTABLES) -> None:
    """Store ``executable`` under ``key`` (atomically); failures are ignored."""
    d = directory(folder)
    _, min_seconds = jax_compat.persistent_cache_settings()
    if d is None or compile_seconds < min_seconds or jax.process_index() != 0:
        return
    tmp = None
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".entry-", dir=d)
        with os.fdopen(fd, "wb") as f:
            f.write(zlib.compress(executable, 1))
        os.replace(tmp, d / key)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return
    with _lock:
        _counts[folder, "writes"] += 1


def reads(folder: str = EXECUTABLES) -> int:
    """Entries read by this process so far (tests and benchmarks)."""
    return _counts[folder, "reads"]


def writes(folder: str = EXECUTABLES) -> int:
    """Entries written by this process so far."""
    return _counts[folder, "writes"]
