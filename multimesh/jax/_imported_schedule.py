"""The schedule of a program imported from Shardy:MPMD, recovered from its call order.

Shardy's partitioner runs the calls in the order its schedule chose, but its output
records no schedule: ``@main`` is a flat list of fragment calls. What it does keep is
enough to rebuild one. A fragment used by one microbatch is named ``..._call{N}``, one
shared by microbatches ``a`` to ``b`` ``..._calls{a}to{b}``, or ``..._calls{b}from{a}``
when the schedule runs them in descending order (circular with reversed backward); a
``call_counter`` attribute on the call, where one survives, says it directly. The
origins' transpose counts give each call's direction; the meshes give the submeshes.
A call of a shared fragment gets the microbatch of the calls whose results it reads,
when exactly one microbatch of its range is among them (a backward reads its own
forward's activations), else the next number of its range not yet taken, in the
name's order (the first stage's forwards, which read only the batch). A call whose
task is pipelined but that carries no number stays unnumbered in the schedule, with a
warning: nothing is guessed.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import replace

from multimesh._src.errors import MultimeshWarning, user_stacklevel
from multimesh.passes.api import schedule_from_order
from multimesh.runtime.plan import Call, Plan
from multimesh.schedules import Schedule, units_from_calls

__all__ = ["recover_schedule", "SCHEDULE_NAME"]

SCHEDULE_NAME = "shardy-mpmd"
"""The name of a recovered schedule (the partitioner's own name is not in its output)."""

_NUMBER = re.compile(r"_calls?(\d+)(?:(to|from)(\d+))?(?=[._]|$)")


def call_range(fragment: str) -> list[int] | None:
    """The microbatches the partitioner's fragment name says it serves, in the order
    it runs them: ``_call2`` [2], ``_calls1to3`` [1, 2, 3], ``_calls3from1`` [3, 2, 1]."""
    m = _NUMBER.search(fragment)
    if m is None:
        return None
    a = int(m.group(1))
    if m.group(2) is None:
        return [a]
    b = int(m.group(3))
    return list(range(a, b + 1)) if m.group(2) == "to" else list(range(a, b - 1, -1))


def _producers(plan: Plan, calls: list[Call]) -> list[tuple[int, ...]]:
    """Per call, the calls whose results it reads (through transfers)."""
    index = {id(c): k for k, c in enumerate(calls)}
    made: dict[int, int] = {}
    for s in plan.steps:
        if isinstance(s, Call):
            for r in s.results:
                made[r] = index[id(s)]
        elif s.src in made:
            made[s.dst] = made[s.src]
    return [tuple(sorted({made[a] for a in c.args if a in made})) for c in calls]


def _microbatches(calls: list[Call], deps: list[tuple[int, ...]],
                  counters: Sequence[int | None]) -> list[int | None]:
    """Each call's microbatch: its counter, its name's number, its readers' (see the
    module docstring), or None."""
    out: list[int | None] = []
    taken: dict[str, set[int]] = {}
    for k, c in enumerate(calls):
        mb = counters[k] if k < len(counters) else None
        span = call_range(c.fragment)
        if mb is None and span is not None:
            used = taken.setdefault(c.fragment, set())
            free = [m for m in span if m not in used]
            near = {m for d in deps[k] if (m := out[d]) in free}
            mb = near.pop() if len(near) == 1 else (free[0] if free else None)
        if mb is not None:
            taken.setdefault(c.fragment, set()).add(mb)
        out.append(mb)
    return out


def recover_schedule(plan: Plan, counters: Sequence[int | None] = ()) -> Schedule | None:
    """The schedule an imported program runs, or None when no call is numbered (the
    program is not microbatched). ``counters``: per call, in order, a ``call_counter``
    the partitioner's output still carries. Numbers the plan's calls as it goes."""
    calls = plan.calls()
    deps = _producers(plan, calls)
    mbs = _microbatches(calls, deps, counters)
    if all(m is None for m in mbs):
        return None
    pipelined = {plan.fragments[c.fragment].task for c, m in zip(calls, mbs) if m is not None}
    missing = [c.fragment for c, m in zip(calls, mbs)
               if m is None and plan.fragments[c.fragment].task in pipelined]
    if missing:
        names = ", ".join(dict.fromkeys(missing))
        n = len(missing)
        warnings.warn(
            f"{n} fragment call{'s' if n > 1 else ''} of the imported program "
            f"{'carry' if n > 1 else 'carries'} no microbatch number ({names}): neither a "
            f"call_counter attribute nor a '_call<N>', '_calls<a>to<b>' or "
            f"'_calls<b>from<a>' fragment name. The recovered schedule leaves them "
            f"unnumbered; keep the partitioner's fragment names to number them.",
            MultimeshWarning, stacklevel=user_stacklevel())
    units_in = []
    for c, m, d in zip(calls, mbs, deps):
        frag = plan.fragments[c.fragment]
        units_in.append(replace(c, task=frag.task, transpose_count=frag.transpose_count,
                                devices=tuple(plan.call_devices(c)), microbatch=m, deps=d,
                                args=(), results=()))
        c.microbatch = m
    units, devices = units_from_calls(units_in)
    return schedule_from_order(SCHEDULE_NAME, units, range(len(units)), devices)
