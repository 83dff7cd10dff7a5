"""Which device holds which shard: the one notion of "same layout" every layer uses.

Two layouts are the same when every device holds the same piece of the array,
whatever the mesh axes are called or how the mesh is shaped (a replicated value on
devices 0,1 is the same on mesh ``x=2`` and on mesh ``y=2``). Transfers are
inserted, and checked, with this comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
