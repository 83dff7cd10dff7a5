"""The two markers the front end puts into a traced program.

``mm_task`` is a call-primitive (modelled on jax's own ``compute_on_p``): it
carries the task body as a closed jaxpr plus a hashable :class:`TaskInfo`
(name, transpose count, mesh, logical mapping). Its transpose rule binds with
``transpose_count + 1``, which is how the backward of a task is told apart from
its forward in the IR. ``mm_logical_sharding`` is an identity whose transpose is
itself: it records logical axis names for the passes to resolve per task.
"""

from __future__ import annotations

import dataclasses
from functools import partial

from jax._src import core, dispatch, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import ad, batching, mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.tree_util import tree_flatten, tree_unflatten
from jax._src.util import (
    merge_lists,
    safe_map,
    safe_zip,
    split_list,
    subs_list,
    unzip2,
    weakref_lru_cache,
)

from multimesh._src.mlir import func as func_dialect
from multimesh._src.mlir import ir
from multimesh._src.mlir import stablehlo as hlo

map, unsafe_map = safe_map, map
zip, unsafe_zip = safe_zip, zip

__all__ = ["TaskInfo", "task_p", "logical_sharding_p", "bind_task", "bind_logical"]


@dataclasses.dataclass(frozen=True)
class TaskInfo:
    """Everything the passes need to know about one task call (hashable)."""

    name: str
    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    logical_axes: tuple[tuple[str, str], ...]
    transpose_count: int = 0
    split_backprop: tuple[str, str] | None = None
    loop_devices: tuple[tuple[int, ...], ...] | None = None
    """``Task.loop_dependent_mesh_slice``: the task's device positions in each microbatch."""

    def bumped(self) -> TaskInfo:
        return dataclasses.replace(self, transpose_count=self.transpose_count + 1)

    def attribute(self) -> ir.Attribute:
        i64 = ir.IntegerType.get_signless(64)

        def ints(xs):
            return ir.ArrayAttr.get([ir.IntegerAttr.get(i64, int(x)) for x in xs])

        def strs(xs):
            return ir.ArrayAttr.get([ir.StringAttr.get(x) for x in xs])

        extra = {}
        if self.split_backprop:
            extra["split_backprop"] = strs(self.split_backprop)
        if self.loop_devices:
            extra["loop_devices"] = ir.ArrayAttr.get([ints(d) for d in self.loop_devices])
        return ir.DictAttr.get({
            **extra,
            "name": ir.StringAttr.get(self.name),
            "transpose_count": ir.IntegerAttr.get(i64, self.transpose_count),
            "devices": ints(self.devices),
            "axis_names": strs(self.axis_names),
            "axis_sizes": ints(self.axis_sizes),
            "logical_axes": ir.ArrayAttr.get([strs(p) for p in self.logical_axes]),
        })


# ----------------------------------------------------------------------------
# mm_task

task_p = core.Primitive("mm_task")
task_p.multiple_results = True
dispatch.simple_impl(task_p)


def bind_task(info: TaskInfo, jaxpr: core.ClosedJaxpr, consts, args):
    return task_p.bind(*consts, *args, jaxpr=jaxpr, info=info)


def _abstract_eval(*in_avals, jaxpr, info):
    return jaxpr.out_avals, core.positional_effects(jaxpr)


task_p.def_effectful_abstract_eval(_abstract_eval)


