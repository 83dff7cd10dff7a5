"""Registered tasks trace under their own mesh: ``registered_task_meshes``.

Inside a task the mesh is the task's mesh, however the task was made. An explicit
task traces its body under its mesh (``_task.py``); a registered task
(``register_task``) is found by the name stack of each op, and ``mm-match-tasks``
claims the ops after the program is traced. Without more, the body of a registered
task on a :class:`TaskMesh` is traced under no mesh at all (or the program's), where
flax's ``nn.with_logical_constraint`` is a no-op and NNX partition metadata and
``jax.lax.with_sharding_constraint`` with a ``PartitionSpec`` have no mesh to name:
each stage's devices would repeat the same work.

While ``mjit`` traces, every ``jax.named_scope`` entered (a linen module's call, an NNX
module's under multimesh's naming, a user's block) is checked against the registered
matchers, with the pass's rule (the first matcher found in the name stack wins, its
first capture group is the matched name). A scope whose name stack a registered task
claims, where the enclosing one was not claimed by the same task, traces under that
task's mesh (:func:`multimesh.jax._task.task_abstract_mesh`, as an explicit task's
body is): the task's own axes, a ``mesh_slice``'s sliced axes dropped. The task is the
registration's (its callback called for the forward, ``backprop=False``, and the
answer kept for ``mm-match-tasks``, so a callback runs once per matched name and
direction). The constraints jax records there name the task's mesh;
``mm-resolve-logical-shardings`` moves them onto it by axis name (and refuses an axis
the task lacks, at the op). The backward, traced later by transposition, carries the
forward's constraints.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import jax

from multimesh._src import jax_compat
from multimesh._src.errors import MeshError
from multimesh.jax import _contexts
from multimesh.jax._primitives import task_mesh_scope
from multimesh.jax._registrations import Registration, active_registrations
from multimesh.jax._task import (
    jax_constraint_hint,
    resolve_task_info,
    task_abstract_mesh,
    task_body_mesh,
)

__all__ = ["registered_task_meshes", "registered_task"]


def registered_task(reg: Registration, name: str, backprop: bool):
    """``reg``'s task for a match, asked of its callback once per program: kept in the
    trace notes of the program being traced or lowered."""
    notes = _contexts.state.trace_notes
    if notes is None:
        return reg.task_for(name, backprop)
    key = (id(reg), name, backprop)
    found = notes.registered_tasks.get(key)
    if found is None:
        found = notes.registered_tasks[key] = (reg, reg.task_for(name, backprop))
    return found[1]


def _owner(regs: list[Registration], stack: str) -> tuple[int, str] | None:
    """``(matcher index, matched name)`` of the registration that claims ``stack``."""
    for i, reg in enumerate(regs):
        m = reg.regex.search(stack)
        if m is not None and m.group(1):
            return i, m.group(1)
    return None


class _Scopes:
    """One program's trace: the owners of the named scopes under way."""

    def __init__(self, regs: list[Registration]):
        self.regs = regs
        self.owners: list[tuple[int, str] | None] = [None]
        self.meshes: list[bool] = []  # whether each scope under way entered a task's mesh
        self.depth = jax_compat.mesh_scope_depth()  # the mesh scopes of the program's own

    def enter(self, stack: str) -> contextlib.AbstractContextManager:
        owner = _owner(self.regs, stack)
        body = None
        # inside an explicit task's body (a mesh scope not entered here) no rule claims
        # an op: the task owns them all (mm-match-tasks)
        explicit = jax_compat.mesh_scope_depth() > self.depth + self._entered()
        if owner is not None and owner != self.owners[-1] and not explicit:
            body = self._body_of(*owner)
        return self._held(owner, body)

    def _entered(self) -> int:
        return sum(1 for held in self.meshes if held)

    @contextlib.contextmanager
    def _held(self, owner, body) -> Iterator[None]:
        self.owners.append(owner)
        self.meshes.append(body is not None)
        try:
            if body is None:
                yield
            else:
                mesh, where, mapping, task = body
                if _contexts.state.trace_notes is not None:
                    _contexts.state.trace_notes.stage_meshes = True
                with _at_user_line(), jax_constraint_hint(where, mapping, mesh.abstract_mesh), \
                        task_mesh_scope(task[0], task[1], mesh):
                    yield
        finally:
            self.owners.pop()
            self.meshes.pop()

    def _body_of(self, index: int, name: str):
        """``(mesh, where, logical mapping, (task name, placement axes))`` of the task's
        body: the concrete mesh it sees (None: the program's, and nothing is entered)."""
        reg = self.regs[index]
        spec = registered_task(reg, name, False)
        if spec.loop_dependent_mesh_slice is not None:
            return None  # a slice per microbatch: placed by the passes alone
        task_name = spec.name or name
        info = resolve_task_info(spec, task_name)
        mesh = task_body_mesh(task_abstract_mesh(spec, info), info)
        if mesh is None:
            return None
        where = f"inside task {task_name!r} (matched by {_matcher(reg)})"
        return mesh, where, info.logical_axes, (task_name, info.axis_names)


def _matcher(reg: Registration) -> str:
    return f"register_task({reg.matcher!r})"


@contextlib.contextmanager
def _at_user_line() -> Iterator[None]:
    """A :class:`MeshError` raised in the block names the user's line it came from."""
    try:
        yield
    except MeshError as e:
        line = _user_line((e.__cause__ or e).__traceback__)  # jax's error, where it was raised
        if line is None or "(at " in str(e):
            raise
        raise MeshError(f"{e} (at {line})").with_traceback(e.__traceback__) from e.__cause__


def _user_line(tb) -> str | None:
    """``file:line`` of the innermost frame of ``tb`` outside multimesh, jax and flax."""
    library = tuple(os.path.dirname(m.__file__) + os.sep
                    for m in (jax, sys.modules.get("flax")) if m is not None and m.__file__)
    library += (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
    found = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(library) and "contextlib" not in code.co_filename:
            found = f"{code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return found


def registered_task_meshes() -> contextlib.AbstractContextManager:
    """While ``mjit`` traces: each named scope a registered task claims traces under the
    task's mesh (see the module's docstring)."""
    regs = active_registrations()
    if not regs or _contexts.state.ignore_transforms:
        return contextlib.nullcontext()
    return jax_compat.name_scope_hook(_Scopes(regs).enter)
