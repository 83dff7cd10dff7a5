"""Pipeline schedules as plain Python: the unit model, the algorithms and a simulator.

No MLIR here. ``mm-schedule-fragments`` (``schedule_fragments.py``) turns ``@main``'s
fragment calls into :class:`Unit`\\ s, calls :func:`build_schedule`, and writes the
result back; the docs, the benchmarks (P6) and the visualiser use this module
directly, with synthetic pipelines from :func:`pipeline_units`.

Model
-----
A **unit** is one fragment call: its position in program order (``index``), the
submesh it runs on (``mesh``, numbered by first use), its pipeline ``stage``, its
``microbatch``, its ``kind`` (``"fwd"``, ``"bwd"`` — a whole backward or, when the
backward is split, the activation-gradient part —, ``"bwd_w"`` — the
weight-gradient part — or ``"other"``) and the units whose results it reads
(``deps``). Stages are derived from the forward fragments in program order: a run of
consecutive forward tasks on one submesh is one stage, so ``embed -> layer1`` on
submesh 0 and ``layer2 -> loss`` on submesh 1 are stages 0 and 1, and eight layers
placed round-robin on four submeshes are eight stages, two per submesh
(interleaving). A backward unit has its forward task's stage. Units without a
microbatch or a stage are *free*: every schedule runs them as soon as they are
ready. A call that reads the result of a later microbatch (an accumulation across
microbatches) gets no stage, so it is free too.

A **schedule** is one dispatch order per submesh that respects ``deps``, plus a
global order that merges them (what ``@main`` becomes). Every algorithm first
writes a *plan* per submesh (the textbook order, as slots ``(kind, stage,
microbatch)``) and then runs it through an event simulator with unit costs; the
simulator only ever starts a unit whose inputs are done, so a plan that a strange
program makes impossible degrades into the nearest order that works instead of
deadlocking (a custom schedule raises instead). The global order is the units
sorted by their simulated start time, which is a topological merge of the
per-submesh orders.
"""

from __future__ import annotations

import difflib
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from multimesh._src.errors import MultimeshValueError

__all__ = [
    "KINDS", "SCHEDULES", "ALIASES", "alias_list", "ScheduleError", "Unit", "Call", "Schedule", "Timeline",
    "units_from_calls", "pipeline_units", "build_schedule", "canonical_schedule_name",
    "canonicalize_custom_schedule", "unit_label", "default_cost", "simulate",
    "live_activations", "live_activation_profile", "theoretical_bubble", "format_gantt",
    "chunk_of", "SPLIT_SCHEDULES", "PLACEMENTS", "check_placement", "theoretical_peak_live",
    "v_shape_units",
]

KINDS = ("fwd", "bwd", "bwd_w", "other")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1", "zero-bubble-h2",
             "eager-1f1b", "interleaved-gpipe", "gpipe-1f1b-last", "circular-reversed-backward",
             "dualpipe-v", "custom")
SPLIT_SCHEDULES = ("zero-bubble-h1", "zero-bubble-h2", "dualpipe-v")
"""Schedules that run weight gradients apart (``mm-split-backward{all=true}`` first)."""
ALIASES = {"fill-drain": "gpipe", "breadth-first": "gpipe", "wavefront": "1f1b",
           "prefetch-wavefront": "1f1b", "zb-h2": "zero-bubble-h2",
           "pipedream-flush": "1f1b", "zb-h1": "zero-bubble-h1",
           # the peers' spellings (JaxPP, SpectraX, Shardy:MPMD), matched in any case
           "Eager1F1B": "eager-1f1b", "InterleavedGPipe": "interleaved-gpipe",
           "GPipeBut1F1BForLastMesh": "gpipe-1f1b-last",
           "CircularWithReversedBackward": "circular-reversed-backward",
           "DualPipeV": "dualpipe-v"}
"""Other names of the schedules; matched case-insensitively (:func:`alias_list`)."""


def alias_list() -> str:
    """``alias = schedule, ...`` in alphabetical order, for error messages."""
    return ", ".join(f"{a} = {t}" for a, t in sorted(ALIASES.items(),
                                                      key=lambda kv: kv[0].lower()))


class ScheduleError(MultimeshValueError):
    """A schedule name, option or custom schedule is invalid for the program."""


# ---------------------------------------------------------------------------- units


@dataclass(frozen=True)
class Unit:
    """One fragment call. ``index`` is its position in program order (0..N-1)."""

    index: int
    mesh: int
    kind: str
    microbatch: int | None = None
    stage: int | None = None
    deps: tuple[int, ...] = ()
    task: str = ""
    fragment: str = ""
    split: bool = False  # a "bwd" whose weight-gradient part is a separate "bwd_w" unit
    own_name: bool = False  # a backward task named apart from its forward (``layer0_bwd``)

    @property
    def free(self) -> bool:
        """Not part of the pipeline proper: no microbatch, no stage or kind "other"."""
        return self.microbatch is None or self.stage is None or self.kind == "other"

    @property
    def key(self) -> tuple[int, int, int]:
        """``(mesh, stage, microbatch)`` of a pipeline unit (one that is not free)."""
        assert self.stage is not None and self.microbatch is not None, self
        return self.mesh, self.stage, self.microbatch


@dataclass(frozen=True)
class Call:
    """A fragment call as the pass reads it from ``@main`` (input to :func:`units_from_calls`)."""

    fragment: str
    task: str
    transpose_count: int
    devices: tuple[int, ...]
    microbatch: int | None = None
    split: str | None = None  # None | "activation" | "weight"
    deps: tuple[int, ...] = ()
    forward: str | None = None  # a backward task's forward, when named apart from it


def units_from_calls(calls: Sequence[Call]) -> tuple[list[Unit], list[tuple[int, ...]]]:
    """Units (with submeshes and stages) for calls in program order; also the device lists.

    Submeshes are the distinct device lists in order of first use. Stages: see the
    module docstring.
    """
    meshes: list[tuple[int, ...]] = []
    mesh_of: dict[tuple[int, ...], int] = {}
    for c in calls:
        if c.devices not in mesh_of:
            mesh_of[c.devices] = len(meshes)
            meshes.append(c.devices)
    # Stages from the first forward appearance of each task (microbatched calls only).
    stage_of: dict[str, int] = {}
    last_mesh = None
    stage = -1
    for c in calls:
        if c.transpose_count != 0 or c.microbatch is None or c.task in stage_of:
            continue
        m = mesh_of[c.devices]
        if m != last_mesh:
            stage += 1
            last_mesh = m
        stage_of[c.task] = stage
    _backward_stages(calls, stage_of, mesh_of)
    weight_split = {(c.task, c.microbatch) for c in calls
                    if c.transpose_count == 1 and c.split == "weight"}
    # A call that reads a later microbatch's result combines microbatches (a sum over
    # them, say): it cannot hold its microbatch's slot, so it runs as a free unit.
    combines = _combining(calls)
    units = []
    for i, c in enumerate(calls):
        if c.transpose_count == 0:
            kind = "fwd"
        elif c.transpose_count == 1:
            kind = "bwd_w" if c.split == "weight" else "bwd"
        else:
            kind = "other"
        split = kind == "bwd" and (c.split == "activation"
                                   or (c.task, c.microbatch) in weight_split)
        units.append(Unit(i, mesh_of[c.devices], kind, c.microbatch,
                          stage_of.get(c.task) if c.microbatch is not None and i not in combines
                          else None,
                          tuple(sorted(set(c.deps))), c.task, c.fragment, split,
                          kind != "fwd" and c.forward is not None))
    return units, meshes



