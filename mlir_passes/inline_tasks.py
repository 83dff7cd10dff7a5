"""``mm-inline-tasks``: flatten the program into ``@main``, tagging task ops."""

from __future__ import annotations

from dataclasses import dataclass

from mlir_passes import _contract as c
from mlir_passes.base import ModulePass
from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import attr_to_py, ir, passmanager, stablehlo


@dataclass(frozen=True)
class InlineTasksPass(ModulePass):
    """Inline every ``func.call`` reachable from ``@main`` (task calls and plain ones).

    Each op that comes out of a task call gets
    ``mm.task = {name = "...", transpose_count = N}``; the task's mesh and logical
    mapping move to the module's ``mm.tasks`` table. Ops that come out of a
    microbatch loop body (a call marked ``mm.microbatch = {loop = L, ...}``) belong to
    loop ``L``: tagged ops get ``loop = L`` in their tag, untagged ones ``mm.loop = L``.
    Ops of plain calls inherit the tag of the call (if the call itself came out of a task). Calls nested in
    regions (``stablehlo.while`` bodies) are inlined in place. A task name that
    comes with a second, different mesh or logical mapping (one function wrapped
    twice, ``task(f, mesh=a)`` and ``task(f, mesh=b)``) names a new task: the
    first keeps the name, the others become ``name.1``, ``name.2``, ... in
    program order (MultiMesh uniquifies colours the same way). Private functions
    left unreferenced are removed.
    """

    argument = "mm-inline-tasks"
    summary = "Inline every `func.call` into `@main`, tagging task ops with `mm.task`."
    consumes = ("front-end", "flat")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            tasks = c.read_tasks(module)
            c.check_task_calls(module.operation)  # before any edit, at the faulty call
            funcs = c.func_by_name(module)
            main = c.main_func(module)
            names = _Names(tasks, _call_names(module))
            uses: dict[str, int] = {}
            while True:
                calls = _collect_calls(main)
                if not calls:
                    break
                uses.clear()
                for call in _collect_calls_module(module):
                    uses[c.callee_of(call)] = uses.get(c.callee_of(call), 0) + 1
                for call in calls:
                    _inline(call, funcs, names, uses)
            c.write_tasks(module, tasks)
            pm = passmanager.PassManager.parse("builtin.module(symbol-dce)")
            pm.run(module.operation)


def _collect_calls(root: ir.Operation) -> list[ir.Operation]:
    out = []

    def cb(op):
        if op.operation.name == "func.call":
            out.append(op.operation)
        return ir.WalkResult.ADVANCE

    root.walk(cb, ir.WalkOrder.PRE_ORDER)
    return out


def _collect_calls_module(module: ir.Module) -> list[ir.Operation]:
    return _collect_calls(module.operation)


def _inline(call: ir.Operation, funcs, names: _Names, uses) -> None:
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
    if uses.get(name, 0) <= 1:
        body = callee  # only use: move the body instead of cloning it
    else:
        body = callee.clone()
    uses[name] = uses.get(name, 0) - 1
    blk = c.entry_block(body)
    ret_op = list(blk.operations)[-1].operation
    # A task result that is just one of its arguments (an identity task, or the
    # backward of `x + y`) would leave the task with no op, and the value would stay
    # where it came from: pin it to the task with an identity op.
    passthrough = [k for k, v in enumerate(ret_op.operands)
                   if tag is not None and isinstance(v.owner, ir.Block) and v.owner == blk]
    for arg, operand in zip(blk.arguments, call.operands):
        arg.replace_all_uses_with(operand)
    if passthrough:
        with ir.InsertionPoint(ret_op), ret_op.location:
            barrier = stablehlo.OptimizationBarrierOp([ret_op.operands[k] for k in passthrough])
        for k, r in zip(passthrough, barrier.results):
            ret_op.operands[k] = r
    ops = [o.operation for o in blk.operations]
    ret = ops[-1]
    loop_attr = (ir.IntegerAttr.get(ir.IntegerType.get_signless(64), loop)
                 if loop >= 0 else None)
    for op in ops[:-1]:
        op.move_before(call)
        if c.TASK_ATTR not in op.attributes:
            if tag is not None:
                op.attributes[c.TASK_ATTR] = tag
            elif loop_attr is not None:
                op.attributes[c.LOOP_ATTR] = loop_attr
        elif loop_attr is not None:
            if op.name == "func.call":  # a task call: its ops learn the loop when inlined
                op.attributes[c.LOOP_ATTR] = loop_attr
            else:  # tagged by mm-match-tasks: the tag carries the loop
                t = c.tag_of(op)
                op.attributes[c.TASK_ATTR] = c.tag_attr(t[0], t[1], loop)
    for res, val in zip(call.results, ret.operands):
        res.replace_all_uses_with(val)
    call.erase()
    if body is not callee:
        body.erase()


def _call_loop(call: ir.Operation) -> int:
    """The microbatch loop the call's ops belong to: the loop it opens, or the one it is in."""
    if c.MICROBATCH_ATTR in call.attributes:
        d = attr_to_py(call.attributes[c.MICROBATCH_ATTR])
        return int(d.get("loop", 0)) if isinstance(d, dict) else 0
    if c.LOOP_ATTR in call.attributes:
        return ir.IntegerAttr(call.attributes[c.LOOP_ATTR]).value
    if c.TASK_ATTR in call.attributes:
        d = attr_to_py(call.attributes[c.TASK_ATTR])
        return int(d.get("loop", -1)) if isinstance(d, dict) else -1
    return -1


def _call_names(module: ir.Module) -> set[str]:
    """Every task name a call of the module uses (so a new name never takes one)."""
    out = set()
    for call in _collect_calls_module(module):
        if c.TASK_ATTR in call.attributes:
            d = attr_to_py(call.attributes[c.TASK_ATTR])
            if isinstance(d, dict) and isinstance(d.get("name"), str):
                out.add(d["name"])
    return out


class _Names:
    """Task names, one per distinct (name, mesh, logical mapping) in program order."""

    def __init__(self, tasks: dict[str, c.TaskMeshInfo], taken: set[str]):
        self.tasks = tasks
        self.taken = set(taken) | set(tasks)
        self.given: dict[tuple[str, c.TaskMeshInfo], str] = {}

    def allocate(self, d: dict) -> str:
        info = c.TaskMeshInfo.from_dict(d)
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
