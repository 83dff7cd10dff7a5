"""Logical -> physical sharding resolution (reference §1.14), as a pure algorithm.

No MLIR and no jax here: the pass ``mm-resolve-logical-shardings`` and the jax
front end both call :func:`resolve_logical_spec`.

Given, per tensor dimension, the *logical* names it may be sharded over, the
tensor shape, a task mesh (device axis names and sizes) and the task's
priority-ordered ``(logical, device)`` mapping:

1. ``used = {}``, ``shard[d] = 1`` for every dim.
2. For each pair ``(L, D)`` in order, for each dim ``d`` whose names contain
   ``L``: ``D`` must be a device axis of the mesh (else an error); if ``D`` is
   not used yet and ``shard[d] * size(D) <= shape[d]``, ``D`` is assigned to
   ``d``, marked used and ``shard[d] *= size(D)``; otherwise the pair is skipped
   for that dim silently (the over-shard rule).
3. Logical names that no pair mentions leave their dim unsharded; an empty
   mapping gives a fully replicated spec.
4. Several device axes on one dim are listed in mesh-axis order.
5. Each dim's shard count (the product of its axes' sizes) must divide the
   dim's size, else an error naming the shape, the dim and the axes.

A device axis of size 1 may be assigned (it never over-shards); the pass drops it
when it writes the sharding on the task's mesh, as it drops a size-one axis from any
sharding there (``_localize.on_task_mesh``): it splits nothing. One rule table per
task: the task's own pairs, its ``extra_axes``, then any rules converted for the whole
program (flax's ``nn.logical_axis_rules`` under ``parallelize_step``,
``multimesh.jax.flax._linen.logical_pairs``).
"""

from __future__ import annotations

from collections.abc import Sequence

from multimesh._src.errors import LogicalShardingError

__all__ = ["resolve_logical_spec", "to_partition_spec", "format_axes"]


def _quote_list(names: Sequence[str]) -> str:
    return ", ".join(f"'{n}'" for n in names) if names else "(none)"


def format_axes(axes: Sequence[str], sizes: dict[str, int]) -> str:
    """``device axis 'x' (size 4)`` or ``device axes 'x' (size 4) and 'y' (size 2)``."""
    parts = [f"'{a}' (size {sizes[a]})" for a in axes]
    if len(parts) == 1:
        return f"device axis {parts[0]}"
    return "device axes " + ", ".join(parts[:-1]) + " and " + parts[-1]



def _check_mesh(names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    if len(names) != len(sizes):
        raise LogicalShardingError(
            f"The task mesh has {len(names)} axis names ({_quote_list(names)}) but "
            f"{len(sizes)} axis sizes {list(sizes)}; they must have the same length.")
    if len(set(names)) != len(names):
        raise LogicalShardingError(
            f"The task mesh has duplicate axis names: {_quote_list(names)}.")

def resolve_logical_spec(
    logical_axes_per_dim: Sequence[Sequence[str]],
    shape: Sequence[int],
    mesh_axis_names: Sequence[str],
    mesh_axis_sizes: Sequence[int],
    mapping: Sequence[tuple[str, str]],
    *,
    tensor_desc: str = "",
) -> tuple[tuple[str, ...], ...]:
    """Per tensor dim, the device axes it is sharded over (in mesh-axis order).

    ``tensor_desc`` (e.g. ``"'w'"``) is inserted after "tensor" in error messages.
    Raises :class:`LogicalShardingError` for an unknown device axis, a rank
    mismatch or a shard count that does not divide its dimension.
    """
    shape = tuple(int(s) for s in shape)
    names = [tuple(str(n) for n in dim) for dim in logical_axes_per_dim]
    mesh_axis_names = tuple(mesh_axis_names)
    mesh_axis_sizes = tuple(int(s) for s in mesh_axis_sizes)
    desc = f"tensor {tensor_desc}" if tensor_desc else "tensor"
    _check_mesh(mesh_axis_names, mesh_axis_sizes)
    if len(names) != len(shape):
        raise LogicalShardingError(
            f"The logical sharding has {len(names)} "
            f"{'entry' if len(names) == 1 else 'entries'} but the {desc} of shape "
            f"{shape} has rank {len(shape)}; give one entry per dimension.")
    size_of = dict(zip(mesh_axis_names, mesh_axis_sizes, strict=True))
    index_of = {n: i for i, n in enumerate(mesh_axis_names)}

    used: set[str] = set()
    shard = [1] * len(shape)
    assigned: list[list[str]] = [[] for _ in shape]
    for logical, device in mapping:
        for d, dim_names in enumerate(names):
            if logical not in dim_names:
                continue
            if device not in size_of:
                raise LogicalShardingError(
                    f"Logical axis '{logical}' is mapped to device axis '{device}', "
                    f"which is not an axis of the task mesh. Valid device axis names "
                    f"are: {_quote_list(mesh_axis_names)}.")
            size = size_of[device]
            if device not in used and shard[d] * size <= shape[d]:
                assigned[d].append(device)
                used.add(device)
                shard[d] *= size

    result = []
    for d, axes in enumerate(assigned):
        axes = sorted(axes, key=index_of.__getitem__)
        if axes and shape[d] % shard[d] != 0:
            raise LogicalShardingError(
                f"Cannot shard dimension {d} of {desc} of shape {shape} over "
                f"{format_axes(axes, size_of)}: {shard[d]} does not evenly divide "
                f"{shape[d]}.")
        result.append(tuple(axes))
    return tuple(result)


def to_partition_spec(resolved: Sequence[Sequence[str]]) -> tuple:
    """``(('x',), (), ('x', 'y'))`` -> ``('x', None, ('x', 'y'))``: PartitionSpec arguments."""
    out = []
    for axes in resolved:
        axes = tuple(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)