def _combining(calls: Sequence[Call]) -> set[int]:
    """Calls that read a later microbatch's result (they combine microbatches)."""
    out = set()
    for i, call in enumerate(calls):
        mb = call.microbatch
        if mb is None:
            continue
        later = [m for d in call.deps if (m := calls[d].microbatch) is not None and m > mb]
        if later:
            out.add(i)
    return out

def _backward_stages(calls: Sequence[Call], stage_of: dict[str, int], mesh_of) -> None:
    """Stages of backward tasks named apart from their forward (``layer0_bwd`` next to
    ``layer0_fwd``, as MultiMesh callbacks name them): their forward's (``Call.forward``,
    which ``mm-match-tasks`` records), else the stage of the forward on the same submesh
    whose results the backward reads (the latest such), else the only stage of that
    submesh."""
    by_mesh: dict[tuple[int, ...], set[int]] = {}
    for c in calls:
        if c.transpose_count and c.forward in stage_of and c.task not in stage_of:
            stage_of[c.task] = stage_of[c.forward]
    for c in calls:
        if c.transpose_count == 0 and c.task in stage_of:
            by_mesh.setdefault(c.devices, set()).add(stage_of[c.task])
    for c in calls:
        if c.transpose_count == 0 or c.microbatch is None or c.task in stage_of:
            continue
        read = [stage_of[calls[d].task] for d in c.deps
                if calls[d].transpose_count == 0 and calls[d].task in stage_of
                and calls[d].devices == c.devices and calls[d].microbatch == c.microbatch]
        if read:
            stage_of[c.task] = max(read)
        elif len(by_mesh.get(c.devices, ())) == 1:
            stage_of[c.task] = next(iter(by_mesh[c.devices]))


def pipeline_units(P: int, M: int, *, interleave: int = 1,
                   split_backward: bool = False) -> list[Unit]:
    """The units of a textbook pipeline: ``P`` submeshes, ``M`` microbatches.

    ``P * interleave`` stages, stage ``k`` on submesh ``k % P`` (task ``stage<k>``);
    per microbatch, in program order, the forwards of every stage, then the
    backwards from the last stage down (each followed by its weight-gradient part
    when ``split_backward``). Backward ``k`` reads backward ``k+1`` and forward ``k``.
    """
    if P < 1 or M < 1 or interleave < 1:
        raise ScheduleError("pipeline_units needs P >= 1, M >= 1 and interleave >= 1")
    S = P * interleave
    units: list[Unit] = []

    def add(kind, m, k, deps, split=False):
        units.append(Unit(len(units), k % P, kind, m, k, tuple(sorted(deps)), f"stage{k}",
                          f"stage{k}_{kind}_{m}", split))
        return len(units) - 1

    for m in range(M):
        f: list[int] = []
        for k in range(S):
            f.append(add("fwd", m, k, [f[-1]] if f else []))
        prev = None
        for k in reversed(range(S)):
            b = add("bwd", m, k, [f[k]] + ([prev] if prev is not None else []), split_backward)
            if split_backward:
                add("bwd_w", m, k, [b, f[k]])
            prev = b
    return units


def unit_label(u: Unit) -> str:
    """The name a custom schedule uses: ``task`` (forward), ``task_bwd``, ``task_bwd_w``;
    a backward task named apart from its forward by a callback keeps its own name
    (``layer0_bwd``, ``layer0_bwd_w``)."""
    if u.kind == "fwd":
        return u.task
    if u.kind == "bwd":
        return u.task if u.own_name else f"{u.task}_bwd"
    if u.kind == "bwd_w":
        return f"{u.task}_w" if u.own_name else f"{u.task}_bwd_w"
    return u.fragment or u.task


def _short(u: Unit) -> str:
    letter = {"fwd": "F", "bwd": "B", "bwd_w": "W"}.get(u.kind, "X")
    return f"{letter}{u.microbatch}" if u.microbatch is not None else f"{letter}*"


def default_cost(u: Unit) -> float:
    """Unit costs: forward 1, weight-gradient part 1, backward 2 (1 when split off)."""
    if u.kind == "bwd":
        return 1.0 if u.split else 2.0
    return 1.0


# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Schedule:
    """Per-submesh dispatch orders of a program's units, and their global merge."""

    name: str
    units: tuple[Unit, ...]
    orders: tuple[tuple[int, ...], ...]  # per submesh, unit indices in dispatch order
    order: tuple[int, ...]  # every unit index once: the global dispatch order
    devices: tuple[tuple[int, ...], ...] = ()  # per submesh, its device list

    @property
    def num_meshes(self) -> int:
        return len(self.orders)

    @property
    def num_microbatches(self) -> int:
        return len({u.microbatch for u in self.units if u.microbatch is not None})

    def rows(self) -> list[list[Unit]]:
        """Per submesh, its units in dispatch order."""
        return [[self.units[i] for i in row] for row in self.orders]

    def labels(self) -> list[list[str]]:
        """Per submesh, ``F3``/``B3``/``W3`` (kind + microbatch) in dispatch order."""
        return [[_short(u) for u in row] for row in self.rows()]

    def timeline(self, cost: Callable[[Unit], float] | None = None,
                 comm: float = 0.0) -> Timeline:
        return simulate(self, cost=cost, comm=comm)

    def bubble_fraction(self, cost: Callable[[Unit], float] | None = None) -> float:
        return self.timeline(cost).bubble_fraction()

    def live_activations(self) -> list[int]:
        return live_activations(self)

    def to_dict(self) -> dict:
        """Plain data, units in global order (the i-th fragment call of the scheduled
        ``@main``); ``deps`` and ``rows`` refer to those positions."""
        pos = {i: k for k, i in enumerate(self.order)}
        units = []
        for i in self.order:
            u = self.units[i]
            d = {"fragment": u.fragment, "task": u.task, "kind": u.kind, "mesh": u.mesh,
                 "deps": sorted(pos[j] for j in u.deps)}
            if u.microbatch is not None:
                d["microbatch"] = u.microbatch
            if u.stage is not None:
                d["stage"] = u.stage
            if u.split:
                d["split"] = True
            units.append(d)
        return {"name": self.name, "submeshes": [list(d) for d in self.devices],
                "units": units, "rows": [[pos[i] for i in row] for row in self.orders]}

    @classmethod
    def from_dict(cls, d: Mapping) -> Schedule:
        units = tuple(
            Unit(k, int(u["mesh"]), str(u["kind"]),
                 int(u["microbatch"]) if "microbatch" in u else None,
                 int(u["stage"]) if "stage" in u else None,
                 tuple(int(x) for x in u.get("deps", ())), str(u.get("task", "")),
                 str(u.get("fragment", "")), bool(u.get("split", False)))
            for k, u in enumerate(d["units"]))
        rows = tuple(tuple(int(x) for x in r) for r in d["rows"])
        return cls(str(d["name"]), units, rows, tuple(range(len(units))),
                   tuple(tuple(int(x) for x in s) for s in d.get("submeshes", ())))


