"""The collectives of a ``shard_map`` traced on another mesh, renumbered onto its task.

A stage traced under its own mesh (an explicit task, or a ``register_task`` stage
under ``Auto`` axes: ``multimesh/jax/_registered_meshes.py``) traces its ``shard_map``
on the stage's mesh, and jax lowers it there; its groups are the task's already (one
copy is kept where jax repeats them over a larger program), and a collective over an axis the
stage lacks is refused while tracing (``multimesh/jax/_primitives.py``). What reaches
this module is a ``shard_map`` traced on another mesh: a registered stage under
``Explicit`` axes (its body keeps the program's mesh, ``("stage", "data", "model")``).
``jax.shard_map`` lowers to
``sdy.manual_computation`` whose collectives (``psum``, ``all_gather``, ``ppermute``,
...) carry device numbers: ``replica_groups`` and ``source_target_pairs`` are flat
positions in the mesh the ``shard_map`` was traced on. The task's fragment is its own
SPMD module over the task's devices, numbered ``0..n-1`` in the task mesh's order, so
each number is translated by axis name: a position becomes its coordinates on the
traced mesh, and those on the axes the task keeps become its position on the task's
mesh. ``partition_id`` (which jax's ``axis_index`` divides by the traced mesh's axis
sizes) goes the other way: it is read through a table of each task device's position
in the traced mesh. jax >= 0.12 names its groups by mesh axes
(``#stablehlo.replica_group_mesh_axes``) rather than numbers: those only move onto the
task's mesh symbol. An axis the task's mesh lacks leaves ``manual_axes`` (a
``mesh_slice``'s sliced axis stays, with size 1); a collective running over an axis the
task does not keep (sliced away, or absent), or a traced axis size the task's mesh does
not give, would need devices outside the task or other local shapes: an error at the
op, naming the axis, the task and why, before XLA sees the module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_contract import MeshAxesGroups, MeshRecord, manual_axes
from multimesh._src.mlir import ir, sdy, stablehlo

__all__ = ["Renumbering", "plan_renumbering"]

_GROUP_ATTRS = ("replica_groups", "source_target_pairs")
_JAX_NAMES = {"stablehlo.all_reduce": "psum", "stablehlo.all_gather": "all_gather",
              "stablehlo.reduce_scatter": "psum_scatter", "stablehlo.all_to_all": "all_to_all",
              "stablehlo.collective_permute": "ppermute",
              "stablehlo.collective_broadcast": "collective_broadcast",
              "stablehlo.partition_id": "axis_index"}


@dataclass
class Renumbering:
    """What to write, once every manual computation of the module is checked."""

    edits: list[tuple[ir.Operation, str, Callable[[], ir.Attribute]]] = field(
        default_factory=list)
    """(op, attribute, its new value): built when applied, all checks done."""

    rewrites: list[Callable[[], None]] = field(default_factory=list)
    """Op rewrites (a ``partition_id`` read through a table), run after the edits."""

    def apply(self) -> None:
        for op, name, value in self.edits:
            op.attributes[name] = value()
        for rewrite in self.rewrites:
            rewrite()


@dataclass(frozen=True)
class _MeshPair:
    """The traced mesh and the task's, by axis name, and the task's name."""

    traced: dict[str, int]
    task: MeshRecord
    task_name: str

    @property
    def kept(self) -> dict[str, int]:
        sizes = dict(zip(self.task.axis_names, self.task.axis_sizes, strict=True))
        return {a: s for a, s in sizes.items() if s > 1}

    def dropped(self) -> list[str]:
        """Axes of the traced mesh the task does not keep (sliced away, or absent)."""
        sizes = dict(zip(self.task.axis_names, self.task.axis_sizes, strict=True))
        return [a for a, s in self.traced.items()
                if s > 1 and sizes.get(a, 1) == 1]

    def why(self, axis: str) -> str:
        if axis in self.task.axis_names:
            return "is sliced away (the task is one slice of it)"
        return "is not an axis of the task's mesh"


def plan_renumbering(op: ir.Operation, traced: dict[str, int], task: MeshRecord,
                     task_name: str, target: str, plan: Renumbering) -> None:
    """Check the collectives of manual computation ``op`` (traced on a mesh with the
    axes ``traced``) against ``task``'s mesh (symbol ``target``); add the rewrites to
    ``plan``."""
    meshes = _MeshPair(traced, task, task_name)
    _check_sizes(op, meshes)
    dropped = set(meshes.dropped())
    _plan_manual_axes(op, task, plan)
    numbered = []
    for coll in _collectives(op):
        if not _by_mesh_axes(coll, meshes, dropped, target, plan):
            numbered.append(coll)
    if not traced or not numbered:
        return
    identity = _identity(meshes)
    if identity and not any(_tiled(c, traced) for c in numbered):
        return
    _check_task_axes_traced(numbered[0], meshes)
    for coll in numbered:
        if coll.name == "stablehlo.partition_id":
            if identity:
                continue
            plan.rewrites.append(functools.partial(_lookup_partition, coll, _positions(meshes)))
            continue
        for name in _GROUP_ATTRS:
            if name in coll.attributes:
                new = _renumber(coll, name, meshes, dropped)
                plan.edits.append((coll, name,
                                   functools.partial(ir.DenseIntElementsAttr.get, new)))


def _by_mesh_axes(coll: ir.Operation, meshes: _MeshPair, dropped: set[str], target: str,
                  plan: Renumbering) -> bool:
    """Groups named by mesh axes (jax >= 0.12: ``#stablehlo.replica_group_mesh_axes<mesh
    = @m, axes = [...]>``) need no numbers, only the task's mesh: retarget them, after
    checking they name no axis the task drops. False for numbered groups."""
    found = False
    for name in _GROUP_ATTRS:
        if name not in coll.attributes:
            continue
        groups = MeshAxesGroups.read(coll.attributes[name])
        if groups is None:
            continue
        found = True
        for axis in groups.axes:
            if axis in dropped:
                raise _spans(coll, axis, meshes)
        plan.edits.append((coll, name, functools.partial(groups.on_mesh, target)))
    return found


def _plan_manual_axes(op: ir.Operation, task: MeshRecord, plan: Renumbering) -> None:
    """Axes the task's mesh lacks leave ``manual_axes`` (a sliced axis, of size 1 there,
    stays)."""
    if "manual_axes" not in op.attributes:
        return
    axes = _manual_axes(op)
    keep = [a for a in axes if a in task.axis_names]
    if keep != axes:
        plan.edits.append((op, "manual_axes", functools.partial(_manual_axes_attr, keep)))


def _manual_axes_attr(axes: list[str]) -> ir.Attribute:
    return sdy.ManualAxesAttr.get([ir.StringAttr.get(a) for a in axes])


def _manual_axes(op: ir.Operation) -> list[str]:
    return manual_axes(op.attributes["manual_axes"])


def _check_sizes(op: ir.Operation, meshes: _MeshPair) -> None:
    sizes = dict(zip(meshes.task.axis_names, meshes.task.axis_sizes, strict=True))
    for axis, size in meshes.traced.items():
        if sizes.get(axis, 1) not in (1, size):
            raise DiagnosticError(
                f"a `shard_map` in task '{meshes.task_name}' was traced on a mesh where the "
                f"axis '{axis}' has size {size}, but the task's mesh gives it size "
                f"{sizes[axis]}; a `shard_map` inside a task runs on the task's mesh, with "
                f"the axes {list(meshes.kept)} (sizes {list(meshes.kept.values())})",
                op.location)


def _identity(meshes: _MeshPair) -> bool:
    """Positions already mean the task's: the same axes, sizes and order."""
    task = tuple((a, s) for a, s in zip(meshes.task.axis_names, meshes.task.axis_sizes,
                                        strict=True) if s > 1)
    return tuple((a, s) for a, s in meshes.traced.items() if s > 1) == task


