"""Shardings written for another mesh, moved onto the mesh of the task that owns them.

Models say how they shard in the words of ONE mesh: ``jax.lax.with_sharding_constraint``
under ``jax.set_mesh``, flax's logical rules, NNX partition metadata, explicit-mode
types, ``shard_map``. jax lowers each of them to an ``sdy`` sharding on a mesh symbol of
its own (``@mesh``: the global mesh, or the abstract mesh a task body was traced
under). Inside a task the mesh is the task's mesh: every such sharding is rewritten
onto ``@mesh_<task>`` by axis name, so a constraint over ``"data"`` on the global mesh
``("stage", "data", "model")`` shards over the task's ``"data"`` on its own devices.

**Size-one axes.** An axis that the task's mesh has with size 1 (the axis a
``mesh_slice={"stage": k}`` slices, or a size-1 axis of a ``TaskMesh``) splits nothing
there: it is dropped from the sharding, which leaves the dimension replicated over it
(as MaxText drops size-one mesh axes, ``remove_size_one_mesh_axis``). An axis the task's
mesh lacks is an error at the op, with its source line, before XLA sees the module:
it is a typo or a sharding meant for another stage. A ``shard_map`` whose operands are
split over a sliced axis is refused too: its body was traced with that split.

:class:`LocalizeShardings` is the rewrite pattern (``_patterns.py``) that
``mm-resolve-logical-shardings`` runs over every op; the attributes are read and
rebuilt through the typed view of ``multimesh._src.ir_contract`` (:class:`Sharding`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_contract import AxisRef, Sharding, map_shardings, mesh_axes, shardings_in
from multimesh._src.mlir import ir, sdy

from . import _collectives
from . import _contract as c
from ._patterns import Rewrite, ops_under

__all__ = ["LocalizeShardings", "foreign_meshes", "warn_lost_pins"]

_SHARDING_ATTRS = ("sharding", "sdy.sharding", "in_shardings", "out_shardings",
                   "out_sharding")
"""Attributes of an op that hold an sdy sharding (or a per-value list of them)."""
_FUNC_ATTRS = ("arg_attrs", "res_attrs")


def foreign_meshes(module: ir.Module, own: set[str]) -> dict[str, dict[str, int]]:
    """``{symbol: {axis: size}}`` of every ``sdy.mesh`` that is not a task's mesh."""
    out: dict[str, dict[str, int]] = {}
    for view in module.body.operations:
        op = view.operation
        if op.name != "sdy.mesh":
            continue
        sym = ir.StringAttr(op.attributes["sym_name"]).value
        if sym in own:
            continue
        axes = mesh_axes(op.attributes["mesh"])
        if axes:  # a maximal mesh (`device_ids=[0]`: a host callback's device) stays
            out[sym] = axes
    return out


