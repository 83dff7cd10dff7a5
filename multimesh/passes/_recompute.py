"""What the two recompute passes share: the backward slice of a fragment result, and
the rewrite that clones a slice into its consumer.

``mm-recompute-forward`` (a backward recomputes its forward's residuals) and
``mm-recompute-transfers`` (a consumer recomputes a cheap value made on other devices)
differ only in which slices they accept: each hands :func:`backward_slice` its own
tests of a leaf and an op, then :func:`rewrite` and :func:`prune_unused_results`.
"""

from __future__ import annotations

from collections.abc import Callable

from multimesh._src.ir_util import select_attr_entries
from multimesh._src.mlir import func, ir

from . import _contract as c

__all__ = ["PASS_THROUGH", "Slice", "backward_slice", "producers", "rewrite", "prune_unused_results"]

# Pass-through: dropped from the recomputed copy (a constraint names the producer's mesh).
PASS_THROUGH = {"sdy.sharding_constraint"}

Slice = tuple[list[ir.Operation], ir.Value, list[int]]
"""``(ops in program order, root value, argument indices it reads)``."""


def producers(calls: list[ir.Operation]) -> dict:
    """Each fragment result -> ``(call, result number)``."""
    out: dict = {}
    for call in calls:
        for j, r in enumerate(call.results):
            out[r] = (call, j)
    return out


def backward_slice(pfn: ir.Operation, j: int, *,
                   leaf: Callable[[int], bool] | None = None,
                   admit: Callable[[ir.Operation], bool] | None = None) -> Slice | None:
    """What computes result ``j`` of ``pfn``: its ops, root and argument leaves, or None
    when ``leaf`` refuses an argument (by number) or ``admit`` an op it reaches (each
    asked once per op, in the order the walk from the root meets them)."""
    body = c.entry_block(pfn)
    ret = list(body.operations)[-1].operation
    root = ret.operands[j]
    ops, seen, leaves = [], set(), set()
    stack = [root]
    while stack:
        v = stack.pop()
        if isinstance(v.owner, ir.Block):
            idx = ir.BlockArgument(v).arg_number
            if leaf is not None and not leaf(idx):
                return None
            leaves.add(idx)
            continue
        op = v.owner.operation
        if op in seen:
            continue
        if admit is not None and not admit(op):
            return None
        seen.add(op)
        ops.append(op)
        stack.extend(op.operands)
    order = {o: i for i, o in enumerate(o.operation for o in body.operations)}
    ops.sort(key=lambda o: order[o])
    return ops, root, sorted(leaves)


def rewrite(fn, call, items) -> None:
    """Recompute in ``fn`` (called by ``call``) the operands ``items`` name, each
    ``(operand number, producer fn, producer call, slice)``: the slices' ops are cloned
    at the start of ``fn``, which reads their leaves' sources instead of the operands."""
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
        if op.name in PASS_THROUGH:
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


def prune_unused_results(module, main, funcs) -> None:
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
