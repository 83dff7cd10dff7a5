"""Small IR idioms that passes, runtime and front end all need, written once.

Custom-call target lookup and the per-argument attribute arrays of a ``func.func``
(``arg_attrs`` / ``res_attrs``: one ``DictAttr`` per argument or result). These
know nothing of multimesh's IR contract (that is ``multimesh/passes/_contract.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from multimesh._src.mlir import ir

__all__ = ["custom_call_target", "mesh_ops", "mesh_attrs", "attr_entries", "attr_dicts",
           "set_attr_dicts", "update_attr_dicts", "select_attr_entries"]

AttrsKey = Literal["arg_attrs", "res_attrs"]


def custom_call_target(op: ir.Operation) -> str | None:
    """The ``call_target_name`` of a ``stablehlo.custom_call``; None for any other op
    (or a malformed custom call), so callers can compare without guarding."""
    if op.name != "stablehlo.custom_call":
        return None
    attrs = op.attributes
    if "call_target_name" not in attrs:
        return None
    a = attrs["call_target_name"]
    return a.value if isinstance(a, ir.StringAttr) else None


def mesh_ops(module: ir.Module) -> dict[str, ir.Operation]:
    """The module's top-level ``sdy.mesh`` ops by symbol name."""
    return {ir.StringAttr(o.operation.attributes["sym_name"]).value: o.operation
            for o in module.body.operations if o.operation.name == "sdy.mesh"}


def mesh_attrs(module: ir.Module) -> dict[str, ir.Attribute]:
    """The module's top-level meshes (``#sdy.mesh`` attributes) by symbol name."""
    return {name: op.attributes["mesh"] for name, op in mesh_ops(module).items()}


def _count(fn: ir.Operation, key: AttrsKey) -> int:
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    return len(ftype.inputs if key == "arg_attrs" else ftype.results)


def attr_entries(fn: ir.Operation, key: AttrsKey) -> list[ir.DictAttr]:
    """``fn``'s ``arg_attrs`` / ``res_attrs`` entries; empty dicts where it has none
    (MLIR omits the array when every entry is empty)."""
    if key in fn.attributes:
        return [ir.DictAttr(a) for a in ir.ArrayAttr(fn.attributes[key])]
    return [ir.DictAttr.get({})] * _count(fn, key)


def attr_dicts(fn: ir.Operation, key: AttrsKey) -> list[dict[str, ir.Attribute]]:
    """:func:`attr_entries` as plain, editable dicts."""
    return [{d[i].name: d[i].attr for i in range(len(d))} for d in attr_entries(fn, key)]


def set_attr_dicts(fn: ir.Operation, key: AttrsKey,
                   dicts: Iterable[Mapping[str, ir.Attribute]]) -> None:
    """Write one dict per argument (or result) back as ``fn``'s ``key`` array."""
    fn.attributes[key] = ir.ArrayAttr.get([ir.DictAttr.get(dict(d)) for d in dicts])


def update_attr_dicts(fn: ir.Operation, key: AttrsKey,
                      changes: Mapping[int, Mapping[str, ir.Attribute | None]]) -> None:
    """Rebuild ``fn``'s ``key`` array with ``changes[i]`` merged into entry ``i``; a
    None value removes that name. Attributes are immutable, so this is the one way
    to change a single argument's attributes."""
    dicts = attr_dicts(fn, key)
    for i, change in changes.items():
        for name, value in change.items():
            if value is None:
                dicts[i].pop(name, None)
            else:
                dicts[i][name] = value
    set_attr_dicts(fn, key, dicts)


def select_attr_entries(fn: ir.Operation, key: AttrsKey, order: Sequence[int]) -> None:
    """Keep ``fn``'s ``key`` entries ``order`` (in that order), after its arguments or
    results were dropped or permuted; an index past the array's end (an argument added
    since) gets an empty entry. A function without the array keeps none."""
    if key not in fn.attributes:
        return
    old = list(ir.ArrayAttr(fn.attributes[key]))
    empty = ir.DictAttr.get({})
    fn.attributes[key] = ir.ArrayAttr.get([old[i] if i < len(old) else empty for i in order])
