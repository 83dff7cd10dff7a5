"""``mm-resolve-logical-shardings``: every sharding annotation onto its task's mesh.

Consumes the flat form (docs/ir.md §2), produces the resolved form (§3).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from multimesh._src.errors import DiagnosticError, LogicalShardingError
from multimesh._src.ir_contract import AxisRef, DimSharding, Sharding
from multimesh._src.ir_util import custom_call_target
from multimesh._src.mlir import attr_to_py, ir, sdy

from . import _contract as c
from . import _localize
from ._patterns import Rewrite, match_ops
from .base import ModulePass
from .logical_axes import resolve_logical_spec

__all__ = ["ResolveLogicalShardingsPass", "mesh_symbol_names", "MARKER_TARGET"]

MARKER_TARGET = c.LOGICAL_TARGET

_INVALID = re.compile(r"[^A-Za-z0-9_]")


def mesh_symbol_names(task_names: Iterable[str]) -> dict[str, str]:
    """``{task: "mesh_<task>"}``, sanitised to ``[A-Za-z0-9_]`` without collisions.

    Task names that are already valid keep ``mesh_<task>`` exactly; the others have
    every invalid character replaced by ``_`` and, if that name is taken, a
    ``_1``, ``_2``, ... suffix. The result depends only on the set of names.
    """
    names = sorted(set(task_names))
    out: dict[str, str] = {}
    taken: set[str] = set()
    for t in names:
        if not _INVALID.search(t) and t:
            out[t] = f"mesh_{t}"
            taken.add(out[t])
    for t in names:
        if t in out:
            continue
        base = "mesh_" + (_INVALID.sub("_", t) or "_")
        cand, i = base, 1
        while cand in taken:
            cand = f"{base}_{i}"
            i += 1
        out[t] = cand
        taken.add(cand)
    return out


@dataclass(frozen=True)
class _Task:
    name: str
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    logical_axes: tuple[tuple[str, str], ...]


def _read_tasks(module: ir.Module) -> dict[str, _Task] | None:
    """The ``mm.tasks`` table, read (and checked) by the contract's typed reader."""
    if c.TASKS_ATTR not in module.operation.attributes:
        return None
    return {name: _Task(name, info.axis_names, info.axis_sizes, info.logical_axes)
            for name, info in c.read_tasks(module).items()}


_DIM_RE = re.compile(r"^Cannot shard dimension (\d+) ")


def _naming_task(message: str, task: _Task, axes: list[list[str]]) -> str:
    """A resolution error plus the task (and, for a non-dividing shard, the logical
    axes behind it)."""
    if message.startswith("Logical axis "):  # a pair naming a device axis the mesh lacks
        return message.replace("not an axis of the task mesh.",
                               f"not an axis of the mesh of task '{task.name}'.")
    m = _DIM_RE.match(message)
    if m is None or int(m.group(1)) >= len(axes):
        return message
    mapped = {logical for logical, _ in task.logical_axes}
    names = [n for n in axes[int(m.group(1))] if n in mapped]
    if not names:
        return message
    noun = "logical axis" if len(names) == 1 else "logical axes"
    listed = " and ".join(f"'{n}'" for n in names)
    return (f"{message} Task '{task.name}' maps the dimension's {noun} {listed} to these "
            f"device axes; change the shape or the task's logical_axes.")


def _is_marker(op: ir.Operation) -> bool:
    return custom_call_target(op) == MARKER_TARGET


def _marker_axes(op: ir.Operation) -> list[list[str]]:
    if c.AXES_ATTR not in op.attributes:
        raise DiagnosticError("logical sharding marker has no mm.axes attribute", op.location)
    axes = attr_to_py(op.attributes[c.AXES_ATTR])
    if not (isinstance(axes, list)
            and all(isinstance(a, list) and all(isinstance(n, str) for n in a) for a in axes)):
        raise DiagnosticError(
            f"{c.AXES_ATTR} must be a list with one list of logical axis names per dimension",
            op.location)
    return axes


def _ops_in_program_order(module: ir.Module) -> list[ir.Operation]:
    """Every op of the module, those of a called function at the call (depth first from
    ``@main``, so the body of a leaf task call comes where it would be inlined), then
    those of functions no call reaches and of any other top-level op."""
    order = _ProgramOrder(c.func_by_name(module))
    if "main" in order.funcs:
        order.expand("main")
    for name in order.funcs:
        order.expand(name)
    for op in module.body.operations:
        if op.operation.name != "func.func":
            order.out.extend(x for x in _scan(op.operation) if not isinstance(x, str))
    return order.out


