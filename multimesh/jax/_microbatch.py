"""``microbatch``: one traced microbatch, repeated by the runtime, outputs summed.

``fun`` is traced once, on one microbatch: the traced body takes the microbatch
index and slices its microbatch out of the full batch itself. The body becomes
the ``mm_microbatch`` primitive (``_primitives.py``); under ``mjit`` the passes
turn it into a loop whose fragments the runtime plan calls once per microbatch,
in the order of the pipeline schedule. So the program, the pass pipeline and the
compiled fragments are the same size for 2 microbatches or 64. Unlike MultiMesh,
a batch that ``size`` does not divide is an error rather than a silently dropped
remainder.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax import lax
from jax.api_util import debug_info, shaped_abstractify
from jax.core import ShapedArray, Tracer
from jax.extend import linear_util as lu
from jax.extend.core import ClosedJaxpr, Literal
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec

from multimesh._src import jax_compat
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError, MultimeshWarning
from multimesh.jax import _checks, _contexts
from multimesh.jax._primitives import bind_microbatch
from multimesh.jax._task import with_sharding_constraint
from multimesh.passes.schedules import (
    ALIASES,
    SCHEDULES,
    ScheduleError,
    canonical_schedule_name,
    canonicalize_custom_schedule,
)

__all__ = ["microbatch", "SCHEDULES"]


def _check_positive(option: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        shown = int(value) if isinstance(value, np.integer) else value
        raise MultimeshValueError(
            f"`microbatch` {option} must be a positive integer, got {shown!r}.")


def _schedule_name(schedule, custom_schedule) -> str | None:
    """The canonical schedule name (or None for the default), checked early."""
    if custom_schedule is not None:
        if isinstance(custom_schedule, (str, bytes)) or not all(
                isinstance(row, Sequence) and not isinstance(row, (str, bytes))
                for row in custom_schedule):
            raise MultimeshTypeError(
                f"`microbatch` custom_schedule must be a list of rows (one per submesh), each "
                f"a list of task names or (microbatch, task name) pairs, got "
                f"{custom_schedule!r}.")
    if schedule is None and custom_schedule is None:
        return None
    if schedule is not None and not isinstance(schedule, str):
        raise MultimeshTypeError(
            f"`microbatch` schedule must be a string, got {type(schedule).__name__} "
            f"{schedule!r}.")
    try:
        name = canonical_schedule_name(schedule, custom_schedule)
    except ScheduleError as e:
        if schedule is not None and custom_schedule is None:
            aliases = ", ".join(f"{a} = {t}" for a, t in sorted(ALIASES.items()))
            raise MultimeshValueError(
                f"Unknown microbatch schedule {schedule!r}; valid schedules are "
                f"{', '.join(SCHEDULES)} (aliases: {aliases}).") from None
        raise MultimeshValueError(f"{e}.") from None
    if name == "custom" and custom_schedule is None:
        raise MultimeshValueError("schedule='custom' needs a custom_schedule.")
    return name


def microbatch(fun: Callable, dim: int, size: int, argnum: int = 0,
               interleave: int | None = None, num_stages: int | None = None,
               schedule: str | None = None, unrolling: int | None = None,
               arg_shardings=None, custom_schedule: Sequence[Sequence] | None = None):
    """Runs ``fun`` on microbatches of argument ``argnum`` and sums the outputs.

    The argument (an array or pytree) is cut along ``dim`` into pieces of
    ``size``; ``fun`` runs on each piece and every output leaf is summed across
    pieces, which is gradient accumulation for ``value_and_grad`` functions.
    ``fun`` is traced once; the pipeline schedule decides in which order each
    task's fragment runs for each microbatch: ``"gpipe"`` (default),
    ``"1f1b"``, ``"interleaved-1f1b"``, ``"zero-bubble-h1"``,
    ``"zero-bubble-h2"`` or ``"custom"`` (with ``custom_schedule``, one row of
    task names per submesh). ``unrolling=k`` (GPipe only) runs the microbatches
    in groups of ``k``, fill-drain within each group, so at most ``k``
    microbatches' activations are alive at once.
    """
    argnum, name = _check_options(fun, dim, size, argnum, interleave, num_stages, unrolling,
                                  schedule, custom_schedule)

    def wrapped(*args, **kwargs):
        if _contexts.state.ignore_transforms:
            return fun(*args, **kwargs)
        index = _checks.resolve_argnum(argnum, len(args), "`microbatch`")
        n = _num_microbatches(args[index], dim, size, argnum)
        if n == 1:
            if name is not None or unrolling is not None:
                warnings.warn(
                    f"`microbatch` got a batch of exactly one microbatch (size {size}), so it "
                    f"calls the function once and the schedule {name or 'gpipe'!r} has nothing "
                    f"to order.", MultimeshWarning, stacklevel=2)
            return fun(*args, **kwargs)
        custom = (canonicalize_custom(custom_schedule, n)
                  if custom_schedule is not None else None)
        _note_loop(name, n, num_stages, interleave, unrolling, custom)
        x = _constrain_argument(args[index], arg_shardings)
        return _run(fun, args, kwargs, index, x, dim, size, n)

    wrapped.__name__ = getattr(fun, "__name__", "microbatch")
    functools.update_wrapper(wrapped, fun, assigned=(), updated=())  # __wrapped__ only
    return wrapped


def _check_options(fun, dim, size, argnum, interleave, num_stages, unrolling, schedule,
                   custom_schedule) -> tuple[int, str | None]:
    """``microbatch``'s arguments checked when it is called, not when the function runs;
    the normalised ``argnum`` and the schedule's canonical name (None: not given)."""
    if not callable(fun):
        raise MultimeshTypeError(f"`microbatch` expects a callable, got {type(fun).__name__}.")
    _check_positive("size", size)
    for option, value in (("interleave", interleave), ("num_stages", num_stages),
                          ("unrolling", unrolling)):
        if value is not None:
            _check_positive(option, value)
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise MultimeshTypeError(f"`microbatch` dim must be an integer, got {dim!r}.")
    argnum = _checks.argnum(argnum, "`microbatch`")
    if custom_schedule is not None:
        _checks.custom_schedule(custom_schedule)
    name = _schedule_name(schedule, custom_schedule)
    if unrolling is not None and name not in (None, "gpipe"):
        raise MultimeshValueError(
            f"`microbatch` unrolling={unrolling} applies to the GPipe schedule only (it bounds "
            f"how many microbatches fill the pipeline before they drain), but the schedule is "
            f"{name!r}. Drop `unrolling`, or use schedule='gpipe'.")
    return argnum, name


