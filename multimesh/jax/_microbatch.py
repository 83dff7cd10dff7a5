"""``microbatch``: one traced microbatch, repeated by the runtime, outputs reduced.

``fun`` is traced once, on one microbatch: the traced body takes the microbatch
index and slices its microbatch out of the full batch itself. The body becomes
the ``mm_microbatch`` primitive (``_primitives.py``); under ``mjit`` the passes
turn it into a loop whose fragments the runtime plan calls once per microbatch,
in the order of the pipeline schedule. So the program, the pass pipeline and the
compiled fragments are the same size for 2 microbatches or 64. Unlike MultiMesh,
a batch that ``size`` does not divide is an error rather than a silently dropped
remainder, and ``reduction="mean"`` averages the outputs instead of summing them: each
microbatch's output is divided by the number of microbatches inside the loop, by the
fragment that makes it, so the fragments stay the same as for a sum.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.api_util import debug_info, shaped_abstractify
from jax.core import ShapedArray, Tracer
from jax.extend import linear_util as lu
from jax.extend.core import ClosedJaxpr, Literal
from jax.interpreters import partial_eval as pe
from jax.sharding import NamedSharding, PartitionSpec

from multimesh._src import jax_compat
from multimesh._src.errors import (
    MultimeshError,
    MultimeshTypeError,
    MultimeshValueError,
    MultimeshWarning,
    user_stacklevel,
)
from multimesh.jax import _checks, _contexts
from multimesh.jax._primitives import bind_microbatch
from multimesh.jax._registrations import active_registrations
from multimesh.jax._task import check_remat, with_sharding_constraint
from multimesh.jax._trace_notes import MicrobatchNote
from multimesh.schedules import (
    SCHEDULES,
    ScheduleError,
    alias_list,
    canonical_schedule_name,
    canonicalize_custom_schedule,
    check_custom_rows,
    describe_schedules,
    get_schedule,
    pipeline_units,
    v_shape_units,
)
from multimesh.schedules.simulator import Program

__all__ = ["microbatch", "SCHEDULES", "REDUCTIONS"]

REDUCTIONS = ("sum", "mean")
"""How ``microbatch`` combines the microbatches' outputs (as ``parallelize_step``'s
``microbatch_reduction``)."""


def _check_positive(option: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        shown = int(value) if isinstance(value, np.integer) else value
        raise MultimeshValueError(
            f"`microbatch` {option} must be a positive integer, got {shown!r}.")


def _schedule_name(schedule, custom_schedule) -> str | None:
    """The canonical schedule name (or None for the default), checked early."""
    if schedule is None and custom_schedule is None:
        return None
    if schedule is not None and not isinstance(schedule, str):
        raise MultimeshTypeError(
            f"`microbatch` schedule must be a string, got {type(schedule).__name__} "
            f"{schedule!r}.")
    try:
        name = canonical_schedule_name(schedule, custom_schedule)
    except ScheduleError:
        if schedule is not None and custom_schedule is None:
            aliases = alias_list()
            raise MultimeshValueError(
                f"Unknown microbatch schedule {schedule!r}; valid schedules are "
                f"{', '.join(SCHEDULES)} (aliases: {aliases}).") from None
        raise  # a schedule with custom rows: the library's own sentence
    if name == "custom" and custom_schedule is None:
        raise MultimeshValueError("schedule='custom' needs a custom_schedule.")
    return name


def microbatch(fun: Callable, dim: int, size: int, argnum: int = 0,
               interleave: int | None = None, num_stages: int | None = None,
               schedule: str | None = None, unrolling: int | None = None,
               arg_shardings=None, custom_schedule: Sequence[Sequence] | None = None,
               reduction: str = "sum", remat=None):
    """Runs ``fun`` on microbatches of argument ``argnum`` and sums (or averages) the outputs.

    The argument (an array or pytree) is cut along ``dim`` into pieces of
    ``size``; ``fun`` runs on each piece and every output leaf is summed across
    pieces (``reduction="sum"``, the default, as in MultiMesh), which is gradient
    accumulation for ``value_and_grad`` functions, or averaged
    (``reduction="mean"``: the full batch's loss and gradients for a loss that
    averages over its batch). Integer outputs are summed in their own dtype (and
    cannot be averaged); ``bool`` outputs are or-ed (true if any microbatch's is).
    ``fun`` is traced once; the pipeline schedule decides in which order each
    task's fragment runs for each microbatch: ``"gpipe"`` (default) or any registered
    schedule, listed below from the registry (those with a placement rule check the
    tasks' stage placement, docs/schedules.md), ``"custom"`` with
    ``custom_schedule``, one row of task names per submesh. ``unrolling=k`` (GPipe only) runs the microbatches
    in groups of ``k``, fill-drain within each group, so at most ``k``
    microbatches' activations are alive at once. ``remat=True`` (or a jax
    checkpoint policy) is the default ``remat`` of every task traced in the loop
    (see :class:`Task`): each stage's backward recomputes its forward.
    """
    argnum, name = _check_options(fun, dim, size, argnum, interleave, num_stages, unrolling,
                                  schedule, custom_schedule)
    check_reduction(reduction)
    remat = check_remat(remat, "`microbatch`")

    def wrapped(*args, **kwargs):
        if _contexts.state.ignore_transforms:
            return fun(*args, **kwargs)
        # the tasks' default while fun is traced (an inner microbatch inherits it);
        # registered tasks read it from the notes when they are matched
        notes = _contexts.state.trace_notes
        if notes is not None and remat is not None:
            notes.remat = remat
        token = _contexts.push("remat", _contexts.state.remat if remat is None else remat)
        try:
            return run(*args, **kwargs)
        finally:
            _contexts.pop(token)

    def run(*args, **kwargs):
        index = _checks.resolve_argnum(argnum, len(args), "`microbatch`")
        n = _num_microbatches(args[index], dim, size, argnum)
        if n == 1:
            if name is not None or unrolling is not None:
                warnings.warn(
                    f"`microbatch` got a batch of exactly one microbatch (size {size}), so it "
                    f"calls the function once and the schedule {name or 'gpipe'!r} has nothing "
                    f"to order.", MultimeshWarning, stacklevel=user_stacklevel())
            out = fun(*args, **kwargs)
            _check_output_dtypes(out, reduction)
            return out
        custom = (canonicalize_custom_schedule(custom_schedule, n)
                  if custom_schedule is not None else None)
        _note_loop(name, n, num_stages, interleave, unrolling, custom)
        _check_count(name, n, num_stages, interleave)
        x = _constrain_argument(args[index], arg_shardings)
        return _run(fun, args, kwargs, index, x, (dim, size, n), reduction)

    wrapped.__name__ = getattr(fun, "__name__", "microbatch")
    functools.update_wrapper(wrapped, fun, assigned=(), updated=())  # __wrapped__ only
    return wrapped


if microbatch.__doc__:  # the schedules, from the registry (not written here: issue 32)
    microbatch.__doc__ += ("\n    Schedules:\n\n"
                           + describe_schedules("    - ") + "\n")


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
        check_custom_rows(custom_schedule)  # the form; the rest needs n, then the program
    name = _schedule_name(schedule, custom_schedule)
    if unrolling is not None and name is not None and not get_schedule(name).takes_unrolling:
        raise MultimeshValueError(
            f"`microbatch` unrolling={unrolling} applies to the GPipe schedule only (it bounds "
            f"how many microbatches fill the pipeline before they drain), but the schedule is "
            f"{name!r}. Drop `unrolling`, or use schedule='gpipe'.")
    return argnum, name


def check_reduction(reduction, who: str = "`microbatch`") -> None:
    """``reduction`` is one of :data:`REDUCTIONS` (``who`` names the caller: ``microbatch``,
    ``plan_pipeline``)."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise MultimeshValueError(
            f"{who} reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got "
            f"{reduction!r}: 'sum' adds the microbatches' outputs (gradient accumulation), "
            f"'mean' averages them (the full batch's mean loss and its gradients).")


