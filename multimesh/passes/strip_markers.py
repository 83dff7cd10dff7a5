"""``mm-strip-markers``: drop every multimesh annotation so XLA accepts the module.

XLA rejects the unknown ``mm.logical_sharding``/``mm.transfer`` custom calls,
and ``mm.*`` attributes are noise to it; this pass is the escape hatch that turns any
multimesh module back into plain StableHLO/Shardy (e.g. to run it as one SPMD
program, ignoring tasks).
"""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_contract import LOGICAL_TARGET, PREFIX, TRANSFER_TARGET
from multimesh._src.ir_util import custom_call_target
from multimesh._src.mlir import ir

from ._patterns import Rewrite, ops_under, rewrite_ops
from .base import ModulePass

__all__ = ["StripMarkersPass"]

_MARKERS = (LOGICAL_TARGET, TRANSFER_TARGET)
_ARG_ATTR_NAMES = ("arg_attrs", "res_attrs")


@dataclass(frozen=True)
class StripMarkersPass(ModulePass):
    """Removes all ``mm.*`` attributes and identity markers.

    Every ``mm.*`` attribute is removed: on ops, on the module (``mm.tasks``)
    and in function argument/result attributes. Every
    ``stablehlo.custom_call @mm.logical_sharding`` (and ``@mm.transfer``, also
    an identity once placement is ignored) is replaced by its operand. The
    result is a single-program module that XLA compiles as one SPMD program.
    """

    argument = "mm-strip-markers"
    summary = ("Remove every `mm.*` attribute and replace `mm.logical_sharding` and "
               "`mm.transfer` by their operand.")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            rewrite_ops(ops_under(module.operation), (_Markers(), _Attributes()))


class _Markers:
    """The pattern: an identity marker is replaced by its operand (checked first)."""

    def match(self, op: ir.Operation) -> Rewrite | None:
        if op.name != "stablehlo.custom_call" or custom_call_target(op) not in _MARKERS:
            return None
        if len(op.operands) != 1 or len(op.results) != 1:
            raise DiagnosticError(
                f"'{custom_call_target(op)}' must have exactly one operand and one result, got "
                f"{len(op.operands)} and {len(op.results)}", op.location)
        if op.operands[0].type != op.results[0].type:
            raise DiagnosticError(
                f"'{custom_call_target(op)}' result type {op.results[0].type} differs from operand "
                f"type {op.operands[0].type}", op.location)
        return lambda: _erase_marker(op)


class _Attributes:
    """The pattern: any other op loses its ``mm.*`` attributes."""

    def match(self, op: ir.Operation) -> Rewrite | None:
        return lambda: _strip_attrs(op)


def _erase_marker(op: ir.Operation) -> None:
    op.results[0].replace_all_uses_with(op.operands[0])
    op.erase()


def _strip_attrs(op: ir.Operation) -> None:
    names = [op.attributes[i].name for i in range(len(op.attributes))]
    for name in names:
        if name.startswith(PREFIX):
            del op.attributes[name]
    for name in _ARG_ATTR_NAMES:
        if name in op.attributes:
            new = _strip_arg_attrs(op.attributes[name])
            if new is not None:
                op.attributes[name] = new


def _strip_arg_attrs(a: ir.Attribute) -> ir.Attribute | None:
    """``[{mm.x = .., other}, ...]`` without the ``mm.*`` entries; None if unchanged."""
    if not isinstance(a, ir.ArrayAttr):
        return None
    changed = False
    out = []
    for d in ir.ArrayAttr(a):
        if not isinstance(d, ir.DictAttr):
            out.append(d)
            continue
        dd = ir.DictAttr(d)
        kept = {dd[i].name: dd[i].attr for i in range(len(dd)) if not dd[i].name.startswith(PREFIX)}
        changed |= len(kept) != len(dd)
        out.append(ir.DictAttr.get(kept))
    return ir.ArrayAttr.get(out) if changed else None
