"""``mm-inline-tasks``: flatten the program into ``@main``, tagging task ops."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from multimesh._src import ir_attrs as ta
from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import custom_call_target, select_attr_entries
from multimesh._src.mlir import attr_to_py, func, ir, passmanager, stablehlo

from . import _contract as c
from .base import ModulePass
from .match_tasks import name_stack


@dataclass(frozen=True)
class InlineTasksPass(ModulePass):
    """Flatten the program into ``@main``, tagging task ops; leaf task calls stay calls.

    A task call at the top of ``@main`` whose body holds no other task (no task
    call, no tagged op, no microbatch marker, also through the plain calls it
    makes) stays one ``func.call``: its tag becomes
    ``mm.task = {name = "...", transpose_count = N[, loop = L]}`` on the call and on
    its callee, which is made private to the call (cloned under a fresh name when
    jax's lowering cache shares it) and flat (its plain calls inlined). Passes
    treat such a call as one op of its task; ``mm-outline-fragments`` inlines it
    into its fragment. Keeping task bodies whole makes every pass before
    outlining touch one op per task call instead of every op of every body.

    Every other ``func.call`` reachable from ``@main`` is inlined: each op that
    comes out of a task call gets the task's tag, ops of plain calls inherit the
    tag of the call (if the call itself came out of a task) and its name stack in
    front of their own (``transpose(jvp(LM))/jit(log_softmax)/add_any``, as jax names
    what it inlines, so a later pass reads their direction), and calls nested in
    regions (``stablehlo.while`` bodies) are inlined in place. Ops that come out of
    a microbatch loop body (a call marked ``mm.microbatch = {loop = L, ...}``)
    belong to loop ``L``: tagged ops get ``loop = L`` in their tag, untagged ones
    ``mm.loop = L``. The task's mesh and logical mapping move to the module's
    ``mm.tasks`` table. A task name that comes with a second, different mesh or
    logical mapping (one function wrapped twice, ``task(f, mesh=a)`` and
    ``task(f, mesh=b)``) names a new task: the first keeps the name, the others
    become ``name.1``, ``name.2``, ... in program order (as the original library,
    multimesh-jax, uniquifies colours). Private functions left unreferenced are removed.
    """

    argument = "mm-inline-tasks"
    summary = "Inline calls into `@main`, tagging task ops with `mm.task`; keep leaf task calls."
    consumes = ("front-end", "flat")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            tasks = c.read_tasks(module)
            funcs = c.func_by_name(module)
            main = c.main_func(module)
            scan = _Scan(funcs)  # one walk over every function
            all_calls = [cl for name in funcs for cl in scan.calls_in(name)]
            for call in all_calls:  # checked before any edit, at the faulty call
                if c.TASK_ATTR in call.attributes:
                    c.task_call(call)
            names = _Names(tasks, _call_names(all_calls))
            uses: dict[str, int] = {}
            for call in all_calls:
                uses[c.callee_of(call)] = uses.get(c.callee_of(call), 0) + 1
            kept: set[str] = set()  # callees of the task calls that stay calls
            emptied: set[str] = set()  # callees whose only call was inlined (moved)
            while True:
                calls = [cl for cl in _collect_calls(main) if c.callee_of(cl) not in kept]
                if not calls:
                    break
                for call in calls:
                    if call.parent == main and _keepable(call, funcs, scan):
                        kept.add(_keep(call, funcs, names, uses, scan, emptied))
                    else:
                        name = c.callee_of(call)
                        if _inline(call, funcs, names, uses, scan):
                            emptied.add(name)
            c.write_tasks(module, tasks)
            _drop_dead(module, funcs, kept, emptied)


class _Scan:
    """Per function: whether it is plain (no task, tag or loop marker inside, also
    through its calls) and the calls it makes; one walk over each function, again
    only for a function that was edited."""

    def __init__(self, funcs):
        self.funcs = funcs
        self.memo: dict[str, tuple[bool, list[ir.Operation]]] = {
            name: _scan_body(fn) for name, fn in funcs.items()}

    def calls_in(self, name: str) -> list[ir.Operation]:
        return self._scan(name)[1]

    def plain(self, name: str, seen: frozenset = frozenset()) -> bool:
        if name not in self.funcs or name in seen:
            return False  # unknown callee (reported when inlined) or recursion
        ok, calls = self._scan(name)
        return ok and all(self.plain(c.callee_of(cl), seen | {name}) for cl in calls)

    def forget(self, name: str) -> None:
        self.memo.pop(name, None)

    def _scan(self, name: str) -> tuple[bool, list[ir.Operation]]:
        got = self.memo.get(name)
        if got is None:
            got = self.memo[name] = _scan_body(self.funcs[name])
        return got


_NOT_PLAIN_ATTRS = (c.TASK_ATTR, c.LOOP_ATTR, c.MICROBATCH_ATTR)
_MARKER_TARGETS = (c.INDEX_TARGET, c.SUM_TARGET, c.LOOP_TARGET)


def _scan_body(fn: ir.Operation) -> tuple[bool, list[ir.Operation]]:
    calls: list[ir.Operation] = []
    plain = [True]
    first = [True]

    def cb(op):
        if first[0]:  # the function itself
            first[0] = False
            return ir.WalkResult.ADVANCE
        attrs = op.attributes
        if len(attrs):
            name = op.name
            if name == "func.call":
                calls.append(op.operation)
            elif custom_call_target(op) in _MARKER_TARGETS:
                plain[0] = False
            if plain[0] and any(a in attrs for a in _NOT_PLAIN_ATTRS):
                plain[0] = False
        return ir.WalkResult.ADVANCE

    fn.walk(cb, ir.WalkOrder.PRE_ORDER)
    return plain[0], calls


def _keepable(call: ir.Operation, funcs, scan: _Scan) -> bool:
    """A task call whose body holds no other task: it can stay one call."""
    if c.TASK_ATTR not in call.attributes:
        return False
    attr = call.attributes[c.TASK_ATTR]
    d = attr_to_py(attr)
    if not isinstance(d, dict):
        return False
    callee = funcs.get(c.callee_of(call))
    if "devices" not in d and (callee is None or c.TASK_ATTR not in callee.attributes
                               or callee.attributes[c.TASK_ATTR] != attr):
        return False  # a flat tag: a plain call that came out of a task body
    return scan.plain(c.callee_of(call))


def _keep(call: ir.Operation, funcs, names: _Names, uses, scan: _Scan,
          emptied: set[str]) -> str:
    """Make ``call`` a leaf task call of the flat form; returns its callee's name."""
    d = attr_to_py(call.attributes[c.TASK_ATTR])
    task = names.allocate(d) if "devices" in d else d["name"]
    tag = c.tag_attr(task, int(d["transpose_count"]), _call_loop(call))
    name = c.callee_of(call)
    callee = funcs[name]
    if uses.get(name, 0) > 1:  # shared by several call sites: this one gets a copy
        uses[name] -= 1
        callee = callee.clone(ip=ir.InsertionPoint.after(callee))
        name = _fresh_name(funcs, name)
        callee.attributes["sym_name"] = ir.StringAttr.get(name)
        funcs[name] = callee
        uses[name] = 1
        call.attributes["callee"] = ir.FlatSymbolRefAttr.get(name)
        inner = _collect_calls(callee)
        for cl in inner:
            uses[c.callee_of(cl)] = uses.get(c.callee_of(cl), 0) + 1
    else:
        inner = scan.calls_in(name)
    while inner:  # flatten: the body's own (plain) calls are inlined into it
        for cl in inner:
            target = c.callee_of(cl)
            if _inline(cl, funcs, names, uses, scan):
                emptied.add(target)
        inner = _collect_calls(callee)
    scan.forget(name)
    blk = c.entry_block(callee)
    _pin_passthrough(blk.operations[len(blk.operations) - 1].operation, blk)
    call = _canonical_signature(call, callee)
    if c.LOOP_ATTR in call.attributes:  # the loop now lives in the tag
        del call.attributes[c.LOOP_ATTR]
    call.attributes[c.TASK_ATTR] = tag
    callee.attributes[c.TASK_ATTR] = tag
    return name


def _canonical_signature(call: ir.Operation, callee: ir.Operation) -> ir.Operation:
    """Give a kept callee the signature its inlined body would have had.

    Inlined, a body takes the values its ops read, in the order they first read
    them, and yields the values read after it in the order they are made (once
    each): outlining orders a fragment's arguments and results that way. So the
    callee's arguments are reordered by first use (unused ones dropped) and its
    results by the op that makes them (repeats merged); the call follows. Returns
    the call (a new one when the signature changed).
    """
    blk = c.entry_block(callee)
    ret = blk.operations[len(blk.operations) - 1].operation
    fn = callee.operation
    keys = _first_uses(blk, fn)
    args = _sorted_by([i for i, k in enumerate(keys) if k is not None], keys)
    results, same_as = _result_order(ret)
    if args == list(range(len(keys))) and results == list(range(len(ret.operands))):
        return call
    ftype = _reorder_callee(fn, blk, ret, args, results)
    # the call
    with ir.InsertionPoint(call), call.location:
        new = func.CallOp([ftype.results[k] for k in results],
                          ir.FlatSymbolRefAttr.get(c.callee_of(call)),
                          [call.operands[i] for i in args]).operation
    for a in call.attributes:
        key = a if isinstance(a, str) else a.name
        if key not in ("callee", "arg_attrs", "res_attrs"):
            new.attributes[key] = call.attributes[key]
    where = {k: p for p, k in enumerate(results)}
    for k, r in enumerate(call.results):
        r.replace_all_uses_with(new.results[where[same_as.get(k, k)]])
    call.erase()
    return new


def _result_order(ret: ir.Operation) -> tuple[list[int], dict[int, int]]:
    """The callee's results in the order their values are made, repeats merged: the
    kept result numbers, and for each repeat the earlier result it returns again."""
    seen: dict = {}
    same_as: dict[int, int] = {}
    for k, v in enumerate(ret.operands):
        if v in seen:
            same_as[k] = seen[v]
        else:
            seen[v] = k
    firsts = [k for k in range(len(ret.operands)) if k not in same_as]
    made = {k: (ret.operands[k].owner.operation, 0, ir.OpResult(ret.operands[k]).result_number)
            for k in firsts}
    return _sorted_by(firsts, made), same_as


def _sorted_by(order: list[int], keys: Sequence[Any] | Mapping[int, Any]) -> list[int]:
    """``order`` sorted by ``keys[i]`` (see :func:`_cmp`), ties by position."""
    def cmp(i: int, j: int) -> int:
        return _cmp(keys[i], keys[j]) or i - j

    return sorted(order, key=functools.cmp_to_key(cmp))


def _reorder_callee(fn: ir.Operation, blk: ir.Block, ret: ir.Operation, args: list[int],
                    results: list[int]) -> ir.FunctionType:
    """The callee with arguments and results in their new order; returns its old type."""
    old_args = list(blk.arguments)
    for i in args:
        old_args[i].replace_all_uses_with(blk.add_argument(old_args[i].type, old_args[i].location))
    for _ in old_args:
        blk.erase_argument(0)
    with ir.InsertionPoint(ret), ret.location:
        func.ReturnOp([ret.operands[k] for k in results])
    ret.erase()
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        [ftype.inputs[i] for i in args], [ftype.results[k] for k in results]))
    select_attr_entries(fn, "arg_attrs", args)
    select_attr_entries(fn, "res_attrs", results)
    return ftype