@dataclass(frozen=True)
class Timeline:
    """Start and end time of every unit of a schedule under some cost model."""

    schedule: Schedule
    start: tuple[float, ...]
    end: tuple[float, ...]

    @property
    def makespan(self) -> float:
        return max(self.end, default=0.0)

    def busy(self, mesh: int) -> float:
        return sum(self.end[i] - self.start[i] for i in self.schedule.orders[mesh])

    def bubble_fraction(self) -> float:
        """Idle share of ``num_meshes x makespan`` (GPipe/1F1B: (P-1)/(M+P-1))."""
        g, t = self.schedule.num_meshes, self.makespan
        if g == 0 or t == 0:
            return 0.0
        return 1.0 - sum(self.busy(m) for m in range(g)) / (g * t)

    def stage_bubble_fraction(self) -> float:
        """Idle share of each submesh's own span, from its first unit to its last, summed
        over submeshes: the bubble a submesh sees when steps overlap (ZB-H2's zero)."""
        span = idle = 0.0
        for m, row in enumerate(self.schedule.orders):
            if not row:
                continue
            a = min(self.start[i] for i in row)
            b = max(self.end[i] for i in row)
            span += b - a
            idle += (b - a) - self.busy(m)
        return idle / span if span else 0.0

    def events(self, scale: float = 1.0) -> list[tuple[str, str, float, float]]:
        """``(track, name, start, end)`` per unit, one track per submesh (for trace.py)."""
        out = []
        for m, row in enumerate(self.schedule.orders):
            track = _track_name(self.schedule, m)
            for i in row:
                u = self.schedule.units[i]
                name = f"{u.fragment or u.task} {_short(u)}"
                out.append((track, name, self.start[i] * scale, self.end[i] * scale))
        return out


def _track_name(s: Schedule, m: int) -> str:
    if m < len(s.devices):
        return f"submesh {m} (devices {','.join(str(d) for d in s.devices[m])})"
    return f"submesh {m}"


# ---------------------------------------------------------------------------- names


def canonical_schedule_name(name: str | None, custom=None) -> str:
    """The canonical schedule for a user's ``schedule``/``custom_schedule`` pair."""
    if custom is not None and name not in (None, "custom"):
        raise ScheduleError(
            f"When custom_schedule is provided, schedule must be 'custom' or None, "
            f"but got '{name}'")
    if name is None:
        return "custom" if custom is not None else "gpipe"
    key = str(name).strip().lower()
    key = {a.lower(): t for a, t in ALIASES.items()}.get(key, key)
    if key not in SCHEDULES:
        aliases = alias_list()
        raise ScheduleError(
            f"unknown schedule '{name}'; valid schedules: {', '.join(sorted(SCHEDULES))} "
            f"(aliases: {aliases})")
    return key


# ---------------------------------------------------------------------------- building


class _Program:
    """Index structures over the units shared by the algorithms."""

    def __init__(self, units: Sequence[Unit]):
        _check_units(units)
        self.units = list(units)
        self.num_meshes = max((u.mesh for u in units), default=-1) + 1
        mbs = sorted({u.key[2] for u in units if not u.free})
        self.mb_rank = {m: r for r, m in enumerate(mbs)}
        self.M = len(mbs)
        self.home = home = _homes(units)
        self.stages_of: list[list[int]] = [[] for _ in range(self.num_meshes)]
        for s in sorted(home):
            self.stages_of[home[s]].append(s)
        # Pipeline submeshes (those with stages) ordered by their first stage.
        piped = sorted((m for m in range(self.num_meshes) if self.stages_of[m]),
                       key=lambda m: self.stages_of[m][0])
        self.rank = {m: r for r, m in enumerate(piped)}
        self.P = len(piped)
        # Slot (kind, stage, mb rank) -> units in program order.
        self.slot: dict[tuple[str, int, int], list[int]] = {}
        for u in units:
            if not u.free:
                _, stage, mb = u.key
                self.slot.setdefault((u.kind, stage, self.mb_rank[mb]), []).append(u.index)
        # Activation bookkeeping: (mesh, stage, mb) keys that have a backward.
        self.has_bwd = {(u.mesh, u.stage, u.microbatch) for u in units
                        if not u.free and u.kind in ("bwd", "bwd_w")}


def _check_units(units: Sequence[Unit]) -> None:
    for k, u in enumerate(units):
        if u.index != k:
            raise ScheduleError(f"unit {k} has index {u.index}; units must be in "
                                "program order with index = position")
        if u.kind not in KINDS:
            raise ScheduleError(f"unit {k} has unknown kind '{u.kind}' (one of {KINDS})")
        for d in u.deps:
            if not 0 <= d < len(units) or d == k:
                raise ScheduleError(f"unit {k} depends on invalid unit {d}")


def _homes(units: Sequence[Unit]) -> dict[int, int]:
    """Stage -> home submesh: that of its first forward unit (else its first unit)."""
    home: dict[int, int] = {}
    for u in units:
        if not u.free and u.kind == "fwd":
            home.setdefault(u.key[1], u.mesh)
    for u in units:
        if not u.free:
            home.setdefault(u.key[1], u.mesh)
    return home


def _warmup(P: int, r: int, V: int, total: int) -> int:
    """Forwards before the first backward's steady-state pair (Megatron's formula)."""
    w = (P - r - 1) if V == 1 else (P - r - 1) * 2 + (V - 1) * P
    return max(0, min(w, total))


def _groups(M: int, size: int) -> list[range]:
    """Microbatches in groups of ``size``: interleaving runs every chunk over a group
    before the next group (Megatron's order). A short last group joins the one
    before: a group smaller than the pipeline leaves its submeshes waiting."""
    starts = list(range(0, M, size))
    if len(starts) > 1 and M - starts[-1] < size:
        starts.pop()
    return [range(a, starts[k + 1] if k + 1 < len(starts) else M) for k, a in enumerate(starts)]


def _plan(prog: _Program, name: str, num_stages: int | None,
          with_w: bool = True, extra: int = 0, h2: bool = False,
          unrolling: int | None = None) -> list[list[tuple[str, int, int]]]:
    """Per submesh, the textbook slot order ``(kind, stage, mb rank)``.

    ``h2``: ZB-H2's warm-up, about twice 1F1B's (``2(P - r) - 1`` forwards on the
    ``r``-th pipeline submesh). ``unrolling``: GPipe in groups of that many
    microbatches, each group filling and draining before the next.
    """
    P = num_stages or prog.P
    plans: list[list[tuple[str, int, int]]] = []
    for m in range(prog.num_meshes):
        chunks = prog.stages_of[m]
        if not chunks:
            plans.append([])
        elif name == "gpipe":
            plans.append(_gpipe_plan(chunks, prog.M, unrolling or prog.M, with_w))
        else:  # 1f1b family (also the F/B skeleton of zero-bubble-h1)
            w = _warmup(P, prog.rank[m], len(chunks), prog.M * len(chunks))
            if h2:
                w = 2 * (P - prog.rank[m]) - 1 if len(chunks) == 1 else 2 * w + 1
            plans.append(_1f1b_plan(chunks, prog.M, max(1, prog.P), w + extra, with_w))
    return plans


