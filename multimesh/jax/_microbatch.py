"""``microbatch``: unroll a function over slices of its batch and sum the results.

Each slice is traced with the microbatch index set, so every task call inside
carries it (``mm.task = {..., microbatch = i}``); the schedule pass then orders the
resulting fragments per submesh. Unlike MultiMesh, a batch that ``size`` does not
divide is an error rather than a silently dropped remainder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax import _checks, _contexts
from multimesh.jax._task import with_sharding_constraint

__all__ = ["microbatch", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1", "custom")
_ALIASES = {"fill-drain": "gpipe", "breadth-first": "gpipe", "wavefront": "1f1b",
            "interleaved": "interleaved-1f1b"}


@contextlib.contextmanager
def _at(i: int):
    st = _contexts.state
    old = st.microbatch
    st.microbatch = i
    try:
        # Also a jax config state in the trace context, so jax's own trace caches
        # (jax.checkpoint, nested jit) trace each microbatch separately.
        with _contexts.microbatch_trace_context(i):
            yield
    finally:
        st.microbatch = old


def _canonical_custom(custom, n: int):
    rows = []
    for r, row in enumerate(custom):
        seen: dict[str, int] = {}
        out = []
        for entry in row:
            if isinstance(entry, str):
                name, mb = entry, seen.get(entry, 0)
            elif isinstance(entry, (tuple, list)) and len(entry) == 2:
                mb, name = int(entry[0]), str(entry[1])
            else:
                raise MultimeshTypeError(
                    f"custom_schedule row {r} has entry {entry!r}; entries are task names or "
                    f"(microbatch, task name) pairs.")
            seen[name] = seen.get(name, 0) + 1
            out.append((mb, name))
        for name, count in seen.items():
            if count != n:
                raise MultimeshValueError(
                    f"task {name!r} has {count} microbatches in "
                    f"custom_schedule row {r}, but there are {n} microbatches; list each task "
                    f"once per microbatch.")
        rows.append(out)
    return rows


def microbatch(fun: Callable, dim: int, size: int, argnum: int = 0,
               interleave: int | None = None, num_stages: int | None = None,
               schedule: str | None = None, unrolling: int | None = None,
               arg_shardings=None, custom_schedule: Sequence[Sequence] | None = None):
    """Unrolls ``fun`` over microbatches of argument ``argnum`` and sums the outputs.

    The argument (an array or pytree) is sliced along ``dim`` into pieces of
    ``size``; ``fun`` runs on each piece and every output leaf is summed across
    pieces, which is gradient accumulation for ``value_and_grad`` functions.
    ``schedule`` picks the pipeline order: ``"gpipe"`` (default), ``"1f1b"``,
    ``"interleaved-1f1b"``, ``"zero-bubble-h1"`` or ``"custom"`` (with
    ``custom_schedule``, one row of task names per submesh).
    """
    if not callable(fun):
        raise MultimeshTypeError(f"`microbatch` expects a callable, got {type(fun).__name__}.")
    argnum = _checks.argnum(argnum, "`microbatch`")
    if custom_schedule is not None:
        _checks.custom_schedule(custom_schedule)
    for option, value in (("size", size), ("interleave", interleave),
                          ("num_stages", num_stages)):
        if value is None and option != "size":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            shown = int(value) if isinstance(value, np.integer) else value
            raise MultimeshValueError(
                f"`microbatch` {option} must be a positive integer, got {shown!r}.")
    if custom_schedule is not None:
        if schedule not in (None, "custom"):
            raise MultimeshValueError(
                "When custom_schedule is provided, schedule must be 'custom' or None, but got "
                f"'{schedule}'.")
        schedule = "custom"
    if schedule is not None:
        schedule = _ALIASES.get(schedule, schedule)
        if schedule not in SCHEDULES:
            raise MultimeshValueError(
                f"Unknown microbatch schedule {schedule!r}; valid schedules are "
                f"{', '.join(SCHEDULES)}.")
        if schedule == "custom" and custom_schedule is None:
            raise MultimeshValueError("schedule='custom' needs a custom_schedule.")

    def wrapped(*args, **kwargs):
        if _contexts.state.ignore_transforms:
            return fun(*args, **kwargs)
        index = _checks.resolve_argnum(argnum, len(args), "`microbatch`")
        x = args[index]
        leaves = jax.tree.leaves(x)
        if not leaves:
            raise MultimeshValueError("`microbatch` argument has no array leaves to slice.")
        sizes = []
        for leaf in leaves:
            shape = np.shape(leaf)
            if not -len(shape) <= dim < len(shape):
                raise MultimeshValueError(
                    f"`microbatch` dim={dim} is out of range for a leaf of shape {shape}.")
            sizes.append(shape[dim])
        if len(set(sizes)) != 1:
            raise MultimeshValueError(
                f"`microbatch` needs every leaf of argument {argnum} to have the same size "
                f"along dim {dim}, got sizes {sizes}.")
        total = sizes[0]
        if total % size:
            raise MultimeshValueError(
                f"`microbatch` size {size} does not divide the batch: dim {dim} has size "
                f"{total}, which leaves a remainder of {total % size}. Choose a size that "
                f"divides {total}.")
        n = total // size
        if n == 1:
            return fun(*args, **kwargs)
        custom = _canonical_custom(custom_schedule, n) if custom_schedule is not None else None
        notes = _contexts.state.trace_notes
        if notes is not None:
            cfg = {"schedule": schedule or "gpipe", "num_microbatches": n,
                   "num_stages": num_stages, "interleave": interleave, "custom": custom}
            if notes.get("microbatch") not in (None, cfg):
                raise MultimeshValueError(
                    "A program may contain one microbatch loop; found a second one with a "
                    "different configuration.")
            notes["microbatch"] = cfg
        if arg_shardings is not None:
            if isinstance(arg_shardings, (PartitionSpec, NamedSharding)):
                x = jax.tree.map(lambda leaf: with_sharding_constraint(leaf, arg_shardings), x)
            else:
                x = with_sharding_constraint(x, arg_shardings)
        acc = None
        for i in range(n):
            xi = jax.tree.map(
                lambda leaf, i=i: lax.slice_in_dim(leaf, i * size, (i + 1) * size, axis=dim), x)
            call_args = list(args)
            call_args[index] = xi
            with _at(i):
                out = fun(*call_args, **kwargs)
            acc = out if acc is None else jax.tree.map(lambda a, b: a + b, acc, out)
        return acc

    wrapped.__name__ = getattr(fun, "__name__", "microbatch")
    wrapped.__wrapped__ = fun
    del unrolling
    return wrapped
