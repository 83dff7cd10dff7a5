"""``MpmdCompiled.memory_profile``: measured memory per submesh beside the schedule's theory."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from multimesh.runtime.memory import SubmeshMemory, handed_over

__all__ = ["MemoryProfile", "memory_profile", "stage_tasks", "program_fingerprint"]


def program_fingerprint(compiled) -> str:
    """What tells one compiled program from another: its MPMD text and its devices."""
    ids = ",".join(str(d.id) for d in compiled.record.devices)
    return hashlib.sha256(f"{ids}\n{compiled.as_text()}".encode()).hexdigest()


@dataclasses.dataclass
class MemoryProfile:
    """Per submesh (schedule order), what one real step held and what the schedule
    predicts: ``predicted_microbatches`` live (stage, microbatch) pairs at most (the
    schedule's ``live_activations``), and ``predicted_activations``, the most bytes
    over the submesh's dispatch order of (pairs between forward and backward) x
    ``residual_bytes`` + (pairs between the halves of a split backward) x
    ``weight_bytes`` (a pair whose first half runs counts in both where that half
    hands values to the second), with each
    stage's own bytes (``stage_bytes``) where the submesh runs several."""

    schedule: str | None
    submeshes: list[SubmeshMemory]
    predicted_microbatches: list[int]
    states: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)
    """Per submesh, after each of its dispatches: (pairs awaiting their backward,
    pairs awaiting their weight half)."""
    stage_states: list[list[dict[str, tuple[int, int]]]] = dataclasses.field(
        default_factory=list)
    """``states`` per stage (its forward task; the tasks of a stage that runs several,
    joined by ``+``)."""
    source: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The schedule of the program measured (None if it is not microbatched), so a
    picture of another program can refuse this profile."""
    program: str | None = dataclasses.field(default=None, compare=False, repr=False)
    """A fingerprint of the compiled program measured (:func:`program_fingerprint`)."""

    @property
    def predicted_activations(self) -> list[int]:
        out = []
        for k, s in enumerate(self.submeshes):
            rows = self.stage_states[k] if k < len(self.stage_states) else [
                {"": c} for c in self.states[k]]
            # a stage with nothing measured kept nothing (a first stage's batch slice)
            fallback = (0, 0) if s.stage_bytes else (s.residual_bytes, s.weight_bytes)
            # a stage that runs several tasks (a V's turn) holds the sum of theirs
            out.append(max((sum(a * s.stage_bytes.get(part, fallback)[0]
                                + b * s.stage_bytes.get(part, fallback)[1]
                                for t, (a, b) in row.items() for part in t.split("+"))
                            for row in rows), default=0))
        return out

    def format(self) -> str:
        """A table, one row per submesh, sizes in KiB per device."""
        head = (f"{'devices':<14}{'peak':>9}{'inputs':>9}{'activ.':>9}{'other':>9}{'temp':>9}"
                f"{'act.peak':>10}{'mbs':>5}{'theory':>9}{'(mbs)':>6}")
        rows = [head]
        for s, n, t in zip(self.submeshes, self.predicted_microbatches,
                           self.predicted_activations):
            ids = ",".join(map(str, s.devices))
            rows.append(f"{ids:<14}" + "".join(f"{v / 1024:>9.1f}" for v in (
                s.peak, s.inputs, s.activations, s.other, s.temporaries))
                + f"{s.peak_activations / 1024:>10.1f}{s.peak_microbatches:>5}"
                + f"{t / 1024:>9.1f}{n:>6}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.format()


def memory_profile(compiled, submeshes: list[SubmeshMemory]) -> MemoryProfile:
    """The :class:`MemoryProfile` of one measured step of ``compiled`` (``submeshes``:
    the executor's ``measure`` of it) beside its schedule's theory."""
    low = compiled.record
    measured = {tuple(s.devices): s for s in submeshes}
    sched = compiled.schedule
    if sched is None:
        return MemoryProfile(None, list(measured.values()), [0] * len(measured),
                             [[] for _ in measured], program=program_fingerprint(compiled))
    ids = [tuple(low.devices[p].id for p in where) for where in sched.devices]
    live = sched.live_activations()
    rows = [measured.get(i, SubmeshMemory(i)) for i in ids]
    per_stage = _states(sched, handed_over(compiled.plan_data))
    states = [[tuple(map(sum, zip((0, 0), *row.values()))) for row in sub] for sub in per_stage]
    return MemoryProfile(sched.name, rows, list(live), states, per_stage,  # type: ignore
                         source=sched, program=program_fingerprint(compiled))


def stage_tasks(schedule) -> dict[int, str]:
    """Each pipeline stage's forward tasks, joined by ``+``: one task, or several
    consecutive ones that run back to back on one submesh (the two at a V's turn),
    which the schedule counts as one stage."""
    tasks: dict[int, list[str]] = {}
    for u in schedule.units:
        if not u.free and u.kind == "fwd" and u.task not in tasks.setdefault(u.stage, []):
            tasks[u.stage].append(u.task)
    return {k: "+".join(v) for k, v in tasks.items()}


def _states(schedule, handed: set[str]) -> list[list[dict[str, tuple[int, int]]]]:
    """Per submesh, after each dispatch, per stage (its forward task): (stage,
    microbatch) pairs whose forward ran and backward has not, and pairs whose
    backward has partly run (a weight half to come). ``handed``: the stages whose
    first backward half makes values for the second (held beside its residuals while
    it runs)."""
    task = stage_tasks(schedule)
    total: dict[tuple, int] = {}
    for u in schedule.units:
        if not u.free and u.kind in ("bwd", "bwd_w"):
            total[u.key] = total.get(u.key, 0) + 1
    out = []
    for row in schedule.rows():
        fwd: set[tuple] = set()
        bwd: dict[tuple, int] = {}
        counts = []
        for u in row:
            if not u.free and u.kind == "fwd":
                fwd.add(u.key)
            elif not u.free and u.kind in ("bwd", "bwd_w"):
                bwd[u.key] = bwd.get(u.key, 0) + 1
            waiting = [k for k in fwd if k in total and bwd.get(k, 0) < total[k]]
            # while a split backward's first half runs, its microbatch's residuals are
            # still held beside what it makes for the second half
            running = (not u.free and u.kind == "bwd" and u.key in fwd
                       and bwd.get(u.key) == 1 and total.get(u.key, 0) > 1
                       and bool(handed & set(task.get(u.key[1], "").split("+"))))
            row_counts: dict[str, list[int]] = {}
            for k in waiting:
                row_counts.setdefault(task.get(k[1], ""), [0, 0])[bool(bwd.get(k))] += 1
            if running:
                row_counts.setdefault(task.get(u.key[1], ""), [0, 0])[0] += 1
            counts.append({t: (a, b) for t, (a, b) in row_counts.items()})
        out.append(counts)
    return out
