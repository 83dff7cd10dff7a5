"""``mm-recompute-transfers``: recompute cheap cross-submesh values instead of moving them."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.ir_util import select_attr_entries
from multimesh._src.mlir import func, ir

from . import _contract as c
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
_PASS = {"sdy.sharding_constraint"}


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
                _rewrite(funcs[c.callee_of(call)], call, items)
            if by_call:
                _prune_unused_results(module, main, funcs)


def _plans(calls: list[ir.Operation], funcs: dict[str, ir.Operation], max_cost: int) -> dict:
    """Per consuming call: ``(operand number, producer fn, producer call, cheap tree)``
    for each operand made on other devices by a tree cheap enough to recompute."""
    devices = {n: c.fragment_info(funcs[n]).devices for n in map(c.callee_of, calls)}
    producer_of: dict = {}
    for call in calls:
        for j, r in enumerate(call.results):
            producer_of[r] = (call, j)
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
    body = c.entry_block(pfn)
    ret = list(body.operations)[-1].operation
    root = ret.operands[j]
    ops, seen, cost = [], set(), 0
    leaves = []  # (pfn block arg index) that must be program inputs
    stack = [root]
    while stack:
        v = stack.pop()
        owner = v.owner
        if isinstance(owner, ir.Block):
            idx = v.arg_number
            src = pcall.operands[idx]
            if not isinstance(src.owner, ir.Block):  # not a program input
                return None
            leaves.append(idx)
            continue
        op = owner.operation
        if op in seen:
            continue
        name = op.name
        if name not in _FREE and name not in _CHEAP and name not in _PASS:
            return None
        if len(op.regions):
            return None
        if name in _CHEAP:
            cost += sum(c.value_bytes(r) // _elem_bytes(r) for r in op.results)
            if cost > max_cost:
                return None
        seen.add(op)
        ops.append(op)
        stack.extend(op.operands)
    order = {o: i for i, o in enumerate(o.operation for o in body.operations)}
    ops.sort(key=lambda o: order[o])
    return ops, root, sorted(set(leaves))


def _elem_bytes(v) -> int:
    n = 1
    for s in ir.RankedTensorType(v.type).shape:
        n *= max(s, 1)
    return max(1, c.value_bytes(v) // n)


def _rewrite(fn, call, items) -> None:
    body = c.entry_block(fn)
    first = list(body.operations)[0]
    new_inputs = list(call.operands)
    drop = set()
    mapping: dict = {}  # shared by all recomputed values, so common subtrees are cloned once
    for k, pfn, pcall, (ops, root, leaves) in items:
        _map_leaves(fn, pfn, pcall, leaves, new_inputs, mapping)
        _clone_tree(fn, ops, first, mapping)
        body.arguments[k].replace_all_uses_with(mapping[root])
        drop.add(k)
    keep = [i for i in range(len(new_inputs)) if i not in drop]
    for i in sorted(drop, reverse=True):
        body.erase_argument(i)
    inputs = [new_inputs[i] for i in keep]
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    fn.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([v.type for v in inputs], list(ftype.results)))
    select_attr_entries(fn, "arg_attrs", keep)
    with ir.InsertionPoint(call), call.location:
        new = func.CallOp([r.type for r in call.results],
                          ir.FlatSymbolRefAttr.get(c.callee_of(call)), inputs)
    for name in [a if isinstance(a, str) else a.name for a in call.attributes]:
        if name not in ("callee",):
            new.operation.attributes[name] = call.attributes[name]
    for old, res in zip(call.results, new.results):
        old.replace_all_uses_with(res)
    call.erase()


def _map_leaves(fn, pfn, pcall, leaves, new_inputs: list, mapping: dict) -> None:
    """The tree's program inputs as arguments of ``fn``: an existing one, or a new one."""
    body = c.entry_block(fn)
    for idx in leaves:
        src = pcall.operands[idx]
        if src in new_inputs:
            pos = new_inputs.index(src)
            if pos < len(body.arguments):
                mapping[c.entry_block(pfn).arguments[idx]] = body.arguments[pos]
                continue
        new_inputs.append(src)
        arg = body.add_argument(src.type, fn.location)
        mapping[c.entry_block(pfn).arguments[idx]] = arg


def _clone_tree(fn, ops, first, mapping: dict) -> None:
    """Clone the tree's ops (pass-through ops aside) at the start of ``fn``."""
    for op in ops:
        if op.results[0] in mapping:
            continue
        if op.name in _PASS:
            mapping[op.results[0]] = mapping.get(op.operands[0], op.operands[0])
            continue
        clone = op.clone(ip=ir.InsertionPoint(first))
        for i, operand in enumerate(list(clone.operands)):
            if operand in mapping:
                clone.operands[i] = mapping[operand]
        if c.TASK_ATTR in fn.attributes:
            clone.attributes[c.TASK_ATTR] = fn.attributes[c.TASK_ATTR]
        for old, new in zip(op.results, clone.results):
            mapping[old] = new


def _prune_unused_results(module, main, funcs) -> None:
    """Drop fragment results nothing reads any more (values now recomputed downstream)."""
    calls = c.fragment_calls(main)
    uses: dict[str, int] = {}
    for call in calls:
        uses[c.callee_of(call)] = uses.get(c.callee_of(call), 0) + 1
    for call in calls:
        name = c.callee_of(call)
        dead = [j for j, r in enumerate(call.results) if not list(r.uses)]
        if not dead or uses[name] != 1:
            continue
        fn = funcs[name]
        ret = list(c.entry_block(fn).operations)[-1].operation
        keep = [j for j in range(len(call.results)) if j not in dead]
        vals = [ret.operands[j] for j in keep]
        with ir.InsertionPoint(ret), ret.location:
            func.ReturnOp(vals)
        ret.erase()
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        fn.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(list(ftype.inputs), [v.type for v in vals]))
        select_attr_entries(fn, "res_attrs", keep)
        with ir.InsertionPoint(call), call.location:
            new = func.CallOp([v.type for v in vals], ir.FlatSymbolRefAttr.get(name),
                              list(call.operands))
        for attr in [a if isinstance(a, str) else a.name for a in call.attributes]:
            if attr != "callee":
                new.operation.attributes[attr] = call.attributes[attr]
        for j, res in zip(keep, new.results):
            call.results[j].replace_all_uses_with(res)
        call.erase()
