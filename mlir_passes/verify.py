"""``mm-verify``: check the ``mm.*`` IR contract of docs/ir.md, plus MLIR's verifier.

Every later pass assumes these invariants, so checking them once, with a
location, turns a confusing failure deep in a pipeline into a one-line error.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir_passes import _contract as c
from mlir_passes._contract import reject_internal_sdy_ops
from mlir_passes.base import ModulePass
from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import custom_call_target
from multimesh._src.mlir import ir

__all__ = ["VerifyPass"]

_MESH_KEYS = ("devices", "axis_names", "axis_sizes", "logical_axes")
_OPTIONAL_KEYS = ("logical_axes", "loop", "split_backprop", "loop_devices", "forward")
_CALL_KEYS = ("name", "transpose_count", "loop", "split_backprop", "loop_devices", *_MESH_KEYS)
_REF_KEYS = ("name", "transpose_count", "loop")
_MARKER = "mm.logical_sharding"


@dataclass(frozen=True)
class VerifyPass(ModulePass):
    """Checks that the module follows the multimesh IR contract (docs/ir.md).

    Runs the MLIR verifier, then checks every ``mm.task`` on a ``func.call``
    (name, transpose count, devices, task mesh axes and logical axes), every
    ``mm.logical_sharding`` custom call (one operand, same result type, one
    ``mm.axes`` entry per dimension), the module's ``mm.tasks`` table, and that
    ``mm.task`` on any other op is ``{name, transpose_count}`` naming a table
    entry. Task calls that share a name must agree on the mesh. Shardy's internal
    ``sdy.data_flow_edge`` (which jax never emits) is rejected. The IR is not
    changed; the first violation is reported at the offending op.
    """

    argument = "mm-verify"
    summary = "Check the `mm.*` attributes and markers against the IR contract."
    mutates = False

    def apply(self, module: ir.Module) -> None:
        _run_mlir_verifier(module)
        mod_op = module.operation
        reject_internal_sdy_ops(mod_op)
        table = _check_table(mod_op)
        meshes: dict[str, tuple[dict, ir.Location]] = {}
        ops: list[ir.Operation] = []

        def collect(op):
            ops.append(op.operation)
            return ir.WalkResult.ADVANCE

        mod_op.walk(collect, ir.WalkOrder.PRE_ORDER)
        for op in ops:
            if op.name == "stablehlo.custom_call" and custom_call_target(op) == _MARKER:
                _check_marker(op)
            if "mm.task" not in op.attributes or op == mod_op:
                continue
            attr = op.attributes["mm.task"]
            if op.name == "func.call" and not _is_reference(attr, table):
                mesh = _check_task(attr, op.location, "'mm.task'", _CALL_KEYS, with_name=True)
                _check_consistent(mesh, op.location, meshes, table)
            else:
                _check_reference(op, attr, table)


# ------------------------------------------------------------------ verifier


def _run_mlir_verifier(module: ir.Module) -> None:
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        d = e.error_diagnostics[0] if e.error_diagnostics else None
        if d is None:
            raise DiagnosticError(str(e)) from None
        notes = [n.message for n in d.notes if not n.message.startswith("see current operation")]
        raise DiagnosticError(d.message, d.location, notes) from None


# ------------------------------------------------------------------ helpers


def _fmt(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _as_dict(attr: ir.Attribute, what: str, loc) -> dict[str, ir.Attribute]:
    if not isinstance(attr, ir.DictAttr):
        raise DiagnosticError(f"{what} must be a dictionary attribute, got {attr}", loc)
    d = ir.DictAttr(attr)
    return {d[i].name: d[i].attr for i in range(len(d))}


def _int(a: ir.Attribute) -> int | None:
    if isinstance(a, ir.BoolAttr) or not isinstance(a, ir.IntegerAttr):
        return None
    return ir.IntegerAttr(a).value


def _str(a: ir.Attribute) -> str | None:
    return ir.StringAttr(a).value if isinstance(a, ir.StringAttr) else None


def _list(a: ir.Attribute) -> list[ir.Attribute] | None:
    if isinstance(a, ir.ArrayAttr):
        return list(ir.ArrayAttr(a))
    return None


def _int_list(a: ir.Attribute, what: str, loc) -> list[int]:
    if isinstance(a, ir.DenseI64ArrayAttr):
        return list(ir.DenseI64ArrayAttr(a))
    items = _list(a)
    vals = [_int(x) for x in items] if items is not None else None
    if vals is None or any(v is None for v in vals):
        raise DiagnosticError(f"{what} must be a list of integers, got {a}", loc)
    return vals  # type: ignore[return-value]


def _str_list(a: ir.Attribute, what: str, loc) -> list[str]:
    items = _list(a)
    vals = [_str(x) for x in items] if items is not None else None
    if vals is None or any(v is None for v in vals):
        raise DiagnosticError(f"{what} must be a list of strings, got {a}", loc)
    return vals  # type: ignore[return-value]


def _duplicate(values: list):
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


# ------------------------------------------------------------------ tasks


def _check_task(attr: ir.Attribute, loc, what: str, allowed: tuple[str, ...], *,
                with_name: bool) -> dict:
    """Check a task dictionary; returns it as Python values."""
    d = _as_dict(attr, what, loc)
    for key in d:
        if key not in allowed:
            raise DiagnosticError(
                f"{what} has unknown key '{key}' (expected {', '.join(allowed)})", loc)
    required = [k for k in allowed if k not in _OPTIONAL_KEYS]
    for key in required:
        if key not in d:
            raise DiagnosticError(f"{what} is missing '{key}'", loc)
    out: dict = {}
    if with_name:
        out.update(_check_name_and_count(d, what, loc))
    devices = _int_list(d["devices"], f"{what} devices", loc)
    names = _str_list(d["axis_names"], f"{what} axis_names", loc)
    sizes = _int_list(d["axis_sizes"], f"{what} axis_sizes", loc)
    c.check_mesh(devices, names, sizes, what, loc)
    logical = _check_logical_axes(d.get("logical_axes"), names, what, loc)
    out.update(devices=devices, axis_names=names, axis_sizes=sizes, logical_axes=logical)
    return out


def _check_name_and_count(d: dict[str, ir.Attribute], what: str, loc) -> dict:
    name = _str(d["name"])
    if name is None:
        raise DiagnosticError(f"{what} name must be a string, got {d['name']}", loc)
    if not name:
        raise DiagnosticError(f"{what} name must not be empty", loc)
    count = _int(d["transpose_count"])
    if count is None:
        raise DiagnosticError(
            f"{what} transpose_count must be an integer, got {d['transpose_count']}", loc)
    if count < 0:
        raise DiagnosticError(f"{what} transpose_count must be >= 0, got {count}", loc)
    return {"name": name, "transpose_count": count}


def _check_logical_axes(a, axis_names: list[str], what: str, loc) -> list[list[str]]:
    if a is None:
        return []
    items = _list(a)
    if items is None:
        raise DiagnosticError(f"{what} logical_axes must be a list of pairs, got {a}", loc)
    pairs = []
    for item in items:
        pair = _list(item)
        vals = [_str(x) for x in pair] if pair is not None else None
        if vals is None or len(vals) != 2 or any(v is None for v in vals):
            raise DiagnosticError(
                f"{what} logical_axes entries must be [logical, device] string pairs, "
                f"got {item}", loc)
        if vals[1] not in axis_names:
            raise DiagnosticError(
                f"{what} logical axis \"{vals[0]}\" maps to device axis \"{vals[1]}\" "
                f"which is not in axis_names {_fmt(axis_names)}", loc)
        pairs.append(vals)
    return pairs


def _check_table(mod_op: ir.Operation) -> dict[str, dict] | None:
    if "mm.tasks" not in mod_op.attributes:
        return None
    loc = mod_op.location
    entries = _as_dict(mod_op.attributes["mm.tasks"], "'mm.tasks'", loc)
    return {name: _check_task(attr, loc, f"'mm.tasks' entry \"{name}\"",
                              (*_MESH_KEYS, "split_backprop", "loop_devices", "forward"),
                              with_name=False)
            for name, attr in entries.items()}


def _is_reference(attr: ir.Attribute, table: dict | None) -> bool:
    """A call tagged ``{name, transpose_count}`` whose name is in ``mm.tasks`` (flat form)."""
    if table is None or not isinstance(attr, ir.DictAttr):
        return False
    d = ir.DictAttr(attr)
    keys = {d[i].name for i in range(len(d))}
    return keys <= set(_REF_KEYS) and "devices" not in keys


def _check_reference(op: ir.Operation, attr: ir.Attribute, table: dict | None) -> None:
    loc = op.location
    what = f"'mm.task' on '{op.name}'"
    d = _as_dict(attr, what, loc)
    for key in d:
        if key not in _REF_KEYS:
            raise DiagnosticError(
                f"{what} has unexpected key '{key}' (only task calls carry the mesh; "
                f"expected name, transpose_count)", loc)
    for key in ("name", "transpose_count"):
        if key not in d:
            raise DiagnosticError(f"{what} is missing '{key}'", loc)
    name = _check_name_and_count(d, what, loc)["name"]
    if table is None:
        raise DiagnosticError(
            f"{what} names task \"{name}\" but the module has no 'mm.tasks' table", loc)
    if name not in table:
        known = ", ".join(f'"{k}"' for k in sorted(table)) or "none"
        raise DiagnosticError(
            f"{what} names task \"{name}\" which is not in 'mm.tasks' (known: {known})", loc)


def _check_consistent(task: dict, loc, meshes: dict, table: dict | None) -> None:
    """Calls of one task must agree on the mesh, and with ``mm.tasks`` when present."""
    name = task["name"]
    mesh = {k: task[k] for k in _MESH_KEYS}
    if table is not None and name in table and table[name] != mesh:
        raise DiagnosticError(
            f"'mm.task' \"{name}\" has mesh {_mesh_str(mesh)} but 'mm.tasks' says "
            f"{_mesh_str(table[name])}", loc)
    if name not in meshes:
        meshes[name] = (mesh, loc)
        return
    first, first_loc = meshes[name]
    if first != mesh:
        raise DiagnosticError(
            f"'mm.task' \"{name}\" has mesh {_mesh_str(mesh)} but an earlier call of the "
            f"same task has {_mesh_str(first)}", loc,
            [("earlier call of the task is here", first_loc)])


def _mesh_str(m: dict) -> str:
    return ", ".join(f"{k}={_fmt(m[k])}" for k in _MESH_KEYS)


# ------------------------------------------------------------------ markers


def _check_marker(op: ir.Operation) -> None:
    loc = op.location
    what = f"'{_MARKER}'"
    if len(op.operands) != 1:
        raise DiagnosticError(f"{what} must have exactly one operand, got {len(op.operands)}",
                              loc)
    if len(op.results) != 1:
        raise DiagnosticError(f"{what} must have exactly one result, got {len(op.results)}",
                              loc)
    in_t, out_t = op.operands[0].type, op.results[0].type
    if in_t != out_t:
        raise DiagnosticError(
            f"{what} result type {out_t} differs from operand type {in_t}", loc)
    if "mm.axes" not in op.attributes:
        raise DiagnosticError(f"{what} is missing 'mm.axes'", loc)
    a = op.attributes["mm.axes"]
    dims = _list(a)
    if dims is None:
        raise DiagnosticError(f"{what} 'mm.axes' must be a list of lists of strings, got {a}",
                              loc)
    if isinstance(in_t, ir.ShapedType) and ir.ShapedType(in_t).has_rank:
        rank = ir.ShapedType(in_t).rank
        if len(dims) != rank:
            raise DiagnosticError(
                f"{what} 'mm.axes' has {len(dims)} entries but the operand {in_t} has rank "
                f"{rank}", loc)
    used: dict[str, int] = {}
    for i, dim in enumerate(dims):
        names = _str_list(dim, f"{what} 'mm.axes' entry {i}", loc)
        for n in names:
            if n in used:
                raise DiagnosticError(
                    f"{what} logical axis \"{n}\" is used by dimensions {used[n]} and {i}", loc)
            used[n] = i
