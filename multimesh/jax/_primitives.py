"""The two markers the front end puts into a traced program.

``mm_task`` is a call-primitive (modelled on jax's own ``compute_on_p``): it
carries the task body as a closed jaxpr plus a hashable :class:`TaskInfo`
(name, transpose count, mesh, logical mapping). Its transpose rule binds with
``transpose_count + 1``, which is how the backward of a task is told apart from
its forward in the IR. ``mm_logical_sharding`` is an identity whose transpose is
itself: it records logical axis names for the passes to resolve per task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import types
import warnings
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import ClosedJaxpr, Primitive, jaxpr_as_fun, new_jaxpr_eqn
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from multimesh._src import jax_compat
from multimesh._src.errors import MeshError, MultimeshWarning, user_stacklevel
from multimesh._src.ir_contract import (
    AXES_ATTR,
    INDEX_TARGET,
    LOGICAL_TARGET,
    LOOP_ATTR,
    MICROBATCH_ATTR,
    SUM_TARGET,
    TASK_ATTR,
    MeshRecord,
)
from multimesh._src.mlir import ir, py_to_attr
from multimesh._src.mlir import stablehlo as hlo
from multimesh.jax import _contexts

__all__ = ["TaskInfo", "task_p", "logical_sharding_p", "bind_task", "bind_logical", "body_scope",
           "warn_unplaced"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskInfo(MeshRecord):
    """One task call: its name and transpose count beside its :class:`MeshRecord`
    (hashable, a primitive parameter)."""

    name: str
    transpose_count: int = 0
    unplaced_ok: bool = False
    """Bound by multimesh's own trace outside ``mjit`` (a Flax init): jax may lower it
    later, unplaced, on purpose (see :func:`warn_unplaced`). Not part of the IR."""
    body_mesh: jax.sharding.Mesh | None = None
    """The mesh the body was traced under (the task's own; None: the program's). Every
    rule that retraces the body, and its lowering, runs under it. Not part of the IR."""

    def bumped(self) -> TaskInfo:
        return dataclasses.replace(self, transpose_count=self.transpose_count + 1)

    def mesh(self) -> MeshRecord:
        """The task's mesh alone, as plain tuples (an ``mm.tasks`` entry)."""
        split = self.split_backprop
        return MeshRecord(tuple(int(d) for d in self.devices), tuple(self.axis_names),
                        tuple(int(s) for s in self.axis_sizes),
                        tuple((a, b) for a, b in self.logical_axes),
                        (split[0], split[1]) if split else None,
                        tuple(tuple(int(d) for d in r) for r in self.loop_devices)
                        if self.loop_devices else None)

    def attribute(self) -> ir.Attribute:
        """The call's ``mm.task``: the tag and the mesh."""
        return py_to_attr({"name": self.name, "transpose_count": self.transpose_count,
                           **self.to_dict()})


# ----------------------------------------------------------------------------
# mm_task

task_p = Primitive("mm_task")
# A call-primitive: jax's rules for calls, except that the transpose binds with
# ``transpose_count + 1``.
def body_scope(params: dict):
    """The mesh a task's body is traced, transformed and lowered under."""
    info = params.get("info")
    mesh = getattr(info, "body_mesh", None)
    if mesh is None or info is None:
        return contextlib.nullcontext()
    return task_mesh_scope(info.name, info.axis_names, mesh)


@contextlib.contextmanager
def task_mesh_scope(name: str, axis_names, mesh: jax.sharding.Mesh):
    """Trace under task ``name``'s ``mesh``. A collective there over an axis of the
    task's placement (``axis_names``: a ``mesh_slice``'s sliced axis) or of the program's
    mesh that ``mesh`` lacks is an error naming the axis and the task: on the program's
    mesh it would have run across the other tasks' devices."""
    outer = tuple(jax.sharding.get_abstract_mesh().axis_names or ())
    try:
        with jax_compat.mesh_scope(mesh.abstract_mesh, mesh):
            yield
    except ValueError as e:
        refused = jax_compat.shard_map_mesh_refused(e)
        if refused is None:
            raise
        raise _other_mesh_error(name, refused[0], mesh) from e
    except (NameError, AssertionError) as e:
        found = jax_compat.unbound_collective(e)
        axis = next((a for a in found[1] if a not in mesh.axis_names
                     and (a in axis_names or a in outer)), None) if found else None
        if found is None or axis is None:
            raise
        raise _collective_error(name, found[0], axis, axis in axis_names, mesh) from e