def _lowering(ctx, *args, jaxpr, info):
    const_args_and_avals = core.jaxpr_const_args(jaxpr.jaxpr)
    const_args, const_avals = unzip2(const_args_and_avals)
    const_arg_values = [
        mlir.ir_constants(c, const_lowering=ctx.const_lowering, aval=aval)
        for c, aval in const_args_and_avals]
    in_avals = (*const_avals, *ctx.avals_in)
    func_op, output_types, effects = mlir.lower_called_computation(
        _symbol(info.name), jaxpr, ctx.module_context, len(const_args), in_avals,
        ctx.avals_out, ctx.tokens_in)
    flat_output_types, treedef = mlir.ir_tree_registry.flatten(output_types)
    tokens = [ctx.tokens_in.get(eff) for eff in effects]
    call_args = (*ctx.dim_var_values, *tokens, *const_arg_values, *args)
    flat_args, _ = mlir.ir_tree_registry.flatten(call_args)
    call = func_dialect.CallOp(
        flat_output_types, ir.FlatSymbolRefAttr.get(func_op.name.value), flat_args)
    call.operation.attributes["mm.task"] = info.attribute()
    out_nodes = treedef.unflatten(call.results)
    tokens, out_nodes = split_list(out_nodes, [len(effects)])
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet(dict(zip(effects, tokens)))))
    return out_nodes


def _symbol(name: str) -> str:
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return f"mm_task_{safe}"


mlir.register_lowering(task_p, _lowering)


def _batcher(axis_data, vals_in, dims_in, *, jaxpr, info):
    batched_jaxpr, dims_out = batching.batch_jaxpr2(jaxpr, axis_data, dims_in)
    return task_p.bind(*vals_in, jaxpr=batched_jaxpr, info=info), dims_out


batching.fancy_primitive_batchers[task_p] = _batcher


def _jvp(primals, tangents, *, jaxpr, info):
    nzs = [not isinstance(t, ad.Zero) for t in tangents]
    jaxpr_jvp, out_nzs = ad.jvp_jaxpr(jaxpr, nzs, False)
    nz_tangents = [t for t in tangents if not isinstance(t, ad.Zero)]
    outs = task_p.bind(*primals, *nz_tangents, jaxpr=jaxpr_jvp, info=info)
    primals_out, nz_tangents_out = split_list(outs, [len(out_nzs)])
    nz_outs = iter(nz_tangents_out)
    tangents_out = [next(nz_outs) if nz else ad.Zero(aval.to_tangent_aval())
                    for aval, nz in zip(jaxpr.out_avals, out_nzs)]
    return primals_out, tangents_out


ad.primitive_jvps[task_p] = _jvp


def _linearize(is_vjp, nzs, *primals, jaxpr, info):
    (primal_jaxpr, num_res_out, nzs_out, in_fwd_res,
     tangent_jaxpr) = ad.linearize_jaxpr(jaxpr, nzs, is_vjp=is_vjp)
    tangent_avals_out = [a.to_tangent_aval() for a in jaxpr.out_avals]

    def tangent_fun(residuals, *tangents):
        tangents_nz = [t for nz, t in zip(nzs, tangents) if nz]
        nz_outs = iter(task_p.bind(*residuals, *tangents_nz, jaxpr=tangent_jaxpr, info=info))
        return [next(nz_outs) if nz else ad.Zero(a)
                for nz, a in zip(nzs_out, tangent_avals_out)]

    ans = task_p.bind(*primals, jaxpr=primal_jaxpr, info=info)
    primal_ans, residuals_ans = split_list(ans, [len(ans) - num_res_out])
    residuals_ans = subs_list(in_fwd_res, [*jaxpr.consts, *primals], residuals_ans)
    return primal_ans, nzs_out, residuals_ans, tangent_fun


ad.primitive_linearizations[task_p] = _linearize


