"""Shared readers/writers for the ``mm.*`` IR contract (docs/ir.md).

Passes use these instead of poking attributes directly, so the contract is
spelled in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import attr_to_py, dict_attr, ir, py_to_attr

TASK_ATTR = "mm.task"
TASKS_ATTR = "mm.tasks"
LOGICAL_TARGET = "mm.logical_sharding"
TRANSFER_TARGET = "mm.transfer"
FRAGMENT_CALL_TARGET = "mm.fragment_call"
DEFAULT_TASK = "mm.default"


@dataclass(frozen=True)
class TaskMeshInfo:
    """A task's submesh and logical mapping, as stored in ``mm.tasks``."""

    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    logical_axes: tuple[tuple[str, str], ...]
    split_backprop: tuple[str, str] | None = None
    """``Task.split_backprop``: name suffixes of the activation and weight halves."""

    @classmethod
    def from_dict(cls, d: dict) -> TaskMeshInfo:
        split = d.get("split_backprop")
        return cls(tuple(d["devices"]), tuple(d["axis_names"]), tuple(d["axis_sizes"]),
                   tuple(tuple(p) for p in d.get("logical_axes", [])),
                   tuple(split) if split else None)

    def to_dict(self) -> dict:
        d = {"devices": list(self.devices), "axis_names": list(self.axis_names),
             "axis_sizes": list(self.axis_sizes),
             "logical_axes": [list(p) for p in self.logical_axes]}
        if self.split_backprop:
            d["split_backprop"] = list(self.split_backprop)
        return d

    def mesh_key(self) -> tuple:
        return (self.devices, self.axis_names, self.axis_sizes)


def main_func(module: ir.Module) -> ir.Operation:
    for op in module.body.operations:
        op = op.operation
        if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise DiagnosticError("module has no 'main' function", module.operation.location)


def func_by_name(module: ir.Module) -> dict[str, ir.Operation]:
    out = {}
    for op in module.body.operations:
        op = op.operation
        if op.name == "func.func":
            out[ir.StringAttr(op.attributes["sym_name"]).value] = op
    return out


def func_name(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


def callee_of(call: ir.Operation) -> str:
    return ir.FlatSymbolRefAttr(call.attributes["callee"]).value


def entry_block(func: ir.Operation) -> ir.Block:
    return func.regions[0].blocks[0]


def read_tasks(module: ir.Module) -> dict[str, TaskMeshInfo]:
    attrs = module.operation.attributes
    if TASKS_ATTR not in attrs:
        return {}
    return {k: TaskMeshInfo.from_dict(v) for k, v in attr_to_py(attrs[TASKS_ATTR]).items()}


def write_tasks(module: ir.Module, tasks: dict[str, TaskMeshInfo]) -> None:
    with module.context:
        module.operation.attributes[TASKS_ATTR] = dict_attr(
            {k: tasks[k].to_dict() for k in sorted(tasks)})


Tag = tuple[str, int, int]
"""``(task name, transpose_count, microbatch)``; microbatch is -1 outside microbatch loops."""


_TAG_CACHE: dict[ir.Attribute, Tag] = {}


def tag_of(op: ir.Operation) -> Tag | None:
    """The :data:`Tag` of an op tagged in flat form, else None."""
    attrs = op.attributes
    if TASK_ATTR not in attrs:
        return None
    a = attrs[TASK_ATTR]
    # Attributes are uniqued per context, so a few distinct tags cover a whole module.
    tag = _TAG_CACHE.get(a)
    if tag is None:
        d = attr_to_py(a)
        tag = d["name"], int(d["transpose_count"]), int(d.get("microbatch", -1))
        if len(_TAG_CACHE) > 4096:
            _TAG_CACHE.clear()
        _TAG_CACHE[a] = tag
    return tag


def tag_attr(name: str, count: int, microbatch: int = -1) -> ir.Attribute:
    d = {"name": name, "transpose_count": count}
    if microbatch >= 0:
        d["microbatch"] = microbatch
    return py_to_attr(d)


def is_custom_call(op: ir.Operation, target: str) -> bool:
    return (op.name == "stablehlo.custom_call"
            and ir.StringAttr(op.attributes["call_target_name"]).value == target)


def value_bytes(v: ir.Value) -> int:
    """Size in bytes of a ranked tensor value (1 for anything else)."""
    t = v.type
    if not isinstance(t, ir.RankedTensorType):
        try:
            t = ir.RankedTensorType(t)
        except (ValueError, TypeError):
            return 1
    n = 1
    for s in t.shape:
        n *= max(s, 1)
    et = t.element_type
    width = getattr(et, "width", None)
    if width is None:
        try:
            width = ir.FloatType(et).width
        except (ValueError, TypeError):
            width = 8
    return n * max(1, width // 8)


def num_devices(module: ir.Module) -> int | None:
    attrs = module.operation.attributes
    if "mm.num_devices" in attrs:
        return ir.IntegerAttr(attrs["mm.num_devices"]).value
    return None


def referenced_meshes(fn: ir.Operation, mesh_names: set[str]) -> list[str]:
    """Names of ``sdy.mesh`` symbols that shardings inside ``fn`` refer to (sorted).

    jax itself emits some constraints on meshes of its own (e.g. ``@empty_mesh``
    for PRNG keys); a fragment extracted into its own module must take those along.
    """
    if len(mesh_names) <= 1:
        return sorted(mesh_names)
    found: set[str] = set()

    def scan(attr) -> None:
        text = str(attr)
        for name in mesh_names:
            if f"@{name}," in text or f"@{name}>" in text or f"@{name} " in text:
                found.add(name)

    def cb(op):
        op = op.operation
        for key in ("sharding", "sdy.sharding", "in_shardings", "out_shardings"):
            if key in op.attributes:
                scan(op.attributes[key])
        return ir.WalkResult.ADVANCE

    fn.walk(cb, ir.WalkOrder.PRE_ORDER)
    for key in ("arg_attrs", "res_attrs"):
        if key in fn.attributes:
            scan(fn.attributes[key])
    return sorted(found)


def top_finder(main: ir.Operation):
    """A function mapping any op nested in ``main`` to its top-level ancestor in ``main``.

    Returns None for ops outside ``main`` (e.g. already moved into a fragment).
    """
    def top(o) -> ir.Operation | None:
        o = o.operation
        while True:
            p = o.parent
            if p is None:
                return None
            if p == main:
                return o
            o = p.operation
    return top


def fragment_calls(main: ir.Operation) -> list[ir.Operation]:
    """The ``func.call`` ops at the top level of ``@main`` (MPMD form), in order."""
    return [o.operation for o in entry_block(main).operations if o.operation.name == "func.call"]
