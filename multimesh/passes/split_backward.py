"""``mm-split-backward``: split backward fragments into activation- and weight-gradient halves."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.mlir import func, ir

from . import _contract as c
from .base import ModulePass


@dataclass(frozen=True)
class SplitBackwardPass(ModulePass):
    """Split each backward fragment in two, for zero-bubble pipeline schedules.

    A backward fragment (``transpose_count = 1``) computes the gradient that flows
    on to the previous stage's backward (on the critical path) and the weight
    gradients (not needed by anyone until the end of the step). The pass moves
    the ops needed for the first into ``@<frag>_act`` (``mm.split = "activation"``)
    and the rest into ``@<frag>_w`` (``mm.split = "weight"``), which takes the
    intermediates it shares with the first as extra arguments. A scheduler can
    then run weight halves in the bubbles. Fragments with nothing to split (only
    one kind of output) are left alone. Runs on the MPMD form right after
    ``mm-outline-fragments``.
    """

    argument = "mm-split-backward"
    summary = "Split backward fragments into activation- and weight-gradient fragments."
    consumes = ("mpmd",)

    all: bool = False
    """Split every backward fragment (zero-bubble schedules); otherwise only tasks whose
    `mm.tasks` entry has `split_backprop`."""

    recompute: tuple[str, ...] = ()
    """Tasks (forward or backward names) whose weight half may recompute what it shares
    with the activation half, from the backward's own arguments, instead of taking it
    as extra arguments: chosen per fragment when the arguments it would keep alive
    longer (those made by other fragments: a stage input, the incoming cotangent) take
    fewer bytes than the shared values. ``remat=True`` under a schedule that splits the
    backward: a microbatch keeps no more than those arguments between the two halves."""

    def apply(self, module: ir.Module) -> None:
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            calls = c.fragment_calls(main)
            task_of = {c.callee_of(call): c.tag_of(funcs[c.callee_of(call)]) for call in calls}
            uses: dict[str, int] = {}
            for call in calls:
                uses[c.callee_of(call)] = uses.get(c.callee_of(call), 0) + 1
            tasks = c.read_tasks(module)
            for call in calls:
                name = c.callee_of(call)
                tag = task_of[name]
                if tag is None or tag[1] != 1 or uses[name] != 1:
                    continue
                info = tasks.get(tag[0])
                suffixes = info.split_backprop if info is not None else None
                if not self.all and not suffixes:
                    continue
                act = _activation_outputs(call, tag[0], task_of)
                if not act or len(act) == len(call.results):
                    continue
                again = tag[0] in self.recompute or any(
                    t in self.recompute for t in _forward_tasks(call, task_of))
                _split(call, funcs[name], act, suffixes or ("_act", "_w"), again)


def _forward_tasks(call: ir.Operation, task_of: dict[str, c.Tag | None]) -> set[str]:
    """The tasks of the forward fragments whose results a backward call reads."""
    out = set()
    for v in call.operands:
        owner = v.owner
        if isinstance(owner, ir.Block) or owner.operation.name != "func.call":
            continue
        t = task_of.get(c.callee_of(owner.operation))
        if t is not None and t[1] == 0:
            out.add(t[0])
    return out


def _activation_outputs(call: ir.Operation, task: str,
                        task_of: dict[str, c.Tag | None]) -> list[int]:
    """Results of a backward fragment that another task's backward fragment reads: the
    gradients with respect to activations, which the next stage waits for."""
    act = []
    for j, r in enumerate(call.results):
        for use in r.uses:
            owner = use.owner.operation
            if owner.name != "func.call":
                continue
            other = task_of.get(c.callee_of(owner))
            if other is not None and other[1] == 1 and other[0] != task:
                act.append(j)
                break
    return act


class _Body:
    """A fragment body's ops (return excluded), indexed, for dependence queries."""

    def __init__(self, fn: ir.Operation) -> None:
        ops = [o.operation for o in c.entry_block(fn).operations]
        self.ret, self.ops = ops[-1], ops[:-1]
        self.index = {op: i for i, op in enumerate(self.ops)}

    def producer(self, v: ir.Value) -> int | None:
        owner = v.owner
        if isinstance(owner, ir.Block):
            return None
        return self.index.get(owner.operation)

    def needed_by(self, outputs: list[int]) -> set[int]:
        """Indices of the ops the given return operands depend on."""
        need: set[int] = set()
        stack = [self.producer(self.ret.operands[j]) for j in outputs]
        while stack:
            i = stack.pop()
            if i is None or i in need:
                continue
            need.add(i)
            stack.extend(self.producer(v) for v in _all_operands(self.ops[i]))
        return need

    def crossing(self, need: set[int], weight_outputs: list[int]) -> list[tuple[int, int]]:
        """(op index, result number) of the values defined in the activation half and
        read by the weight half (by its ops or its returned values)."""
        read = [v for i, op in enumerate(self.ops) if i not in need for v in _all_operands(op)]
        read += [self.ret.operands[j] for j in weight_outputs]
        crossing: list[tuple[int, int]] = []
        for v in read:
            p = self.producer(v)
            if p is not None and p in need:
                key = (p, ir.OpResult(v).result_number)
                if key not in crossing:
                    crossing.append(key)
        return crossing


