"""``mm-extract-fragments``: one standalone SPMD module per fragment, nested in the program."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import mesh_ops
from multimesh._src.mlir import ir, stablehlo

from . import _contract as c
from .base import ModulePass


@dataclass(frozen=True)
class ExtractFragmentsPass(ModulePass):
    """Turn each fragment function into a nested module that XLA can compile as is.

    ``func.func private @layer1_fwd`` becomes

        module @layer1_fwd attributes {mm.devices = [...], mm.task = {...},
                                      mhlo.num_partitions = 4, mhlo.num_replicas = 1} {
          sdy.mesh @mesh_layer1 = <...>
          func.func public @main(...)    // no mm.* attributes inside
        }

    and each call becomes ``stablehlo.custom_call @mm.fragment_call(...)
    {mm.fragment = @layer1_fwd}``. ``@main`` then reads as the whole MPMD program:
    fragment calls, transfers and the return (and a microbatch loop, whose body
    function is rewritten the same way). Fragments with identical bodies get
    identical nested modules, which the runtime compiles once.
    """

    argument = "mm-extract-fragments"
    summary = "Move each fragment into its own nested SPMD module called by `mm.fragment_call`."
    consumes = ("mpmd",)
    requires = ("mm-propagate-shardings",)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            meshes = mesh_ops(module)
            calls = _fragment_calls(main, funcs)
            infos = {n: c.fragment_info(funcs[n], meshes, need_task=True)
                     for n in map(c.callee_of, calls)}
            # Shardings inside a fragment name its own mesh, or one of jax's own (e.g.
            # @empty_mesh); only those need a look, and none at all if there are none.
            foreign = set(meshes) - {info.mesh for info in infos.values()}
            done = set()
            for call in calls:
                name = c.callee_of(call)
                if name not in done:
                    done.add(name)
                    _nest(funcs[name], infos[name], meshes, foreign)
                _to_fragment_call(call, name)


def _fragment_calls(main: ir.Operation, funcs: dict[str, ir.Operation]) -> list[ir.Operation]:
    """The calls of ``@main`` and of microbatch loop bodies, all checked to be fragments."""
    blocks = [c.entry_block(main)]
    for op in c.entry_block(main).operations:
        if c.is_custom_call(op.operation, c.LOOP_TARGET):
            body, _ = c.loop_body(op.operation, funcs)
            blocks.append(c.entry_block(body))
    calls = [o.operation for b in blocks for o in b.operations
             if o.operation.name == "func.call"]
    for call in calls:
        if c.FRAGMENT_ATTR not in call.attributes:
            raise DiagnosticError(
                "call in @main is not a fragment call; run mm-outline-fragments first",
                call.location)
    return calls


def _nest(fn: ir.Operation, info: c.FragmentInfo, meshes: dict[str, ir.Operation],
          foreign: set[str]) -> None:
    """Move fragment ``fn`` into a nested module of its own, as its public ``@main``,
    with copies of the meshes it names."""
    name = c.func_name(fn)
    mesh_sym = info.mesh
    assert mesh_sym is not None  # fragment_info was given the meshes
    i32 = ir.IntegerType.get_signless(32)
    with ir.InsertionPoint(fn), fn.location:
        sub = ir.Operation.create("builtin.module", regions=1)
    sub.regions[0].blocks.append()
    sub.attributes["sym_name"] = ir.StringAttr.get(name)
    for key in (c.DEVICES_ATTR, c.TASK_ATTR, c.SPLIT_ATTR, c.LOOP_DEVICES_ATTR):
        if key in fn.attributes:
            sub.attributes[key] = fn.attributes[key]
    sub.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, len(info.devices))
    sub.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)
    body = sub.regions[0].blocks[0]
    meshes[mesh_sym].clone(ip=ir.InsertionPoint(body))
    others = c.scan_fragment(fn, foreign | {mesh_sym})[0] if foreign else []
    for other in others:
        if other != mesh_sym:
            meshes[other].clone(ip=ir.InsertionPoint(body))
    body.append(fn)
    fn.attributes["sym_name"] = ir.StringAttr.get("main")
    fn.attributes["sym_visibility"] = ir.StringAttr.get("public")
    _strip(fn)


def _to_fragment_call(call: ir.Operation, name: str) -> None:
    """``func.call @f`` -> ``stablehlo.custom_call @mm.fragment_call {mm.fragment = @f}``."""
    i32 = ir.IntegerType.get_signless(32)
    with ir.InsertionPoint(call), call.location:
        op = stablehlo.CustomCallOp(
            [r.type for r in call.results], list(call.operands),
            call_target_name=ir.StringAttr.get(c.FRAGMENT_CALL_TARGET),
            has_side_effect=ir.BoolAttr.get(False),
            api_version=ir.IntegerAttr.get(i32, 1))
    op.operation.attributes[c.FRAGMENT_ATTR] = ir.FlatSymbolRefAttr.get(name)
    for old, new in zip(call.results, op.results):
        old.replace_all_uses_with(new)
    call.erase()


def _strip(fn: ir.Operation) -> None:
    """Drop every ``mm.*`` attribute inside the fragment (XLA sees plain StableHLO + sdy)."""
    def cb(o):
        attrs = o.attributes
        if len(attrs):
            names = [a if isinstance(a, str) else a.name for a in attrs]
            for n in names:
                if n.startswith(c.PREFIX):
                    del attrs[n]
        return ir.WalkResult.ADVANCE

    fn.walk(cb, ir.WalkOrder.PRE_ORDER)