@dataclass(frozen=True)
class LocalizeShardings:
    """The pattern: an op (or a task's body function) holding a sharding on a mesh
    that is no task's is checked against its task's mesh and rewritten onto it."""

    foreign: dict[str, dict[str, int]]
    tasks: dict[str, c.MeshRecord]
    sym_names: dict[str, str]
    used: set[str] = field(default_factory=set)
    """The tasks whose meshes the matched ops move onto."""

    def match(self, op: ir.Operation) -> Rewrite | None:
        found = self._foreign_attrs(op)
        if not found:
            return None
        foreign = [(s.mesh, s) for _, _, shardings in found for s in shardings
                   if isinstance(s.mesh, str) and s.mesh in self.foreign]
        tag = c.owner_tag(op)
        if tag is None and op.name == "func.func":
            return None  # @main's own arguments: the input pins (docs/ir.md §1)
        if tag is None or tag[0] not in self.tasks:
            raise DiagnosticError(
                f"a sharding on the mesh {self._mesh_text(foreign[0][0])} is not inside a "
                f"task, so multimesh cannot tell which submesh it means", op.location)
        name, task = tag[0], self.tasks[tag[0]]
        self.used.add(name)
        manual = op.name == "sdy.manual_computation"
        for mesh, s in foreign:
            _check_axes(op, s, self.foreign[mesh], name, task, manual)
        plan = None
        if manual:
            plan = _collectives.Renumbering()
            _collectives.plan_renumbering(op, self.foreign[foreign[0][0]], task, name,
                                          self.sym_names[name], plan)
        edits = [(attr_name, a) for attr_name, a, _ in found]
        return lambda: self._rewrite(op, edits, self.sym_names[name], task, plan)

    def _foreign_attrs(self, op: ir.Operation) -> list[tuple[str, ir.Attribute, list[Sharding]]]:
        """The attributes of ``op`` holding a sharding on a foreign mesh, with their
        shardings."""
        attrs = op.attributes
        if not len(attrs):
            return []
        found = []
        for n in _FUNC_ATTRS if op.name == "func.func" else _SHARDING_ATTRS:
            if n in attrs:
                a = attrs[n]
                shardings = shardings_in(a)
                if any(self._is_foreign(s) for s in shardings):
                    found.append((n, a, shardings))
        return found

    def _is_foreign(self, s: Sharding) -> bool:
        return isinstance(s.mesh, str) and s.mesh in self.foreign

    def _mesh_text(self, ref: str) -> str:
        return f"@{ref} <" + ", ".join(f"{a}={s}" for a, s in self.foreign[ref].items()) + ">"

    def _rewrite(self, op: ir.Operation, found: list[tuple[str, ir.Attribute]], target: str,
                 task: c.MeshRecord, plan: _collectives.Renumbering | None) -> None:
        sizes = dict(zip(task.axis_names, task.axis_sizes, strict=True))

        def moved(s: Sharding) -> Sharding | None:
            if not self._is_foreign(s):
                return None
            return on_task_mesh(s, target, sizes)

        for attr_name, a in found:
            new = map_shardings(a, moved)
            if new is not None:
                op.attributes[attr_name] = new
        if plan is not None:
            plan.apply()


def on_task_mesh(s: Sharding, target: str, sizes: dict[str, int]) -> Sharding:
    """``s`` on the task's mesh symbol ``target`` (the task's axis sizes ``sizes``):
    every axis the task's mesh has with size 1, or lacks, is dropped (it splits nothing
    there; one it lacks on a dimension was refused before, one in ``replicated`` asks
    for nothing)."""
    return Sharding(target, s.dims, s.replicated, s.unreduced).keep_axes(
        lambda x: sizes.get(x.name, 1) > 1)


def _axis_text(x: AxisRef) -> str:
    if x.sub is None:
        return f'"{x.name}"'
    sub = sdy.SubAxisInfoAttr(x.sub)
    return f'"{x.name}":({sub.pre_size}){sub.size}'


def _check_axes(op: ir.Operation, s: Sharding, mesh: dict[str, int], task_name: str,
                task: c.MeshRecord, manual: bool) -> None:
    """An axis on a dimension (or ``unreduced``) must be one the task's mesh has: with
    the size it had, or with size 1 (dropped). ``replicated={"stage"}`` (explicit mode
    lists the mesh's explicit axes a value is not sharded over) asks for nothing an
    axis the task lacks could not give. A ``shard_map`` (``manual``) may not split an
    operand over an axis the task keeps only one index of."""
    sizes = dict(zip(task.axis_names, task.axis_sizes, strict=True))
    for x in [*(x for d in s.dims for x in d.axes), *s.unreduced]:
        axis = x.name
        if axis not in mesh:
            continue
        if axis in sizes and (sizes[axis] > 1 or mesh[axis] == 1):
            if x.sub is not None and sizes[axis] != mesh[axis]:
                raise DiagnosticError(
                    f"a sharding in task '{task_name}' names part of the "
                    f"axis '{axis}' ({_axis_text(x)}), which has size {mesh[axis]} in the "
                    f"mesh it was written for but {sizes[axis]} in the task's mesh; shard "
                    f"over the whole axis", op.location)
            continue
        if axis in sizes and not manual:
            continue  # a size-one axis of the task's mesh: dropped, replicated over it
        kept = [n for n, size in sizes.items() if size > 1 or mesh.get(n, 1) == 1]
        why = ("is sliced away (the task is one slice of it)" if axis in sizes
               else "is not an axis of the task's mesh")
        raise DiagnosticError(
            f"a sharding in task '{task_name}' names the mesh axis "
            f"'{axis}', which {why}; inside a task the mesh is the task's mesh, with the "
            f"axes {kept} (device positions {list(task.devices)}). Shard over those axes "
            f"only, or give the task a mesh with an axis '{axis}'", op.location)