def _partial_eval(trace, *in_tracers, jaxpr, info):
    # Needed for jax.checkpoint around grad: split the body into the known
    # (forward) part and the unknown part, both still tasks.
    in_pvals = [t.pval for t in in_tracers]
    unknown_ins = tuple(not pv.is_known() for pv in in_pvals)
    (known_jaxpr, unknown_jaxpr, unknown_outs, res_out_avals,
     in_fwd_res) = pe.partial_eval_jaxpr_nounits_fwd(jaxpr, unknown_ins, instantiate=False)
    known_inputs = [pv.get_known() for pv in in_pvals if pv.is_known()]
    all_known = task_p.bind(*known_inputs, jaxpr=known_jaxpr, info=info)
    known_out_vals, residual_vals = split_list(all_known, [len(all_known) - len(res_out_avals)])
    residual_iter = iter(residual_vals)
    residual_vals = [next(residual_iter) if f is None else [*jaxpr.consts, *known_inputs][f]
                     for f in in_fwd_res]
    residual_tracers = map(trace.new_instantiated_const, residual_vals)
    unknown_tracers_in = [*residual_tracers, *(t for t in in_tracers if not t.pval.is_known())]
    unknown_tracers_out = [pe.JaxprTracer(trace, pe.PartialVal.unknown(a), None)
                           for a in unknown_jaxpr.out_avals]
    eqn = pe.new_eqn_recipe(trace, unknown_tracers_in, unknown_tracers_out, task_p,
                            dict(jaxpr=unknown_jaxpr, info=info),
                            core.positional_effects(unknown_jaxpr),
                            source_info_util.current())
    for t in unknown_tracers_out:
        t.recipe = eqn
    return merge_lists(unknown_outs, known_out_vals, unknown_tracers_out)


pe.custom_partial_eval_rules[task_p] = _partial_eval
pe.partial_eval_jaxpr_custom_rules[task_p] = partial(
    pe.closed_call_partial_eval_custom_rule, "jaxpr",
    lambda _unks, _inst, _kk, _ks, _nro, _nri, known, staged: (known, staged))


@weakref_lru_cache
def _transpose_jaxpr(jaxpr, in_avals, in_tree):
    cell = lambda: None  # noqa: E731

    def transposed(*in_flat):
        primals_in, cts_in = tree_unflatten(in_tree, in_flat)
        out = ad.backward_pass(jaxpr.jaxpr, False, jaxpr.consts, primals_in, cts_in)
        out = [ct if not isinstance(ct, ad.Zero) else None for ct in out]
        cts_out, cell.out_tree = tree_flatten(out)
        return cts_out

    dbg = jaxpr.jaxpr.debug_info.with_unknown_names()
    trans_jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(transposed, debug_info=dbg), in_avals)
    return core.ClosedJaxpr(trans_jaxpr, consts), cell.out_tree


def _transpose(cts_in, *primals_in, jaxpr, info):
    in_flat, in_tree = tree_flatten((primals_in, cts_in))
    in_avals = tuple(core.typeof(x) for x in in_flat)
    trans_jaxpr, out_tree = _transpose_jaxpr(jaxpr, in_avals, in_tree)
    cts_out = task_p.bind(*in_flat, jaxpr=trans_jaxpr, info=info.bumped())
    return tree_unflatten(out_tree, cts_out)


ad.primitive_transposes[task_p] = _transpose


def _dce(used_outputs, eqn):
    if not any(used_outputs) and not pe.has_effects(eqn):
        return [False] * len(eqn.invars), None
    dced_jaxpr, used_inputs = pe._cached_closed_call_dce(eqn.params["jaxpr"], tuple(used_outputs))
    new_params = dict(eqn.params, jaxpr=dced_jaxpr)
    new_invars = [v for v, used in zip(eqn.invars, used_inputs) if used]
    new_effs = core.eqn_effects(dced_jaxpr, new_invars)
    new_eqn = pe.new_jaxpr_eqn(
        new_invars, [v for v, used in zip(eqn.outvars, used_outputs) if used],
        eqn.primitive, new_params, new_effs, eqn.source_info, eqn.ctx)
    return used_inputs, new_eqn


pe.dce_rules[task_p] = _dce


# ----------------------------------------------------------------------------
# mm_logical_sharding

logical_sharding_p = core.Primitive("mm_logical_sharding")


def bind_logical(x, axes: tuple[tuple[str, ...], ...]):
    return logical_sharding_p.bind(x, axes=axes)


logical_sharding_p.def_impl(lambda x, *, axes: x)
logical_sharding_p.def_abstract_eval(lambda aval, *, axes: aval)


