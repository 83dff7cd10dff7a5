"""``mm-propagate-shardings``: Shardy propagation inside each fragment, one mesh at a time."""

from __future__ import annotations

from dataclasses import dataclass

from mlir_passes import _contract as c
from mlir_passes.base import ModulePass
from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import ir, passmanager, sdy

SHARDING = "sdy.sharding"
_ALL_MESHES: dict[int, dict] = {}  # module id -> its meshes, while the pass runs


@dataclass(frozen=True)
class PropagateShardingsPass(ModulePass):
    """Run ``sdy-propagation-pipeline`` on every fragment in its own module.

    Shardy needs every mesh of a module to have one device count, so each
    fragment is propagated alone, on its task's mesh. Fragments are visited in
    ``@main`` order; an argument that receives a value already laid out on an
    equivalent mesh (same axis names and sizes) starts from that layout, so a
    forward fragment hands its residuals to the backward one with no reshard and a
    pipeline stage hands activations to the next with a pure device-to-device
    copy. Afterwards every fragment argument and result carries a closed
    ``sdy.sharding``, and every ``@main`` argument carries ``mm.sharding`` and
    ``mm.devices`` (the layout of its first consumer), which is where the program wants its inputs.
    """

    argument = "mm-propagate-shardings"
    summary = "Propagate shardings inside each fragment with Shardy, one submesh at a time."
    consumes = ("mpmd",)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            meshes = _meshes(module)
            _ALL_MESHES[id(module)] = meshes
            # value -> (mesh symbol, sharding attr, devices attr) as laid out where it lives
            layout: dict[ir.Value, tuple[str, ir.Attribute, ir.Attribute]] = {}
            pm = passmanager.PassManager.parse("builtin.module(sdy-aggressive-propagate)")
            calls = c.fragment_calls(main)
            # Check every fragment before Shardy sees any (it may crash on bad input).
            infos = {n: c.fragment_info(funcs[n], meshes) for n in map(c.callee_of, calls)}
            for n in infos:
                c.reject_internal_sdy_ops(funcs[n])
            for call in calls:
                name = c.callee_of(call)
                fn = funcs[name]
                mesh_sym = infos[name].mesh
                mesh = meshes[mesh_sym]
                hints = []
                for v in call.operands:
                    src = layout.get(v)
                    if src is not None and _same_shape(meshes[src[0]], mesh):
                        hints.append(_rebase(src[1], mesh_sym))
                    else:
                        hints.append(None)
                done = _propagate(module, fn, mesh_sym, mesh, hints, pm)
                arg_sh = _shardings(done, "arg_attrs", len(call.operands), mesh_sym)
                res_sh = _shardings(done, "res_attrs", len(call.results), mesh_sym)
                done.erase()
                # Only the boundary is kept: XLA re-propagates inside the body at compile
                # time, exactly as for a plain jax module.
                _write(fn, "arg_attrs", arg_sh)
                _write(fn, "res_attrs", res_sh)
                devs = infos[name].devices_attr
                for v, sh in zip(call.operands, arg_sh):
                    if isinstance(v.owner, ir.Block) and v not in layout:
                        layout[v] = (mesh_sym, sh, devs)
                for r, sh in zip(call.results, res_sh):
                    layout[r] = (mesh_sym, sh, devs)
            blk = c.entry_block(main)
            attrs = []
            old = list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes else []
            for i, a in enumerate(blk.arguments):
                d = {}
                if i < len(old):
                    od = ir.DictAttr(old[i])
                    d = {od[k].name: od[k].attr for k in range(len(od))}
                if a in layout:
                    d["mm.sharding"] = layout[a][1]
                    d["mm.devices"] = layout[a][2]
                attrs.append(ir.DictAttr.get(d))
            main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
            _ALL_MESHES.pop(id(module), None)


def _meshes(module) -> dict[str, ir.Attribute]:
    out = {}
    for op in module.body.operations:
        op = op.operation
        if op.name == "sdy.mesh":
            out[ir.StringAttr(op.attributes["sym_name"]).value] = op.attributes["mesh"]
    return out


