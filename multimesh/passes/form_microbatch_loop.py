"""``mm-form-microbatch-loop``: gather a microbatch loop's fragment calls into its body."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import attr_entries, mesh_attrs
from multimesh._src.mlir import func, ir, stablehlo

from . import _contract as c
from .base import ModulePass

__all__ = ["FormMicrobatchLoopPass", "BODY_NAME"]

BODY_NAME = "microbatch_loop"


@dataclass(frozen=True)
class FormMicrobatchLoopPass(ModulePass):
    """Turn the flat loop (markers around in-loop fragment calls) into an explicit loop.

    Input is the MPMD form after ``mm-propagate-shardings`` of a microbatched
    program: ``@main`` holds fragment calls, the ``mm.microbatch_index`` marker and
    ``mm.microbatch_sum`` markers, and fragments of the loop have ``loop = 0`` in
    their ``mm.task``. Afterwards:

    * the loop's calls (in program order) live in ``func.func private
      @microbatch_loop(%index, %running_sums..., %invariants...)``, which returns
      the new running sums; one call of it is one microbatch;
    * ``@main`` calls it once through ``stablehlo.custom_call @mm.microbatch_loop(
      %zero_sums..., %invariants...) {mm.body = @microbatch_loop,
      mm.num_microbatches = M}``, whose results are the sums;
    * every sum is accumulated in place by the fragment that produces it: the
      fragment takes the running sum as an extra argument (a ``jax.buffer_donor``,
      so XLA adds in place) and returns ``running sum + value``;
    * one ``@<task>_acc_init`` fragment per task makes the zero accumulators,
      called before the loop (the runtime recognises it and puts the zeros on the
      devices itself: it is never compiled, docs/ir.md).

    ``@main`` ends up ordered as: the calls the loop does not depend on, the
    initialisations, the loop, and the calls that read its sums. A program
    without loop markers is left unchanged.
    """

    argument = "mm-form-microbatch-loop"
    summary = "Move a microbatch loop's fragment calls into a loop body called once per microbatch."
    consumes = ("mpmd",)

    def apply(self, module: ir.Module) -> None:
        with module.context, module.operation.location:
            main = c.main_func(module)
            block = c.entry_block(main)
            ops = [o.operation for o in block.operations]
            index_ops = [op for op in ops if c.is_custom_call(op, c.INDEX_TARGET)]
            sums = [op for op in ops if c.is_custom_call(op, c.SUM_TARGET)]
            if not index_ops and not sums:
                return
            funcs = c.func_by_name(module)
            meshes = mesh_attrs(module)
            num = _num_microbatches(sums, index_ops, module)
            for op in ops:
                if op.name == "func.call":
                    if c.callee_of(op) not in funcs:
                        raise DiagnosticError(
                            f"fragment call to unknown function @{c.callee_of(op)}",
                            op.location)
                    c.fragment_info(funcs[c.callee_of(op)], meshes, need_task=True)
            inloop = _loop_calls(ops, funcs)
            _check_structure(ops, inloop, sums, funcs)
            acc = _plan_accumulators(sums, inloop, funcs)
            _LoopBuilder(module, main, funcs, num).build(ops, inloop, index_ops, sums, acc)


def _num_microbatches(sums, index_ops, module) -> int:
    found: dict[int, ir.Operation] = {}
    for op in sums:
        d = c.microbatch_of(op)
        if d is None or "num_microbatches" not in d:
            raise DiagnosticError(
                f"'{c.SUM_TARGET}' needs '{c.MICROBATCH_ATTR} = {{loop = 0, num_microbatches = "
                f"M}}' with M >= 1", op.location)
        if d.get("loop", 0) != 0:
            raise DiagnosticError(
                f"only one microbatch loop (loop 0) is supported, got loop {d.get('loop')}",
                op.location)
        found.setdefault(d["num_microbatches"], op)
    if len(found) > 1:
        a, b = sorted(found)[:2]
        raise DiagnosticError(
            f"the loop's sums disagree on the number of microbatches ({a} and {b})",
            found[b].location)
    if not found:
        loc = index_ops[0].location if index_ops else module.operation.location
        raise DiagnosticError(
            "a microbatch loop needs at least one 'mm.microbatch_sum' (its outputs)", loc)
    return next(iter(found))


def _loop_calls(ops, funcs) -> list[ir.Operation]:
    out = []
    for op in ops:
        if op.name == "func.call":
            tag = c.tag_of(funcs[c.callee_of(op)])
            if tag is not None and tag[2] >= 0:
                if tag[2] != 0:
                    raise DiagnosticError(
                        f"only one microbatch loop (loop 0) is supported, got loop {tag[2]}",
                        op.location)
                out.append(op)
    return out


def _check_structure(ops, inloop, sums, funcs) -> None:
    """In-loop values leave the loop only through sums; every sum reads the loop."""
    _check_no_escape(ops, inloop)
    calls = set(inloop)
    for s in sums:
        owner = s.operands[0].owner
        if isinstance(owner, ir.Block) or owner.operation not in calls:
            raise DiagnosticError(
                f"'{c.SUM_TARGET}' must sum a result of a fragment call in the loop "
                f"(a fragment whose mm.task has loop = 0)", s.location)
    seen: dict[str, int] = {}
    for call in inloop:
        seen[c.callee_of(call)] = seen.get(c.callee_of(call), 0) + 1
    for call in inloop:
        if seen[c.callee_of(call)] > 1 and any(
                s.operands[0].owner.operation == call for s in sums):
            raise DiagnosticError(
                f"fragment '@{c.callee_of(call)}' is called more than once but accumulates a "
                f"sum; each accumulating fragment must have one call", call.location)


def _check_no_escape(ops, inloop) -> None:
    """No op outside the loop (sums and markers aside) reads an in-loop value or the
    microbatch index (which exists only inside the loop)."""
    inside = {r for call in inloop for r in call.results}
    index = {op.results[0] for op in ops if c.is_custom_call(op, c.INDEX_TARGET)}
    loop_ops = set(inloop)
    for op in ops:
        if op.name == "func.return" or c.is_loop_marker(op) or op in loop_ops:
            continue
        for v in op.operands:
            if v in inside:
                raise DiagnosticError(
                    f"'{op.name}' outside the microbatch loop reads a value of the loop "
                    f"directly; loop values leave the loop only through '{c.SUM_TARGET}'",
                    op.location)
            if v in index:
                raise DiagnosticError(
                    f"'{op.name}' outside the microbatch loop reads the microbatch index "
                    f"'{c.INDEX_TARGET}'; only calls in the loop (mm.task with loop = 0) "
                    f"may read it", op.location)


def _plan_accumulators(sums, inloop, funcs) -> dict:
    """Per in-loop call: ``[(result number, [sum ops])]`` of the values it accumulates."""
    per_call: dict = {}
    for s in sums:
        v = s.operands[0]
        call = v.owner.operation
        per_call.setdefault(call, {}).setdefault(v.result_number, []).append(s)
    return {call: sorted(d.items()) for call, d in per_call.items()}


def _invariants(inloop, index_values) -> list[ir.Value]:
    """Values the loop's calls read from outside the loop (the index aside), in order."""
    loop_set = set(inloop)
    invariants: list[ir.Value] = []
    seen: set = set()
    for call in inloop:
        for v in call.operands:
            owner = v.owner
            inside = not isinstance(owner, ir.Block) and owner.operation in loop_set
            if v in index_values or inside or v in seen:
                continue
            seen.add(v)
            invariants.append(v)
    return invariants


