"""Memory accounting for a plan: live buffers per device over the dispatch order.

Used by the P7 benchmark and by tests that bound live activations. Sizes are
per-device shard bytes, from each value's layout; a fragment's own peak is its
arguments + outputs + XLA temporaries (``get_compiled_memory_stats``).
"""

from __future__ import annotations

import math

import numpy as np

from multimesh.runtime.plan import Call, Plan


def _shard_bytes(shape, dtype: str, layout) -> int:
    _, names, sizes, dims = layout
    size_of = dict(zip(names, sizes))
    n = 1
    for d, axes in zip(shape, dims):
        n *= math.ceil(d / math.prod(size_of[a] for a in axes)) if axes else d
    from multimesh.runtime.executor import _dtype

    return n * np.dtype(_dtype(dtype)).itemsize


def simulated_peaks(plan: Plan, executor) -> tuple[dict[int, int], dict[int, int]]:
    """(peak bytes per device while running the plan, max fragment peak per device)."""
    live: dict[int, int] = {}  # device position -> bytes
    where: dict[int, list] = {}
    peak: dict[int, int] = {}
    own: dict[int, int] = {}

    def add(vid, shape, dtype, lay, sign=1):
        b = _shard_bytes(shape, dtype, lay)
        for p in lay[0]:
            live[p] = live.get(p, 0) + sign * b
        if sign > 0:
            where[vid] = (shape, dtype, lay)

    first = True
    for i, step in enumerate(plan.steps):
        if isinstance(step, Call):
            frag = plan.fragments[step.fragment]
            if first:
                first = False
            for vid, t, lay in zip(step.args, frag.in_types, frag.in_layouts):
                if vid not in where:
                    add(vid, t[0], t[1], lay)
            stats = executor.exes[step.fragment].memory_analysis()
            temp = stats.temp_size_in_bytes
            fpeak = (stats.argument_size_in_bytes + stats.output_size_in_bytes + temp)
            for p in frag.devices:
                own[p] = max(own.get(p, 0), fpeak)
            for vid, t, lay in zip(step.results, frag.out_types, frag.out_layouts):
                add(vid, t[0], t[1], lay)
            for p in frag.devices:
                peak[p] = max(peak.get(p, 0), live.get(p, 0) + temp)
            done = step.args
        else:
            src = where.get(step.src)
            if src is not None:
                add(step.dst, src[0], src[1], step.layout)
            done = [step.src]
        for vid in set(done):
            if plan.last_use.get(vid) == i and vid not in plan.outputs and vid in where:
                shape, dtype, lay = where.pop(vid)
                add(vid, shape, dtype, lay, sign=-1)
    return peak, own