def _check_output_dtypes(out, reduction: str) -> None:
    """Integers have no mean in their own dtype: refuse rather than round."""
    if reduction != "mean":
        return
    paths = jax.tree_util.tree_flatten_with_path(out)[0]
    for path, leaf in paths:
        dtype = jnp.result_type(leaf)
        if jnp.issubdtype(dtype, jnp.integer):
            where = jax.tree_util.keystr(path) or "the output"
            raise MultimeshTypeError(
                f"`microbatch` reduction='mean' cannot average the integer output {where} "
                f"(dtype {dtype}): the mean of integers is not an integer. Return it as a "
                f"float (`x.astype(jnp.float32)`), or use reduction='sum' and divide it "
                f"yourself.")


def _scale(leaf, inputs, n: int):
    """One microbatch's share of a mean: a computed inexact value divided by ``n``.

    Inputs and constants are left alone (they are passed through the loop, not summed);
    so are bools, which are or-ed under either reduction."""
    if not isinstance(leaf, Tracer) or any(leaf is v for v in inputs):
        return leaf
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return leaf
    return leaf / n


def _constrain_argument(x, arg_shardings):
    """The microbatched argument under ``arg_shardings`` (one spec or sharding for every
    leaf, or a pytree of them)."""
    if arg_shardings is None:
        return x
    if isinstance(arg_shardings, (PartitionSpec, NamedSharding)):
        return jax.tree.map(lambda leaf: with_sharding_constraint(leaf, arg_shardings), x)
    return with_sharding_constraint(x, arg_shardings)