# ----------------------------------------------------------------------------- input pins

_ARG_NAME = re.compile(r'loc\("([^"]*)"')
"""The name jax gives an argument, in its location (locations have no structured
accessors in the bindings)."""


def warn_lost_pins(module: ir.Module, tasks: dict[str, c.MeshRecord]) -> None:
    """Warn, at the first op of each task that uses it, about a program argument placed
    sharded over a mesh axis that task slices away or lacks (NNX partition metadata
    ``("stage", None)``, ``device_put`` over the global mesh): inside the task the
    value moves onto the task's mesh, and that axis of its layout cannot hold there."""
    main = c.func_by_name(module).get("main")
    if main is None or "arg_attrs" not in main.attributes:
        return  # a module of tests' own functions: no program arguments
    foreign = foreign_meshes(module, set())
    block = c.entry_block(main)
    pinned: dict[int, tuple[list[str], str, str]] = {}
    for arg, attrs in zip(block.arguments, ir.ArrayAttr(main.attributes["arg_attrs"])):
        attrs = ir.DictAttr(attrs)
        if c.SHARDING_ATTR not in attrs or not sdy.TensorShardingAttr.isinstance(
                attrs[c.SHARDING_ATTR]):
            continue
        s = Sharding.from_attr(attrs[c.SHARDING_ATTR])
        mesh = foreign.get(s.mesh, {}) if isinstance(s.mesh, str) else mesh_axes(s.mesh)
        axes = [x.name for d in s.dims for x in d.axes] + [x.name for x in s.unreduced]
        axes = [a for a in axes if mesh.get(a, 1) > 1]
        if axes:
            name = _ARG_NAME.search(str(arg.location))
            what = f"argument '{name.group(1)}'" if name else f"argument {arg.arg_number}"
            pinned[arg.arg_number] = (axes, str(attrs[c.SHARDING_ATTR]), what)
    if pinned:
        _warn_uses(main, block, pinned, tasks)


def _warn_uses(main: ir.Operation, block: ir.Block, pinned: dict, tasks) -> None:
    """One warning per (argument, task), at the task's first op (program order)."""
    warned: set[tuple[int, str]] = set()
    args = [(block.arguments[n], n) for n in pinned]
    for op in ops_under(main):
        for v in op.operands:
            number = next((n for a, n in args if a == v), None)
            if number is None:
                continue
            tag = c.owner_tag(op)
            task_name = tag[0] if tag is not None else ""
            task = tasks.get(task_name)
            if task is None or (number, task_name) in warned:
                continue
            axes, text, what = pinned[number]
            sizes = dict(zip(task.axis_names, task.axis_sizes, strict=True))
            lost = [a for a in axes if sizes.get(a, 1) == 1]
            if lost:
                warned.add((number, task_name))
                _warn_lost(op, what, lost[0], text, task_name, task, sizes)


def _warn_lost(op, what: str, axis: str, text: str, task_name: str, task, sizes) -> None:
    kept = [n for n, s in sizes.items() if s > 1]
    why = "slices away" if axis in sizes else "does not have"
    c.warn_at(op.location,
              f"{what} is placed sharded over the mesh axis '{axis}' ({text}), which task "
              f"'{task_name}' that uses it {why}: inside a task the mesh is the task's mesh, "
              f"with the axes {kept} (device positions {list(task.devices)}), so the value "
              f"moves onto it with '{axis}' dropped from its layout. Partition it over the "
              f"task's axes only (for NNX metadata or flax rules: leave '{axis}' out)")