def _scan(root: ir.Operation) -> list[ir.Operation | str]:
    """The ops under ``root`` in walk order, each call followed by its callee's name."""
    items: list[ir.Operation | str] = []

    def cb(op):
        items.append(op.operation)
        if op.name == "func.call":
            items.append(c.callee_of(op))
        return ir.WalkResult.ADVANCE

    root.walk(cb, ir.WalkOrder.PRE_ORDER)
    return items


class _ProgramOrder:
    """Ops collected depth first through calls, each function once."""

    def __init__(self, funcs: dict[str, ir.Operation]) -> None:
        self.funcs = funcs
        self.out: list[ir.Operation] = []
        self.seen: set[str] = set()

    def expand(self, name: str) -> None:
        if name in self.seen or name not in self.funcs:
            return
        self.seen.add(name)
        for item in _scan(self.funcs[name]):
            if isinstance(item, str):
                self.expand(item)
            else:
                self.out.append(item)


def _mesh_attr(task: _Task) -> ir.Attribute:
    return sdy.MeshAttr.get(
        [sdy.MeshAxisAttr.get(n, s) for n, s in zip(task.axis_names, task.axis_sizes, strict=True)])


@dataclass(frozen=True)
class ResolveLogicalShardingsPass(ModulePass):
    """Resolve every ``mm.logical_sharding`` marker against its task's logical mapping.

    A marker's task is its own ``mm.task`` tag, else that of the nearest enclosing
    tagged op (markers inside ``stablehlo.while`` bodies and other regions, or in the
    body function of a leaf task call, which carries the call's tag). If the
    task's ``logical_axes`` is empty the marker becomes a fully replicated constraint
    on the task's mesh (logical names mean nothing there). Otherwise the
    marker's ``mm.axes`` are mapped to device axes with the reference §1.14
    algorithm (priority order, each device axis once, over-sharding axes skipped,
    several axes on one dim in mesh order, shard counts must divide) and the marker
    becomes ``sdy.sharding_constraint %x <@mesh_<task>, [...]>`` with closed
    dimensions, keeping the marker's ``mm.task`` tag. One ``sdy.mesh @mesh_<task>``
    per task used is added at the start of the module (task names are sanitised to
    ``[A-Za-z0-9_]``, see :func:`mesh_symbol_names`). The rewrite is all-or-nothing:
    every marker is resolved before the IR is touched.

    Shardings written for another mesh (``jax.lax.with_sharding_constraint`` under
    ``jax.set_mesh``, flax's rules, NNX metadata, explicit-mode types, ``shard_map``: an
    ``sdy`` sharding on a mesh symbol that is no task's) are moved onto the mesh of the
    task that owns the op, by axis name (``_localize.py``): inside a task the mesh is the
    task's mesh. An axis the task's mesh has with size 1 (a ``mesh_slice``'s sliced axis)
    splits nothing there and is dropped, in a logical sharding too, leaving the dimension
    replicated over it; naming an axis the task's mesh lacks is an error at the op, and
    so is a ``shard_map`` splitting an operand over a sliced axis. Explicit mode's
    ``replicated={...}`` over an axis the task lacks asks for nothing there and is
    dropped. A ``shard_map``'s collectives
    (``replica_groups``, ``source_target_pairs``: flat positions in the mesh it was traced
    on) are renumbered onto the task's devices by axis name (``_collectives.py``), and
    axes the task lacks leave its ``manual_axes``; a collective over such an axis is an
    error at the op. A program argument placed sharded over an axis that a task using it
    slices away or lacks (``@main``'s ``mm.sharding``) warns, once per task, at the
    task's first op that uses it.

    One pass, not two: a logical marker and a sharding written for another mesh are the
    same annotation (shard this value over these names), read against the same task
    table and written onto the same ``@mesh_<task>``; the pass runs its two rewrite
    patterns (``_patterns.py``) over every op in one walk, checking all of them before
    the first edit, so the IR never holds a half-localized program and no later pass
    sees a sharding on a mesh that is no task's.

    A logical name that no task of the module maps leaves its dimension unsharded; when
    it looks like a mistake (a near miss of a mapped name, a mesh axis name, the device
    side of a swapped pair) the pass warns once per name, at the first marker using it,
    naming the fix.
    """

    argument: ClassVar[str] = "mm-resolve-logical-shardings"
    summary: ClassVar[str] = (
        "Replace logical sharding markers by sdy.sharding_constraint ops on each task's mesh, "
        "and move shardings written for the global mesh onto it.")
    consumes = ("flat",)

    def apply(self, module: ir.Module) -> None:
        with module.context, ir.Location.unknown():
            self._apply(module)

    def _apply(self, module: ir.Module) -> None:
        tasks = _read_tasks(module) or {}
        records = c.read_tasks(module)
        sym_names = mesh_symbol_names(tasks)
        own = set(sym_names.values())
        if tasks:
            _localize.warn_lost_pins(module, records)
        markers = _LogicalMarkers(tasks, sym_names)
        patterns: list = [markers]
        foreign = _localize.foreign_meshes(module, own) if tasks else {}
        if foreign:
            patterns.append(_localize.LocalizeShardings(foreign, records, sym_names))
        # Phase 1: match (resolve and check) every op; may raise, no IR is modified.
        rewrites = match_ops(_ops_in_program_order(module), patterns)
        if not rewrites:
            return
        needed = {task.name: task for _, task, _ in markers.plan}
        needed.update((name, tasks[name]) for name in _localize_tasks(patterns))
        to_create = _meshes_to_create(module, needed, sym_names)
        _warn_unmapped_names(markers.plan, tasks)
        # Phase 2: rewrite.
        _insert_meshes(module, to_create)
        for rewrite in rewrites:
            rewrite()


