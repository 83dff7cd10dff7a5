"""The text Gantt chart of a schedule (docs/schedules.md, ``mm.visualize``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from .model import Unit, short_label
from .simulator import Schedule, Timeline, chunk_of, simulate

__all__ = ["format_gantt", "format_timeline"]


def format_gantt(schedule: Schedule, cost: Callable[[Unit], float] | None = None) -> str:
    """A text Gantt chart: one row per submesh, one cell per unit of time.

    Each unit is drawn as its label (``F``/``B``/``W`` + microbatch; ``X`` for other
    units, ``*`` without a microbatch; under interleaving a letter for the stage
    among its submesh's stages, ``a`` first) followed by ``-`` over the rest of its
    duration; ``.`` is idle time.
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
    return "\n".join(lines)


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