def _logical_lowering(ctx, x, *, axes):
    from multimesh.jax import _contexts

    st = _contexts.state
    if st.program_devices is None:
        # Lowered by plain jax (eager or jax.jit, not mjit): logical
        # names have no task to resolve them, so the marker is the identity.
        return [x]
    (aval,) = ctx.avals_in
    op = hlo.CustomCallOp(
        [mlir.aval_to_ir_type(ctx.module_context, aval)], [x],
        call_target_name=ir.StringAttr.get("mm.logical_sharding"),
        has_side_effect=ir.BoolAttr.get(False),
        api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]),
        backend_config=ir.StringAttr.get(""),
        operand_layouts=None, result_layouts=None)
    op.operation.attributes["mm.axes"] = ir.ArrayAttr.get([
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

microbatch_p = core.Primitive("mm_microbatch")
microbatch_p.multiple_results = True
dispatch.simple_impl(microbatch_p)

INDEX_TARGET = "mm.microbatch_index"
SUM_TARGET = "mm.microbatch_sum"


def bind_microbatch(jaxpr: core.ClosedJaxpr, num_consts: int, operands,
                    num_microbatches: int):
    return microbatch_p.bind(*operands, jaxpr=jaxpr, num_consts=num_consts,
                             num_microbatches=num_microbatches)


def _mb_abstract_eval(*in_avals, jaxpr, num_consts, num_microbatches):
    del in_avals, num_consts, num_microbatches
    return jaxpr.out_avals, core.positional_effects(jaxpr)


microbatch_p.def_effectful_abstract_eval(_mb_abstract_eval)


def _body_outputs(jaxpr, num_consts, operands, i):
    consts, args = split_list(list(operands), [num_consts])
    return core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts, *consts, i, *args)


def _add(a, b):
    import jax.numpy as jnp

    return jnp.add(a, b)  # bool outputs add as logical or, like jnp


def unrolled(*operands, jaxpr, num_consts, num_microbatches):
    """The loop as straight-line code: body(i) for every i, summed."""
    import jax.numpy as jnp

    acc = None
    for i in range(num_microbatches):
        outs = _body_outputs(jaxpr, num_consts, operands, jnp.int32(i))
        acc = outs if acc is None else [_add(a, o) for a, o in zip(acc, outs)]
    return acc


def _fori(*operands, jaxpr, num_consts, num_microbatches):
    import jax.numpy as jnp
    from jax import lax

    def step(i, acc):
        outs = _body_outputs(jaxpr, num_consts, operands, i)
        return [_add(a, o) for a, o in zip(acc, outs)]

    zeros = [jnp.zeros(a.shape, a.dtype) for a in jaxpr.out_avals]
    return lax.fori_loop(0, num_microbatches, step, zeros)


def _warn_unrolled(what: str) -> None:
    import warnings

    from multimesh._src.errors import MultimeshWarning
    from multimesh.jax import _contexts

    notes = _contexts.state.trace_notes
    if notes is not None and notes.get("microbatch") is not None:
        notes["microbatch"] = None  # no loop left for a schedule to order

    warnings.warn(
        f"A `microbatch` function is transformed from the outside ({what}), so its loop is "
        f"unrolled into straight-line code: the result is the same, but no pipeline schedule "
        f"applies. To pipeline, apply the transformation inside: "
        f"microbatch(jax.value_and_grad(loss), ...).", MultimeshWarning, stacklevel=4)


def _mb_jvp(primals, tangents, *, jaxpr, num_consts, num_microbatches):
    import jax

    _warn_unrolled("jax.grad, jax.jvp or jax.linearize")
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    f = partial(unrolled, jaxpr=jaxpr, num_consts=num_consts,
                num_microbatches=num_microbatches)
    return jax.jvp(lambda *xs: f(*xs), tuple(primals), tuple(tangents))


ad.primitive_jvps[microbatch_p] = _mb_jvp


def _mb_batch(vals, dims, *, jaxpr, num_consts, num_microbatches):
    import jax

    _warn_unrolled("jax.vmap")
    f = partial(unrolled, jaxpr=jaxpr, num_consts=num_consts,
                num_microbatches=num_microbatches)
    outs = jax.vmap(lambda *xs: f(*xs), in_axes=tuple(dims), out_axes=0)(*vals)
    return outs, [0] * len(outs)


batching.primitive_batchers[microbatch_p] = _mb_batch


def _mb_dce(used_outputs, eqn):
    if not any(used_outputs) and not pe.has_effects(eqn):
        return [False] * len(eqn.invars), None
    closed = eqn.params["jaxpr"]
    nc = eqn.params["num_consts"]
    keep = [False] * nc + [True] + [False] * (len(closed.jaxpr.invars) - nc - 1)
    new_jaxpr, used_in = pe.dce_jaxpr(closed.jaxpr, list(used_outputs), instantiate=keep)
    used_operands = used_in[:nc] + used_in[nc + 1:]
    new_params = dict(eqn.params, jaxpr=core.ClosedJaxpr(new_jaxpr, closed.consts),
                      num_consts=sum(used_in[:nc]))
    new_invars = [v for v, u in zip(eqn.invars, used_operands) if u]
    new_eqn = pe.new_jaxpr_eqn(
        new_invars, [v for v, u in zip(eqn.outvars, used_outputs) if u], eqn.primitive,
        new_params, core.eqn_effects(new_params["jaxpr"], new_invars), eqn.source_info,
        eqn.ctx)
    return used_operands, new_eqn


pe.dce_rules[microbatch_p] = _mb_dce


def _mb_lowering(ctx, *operands, jaxpr, num_consts, num_microbatches):
    from multimesh.jax import _contexts

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
    index.attributes["mm.loop"] = loop
    const_args_and_avals = core.jaxpr_const_args(jaxpr.jaxpr)
    const_args, const_avals = unzip2(const_args_and_avals)
    const_arg_values = [
        mlir.ir_constants(c, const_lowering=ctx.const_lowering, aval=aval)
        for c, aval in const_args_and_avals]
    index_aval = core.ShapedArray((), np_int32())
    in_avals = (*const_avals, *ctx.avals_in[:num_consts], index_aval,
                *ctx.avals_in[num_consts:])
    func_op, output_types, effects = mlir.lower_called_computation(
        "mm_microbatch_body", jaxpr, ctx.module_context, len(const_args), in_avals,
        ctx.avals_out, ctx.tokens_in)
    flat_output_types, treedef = mlir.ir_tree_registry.flatten(output_types)
    tokens = [ctx.tokens_in.get(eff) for eff in effects]
    call_args = (*ctx.dim_var_values, *tokens, *const_arg_values, *operands[:num_consts],
                 index.results[0], *operands[num_consts:])
    flat_args, _ = mlir.ir_tree_registry.flatten(call_args)
    call = func_dialect.CallOp(
        flat_output_types, ir.FlatSymbolRefAttr.get(func_op.name.value), flat_args)
    call.operation.attributes["mm.microbatch"] = info
    out_nodes = treedef.unflatten(call.results)
    tokens, out_nodes = split_list(out_nodes, [len(effects)])
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet(dict(zip(effects, tokens)))))
    sums = []
    for v in out_nodes:
        s = _marker(SUM_TARGET, [v], v.type)
        s.attributes["mm.microbatch"] = info
        sums.append(s.results[0])
    return sums


def np_int32():
    import numpy as np

    return np.dtype(np.int32)


def _marker(target: str, operands, result_type) -> ir.Operation:
    op = hlo.CustomCallOp(
        [result_type], list(operands), call_target_name=ir.StringAttr.get(target),
        has_side_effect=ir.BoolAttr.get(False), api_version=mlir.i32_attr(1),
        called_computations=ir.ArrayAttr.get([]), backend_config=ir.StringAttr.get(""),
        operand_layouts=None, result_layouts=None)
    return op.operation


mlir.register_lowering(microbatch_p, _mb_lowering)