def _not_the_batch(argnum: int) -> str:
    return (f" Is argument {argnum} the batch? `argnum` names the argument to cut; if the "
            f"batch is another argument, pass its position as `argnum`.")


def _num_microbatches(x, dim: int, size: int, argnum: int) -> int:
    leaves = jax.tree_util.tree_flatten_with_path(x)[0]
    if not leaves:
        raise MultimeshValueError(
            f"`microbatch` argument {argnum} has no array leaves to slice.{_not_the_batch(argnum)}")
    sizes = []
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not -len(shape) <= dim < len(shape):
            raise MultimeshValueError(
                f"`microbatch` dim={dim} is out of range for a leaf of shape {shape} "
                f"(argument {argnum}{jax.tree_util.keystr(path)}).{_not_the_batch(argnum)}")
        sizes.append(shape[dim])
    if len(set(sizes)) != 1:
        raise MultimeshValueError(
            f"`microbatch` needs every leaf of argument {argnum} to have the same size "
            f"along dim {dim}, got sizes {sizes}.{_not_the_batch(argnum)}")
    total = sizes[0]
    if total == 0:
        raise MultimeshValueError(
            f"`microbatch` got an empty batch: argument {argnum} has size 0 along dim {dim}, "
            f"so there is no microbatch to run. Pass a batch whose dim {dim} is a positive "
            f"multiple of size={size}.")
    if total % size:
        raise MultimeshValueError(
            f"`microbatch` size {size} does not divide the batch: dim {dim} has size "
            f"{total}, which leaves a remainder of {total % size}. Choose a size that "
            f"divides {total}.{_not_the_batch(argnum)}")
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
    cfg = MicrobatchNote(name or "gpipe", n, num_stages, interleave, unrolling, custom,
                         requested=name is not None)
    if notes.microbatch is not None:
        raise MultimeshValueError(
            "A program may contain one microbatch loop, but this one calls a second "
            "`microbatch` function. Microbatch one function that does all of the work.")
    notes.microbatch = cfg


