"""``mm-insert-transfers``: an explicit ``mm.transfer`` on every edge that moves or reshards."""

from __future__ import annotations

from dataclasses import dataclass

from mlir_passes import _contract as c
from mlir_passes.base import ModulePass
from multimesh._src.errors import DiagnosticError
from multimesh._src.layouts import layout_key
from multimesh._src.mlir import attr_to_py, ir, sdy, stablehlo


@dataclass(frozen=True)
class InsertTransfersPass(ModulePass):
    """Make every cross-submesh or resharding edge of ``@main`` an explicit op.

    Input is the MPMD form after ``mm-propagate-shardings``: a value lives where its
    producer put it (a fragment result's ``sdy.sharding`` on the fragment's
    ``mm.devices``, or an argument's ``mm.sharding``/``mm.devices``). Where a
    consuming fragment wants another device set or layout, the pass inserts

        %t = stablehlo.custom_call @mm.transfer(%v)
               {mm.devices = [...], mm.sharding = #sdy.sharding<@mesh_b, ...>}

    right after the producer, so the copy can start as early as possible, and
    rewires the consumer to ``%t``. One transfer per value and destination layout.
    Two layouts are the same when every device holds the same piece of the value,
    whatever the mesh axes are called (``multimesh._src.layouts.layout_key``).
    """

    argument = "mm-insert-transfers"
    summary = "Insert an explicit `mm.transfer` on every edge that changes devices or sharding."
    consumes = ("mpmd",)
    requires = ("mm-propagate-shardings",)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            meshes = {ir.StringAttr(o.operation.attributes["sym_name"]).value:
                      o.operation.attributes["mesh"]
                      for o in module.body.operations if o.operation.name == "sdy.mesh"}
            block = c.entry_block(main)
            args_attrs = (list(main.attributes["arg_attrs"]) if "arg_attrs" in main.attributes
                          else [None] * len(block.arguments))
            where: dict[ir.Value, tuple] = {}
            for a, attrs in zip(block.arguments, args_attrs):
                d = ir.DictAttr(attrs) if attrs is not None else None
                if d is not None and "mm.sharding" in d and "mm.devices" in d:
                    c.check_placement(d["mm.devices"], d["mm.sharding"], meshes,
                                      f"@main argument #{a.arg_number}", main.location)
                    where[a] = _layout(d["mm.devices"], d["mm.sharding"], meshes)
            plans = []  # (consumer call, operand index, value, layout, sharding, devices)
            calls = [o.operation for o in block.operations if o.operation.name == "func.call"]
            for call in calls:
                fn = funcs[c.callee_of(call)]
                devs = c.fragment_info(fn, meshes).devices_attr
                arg_attrs = list(fn.attributes["arg_attrs"]) if "arg_attrs" in fn.attributes \
                    else []
                for k, v in enumerate(call.operands):
                    if k >= len(arg_attrs) or "sdy.sharding" not in ir.DictAttr(arg_attrs[k]):
                        raise DiagnosticError(
                            f"fragment '@{c.callee_of(call)}' argument #{k} has no sdy.sharding; "
                            f"run mm-propagate-shardings first", call.location)
                    sh = ir.DictAttr(arg_attrs[k])["sdy.sharding"]
                    want = _layout(devs, sh, meshes)
                    have = where.get(v)
                    if have is not None and have != want:
                        plans.append((call, k, v, want, sh, devs))
                res_attrs = list(fn.attributes["res_attrs"]) if "res_attrs" in fn.attributes \
                    else []
                for j, (r, ra) in enumerate(zip(call.results, res_attrs)):
                    if "sdy.sharding" not in ir.DictAttr(ra):
                        raise DiagnosticError(
                            f"fragment '@{c.callee_of(call)}' result #{j} has no sdy.sharding; "
                            f"run mm-propagate-shardings first", call.location)
                    where[r] = _layout(devs, ir.DictAttr(ra)["sdy.sharding"], meshes)
            made: dict[tuple, ir.Value] = {}
            for call, k, v, want, sh, devs in plans:
                key = (v, want)
                t = made.get(key)
                if t is None:
                    owner = v.owner
                    ip = (ir.InsertionPoint.at_block_begin(block) if isinstance(owner, ir.Block)
                          else ir.InsertionPoint.after(owner))
                    with ip, call.location:
                        op = stablehlo.CustomCallOp(
                            [v.type], [v], call_target_name=ir.StringAttr.get(c.TRANSFER_TARGET),
                            has_side_effect=ir.BoolAttr.get(False),
                            api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1))
                    op.operation.attributes["mm.devices"] = devs
                    op.operation.attributes["mm.sharding"] = sh
                    t = op.results[0]
                    made[key] = t
                call.operands[k] = t


def _layout(devices: ir.Attribute, sharding: ir.Attribute, meshes: dict[str, str]):
    """The device -> shard mapping of a value (see ``multimesh._src.layouts``)."""
    ts = sdy.TensorShardingAttr(sharding)
    mesh = ts.mesh_or_ref
    if isinstance(mesh, ir.FlatSymbolRefAttr):
        mesh = meshes[mesh.value]
    mesh = sdy.MeshAttr(mesh)
    names = [sdy.MeshAxisAttr(a).name for a in mesh.axes]
    sizes = [sdy.MeshAxisAttr(a).size for a in mesh.axes]
    dims = [[sdy.AxisRefAttr(a).name for a in sdy.DimensionShardingAttr(d).axes]
            for d in ts.dimension_shardings]
    return layout_key(attr_to_py(devices), names, sizes, dims)