def _constrain_argument(x, arg_shardings):
    """The microbatched argument under ``arg_shardings`` (one spec or sharding for every
    leaf, or a pytree of them)."""
    if arg_shardings is None:
        return x
    if isinstance(arg_shardings, (PartitionSpec, NamedSharding)):
        return jax.tree.map(lambda leaf: with_sharding_constraint(leaf, arg_shardings), x)
    return with_sharding_constraint(x, arg_shardings)


def canonicalize_custom(custom_schedule, n: int):
    """The rows as ``(microbatch, name)`` pairs for ``n`` microbatches. Their form was
    checked by ``microbatch`` itself (``_checks.custom_schedule``); here what needs
    ``n`` (microbatch range, repeats), and the pass checks the names against the
    program."""
    rows = [[e if isinstance(e, str) else (int(e[0]), e[1]) for e in row]
            for row in custom_schedule]
    try:
        return canonicalize_custom_schedule(rows, n)
    except ScheduleError as e:
        raise MultimeshValueError(f"{e}.") from None


def _num_microbatches(x, dim: int, size: int, argnum: int) -> int:
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
    return total // size


def _note_loop(name, n, num_stages, interleave, unrolling, custom) -> None:
    """Record the loop's schedule for ``mjit`` (one loop per program)."""
    st = _contexts.state
    if st.microbatch_loop is not None:
        raise MultimeshValueError(
            "`microbatch` was called inside another `microbatch` function; nested microbatch "
            "loops are not supported. Microbatch the outer function only.")
    notes = st.trace_notes
    if notes is None:
        return
    cfg = {"schedule": name or "gpipe", "num_microbatches": n, "num_stages": num_stages,
           "interleave": interleave, "unrolling": unrolling, "custom": custom,
           "requested": name is not None}
    if notes.get("microbatch") is not None:
        raise MultimeshValueError(
            "A program may contain one microbatch loop, but this one calls a second "
            "`microbatch` function. Microbatch one function that does all of the work.")
    notes["microbatch"] = cfg