_FEW_USES = 8


def _first_uses(blk: ir.Block, fn: ir.Operation) -> list:
    """Per argument of ``fn``: ``(op of its body, 0, operand number)`` of its first
    direct use, ``(op, 1, 0)`` when first used inside that op's regions, None if
    unused. An argument with few uses looks at them; the others are found by walking
    the body from its start until each has been seen."""
    keys: list = []
    many: dict = {}  # argument -> its index, for the walk
    for i, arg in enumerate(blk.arguments):
        uses = []
        for use in arg.uses:
            uses.append(use)
            if len(uses) > _FEW_USES:
                break
        if len(uses) > _FEW_USES:
            many[arg] = i
            keys.append(None)
        else:
            keys.append(_earliest_use(uses, fn))
    if many:
        _walk_first_uses(blk, many, keys)
    return keys


def _earliest_use(uses: list, fn: ir.Operation) -> tuple | None:
    best = None
    for use in uses:
        user = use.owner.operation
        top = user
        while top.parent.operation != fn:
            top = top.parent.operation
        key = (top, 0, use.operand_number) if top == user else (top, 1, 0)
        if best is None or _cmp(key, best) < 0:
            best = key
    return best


def _walk_first_uses(blk: ir.Block, many: dict, keys: list) -> None:
    """Fill ``keys`` for the arguments in ``many`` by walking the body in order."""
    for view in blk.operations:
        op = view.operation
        for k, v in enumerate(op.operands):
            i = many.get(v)
            if i is not None and keys[i] is None:
                keys[i] = (op, 0, k)
        if len(op.regions):
            _first_nested(op, many, keys)
        if all(keys[i] is not None for i in many.values()):
            break


