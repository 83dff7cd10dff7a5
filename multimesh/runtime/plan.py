"""Read the MPMD form of a module (docs/ir.md §4) into a runnable plan.

The plan is plain data: fragments (a standalone SPMD module each, its devices
and argument/result layouts) and, per call, which values feed it. Transfers are
decided here, once, by comparing where a value lives with where its consumer
wants it, so the hot loop in :mod:`executor` does no sharding comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multimesh._src.errors import MultimeshValueError
from multimesh._src.mlir import attr_to_py, ir, print_module, sdy

Layout = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[tuple[str, ...], ...]]
"""(device positions, mesh axis names, mesh axis sizes, per-dim axes)."""


@dataclass
class Fragment:
    name: str
    task: str
    transpose_count: int
    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    text: str
    in_layouts: list[Layout]
    out_layouts: list[Layout]
    in_types: list[tuple[tuple[int, ...], str]]
    out_types: list[tuple[tuple[int, ...], str]]


@dataclass
class Transfer:
    src: int
    dst: int
    layout: Layout


@dataclass
class Call:
    fragment: str
    args: list[int]
    results: list[int]


@dataclass
class Plan:
    num_devices: int
    fragments: dict[str, Fragment]
    steps: list  # Call | Transfer, in dispatch order
    inputs: list[Layout | None]
    input_ids: list[int]
    outputs: list[int]
    out_layouts: list[Layout]
    last_use: dict[int, int] = field(default_factory=dict)

    def describe(self) -> str:
        """A readable plan: one line per fragment call and transfer."""
        lines = [f"multimesh plan over {self.num_devices} devices:"]
        for s in self.steps:
            if isinstance(s, Call):
                f = self.fragments[s.fragment]
                lines.append(f"  {s.fragment:<24} devices {list(f.devices)}  "
                             f"args {s.args} -> {s.results}")
            else:
                lines.append(f"  transfer %{s.src} -> %{s.dst} onto devices {list(s.layout[0])} "
                             f"{_spec_str(s.layout[3])}")
        lines.append(f"  outputs {self.outputs}")
        return "\n".join(lines)


def _spec_str(dims) -> str:
    return "P(" + ", ".join(repr(d[0]) if len(d) == 1 else (repr(d) if d else "None")
                            for d in dims) + ")"


def _sharding_dims(attr: ir.Attribute) -> tuple[tuple[str, ...], ...]:
    ts = sdy.TensorShardingAttr(attr)
    out = []
    for d in ts.dimension_shardings:
        dim = sdy.DimensionShardingAttr(d)
        out.append(tuple(sdy.AxisRefAttr(a).name for a in dim.axes))
    return tuple(out)


def _attr_list(fn, which, n):
    if which in fn.attributes:
        return [ir.DictAttr(a) for a in fn.attributes[which]]
    return [None] * n


def _type_info(t) -> tuple[tuple[int, ...], str]:
    rt = ir.RankedTensorType(t)
    return tuple(rt.shape), str(rt.element_type)


def build_plan(module: ir.Module) -> Plan:
    """Build a :class:`Plan` from a module in MPMD form."""
    with module.context:
        syms = {}
        meshes = {}
        main = None
        for op in module.body.operations:
            op = op.operation
            if op.name == "func.func":
                name = ir.StringAttr(op.attributes["sym_name"]).value
                syms[name] = op
                if name == "main":
                    main = op
            elif op.name == "sdy.mesh":
                meshes[ir.StringAttr(op.attributes["sym_name"]).value] = op
        if main is None:
            raise MultimeshValueError("The module has no 'main' function.")
        num_devices = ir.IntegerAttr(module.operation.attributes["mm.num_devices"]).value \
            if "mm.num_devices" in module.operation.attributes else 1
        block = main.regions[0].blocks[0]
        ids: dict[ir.Value, int] = {}
        layout_of: dict[int, Layout] = {}
        inputs: list[Layout | None] = []
        arg_attrs = _attr_list(main, "arg_attrs", len(block.arguments))
        fragments: dict[str, Fragment] = {}
        steps: list = []
        for a, attrs in zip(block.arguments, arg_attrs):
            ids[a] = len(ids)
            inputs.append(None)
        input_ids = list(range(len(ids)))
        counter = [len(ids)]

        def new_id():
            counter[0] += 1
            return counter[0] - 1

        pending_input_layouts: dict[int, Layout] = {}
        transfers_done: dict[tuple[int, Layout], int] = {}
        ret = None
        for op in block.operations:
            op = op.operation
            if op.name == "func.return":
                ret = op
                continue
            if op.name != "func.call":
                raise MultimeshValueError(
                    f"Expected only fragment calls in @main (MPMD form), found '{op.name}'.")
            fname = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
            if fname not in fragments:
                fragments[fname] = _fragment(syms[fname], meshes, syms)
            frag = fragments[fname]
            args = []
            for v, want in zip(op.operands, frag.in_layouts):
                vid = ids[v]
                if vid in input_ids and vid not in pending_input_layouts:
                    pending_input_layouts[vid] = want
                    layout_of[vid] = want
                have = layout_of[vid]
                if have != want:
                    key = (vid, want)
                    if key not in transfers_done:
                        dst = new_id()
                        steps.append(Transfer(vid, dst, want))
                        transfers_done[key] = dst
                        layout_of[dst] = want
                    vid = transfers_done[key]
                args.append(vid)
            results = []
            for r, lay in zip(op.results, frag.out_layouts):
                rid = new_id()
                ids[r] = rid
                layout_of[rid] = lay
                results.append(rid)
            steps.append(Call(fname, args, results))
        outputs = []
        for v in ret.operands:
            vid = ids[v]
            if vid in input_ids and vid not in layout_of:
                # returned unchanged and used by nothing: keep it replicated everywhere
                lay = (tuple(range(num_devices)), ("x",), (num_devices,),
                       tuple(() for _ in ir.RankedTensorType(v.type).shape))
                pending_input_layouts[vid] = lay
                layout_of[vid] = lay
            outputs.append(vid)
        for vid in input_ids:
            if vid not in pending_input_layouts:
                v = block.arguments[vid]
                rank = len(ir.RankedTensorType(v.type).shape)
                pending_input_layouts[vid] = (tuple(range(num_devices)), ("x",), (num_devices,),
                                              tuple(() for _ in range(rank)))
        plan = Plan(num_devices, fragments, steps,
                    [pending_input_layouts[i] for i in input_ids], input_ids, outputs,
                    [layout_of[o] for o in outputs])
        for i, s in enumerate(steps):
            for vid in (s.args if isinstance(s, Call) else [s.src]):
                plan.last_use[vid] = i
        return plan


def _fragment(fn: ir.Operation, meshes, syms) -> Fragment:
    name = ir.StringAttr(fn.attributes["sym_name"]).value
    task = attr_to_py(fn.attributes["mm.task"])
    devices = tuple(attr_to_py(fn.attributes["mm.devices"]))
    mesh_sym = ir.FlatSymbolRefAttr(fn.attributes["mm.mesh"]).value
    mesh = sdy.MeshAttr(meshes[mesh_sym].attributes["mesh"])
    axis_names = tuple(sdy.MeshAxisAttr(a).name for a in mesh.axes)
    axis_sizes = tuple(sdy.MeshAxisAttr(a).size for a in mesh.axes)
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)

    def layouts(which, n):
        out = []
        for a in _attr_list(fn, which, n):
            dims = _sharding_dims(a["sdy.sharding"])
            out.append((devices, axis_names, axis_sizes, dims))
        return out

    in_layouts = layouts("arg_attrs", len(ftype.inputs))
    out_layouts = layouts("res_attrs", len(ftype.results))
    text = _standalone(fn, meshes[mesh_sym], len(devices))
    return Fragment(name, task["name"], int(task["transpose_count"]), devices, axis_names,
                    axis_sizes, text, in_layouts, out_layouts,
                    [_type_info(t) for t in ftype.inputs], [_type_info(t) for t in ftype.results])


def _standalone(fn: ir.Operation, mesh_op: ir.Operation, n: int) -> str:
    """The fragment as its own SPMD module: one mesh, a public @main, no mm.* attributes."""
    m = ir.Module.create(fn.location)
    # One generic module name: identical fragments (e.g. the same stage in every
    # microbatch) then have identical text and compile once.
    m.operation.attributes["sym_name"] = ir.StringAttr.get("multimesh_fragment")
    m.operation.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(32), n)
    m.operation.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(
        ir.IntegerType.get_signless(32), 1)
    mesh_op.clone(ip=ir.InsertionPoint(m.body))
    f = fn.clone(ip=ir.InsertionPoint(m.body))
    f.attributes["sym_name"] = ir.StringAttr.get("main")
    f.attributes["sym_visibility"] = ir.StringAttr.get("public")

    def strip(o):
        for name in [a if isinstance(a, str) else a.name for a in o.attributes]:
            if name.startswith("mm."):
                del o.attributes[name]
        return ir.WalkResult.ADVANCE

    f.walk(strip, ir.WalkOrder.PRE_ORDER)
    return print_module(m)
