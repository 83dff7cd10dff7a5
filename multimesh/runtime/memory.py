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
    sim = _LiveBytes()
    for i, step in enumerate(plan.steps):
        if isinstance(step, Call):
            sim.call(plan.fragments[step.fragment], step,
                     executor.exes[step.fragment].memory_analysis())
            done = step.args
        else:
            src = sim.where.get(step.src)
            if src is not None:
                sim.add(step.dst, src[0], src[1], step.layout)
            done = [step.src]
        for vid in set(done):
            if plan.last_use.get(vid) == i and vid not in plan.outputs:
                sim.free(vid)
    return sim.peak, sim.own


class _LiveBytes:
    """Bytes alive on each device as the plan's steps run in order."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # device position -> bytes
        self.where: dict[int, tuple] = {}  # value -> (shape, dtype, layout) while alive
        self.peak: dict[int, int] = {}
        self.own: dict[int, int] = {}  # device position -> largest fragment peak

    def add(self, vid: int, shape, dtype, lay, sign: int = 1) -> None:
        b = _shard_bytes(shape, dtype, lay)
        for p in lay[0]:
            self.live[p] = self.live.get(p, 0) + sign * b
        if sign > 0:
            self.where[vid] = (shape, dtype, lay)

    def free(self, vid: int) -> None:
        if vid in self.where:
            shape, dtype, lay = self.where.pop(vid)
            self.add(vid, shape, dtype, lay, sign=-1)

    def call(self, frag, step: Call, stats) -> None:
        """One fragment call: its inputs (if new), its outputs, and its temporaries
        on top of what is alive at that point (``stats``: XLA's memory analysis)."""
        for vid, t, lay in zip(step.args, frag.in_types, frag.in_layouts):
            if vid not in self.where:
                self.add(vid, t[0], t[1], lay)
        temp = stats.temp_size_in_bytes
        fpeak = stats.argument_size_in_bytes + stats.output_size_in_bytes + temp
        for p in frag.devices:
            self.own[p] = max(self.own.get(p, 0), fpeak)
        for vid, t, lay in zip(step.results, frag.out_types, frag.out_layouts):
            self.add(vid, t[0], t[1], lay)
        for p in frag.devices:
            self.peak[p] = max(self.peak.get(p, 0), self.live.get(p, 0) + temp)