def _check_count(name, n: int, num_stages, interleave) -> None:
    """Refuse, before ``fun`` is traced, a number of microbatches the schedule accepts
    on no pipeline the program's devices allow (``num_stages``: that one)."""
    if name is None or name == "custom" or _contexts.state.trace_notes is None:
        return
    algo = get_schedule(name)
    V = interleave or algo.interleave
    devices = len(_contexts.state.program_devices or ()) or jax.device_count()
    sizes = ([num_stages // V] if num_stages and num_stages % V == 0
             else range(2, max(2, devices) + 1))
    errors = []
    for P in sizes:
        units = (v_shape_units(P, n, split_backward=algo.splits_backward)
                 if algo.placement == "v-shape"
                 else pipeline_units(P, n, interleave=V, split_backward=algo.splits_backward))
        try:
            algo.check(Program(units))
            return
        except ScheduleError as e:
            errors.append(str(e))
    if errors:
        raise ScheduleError(
            f"`microbatch` got {n} microbatch(es) for schedule {algo.name!r}, which it "
            f"accepts on no pipeline of {'num_stages=' + str(num_stages) if num_stages else f'2 to {max(2, devices)} submeshes'}"
            f" (checked before tracing): {errors[0]}")


def _task_submeshes(jaxpr, found: set) -> set:
    """The device positions of every task call in ``jaxpr`` (and the jaxprs it holds)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "mm_task":
            found.add(tuple(eqn.params["info"].devices))
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _task_submeshes(inner, found)
    return found


def _check_traced_count(traced, n: int) -> None:
    """Refuse, once the body is traced and before any pass runs, a number of
    microbatches the schedule does not accept on the pipeline the body's task calls
    make (one submesh per device set). Only where every task is a call in the body:
    registered tasks add submeshes that only the compiled program shows."""
    note = _contexts.state.trace_notes
    cfg = note.microbatch if note is not None else None
    name = getattr(cfg, "schedule", None)
    if name is None or name == "custom" or active_registrations():
        return
    meshes = [set(m) for m in _task_submeshes(traced, set())]
    P = len(meshes)
    if P < 2 or sum(map(len, meshes)) != len(set().union(*meshes)):
        return  # overlapping submeshes: the pass alone knows the pipeline
    algo = get_schedule(name)
    V = getattr(cfg, "interleave", None) or algo.interleave
    units = (v_shape_units(P, n, split_backward=algo.splits_backward)
             if algo.placement == "v-shape"
             else pipeline_units(P, n, interleave=V, split_backward=algo.splits_backward))
    try:
        algo.check(Program(units))
    except ScheduleError as e:
        raise ScheduleError(
            f"`microbatch` got {n} microbatch(es) for schedule {algo.name!r}, and the "
            f"traced step's tasks make a pipeline of {P} submeshes (checked before "
            f"compiling): {e}") from None


def _is_operand(x) -> bool:
    return isinstance(x, (Tracer, jax.Array, np.ndarray, np.generic))


def _run(fun, args, kwargs, argnum, x, cut, reduction):
    """Trace ``fun`` once on microbatch ``i`` (a traced index) and bind the loop.

    ``cut`` is ``(dim, size, number of microbatches)``."""
    dim, size, n = cut
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
        _check_output_dtypes(out, reduction)
        flat_out, tree = jax.tree.flatten(out)
        out_tree_cell.append(tree)
        if reduction == "mean":
            flat_out = [_scale(v, (i, *flat), n) for v in flat_out]
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
    except MultimeshError:
        raise
    except Exception as e:
        _blame_the_cut(fun, args, kwargs, argnum, cut, e)
        raise
    finally:
        st.microbatch_loop = old
    _check_traced_count(traced, n)
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
        outs[k] = _repeated(v, n, reduction)
    return jax.tree.unflatten(out_tree, outs)


def _repeated(v, n: int, reduction: str):
    """The reduction of ``n`` copies of ``v``: ``v`` itself for a mean or a bool (or),
    ``n * v`` in ``v``'s dtype for a sum."""
    v = jnp.asarray(v)
    if reduction == "mean" or v.dtype == np.bool_:
        return v
    if jnp.issubdtype(v.dtype, jnp.integer) and v.dtype.itemsize < 8:
        return (v.astype(np.int32) * n).astype(v.dtype)  # wraps like n additions would
    return v * n


def _blame_the_cut(fun, args, kwargs, argnum: int, cut, error: Exception) -> None:
    """``fun`` failed on one microbatch: if it traces on the whole batch, cutting argument
    ``argnum`` broke it (``argnum`` names the parameters, say), so say that."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    dyn = [k for k, leaf in enumerate(leaves) if _is_operand(leaf)]

    def whole(*vals):
        new = list(leaves)
        for k, v in zip(dyn, vals):
            new[k] = v
        a, kw = jax.tree.unflatten(tree, new)
        return fun(*a, **kw)

    try:
        with _contexts.ignore_transforms():
            jax.eval_shape(whole, *[jax.ShapeDtypeStruct(np.shape(leaves[k]),
                                                         jnp.result_type(leaves[k]))
                                    for k in dyn])
    except Exception:
        return  # it fails on the whole batch too: not the cut's doing
    dim, size, n = cut
    shapes = [np.shape(v) for v in jax.tree.leaves(args[argnum])]
    raise MultimeshValueError(
        f"`microbatch`'s function runs on the whole of argument {argnum} but fails on one "
        f"microbatch of it: argument {argnum} (leaf shapes {shapes}) is cut along dim {dim} "
        f"into {n} microbatches of {size}, and then {type(error).__name__}: {error}"
        f"{_not_the_batch(argnum)}") from error


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