def _first_nested(top: ir.Operation, many: dict, keys: list) -> None:
    """Arguments in ``many`` first read inside ``top``'s regions get ``(top, 1, 0)``."""
    found = []

    def cb(o):
        if o.operation != top:
            for v in o.operands:
                i = many.get(v)
                if i is not None and keys[i] is None:
                    found.append(i)
        return ir.WalkResult.ADVANCE

    top.walk(cb, ir.WalkOrder.PRE_ORDER)
    for i in found:
        if keys[i] is None:
            keys[i] = (top, 1, 0)


def _cmp(a, b) -> int:
    """Order of two ``(op, rank, number)`` keys: by op position in the block, then the rest."""
    if a[0] != b[0]:
        return -1 if a[0].is_before_in_block(b[0]) else 1
    return (a[1:] > b[1:]) - (a[1:] < b[1:])


def _fresh_name(funcs, base: str) -> str:
    k = 1
    while f"{base}_{k}" in funcs:
        k += 1
    return f"{base}_{k}"


def _pin_passthrough(ret_op: ir.Operation, blk: ir.Block) -> list[int]:
    """A task result that is just one of its arguments (an identity task, or the
    backward of ``x + y``) would leave the task with no op, and the value would stay
    where it came from: pin it to the task with an identity op."""
    passthrough = [k for k, v in enumerate(ret_op.operands)
                   if isinstance(v.owner, ir.Block) and v.owner == blk]
    if passthrough:
        with ir.InsertionPoint(ret_op), ret_op.location:
            barrier = stablehlo.OptimizationBarrierOp([ret_op.operands[k] for k in passthrough])
        for k, r in zip(passthrough, barrier.results):
            ret_op.operands[k] = r
    return passthrough