def _other_mesh_error(name: str, named, mesh) -> Exception:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    other = [(a, s) for a, s in zip(named.axis_names, named.axis_sizes, strict=True)
             if a in sizes and sizes[a] != s]
    what = (f"was traced on a mesh where the axis {other[0][0]!r} has size {other[0][1]}, "
            f"but the task's mesh gives it size {sizes[other[0][0]]}" if other else
            f"names the mesh {dict(zip(named.axis_names, named.axis_sizes, strict=True))} "
            f"(axis types {list(named.axis_types)}), which is not the task's")
    return MeshError(
        f"a `shard_map` in task {name!r} {what}: inside a task the mesh is the task's "
        f"mesh, {sizes} (axis types {list(mesh.axis_types)}). Leave out the `shard_map`'s "
        f"`mesh=` (it then runs on the task's mesh), or give the task a mesh with those "
        f"axes and sizes.")


def _collective_error(name: str, op: str, axis: str, sliced: bool, mesh) -> Exception:
    why = ("which is sliced away (the task is one slice of it)" if sliced
           else "which the task's mesh lacks")
    return MeshError(
        f"a `{op}` in task {name!r} runs over the mesh axis {axis!r}, {why}; inside a task "
        f"a collective runs among the task's devices only, over the axes "
        f"{list(mesh.axis_names)} of its mesh (sizes {list(mesh.axis_sizes)}). Run the "
        f"collective over those axes, or do the step that needs {axis!r} outside the "
        f"task.")


jax_compat.register_call_primitive(task_p, transposed=lambda p: dict(p, info=p["info"].bumped()),
                                   scope=body_scope)


def bind_task(info: TaskInfo, jaxpr: ClosedJaxpr, consts, args):
    return task_p.bind(*consts, *args, call_jaxpr=jaxpr, info=info)


def linearize_task(info: TaskInfo, fun, in_avals, args) -> list | None:
    """``bind_task`` under ``grad``, the body ``fun`` (flat) traced once, straight into
    its forward and tangent tasks; None where the plain trace must run
    (``jax_compat.linearize_call``)."""
    return jax_compat.linearize_call(task_p, {"info": info}, fun, in_avals, args)


def _lowering(ctx, *args, call_jaxpr, info):
    st = _contexts.state
    if not (info.unplaced_ok or st.ignore_transforms or _contexts.traced_by_multimesh()):
        warn_unplaced(info, _program_name(ctx))
    with body_scope({"info": info}):
        call, out_nodes = jax_compat.lower_call(ctx, _symbol(info.name), call_jaxpr, args,
                                                ctx.avals_in)
    call.attributes[TASK_ATTR] = info.attribute()
    return out_nodes


_SERIALS: dict[int, int] = {}  # id of a live module jax lowers -> its serial number
_NEXT_SERIAL = itertools.count()


def _program_name(ctx) -> str:
    """The name of the module jax lowers (``jit_loss``) and a serial number of its own:
    a module's id alone is reused once it is freed, and a later program would then pass
    for one already warned about."""
    module = getattr(ctx.module_context, "module", None)
    try:
        name = str(module.operation.attributes["sym_name"])  # type: ignore[union-attr]
    except (AttributeError, KeyError):
        name = ""
    key = id(module)
    if key not in _SERIALS:
        _SERIALS[key] = next(_NEXT_SERIAL)
        try:
            weakref.finalize(module, _SERIALS.pop, key, None)
        except TypeError:  # not weakly referable: the id stays taken
            pass
    return f"{name}#{_SERIALS[key]}"


_UNPLACED: set[tuple] = set()  # (task, program) already warned about (see warn_unplaced)