def _localize_tasks(patterns: list) -> set[str]:
    return {name for p in patterns if isinstance(p, _localize.LocalizeShardings)
            for name in p.used}


_Spec = tuple[tuple[str, ...], ...]


class _LogicalMarkers:
    """The pattern: an ``mm.logical_sharding`` marker, resolved through its task's
    rule table, becomes a constraint on the task's mesh."""

    def __init__(self, tasks: dict[str, _Task], sym_names: dict[str, str]) -> None:
        self.tasks = tasks
        self.sym_names = sym_names
        self.plan: list[tuple[ir.Operation, _Task, _Spec]] = []

    def match(self, op: ir.Operation) -> Rewrite | None:
        if op.name != "stablehlo.custom_call" or not _is_marker(op):
            return None
        op, task, spec = _resolve(op, self.tasks)
        self.plan.append((op, task, spec))
        return lambda: _to_constraint(op, self.sym_names[task.name], task, spec)


def _resolve(op: ir.Operation, tasks: dict[str, _Task]) -> tuple[ir.Operation, _Task, _Spec]:
    """One marker checked and resolved to its task and per-dimension device axes."""
    loc = op.location
    if len(op.operands) != 1 or len(op.results) != 1:
        raise DiagnosticError(
            f"logical sharding marker must have exactly one operand and one result, "
            f"got {len(op.operands)} and {len(op.results)}", loc)
    tag = c.owner_tag(op)
    if tag is None:
        raise DiagnosticError(
            "logical sharding marker is not assigned to a task; run mm-assign-tasks first", loc)
    name = tag[0]
    if name not in tasks:
        known = ", ".join(f"'{t}'" for t in sorted(tasks)) or "none"
        raise DiagnosticError(
            f"logical sharding marker is assigned to task '{name}', which is not in "
            f"the module's mm.tasks table (known tasks: {known})", loc)
    task = tasks[name]
    axes = _marker_axes(op)
    ty = op.operands[0].type
    if not isinstance(ty, ir.RankedTensorType):
        raise DiagnosticError(
            f"logical sharding marker operand must be a ranked tensor, got {ty}", loc)
    if op.results[0].type != ty:
        raise DiagnosticError(
            f"logical sharding marker must be an identity, but its operand type {ty} "
            f"differs from its result type {op.results[0].type}", loc)
    if not task.logical_axes:
        # No mapping: every logical name means "replicated" on this task's
        # devices (MultiMesh's rule). Writing it explicitly also keeps the
        # value on the task's submesh when the marker is the task's only op.
        return op, task, tuple(() for _ in ty.shape)
    try:
        spec = resolve_logical_spec(
            axes, ty.shape, task.axis_names, task.axis_sizes, task.logical_axes)
    except LogicalShardingError as e:
        raise DiagnosticError(_naming_task(str(e), task, axes), loc) from None
    return op, task, spec


def _warn_unmapped_names(plan: list[tuple[ir.Operation, _Task, _Spec]],
                         tasks: dict[str, _Task]) -> None:
    """Warn once per logical name that no task of the program maps and that looks like a
    mistake: a mesh axis name, the device side of a swapped pair, or a near miss of a
    name the tasks map (a typo). Each leaves its dimension unsharded everywhere.

    A name that some task maps is fine elsewhere (unmapped in one task means replicated
    there), and so is one that resembles nothing the tasks map (``"seq"`` in a model
    run without sequence sharding): MultiMesh's rule, replicated. A program in which
    no task maps any name (no tasks, or none with ``logical_axes``) is quiet too.
    """
    mapped = {logical for t in tasks.values() for logical, _ in t.logical_axes}
    if not mapped:
        return
    seen: set[str] = set()
    for op, task, _ in plan:
        for name in (n for dim in _marker_axes(op) for n in dim):
            if name in mapped or name in seen:
                continue
            seen.add(name)
            message = _unmapped_message(name, task, tasks, mapped)
            if message is not None:
                c.warn_at(op.location, message)


