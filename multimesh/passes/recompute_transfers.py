"""``mm-recompute-transfers``: recompute cheap cross-submesh values instead of moving them."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.mlir import ir

from . import _contract as c
from . import _recompute
from .base import ModulePass

# Free to recompute (MultiMesh's rule): they only describe data the consumer has.
_FREE = {"stablehlo.constant", "stablehlo.iota", "stablehlo.broadcast_in_dim",
         "stablehlo.reshape"}
# Cheap: cost = number of elements produced.
_CHEAP = {"stablehlo.add", "stablehlo.subtract", "stablehlo.multiply", "stablehlo.divide",
          "stablehlo.negate", "stablehlo.abs", "stablehlo.maximum", "stablehlo.minimum",
          "stablehlo.convert", "stablehlo.transpose", "stablehlo.slice", "stablehlo.select",
          "stablehlo.compare", "stablehlo.exponential", "stablehlo.log", "stablehlo.sqrt",
          "stablehlo.rsqrt", "stablehlo.tanh", "stablehlo.sine", "stablehlo.cosine",
          "stablehlo.concatenate", "stablehlo.pad", "stablehlo.and", "stablehlo.or",
          "stablehlo.not", "stablehlo.clamp", "stablehlo.power", "stablehlo.remainder",
          "stablehlo.floor", "stablehlo.ceil", "stablehlo.sign", "stablehlo.logistic"}
# Pass-through: dropped from the recomputed copy (a constraint names the producer's mesh).
_PASS = _recompute.PASS_THROUGH


@dataclass(frozen=True)
class RecomputeTransfersPass(ModulePass):
    """Recompute, inside the consumer, values that would otherwise cross submeshes.

    For every fragment argument fed by another fragment on a *different* device
    set, the producing expression is inspected: if it is a tree of cheap ops
    (constants, iota, broadcasts, reshapes — free — and elementwise/layout ops,
    costing one unit per element produced) whose leaves are program inputs or
    constants, and its total cost is at most ``max-cost``, the tree is cloned into
    the consumer, the consumer takes the program inputs directly, and the transfer
    disappears. Sharding constraints inside the tree are dropped from the copy (the
    consumer's own propagation decides its layout). This is the original
    library's comm-avoiding recompute (``enable_recomputation``), applied to the MPMD form
    right after ``mm-outline-fragments``.
    """

    argument = "mm-recompute-transfers"
    summary = "Recompute cheap cross-submesh values in the consumer instead of transferring them."
    consumes = ("mpmd",)

    max_cost: int = 1 << 20
    """Largest recompute cost (elements produced by non-free ops) accepted per value."""

    def __post_init__(self):
        if self.max_cost < 0:
            raise self.bad_option("max_cost", "a non-negative number of elements")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            by_call = _plans(c.fragment_calls(main), funcs, self.max_cost)
            for call, items in by_call.items():
                _recompute.rewrite(funcs[c.callee_of(call)], call, items)
            if by_call:
                _recompute.prune_unused_results(module, main, funcs)


def _plans(calls: list[ir.Operation], funcs: dict[str, ir.Operation], max_cost: int) -> dict:
    """Per consuming call: ``(operand number, producer fn, producer call, cheap tree)``
    for each operand made on other devices by a tree cheap enough to recompute."""
    devices = {n: c.fragment_info(funcs[n]).devices for n in map(c.callee_of, calls)}
    producer_of = _recompute.producers(calls)
    by_call: dict = {}
    for call in calls:
        devs = devices[c.callee_of(call)]
        for k, v in enumerate(call.operands):
            if v not in producer_of:
                continue
            pcall, j = producer_of[v]
            if devices[c.callee_of(pcall)] == devs:
                continue
            pfn = funcs[c.callee_of(pcall)]
            tree = _cheap_tree(pfn, pcall, j, max_cost)
            if tree is not None:
                by_call.setdefault(call, []).append((k, pfn, pcall, tree))
    return by_call


def _cheap_tree(pfn, pcall, j, max_cost):
    """Ops (in order) computing result ``j`` of ``pfn`` if it is a cheap tree over inputs."""
    cost = 0

    def is_input(idx: int) -> bool:  # the producer's argument is a program input
        return isinstance(pcall.operands[idx].owner, ir.Block)

    def cheap(op: ir.Operation) -> bool:
        nonlocal cost
        name = op.name
        if name not in _FREE and name not in _CHEAP and name not in _PASS:
            return False
        if len(op.regions):
            return False
        if name in _CHEAP:
            cost += sum(c.value_bytes(r) // _elem_bytes(r) for r in op.results)
            if cost > max_cost:
                return False
        return True

    return _recompute.backward_slice(pfn, j, leaf=is_input, admit=cheap)


def _elem_bytes(v) -> int:
    n = 1
    for s in ir.RankedTensorType(v.type).shape:
        n *= max(s, 1)
    return max(1, c.value_bytes(v) // n)
