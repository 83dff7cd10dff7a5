"""The pass pipeline's result on disk, beside jax's persistent compilation cache (issue 40).

With jax's persistent cache on (``jax_compilation_cache_dir``), a restarted process
loads every fragment's executable from it, yet tracing, lowering and the pass pipeline
ran again. This cache keeps the pass pipeline's result (the MPMD module the runtime
plan is built from) in ``<jax_compilation_cache_dir>/multimesh-passes/``, so that a
later process with the same program skips the passes.

An entry's key is what jax keys its own entries with, and what the passes read: a hash
of the lowered program (its bytecode, inputs pinned), the pass pipeline (every pass's
options and the registered-task rules it holds in memory), the microbatch schedule,
the program's devices (ids, platform, kind) and default mesh, and the versions of
multimesh (its source files' hash), jax and jaxlib. A changed program or option is a
different entry (a miss). Entries are written atomically and checked when read (a
header and a hash of their contents): a damaged or unreadable entry is ignored with a
``MultimeshWarning`` and the passes run again (the entry is then rewritten).

Off unless jax's persistent cache is on with a local directory; off for programs
that call back into Python (``jax.debug.print``, ...: jax does not cache those
either), while ``MULTIMESH_DUMP_IR_TO`` dumps the passes, and with
``MULTIMESH_PIPELINE_CACHE=0``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import tempfile
import threading
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import jaxlib.version as jaxlib_version
import numpy as np
from jax.sharding import NamedSharding

from multimesh._src import jax_compat
from multimesh._src.errors import MultimeshWarning
from multimesh._src.mlir import ir, make_context, module_bytecode, parse_module
from multimesh.jax import _contexts
from multimesh.jax._registrations import active_registrations, user_level
from multimesh.jax._stages import inputs as _inputs
from multimesh.jax._stages.stage import LoweredProgram

__all__ = ["ENV", "HIT", "MISS", "OFF", "DAMAGED", "load_or_run", "counts", "directory", "trace_key",
           "read_program", "write_program", "entry_key"]

ENV = "MULTIMESH_PIPELINE_CACHE"
"""``0`` turns the cache off."""

HIT, MISS, OFF, DAMAGED = "hit", "miss", "off", "damaged"
"""What happened to a program (``MpmdCompiled.pipeline_cache``): its passes' result was
read from the cache; not there (the passes ran, the entry was written); the cache is
off; an entry was there but damaged (warned; the passes ran, the entry rewritten)."""

_MAGIC = b"MMPASSES1\n"
_counts = {HIT: 0, MISS: 0, DAMAGED: 0, "writes": 0, "pipeline_runs": 0,
           "lowering_skipped": 0, "plans_read": 0}
_lock = threading.Lock()


def counts() -> dict[str, int]:
    """This process's hits, misses, damaged entries, writes and pass-pipeline runs."""
    with _lock:
        return dict(_counts)


def _count(what: str) -> None:
    with _lock:
        _counts[what] += 1


def directory() -> Path | None:
    """Where entries live, or None when the cache is off."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return None
    if os.environ.get("MULTIMESH_DUMP_IR_TO") or not jax_compat.persistent_cache_on():
        return None
    root, _ = jax_compat.persistent_cache_settings()
    if "://" in root:  # gs://, ...: jax's own entries only
        return None
    return Path(root) / "multimesh-passes"


@functools.cache
def _source_hash() -> str:
    """A hash of multimesh's own source files: the passes that wrote an entry."""
    root = Path(__file__).resolve().parents[2]  # the multimesh package
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _pipeline_text(pipeline) -> str:
    """The pipeline's text with what its passes hold in memory (registered-task rules)."""
    parts = [str(pipeline)]
    for step in pipeline.steps:
        table = getattr(step, "rule_table", ())
        if table:  # mm-match-tasks' rules (dataclasses of names, regexes, meshes)
            parts.append(repr(_canon(table)))
    return "\n".join(parts)


def entry_key(rec: LoweredProgram) -> str:
    """The entry's name: a hash of everything the pass pipeline's result depends on."""
    program = rec.program if isinstance(rec.program, bytes) else rec.program.encode()
    what = repr((
        _pipeline_text(rec.pipeline), json.dumps(rec.schedule_config, sort_keys=True),
        [(d.id, d.platform, d.device_kind, d.process_index) for d in rec.devices],
        rec.default_mesh, _versions())).encode("utf-8", "surrogatepass")
    h = hashlib.sha256(what)
    h.update(hashlib.sha256(program).digest())
    return h.hexdigest()