def _check_task_axes_traced(coll: ir.Operation, meshes: _MeshPair) -> None:
    """Every axis the task keeps is an axis of the mesh the ``shard_map`` was traced on
    (else its numbers cannot be placed on the task's devices)."""
    task, traced = meshes.task, meshes.traced
    extra = [a for a, s in zip(task.axis_names, task.axis_sizes, strict=True)
             if s > 1 and a not in traced]
    if extra:
        raise DiagnosticError(
            f"a `{_jax_name(coll)}` in a `shard_map` of task '{meshes.task_name}' was traced "
            f"on a mesh with the axes {list(traced)}, which lacks the task's mesh axis "
            f"'{extra[0]}'; its device numbers cannot be placed on the task's devices. "
            f"Trace the `shard_map` on the task's mesh (`mm.task(..., mesh=...)`) or give "
            f"`shard_map` a mesh with that axis", coll.location)


def _tiled(coll: ir.Operation, traced: dict[str, int]) -> bool:
    """Whether ``coll``'s groups name positions past the traced mesh's devices (jax
    repeats a smaller mesh's groups over a program of more devices)."""
    size = int(np.prod(list(traced.values())))
    for name in _GROUP_ATTRS:
        if name in coll.attributes:
            groups = np.asarray(ir.DenseIntElementsAttr(coll.attributes[name]))
            if groups.size and int(groups.max()) >= size:
                return True
    return False