def _drop_dead(module: ir.Module, funcs, kept: set[str], emptied: set[str]) -> None:
    """Remove the callees left without callers (symbol-dce unless only known ones)."""
    others = [n for n in funcs if n != "main" and n not in kept and n not in emptied]
    if others:
        pm = passmanager.PassManager.parse("builtin.module(symbol-dce)")
        pm.run(module.operation)
        return
    for n in emptied:
        funcs[n].erase()


def _collect_calls(root: ir.Operation) -> list[ir.Operation]:
    out = []

    def cb(op):
        if op.name == "func.call":
            out.append(op.operation)
        return ir.WalkResult.ADVANCE

    root.walk(cb, ir.WalkOrder.PRE_ORDER)
    return out


def _inline(call: ir.Operation, funcs, names: _Names, uses, scan: _Scan | None = None) -> bool:
    """Inline ``call`` where it stands; True when its callee was moved (its only use)."""
    name = c.callee_of(call)
    callee = funcs.get(name)
    if callee is None:
        raise DiagnosticError(f"call to unknown function '@{name}'", call.location)
    tag = None
    loop = _call_loop(call)
    if c.TASK_ATTR in call.attributes:
        d = attr_to_py(call.attributes[c.TASK_ATTR])
        task = names.allocate(d) if "devices" in d else d["name"]
        tag = c.tag_attr(task, int(d["transpose_count"]), loop)
    moved = uses.get(name, 0) <= 1
    body = _body_to_inline(callee, name, moved, uses, scan)
    blk = c.entry_block(body)
    ret_op = blk.operations[len(blk.operations) - 1].operation
    for arg, operand in zip(blk.arguments, call.operands):
        arg.replace_all_uses_with(operand)
    if tag is not None:
        _pin_passthrough(ret_op, blk)
    ops = [o.operation for o in blk.operations]
    ret = ops[-1]
    # a plain call's ops (not a task's, not the microbatch loop body's) carry its name
    site = name_stack(call.location) if tag is None and c.microbatch_of(call) is None else None
    for op in ops[:-1]:
        op.move_before(call)
        _retag(op, tag, loop)
        if site:
            _prefix_name(op, site)
    for res, val in zip(call.results, ret.operands):
        res.replace_all_uses_with(val)
    call.erase()
    if body is not callee:
        body.erase()
    return moved


