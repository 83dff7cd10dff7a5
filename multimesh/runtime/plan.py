"""Read the MPMD form of a module (docs/ir.md §4) into a runnable plan.

The plan is plain data: fragments (a standalone SPMD module each, its devices
and argument/result layouts) and, per call, which values feed it. Transfers are
decided here, once, by comparing where a value lives with where its consumer
wants it, so the hot loop in :mod:`executor` does no sharding comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multimesh._src.errors import MultimeshValueError
from multimesh._src.layouts import layout_key
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
    microbatch: int = -1


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
    """Build a :class:`Plan` from a module after ``mm-extract-fragments``."""
    with module.context:
        subs: dict[str, ir.Operation] = {}
        main = None
        for op in module.body.operations:
            op = op.operation
            if op.name == "builtin.module":
                subs[ir.StringAttr(op.attributes["sym_name"]).value] = op
            elif op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                main = op
        if main is None:
            raise MultimeshValueError("The module has no 'main' function.")
        attrs = module.operation.attributes
        num_devices = ir.IntegerAttr(attrs["mm.num_devices"]).value \
            if "mm.num_devices" in attrs else 1
        block = main.regions[0].blocks[0]
        ids: dict[ir.Value, int] = {a: i for i, a in enumerate(block.arguments)}
        input_ids = list(range(len(ids)))
        arg_attrs = _attr_list(main, "arg_attrs", len(input_ids))
        inputs: list[Layout] = []
        for a, d in zip(block.arguments, arg_attrs):
            rank = len(ir.RankedTensorType(a.type).shape)
            if d is not None and "mm.sharding" in d and "mm.devices" in d:
                inputs.append(_layout_from(d["mm.devices"], d["mm.sharding"], subs, main))
            else:  # unused by any fragment: keep it replicated on every device
                inputs.append((tuple(range(num_devices)), ("x",), (num_devices,),
                               tuple(() for _ in range(rank))))
        layout_of: dict[int, Layout] = dict(enumerate(inputs))
        fragments: dict[str, Fragment] = {}
        steps: list = []
        ret = None
        for op in block.operations:
            op = op.operation
            if op.name == "func.return":
                ret = op
                continue
            target = (ir.StringAttr(op.attributes["call_target_name"]).value
                      if op.name == "stablehlo.custom_call" else None)
            if target == "mm.transfer":
                src = ids[op.operands[0]]
                dst = len(ids)
                ids[op.results[0]] = dst
                lay = _layout_from(op.attributes["mm.devices"], op.attributes["mm.sharding"],
                                   subs, main)
                steps.append(Transfer(src, dst, lay))
                layout_of[dst] = lay
            elif target == "mm.fragment_call":
                fname = ir.FlatSymbolRefAttr(op.attributes["mm.fragment"]).value
                if fname not in fragments:
                    fragments[fname] = _fragment(fname, subs[fname])
                frag = fragments[fname]
                args = [ids[v] for v in op.operands]
                for k, (vid, want) in enumerate(zip(args, frag.in_layouts)):
                    if layout_of[vid] != want and layout_key(*layout_of[vid]) != \
                            layout_key(*want):
                        raise MultimeshValueError(
                            f"Fragment '{fname}' argument #{k} is laid out as "
                            f"{layout_of[vid]} but the fragment wants {want}; the module is "
                            f"missing an mm.transfer (run mm-insert-transfers).")
                results = []
                for r, lay in zip(op.results, frag.out_layouts):
                    rid = len(ids)
                    ids[r] = rid
                    layout_of[rid] = lay
                    results.append(rid)
                steps.append(Call(fname, args, results))
            else:
                raise MultimeshValueError(
                    f"Expected only fragment calls and transfers in @main, found '{op.name}'"
                    + (f" @{target}" if target else "") + "; run mm-extract-fragments.")
        outputs = [ids[v] for v in ret.operands]
        plan = Plan(num_devices, fragments, steps, inputs, input_ids, outputs,
                    [layout_of[o] for o in outputs])
        for i, s in enumerate(steps):
            for vid in (s.args if isinstance(s, Call) else [s.src]):
                plan.last_use[vid] = i
        return plan


def _mesh_of(sub: ir.Operation):
    for op in sub.regions[0].blocks[0].operations:
        if op.operation.name == "sdy.mesh":
            return op.operation
    raise MultimeshValueError("A fragment module has no sdy.mesh.")


def _layout_from(devices_attr, sharding_attr, subs, main) -> Layout:
    devices = tuple(attr_to_py(devices_attr))
    ts = sdy.TensorShardingAttr(sharding_attr)
    mesh_ref = ts.mesh_or_ref
    if isinstance(mesh_ref, ir.FlatSymbolRefAttr):
        name = mesh_ref.value
        mesh = _find_mesh(main, name)
    else:
        mesh = sdy.MeshAttr(mesh_ref)
    names = tuple(sdy.MeshAxisAttr(a).name for a in mesh.axes)
    sizes = tuple(sdy.MeshAxisAttr(a).size for a in mesh.axes)
    return devices, names, sizes, _sharding_dims(sharding_attr)


def _find_mesh(main: ir.Operation, name: str):
    top = main.parent
    for op in top.regions[0].blocks[0].operations:
        op = op.operation
        if op.name == "sdy.mesh" and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return sdy.MeshAttr(op.attributes["mesh"])
    raise MultimeshValueError(f"Unknown mesh @{name}.")


def _fragment(name: str, sub: ir.Operation) -> Fragment:
    task = attr_to_py(sub.attributes["mm.task"])
    devices = tuple(attr_to_py(sub.attributes["mm.devices"]))
    mesh = sdy.MeshAttr(_mesh_of(sub).attributes["mesh"])
    axis_names = tuple(sdy.MeshAxisAttr(a).name for a in mesh.axes)
    axis_sizes = tuple(sdy.MeshAxisAttr(a).size for a in mesh.axes)
    fn = None
    for op in sub.regions[0].blocks[0].operations:
        if op.operation.name == "func.func":
            fn = op.operation
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)

    def layouts(which, n):
        return [(devices, axis_names, axis_sizes, _sharding_dims(a["sdy.sharding"]))
                for a in _attr_list(fn, which, n)]

    return Fragment(name, task["name"], int(task["transpose_count"]), devices, axis_names,
                    axis_sizes, _standalone(sub), layouts("arg_attrs", len(ftype.inputs)),
                    layouts("res_attrs", len(ftype.results)),
                    [_type_info(t) for t in ftype.inputs], [_type_info(t) for t in ftype.results],
                    int(task.get("microbatch", -1)))


def _standalone(sub: ir.Operation) -> str:
    """The nested module as its own text, with a generic name and no mm.* attributes.

    A generic module name makes identical fragments (the same stage in every
    microbatch) identical text, so they compile once.
    """
    m = ir.Module.parse(sub.get_asm())
    op = m.operation
    for n in [a if isinstance(a, str) else a.name for a in op.attributes]:
        if n.startswith("mm."):
            del op.attributes[n]
    op.attributes["sym_name"] = ir.StringAttr.get("multimesh_fragment")
    return print_module(m)
