"""Which device holds which shard: the one notion of "same layout" every layer uses.

Two layouts are the same when every device holds the same piece of the array,
whatever the mesh axes are called or how the mesh is shaped (a replicated value on
devices 0,1 is the same on mesh ``x=2`` and on mesh ``y=2``). Transfers are
inserted, and checked, with this comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Placement = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[tuple[str, ...], ...]]
"""Where an array lives and how it is split: ``(devices, axis_names, axis_sizes, dims)``,
the devices in row-major order over the mesh and, per dimension, the mesh axes it is
split over (the runtime's plan and the front end's input pins use it). Not the
planner's ``Layout`` (a stage's parallel layout)."""


def layout_key(devices: Sequence[int], axis_names: Sequence[str], axis_sizes: Sequence[int],
               dims: Sequence[Sequence[str]]) -> tuple:
    """A hashable description of the device -> shard mapping.

    ``devices`` are the mesh's devices in row-major order over ``axis_sizes``;
    ``dims`` lists, per tensor dimension, the mesh axes it is split over (major
    first). Returns ``(shard counts per dim, (device, shard index) pairs in mesh
    order)``: the order is kept because an executable's device assignment is ordered,
    so arrays must arrive in it even when, as for a replicated value, the data alone
    would not care.
    """
    sizes = dict(zip(axis_names, axis_sizes))
    strides = {}
    stride = 1
    for name in reversed(list(axis_names)):
        strides[name] = stride
        stride *= sizes[name]
    counts = tuple(math.prod(sizes[a] for a in axes) for axes in dims)
    pairs = []
    for linear, dev in enumerate(devices):
        coord = {a: (linear // strides[a]) % sizes[a] for a in axis_names}
        index = []
        for axes in dims:
            i = 0
            for a in axes:
                i = i * sizes[a] + coord[a]
            index.append(i)
        pairs.append((int(dev), tuple(index)))
    return counts, tuple(pairs)


def translate_dims(src_devices: Sequence[int], src_names: Sequence[str],
                   src_sizes: Sequence[int], dims: Sequence[Sequence[str]],
                   dst_devices: Sequence[int], dst_names: Sequence[str],
                   dst_sizes: Sequence[int]) -> tuple[tuple[str, ...], ...] | None:
    """``dims`` (per tensor dim, axes of the source mesh) written on another mesh over
    the same devices, or None when that mesh cannot express the same layout.

    Each source axis must be a run of whole destination axes (size-1 axes aside):
    ``P("d")`` on mesh ``d=4`` is ``P("x")`` on mesh ``x=4, y=1`` over the same devices,
    and ``P(("x", "y"))`` on ``x=2, y=2``. The answer is checked with :func:`layout_key`.
    """
    if [int(d) for d in src_devices] != [int(d) for d in dst_devices]:
        return None
    src, dst = _strides(src_names, src_sizes), _strides(dst_names, dst_sizes)
    out = []
    for axes in dims:
        new: list[str] = []
        for a in axes:
            lo, size = src[a]
            if size == 1:
                continue
            cover = _covering_axes(lo, size, dst)
            if cover is None:
                return None
            new.extend(cover)
        out.append(tuple(new))
    out_t = tuple(out)
    if layout_key(src_devices, src_names, src_sizes, dims) != \
            layout_key(dst_devices, dst_names, dst_sizes, out_t):
        return None
    return out_t


def _strides(names: Sequence[str], sizes: Sequence[int]) -> dict[str, tuple[int, int]]:
    """Axis name -> (stride in the flattened device order, size)."""
    out, stride = {}, 1
    for name, size in reversed(list(zip(names, sizes))):
        out[name] = (stride, int(size))
        stride *= int(size)
    return out


def _covering_axes(lo: int, size: int,
                   dst: dict[str, tuple[int, int]]) -> list[str] | None:
    """The destination axes (major to minor) that together make one source axis of
    stride ``lo`` and ``size``, or None when they do not chain into exactly it."""
    cover = sorted(((st, n) for n, (st, sz) in dst.items()
                    if sz > 1 and lo <= st < lo * size), reverse=True)
    expect = lo
    for st, n in reversed(cover):  # minor to major: strides must chain
        if st != expect:
            return None
        expect *= dst[n][1]
    if expect != lo * size:
        return None
    return [n for _, n in cover]