def _prefix_name(op: ir.Operation, site: str) -> None:
    """Name an op inlined from a plain call by its whole name stack, the call site's in
    front of its own (``transpose(jvp(LM))/jit(log_softmax)/add_any``), as jax names the
    ops of a call it inlines: a callee's ops carry only their stack relative to the call,
    and ``mm-assign-tasks`` reads an op's direction from its whole stack."""
    own = name_stack(op.location)
    op.location = ir.Location.name(f"{site}/{own}" if own else site, childLoc=op.location)


def _body_to_inline(callee: ir.Operation, name: str, moved: bool, uses,
                    scan: _Scan | None) -> ir.Operation:
    """The callee itself when this is its only use, else a copy (whose calls count)."""
    uses[name] = uses.get(name, 0) - 1
    if moved:
        if scan is not None:
            scan.forget(name)
        return callee
    body = callee.clone()
    for inner in _collect_calls(body):  # the copy's calls are new uses
        uses[c.callee_of(inner)] = uses.get(c.callee_of(inner), 0) + 1
    return body


def _retag(op: ir.Operation, tag: ir.Attribute | None, loop: int) -> None:
    """An inlined op gets the call's task (untagged ops) or learns its loop."""
    has_task = c.TASK_ATTR in op.attributes
    if not has_task and tag is not None:
        op.attributes[c.TASK_ATTR] = tag
        return
    if loop < 0:
        return
    if not has_task or op.name == "func.call":  # a task call's ops learn it when inlined
        op.attributes[c.LOOP_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), loop)
        return
    t = c.tag_of(op)  # tagged by mm-match-tasks: the tag carries the loop
    assert t is not None
    op.attributes[c.TASK_ATTR] = c.tag_attr(t[0], t[1], loop)


def _call_loop(call: ir.Operation) -> int:
    """The microbatch loop the call's ops belong to: the loop it opens, or the one it is in."""
    d = c.microbatch_of(call)
    if d is not None:
        return d.get("loop", 0)
    if c.LOOP_ATTR in call.attributes:
        return ta.read_attr(call, c.LOOP_ATTR, c.LOOP_ID)
    if c.TASK_ATTR in call.attributes:
        d = attr_to_py(call.attributes[c.TASK_ATTR])
        if isinstance(d, dict) and "loop" in d:
            return ta.read(d["loop"], ta.int_in(-1, c.MAX_ID), f"'{c.TASK_ATTR}' loop",
                           call.location)
    return -1


def _call_names(calls) -> set[str]:
    """Every task name a call of the module uses (so a new name never takes one)."""
    out = set()
    for call in calls:
        if c.TASK_ATTR in call.attributes:
            d = attr_to_py(call.attributes[c.TASK_ATTR])
            if isinstance(d, dict) and isinstance(d.get("name"), str):
                out.add(d["name"])
    return out


class _Names:
    """Task names, one per distinct (name, mesh, logical mapping) in program order."""

    def __init__(self, tasks: dict[str, c.MeshRecord], taken: set[str]):
        self.tasks = tasks
        self.taken = set(taken) | set(tasks)
        self.given: dict[tuple[str, c.MeshRecord], str] = {}

    def allocate(self, d: dict) -> str:
        info = c.MeshRecord.from_dict(d)
        key = (d["name"], info)
        name = self.given.get(key)
        if name is None:
            name = d["name"]
            old = self.tasks.get(name)
            if old is not None and old != info:
                k = 1
                while f"{d['name']}.{k}" in self.taken:
                    k += 1
                name = f"{d['name']}.{k}"
            self.taken.add(name)
            self.tasks[name] = info
            self.given[key] = name
        return name
