"""Which form of docs/ir.md a module is in, so a pass can refuse the wrong one.

A pass run on a module from the wrong stage does not always fail: the full pipeline
run on its own output used to collapse the program into one fragment, and
``mm-insert-transfers`` on a flat module failed at ``1:1`` with no hint. Each pass
declares the forms it ``consumes``; :func:`check_stage` (called by
``ModulePass.run``) names the form found, the op that shows it, and what to run.

Detection reads the module's top-level ops (a handful), walking ``@main`` only when
functions other than fragments remain, so it is cheap at any module size.
"""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import ir

from . import _contract as c

__all__ = ["STAGES", "stage_of", "check_stage"]

FRONT_END, FLAT, MPMD, EXTRACTED = "front-end", "flat", "mpmd", "extracted"
STAGES = (FRONT_END, FLAT, MPMD, EXTRACTED)
"""The forms of docs/ir.md, in pipeline order."""

DESCRIPTION = {
    FRONT_END: "front-end form (task calls not inlined yet, docs/ir.md section 1)",
    FLAT: "flat form (one @main, ops tagged with their task, docs/ir.md sections 2-3)",
    MPMD: "MPMD form (fragment functions called from @main, docs/ir.md section 4)",
    EXTRACTED: "extracted MPMD form (nested fragment modules called by mm.fragment_call, "
               "after mm-extract-fragments)",
}
_ENTERED_BY = {FLAT: "mm-inline-tasks", MPMD: "mm-outline-fragments",
               EXTRACTED: "mm-extract-fragments"}
"""The pass that takes a module from the previous stage into this one."""


@dataclass
class _TopLevel:
    """What ``stage_of`` needs to know about the module's top-level functions."""

    main: ir.Operation | None = None
    fragment_fn: ir.Operation | None = None  # the first one with mm.devices
    other_fn: bool = False  # untagged callees: task bodies not inlined yet
    leaf_fn: bool = False  # tagged callees: leaf task bodies or bare MPMD fragments

    def add(self, op: ir.Operation) -> None:
        if ir.StringAttr(op.attributes["sym_name"]).value == "main":
            self.main = op
        elif c.DEVICES_ATTR in op.attributes:
            self.fragment_fn = self.fragment_fn or op
        elif c.TASK_ATTR in op.attributes:  # a leaf task call's body (flat form), or a
            self.leaf_fn = True             # fragment without mm.devices (MPMD form)
        else:
            self.other_fn = True


def stage_of(module: ir.Module) -> tuple[str | None, ir.Operation | None]:
    """``(stage, op)``: the module's form and the first op that shows it (None if none).

    A module without ``@main`` has no stage (None): the passes that need ``@main``
    say so themselves. Neither has one whose ``@main`` only returns: it is in every form.
    """
    top = _TopLevel()
    for view in module.body.operations:
        op = view.operation
        if op.name == "builtin.module" and (c.DEVICES_ATTR in op.attributes
                                            or c.TASK_ATTR in op.attributes):
            return EXTRACTED, op  # a fragment module
        if op.name == "func.func":
            top.add(op)
    if top.main is None:
        return None, None
    first = _first_op(top.main)
    if first is None or first.name == "func.return":
        return None, None  # nothing but the return: every form at once (an identity program)
    if top.fragment_fn is not None:
        return MPMD, _first_call(top.main, fragment=True) or top.fragment_fn
    if top.other_fn or top.leaf_fn:  # callees remain: task bodies not inlined yet (or
        stage = _stage_by_first_call(top)  # composites' or leaf task calls' bodies)
        if stage is not None:
            return stage
    return FLAT, first


def _stage_by_first_call(top: _TopLevel) -> tuple[str, ir.Operation] | None:
    assert top.main is not None
    call = _first_call(top.main, fragment=None)
    if call is None:
        return None
    if c.FRAGMENT_ATTR in call.attributes:  # a call to a malformed fragment: MPMD
        return MPMD, call
    if top.other_fn and not _leaf_call(call):
        return FRONT_END, call
    return None


def _leaf_call(call: ir.Operation) -> bool:
    """A leaf task call of the flat form: tagged ``{name, transpose_count}`` (no mesh)."""
    if c.TASK_ATTR not in call.attributes:
        return False
    tag = call.attributes[c.TASK_ATTR]
    return isinstance(tag, ir.DictAttr) and "devices" not in tag


def _first_op(main: ir.Operation) -> ir.Operation | None:
    ops = c.entry_block(main).operations
    return ops[0].operation if len(ops) else None


def _first_call(main: ir.Operation, *, fragment: bool | None) -> ir.Operation | None:
    """The first ``func.call`` under ``main`` (marked ``mm.fragment`` or not; None: any)."""
    found: list[ir.Operation] = []

    def cb(op):
        op = op.operation
        if op.name == "func.call" and (
                fragment is None or (c.FRAGMENT_ATTR in op.attributes) == fragment):
            found.append(op)
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    main.walk(cb, ir.WalkOrder.PRE_ORDER)
    return found[0] if found else None


def check_stage(module: ir.Module, argument: str, consumes: tuple[str, ...],
                requires: tuple[str, ...] = ()) -> None:
    """:class:`DiagnosticError` if ``module`` is in none of the forms ``consumes``.

    ``requires`` are passes this one needs to have run besides those that reach its
    form (``mm-propagate-shardings`` for ``mm-insert-transfers``), named in the hint.
    """
    stage, op = stage_of(module)
    if stage is None or stage in consumes:
        return
    wanted = " or ".join(DESCRIPTION[s].split(" (")[0] for s in consumes)
    where = op.location if op is not None else module.operation.location
    have = STAGES.index(stage)
    if have < min(STAGES.index(s) for s in consumes):
        target = min(STAGES.index(s) for s in consumes)
        todo = [_ENTERED_BY[s] for s in STAGES[have + 1:target + 1]]
        todo += [r for r in requires if r not in todo]
        hint = f"run {_join(todo)} first"
    else:
        hint = (f"it has already been through {_ENTERED_BY[stage]}: give {argument} a module "
                f"from an earlier stage (the traced program, or a MULTIMESH_DUMP_IR_TO dump "
                f"from before {_ENTERED_BY[stage]})")
    raise DiagnosticError(
        f"{argument} expects a module in {wanted}, but this one is in {DESCRIPTION[stage]}; "
        f"{hint}", where)


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