class _LoopBuilder:
    """Builds the microbatch loop's body function and its calls in ``@main``."""

    def __init__(self, module, main, funcs, num):
        self.module = module
        self.main = main
        self.funcs = funcs
        self.num = num

    def build(self, ops, inloop, index_ops, sums, acc) -> None:
        block = c.entry_block(self.main)
        ret = ops[-1]
        carries, extra_args = self._carries(inloop, acc)
        index_values = {op.results[0] for op in index_ops}
        invariants = _invariants(inloop, index_values)
        carry_types = [self._result_type(call, rn) for call, rn, _ in carries]
        self._body_fn(inloop, index_values, invariants, carries, carry_types, extra_args)
        # 3. @main: zero initialisers and the loop in place of the markers and calls
        inits = self._initializers(carries, ret)
        with ir.InsertionPoint(ret), self.main.location:
            loop = stablehlo.CustomCallOp(
                carry_types, inits + invariants,
                call_target_name=ir.StringAttr.get(c.LOOP_TARGET),
                has_side_effect=ir.BoolAttr.get(False),
                api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1)).operation
        loop.attributes[c.BODY_ATTR] = ir.FlatSymbolRefAttr.get(BODY_NAME)
        loop.attributes[c.NUM_MICROBATCHES_ATTR] = ir.IntegerAttr.get(
            ir.IntegerType.get_signless(64), self.num)
        for k, (_, _, group) in enumerate(carries):
            for s in group:
                s.results[0].replace_all_uses_with(loop.results[k])
        for s in sums:
            s.erase()
        for call in reversed(inloop):
            call.erase()
        for op in index_ops:
            op.erase()
        _order_main(block, loop, ret)

    def _carries(self, inloop, acc) -> tuple[list, dict]:
        """1. Each producing fragment accumulates its sums in place: the carries
        ``(old call, new result number, sum ops)`` in order, and per old call the carry
        numbers of its running-sum arguments."""
        carries: list = []
        extra_args: dict = {}
        for call in inloop:
            if call not in acc:
                continue
            new_numbers = self._accumulate(call, acc[call])
            extra_args[call] = []
            for (_, group), rn in zip(acc[call], new_numbers):
                extra_args[call].append(len(carries))
                carries.append((call, rn, group))
        return carries, extra_args

    def _body_fn(self, inloop, index_values, invariants, carries, carry_types,
                 extra_args) -> None:
        """2. The loop body: index, running sums, invariants -> new running sums."""
        i32 = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
        arg_types = [i32] + carry_types + [v.type for v in invariants]
        with ir.InsertionPoint(self.module.body), self.main.location:
            body_fn = func.FuncOp(  # type: ignore[call-arg]  # stubs show the generated
                BODY_NAME, ir.FunctionType.get(arg_types, carry_types),  # FuncOp, not
                visibility="private")  # func.py's subclass, which adds these
            body = body_fn.add_entry_block()  # type: ignore[attr-defined]  # (the same)
        args = list(body.arguments)
        value: dict[ir.Value, ir.Value] = {v: args[0] for v in index_values}
        carry_args = args[1:1 + len(carries)]
        value.update({v: args[1 + len(carries) + k] for k, v in enumerate(invariants)})
        new_calls: dict = {}
        for call in inloop:
            operands = [value[v] for v in call.operands]
            operands += [carry_args[k] for k in extra_args.get(call, [])]
            fn = self.funcs[c.callee_of(call)]
            ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
            with ir.InsertionPoint(body), call.location:
                new = func.CallOp(list(ftype.results), ir.FlatSymbolRefAttr.get(
                    c.callee_of(call)), operands).operation
            new.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
            new_calls[call] = new
            for r, nr in zip(call.results, new.results):
                value[r] = nr
        with ir.InsertionPoint(body), self.main.location:
            func.ReturnOp([new_calls[call].results[rn] for call, rn, _ in carries])

    def _result_type(self, call, rn):
        fn = self.funcs[c.callee_of(call)]
        return ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).results[rn]

    def _accumulate(self, call, items) -> list[int]:
        """Give the call's fragment a running-sum argument per summed result.

        Returns the result numbers that carry the new running sums.
        """
        fn = self.funcs[c.callee_of(call)]
        body = c.entry_block(fn)
        ret = list(body.operations)[-1].operation
        nres = len(call.results)
        arg_attrs = attr_entries(fn, "arg_attrs")
        res_attrs = attr_entries(fn, "res_attrs")
        outs = list(ret.operands)
        extra: list = []
        numbers = []
        for rn, _group in items:
            a = body.add_argument(call.results[rn].type, fn.location)
            d: dict[str, ir.Attribute] = {c.DONOR_ATTR: ir.BoolAttr.get(True)}
            if "sdy.sharding" in res_attrs[rn]:
                d["sdy.sharding"] = res_attrs[rn]["sdy.sharding"]
            arg_attrs.append(ir.DictAttr.get(d))
            with ir.InsertionPoint(ret), ret.location:
                total = stablehlo.AddOp(a, outs[rn]).result
            if any(not c.is_custom_call(u.owner.operation, c.SUM_TARGET)
                   for u in call.results[rn].uses):  # also used as it is: keep it
                extra.append((total, res_attrs[rn]))
                numbers.append(nres + len(extra) - 1)
            else:
                outs[rn] = total
                numbers.append(rn)
        outs += [t for t, _ in extra]
        res_attrs += [a for _, a in extra]
        with ir.InsertionPoint(ret), ret.location:
            func.ReturnOp(outs)
        ret.erase()
        fn.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        fn.attributes["res_attrs"] = ir.ArrayAttr.get(res_attrs)
        fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [a.type for a in body.arguments], [v.type for v in outs]))
        return numbers

    def _initializers(self, carries, ret) -> list[ir.Value]:
        """Zero running sums: one ``@<task>_acc_init`` fragment per task, before the loop."""
        by_task: dict[str, list[int]] = {}
        for k, (call, _, _) in enumerate(carries):
            by_task.setdefault(_task_of(self.funcs[c.callee_of(call)])[0], []).append(k)
        out: list = [None] * len(carries)
        for task, ks in by_task.items():
            first = self.funcs[c.callee_of(carries[ks[0]][0])]
            safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in task)
            name, n = f"{safe}_acc_init", 1
            while name in self.funcs:
                name, n = f"{safe}_acc_init_{n}", n + 1
            types, attrs = [], []
            for k in ks:
                call, rn, _ = carries[k]
                fn = self.funcs[c.callee_of(call)]
                types.append(self._result_type(call, rn))
                attrs.append(attr_entries(fn, "res_attrs")[rn])
            with ir.InsertionPoint(self.module.body), self.main.location:
                init_op = func.FuncOp(  # type: ignore[call-arg]  # as in _body_fn
                    name, ir.FunctionType.get([], types), visibility="private")
                body = init_op.add_entry_block()  # type: ignore[attr-defined]  # (the same)
            with ir.InsertionPoint(body), self.main.location:
                func.ReturnOp([_zeros(t) for t in types])
            init = init_op.operation
            init.attributes["res_attrs"] = ir.ArrayAttr.get(attrs)
            tag = _task_of(first)
            init.attributes[c.TASK_ATTR] = c.tag_attr(tag[0], tag[1])
            for key in (c.DEVICES_ATTR, c.MESH_ATTR):
                init.attributes[key] = first.attributes[key]
            self.funcs[name] = init
            with ir.InsertionPoint(ret), self.main.location:
                cl = func.CallOp(types, ir.FlatSymbolRefAttr.get(name), [])
            cl.operation.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
            for k, r in zip(ks, cl.results):
                out[k] = r
        return out