def _unmapped_message(name: str, task: _Task, tasks: dict[str, _Task],
                      mapped: set[str]) -> str | None:
    """Why ``name`` maps to nothing, and the fix (None: nothing suggests a mistake)."""
    head = (f"logical axis name '{name}' is mapped by no task of the program, so it leaves "
            f"its dimension unsharded in task '{task.name}'")
    for t in _this_first(task, tasks):
        for logical, device in t.logical_axes:
            if device == name and device not in t.axis_names and logical in t.axis_names:
                return (f"{head}; task '{t.name}' has the pair ('{logical}', '{name}'), which "
                        f"maps its mesh axis '{logical}' as a logical name onto '{name}', "
                        f"not an axis of its mesh: the pair looks swapped, write "
                        f"('{name}', '{logical}') in its logical_axes")
    for t in _this_first(task, tasks):
        if name in t.axis_names:
            onto = sorted({lg for lg, d in t.logical_axes if d == name})
            use = (f"use a logical name that task '{t.name}' maps onto it "
                   f"({_quoted(onto, ' or ')})" if onto else
                   f"map a logical name onto it in the logical_axes of task '{t.name}', "
                   f"e.g. ('{name}', '{name}')")
            return (f"{head}; '{name}' is a mesh axis of task '{t.name}', not a logical "
                    f"name: {use}")
    near = difflib.get_close_matches(name, sorted(mapped), n=3)
    if not near:
        return None
    return (f"{head}; did you mean {_quoted(near, ' or ')}? (the logical names the tasks "
            f"map: {_quoted(sorted(mapped))})")


def _this_first(task: _Task, tasks: dict[str, _Task]) -> list[_Task]:
    return [task] + [t for n, t in sorted(tasks.items()) if n != task.name]


def _quoted(names: Iterable[str], sep: str = ", ") -> str:
    return sep.join(f"'{n}'" for n in names)


def _meshes_to_create(module: ir.Module, needed: dict[str, _Task],
                      sym_names: dict[str, str]) -> list[tuple[str, ir.Attribute]]:
    """Mesh symbols: reuse an identical existing one, reject a conflicting one."""
    table = ir.SymbolTable(module.operation)
    to_create: list[tuple[str, ir.Attribute]] = []
    for name in sorted(needed):
        sym = sym_names[name]
        mesh = _mesh_attr(needed[name])
        if sym not in table:
            to_create.append((sym, mesh))
            continue
        existing = table[sym].operation
        if existing.name != "sdy.mesh" or existing.attributes["mesh"] != mesh:
            what = (f"mesh {existing.attributes['mesh']}" if existing.name == "sdy.mesh"
                    else f"'{existing.name}' op")
            raise DiagnosticError(
                f"symbol @{sym} for task '{name}' already exists as {what}, which "
                f"differs from the task's mesh {mesh}", existing.location)
    return to_create


def _insert_meshes(module: ir.Module, to_create: list[tuple[str, ir.Attribute]]) -> None:
    """New meshes go after the existing ``sdy.mesh`` ops at the top of the module."""
    body = module.body
    anchor = None
    for o in body.operations:
        if o.operation.name != "sdy.mesh":
            anchor = o.operation
            break
    for sym, mesh in to_create:
        ip = ir.InsertionPoint(anchor) if anchor is not None else ir.InsertionPoint(body)
        sdy.MeshOp(sym, mesh, ip=ip)


def _to_constraint(op: ir.Operation, mesh_sym: str, task: _Task, spec: _Spec) -> None:
    """Replace the marker by ``sdy.sharding_constraint``, keeping its ``mm.task`` tag.
    The sharding is built as a localized one is (:func:`_localize.on_task_mesh`): an
    axis of size 1 in the task's mesh is dropped."""
    operand = op.operands[0]
    dims = tuple(DimSharding(tuple(AxisRef(a) for a in axes), closed=True) for axes in spec)
    sizes = dict(zip(task.axis_names, task.axis_sizes, strict=True))
    sharding = _localize.on_task_mesh(Sharding(mesh_sym, dims), mesh_sym, sizes).to_attr()
    new = sdy.ShardingConstraintOp(operand, sharding, results=[operand.type],
                                   loc=op.location, ip=ir.InsertionPoint(op))
    if c.TASK_ATTR in op.attributes:
        new.operation.attributes[c.TASK_ATTR] = op.attributes[c.TASK_ATTR]
    op.results[0].replace_all_uses_with(new.result)
    op.erase()