def _read(path: Path) -> bytes | None:
    """The module bytecode stored at ``path``; None when there is no entry; raises
    ``ValueError`` for a damaged one."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"it cannot be read ({e})") from None
    head = len(_MAGIC) + 32
    if len(data) < head or not data.startswith(_MAGIC):
        raise ValueError(f"its header is not a multimesh pass-cache entry's ({len(data)} bytes)")
    digest, body = data[len(_MAGIC):head], data[head:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("its contents do not match their hash (truncated or changed)")
    try:
        return zlib.decompress(body)
    except zlib.error as e:
        raise ValueError(f"it cannot be decompressed ({e})") from None


def _write(path: Path, bytecode: bytes) -> None:
    """Store ``bytecode`` at ``path`` atomically; failures are ignored (no entry)."""
    if jax.process_index() != 0:
        return
    body = zlib.compress(bytecode, 1)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".entry-", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return
    _count("writes")


def _warn_damaged(what: str, label: str, path: Path, why: ValueError, instead: str) -> None:
    warnings.warn(
        f"multimesh's disk cache of {what} has a damaged entry for {label} in "
        f"{path.parent}: {why}. It is "
        f"ignored ({instead}, and the entry is rewritten). If this repeats, another "
        f"process may be writing that directory with another multimesh, or the disk is "
        f"failing; deleting the directory is safe.", MultimeshWarning,
        stacklevel=user_level())


def _key_of(rec: LoweredProgram) -> str | None:
    """``rec``'s entry name, or None when it is not cached."""
    if directory() is None or rec.host_callbacks:
        return None
    try:
        return entry_key(rec)
    except ValueError:  # a pass holds something with no stable form: not cached
        return None


def write_plan(rec: LoweredProgram, plan) -> None:
    """Store the runtime plan built from ``rec``'s pass result (beside that entry)."""
    key, d = _key_of(rec), directory()
    if key is None or d is None or not (d / key).exists():
        return
    try:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - a plan that does not pickle: built each time
        return
    _write(d / f"{key}.plan", data)


def _read_plan(path: Path):
    """The plan stored at ``path``, or None (missing or damaged: it is rebuilt)."""
    try:
        data = _read(path)
        plan = None if data is None else pickle.loads(data)
    except Exception:  # noqa: BLE001 - anything unreadable: the plan is rebuilt
        return None
    if plan is not None:
        _count("plans_read")
    return plan


def load_or_run(rec: LoweredProgram, run: Callable[[], tuple[ir.Module, list]]
                ) -> tuple[ir.Module, list, str, object]:
    """The pass pipeline's result for ``rec``: ``(module, pass timings, what happened,
    the runtime plan or None)``.

    ``run()`` runs the passes (returning the module and their timings); it is called
    unless the cache holds a sound entry for ``rec``, which is then written. The plan
    is the one stored beside a hit (:func:`write_plan`), if any."""
    key, d = _key_of(rec), directory()
    if d is None or key is None:
        _count("pipeline_runs")
        module, timings = run()
        return module, timings, OFF, None
    path = d / key
    status = MISS
    try:
        data = _read(path)
        if data is not None:
            module = parse_module(data, make_context())
            _count(HIT)
            return module, [], HIT, _read_plan(d / f"{key}.plan")
    except ValueError as e:
        status = DAMAGED
        _warn_damaged("the pass pipeline's results", rec.label, path, e,
                      "the passes run again")
    _count(status)
    _count("pipeline_runs")
    module, timings = run()
    _write(path, module_bytecode(module))
    return module, timings, status, None


# --------------------------------------------------------------------------- the trace key
# A hit of the key below skips jax's lowering too: the entry holds the lowered program
# (inputs pinned), whose own key then finds the passes' result above.