def _same_shape(a: ir.Attribute, b: ir.Attribute) -> bool:
    return str(a) == str(b)


def _rebase(sharding: ir.Attribute, mesh_sym: str) -> ir.Attribute:
    ts = sdy.TensorShardingAttr(sharding)
    return sdy.TensorShardingAttr.get(
        mesh_sym, list(ts.dimension_shardings), replicated_axes=list(ts.replicated_axes))


def _propagate(module, fn, mesh_sym, mesh, hints, pm) -> ir.Operation:
    name = c.func_name(fn)
    tmp = ir.Module.create(fn.location)
    with ir.InsertionPoint(tmp.body), fn.location:
        sdy.MeshOp(mesh_sym, mesh)
    for other in c.referenced_meshes(fn, set(_ALL_MESHES.get(id(module), {}))):
        if other != mesh_sym:
            with ir.InsertionPoint(tmp.body), fn.location:
                sdy.MeshOp(other, _ALL_MESHES[id(module)][other])
    clone = fn.clone(ip=ir.InsertionPoint(tmp.body))
    clone.attributes["sym_name"] = ir.StringAttr.get("main")
    clone.attributes["sym_visibility"] = ir.StringAttr.get("public")
    n = len(c.entry_block(clone).arguments)
    old = list(clone.attributes["arg_attrs"]) if "arg_attrs" in clone.attributes else [None] * n
    attrs = []
    for h, o in zip(hints, old):
        d = {}
        if o is not None:
            od = ir.DictAttr(o)
            d = {od[k].name: od[k].attr for k in range(len(od))}
        if h is not None:
            d[SHARDING] = h
        attrs.append(ir.DictAttr.get(d))
    clone.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
    try:
        pm.run(tmp.operation)
    except ir.MLIRError as e:
        d = e.error_diagnostics[0] if e.error_diagnostics else None
        raise DiagnosticError(
            f"sharding propagation failed in fragment '{name}': {d.message if d else e}",
            d.location if d else fn.location) from None
    new_main = None
    for op in tmp.body.operations:
        if op.operation.name == "func.func":
            new_main = op.operation
    return new_main.detach_from_parent()


def _shardings(fn, which: str, n: int, mesh_sym: str) -> list[ir.Attribute]:
    out = []
    attrs = list(fn.attributes[which]) if which in fn.attributes else [None] * n
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    types = ftype.inputs if which == "arg_attrs" else ftype.results
    for i in range(n):
        a = attrs[i] if i < len(attrs) else None
        sh = None
        if a is not None:
            d = ir.DictAttr(a)
            if SHARDING in d:
                sh = d[SHARDING]
        if sh is None:
            rank = len(ir.RankedTensorType(types[i]).shape) if _ranked(types[i]) else 0
            sh = sdy.TensorShardingAttr.get(
                mesh_sym, [sdy.DimensionShardingAttr.get([], is_closed=True)] * rank)
        out.append(_close(sh, mesh_sym))
    return out


def _ranked(t) -> bool:
    try:
        ir.RankedTensorType(t)
        return True
    except (ValueError, TypeError):
        return False


def _close(sh: ir.Attribute, mesh_sym: str) -> ir.Attribute:
    ts = sdy.TensorShardingAttr(sh)
    dims = [sdy.DimensionShardingAttr.get(list(d.axes), is_closed=True)
            for d in (sdy.DimensionShardingAttr(x) for x in ts.dimension_shardings)]
    return sdy.TensorShardingAttr.get(mesh_sym, dims)


def _write(fn, which: str, shardings) -> None:
    old = list(fn.attributes[which]) if which in fn.attributes else [None] * len(shardings)
    out = []
    for o, sh in zip(old, shardings):
        d = {}
        if o is not None:
            od = ir.DictAttr(o)
            d = {od[k].name: od[k].attr for k in range(len(od))}
        d[SHARDING] = sh
        out.append(ir.DictAttr.get(d))
    fn.attributes[which] = ir.ArrayAttr.get(out)
