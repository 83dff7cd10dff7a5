"""``mm-verify``: check the ``mm.*`` IR contract of docs/ir.md, plus MLIR's verifier.

Every later pass assumes these invariants, so checking them once, with a
location, turns a confusing failure deep in a pipeline into a one-line error.
The checks are the contract's own readers (:mod:`multimesh.passes._contract`) in their
strict mode: mm-verify reads everything the way the passes do and reports the first
thing that fails.
"""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import ir

from . import _contract as c
from ._patterns import ops_under
from .base import ModulePass

__all__ = ["VerifyPass"]


@dataclass(frozen=True)
class VerifyPass(ModulePass):
    """Checks that the module follows the multimesh IR contract (docs/ir.md).

    Runs the MLIR verifier, then checks every ``mm.task`` on a ``func.call``
    (name, transpose count, devices, task mesh axes and logical axes), every
    ``mm.logical_sharding`` custom call (one operand, same result type, one
    ``mm.axes`` entry per dimension), the module's ``mm.tasks`` table, and that
    ``mm.task`` on any other op is ``{name, transpose_count}`` naming a table
    entry. Task calls that share a name must agree on the mesh. Shardy's internal
    ``sdy.data_flow_edge`` (which jax never emits) is rejected. The IR is not
    changed; the first violation is reported at the offending op.
    """

    argument = "mm-verify"
    summary = "Check the `mm.*` attributes and markers against the IR contract."
    mutates = False

    def apply(self, module: ir.Module) -> None:
        _run_mlir_verifier(module)
        mod_op = module.operation
        c.reject_internal_sdy_ops(mod_op)
        table = (c.read_tasks(module, strict=True) if c.TASKS_ATTR in mod_op.attributes
                 else None)
        calls: dict[str, tuple[c.MeshRecord, ir.Location]] = {}
        for op in ops_under(mod_op):
            if c.is_custom_call(op, c.LOGICAL_TARGET):
                c.logical_marker_axes(op)
            if c.TASK_ATTR not in op.attributes or op == mod_op:
                continue
            if op.name == "func.call" and not (table is not None and c.is_task_reference(op)):
                (name, _, _), mesh = c.task_call(op, strict=True)
                assert mesh is not None  # strict: the mesh is required
                _check_consistent(name, mesh, op.location, calls, table)
            else:
                c.task_reference(op, table)


def _run_mlir_verifier(module: ir.Module) -> None:
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        d = e.error_diagnostics[0] if e.error_diagnostics else None
        if d is None:
            raise DiagnosticError(str(e)) from None
        notes = [n.message for n in d.notes if not n.message.startswith("see current operation")]
        raise DiagnosticError(d.message, d.location, notes) from None


def _mesh(info: c.MeshRecord) -> tuple:
    return (info.devices, info.axis_names, info.axis_sizes, info.logical_axes)


def _check_consistent(name: str, mesh: c.MeshRecord, loc, calls: dict,
                      table: dict[str, c.MeshRecord] | None) -> None:
    """Calls of one task must agree on the mesh, and with ``mm.tasks`` when present."""
    if table is not None and name in table and _mesh(table[name]) != _mesh(mesh):
        raise DiagnosticError(
            f"'{c.TASK_ATTR}' \"{name}\" has mesh {mesh.mesh_text()} but '{c.TASKS_ATTR}' "
            f"says {table[name].mesh_text()}", loc)
    if name not in calls:
        calls[name] = (mesh, loc)
        return
    first, first_loc = calls[name]
    if _mesh(first) != _mesh(mesh):
        raise DiagnosticError(
            f"'{c.TASK_ATTR}' \"{name}\" has mesh {mesh.mesh_text()} but an earlier call of "
            f"the same task has {first.mesh_text()}", loc,
            [("earlier call of the task is here", first_loc)])
