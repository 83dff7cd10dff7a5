"""Shardings written for another mesh, moved onto the mesh of the task that owns them.

Models say how they shard in the words of ONE mesh: ``jax.lax.with_sharding_constraint``
under ``jax.set_mesh``, flax's logical rules, NNX partition metadata, explicit-mode
types, ``shard_map``. jax lowers each of them to an ``sdy`` sharding on a mesh symbol of
its own (``@mesh``: the global mesh, or the abstract mesh a task body was traced
under). Inside a task the mesh is the task's mesh: every such sharding is rewritten
onto ``@mesh_<task>`` by axis name, so a constraint over ``"data"`` on the global mesh
``("stage", "data", "model")`` shards over the task's ``"data"`` on its own devices.

A sliced axis (``mesh_slice={"stage": k}`` leaves it with size 1) and any axis the
task's mesh lacks cannot carry a sharding inside the task: naming one is an error at
the op, with its source line, before XLA sees the module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import ir, sdy

from . import _collectives
from . import _contract as c

__all__ = ["ForeignSharding", "collect_foreign", "plan_collectives", "rewrite_foreign",
           "warn_lost_pins"]

# Attributes that hold an sdy sharding (a TensorSharding or a per-value list of them).
_SHARDING_ATTRS = ("sharding", "sdy.sharding", "in_shardings", "out_shardings",
                   "out_sharding", "manual_axes")
_REF = re.compile(r"@([A-Za-z_][A-Za-z0-9_$.]*)")
_AXIS = re.compile(r'"([^"]+)"(:\((\d+)\)(\d+))?')
_REPLICATED = re.compile(r',\s*replicated=\{([^}]*)\}')


@dataclass(frozen=True)
class ForeignSharding:
    """One attribute (of an op, or of a function's arguments/results) to rewrite."""

    op: ir.Operation
    attr: str          # attribute name on ``op``
    task: str          # the task whose mesh it moves to
    text: str          # the attribute's text


def _foreign_meshes(module: ir.Module, own: set[str]) -> dict[str, dict[str, int]]:
    """``{symbol: {axis: size}}`` of every ``sdy.mesh`` that is not a task's mesh."""
    out: dict[str, dict[str, int]] = {}
    for view in module.body.operations:
        op = view.operation
        if op.name != "sdy.mesh":
            continue
        sym = ir.StringAttr(op.attributes["sym_name"]).value
        if sym in own:
            continue
        mesh = sdy.MeshAttr(op.attributes["mesh"])
        if not len(mesh.axes):
            continue  # a maximal mesh (`device_ids=[0]`: a host callback's device) stays
        out[sym] = {sdy.MeshAxisAttr(a).name: sdy.MeshAxisAttr(a).size for a in mesh.axes}
    return out


def _task_of(op: ir.Operation) -> str | None:
    """The ``mm.task`` name of ``op`` or of the nearest enclosing op (a leaf task call's
    body function carries its call's tag)."""
    cur: ir.Operation | None = op
    while cur is not None and cur.name != "builtin.module":
        if c.TASK_ATTR in cur.attributes:
            tag = c.attr_to_py(cur.attributes[c.TASK_ATTR])
            if isinstance(tag, dict) and isinstance(tag.get("name"), str):
                return tag["name"]
            return None
        parent = cur.parent
        cur = parent.operation if parent is not None else None
    return None


def collect_foreign(module: ir.Module, own_meshes: set[str]) -> list[ForeignSharding]:
    """Every sharding attribute that names a mesh other than a task's (no IR change)."""
    foreign = _foreign_meshes(module, own_meshes)
    if not foreign:
        return []
    found: list[ForeignSharding] = []

    def visit(op):
        op = op.operation
        names = (("arg_attrs", "res_attrs") if op.name == "func.func" else _SHARDING_ATTRS)
        for name in names:
            if name not in op.attributes:
                continue
            text = str(op.attributes[name])
            if any(ref in foreign for ref in _REF.findall(text)):
                found.append(ForeignSharding(op, name, _task_of(op) or "", text))
        return ir.WalkResult.ADVANCE

    for view in module.body.operations:
        if view.operation.name == "func.func":
            view.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def check_foreign(items: Iterable[ForeignSharding], module: ir.Module, own_meshes: set[str],
                  tasks: dict[str, c.MeshRecord]) -> None:
    """Raise at the op for a sharding outside a task, or naming an axis its task lacks."""
    foreign = _foreign_meshes(module, own_meshes)
    for item in items:
        if item.op.name == "func.func" and not item.task:
            continue  # @main's own arguments: the input pins (docs/ir.md §1)
        if item.task not in tasks:
            raise DiagnosticError(
                f"a sharding on the mesh {_mesh_text(foreign, item.text)} is not inside a "
                f"task, so multimesh cannot tell which submesh it means", item.op.location)
        task = tasks[item.task]
        sizes = dict(zip(task.axis_names, task.axis_sizes, strict=True))
        for ref in set(_REF.findall(item.text)) & set(foreign):
            _check_axes(item, foreign[ref], sizes, task.devices)


def plan_collectives(items: Iterable[ForeignSharding], module: ir.Module, own_meshes: set[str],
                     tasks: dict[str, c.MeshRecord],
                     sym_names: dict[str, str]) -> _collectives.Renumbering:
    """Check the collectives of each ``shard_map`` written for another mesh against its
    task's mesh, and plan their renumbering onto the task's devices (``_collectives``)."""
    foreign = _foreign_meshes(module, own_meshes)
    plan = _collectives.Renumbering()
    seen: set[ir.Operation] = set()
    for item in items:
        if item.op.name != "sdy.manual_computation" or item.op in seen or not item.task:
            continue
        seen.add(item.op)
        refs = [r for r in _REF.findall(item.text) if r in foreign]
        _collectives.plan_renumbering(item.op, foreign[refs[0]], tasks[item.task],
                                      item.task, sym_names[item.task], plan)
    return plan


def _check_axes(item: ForeignSharding, mesh: dict[str, int], sizes: dict[str, int],
                devices: tuple[int, ...]) -> None:
    kept = [n for n, s in sizes.items() if s > 1 or mesh.get(n, 1) == 1]
    # ``replicated={"stage"}`` (explicit mode lists the mesh's explicit axes a value is
    # not sharded over) asks for nothing an axis the task lacks could not give.
    for m in _AXIS.finditer(_REPLICATED.sub("", item.text)):
        axis, sub = m.group(1), m.group(2)
        if axis not in mesh:
            continue
        if axis in sizes and (sizes[axis] > 1 or mesh[axis] == 1):
            if sub and sizes[axis] != mesh[axis]:
                raise DiagnosticError(
                    f"a sharding in task '{item.task}' names part of the "
                    f"axis '{axis}' ({m.group(0)}), which has size {mesh[axis]} in the mesh "
                    f"it was written for but {sizes[axis]} in the task's mesh; shard over "
                    f"the whole axis", item.op.location)
            continue
        why = ("is sliced away (the task is one slice of it)" if axis in sizes
               else "is not an axis of the task's mesh")
        raise DiagnosticError(
            f"a sharding in task '{item.task}' names the mesh axis "
            f"'{axis}', which {why}; inside a task the mesh is the task's mesh, with the "
            f"axes {kept} (device positions {list(devices)}). Shard over those axes "
            f"only, or give the task a mesh with an axis '{axis}'", item.op.location)


def _mesh_text(foreign: dict[str, dict[str, int]], text: str) -> str:
    for ref in _REF.findall(text):
        if ref in foreign:
            return "@" + ref + " <" + ", ".join(f"{a}={s}" for a, s in foreign[ref].items()) + ">"
    return "?"


def rewrite_foreign(items: Iterable[ForeignSharding], foreign: set[str],
                    sym_names: dict[str, str], tasks: dict[str, c.MeshRecord]) -> None:
    """Point every checked sharding at its task's mesh symbol; a ``replicated`` axis
    the task's mesh lacks (or has one device of) is dropped: nothing to replicate over."""
    for item in items:
        if not item.task:
            continue
        target = sym_names[item.task]
        task = tasks[item.task]
        real = {n for n, s in zip(task.axis_names, task.axis_sizes, strict=True) if s > 1}

        def swap(m: re.Match, target=target) -> str:
            return "@" + target if m.group(1) in foreign else m.group(0)

        def keep(m: re.Match, real=real) -> str:
            names = [a for a in re.findall(r'"[^"]+"', m.group(1)) if a.strip('"') in real]
            return f", replicated={{{', '.join(names)}}}" if names else ""

        text = _REPLICATED.sub(keep, _REF.sub(swap, item.text))
        item.op.attributes[item.attr] = ir.Attribute.parse(text)


def foreign_symbols(module: ir.Module, own: set[str]) -> set[str]:
    return set(_foreign_meshes(module, own))


_INLINE_MESH = re.compile(r'mesh<\[([^\]]*)\]')


def warn_lost_pins(module: ir.Module, tasks: dict[str, c.MeshRecord]) -> None:
    """Warn, at the first op of each task that uses it, about a program argument placed
    sharded over a mesh axis that task slices away or lacks (NNX partition metadata
    ``("stage", None)``, ``device_put`` over the global mesh): inside the task the
    value moves onto the task's mesh, and that axis of its layout cannot hold there."""
    main = c.func_by_name(module).get("main")
    if main is None or "arg_attrs" not in main.attributes:
        return  # a module of tests' own functions: no program arguments
    foreign = _foreign_meshes(module, set())
    block = c.entry_block(main)
    pinned: dict[int, tuple[list[str], str, str]] = {}
    for arg, attrs in zip(block.arguments, ir.ArrayAttr(main.attributes["arg_attrs"])):
        attrs = ir.DictAttr(attrs)
        if c.SHARDING_ATTR not in attrs:
            continue
        text = str(attrs[c.SHARDING_ATTR])
        mesh = _pin_mesh(text, foreign)
        axes = [m.group(1) for m in _AXIS.finditer(_INLINE_MESH.sub("", _REPLICATED.sub("", text)))
                if mesh.get(m.group(1), 1) > 1]
        if axes:
            name = re.search(r'loc\("([^"]*)"', str(arg.location))
            what = f"argument '{name.group(1)}'" if name else f"argument {arg.arg_number}"
            pinned[arg.arg_number] = (axes, text, what)
    if pinned:
        _warn_uses(main, block, pinned, tasks)


def _pin_mesh(text: str, foreign: dict[str, dict[str, int]]) -> dict[str, int]:
    inline = _INLINE_MESH.search(text)
    if inline is not None:
        return {a: int(n) for a, n in re.findall(r'"([^"]+)"=(\d+)', inline.group(1))}
    for ref in _REF.findall(text):
        if ref in foreign:
            return foreign[ref]
    return {}


def _warn_uses(main: ir.Operation, block: ir.Block, pinned: dict, tasks) -> None:
    """One warning per (argument, task), at the task's first op (program order)."""
    warned: set[tuple[int, str]] = set()
    args = [(block.arguments[n], n) for n in pinned]

    def visit(op):
        op = op.operation
        for v in op.operands:
            number = next((n for a, n in args if a == v), None)
            if number is None:
                continue
            task_name = _task_of(op) or ""
            task = tasks.get(task_name)
            if task is None or (number, task_name) in warned:
                continue
            axes, text, what = pinned[number]
            sizes = dict(zip(task.axis_names, task.axis_sizes, strict=True))
            lost = [a for a in axes if sizes.get(a, 1) == 1]
            if lost:
                warned.add((number, task_name))
                found.append((op, what, lost[0], text, task_name, task, sizes))
        return ir.WalkResult.ADVANCE

    found: list[tuple] = []
    main.walk(visit, ir.WalkOrder.PRE_ORDER)
    for item in found:  # after the walk: a warning turned error must not cross its callback
        _warn_lost(*item)


def _warn_lost(op, what: str, axis: str, text: str, task_name: str, task, sizes) -> None:
    kept = [n for n, s in sizes.items() if s > 1]
    why = "slices away" if axis in sizes else "does not have"
    c.warn_at(op.location,
              f"{what} is placed sharded over the mesh axis '{axis}' ({text}), which task "
              f"'{task_name}' that uses it {why}: inside a task the mesh is the task's mesh, "
              f"with the axes {kept} (device positions {list(task.devices)}), so the value "
              f"moves onto it with '{axis}' dropped from its layout. Partition it over the "
              f"task's axes only (for NNX metadata or flax rules: leave '{axis}' out)")