def _bwd(seq: list[tuple[str, int, int]], s: int, b: int, with_w: bool) -> None:
    seq.append(("bwd", s, b))
    if with_w:
        seq.append(("bwd_w", s, b))


def _gpipe_plan(chunks: list[int], M: int, k: int, with_w: bool) -> list[tuple[str, int, int]]:
    """All forwards of a group of ``k`` microbatches, then their backwards, per group."""
    seq: list[tuple[str, int, int]] = []
    for lo in range(0, M, k):
        group = range(lo, min(M, lo + k))
        for s in chunks:
            seq += [("fwd", s, b) for b in group]
        for s in reversed(chunks):
            for b in group:
                _bwd(seq, s, b, with_w)
    return seq


def _1f1b_plan(chunks: list[int], M: int, group_size: int, warmup: int,
               with_w: bool) -> list[tuple[str, int, int]]:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest
    of the backwards (chunks interleaved in Megatron's microbatch groups)."""
    fseq: list[tuple[int, int]] = []
    bseq: list[tuple[int, int]] = []
    for group in _groups(M, group_size):
        for c in chunks:
            fseq += [(c, b) for b in group]
        for c in reversed(chunks):
            bseq += [(c, b) for b in group]
    total = len(fseq)
    w = min(total, warmup)
    seq: list[tuple[str, int, int]] = [("fwd", s, b) for s, b in fseq[:w]]
    for i in range(total - w):
        s, b = fseq[w + i]
        seq.append(("fwd", s, b))
        _bwd(seq, *bseq[i], with_w)
    for s, b in bseq[total - w:]:
        _bwd(seq, s, b, with_w)
    return seq


def _unit_plans(prog: _Program, slot_plans) -> tuple[list[list[int]], dict[int, int]]:
    """Expand slot plans into unit plans; ``pos[u]`` = rank of ``u`` in its plan.

    Units sit in the plan of the submesh they run on, ordered by the position of
    their slot in the plan of their stage's home submesh (the same thing, unless a
    task changes submesh between microbatches).
    """
    key: dict[int, tuple[int, int]] = {}
    for seq in slot_plans:
        for p, sl in enumerate(seq):
            for i in prog.slot.get(sl, ()):
                key[i] = (p, i)
    plans: list[list[int]] = [[] for _ in range(prog.num_meshes)]
    for i in sorted(key, key=key.__getitem__):
        plans[prog.units[i].mesh].append(i)
    pos = {i: k for row in plans for k, i in enumerate(row)}
    return plans, pos


class _Sim:
    """Event simulator: each idle submesh asks ``choose`` for a unit among its ready ones."""

    def __init__(self, prog: _Program, cost: Callable[[Unit], float], comm: float = 0.0):
        self.prog = prog
        self.cost = cost
        self.comm = comm
        n = len(prog.units)
        self.left = [len(set(u.deps)) for u in prog.units]
        self.users: list[list[int]] = [[] for _ in range(n)]
        for u in prog.units:
            for d in set(u.deps):
                self.users[d].append(u.index)
        self.start: list[float | None] = [None] * n
        self.end: list[float | None] = [None] * n
        self.done = [False] * n
        self.ready: list[set[int]] = [set() for _ in range(prog.num_meshes)]
        self.pending: list[tuple[float, int]] = []  # (available time, unit)
        self.orders: list[list[int]] = [[] for _ in range(prog.num_meshes)]
        # live activation keys per submesh, counted at dispatch
        self.bwd_left: dict[tuple[int, int, int], int] = {}
        for u in prog.units:
            if not u.free and u.kind in ("bwd", "bwd_w"):
                self.bwd_left[u.key] = self.bwd_left.get(u.key, 0) + 1
        self.live = [0] * prog.num_meshes
        self.peak = [0] * prog.num_meshes
        self.opened: set[tuple[int, int, int]] = set()
        for u in prog.units:
            if self.left[u.index] == 0:
                self.ready[u.mesh].add(u.index)

    def dispatch(self, i: int, t: float) -> None:
        u = self.prog.units[i]
        self.ready[u.mesh].discard(i)
        c = float(self.cost(u))
        if not c > 0:
            raise ScheduleError(f"cost of unit {i} must be positive, got {c}")
        self.start[i], self.end[i] = t, t + c
        self.orders[u.mesh].append(i)
        if not u.free:
            k = (u.mesh, u.stage, u.microbatch)
            if u.kind == "fwd" and k in self.bwd_left and k not in self.opened:
                self.opened.add(k)
                self.live[u.mesh] += 1
                self.peak[u.mesh] = max(self.peak[u.mesh], self.live[u.mesh])
            elif u.kind in ("bwd", "bwd_w") and k in self.bwd_left:
                self.bwd_left[k] -= 1
                if self.bwd_left[k] == 0 and k in self.opened:
                    self.live[u.mesh] -= 1

    def run(self, choose, stall) -> None:
        n = len(self.prog.units)
        self.free_at = [0.0] * self.prog.num_meshes
        self.running: list[tuple[float, int]] = []
        t = 0.0
        finished = 0
        while finished < n:
            self._fill(t, choose)
            times = [x for x in (self.running[0][0] if self.running else None,
                                 self.pending[0][0] if self.pending else None)
                     if x is not None]
            if not times:
                if any(self.ready):
                    self._start(stall(), t)
                    continue
                raise ScheduleError("the units' dependencies form a cycle")
            t = max(t, min(times))
            finished += self._complete(t)
            while self.pending and self.pending[0][0] <= t:
                _, j = heapq.heappop(self.pending)
                self.ready[self.prog.units[j].mesh].add(j)

    def _start(self, i: int, t: float) -> None:
        self.dispatch(i, t)
        end = self.end[i]
        assert end is not None
        self.free_at[self.prog.units[i].mesh] = end
        heapq.heappush(self.running, (end, i))

    def _fill(self, t: float, choose) -> None:
        """Give every idle submesh work at time ``t`` until none takes any more."""
        progress = True
        while progress:
            progress = False
            for m in range(self.prog.num_meshes):
                if self.free_at[m] <= t and self.ready[m]:
                    i = choose(m, self.ready[m])
                    if i is not None:
                        self._start(i, t)
                        progress = True

    def _complete(self, t: float) -> int:
        """Finish the units done by ``t``; their users become pending once all their
        inputs are done (and, across submeshes, sent). Returns how many finished."""
        units = self.prog.units
        finished = 0
        while self.running and self.running[0][0] <= t:
            _, i = heapq.heappop(self.running)
            self.done[i] = True
            finished += 1
            for j in self.users[i]:
                self.left[j] -= 1
                if self.left[j] == 0:
                    avail = max(self._end(d) + (self.comm if units[d].mesh != units[j].mesh
                                                else 0.0)
                                for d in set(units[j].deps))
                    heapq.heappush(self.pending, (avail, j))
        return finished

    def times(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Start and end of every unit, once all have run."""
        start = tuple(x for x in self.start if x is not None)
        end = tuple(x for x in self.end if x is not None)
        assert len(start) == len(end) == len(self.start), "not every unit ran"
        return start, end

    def _end(self, i: int) -> float:
        end = self.end[i]
        assert end is not None
        return end


def _run_plans(prog: _Program, plans: list[list[int]], pos: dict[int, int], *,
               strict: bool, cost, comm: float = 0.0, name: str = "",
               chooser=None) -> _Sim:
    sim = _Sim(prog, cost, comm)
    heads = [0] * prog.num_meshes
    placed = set()

    def head(m):
        row = plans[m]
        while heads[m] < len(row) and row[heads[m]] in placed:
            heads[m] += 1
        return row[heads[m]] if heads[m] < len(row) else None

    def take(i):
        placed.add(i)
        return i

    def choose(m, ready):
        free = [i for i in ready if i not in pos]
        if free:
            return take(min(free))
        if chooser is not None:
            i = chooser(sim, m, ready, head(m))
            return None if i is None else take(i)
        h = head(m)
        return take(h) if h is not None and h in ready else None

    def stall():
        if strict:
            raise _deadlock(prog, plans, heads, placed, name)
        cands = [i for r in sim.ready for i in r]
        return take(min(cands, key=lambda i: (pos.get(i, -1), i)))

    sim.run(choose, stall)
    return sim


def _deadlock(prog: _Program, plans, heads, placed, name) -> ScheduleError:
    for m, row in enumerate(plans):
        k = heads[m]
        while k < len(row) and row[k] in placed:
            k += 1
        if k >= len(row):
            continue
        u = prog.units[row[k]]
        for d in u.deps:
            if d not in placed:
                v = prog.units[d]
                return ScheduleError(
                    f"{name or 'the'} schedule deadlocks: row {m} runs '{unit_label(u)}' "
                    f"microbatch {u.microbatch} before its input '{unit_label(v)}' "
                    f"microbatch {v.microbatch} (row {v.mesh}) can be computed")
    return ScheduleError(f"{name or 'the'} schedule deadlocks")


def _finish(prog: _Program, name: str, sim: _Sim,
            devices: Sequence[Sequence[int]] | None) -> Schedule:
    order = sorted(range(len(prog.units)),
                   key=lambda i: (sim.start[i], prog.units[i].mesh, i))
    devs = tuple(tuple(d) for d in devices) if devices is not None else ()
    return Schedule(name, tuple(prog.units), tuple(tuple(r) for r in sim.orders),
                    tuple(order), devs)


def build_schedule(units: Sequence[Unit], name: str | None = "gpipe", *,
                   num_stages: int | None = None, interleave: int | None = None,
                   custom: Sequence[Sequence] | None = None,
                   devices: Sequence[Sequence[int]] | None = None,
                   unrolling: int | None = None) -> Schedule:
    """Schedule ``units`` (program order) with the named algorithm.

    ``num_stages``: pipeline depth used for 1F1B's warm-up (default: the number of
    submeshes with stages); a larger value runs more forwards before the first
    backward. ``interleave``: if given, every pipeline submesh must run exactly that
    many stages. ``custom``: one row per submesh (see :func:`canonicalize_custom_schedule`).
    ``devices``: per submesh device lists, kept for display. ``unrolling`` (GPipe only):
    fill and drain the pipeline in groups of that many microbatches.
    """
    key = canonical_schedule_name(name, custom)
    prog = _Program(units)
    _check_options(prog, key, num_stages, interleave, unrolling)
    if key in PLACEMENTS:
        return _placed_schedule(prog, key, num_stages, devices)
    if key == "custom":
        if custom is None:
            raise ScheduleError("schedule 'custom' needs a custom_schedule")
        plans, pos = _custom_plans(prog, custom)
        sim = _run_plans(prog, plans, pos, strict=True, cost=default_cost, name="custom")
        return _finish(prog, key, sim, devices)
    if key in ("zero-bubble-h1", "zero-bubble-h2"):
        return _zero_bubble(prog, num_stages, devices, h2=key == "zero-bubble-h2")
    algo = "gpipe" if key == "gpipe" else "1f1b"
    plans, pos = _feasible_plans(prog, algo, num_stages, unrolling=unrolling)
    sim = _run_plans(prog, plans, pos, strict=False, cost=default_cost, name=key)
    return _finish(prog, key, sim, devices)



def _check_options(prog: _Program, key: str, num_stages: int | None,
                   interleave: int | None, unrolling: int | None) -> None:
    if unrolling is not None:
        if key != "gpipe":
            raise ScheduleError(
                f"unrolling={unrolling} applies to the gpipe schedule only, not '{key}'")
        if unrolling < 1:
            raise ScheduleError(f"unrolling must be >= 1, got {unrolling}")
    if num_stages is not None and num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if interleave is None:
        return
    if interleave < 1:
        raise ScheduleError(f"interleave must be >= 1, got {interleave}")
    for m in range(prog.num_meshes):
        if prog.stages_of[m] and len(prog.stages_of[m]) != interleave:
            raise ScheduleError(
                f"interleave={interleave}, but submesh {m} runs "
                f"{len(prog.stages_of[m])} pipeline stage(s) (stages {prog.stages_of[m]})")

def _feasible_plans(prog: _Program, algo: str, num_stages: int | None, with_w: bool = True,
                    h2: bool = False, unrolling: int | None = None):
    """The textbook plans; for 1F1B, with the warm-up lengthened just enough that the
    plans can run as written (interleaving with a microbatch count that the number of
    submeshes does not divide needs this; a warm-up of everything is GPipe, which
    always runs). Programs no warm-up fixes fall back to the simulator's repair."""
    longest = max((len(s) for s in prog.stages_of), default=0) * max(prog.M, 1)
    first = None
    for extra in range(0, longest + 1 if algo == "1f1b" else 1):
        plans, pos = _unit_plans(prog, _plan(prog, algo, num_stages, with_w, extra, h2,
                                             unrolling))
        first = first or (plans, pos)
        try:
            _run_plans(prog, plans, pos, strict=True, cost=default_cost)
        except ScheduleError:
            continue
        return plans, pos
    return first


def _zero_bubble(prog: _Program, num_stages, devices, h2: bool = False) -> Schedule:
    """ZB-H1: 1F1B's order of forwards and (activation-)backwards; each weight-gradient
    part runs in the first slot where its submesh would otherwise idle, or earlier when
    deferring it would make the submesh hold more activations than 1F1B's peak on any
    submesh (ZB-H1's memory bound: the first stage's P). ZB-H2 (Qi et al.): the same
    with about twice 1F1B's warm-up, so the forwards fill the start-up bubble, under
    twice that memory bound."""
    ref = _run_plans(prog, *_feasible_plans(prog, "1f1b", num_stages),
                     strict=False, cost=default_cost)
    limit = [max(ref.peak, default=0) * (2 if h2 else 1)] * prog.num_meshes
    plans, pos = _feasible_plans(prog, "1f1b", num_stages, with_w=False, h2=h2)
    w_pool = {u.index for u in prog.units if not u.free and u.kind == "bwd_w"}
    for i in w_pool:
        pos[i] = -1  # scheduled by the chooser, not free

    def chooser(sim: _Sim, m: int, ready: set[int], h: int | None):
        ws = sorted((i for i in ready if i in w_pool),
                    key=lambda i: (prog.mb_rank[prog.units[i].key[2]],
                                   -prog.units[i].key[1], i))
        if h is not None and h in ready:
            u = prog.units[h]
            opens = (u.kind == "fwd" and (u.mesh, u.stage, u.microbatch) in prog.has_bwd
                     and (u.mesh, u.stage, u.microbatch) not in sim.opened)
            if opens and ws and sim.live[m] + 1 > limit[m]:
                return ws[0]
            return h
        return ws[0] if ws else None

    name = "zero-bubble-h2" if h2 else "zero-bubble-h1"
    sim = _run_plans(prog, plans, pos, strict=False, cost=default_cost, name=name,
                     chooser=chooser)
    return _finish(prog, name, sim, devices)


# ---------------------------------------------------------------------------- custom


def canonicalize_custom_schedule(rows: Sequence[Sequence], num_microbatches: int
                                 ) -> list[list[tuple[int, str]]]:
    """Rows of ``name`` or ``(microbatch, name)`` -> rows of ``(microbatch, name)``.

    A bare ``name`` is that name's next microbatch in the row (its 1st occurrence
    is microbatch 0, ...; the smallest one not yet listed). Checks the form only
    (types, microbatch range, repeats): whether each name is a task of its row's
    submesh, and occurs once per microbatch, is checked against the program
    (:func:`build_schedule`), so a misspelt name is reported as such, not as a count.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ScheduleError("custom_schedule must be a list of rows (one per submesh), "
                            f"got {type(rows).__name__}")
    return [_canonical_row(r, row, num_microbatches) for r, row in enumerate(rows)]


def _canonical_row(r: int, row, num_microbatches: int) -> list[tuple[int, str]]:
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
        raise ScheduleError(f"custom_schedule row {r} must be a list of entries, got {row!r}")
    seen: dict[str, set[int]] = {}
    canon = []
    for k, e in enumerate(row):
        mb, name = _canonical_entry(r, k, e, seen)
        if not 0 <= mb < num_microbatches:
            raise ScheduleError(
                f"custom_schedule row {r}: microbatch {mb} of task '{name}' is out of "
                f"range (there are {num_microbatches} microbatches)")
        if mb in seen.setdefault(name, set()):
            raise ScheduleError(
                f"task '{name}' appears twice for microbatch {mb} in custom_schedule row {r}")
        seen[name].add(mb)
        canon.append((mb, name))
    return canon


def _canonical_entry(r: int, k: int, e, seen: dict[str, set[int]]) -> tuple[int, str]:
    """``name`` (its next microbatch in the row) or ``(microbatch, name)``."""
    if isinstance(e, str):
        mb = 0
        while mb in seen.get(e, ()):
            mb += 1
        return mb, e
    if (isinstance(e, Sequence) and len(e) == 2 and isinstance(e[1], str)
            and isinstance(e[0], int) and not isinstance(e[0], bool)):
        return int(e[0]), e[1]
    raise ScheduleError(
        f"custom_schedule row {r} entry {k} must be a task name or a "
        f"(microbatch, name) pair, got {e!r}")

def _custom_plans(prog: _Program, custom) -> tuple[list[list[int]], dict[int, int]]:
    rows = canonicalize_custom_schedule(custom, prog.M)
    if len(rows) != prog.num_meshes:
        raise ScheduleError(
            f"custom_schedule has {len(rows)} rows for {prog.num_meshes} submeshes; give one "
            f"row per submesh, in the order the program first uses them")
    by_label: list[dict[str, dict[int, list[int]]]] = [{} for _ in range(prog.num_meshes)]
    for u in prog.units:
        if not u.free:
            by_label[u.mesh].setdefault(unit_label(u), {}).setdefault(
                prog.mb_rank[u.key[2]], []).append(u.index)
    for r, row in enumerate(rows):
        _check_custom_row(r, row, by_label, prog.M)
    plans: list[list[int]] = []
    for r, row in enumerate(rows):
        plan = []
        for mb, name in row:
            plan += by_label[r][name].get(mb, [])
        plans.append(plan)
    pos = {i: k for row in plans for k, i in enumerate(row)}
    return plans, pos


def _check_custom_row(r: int, row: list[tuple[int, str]], by_label: list[dict], M: int) -> None:
    """Row ``r`` names only tasks of submesh ``r`` (a misspelling is named, with its
    entry and the valid names), each once per microbatch."""
    labels = by_label[r]
    for k, (_, name) in enumerate(row):
        if name in labels:
            continue
        known = ", ".join(sorted(labels)) or "none"
        elsewhere = [m for m, other in enumerate(by_label) if name in other]
        close = difflib.get_close_matches(name, list(labels), n=1)
        hint = (f"; it runs on submesh {elsewhere[0]}" if elsewhere else
                f"; did you mean '{close[0]}'?" if close else "")
        raise ScheduleError(
            f"custom_schedule row {r} entry {k} names '{name}', which is not a task of "
            f"submesh {r} (its tasks: {known}){hint}")
    for name in sorted(labels):
        count = sum(1 for _, n in row if n == name)
        if count != M:
            raise ScheduleError(
                f"task '{name}' has {count} microbatches in custom_schedule row {r}, but "
                f"there are {M} microbatches (each task once per microbatch)")


# ---------------------------------------------------------------------------- analysis


def simulate(schedule: Schedule, *, cost: Callable[[Unit], float] | None = None,
             comm: float = 0.0) -> Timeline:
    """Run the schedule's per-submesh orders: a unit starts when its submesh is free and
    its inputs are done (``comm`` later when they come from another submesh)."""
    prog = _Program(schedule.units)
    plans = [list(r) for r in schedule.orders]
    pos = {i: k for row in plans for k, i in enumerate(row)}
    missing = set(range(len(schedule.units))) - set(pos)
    if missing:
        raise ScheduleError(f"schedule does not place units {sorted(missing)}")
    sim = _run_plans(prog, plans, pos, strict=True, cost=cost or default_cost, comm=comm,
                     name=schedule.name)
    return Timeline(schedule, *sim.times())


def live_activation_profile(schedule: Schedule) -> list[list[int]]:
    """Per submesh, the number of live activations after each of its dispatches.

    An activation ``(stage, microbatch)`` is live from its first forward unit until its
    last backward unit (weight-gradient part included) on that submesh; stages
    without a backward hold nothing, and neither does a microbatch whose backward
    all ran before its forward (a backward that reads no residual, e.g. of a loss
    with a constant cotangent). Counted in dispatch order.
    """
    out = []
    bwd_total: dict[tuple[int, int, int], int] = {}
    for u in schedule.units:
        if not u.free and u.kind in ("bwd", "bwd_w"):
            bwd_total[u.key] = bwd_total.get(u.key, 0) + 1
    for row in schedule.rows():
        live, prof = 0, []
        opened: set[tuple[int, int, int]] = set()
        seen: dict[tuple[int, int, int], int] = {}
        for u in row:
            if not u.free:
                k = u.key
                if u.kind == "fwd" and k in bwd_total and k not in opened:
                    opened.add(k)
                    if seen.get(k, 0) < bwd_total[k]:  # some backward still to come
                        live += 1
                elif u.kind in ("bwd", "bwd_w") and k in bwd_total:
                    seen[k] = seen.get(k, 0) + 1
                    if seen[k] == bwd_total[k] and k in opened:
                        live -= 1
            prof.append(live)
        out.append(prof)
    return out


def live_activations(schedule: Schedule) -> list[int]:
    """Peak live activations per submesh (1F1B: at most P; GPipe: M)."""
    return [max(p, default=0) for p in live_activation_profile(schedule)]


def theoretical_bubble(name: str, P: int, M: int, interleave: int = 1) -> float | None:
    """Textbook bubble fraction with this module's unit costs.

    GPipe and 1F1B: (P-1)/(M+P-1); interleaved 1F1B with V stages per submesh:
    (P-1)/(V*M+P-1); ZB-H1 (forward, activation- and weight-gradient halves all
    cost 1): the paper's bubble (P-1)(F+B-W) over a step of 3M+(P-1), i.e.
    (P-1)/(3M+P-1); ZB-H2 the same over one step (its gain is inside each submesh's
    span, :meth:`Timeline.stage_bubble_fraction`, which is 0); the schedules with a
    placement rule: :func:`_placed_bubble`. None where there is no closed form
    (custom).
    """
    key = canonical_schedule_name(name)
    if key in ("gpipe", "1f1b") and interleave == 1:
        return (P - 1) / (M + P - 1)
    if key in ("1f1b", "interleaved-1f1b"):
        return (P - 1) / (interleave * M + P - 1)
    if key in ("zero-bubble-h1", "zero-bubble-h2") and interleave == 1:
        return (P - 1) / (3 * M + P - 1)
    return _placed_bubble(key, P, M, interleave)


# ---------------------------------------------------------------------------- text Gantt


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
            return _short(u) + "abcdefghijklmnopqrstuvwxyz"[chunk[u.index] % 26]
        return _short(u)

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


def chunk_of(schedule: Schedule) -> dict[int, int]:
    """Per pipeline unit, which of its submesh's stages it belongs to (0 = the first);
    non-zero only under interleaving."""
    stages: dict[int, set[int]] = {}
    for u in schedule.units:
        if not u.free:
            stages.setdefault(u.mesh, set()).add(u.key[1])
    rank = {m: {st: k for k, st in enumerate(sorted(ss))} for m, ss in stages.items()}
    return {u.index: rank[u.mesh][u.key[1]] for u in schedule.units if not u.free}


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



# ---------------------------------------------------------------------------- placed schedules
#
# Schedules that assume a stage placement (docs/schedules.md): each checks that the
# program's stages sit where it needs them, writes its textbook slot plan per submesh
# and runs it through the simulator like the others.

PLACEMENTS = {
    "eager-1f1b": "contiguous",
    "gpipe-1f1b-last": "contiguous",
    "interleaved-gpipe": "round-robin",
    "circular-reversed-backward": "round-robin",
    "dualpipe-v": "v-shape",
}
"""The stage placement each of these schedules needs: ``contiguous`` (one stage per
submesh, stage k on the k-th submesh), ``round-robin`` (stage k on submesh k % P, the
same number of stages on every submesh) or ``v-shape`` (2P stages, stage i and stage
2P - 1 - i on submesh i)."""

_PLACEMENT_TEXT = {
    "contiguous": "one pipeline stage per submesh (contiguous placement: consecutive "
                  "layers on one submesh, stage k on the k-th submesh)",
    "round-robin": "round-robin placement (stage k on submesh k % P for P pipeline "
                   "submeshes, every submesh running the same number of stages)",
    "v-shape": "V-shape placement (2P stages on P submeshes: stage i and stage 2P - 1 - i "
               "on submesh i, so the forward goes down the submeshes and back up)",
}


def check_placement(units: Sequence[Unit], name: str) -> None:
    """Raise :class:`ScheduleError` when the stages of ``units`` are not placed as the
    schedule ``name`` needs (:data:`PLACEMENTS`); other schedules take any placement."""
    key = canonical_schedule_name(name)
    if key in PLACEMENTS:
        _check_placement(_Program(units), key)


def _check_placement(prog: _Program, key: str) -> None:
    rule = PLACEMENTS[key]
    piped = sorted(prog.rank, key=prog.rank.__getitem__)
    counts = {m: len(prog.stages_of[m]) for m in piped}
    wrong = None
    if rule == "v-shape":
        wrong = _v_shape_mismatch(prog, piped)
    elif rule == "contiguous":
        m = next((m for m in piped if counts[m] != 1), None)
        if m is not None:
            wrong = f"submesh {m} runs {counts[m]} stages (stages {prog.stages_of[m]})"
    elif len(set(counts.values())) > 1:
        m = max(piped, key=counts.__getitem__)
        wrong = (f"submesh {m} runs {counts[m]} stages (stages {prog.stages_of[m]}) and "
                 f"submesh {min(piped, key=counts.__getitem__)} runs fewer")
    else:
        for k, stage in enumerate(sorted(prog.home)):
            if piped and prog.home[stage] != piped[k % len(piped)]:
                wrong = (f"stage {stage} runs on submesh {prog.home[stage]}, where "
                         f"round-robin puts it on submesh {piped[k % len(piped)]}")
                break
    if wrong is not None:
        raise ScheduleError(
            f"schedule '{key}' needs {_PLACEMENT_TEXT[rule]}, but {wrong}; place the "
            f"tasks that way, or choose a schedule without a placement rule (gpipe, 1f1b)")


def _v_shape_mismatch(prog: _Program, piped: list[int]) -> str | None:
    """Why the stages do not go down the submeshes and back up, if they do not. The
    turning submesh's two stages follow each other, so they may be one stage."""
    seq = [prog.home[st] for st in sorted(prog.home)]
    visits = [m for k, m in enumerate(seq) if k == 0 or seq[k - 1] != m]
    want = piped + piped[-2::-1]
    if visits == want:
        return None
    return f"its stages run on submeshes {visits} in order, where V-shape needs {want}"


def _placed_schedule(prog: _Program, key: str, num_stages: int | None,
                     devices) -> Schedule:
    _check_placement(prog, key)
    if key == "dualpipe-v" and 2 <= prog.P and prog.M < 2 * prog.P:
        raise ScheduleError(
            f"schedule 'dualpipe-v' needs at least 2P = {2 * prog.P} microbatches for "
            f"{prog.P} pipeline submeshes, but there are {prog.M}; use more microbatches "
            f"(a smaller microbatch size) or another schedule")
    plans, pos = _unit_plans(prog, _placed_plans(prog, key, num_stages))
    sim = _run_plans(prog, plans, pos, strict=False, cost=default_cost, name=key)
    return _finish(prog, key, sim, devices)


def _placed_plans(prog: _Program, key: str, num_stages: int | None
                  ) -> list[list[tuple[str, int, int]]]:
    """Per submesh, the slot order of ``key`` (:data:`PLACEMENTS`'s schedules)."""
    P = max(1, prog.P)
    plans: list[list[tuple[str, int, int]]] = []
    for m in range(prog.num_meshes):
        chunks = prog.stages_of[m]
        r = prog.rank.get(m, 0)
        total = prog.M * len(chunks)
        if not chunks:
            plans.append([])
        elif key == "eager-1f1b":  # 2(P - r) - 1 forwards before the first backward
            warm = 2 * ((num_stages or P) - r) - 2
            plans.append(_1f1b_plan(chunks, prog.M, P, max(0, min(total, warm)), True))
        elif key == "gpipe-1f1b-last":  # the last submesh: F0 B0 F1 B1 ...
            plans.append(_1f1b_plan(chunks, prog.M, P, 0, True) if r == P - 1
                         else _gpipe_plan(chunks, prog.M, prog.M, True))
        elif key == "interleaved-gpipe":  # every forward in Megatron's groups, then backwards
            plans.append(_1f1b_plan(chunks, prog.M, P, total, True))
        elif key == "dualpipe-v":
            plans.append(_dualpipe_v_plan(r, P, prog.M, chunks[0], chunks[-1]))
        else:  # circular-reversed-backward: the backwards mirror the forwards
            fwd = [sl for sl in _1f1b_plan(chunks, prog.M, P, total, False) if sl[0] == "fwd"]
            seq = list(fwd)
            for _, st, b in reversed(fwd):
                _bwd(seq, st, b, True)
            plans.append(seq)
    return plans


def _dualpipe_v_ops(r: int, P: int, M: int) -> list[tuple]:
    """DualPipeV's eight steps on the ``r``-th of ``P`` submeshes (deepseek-ai/DualPipe,
    ``dualpipev.py``): ``("F", chunk)``, ``("B", chunk, defer_w)``, ``("W",)``. Chunk 0
    is the submesh's stage on the way down, chunk 1 its stage on the way back up; a
    backward with ``defer_w`` leaves its weight part to a later ``W`` (oldest first)."""
    ops: list[tuple] = [("F", 0)] * (2 * (P - r - 1))            # 1: nF0
    ops += [("F", 0), ("F", 1)] * (r + 1)                        # 2: nF0F1
    ops += [("B", 1, True), ("W",), ("F", 1)] * (P - r - 1)      # 3: nB1W1F1
    ops += [("F", 0), ("B", 1, False), ("F", 1), ("B", 0, False)] * (M - 2 * P + r + 1)  # 4
    ops += [("B", 1, False), ("F", 1), ("B", 0, False)] * (P - r - 1)  # 5: nB1F1B0
    defer = False
    for i in range(r + 1):                                       # 6: nB1B0
        defer = defer or (i == (r + 1) // 2 and r % 2 == 1)
        ops.append(("B", 1, defer))
        defer = defer or (i == (r + 1) // 2 and r % 2 == 0)
        ops.append(("B", 0, defer))
    ops += [("W",), ("B", 0, True)] * (P - r - 1)                # 7: nWB0
    return ops + [("W",)] * (r + 1)                              # 8: nW


def _dualpipe_v_plan(r: int, P: int, M: int, down: int, up: int
                     ) -> list[tuple[str, int, int]]:
    """The slots of :func:`_dualpipe_v_ops`; on the turning submesh the two stages may
    be one (they run back to back), which then sits where its first chunk does."""
    stage, nf, nb = (down, up), [0, 0], [0, 0]
    waiting: list[tuple[int, int]] = []
    seq: list[tuple[str, int, int]] = []
    for op in _dualpipe_v_ops(r, P, M):
        if op[0] == "F":
            seq.append(("fwd", stage[op[1]], nf[op[1]]))
            nf[op[1]] += 1
        elif op[0] == "B":
            sl = (stage[op[1]], nb[op[1]])
            nb[op[1]] += 1
            seq.append(("bwd", *sl))
            if op[2]:
                waiting.append(sl)
            else:
                seq.append(("bwd_w", *sl))
        else:
            seq.append(("bwd_w", *waiting.pop(0)))
    return list(dict.fromkeys(seq))


def v_shape_units(P: int, M: int, *, split_backward: bool = True) -> list[Unit]:
    """:func:`pipeline_units` with ``2P`` stages placed in a V: stage ``k`` on submesh
    ``k`` for ``k < P`` and on ``2P - 1 - k`` after (DualPipeV's placement)."""
    units = pipeline_units(P, M, interleave=2, split_backward=split_backward)
    return [replace(u, mesh=k if (k := u.stage or 0) < P else 2 * P - 1 - k) for u in units]


def _placed_bubble(key: str, P: int, M: int, V: int) -> float | None:
    """Unit-cost bubble of the placed schedules (docs/schedules.md derives each).

    Eager 1F1B and GPipe with 1F1B on the last submesh: (P-1)/(M+P-1), as GPipe and
    1F1B (the extra warm-up forwards and the last submesh's order move no unit of
    the critical path). Interleaved GPipe and circular with reversed backward, V
    stages per submesh and P dividing M: (P-1)/(VM+P-1), as interleaved 1F1B.
    DualPipeV (2P half-size stages, split backwards, M >= 2P): the lower bound
    (P-1)/(6M+P-1).
    """
    if key in ("eager-1f1b", "gpipe-1f1b-last") and V == 1:
        return (P - 1) / (M + P - 1)
    if key in ("interleaved-gpipe", "circular-reversed-backward") and M % P == 0:
        return (P - 1) / (V * M + P - 1)
    if key == "dualpipe-v" and M >= 2 * P:  # 6M half-stage units each, the last starts at P-1
        return (P - 1) / (6 * M + P - 1)
    return None


def theoretical_peak_live(name: str, P: int, M: int, interleave: int = 1) -> int | None:
    """The most (stage, microbatch) activations one submesh holds, by the textbook.

    GPipe: M; 1F1B and ZB-H1: min(P, M) (submesh 0); ZB-H2: min(2P, M); interleaved
    1F1B (P dividing M): Megatron's warm-up plus one, min((V+1)P - 1, VM); eager 1F1B: min(2P - 1,
    M); GPipe with 1F1B on the last submesh: M (1 on the last submesh); interleaved
    GPipe and circular with reversed backward: every forward before any backward, VM;
    DualPipeV (M >= 2P): 2P + 1 half-size activations, its warm-up's 2P and the forward
    that each steady-state pair runs before its backward.
    """
    key = canonical_schedule_name(name)
    V = interleave
    one = V == 1
    megatron = min((V + 1) * P - 1, V * M) if M % P == 0 else None
    table = {"gpipe": M if one else None, "1f1b": min(P, M) if one else megatron,
             "interleaved-1f1b": megatron,
             "zero-bubble-h1": min(P, M) if one else None,
             "zero-bubble-h2": min(2 * P, M) if one else None,
             "eager-1f1b": min(2 * P - 1, M) if one else None,
             "gpipe-1f1b-last": (M if P > 1 else 1) if one else None,
             "interleaved-gpipe": V * M, "circular-reversed-backward": V * M,
             "dualpipe-v": 2 * P + 1 if M >= 2 * P else None}
    return table.get(key)