def _collectives(op: ir.Operation) -> list[ir.Operation]:
    found: list[ir.Operation] = []

    def visit(o):
        o = o.operation
        if o.name == "stablehlo.partition_id" or any(n in o.attributes for n in _GROUP_ATTRS):
            found.append(o)
        return ir.WalkResult.ADVANCE

    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                inner.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _positions(meshes: _MeshPair) -> np.ndarray:
    """Per device of the task, its flat position in the traced mesh (coordinate 0 on the
    axes the task does not keep)."""
    names, shape = meshes.task.axis_names, tuple(meshes.task.axis_sizes)
    coords = np.unravel_index(np.arange(int(np.prod(shape))), shape)
    by_name = dict(zip(names, coords, strict=True))
    traced = [by_name[a] if a in by_name and a in meshes.kept else np.zeros_like(coords[0])
              for a in meshes.traced]
    return np.ravel_multi_index(tuple(traced), tuple(meshes.traced.values())).astype(np.uint32)


def _lookup_partition(pid: ir.Operation, table: np.ndarray) -> None:
    """``partition_id`` (the task's device number) -> its position in the traced mesh,
    which jax's ``axis_index`` arithmetic (divide, remainder by the traced mesh's axis
    sizes) was written for."""
    u32 = ir.IntegerType.get_unsigned(32)
    with ir.InsertionPoint.after(pid), pid.location:
        # the stubs do not take an ndarray as the Buffer it is (form_microbatch_loop too)
        tbl = stablehlo.ConstantOp(ir.DenseElementsAttr.get(  # type: ignore[call-overload]
            table, type=u32))
        part = stablehlo.DynamicSliceOp(tbl.result, [pid.result], ir.DenseI64ArrayAttr.get([1]))
        scalar = stablehlo.ReshapeOp(ir.RankedTensorType.get([], u32), part.result)
    pid.result.replace_all_uses_except(scalar.result, part.operation)


def _jax_name(op: ir.Operation) -> str:
    return _JAX_NAMES.get(op.name, op.name)


def _renumber(coll: ir.Operation, name: str, meshes: _MeshPair, dropped: set[str]) -> np.ndarray:
    """The groups (or pairs) of ``coll`` as positions on the task's mesh."""
    groups = np.asarray(ir.DenseIntElementsAttr(coll.attributes[name]), dtype=np.int64)
    if groups.size == 0:
        return groups
    axes = list(meshes.traced)
    shape = tuple(meshes.traced.values())
    size = int(np.prod(shape))
    tiles = groups // size
    if (tiles != tiles[..., :1]).any():
        raise DiagnosticError(
            f"a `{_jax_name(coll)}` in a `shard_map` of task '{meshes.task_name}' names "
            f"device {int(groups.max())}, outside the {size} devices of the mesh it was "
            f"traced on", coll.location)
    # A shard_map traced on the task's own mesh inside a program over more devices
    # (a registered stage, traced under its mesh): jax repeats its groups once per
    # copy of that mesh in the program's device count; the fragment runs one copy.
    groups = groups[tiles[..., 0] == 0]
    coords = np.stack(np.unravel_index(groups, shape), axis=-1)  # (..., members, axes)
    for d in sorted(dropped, key=axes.index):
        col = coords[..., axes.index(d)]
        if (col != col[..., :1]).any():
            raise _spans(coll, d, meshes)
    keep = np.all(coords[..., [axes.index(d) for d in dropped]] == 0, axis=(-2, -1)) \
        if dropped else np.ones(groups.shape[0], dtype=bool)
    task_shape = tuple(meshes.task.axis_sizes)
    task_coords = [coords[..., axes.index(a)] if a in meshes.traced and s > 1
                   else np.zeros(groups.shape, dtype=np.int64)
                   for a, s in zip(meshes.task.axis_names, task_shape, strict=True)]
    flat = np.ravel_multi_index(tuple(task_coords), task_shape)
    return np.ascontiguousarray(flat[keep].astype(np.int64))


def _spans(coll: ir.Operation, axis: str, meshes: _MeshPair) -> DiagnosticError:
    kept = list(meshes.kept)
    return DiagnosticError(
        f"a `{_jax_name(coll)}` in a `shard_map` of task '{meshes.task_name}' runs over the "
        f"mesh axis '{axis}', which {meshes.why(axis)}; inside a task a collective runs "
        f"among the task's devices only (positions {list(meshes.task.devices)}), over the "
        f"axes {kept}. Run it over those axes, or move the step across '{axis}' out of the "
        f"task. (A `shard_map` traced on the global mesh is manual over every axis of it; "
        f"with `check_vma=False` jax's gradient sums over each axis an input is replicated "
        f"on, '{axis}' included: keep `check_vma=True`, or place the stage with "
        f"`mm.task(..., mesh_slice=...)`, which traces it on the stage's own mesh)",
        coll.location)