def _canon(obj, depth: int = 0):
    """A process-independent form of ``obj`` (sets sorted, shardings by device ids); an
    object printed by address raises ``ValueError`` (no key: not cached)."""
    if depth > 20:
        raise ValueError("too deep")
    if isinstance(obj, jax.sharding.Sharding):
        return _canon_sharding(obj)
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted(repr(_canon(x, depth + 1)) for x in obj))
    if isinstance(obj, dict):
        return ("dict", sorted((repr(_canon(k, depth + 1)), _canon(v, depth + 1))
                               for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return [_canon(x, depth + 1) for x in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, [(f.name, _canon(getattr(obj, f.name), depth + 1))
                                     for f in dataclasses.fields(obj)])
    text = repr(obj)
    if " at 0x" not in text:
        return text
    fields = getattr(obj, "__dict__", None)  # jax's AxisEnv in its trace context, ...
    if fields is None and hasattr(type(obj), "__slots__"):
        fields = {k: getattr(obj, k) for k in type(obj).__slots__
                  if not k.startswith("__") and hasattr(obj, k)}
    if fields is None:
        raise ValueError(f"{type(obj).__name__} has no stable form")
    return (type(obj).__qualname__, _canon(fields, depth + 1))


def _canon_sharding(obj: jax.sharding.Sharding) -> tuple:
    """A sharding by its devices' ids (``NamedSharding``'s repr leaves them out)."""
    if isinstance(obj, NamedSharding):
        m = obj.mesh
        return ("NamedSharding", tuple(int(i) for i in m.device_ids.flat),
                tuple(m.axis_names), tuple(m.devices.shape), repr(tuple(m.axis_types)),
                repr(obj.spec), obj.memory_kind)
    return (type(obj).__name__, sorted(getattr(d, "id", -1) for d in obj.device_set),
            repr(obj))


def trace_key(traced) -> str | None:
    """The key of ``traced``'s lowered program from its trace alone (None: not cached).

    Everything the lowering and the input pinning read: the jaxpr as jax prints it
    (with its effects; not its source lines: the stored program keeps the locations of
    the process that wrote it), its constants' bytes, the
    argument and output trees, the donations, the program's devices and mesh, the
    ``in_shardings`` and committed inputs' shardings, what tracing noted, ``mjit``'s
    switches and jax's trace context, and the versions. Programs with registered
    tasks (their rules read the lowered program) are keyed by the lowered program only.
    """
    if directory() is None or active_registrations() or _contexts.state.ignore_transforms:
        return None
    jaxpr = traced._traced.jaxpr
    text = jaxpr.pretty_print(print_effects=True)  # jax's own printing (~1/5 of lowering)
    if " at 0x" in text:  # a parameter printed by address: no stable key
        return None
    owner, devices = traced._owner, traced._devices
    mesh = owner.program_mesh(devices)
    dyn_flat = jax.tree.leaves(traced._dyn)
    try:
        parts = _canon((
            str(jax.tree.structure(traced._dyn)), str(traced._traced.out_tree),
            list(traced._donated), [(d.id, d.platform, d.device_kind, d.process_index)
                                    for d in devices],
            None if mesh is None else (tuple(mesh.axis_names), tuple(mesh.devices.shape),
                                       tuple(int(i) for i in mesh.device_ids.flat)),
            traced._in_shardings, _inputs.committed_key(dyn_flat), owner.pin_committed,
            traced._notes, _contexts.compile_state(), _versions()))
    except ValueError:
        return None
    h = hashlib.sha256(text.encode("utf-8", "surrogatepass"))
    h.update(repr(parts).encode("utf-8", "surrogatepass"))
    for c in jaxpr.consts:
        h.update(repr((getattr(c, "shape", ()), str(getattr(c, "dtype", type(c))))).encode())
        h.update(np.asarray(c).tobytes())
    return "trace-" + h.hexdigest()


def _versions() -> tuple:
    """multimesh by its source (a hash of its files: an edit is a new version), jax, jaxlib."""
    return (_source_hash(), jax.__version__, jaxlib_version.__version__)


def read_program(key: str | None, label: str) -> bytes | None:
    """The lowered program stored under the trace ``key``, or None (a damaged entry
    warns, naming the program ``label``, and is ignored)."""
    d = directory()
    if key is None or d is None:
        return None
    try:
        data = _read(d / key)
    except ValueError as e:
        _warn_damaged("lowered programs", label, d / key, e, "the program is lowered again")
        return None
    if data is not None:
        _count("lowering_skipped")
    return data


def write_program(key: str | None, program: bytes) -> None:
    """Store the lowered ``program`` under the trace ``key``."""
    d = directory()
    if key is not None and d is not None:
        _write(d / key, program)