def warn_unplaced(info: TaskInfo, program: str) -> None:
    """Warn that a task outside ``mjit`` (called eagerly, under ``jax.jit``, ...) is an
    ordinary call that nothing puts on its submesh.

    Jax lowers a task it is about to run (its lowering rule calls this), so a trace
    that never runs (``jax.eval_shape``) is quiet; the warning comes once per task and
    program (``program``: the module jax lowers, ``jit_loss`` for ``jax.jit(loss)``,
    the primitive's own for an eager call), so each program that runs it unplaced is
    named, and retracing or calling it again is not.
    """
    key = (info.name, info.devices, info.axis_names, info.axis_sizes, program)
    if key in _UNPLACED:
        return
    _UNPLACED.add(key)
    warnings.warn(
        f"Task {info.name!r} is traced outside `multimesh.jax.mjit` (called eagerly, or "
        f"under jax.jit or another jax transformation that runs it), so its placement "
        f"is ignored: it runs as an ordinary jax call where jax puts it, not on its "
        f"submesh (device positions {list(info.devices)}). The values are the same. To "
        f"place it, compile the program with `multimesh.jax.mjit` (or `parallelize`); to "
        f"run plain jax on purpose, call it under `multimesh.jax.ignore_transforms()`.",
        MultimeshWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from here's caller, that points at the
    first frame outside multimesh, jax and flax (the user's call of the task)."""
    library = tuple(os.path.dirname(m.__file__) + os.sep
                    for m in (jax, sys.modules.get("flax")) if m is not None and m.__file__)
    library += (os.path.dirname(os.path.dirname(__file__)) + os.sep,)  # multimesh/
    frame: types.FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(library):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _symbol(name: str) -> str:
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return f"mm_task_{safe}"


mlir.register_lowering(task_p, _lowering)


# ----------------------------------------------------------------------------
# mm_logical_sharding

logical_sharding_p = Primitive("mm_logical_sharding")


def bind_logical(x, axes: tuple[tuple[str, ...], ...]):
    return logical_sharding_p.bind(x, axes=axes)


logical_sharding_p.def_impl(lambda x, *, axes: x)
logical_sharding_p.def_abstract_eval(lambda aval, *, axes: aval)


def _logical_lowering(ctx, x, *, axes):
    st = _contexts.state
    if st.program_devices is None:
        # Lowered by plain jax (eager or jax.jit, not mjit): logical
        # names have no task to resolve them, so the marker is the identity.
        return [x]
    (aval,) = ctx.avals_in
    op = hlo.CustomCallOp(
        [mlir.aval_to_ir_type(ctx.module_context, aval)], [x],
        call_target_name=ir.StringAttr.get(LOGICAL_TARGET),
        has_side_effect=ir.BoolAttr.get(False),
        api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]),
        backend_config=ir.StringAttr.get(""),
        operand_layouts=None, result_layouts=None)
    op.operation.attributes[AXES_ATTR] = ir.ArrayAttr.get([
        ir.ArrayAttr.get([ir.StringAttr.get(n) for n in names]) for names in axes])
    return op.results


mlir.register_lowering(logical_sharding_p, _logical_lowering)
ad.deflinear2(logical_sharding_p, lambda ct, _x, *, axes: [bind_logical(ct, axes)])


def _logical_batcher(vals, dims, *, axes):
    (x,), (d,) = vals, dims
    if d is None:
        return bind_logical(x, axes), d
    new_axes = tuple(axes[:d]) + ((),) + tuple(axes[d:])
    return bind_logical(x, new_axes), d


batching.primitive_batchers[logical_sharding_p] = _logical_batcher


# ----------------------------------------------------------------------------
# mm_microbatch
#
# One traced microbatch. The body is a closed jaxpr over ``(*consts, i, *args)``
# where ``i`` is the microbatch index (an int32 scalar the loop supplies) and the
# body slices its own microbatch out of the full batch with it; the result is the
# sum of the body's outputs over ``i = 0..num_microbatches-1``. Under ``mjit`` it
# lowers to one call of the body between an ``mm.microbatch_index`` marker and
# ``mm.microbatch_sum`` markers, which the passes turn into a loop that the
# runtime plan repeats; anywhere else it is an ordinary ``fori_loop``.

microbatch_p = Primitive("mm_microbatch")
microbatch_p.multiple_results = True
jax_compat.def_jit_impl(microbatch_p)


def bind_microbatch(jaxpr: ClosedJaxpr, num_consts: int, operands,
                    num_microbatches: int):
    return microbatch_p.bind(*operands, jaxpr=jaxpr, num_consts=num_consts,
                             num_microbatches=num_microbatches)


def _mb_abstract_eval(*in_avals, jaxpr, num_consts, num_microbatches):
    del in_avals, num_consts, num_microbatches
    return jaxpr.out_avals, jax_compat.positional_effects(jaxpr)


microbatch_p.def_effectful_abstract_eval(_mb_abstract_eval)


def _body_outputs(jaxpr, num_consts, operands, i):
    consts, args = list(operands[:num_consts]), list(operands[num_consts:])
    return jaxpr_as_fun(jaxpr)(*consts, i, *args)


def _add(a, b):
    return jnp.add(a, b)  # bool outputs add as logical or, like jnp


def unrolled(*operands, jaxpr, num_consts, num_microbatches):
    """The loop as straight-line code: body(i) for every i, summed."""
    acc = None
    for i in range(num_microbatches):
        outs = _body_outputs(jaxpr, num_consts, operands, jnp.int32(i))
        acc = outs if acc is None else [_add(a, o) for a, o in zip(acc, outs)]
    return acc


def _fori(*operands, jaxpr, num_consts, num_microbatches):
    def step(i, acc):
        outs = _body_outputs(jaxpr, num_consts, operands, i)
        return [_add(a, o) for a, o in zip(acc, outs)]

    zeros = [jnp.zeros(a.shape, a.dtype) for a in jaxpr.out_avals]
    return lax.fori_loop(0, num_microbatches, step, zeros)