def _task_of(fn: ir.Operation) -> c.Tag:
    """A fragment's tag (outlined fragments always carry one)."""
    tag = c.tag_of(fn)
    assert tag is not None, c.func_name(fn)
    return tag

def _zeros(t) -> ir.Value:
    """A splat zero constant of tensor type ``t`` (XLA materialises it on device)."""
    rt = ir.RankedTensorType(t)
    et = rt.element_type
    if isinstance(et, ir.IntegerType):
        attr = ir.DenseElementsAttr.get_splat(rt, ir.IntegerAttr.get(et, 0))
    elif isinstance(et, ir.ComplexType):
        part = ir.ComplexType(et).element_type
        dtype = np.complex64 if ir.FloatType(part).width == 32 else np.complex128
        attr = ir.DenseElementsAttr.get(  # type: ignore[call-overload]  # the stubs do not
            np.zeros(rt.shape, dtype=dtype), type=rt)  # list numpy arrays (buffers) it takes
    else:
        attr = ir.DenseElementsAttr.get_splat(rt, ir.FloatAttr.get(et, 0.0))
    return stablehlo.ConstantOp(attr).result


def _order_main(block, loop, ret) -> None:
    """Calls the loop does not depend on, then the loop, then the rest (program order)."""
    ops = [o.operation for o in block.operations]
    ops = [op for op in ops if op != ret and op != loop]
    after = {r for r in loop.results}
    post = []
    for op in ops:
        if any(v in after for v in op.operands):
            post.append(op)
            after.update(op.results)
    for op in post:
        op.move_before(ret)
    loop.move_before(post[0] if post else ret)
