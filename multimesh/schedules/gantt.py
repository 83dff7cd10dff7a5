"""The text Gantt chart of a schedule (docs/schedules.md, ``mm.visualize``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from .model import Unit, short_label
from .simulator import Schedule, Timeline, chunk_of, live_activation_profile, simulate

__all__ = ["format_gantt", "format_timeline", "memory_lanes", "Lane"]


def format_gantt(schedule: Schedule, cost: Callable[[Unit], float] | None = None,
                 memory: bool | Sequence[str] = False) -> str:
    """A text Gantt chart: one row per submesh, one cell per unit of time.

    Each unit is drawn as its label (``F``/``B``/``W`` + microbatch; ``X`` for other
    units, ``*`` without a microbatch; under interleaving a letter for the stage
    among its submesh's stages, ``a`` first) followed by ``-`` over the rest of its
    duration; ``.`` is idle time. ``memory``: under each submesh a lane of its live
    activations over time (:func:`memory_lanes`), ending with their peak; strings, one
    per submesh, are appended to the lanes (what a real step measured).
    """
    tl = simulate(schedule, cost=cost)
    s = schedule
    chunk = chunk_of(s)
    interleaved = any(c > 0 for c in chunk.values())

    def label(u: Unit) -> str:
        if interleaved and u.index in chunk:
            return short_label(u) + "abcdefghijklmnopqrstuvwxyz"[chunk[u.index] % 26]
        return short_label(u)

    durs = [e - b for b, e in zip(tl.start, tl.end, strict=True)]
    quantum = _quantum(durs + list(tl.start))
    width = max([len(label(u)) for u in s.units] + [2]) + 1
    T = round(tl.makespan / quantum) if s.units else 0
    names = [f"submesh {m}" for m in range(s.num_meshes)]
    pad = max((len(n) for n in names), default=0)
    head = (f"{s.name}: {s.num_meshes} submeshes x {s.num_microbatches} microbatches, "
            f"makespan {tl.makespan:g}, bubble {100 * tl.bubble_fraction():.1f}%")
    lines = [head]
    for m, row in enumerate(s.orders):
        cells = [".".ljust(width)] * T
        for i in row:
            a = round(tl.start[i] / quantum)
            b = max(a + 1, round(tl.end[i] / quantum))
            lab = label(s.units[i])
            cells[a] = lab.ljust(width)
            for k in range(a + 1, b):
                cells[k] = "-" * width
        lines.append(f"{names[m].ljust(pad)} |{''.join(cells).rstrip()}")
        if memory is not False:
            lane = memory_lanes(s, tl)[m]
            cells = [str(lane.at(k * quantum)).ljust(width)[:width] for k in range(T)]
            note = f"  {memory[m]}" if not isinstance(memory, bool) and m < len(memory) else ""
            lines.append(f"{'  live'.ljust(pad)} |{''.join(cells).rstrip()}   peak "
                         f"{lane.peak}{note}")
    return "\n".join(lines)


class Lane:
    """One submesh's live activations over time: ``(time, count)`` steps."""

    def __init__(self, steps: list[tuple[float, int]]):
        # at one instant only the last count holds (a backward ends as a forward starts)
        last = dict(sorted(steps, key=lambda s: s[0]))
        self.steps = sorted(last.items())
        self.peak = max((c for _, c in steps), default=0)

    def at(self, t: float) -> int:
        """The count at time ``t`` (the last step at or before it)."""
        out = 0
        for when, c in self.steps:
            if when > t + 1e-9:
                break
            out = c
        return out


def memory_lanes(schedule: Schedule, timeline: Timeline | None = None) -> list[Lane]:
    """Per submesh, its live (stage, microbatch) activations over the simulated time
    (``live_activation_profile`` in dispatch order): one comes alive when its forward
    starts and is freed when its last backward ends."""
    tl = timeline or simulate(schedule)
    lanes = []
    for row, prof in zip(schedule.orders, live_activation_profile(schedule), strict=True):
        steps, before = [], 0
        for i, live in zip(row, prof, strict=True):
            steps.append((tl.start[i] if live >= before else tl.end[i], live))
            before = live
        lanes.append(Lane(steps))
    return lanes


def format_timeline(tl: Timeline, label: str, columns: int = 72) -> str:
    """A text Gantt of a timeline in seconds (simulated with real costs, or measured),
    ``columns`` cells wide: each unit is its letter and microbatch (``F3``) where it
    starts, ``-`` while it runs (just its letter where that is too long); ``.`` is
    idle."""
    s = tl.schedule
    T = tl.makespan or 1.0
    names = [f"submesh {m}" for m in range(s.num_meshes)]
    pad = max((len(n) for n in names), default=0)
    lines = [f"{s.name}, {label}: step {T * 1e3:.3g} ms, bubble "
             f"{100 * tl.bubble_fraction():.1f}%"]
    for m, row in enumerate(s.orders):
        cells = ["."] * columns
        for i in row:
            a = min(columns - 1, int(tl.start[i] / T * columns))
            b = max(a + 1, min(columns, round(tl.end[i] / T * columns)))
            lab = short_label(s.units[i])
            cells[a:b] = list(lab.ljust(b - a, "-") if len(lab) <= b - a else lab[0] * (b - a))
        lines.append(f"{names[m].ljust(pad)} |{''.join(cells)}")
    return "\n".join(lines)


def _quantum(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 1e-12]
    if not vals:
        return 1.0
    q = min(vals)
    for v in vals:  # coarse gcd so that every boundary lands on a cell
        r = v / q
        if abs(r - round(r)) > 1e-6:
            q = math.gcd(round(q * 1000), round(v * 1000)) / 1000 or q
    return q