def _split(call: ir.Operation, fn: ir.Operation, act_outputs: list[int],
           suffixes: tuple[str, str], recompute: bool = False) -> None:
    body = _Body(fn)
    need = body.needed_by(act_outputs)
    weight_outputs = [j for j in range(len(body.ret.operands)) if j not in act_outputs]
    crossing = body.crossing(need, weight_outputs)
    w_keep = set(range(len(body.ops))) - need
    if recompute and crossing:
        whole = body.needed_by(weight_outputs)
        if _held_longer(call, fn, whole, w_keep) < sum(
                c.value_bytes(body.ops[p].results[r]) for p, r in crossing):
            crossing, w_keep = [], whole
    name = c.func_name(fn)
    a_name, w_name = f"{name}{suffixes[0]}", f"{name}{suffixes[1]}"
    a_fn = _make_half(fn, a_name, keep=need, outputs=[("ret", j) for j in act_outputs]
                      + [("op", k) for k in crossing], split="activation")
    w_fn = _make_half(fn, w_name, keep=w_keep,
                      outputs=[("ret", j) for j in weight_outputs], split="weight",
                      crossing=crossing)
    # rebuild the call site: act half, then weight half
    a_args = [call.operands[i] for i in a_fn[1]]
    with ir.InsertionPoint(call), call.location:
        a_call = func.CallOp(a_fn[2], ir.FlatSymbolRefAttr.get(a_name), a_args)
    a_call.operation.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
    cross_vals = list(a_call.results)[len(act_outputs):]
    w_args = [call.operands[i] for i in w_fn[1]] + cross_vals
    with ir.InsertionPoint(call), call.location:
        w_call = func.CallOp(w_fn[2], ir.FlatSymbolRefAttr.get(w_name), w_args)
    w_call.operation.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
    for k, j in enumerate(act_outputs):
        call.results[j].replace_all_uses_with(a_call.results[k])
    for k, j in enumerate(weight_outputs):
        call.results[j].replace_all_uses_with(w_call.results[k])
    call.erase()
    fn.erase()


def _held_longer(call: ir.Operation, fn: ir.Operation, recompute: set[int],
                 keep: set[int]) -> int:
    """Bytes of the arguments a weight half that recomputes (its ops ``recompute``) reads
    beyond those the one that takes shared values reads (ops ``keep``), counting only
    those made by other fragments (per microbatch: a stage input, a cotangent); the
    program's own arguments (the parameters) are held through the step anyway."""
    body = _Body(fn)

    def args_of(ops: set[int]) -> set[int]:
        read = {v for i in ops for v in _all_operands(body.ops[i])}
        read |= set(body.ret.operands)
        return {k for k, a in enumerate(c.entry_block(fn).arguments) if a in read}
    total = 0
    for k in args_of(recompute) - args_of(keep):
        owner = call.operands[k].owner
        if not isinstance(owner, ir.Block) and owner.operation.name == "func.call":
            total += c.value_bytes(call.operands[k])
    return total


def _defined_inside(op: ir.Operation) -> set[ir.Value]:
    """Every value defined in ``op``'s regions (results and block arguments)."""
    inner: set[ir.Value] = set()

    def cb(o):
        inner.update(o.results)
        for reg in o.regions:
            for b in reg.blocks:
                inner.update(b.arguments)
        return ir.WalkResult.ADVANCE

    op.walk(cb, ir.WalkOrder.PRE_ORDER)
    return inner


def _all_operands(op: ir.Operation) -> list[ir.Value]:
    """``op``'s operands and the values its regions capture from outside."""
    vals = list(op.operands)
    if not len(op.regions):
        return vals
    inner = _defined_inside(op)

    def cb(o):
        if o.operation != op:
            vals.extend(v for v in o.operands if v not in inner)
        return ir.WalkResult.ADVANCE

    op.walk(cb, ir.WalkOrder.PRE_ORDER)
    return vals


def _make_half(fn, name, *, keep, outputs, split, crossing=()):
    """Clone ``fn`` keeping ops ``keep``; returns (func, used original arg indices, result types)."""
    clone = fn.clone(ip=ir.InsertionPoint(fn))
    clone.attributes["sym_name"] = ir.StringAttr.get(name)
    clone.attributes[c.SPLIT_ATTR] = ir.StringAttr.get(split)
    body = c.entry_block(clone)
    ops = [o.operation for o in body.operations]
    ret, ops = ops[-1], ops[:-1]
    n_orig = len(body.arguments)
    # extra block args for crossing values (weight half only)
    for p, rn in crossing:
        arg = body.add_argument(ops[p].results[rn].type, fn.location)
        ops[p].results[rn].replace_all_uses_with(arg)
    out_vals = [ret.operands[x] if kind == "ret" else ops[x[0]].results[x[1]]
                for kind, x in outputs]
    with ir.InsertionPoint(ret), ret.location:
        func.ReturnOp(out_vals)
    ret.erase()
    for i in sorted(set(range(len(ops))) - set(keep), reverse=True):
        ops[i].erase()
    used = [i for i, a in enumerate(body.arguments) if list(a.uses) or i >= n_orig]
    for i in reversed(range(len(body.arguments))):
        if i not in used:
            body.erase_argument(i)
    in_types = [a.type for a in body.arguments]
    out_types = [v.type for v in out_vals]
    clone.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(in_types, out_types))
    for key in ("arg_attrs", "res_attrs"):
        if key in clone.attributes:
            del clone.attributes[key]
    orig_used = [i for i in used if i < n_orig]
    return clone, orig_used, out_types
