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
    mapping move to the module's ``mm.tasks`` table. Ops of plain calls inherit
    the tag of the call (if the call itself came out of a task). Calls nested in
    regions (``stablehlo.while`` bodies) are inlined in place. Giving one task
    name two different meshes is an error. Private functions left unreferenced
    are removed.
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
            uses: dict[str, int] = {}
            while True:
                calls = _collect_calls(main)
                if not calls:
                    break
                uses.clear()
                for call in _collect_calls_module(module):
                    uses[c.callee_of(call)] = uses.get(c.callee_of(call), 0) + 1
                for call in calls:
                    _inline(call, funcs, tasks, uses)
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


def _inline(call: ir.Operation, funcs, tasks, uses) -> None:
    name = c.callee_of(call)
    callee = funcs.get(name)
    if callee is None:
        raise DiagnosticError(f"call to unknown function '@{name}'", call.location)
    tag = None
    if c.TASK_ATTR in call.attributes:
        d = attr_to_py(call.attributes[c.TASK_ATTR])
        if "devices" in d:
            _register(tasks, d, call)
        tag = c.tag_attr(d["name"], int(d["transpose_count"]), int(d.get("microbatch", -1)))
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
    for op in ops[:-1]:
        op.move_before(call)
        if tag is not None and c.TASK_ATTR not in op.attributes:
            op.attributes[c.TASK_ATTR] = tag
    for res, val in zip(call.results, ret.operands):
        res.replace_all_uses_with(val)
    call.erase()
    if body is not callee:
        body.erase()


def _register(tasks, d: dict, call: ir.Operation) -> None:
    info = c.TaskMeshInfo.from_dict(d)
    old = tasks.get(d["name"])
    if old is not None and old.mesh_key() != info.mesh_key():
        raise DiagnosticError(
            f"task '{d['name']}' was given two different submeshes: devices "
            f"{list(old.devices)} with axes {dict(zip(old.axis_names, old.axis_sizes))} and "
            f"devices {list(info.devices)} with axes "
            f"{dict(zip(info.axis_names, info.axis_sizes))}; a task name has one submesh",
            call.location)
    if old is not None and old.logical_axes != info.logical_axes:
        raise DiagnosticError(
            f"task '{d['name']}' was given two different logical mappings: "
            f"{[list(p) for p in old.logical_axes]} and {[list(p) for p in info.logical_axes]}",
            call.location)
    tasks[d["name"]] = info