def _warn_unrolled(what: str) -> None:
    notes = _contexts.state.trace_notes
    if notes is not None and notes.microbatch is not None:
        notes.microbatch = None  # no loop left for a schedule to order

    warnings.warn(
        f"A `microbatch` function is transformed from the outside ({what}), so its loop is "
        f"unrolled into straight-line code: the result is the same, but no pipeline schedule "
        f"applies. To pipeline, apply the transformation inside: "
        f"microbatch(jax.value_and_grad(loss), ...).", MultimeshWarning,
        stacklevel=user_stacklevel())


def _mb_jvp(primals, tangents, *, jaxpr, num_consts, num_microbatches):
    _warn_unrolled("jax.grad, jax.jvp or jax.linearize")
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    f = partial(unrolled, jaxpr=jaxpr, num_consts=num_consts,
                num_microbatches=num_microbatches)
    return jax.jvp(lambda *xs: f(*xs), tuple(primals), tuple(tangents))


ad.primitive_jvps[microbatch_p] = _mb_jvp


def _mb_batch(vals, dims, *, jaxpr, num_consts, num_microbatches):
    _warn_unrolled("jax.vmap")
    f = partial(unrolled, jaxpr=jaxpr, num_consts=num_consts,
                num_microbatches=num_microbatches)
    outs = jax.vmap(lambda *xs: f(*xs), in_axes=tuple(dims), out_axes=0)(*vals)
    return outs, [0] * len(outs)


batching.primitive_batchers[microbatch_p] = _mb_batch


def _mb_dce(used_outputs, eqn):
    if not any(used_outputs) and not jax_compat.has_effects(eqn):
        return [False] * len(eqn.invars), None
    closed = eqn.params["jaxpr"]
    nc = eqn.params["num_consts"]
    keep = [False] * nc + [True] + [False] * (len(closed.jaxpr.invars) - nc - 1)
    new_jaxpr, used_in = pe.dce_jaxpr(closed.jaxpr, list(used_outputs), instantiate=keep)
    used_operands = used_in[:nc] + used_in[nc + 1:]
    new_params = dict(eqn.params, jaxpr=ClosedJaxpr(new_jaxpr, closed.consts),
                      num_consts=sum(used_in[:nc]))
    new_invars = [v for v, u in zip(eqn.invars, used_operands) if u]
    new_eqn = new_jaxpr_eqn(
        new_invars, [v for v, u in zip(eqn.outvars, used_outputs) if u], eqn.primitive,
        new_params, jax_compat.eqn_effects(new_params["jaxpr"], new_invars),
        eqn.source_info, eqn.ctx)
    return used_operands, new_eqn


jax_compat.register_dce_rule(microbatch_p, _mb_dce)


def _mb_lowering(ctx, *operands, jaxpr, num_consts, num_microbatches):
    if _contexts.state.program_devices is None:  # plain jax: an ordinary loop
        return mlir.lower_fun(partial(_fori, jaxpr=jaxpr, num_consts=num_consts,
                                      num_microbatches=num_microbatches),
                              multiple_results=True)(ctx, *operands)
    i64 = ir.IntegerType.get_signless(64)
    loop = ir.IntegerAttr.get(i64, 0)
    info = ir.DictAttr.get({"loop": loop,
                            "num_microbatches": ir.IntegerAttr.get(i64, num_microbatches)})
    index_type = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
    index = _marker(INDEX_TARGET, [], index_type)
    index.attributes[LOOP_ATTR] = loop
    index_aval = jax.core.ShapedArray((), np_int32())
    in_avals = (*ctx.avals_in[:num_consts], index_aval, *ctx.avals_in[num_consts:])
    call, out_nodes = jax_compat.lower_call(
        ctx, "mm_microbatch_body", jaxpr, (*operands[:num_consts], index.results[0],
                                           *operands[num_consts:]), in_avals)
    call.attributes[MICROBATCH_ATTR] = info
    sums = []
    for v in out_nodes:
        s = _marker(SUM_TARGET, [v], v.type)
        s.attributes[MICROBATCH_ATTR] = info
        sums.append(s.results[0])
    return sums


def np_int32():
    return np.dtype(np.int32)


def _marker(target: str, operands, result_type) -> ir.Operation:
    op = hlo.CustomCallOp(
        [result_type], list(operands), call_target_name=ir.StringAttr.get(target),
        has_side_effect=ir.BoolAttr.get(False), api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]), backend_config=ir.StringAttr.get(""),
        operand_layouts=None, result_layouts=None)
    return op.operation


mlir.register_lowering(microbatch_p, _mb_lowering)
