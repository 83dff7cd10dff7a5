"""jax's internals behind one door: the only module that imports ``jax._src`` or ``jaxlib._*``.

multimesh is pure Python on stock jax. Most of what it needs from jax is public
(``jax.extend``, ``jax.interpreters.*``, ``jax.api_util``, ``jax.stages``); the
rest has no public name, and lives here, one shim each, with a docstring that says
why it exists and where jax versions differ. Everything else in multimesh imports
jax's public API only: ``tests/test_layering.py`` and ruff's ``TID251`` rule
(``pyproject.toml``) enforce it, so a jax upgrade is a change to this file.

Supported: jax 0.10.2 to 0.12 (README, "Compatibility"). The largest difference:
jax 0.11 merged ``ClosedJaxpr`` into ``Jaxpr`` (a jaxpr carries its constants) and
gave call-primitives one rule set (``register_call_primitive_rules``); on 0.10 the
same rules are written out here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import re
import sys
import threading
from collections.abc import Callable, Sequence, Set
from contextlib import ExitStack
from types import ModuleType, SimpleNamespace
from typing import Any

import jax
import jaxlib
import jaxlib._jax
import numpy as np
from jax._src import callback as _callback
from jax._src import clusters as _clusters
from jax._src import compiler as _compiler
from jax._src import config as _config
from jax._src import core as _core
from jax._src import debugging as _debugging
from jax._src import dispatch as _dispatch
from jax._src import distributed as _distributed
from jax._src import mesh as _mesh_lib
from jax._src import source_info_util as _siu
from jax._src import stages as _stages_lib
from jax._src import util as _util
from jax._src import xla_bridge as _xla_bridge
from jax._src.array import ArrayImpl as _ArrayImpl
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters import pxla as _pxla
from jax._src.lib import xla_client as _xc
from jax._src.sharding_impls import GSPMDSharding as _GSPMDSharding
from jax.extend import linear_util as _lu
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Primitive
from jax.extend.core.primitives import closed_call_p

__all__ = [
    "JAX_VERSION", "register_call_primitive", "lower_call", "fresh_ir_context", "def_jit_impl",
    "positional_effects", "register_dce_rule", "eqn_effects", "has_effects",
    "compile_module", "lowered_callbacks", "ORDERED_EFFECTS", "dispatcher", "shard_args",
    "batched_copy", "device_list", "device_assignment", "is_committed", "key_impl",
    "REUSE_INPUT", "ALWAYS_COPY", "trace_context", "register_cache", "separate_consts", "array_impl_type",
    "gspmd_sharding", "concrete_mesh", "distributed_client", "cluster_env_base", "sdy_mpmd_partitioner",
    "persistent_cache_hits", "in_config_of_caller", "load_on_devices",
    "persistent_cache_on", "serialized_executable", "persistent_cache_settings", "staging",
    "mesh_scope", "mesh_scope_depth", "name_scope_hook", "unbound_collective",
    "shard_map_mesh_refused", "many_meshes", "backends_initialized",
    "unused_inputs", "linearize_call",
]

JAX_VERSION: tuple[int, ...] = tuple(
    int(p) for p in re.findall(r"\d+", jax.__version__)[:3])
"""``jax.__version__`` as numbers, e.g. ``(0, 10, 2)``."""

_MERGED_JAXPR = ClosedJaxpr is _core.Jaxpr  # jax >= 0.11: one class, consts attached


# ----------------------------------------------------------------------------
# Call-primitives (the ``mm_task`` marker)

def register_call_primitive(prim: Primitive, *,
                            transposed: Callable[[dict], dict],
                            scope: Callable[[dict], contextlib.AbstractContextManager] | None
                            = None) -> None:
    """Give ``prim`` the rules of a call-primitive: impl, abstract eval, jvp,
    linearize, transpose, partial eval, DCE and batching.

    ``prim`` binds as ``prim.bind(*args, call_jaxpr=closed_jaxpr, **params)`` with
    hashable ``params`` that every rule passes through unchanged, except the
    transpose, which binds with ``transposed(params)`` (how the backward of a task
    is told apart from its forward). Lowering is the caller's (``lower_call``).

    ``scope(params)``, when given, is entered around every rule that retraces or
    rewrites the body (jvp, linearize, transpose, partial eval, DCE, batching): a
    task's body runs under its own mesh, and jax checks the mesh in context whenever
    it walks a ``shard_map`` inside.

    Why here: jax has no public way to define a call-primitive. jax >= 0.11 has one
    internal helper for it (``register_call_primitive_rules``, which ``compute_on``
    and ``eval_jaxpr`` use); on 0.10 the same rules are written out below, as jax
    0.10's ``compute_on`` wrote them. Partial eval of jaxprs and DCE are jax's own
    ``closed_call`` rules in every version.
    """
    prim.multiple_results = True
    _eval_jaxpr = _call_rules_module()
    if _eval_jaxpr is not None:
        def transpose(ct, *args, call_jaxpr, **params):
            return _eval_jaxpr.eval_jaxpr_transpose(
                prim, ct, *args, call_jaxpr=call_jaxpr, **transposed(params))

        _eval_jaxpr.register_call_primitive_rules(prim, transpose_rule=transpose)
    else:
        _register_call_rules_010(prim, transposed)
        _pe.partial_eval_jaxpr_custom_rules[prim] = \
            _pe.partial_eval_jaxpr_custom_rules[closed_call_p]
        _pe.dce_rules[prim] = _pe.dce_rules[closed_call_p]
    if scope is not None:
        _scope_rules(prim, scope)


_RULE_TABLES = (
    (_batching, "fancy_primitive_batchers"), (_ad, "primitive_jvps"),
    (_ad, "primitive_linearizations"), (_ad, "primitive_transposes"),
    (_pe, "custom_partial_eval_rules"), (_pe, "partial_eval_jaxpr_custom_rules"),
    (_pe, "dce_rules"))


def _scope_rules(prim, scope) -> None:
    """Wrap each of ``prim``'s rules in ``scope(params)`` (params from the keyword
    arguments, or from the equation a jaxpr-level rule is given)."""
    for module, table_name in _RULE_TABLES:
        table = getattr(module, table_name, None)
        if table is None or prim not in table:
            continue
        table[prim] = functools.partial(_scoped, table[prim], scope)


def _scoped(rule, scope, *args, **kwargs):
    params = kwargs if "call_jaxpr" in kwargs or "jaxpr" in kwargs else next(
        (a.params for a in args if isinstance(getattr(a, "params", None), dict)), kwargs)
    with scope(params):
        return rule(*args, **kwargs)


@functools.cache
def _call_rules_module() -> ModuleType | None:
    """jax >= 0.11's module of call-primitive rules; None on 0.10, which has none
    (asked once: a failed import searches the path again each time)."""
    try:
        mod = importlib.import_module("jax._src.lax.eval_jaxpr")
    except ImportError:
        return None
    return mod if hasattr(mod, "register_call_primitive_rules") else None


def _register_call_rules_010(prim, transposed) -> None:
    """jax 0.10's call-primitive rules (those of its ``compute_on_p``), for ``prim``.

    Each rule is a module-level function that takes ``prim`` first (bound with
    ``functools.partial``), so the rules read one at a time.
    """
    _dispatch.simple_impl(prim)
    prim.def_effectful_abstract_eval(_abstract_eval_010)
    _batching.fancy_primitive_batchers[prim] = functools.partial(_batch_010, prim)
    _ad.primitive_jvps[prim] = functools.partial(_jvp_010, prim)
    _ad.primitive_linearizations[prim] = functools.partial(_linearize_010, prim)
    _pe.custom_partial_eval_rules[prim] = functools.partial(_partial_eval_010, prim)
    _ad.primitive_transposes[prim] = functools.partial(_transpose_010, prim, transposed)


def _abstract_eval_010(*in_avals, call_jaxpr, **params):
    return call_jaxpr.out_avals, _core.positional_effects(call_jaxpr)


def _batch_010(prim, axis_data, vals_in, dims_in, *, call_jaxpr, **params):
    batched, dims_out = _batching.batch_jaxpr2(call_jaxpr, axis_data, tuple(dims_in))
    return prim.bind(*vals_in, call_jaxpr=batched, **params), dims_out


def _jvp_010(prim, primals, tangents, *, call_jaxpr, **params):
    nzs = [not isinstance(t, _ad.Zero) for t in tangents]
    jaxpr_jvp, out_nzs = _ad.jvp_jaxpr(call_jaxpr, nzs, False)
    nz_tangents = [t for t in tangents if not isinstance(t, _ad.Zero)]
    outs = prim.bind(*primals, *nz_tangents, call_jaxpr=jaxpr_jvp, **params)
    primals_out, nz_tangents_out = _util.split_list(outs, [len(out_nzs)])
    nz_outs = iter(nz_tangents_out)
    tangents_out = [next(nz_outs) if nz else _ad.Zero(aval.to_tangent_aval())
                    for aval, nz in _util.safe_zip(call_jaxpr.out_avals, out_nzs)]
    return primals_out, tangents_out


def _linearize_010(prim, is_vjp, nzs, *primals, call_jaxpr, **params):
    (primal_jaxpr, num_res_out, nzs_out, in_fwd_res,
     tangent_jaxpr) = _ad.linearize_jaxpr(call_jaxpr, nzs, is_vjp=is_vjp)
    tangent_avals_out = [a.to_tangent_aval() for a in call_jaxpr.out_avals]

    def tangent_fun(residuals, *tangents):
        tangents_nz = [t for nz, t in _util.safe_zip(nzs, tangents) if nz]
        nz_outs = iter(prim.bind(*residuals, *tangents_nz, call_jaxpr=tangent_jaxpr,
                                 **params))
        return [next(nz_outs) if nz else _ad.Zero(a)
                for nz, a in _util.safe_zip(nzs_out, tangent_avals_out)]

    ans = prim.bind(*primals, call_jaxpr=primal_jaxpr, **params)
    primal_ans, residuals_ans = _util.split_list(ans, [len(ans) - num_res_out])
    residuals_ans = _util.subs_list(in_fwd_res, [*call_jaxpr.consts, *primals],
                                    residuals_ans)
    return primal_ans, nzs_out, residuals_ans, tangent_fun


def _partial_eval_010(prim, trace, *in_tracers, call_jaxpr, **params):
    """Needed for jax.checkpoint around grad: the known (forward) part and the
    unknown part are both calls of prim."""
    in_pvals = [t.pval for t in in_tracers]
    unknown_ins = tuple(not pv.is_known() for pv in in_pvals)
    (known_jaxpr, unknown_jaxpr, unknown_outs, res_out_avals,
     in_fwd_res) = _pe.partial_eval_jaxpr_nounits_fwd(call_jaxpr, unknown_ins,
                                                      instantiate=False)
    known_inputs = [pv.get_known() for pv in in_pvals if pv.is_known()]
    all_known = prim.bind(*known_inputs, call_jaxpr=known_jaxpr, **params)
    known_out, residuals = _util.split_list(all_known,
                                            [len(all_known) - len(res_out_avals)])
    res_iter = iter(residuals)
    residuals = [next(res_iter) if f is None else [*call_jaxpr.consts, *known_inputs][f]
                 for f in in_fwd_res]
    res_tracers = _util.safe_map(trace.new_instantiated_const, residuals)
    unknown_in = [*res_tracers, *(t for t in in_tracers if not t.pval.is_known())]
    unknown_out = [_pe.JaxprTracer(trace, _pe.PartialVal.unknown(a), None)
                   for a in unknown_jaxpr.out_avals]
    eqn = _pe.new_eqn_recipe(trace, unknown_in, unknown_out, prim,
                             dict(params, call_jaxpr=unknown_jaxpr),
                             _core.positional_effects(unknown_jaxpr),
                             source_info_util.current())
    for t in unknown_out:
        t.recipe = eqn
    return _util.merge_lists(unknown_outs, known_out, unknown_out)


def linearize_call(prim: Primitive, params: dict, fun, in_avals, args_flat) -> list | None:
    """``prim.bind(*args_flat, call_jaxpr=<fun traced>, **params)`` under ``jax.grad``,
    with ``fun`` traced once, straight into its forward and tangent jaxprs.

    Under jax's ``LinearizeTrace`` (``grad``, ``vjp``, ``value_and_grad``) a call
    primitive is traced to a jaxpr, and then its linearization rule evaluates that
    jaxpr again into a forward and a tangent jaxpr (``ad.linearize_jaxpr``). This does
    what the rule and ``LinearizeTrace.process_primitive`` do, but evaluates ``fun``
    (a flat ``lu.WrappedFun``) itself, as ``jax.jit``'s trace of a whole step does:
    one trace of the body in place of two (a third of a restart's tracing).

    Returns the outputs (``LinearizeTracer``s), or None where the ordinary path must
    run: jax >= 0.11 (its linearization rule differs), no ``LinearizeTrace`` current,
    no nonzero tangent in, a reference input, or a body that closed over another
    trace's values (their tangents would be lost; the plain trace turns them into
    arguments).
    """
    if _call_rules_module() is not None:
        return None
    trace = _core.trace_ctx.trace
    if type(trace) is not _ad.LinearizeTrace or any(
            isinstance(a, _ad.AbstractRef) for a in in_avals):
        return None
    primals, tangents = _util.unzip2(map(trace.to_primal_tangent_pair, args_flat))
    nzs = tuple(type(t) is not _ad.Zero for t in tangents)
    if not any(nzs):
        return None
    got = _linearize_fun(fun, tuple(in_avals), nzs, trace.is_vjp)
    if got is None:
        return None
    primal_jaxpr, residual_src, nzs_out, tangent_jaxpr, out_avals = got
    with _core.set_current_trace(trace.parent_trace):
        ans = prim.bind(*primals, call_jaxpr=primal_jaxpr, **params)
    primal_ans, computed = _util.split_list(ans, [len(out_avals)])
    computed_it = iter(computed)
    residuals = [next(computed_it) if src is None else
                 (primals[src] if isinstance(src, int) else src[0]) for src in residual_src]
    with (_core.set_current_trace(trace.tangent_trace),
          source_info_util.set_name_stack(trace._name_stack_suffix())):
        tangents_nz = [t for nz, t in zip(nzs, tangents) if nz]
        outs = iter(prim.bind(*residuals, *tangents_nz, call_jaxpr=tangent_jaxpr, **params))
        tangent_out = [next(outs) if nz else _ad.Zero(a.to_tangent_aval())
                       for nz, a in zip(nzs_out, out_avals)]
    return [_ad.maybe_linearize_tracer(trace, x, nz, t)
            for x, nz, t in zip(primal_ans, nzs_out, tangent_out)]


@_siu.reset_name_stack()
def _linearize_fun(fun, in_avals, nzs, is_vjp):
    """jax 0.10's ``ad._linearize_jaxpr`` with ``fun`` called where it evaluates a
    jaxpr: ``(primal jaxpr, where each residual comes from, nonzero tangents out,
    tangent jaxpr, out avals)``, or None (a value closed over from another trace).

    A residual comes from the forward's outputs after its primal outputs (None), from
    input ``i`` (an ``int``: not computed again), or is a constant (``(value,)``)."""
    dbg = fun.debug_info
    primal_trace = _pe.DynamicJaxprTrace(dbg)
    tangent_trace = _pe.DynamicJaxprTrace(dbg, auto_dce=True)
    tangent_trace.tag = _core.TraceTag()
    lin_trace = _ad.LinearizeTrace(primal_trace, tangent_trace, is_vjp=is_vjp)
    src = source_info_util.current()

    def new_arg(trace, aval, nz):
        primal = primal_trace.new_arg(aval, src)
        tangent_aval = aval.to_tangent_aval()
        tangent = tangent_trace.new_arg(tangent_aval, src) if nz else _ad.Zero(tangent_aval)
        return _ad.LinearizeTracer(trace, primal, tangent)

    tracers = [new_arg(lin_trace, a, nz) for a, nz in zip(in_avals, nzs)]
    in_primals = [t.primal for t in tracers]
    with _core.set_current_trace(lin_trace, check_leaks=True):
        ans = fun.call_wrapped(*tracers)
        out_primals, out_tangents = _util.unzip2(map(lin_trace.to_primal_tangent_pair, ans))
        del lin_trace, ans, tracers  # no reference left for jax's leak check
    out_avals = [_core.typeof(x) for x in out_primals]
    nzs_out = [type(t) is not _ad.Zero for t in out_tangents]
    nz_tangents = [tangent_trace.to_jaxpr_tracer(t, src)
                   for nz, t in zip(nzs_out, out_tangents) if nz]
    tangent_jaxpr, tangent_consts = tangent_trace.to_jaxpr(
        nz_tangents, dbg.with_unknown_names(), src)
    tangent_trace.invalidate()
    tangent_jaxpr, tangent_consts = _ad._dce_consts(tangent_jaxpr, tangent_consts)
    tangent_jaxpr = _pe.close_jaxpr(_pe.convert_constvars_jaxpr(tangent_jaxpr))
    inputs = {id(x): i for i, x in enumerate(in_primals)}
    residual_src: list = []
    computed = []
    for c in tangent_consts:
        if id(c) in inputs:
            residual_src.append(inputs[id(c)])
        elif not isinstance(c, _core.Tracer):
            residual_src.append((c,))
        else:
            residual_src.append(None)
            computed.append(c)
    outs = [primal_trace.to_jaxpr_tracer(x, src) for x in (*out_primals, *computed)]
    primal_jaxpr, primal_consts = primal_trace.to_jaxpr(outs, dbg.with_unknown_names(), src)
    primal_trace.invalidate()
    if any(isinstance(c, _core.Tracer) for c in primal_consts):
        return None  # closed over another trace's value: the plain trace's way
    primal_jaxpr, primal_consts = _ad._dce_consts(primal_jaxpr, primal_consts)
    return (ClosedJaxpr(primal_jaxpr, primal_consts), residual_src, nzs_out, tangent_jaxpr,
            out_avals)


@_util.weakref_lru_cache
def _transpose_jaxpr_010(call_jaxpr, in_avals, in_tree):
    """The backward pass of ``call_jaxpr`` traced to a jaxpr (cached per jaxpr)."""
    cell = SimpleNamespace(out_tree=None)  # set by the traced function

    def transposed_fun(*in_flat):
        primals_in, cts_in = jax.tree_util.tree_unflatten(in_tree, in_flat)
        out = _ad.backward_pass(call_jaxpr.jaxpr, False, call_jaxpr.consts, primals_in,
                                cts_in)
        out = [ct if not isinstance(ct, _ad.Zero) else None for ct in out]
        cts_out, cell.out_tree = jax.tree_util.tree_flatten(out)
        return cts_out

    dbg = call_jaxpr.jaxpr.debug_info.with_unknown_names()
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
        _lu.wrap_init(transposed_fun, debug_info=dbg), in_avals)
    return ClosedJaxpr(jaxpr, consts), cell.out_tree


def _transpose_010(prim, transposed, cts_in, *primals_in, call_jaxpr, **params):
    in_flat, in_tree = jax.tree_util.tree_flatten((primals_in, cts_in))
    in_avals = tuple(jax.typeof(x) for x in in_flat)
    trans_jaxpr, out_tree = _transpose_jaxpr_010(call_jaxpr, in_avals, in_tree)
    cts_out = prim.bind(*in_flat, call_jaxpr=trans_jaxpr, **transposed(params))
    return jax.tree_util.tree_unflatten(out_tree, cts_out)


def lower_call(ctx, name: str, call_jaxpr, operands, in_avals, *,
               make_call: Callable | None = None) -> tuple:
    """Lower ``call_jaxpr`` into a private function ``name`` and call it with
    ``func.call``; returns the call op (for the caller's attributes) and its results.

    ``make_call(result_types, callee, args)`` builds another call op instead.

    ``operands``/``in_avals`` are the call's arguments (the lowering rule's values,
    plus any the caller adds); the jaxpr's constants and effect tokens are threaded
    as jax's own call lowering does. Why here: ``lower_called_computation`` and
    ``jaxpr_const_args`` are internal in every version, and jax >= 0.11 reads the
    constants off the jaxpr itself (0.10: off the ``ClosedJaxpr``'s inner jaxpr).
    The call op is built with the bindings of jax's lowering, whose context ``ctx`` is
    (the same objects as ``multimesh._src.mlir``'s, which imports this module).
    """
    ir, func = _mlir.ir, _mlir.func_dialect

    const_args_and_avals = _core.jaxpr_const_args(
        call_jaxpr if _MERGED_JAXPR else call_jaxpr.jaxpr)
    const_args, const_avals = _util.unzip2(const_args_and_avals)
    const_values = [_mlir.ir_constants(c, const_lowering=ctx.const_lowering, aval=aval)
                    for c, aval in const_args_and_avals]
    func_op, output_types, effects = _mlir.lower_called_computation(
        name, call_jaxpr, ctx.module_context, len(const_args), (*const_avals, *in_avals),
        ctx.avals_out, ctx.tokens_in)
    flat_output_types, treedef = _mlir.ir_tree_registry.flatten(output_types)
    tokens = [ctx.tokens_in.get(eff) for eff in effects]
    flat_args, _ = _mlir.ir_tree_registry.flatten(
        (*ctx.dim_var_values, *tokens, *const_values, *operands))
    callee = ir.FlatSymbolRefAttr.get(func_op.name.value)
    call = (make_call(flat_output_types, callee, flat_args) if make_call is not None
            else func.CallOp(flat_output_types, callee, flat_args))
    out_nodes = treedef.unflatten(call.results)
    tokens, out_nodes = _util.split_list(out_nodes, [len(effects)])
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(
        _mlir.TokenSet(dict(zip(effects, tokens)))))
    return call.operation, out_nodes


def fresh_ir_context():
    """A new MLIR context with every dialect jax emits (func, stablehlo, sdy, mhlo, ...).

    multimesh needs a context of its own: it turns multithreading off, keys caches on
    the context, and a compiled program's IR must be freed with it. jax 0.10's public
    ``make_ir_context`` makes a new one each call; jax >= 0.11's hands out one
    thread-local context up to 10 times (jax's own lowerings share it), and its
    ``_create_ir_context`` makes a new one.
    """
    create = getattr(_mlir, "_create_ir_context", None)
    return create() if create is not None else _mlir.make_ir_context()


def def_jit_impl(prim: Primitive) -> None:
    """Eager ``prim.bind`` compiles the one primitive, like jax's own primitives do
    (``dispatch.simple_impl``; internal in every version)."""
    _dispatch.simple_impl(prim)


def positional_effects(jaxpr) -> Set:
    """The effects of calling ``jaxpr`` (an abstract-eval rule's second result);
    ``core.positional_effects`` is internal in every version."""
    return _core.positional_effects(jaxpr)


def eqn_effects(jaxpr, invars) -> Set:
    """The effects of an equation that calls ``jaxpr`` on ``invars`` (internal)."""
    return _core.eqn_effects(jaxpr, invars)


def has_effects(eqn) -> bool:
    """Whether DCE must keep ``eqn`` although no output is used (internal)."""
    return _pe.has_effects(eqn)


def register_dce_rule(prim: Primitive, rule: Callable) -> None:
    """Register ``rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)``.

    ``jax.interpreters.partial_eval.dce_rules`` is public, but jax 0.12 calls the
    rules with one more argument (``live_ins``, which marks live reference inputs;
    multimesh's primitives take no references, so it is ignored).
    """
    if JAX_VERSION >= (0, 12):
        def rule_012(used_outputs, live_ins, eqn):
            return rule(used_outputs, eqn)

        _pe.dce_rules[prim] = rule_012  # type: ignore[assignment]  # jax 0.12's rules take live_ins; its annotation is 0.10's
    else:
        _pe.dce_rules[prim] = rule


def separate_consts(closed) -> tuple:
    """``(jaxpr, consts)``: ``closed`` with its constants turned into leading arguments.

    jax 0.10 moves the constvars of the inner jaxpr into its invars; jax >= 0.11
    detaches the constants that a jaxpr carries (``pe.separate_consts``, internal).
    """
    return _pe.separate_consts(closed)


# ----------------------------------------------------------------------------
# Compiling and dispatching fragments, moving arrays (multimesh/runtime/executor.py)

def compile_module(name: str, module, in_avals, out_avals, in_shardings, out_shardings,
                   devices, host_callbacks: Sequence[Callable] = (),
                   ordered_effects: Sequence = (), serialized: bytes | None = None):
    """Compile an MLIR module for ``devices`` (a list, in mesh order) into a
    ``jax.stages.Compiled`` that takes and returns ``jax.Array``s on jit's C++
    dispatch path.

    jax has no public "compile this StableHLO for these devices": this is jit's own
    path, ``UnloadedMeshExecutable.from_hlo`` (15 internal keywords, unchanged from
    0.10.2 to 0.12) and the ``Compiled`` constructor. All arguments are kept and
    none is donated unless the module marks it (``jax.buffer_donor``).

    ``host_callbacks``: the Python callbacks the module calls, by their index in it
    (then jax dispatches calls on its Python path, with runtime tokens, so
    ``jax.effects_barrier()`` waits for them). ``ordered_effects``: the module's
    ``main`` takes and returns one token per effect, first, like a jitted program
    with ordered effects; jax threads its runtime token of each through the call.

    ``serialized``: an executable of this module (on any devices of the same count,
    :func:`serialized_executable`), loaded onto ``devices`` instead of compiling; the
    rest of jit's path is the same. It raises where the bytes cannot be loaded.
    """
    # jax only asks whether there are unordered effects (then it keeps runtime tokens)
    unordered: list[_core.Effect] = [_debugging.debug_effect] if host_callbacks else []
    if serialized is not None:
        _install_loader()
    _loading.blob = serialized
    try:
        exe = _from_hlo(name, module, in_avals, out_avals, in_shardings, out_shardings,
                        devices, host_callbacks, ordered_effects, unordered)
    finally:
        _loading.blob = None
    _skip_sub_byte_layout_check(exe)
    args_info: tuple[tuple, dict] = (tuple(_stages_lib.ArgInfo(a, False) for a in in_avals), {})
    out_tree = jax.tree_util.tree_structure([0] * len(out_avals))
    return _stages_lib.Compiled(exe, [], args_info, out_tree)


def _from_hlo(name, module, in_avals, out_avals, in_shardings, out_shardings, devices,
              host_callbacks, ordered_effects, unordered):
    return _pxla.UnloadedMeshExecutable.from_hlo(
        name, module, list(in_avals), list(out_avals), list(in_shardings),
        list(out_shardings), tuple_args=False, unordered_effects=unordered,
        ordered_effects=list(ordered_effects),
        host_callbacks=list(host_callbacks), keepalive=list(host_callbacks) or None,
        kept_var_idx=set(range(len(in_shardings))),
        backend=devices[0].client, device_list=_xc.DeviceList(tuple(devices)),
        committed=True, in_layouts=(None,) * len(in_shardings),
        out_layouts=(None,) * len(out_shardings), compiler_options_kvs=(),
        num_devices=len(devices))


_loading = threading.local()
"""``blob``: the serialized executable :func:`compile_module` loads in this thread."""
_loader_lock = threading.Lock()
_loader_installed = False


def _install_loader() -> None:
    """Wrap jax's ``compiler.compile_or_get_cached`` (internal; pxla's
    ``_cached_compilation`` looks it up on the module at each call, 0.10.2 to 0.12) so
    that a compile in a thread that set ``_loading.blob`` deserializes those bytes for
    the call's devices (``Client.deserialize_executable`` with the call's compile
    options, as jax's own cache read does) instead of compiling or reading jax's cache."""
    global _loader_installed
    with _loader_lock:
        if _loader_installed:
            return
        original = _compiler.compile_or_get_cached

        @functools.wraps(original)
        def compile_or_load(backend, computation, devices, compile_options, *args, **kwargs):
            blob = getattr(_loading, "blob", None)
            if blob is None:
                return original(backend, computation, devices, compile_options, *args,
                                **kwargs)
            _loading.blob = None
            targets = [a for a in (*args, *kwargs.values()) if isinstance(a, _xc.DeviceList)]
            return backend.deserialize_executable(blob, targets[0], compile_options)

        _compiler.compile_or_get_cached = compile_or_load
        _loader_installed = True


def serialized_executable(compiled) -> bytes | None:
    """The bytes of an executable :func:`compile_module` compiled, which it loads again
    with ``serialized=``; None for one with host callbacks (their addresses are compiled
    in) or one jax cannot serialize. Only an executable XLA compiled in this process
    serializes with its code on jaxlib 0.10.2's CPU client (docs/performance.md)."""
    src = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
    if src is None or src.host_callbacks or src.keepalive:
        return None
    try:
        return src.xla_executable.serialize()
    except (AttributeError, jax.errors.JaxRuntimeError):
        return None


def persistent_cache_settings() -> tuple[str, float]:
    """``(jax_compilation_cache_dir, jax_persistent_cache_min_compile_time_secs)``."""
    return (str(_config.compilation_cache_dir.value or ""),
            float(_config.persistent_cache_min_compile_time_secs.value))


def load_on_devices(compiled, name: str, in_shardings, out_shardings, devices):
    """``compiled`` (from :func:`compile_module`) for other devices, without compiling.

    An SPMD executable does not depend on which devices it runs on, only on how many:
    PjRt loads a serialized one with any device assignment of the same size (what
    jax's persistent cache does on GPU, where its key leaves out the device ids). jax
    has no public "load this executable onto those devices", so this serializes the
    executable, deserializes it for ``devices`` (``Client.deserialize_executable``
    with a device assignment in its compile options) and rebuilds jit's wrapper around
    it (``UnloadedMeshExecutable`` with the new shardings; internal, checked on
    0.10.2). None where that cannot apply: an executable with host callbacks (their
    pointers are compiled in) or devices of another process.
    """
    src = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
    if (src is None or src.host_callbacks or src.keepalive
            or any(d.process_index != jax.process_index() for d in devices)):
        return None
    device_list = _xc.DeviceList(tuple(devices))
    assignment = np.empty((1, len(devices)), dtype=object)
    assignment[0, :] = devices
    options = _compiler.get_compile_options(
        num_replicas=1, num_partitions=len(devices), device_assignment=assignment,
        backend=src.backend)
    try:
        xla = src.backend.deserialize_executable(src.xla_executable.serialize(),
                                                 device_list, options)
        exe = dataclasses.replace(
            src, xla_executable=xla, device_list=device_list, name=name,
            input_shardings=tuple(in_shardings), output_shardings=tuple(out_shardings)).load()
    except (TypeError, AttributeError, jax.errors.JaxRuntimeError):
        return None  # another jax's fields, or a backend that cannot: compile instead
    _skip_sub_byte_layout_check(exe)
    return _stages_lib.Compiled(exe, [], compiled.args_info, compiled.out_tree)


def _skip_sub_byte_layout_check(exe) -> None:
    """Let sub-byte arguments (``int4``, ``uint2``, ``float4_e2m1fn``, ...) through.

    jax's CPU client gives such arrays unpacked layouts (``sub_byte_element_size_in_bits
    = 0``) while the executable reports packed ones (4), and runs them fine: ``jax.jit``'s
    own dispatch never compares the two, but the AOT path (``Compiled.call``, which the
    runtime's calls take) does and refuses. Drop the comparison (``MeshExecutable.
    _xla_in_layouts``, internal, 0.10.2 to 0.12) for those arguments only, as jit does.
    """
    layouts = getattr(exe, "_xla_in_layouts", None)
    if layouts and any(getattr(lay, "sub_byte_element_size_in_bits", 0) for lay in layouts):
        exe._xla_in_layouts = [None if getattr(lay, "sub_byte_element_size_in_bits", 0)
                               else lay for lay in layouts]
ORDERED_EFFECTS: tuple = (_debugging.ordered_debug_effect, _callback._OrderedIOEffect)
"""jax's ordered effects of Python callbacks (``jax.debug.print(ordered=True)``,
``io_callback(ordered=True)``); a fragment with any ordered callback takes and returns
jax's runtime token of each (internal objects in every version)."""


def lowered_callbacks(lowered) -> tuple[list[Callable], bool]:
    """The Python callbacks a ``jax.stages.Lowered``'s module calls (``index`` i of a
    callback custom call is entry i), and whether it threads tokens for ordered effects.
    jax hands both to XLA's compile itself and has no public reader for them
    (``Lowered._lowering.compile_args``, internal, the same keys from 0.10.2 to 0.12)."""
    args = lowered._lowering.compile_args
    return list(args.get("host_callbacks") or ()), bool(args.get("ordered_effects"))


def dispatcher(compiled):
    """What calls of ``compiled`` go through: the C++ function ``jax.stages.Compiled``
    builds on its first call (built now, so the first call is as fast as the rest), or
    ``compiled`` itself when jax has none for it (``_executable.create_cpp_call``,
    internal)."""
    if getattr(compiled, "_call", None) is None and hasattr(compiled, "_executable"):
        compiled._call = compiled._executable.create_cpp_call(compiled._params)
    return getattr(compiled, "_call", None) or compiled


shard_args = _pxla.shard_args
"""``shard_args(shardings, layouts, copy_semantics, arrays)``: jit's placement of its
arguments (``jax.device_put``'s core without its Python overhead): copies same-layout
arrays to other devices in one batched call, reshards otherwise. Internal in every
version; the same signature from 0.10.2 to 0.12."""

batched_copy = _xc.batched_copy_array_to_devices_with_sharding
"""``batched_copy(arrays, device_lists, shardings, copy_semantics)``: copy each array's
shards to the devices of the same-layout sharding, all in one host call
(``xla_client.batched_copy_array_to_devices_with_sharding``; internal, unchanged from
0.10.2 to 0.12). ``device_lists`` are :func:`device_list` of the shardings."""

REUSE_INPUT = _xc.ArrayCopySemantics.REUSE_INPUT
ALWAYS_COPY = _xc.ArrayCopySemantics.ALWAYS_COPY
"""``copy_semantics`` values: reuse the source's buffers where the devices agree, or
always copy (``xla_client.ArrayCopySemantics``)."""


def device_list(sharding):
    """The device list a sharding holds, in the form :data:`batched_copy` takes
    (``Sharding._internal_device_list``, internal)."""
    return sharding._internal_device_list


def device_assignment(sharding) -> tuple:
    """A sharding's devices in its own order (``Sharding._device_assignment``,
    internal in every version): the order its shards are laid out in, which the
    public ``device_set`` does not keep."""
    return tuple(sharding._device_assignment)


def is_committed(x) -> bool:
    """Whether ``x`` is a ``jax.Array`` committed to its devices (placed by
    ``jax.device_put`` or a computation, not left to jax's default device):
    ``ArrayImpl._committed``, internal in every version. False for anything else."""
    return bool(getattr(x, "_committed", False))


def key_impl(dtype):
    """The PRNG implementation of a typed key's dtype (``key<fry>``), as
    ``jax.random.wrap_key_data(..., impl=)`` takes it (``dtype._impl``, internal in
    every version; ``jax.random.key_impl`` needs an array, not a dtype)."""
    return dtype._impl


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()
_hits_lock = threading.Lock()
_hits_listening = False


def _count_cache_hit(event: str, **_: object) -> None:
    if event == _CACHE_HIT_EVENT:
        _hits.n = getattr(_hits, "n", 0) + 1


def persistent_cache_hits() -> int:
    """How many executables this thread has loaded from jax's persistent compilation
    cache (``jax_compilation_cache_dir``) so far.

    ``compile_or_get_cached``, which :func:`compile_module` goes through (inside
    ``UnloadedMeshExecutable.from_hlo``), says whether it read the executable from the
    cache only through the monitoring event ``/jax/compilation_cache/cache_hits``
    (the event's name is internal, the same from 0.10.2 to 0.12). Events are counted
    per thread, so concurrent compiles each see their own.
    """
    global _hits_listening
    if not _hits_listening:
        with _hits_lock:
            if not _hits_listening:
                jax.monitoring.register_event_listener(_count_cache_hit)
                _hits_listening = True
    return getattr(_hits, "n", 0)


def persistent_cache_on() -> bool:
    """Whether jax's persistent compilation cache is in use (``jax_compilation_cache_dir``
    set and ``jax_enable_compilation_cache`` on; the flags are public, reading them
    through ``config`` is the same from 0.10.2 to 0.12)."""
    return bool(_config.enable_compilation_cache.value
                and _config.compilation_cache_dir.value)


def in_config_of_caller() -> Callable[[], ExitStack]:
    """A context factory that re-enters, in another thread, the jax configuration this
    thread set with context managers (``with jax.log_compiles(True):``, ...).

    jax's config context managers are thread-local, so a worker thread compiling on the
    caller's behalf would otherwise see only global values (``State.get_local`` and
    ``config_states``: internal, the same from 0.10.2 to 0.12).
    """
    unset = _config.config_ext.unset
    local = [(st, v) for st in getattr(_config, "config_states", {}).values()
             if (v := st.get_local()) is not unset]

    def enter() -> ExitStack:
        stack = ExitStack()
        for st, v in local:
            stack.enter_context(st(v))
        return stack
    return enter


# ----------------------------------------------------------------------------
# Caches, configuration, arrays, meshes

def trace_context() -> tuple:
    """jax's trace context (``jax_enable_x64``, the active mesh, ...), the part of
    ``jax.jit``'s cache key that configuration changes; internal in every version."""
    return _config.trace_context()


def register_cache(cache, for_what: str) -> None:
    """Register ``cache`` (``cache_clear``/``cache_info``) so that ``jax.clear_caches``
    empties it too (``util.register_cache``, internal in every version)."""
    _util.register_cache(cache, for_what)


def array_impl_type() -> type[jax.Array]:
    """The concrete class of ``jax.Array``, for ``type(x) is ...`` checks on the
    dispatch path (``jax.Array`` is an abstract base, and ``isinstance`` against it
    costs more); internal in every version."""
    return _ArrayImpl


def gspmd_sharding(devices, hlo_sharding):
    """A ``jax.sharding.Sharding`` for an XLA ``HloSharding`` over ``devices`` (what an
    executable reports it was compiled with). ``GSPMDSharding`` has had no public
    name since ``jax.sharding.GSPMDSharding`` was removed (before 0.10)."""
    return _GSPMDSharding(tuple(devices), hlo_sharding)


def concrete_mesh():
    """The mesh of ``with jax.set_mesh(mesh)`` or else ``with mesh:``, or None, usable
    while tracing. ``jax.sharding.get_mesh`` refuses to run under a trace, and the
    legacy ``with mesh:`` environment has no public reader."""
    for mesh in (_mesh_lib.get_concrete_mesh(), _mesh_lib.thread_resources.env.physical_mesh):
        if mesh is not None and not mesh.empty:
            return mesh
    return None


def _mesh_contexts() -> tuple:
    """``(abstract, concrete)``: jax's two thread-local mesh contexts, the ``Config``
    objects behind ``jax.sharding.use_abstract_mesh`` and ``jax.set_mesh``.

    jax 0.10 and 0.11 keep them in ``jax._src.config`` (``abstract_mesh_context_manager``,
    default None; ``device_context``, default None); jax 0.12 moved both to
    ``jax._src.mesh`` (defaults: the empty abstract and the empty concrete mesh). Both
    are internal; ``get_abstract_mesh``/``get_concrete_mesh`` read them in every version.
    """
    found = []
    for name in ("abstract_mesh_context_manager", "device_context"):
        ctx = getattr(_mesh_lib, name, None)
        found.append(ctx if ctx is not None else getattr(_config, name))
    return found[0], found[1]


_UNBOUND_AXIS = re.compile(r"unbound axis name: ([^\s]+?)\.?(?:\s|$)")


def unbound_collective(exc: BaseException) -> tuple[str, tuple[str, ...]] | None:
    """``(collective, axis names)`` when ``exc`` is jax's refusal of a collective
    (``psum``, ``all_gather``, ``ppermute``, ``axis_index``...) over axes that no
    ``shard_map`` in context binds; None for any other error.

    jax says so in two ways, neither public: a ``NameError`` "unbound axis name: x"
    (the axis read from the message), or, for a ``psum``/``ppermute`` under
    ``check_vma=True``, a bare ``AssertionError`` in ``core.pvary``, whose frame holds
    the axes and the mesh in context (0.10 to 0.12). The collective is the outermost
    frame of ``jax/_src/lax/parallel.py``: the function the user called.
    """
    axes: tuple[str, ...] = ()
    if isinstance(exc, NameError):
        found = _UNBOUND_AXIS.search(str(exc))
        axes = (found.group(1),) if found else ()
    op = None
    tb = exc.__traceback__
    while tb is not None:
        code, local = tb.tb_frame.f_code, tb.tb_frame.f_locals
        if op is None and code.co_filename.endswith(("lax/parallel.py", "lax\\parallel.py")):
            op = code.co_name
        if isinstance(exc, AssertionError) and code.co_name == "pvary" \
                and code.co_filename.endswith("core.py") and "cur_mesh" in local:
            names = local.get("axes", ())
            names = names if isinstance(names, tuple) else (names,)
            bound = set(local["cur_mesh"].axis_names or ())
            axes = tuple(a for a in names if a not in bound)
        tb = tb.tb_next
    if not axes or op is None:
        return None
    return op.lstrip("_"), axes


def shard_map_mesh_refused(exc: BaseException) -> tuple | None:
    """``(the mesh passed to shard_map, the abstract mesh in context)`` when ``exc`` is
    jax's refusal of a ``shard_map(..., mesh=)`` whose mesh is not the one in context
    (a ``ValueError`` from ``_shmap_checks``, whose frame holds both, 0.10 to 0.12);
    None for any other error."""
    if not isinstance(exc, ValueError):
        return None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "_shmap_checks" and "ctx_mesh" in frame.f_locals:
            return frame.f_locals["mesh"], frame.f_locals["ctx_mesh"]
        tb = tb.tb_next
    return None


@contextlib.contextmanager
def mesh_scope(abstract, concrete=None):
    """Trace under a task's mesh inside a program traced under a larger one.

    ``jax.sharding.use_abstract_mesh`` refuses to change the mesh's size and
    ``jax.set_mesh`` refuses to run under a trace; a task's body is traced inside the
    program's trace, on a submesh, so both contexts (the abstract mesh that
    ``PartitionSpec``s resolve against and the concrete one) are swapped here
    directly, as those two do (:func:`_mesh_contexts`: where each jax version keeps
    them). ``concrete`` None leaves no concrete mesh in scope, and ``abstract`` None no
    mesh at all (the runtime's own programs, which name their mesh, run so whatever
    mesh the caller entered). The scope is a :func:`many_meshes` scope too.
    """
    abstract_ctx, concrete_ctx = _mesh_contexts()
    conc = _mesh_lib.empty_concrete_mesh if concrete is None else concrete
    abstract = _mesh_lib.empty_abstract_mesh if abstract is None else abstract
    with many_meshes():
        prev_abstract = abstract_ctx.swap_local(abstract)
        prev_concrete = concrete_ctx.swap_local(conc)
        _THREAD.mesh_scopes += 1
        try:
            yield
        finally:
            _THREAD.mesh_scopes -= 1
            abstract_ctx.set_local(prev_abstract)
            concrete_ctx.set_local(prev_concrete)


class _Depth(threading.local):
    depth = 0  # many_meshes scopes open in this thread
    mesh_scopes = 0  # mesh_scope blocks open in this thread (a subset of those)


_THREAD = _Depth()


def mesh_scope_depth() -> int:
    """How many :func:`mesh_scope` blocks (task meshes, not whole-program
    :func:`many_meshes` scopes) this thread is in."""
    return _THREAD.mesh_scopes


@contextlib.contextmanager
def many_meshes():
    """Trace a program of many meshes (an ``mjit`` trace, a task's body) in this thread:
    inside, jax's own ``jax.sharding.use_abstract_mesh`` may enter a mesh of another size.

    Why: jax's rules enter the mesh a value is typed on (batching's ``broadcast``,
    "delete once jaxpr arguments always have the context mesh"; the transpose of
    ``reshard``, which ``sub``'s JVP inserts between a stage's output and a target read
    on the global mesh; ``scan``'s and ``lax``'s helpers). In an MPMD program a value
    made by a task is typed on that task's mesh, of another size than the program's
    mesh or another task's, and jax's size check (a guard for a single-mesh program)
    would refuse the program's own values.

    How, and why so: no jax class is patched for good. jax's rules import
    ``use_abstract_mesh`` by name into a dozen modules, so no single name can be
    rebound, and its check compares against the thread's current mesh, which a task
    scope must set. So the class's ``__enter__`` is swapped for a lenient one when the
    first such scope (in any thread) opens, and put back when the last one closes
    (a process-wide count under a lock). Outside every scope jax's class is jax's own,
    and a user's ``jax.sharding.use_abstract_mesh`` refuses to change the mesh's size
    as jax's does. While a scope is open, the swapped ``__enter__`` runs jax's own in
    every thread that is not inside one (a thread-local depth), so another thread's
    program keeps jax's check; inside, it enters as jax's does (``swap_local`` of the
    abstract mesh; ``__exit__`` unchanged) minus the size check. The class and its
    ``__enter__``/``__exit__`` pair are the same on jax 0.10.2, 0.11 and 0.12; only the
    context it swaps moved (:func:`_mesh_contexts`).
    """
    with _LENIENT:
        _THREAD.depth += 1
        try:
            yield
        finally:
            _THREAD.depth -= 1


class _LenientEnter:
    """The process-wide count of :func:`many_meshes` scopes, which swaps jax's
    ``use_abstract_mesh.__enter__`` while it is above zero."""
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._strict: Callable | None = None

    def __enter__(self) -> None:
        with self._lock:
            if self._open == 0:
                self._install()
            self._open += 1

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._uninstall()

    def _install(self) -> None:
        cls = _mesh_lib.use_abstract_mesh
        strict = cls.__dict__["__enter__"]
        abstract_ctx = _mesh_contexts()[0]
        self._strict = strict

        def __enter__(self):  # noqa: N807  (jax's method, the lenient way)
            if _THREAD.depth:
                self.prev = abstract_ctx.swap_local(self.mesh)
                return None
            return strict(self)

        cls.__enter__ = __enter__  # type: ignore[method-assign]

    def _uninstall(self) -> None:
        _mesh_lib.use_abstract_mesh.__enter__ = self._strict  # type: ignore[method-assign,assignment]
        self._strict = None


_LENIENT = _LenientEnter()


# ----------------------------------------------------------------------------
# Multi-process

def distributed_client():
    """The ``jax.distributed`` coordination client of this process, or None (for the
    key-value store the peer watchdog uses); internal in every version."""
    return _distributed.global_state.client


def cluster_env_base() -> tuple[type, list]:
    """``(ClusterEnv, registered)``: jax's base class for cluster auto-detection and
    its list of detected subclasses, so ``python -m multimesh.launch`` can be found
    by a plain ``jax.distributed.initialize()`` like SLURM is; internal in every
    version."""
    return _clusters.ClusterEnv, _clusters.ClusterEnv._cluster_types


def backends_initialized() -> bool:
    """Whether this process has set up its jax backends (``xla_bridge._backends``,
    internal in every version). Under ``jax.distributed`` that set-up exchanges every
    process's device topology, so a process that exits before it strands the others."""
    return bool(getattr(_xla_bridge, "_backends", None))


def sdy_mpmd_partitioner():
    """jaxlib's Shardy:MPMD partitioner extension (``jaxlib._sdy_mpmd``: no public
    name). In jaxlib 0.10 to 0.12 the extension imports ``jax.jaxlib._jax``, which
    these versions install as ``jaxlib._jax`` only, so that name is aliased first."""
    sys.modules.setdefault("jax.jaxlib", jaxlib)
    sys.modules.setdefault("jax.jaxlib._jax", jaxlib._jax)
    return importlib.import_module("jaxlib._sdy_mpmd")  # an extension module, untyped


def unused_inputs(closed) -> set[int]:
    """Positions of a closed jaxpr's inputs that no equation and no output reads
    (what ``jax.jit(keep_unused=False)`` drops)."""
    jaxpr = closed.jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars}
    used |= {id(v) for v in jaxpr.outvars}
    return {i for i, v in enumerate(jaxpr.invars) if id(v) not in used}


def staging() -> bool:
    """Whether the current trace stages out a program (``jax.jit``, ``jax.eval_shape``)
    rather than running now (eagerly, or under eager ``jax.grad``/``jax.vmap``): some
    trace between here and the bottom is a jaxpr trace. jax has no public way to ask."""
    trace = getattr(getattr(_core, "trace_ctx", None), "trace", None)
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# ----------------------------------------------------------------------------
# Named scopes (registered tasks trace under their mesh)

class _NameScopeHooks(threading.local):
    def __init__(self) -> None:
        self.hooks: list[Callable[[str], contextlib.AbstractContextManager | None]] = []
        self.entered: list[tuple[int, contextlib.AbstractContextManager]] = []


_NAME_HOOKS = _NameScopeHooks()


@contextlib.contextmanager
def name_scope_hook(enter: Callable[[str], contextlib.AbstractContextManager | None]):
    """While the block runs, in this thread, ``enter(name_stack)`` is called as each
    ``jax.named_scope`` (a linen module's call, an NNX module's under multimesh's
    naming, a user's block) is entered, with the name stack it opens as text
    (``Model/layers_0``); the context manager it returns, if any, is held until that
    scope exits.

    jax has no public hook on its name stack; ``jax.named_scope`` enters
    ``source_info_util.ExtendNameStackContextManager`` (the same class on 0.10 to
    0.12), whose ``__enter__``/``__exit__`` are wrapped once, here, and call the
    hooks of the thread that enters them (none: jax's own code alone).
    """
    _wrap_name_scopes()
    _NAME_HOOKS.hooks.append(enter)
    try:
        yield
    finally:
        _NAME_HOOKS.hooks.pop()


def _wrap_name_scopes() -> None:
    cls = _siu.ExtendNameStackContextManager
    if getattr(cls, "_multimesh_hooked", False):
        return
    plain_enter, plain_exit = cls.__enter__, cls.__exit__

    def enter(self):
        stack = plain_enter(self)
        hooks = _NAME_HOOKS.hooks
        if hooks:
            try:
                held = hooks[-1](str(stack))
                if held is not None:
                    held.__enter__()
            except BaseException:
                plain_exit(self, None, None, None)
                raise
            if held is not None:
                _NAME_HOOKS.entered.append((id(self), held))
        return stack

    def exit_(self, *exc):
        entered = _NAME_HOOKS.entered
        try:
            if entered and entered[-1][0] == id(self):
                entered.pop()[1].__exit__(*exc)
        finally:
            plain_exit(self, *exc)

    hooked: Any = cls  # its methods are replaced, which mypy refuses for a class
    hooked.__enter__, hooked.__exit__ = enter, exit_
    hooked._multimesh_hooked = True
