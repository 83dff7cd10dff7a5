"""A profiled step laid out as the schedule picture (``compiled.profile(trace_path=...)``).

The runtime records one span per plan step, named after its fragment or value
(:func:`multimesh.runtime.steps.traced`). Written as is, eight calls of one fragment
read as eight identical slices. Here each call's slice is named after its unit of the
schedule, ``s1_fwd F3 (stage 1)`` (fragment, direction letter and microbatch, stage),
with the same facts as arguments; the tracks are the rows of
:func:`~multimesh.jax.visualize_schedule`, submesh 0 first; and each transfer is a
flow from the slice that made its value (on the sending submesh) to the transfer's
own slice (on the receiving one). The runtime's arguments stay as they are.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from multimesh.runtime.plan import Call, Plan
from multimesh.runtime.trace import Event, write_trace
from multimesh.schedules import Schedule, Unit, units_from_calls

__all__ = ["step_trace", "write_step_trace"]

_LETTER = {"fwd": "F", "bwd": "B", "bwd_w": "W"}


def _units(plan: Plan, schedule: Schedule | None
           ) -> tuple[dict[int, Unit], list[tuple[int, ...]]]:
    """Plan step index -> its call's schedule unit, and the submeshes in the
    picture's order. Without a schedule, units of the calls as one microbatch."""
    calls = [(i, s) for i, s in enumerate(plan.steps) if isinstance(s, Call)]
    if schedule is None:
        units, meshes = units_from_calls([
            replace(s, task=plan.fragments[s.fragment].task,
                    transpose_count=plan.fragments[s.fragment].transpose_count,
                    devices=tuple(plan.call_devices(s)), microbatch=0, args=(), results=())
            for _, s in calls])
        return {i: u for (i, _), u in zip(calls, units)}, list(meshes)
    queue: dict[tuple[str, int | None], deque[Unit]] = {}
    for k in schedule.order:
        u = schedule.units[k]
        queue.setdefault((u.fragment, u.microbatch), deque()).append(u)
    out = {}
    for i, s in calls:
        q = queue.get((s.fragment, s.microbatch))
        if q:
            out[i] = q.popleft()
    return out, [tuple(d) for d in schedule.devices]


def _call_label(plan: Plan, call: Call, unit: Unit | None) -> tuple[str, dict]:
    """``s1_fwd F3 (stage 1)`` and its arguments."""
    frag = plan.fragments[call.fragment]
    kind = unit.kind if unit is not None else \
        {0: "fwd", 1: "bwd"}.get(frag.transpose_count, "other")
    stage = unit.stage if unit is not None else None
    mb = call.microbatch
    head = kind if mb is None else f"{_LETTER.get(kind, 'X')}{mb}"
    name = f"{call.fragment} {head}" + ("" if stage is None else f" (stage {stage})")
    return name, {"task": frag.task, "direction": kind, "microbatch": mb, "stage": stage}


class _Tracks:
    """Submesh tracks, numbered as the picture's rows, then any others."""

    def __init__(self, meshes: list[tuple[int, ...]], device_ids: Sequence[int]):
        self.ids = device_ids
        self.index = {m: k for k, m in enumerate(meshes)}

    def of(self, where: Sequence[int]) -> tuple[str, int]:
        where = tuple(where)
        m = self.index.setdefault(where, len(self.index))
        return f"submesh {m} (devices {','.join(str(self.ids[p]) for p in where)})", m

    def names(self) -> list[str]:
        return [self.of(w)[0] for w in self.index]


def step_trace(events: Sequence[Event], plan: Plan, schedule: Schedule | None,
               device_ids: Sequence[int]) -> tuple[list[Event], list[str], list[tuple[int, int]]]:
    """The runtime's ``events`` relabelled: ``(events, tracks in order, flows)``."""
    units, meshes = _units(plan, schedule)
    tracks = _Tracks(meshes, device_ids)
    layouts = plan.value_layouts()
    made: dict[int, int] = {}  # value id -> the event that made it
    out: list[Event] = []
    flows: list[tuple[int, int]] = []
    for k, e in enumerate(events):
        args = dict(e[4]) if len(e) == 5 and e[4] else {}
        i = args.get("plan_step")
        cat = args.get("cat", "fragment")
        if i is None or cat not in ("fragment", "transfer"):
            out.append(tuple(e))
            continue
        step = plan.steps[i]
        if cat == "fragment":
            name, extra = _call_label(plan, step, units.get(i))
            track, m = tracks.of(plan.call_devices(step))
            made.update(dict.fromkeys(step.results, k))
        else:
            name, (track, m) = e[1], tracks.of(step.layout[0])
            extra = {"from_submesh": tracks.index.get(tuple(layouts[step.src][0]))}
            if step.src in made:
                flows.append((made[step.src], k))
                extra["microbatch"] = out[made[step.src]][4].get("microbatch")
            made[step.dst] = k
        out.append((track, name, e[2], e[3], {**args, **extra, "submesh": m}))
    return out, tracks.names(), flows


def write_step_trace(events: Sequence[Event], plan: Plan, schedule: Schedule | None,
                     device_ids: Sequence[int], path: str | os.PathLike) -> dict:
    """:func:`step_trace` written as a Chrome/Perfetto trace file; returns its dict."""
    evs, names, flows = step_trace(events, plan, schedule, device_ids)
    return write_trace(evs, path, tracks=names, flows=flows)