def _is_operand(x) -> bool:
    return isinstance(x, (Tracer, jax.Array, np.ndarray, np.generic))


def _run(fun, args, kwargs, argnum, x, dim, size, n):
    """Trace ``fun`` once on microbatch ``i`` (a traced index) and bind the loop."""
    x_leaves, x_tree = jax.tree.flatten(x)
    rest = (tuple(a for k, a in enumerate(args) if k != argnum), kwargs)
    rest_leaves, rest_tree = jax.tree.flatten(rest)
    dyn = [k for k, leaf in enumerate(rest_leaves) if _is_operand(leaf)]
    operands = list(x_leaves) + [rest_leaves[k] for k in dyn]
    out_tree_cell = []

    def body(i, *flat):
        xs_full, dyn_vals = flat[:len(x_leaves)], flat[len(x_leaves):]
        xs = [lax.dynamic_slice_in_dim(leaf, i * size, size, axis=dim, allow_negative_indices=False)
              for leaf in xs_full]
        leaves = list(rest_leaves)
        for k, v in zip(dyn, dyn_vals):
            leaves[k] = v
        others, kw = jax.tree.unflatten(rest_tree, leaves)
        call = list(others)
        call.insert(argnum, jax.tree.unflatten(x_tree, xs))
        out = fun(*call, **kw)
        flat_out, tree = jax.tree.flatten(out)
        out_tree_cell.append(tree)
        return flat_out

    in_avals = [ShapedArray((), np.dtype(np.int32))] + [
        shaped_abstractify(v) for v in operands]
    dbg = debug_info("multimesh.microbatch", fun, args, kwargs)
    st = _contexts.state
    old = st.microbatch_loop
    st.microbatch_loop = n
    try:
        with _contexts.autoshard(True):
            traced, _, consts = pe.trace_to_jaxpr_dynamic(
                lu.wrap_init(body, debug_info=dbg.with_unknown_names()), in_avals)
    finally:
        st.microbatch_loop = old
    out_tree = out_tree_cell[-1]
    # The body as a jaxpr over (*consts, i, *operands).
    jaxpr, consts = jax_compat.separate_consts(ClosedJaxpr(traced, consts))
    jaxpr, nc = jaxpr.jaxpr, len(consts)
    through = _passed_through(jaxpr, consts, operands)
    keep = [k not in through for k in range(len(jaxpr.outvars))]
    outs: list = [None] * len(jaxpr.outvars)
    if any(keep):
        body_jaxpr, _ = pe.dce_jaxpr(jaxpr, keep, instantiate=True)
        closed = ClosedJaxpr(body_jaxpr, ())
        results = iter(bind_microbatch(closed, nc, [*consts, *operands], n))
        for k in range(len(outs)):
            if keep[k]:
                outs[k] = next(results)
    for k, v in through.items():
        outs[k] = jax.numpy.asarray(v) * n
    return jax.tree.unflatten(out_tree, outs)


def _passed_through(jaxpr, consts, operands) -> dict[int, object]:
    """Output position -> value, for the outputs of the loop body (a jaxpr over
    ``(*consts, i, *operands)``) that are just an input or a constant: they need no
    loop, only ``n`` copies of the value."""
    nc = len(consts)
    invars = {v: k for k, v in enumerate(jaxpr.invars)}
    through: dict[int, object] = {}
    for k, v in enumerate(jaxpr.outvars):
        if isinstance(v, Literal):
            through[k] = v.val
        elif invars.get(v, nc) < nc:
            through[k] = consts[invars[v]]
        elif invars.get(v, nc) > nc:  # an input other than the index
            through[k] = operands[invars[v] - nc - 1]
    return through
