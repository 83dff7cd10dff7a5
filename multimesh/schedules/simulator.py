"""The event simulator, the schedule value and what is measured on it (no MLIR),
under unit costs or real ones (:func:`predict`; ``costs`` compares schedules with it).

Every algorithm writes a *plan* per submesh and runs it through :class:`Sim` with unit
costs; the simulator only ever starts a unit whose inputs are done, so a plan that a
strange program makes impossible degrades into the nearest order that works instead
of deadlocking (a custom schedule raises instead). The global order is the units
sorted by their simulated start time, a topological merge of the per-submesh orders.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .model import KINDS, ScheduleError, Unit, default_cost, short_label, unit_label

__all__ = ["Schedule", "Timeline", "Program", "Sim", "unit_plans", "run_plans", "finish",
           "simulate", "live_activation_profile", "live_activations", "chunk_of",
           "FragmentCosts", "as_cost", "Prediction", "predict", "time_text", "bytes_text",
           "Comm"]

Comm = float | Callable[[Unit, Unit], float]
"""Seconds per transfer between submeshes: one figure, or a function of the sending
and the receiving unit (what their edge moves, priced by the caller's hardware model)."""


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
        return [[short_label(u) for u in row] for row in self.rows()]

    def timeline(self, cost: Callable[[Unit], float] | None = None,
                 comm: Comm = 0.0) -> Timeline:
        return simulate(self, cost=cost, comm=comm)

    def bubble_fraction(self, cost: Callable[[Unit], float] | None = None) -> float:
        return self.timeline(cost).bubble_fraction()

    def live_activations(self) -> list[int]:
        return live_activations(self)

    def simulate(self, costs=None, *, residual_bytes=None, comm: Comm = 0.0):
        """Predicted step time, bubble and peak memory per submesh under ``costs``:
        a :class:`~multimesh.schedules.costs.Prediction` (see :func:`.costs.predict`)."""
        return predict(self, costs, residual_bytes=residual_bytes, comm=comm)

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
                name = f"{u.fragment or u.task} {short_label(u)}"
                out.append((track, name, self.start[i] * scale, self.end[i] * scale))
        return out


def _track_name(s: Schedule, m: int) -> str:
    if m < len(s.devices):
        return f"submesh {m} (devices {','.join(str(d) for d in s.devices[m])})"
    return f"submesh {m}"


class Program:
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


def unit_plans(prog: Program, slot_plans) -> tuple[list[list[int]], dict[int, int]]:
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


class Sim:
    """Event simulator: each idle submesh asks ``choose`` for a unit among its ready ones."""

    def __init__(self, prog: Program, cost: Callable[[Unit], float], comm: Comm = 0.0):
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
        raw = self.cost(u)
        if isinstance(raw, (bool, str, bytes)) or not hasattr(raw, "__float__"):
            raise ScheduleError(f"cost of unit {i} ({u.fragment or short_label(u)} on "
                                f"submesh {u.mesh}) must be a number of seconds, got "
                                f"{type(raw).__name__} {raw!r}")
        c = float(raw)
        if not 0 < c < math.inf:
            raise ScheduleError(f"cost of unit {i} ({u.fragment or short_label(u)} on "
                                f"submesh {u.mesh}) must be a positive finite duration, "
                                f"got {c}")
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
                    avail = max(self._end(d) + self._sent(units[d], units[j])
                                for d in set(units[j].deps))
                    heapq.heappush(self.pending, (avail, j))
        return finished

    def _sent(self, src: Unit, dst: Unit) -> float:
        """Seconds from ``src``'s end until ``dst`` has its result: none on the same
        submesh, else ``comm`` (seconds, or ``comm(src, dst)``)."""
        if src.mesh == dst.mesh:
            return 0.0
        return float(self.comm(src, dst)) if callable(self.comm) else self.comm

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


def run_plans(prog: Program, plans: list[list[int]], pos: dict[int, int], *,
               strict: bool, cost, comm: Comm = 0.0, name: str = "",
               chooser=None) -> Sim:
    sim = Sim(prog, cost, comm)
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


def _deadlock(prog: Program, plans, heads, placed, name) -> ScheduleError:
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


def finish(prog: Program, name: str, sim: Sim,
            devices: Sequence[Sequence[int]] | None) -> Schedule:
    order = sorted(range(len(prog.units)),
                   key=lambda i: (sim.start[i], prog.units[i].mesh, i))
    devs = tuple(tuple(d) for d in devices) if devices is not None else ()
    return Schedule(name, tuple(prog.units), tuple(tuple(r) for r in sim.orders),
                    tuple(order), devs)


def check_comm(comm) -> None:
    """``comm``, the seconds per transfer between submeshes: a finite number >= 0, or
    a function of the two units (a hardware model's price of the bytes they move)."""
    if callable(comm):
        return
    if isinstance(comm, bool) or not isinstance(comm, (int, float)) or not 0 <= comm < math.inf:
        raise ScheduleError(f"comm (seconds per transfer between submeshes) must be a "
                            f"finite number >= 0, got {comm!r}")


def simulate(schedule: Schedule, *, cost: Callable[[Unit], float] | None = None,
             comm: Comm = 0.0) -> Timeline:
    """Run the schedule's per-submesh orders: a unit starts when its submesh is free and
    its inputs are done (``comm`` later when they come from another submesh: seconds
    per transfer, or ``comm(src_unit, dst_unit)``, the seconds of what that edge
    moves; ``multimesh.jax.compare_schedules`` passes ``DeviceModel.transfer_seconds``
    of its bytes. The simulator has no hardware model of its own)."""
    check_comm(comm)
    prog = Program(schedule.units)
    plans = [list(r) for r in schedule.orders]
    pos = {i: k for row in plans for k, i in enumerate(row)}
    missing = set(range(len(schedule.units))) - set(pos)
    if missing:
        raise ScheduleError(f"schedule does not place units {sorted(missing)}")
    sim = run_plans(prog, plans, pos, strict=True, cost=cost or default_cost, comm=comm,
                     name=schedule.name)
    return Timeline(schedule, *sim.times())


def live_activation_profile(schedule: Schedule,
                            size: Callable[[tuple[int, int, int]], int] | None = None
                            ) -> list[list[int]]:
    """Per submesh, the number of live activations after each of its dispatches
    (with ``size``, their total size: each counts ``size((mesh, stage, microbatch))``).

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
        opened: dict[tuple[int, int, int], int] = {}
        seen: dict[tuple[int, int, int], int] = {}
        for u in row:
            if not u.free:
                k = u.key
                if u.kind == "fwd" and k in bwd_total and k not in opened:
                    opened[k] = 1 if size is None else size(k)
                    if seen.get(k, 0) < bwd_total[k]:  # some backward still to come
                        live += opened[k]
                elif u.kind in ("bwd", "bwd_w") and k in bwd_total:
                    seen[k] = seen.get(k, 0) + 1
                    if seen[k] == bwd_total[k] and k in opened:
                        live -= opened[k]
            prof.append(live)
        out.append(prof)
    return out


def live_activations(schedule: Schedule) -> list[int]:
    """Peak live activations per submesh (1F1B: at most P; GPipe: M)."""
    return [max(p, default=0) for p in live_activation_profile(schedule)]


def chunk_of(schedule: Schedule) -> dict[int, int]:
    """Per pipeline unit, which of its submesh's stages it belongs to (0 = the first);
    non-zero only under interleaving."""
    stages: dict[int, set[int]] = {}
    for u in schedule.units:
        if not u.free:
            stages.setdefault(u.mesh, set()).add(u.key[1])
    rank = {m: {st: k for k, st in enumerate(sorted(ss))} for m, ss in stages.items()}
    return {u.index: rank[u.mesh][u.key[1]] for u in schedule.units if not u.free}


# ---------------------------------------------------------------- real costs
# (here, not in costs.py, because Schedule.simulate calls predict)


@dataclass(frozen=True)
class FragmentCosts:
    """Seconds per call of each fragment (by name), and where they come from.

    ``source`` names the origin in pictures and tables (``"xla"``, ``"profile"``,
    ``"given"``); ``split_share`` is the weight-gradient share of a backward that a
    comparison splits in two (see the module docstring).
    """

    seconds: Mapping[str, float]
    source: str = "given"
    split_share: float = 0.5

    def of(self, fragment: str) -> float:
        """Seconds of one call of ``fragment`` (or a derived name, ``f|dx``, ``f+g``)."""
        if "+" in fragment:
            return sum(self.of(f) for f in fragment.split("+"))
        base, _, half = fragment.partition("|")
        if base not in self.seconds:
            known = ", ".join(sorted(self.seconds)) or "none"
            raise ScheduleError(f"no cost for fragment '{base}' ({self.source} costs know: "
                                f"{known})")
        s = float(self.seconds[base])
        return {"dx": s * (1 - self.split_share), "dw": s * self.split_share}.get(half, s)

    def __call__(self, unit: Unit) -> float:
        return self.of(unit.fragment)


def as_cost(costs) -> tuple[Callable[[Unit], float], str]:
    """``(unit -> seconds, source)`` for ``costs``: None (unit costs), a
    :class:`FragmentCosts`, anything with a ``fragment_costs()`` method (a measured
    profile), a ``{fragment: seconds}`` mapping, or a callable on units."""
    if costs is None:
        return default_cost, "unit"
    if hasattr(costs, "fragment_costs"):
        costs = costs.fragment_costs()
    if isinstance(costs, FragmentCosts):
        return costs, costs.source
    if isinstance(costs, Mapping):
        return FragmentCosts(dict(costs)), "given"
    if callable(costs):
        return costs, "given"
    raise ScheduleError(f"costs must be None, a FragmentCosts, a measured profile, a "
                        f"{{fragment: seconds}} mapping or a function of a unit, got "
                        f"{type(costs).__name__}")


@dataclass(frozen=True)
class Prediction:
    """One schedule simulated with costs: its timeline, and memory per submesh.

    ``peak_microbatches``: the most (stage, microbatch) activations a submesh holds;
    ``peak_activation_bytes``: the most bytes they hold (residual bytes of each
    forward fragment, summed over a stage), None without residual sizes.
    """

    timeline: Timeline
    source: str
    peak_microbatches: tuple[int, ...]
    peak_activation_bytes: tuple[int, ...] | None = None

    @property
    def schedule(self) -> Schedule:
        return self.timeline.schedule

    @property
    def step_time(self) -> float:
        """Predicted seconds (units with unit costs) of one step, transfers free
        unless ``comm`` was given."""
        return self.timeline.makespan

    @property
    def bubble(self) -> float:
        return self.timeline.bubble_fraction()

    @property
    def busy(self) -> tuple[float, ...]:
        """Per submesh, the sum of its units' durations."""
        return tuple(self.timeline.busy(m) for m in range(self.schedule.num_meshes))

    def __str__(self) -> str:
        t = time_text(self.step_time, self.source)
        mem = "" if self.peak_activation_bytes is None else (
            ", peak activations " + " ".join(bytes_text(b) for b in self.peak_activation_bytes))
        return (f"{self.schedule.name} (costs: {self.source}): step {t}, bubble "
                f"{100 * self.bubble:.1f}%, peak live microbatches "
                f"{list(self.peak_microbatches)}{mem}")


def predict(schedule: Schedule, costs=None, *, residual_bytes=None,
            comm: Comm = 0.0) -> Prediction:
    """Simulate ``schedule``'s order with ``costs`` (see :func:`as_cost`), ``comm``
    seconds per transfer between submeshes. ``residual_bytes``: ``{forward fragment:
    bytes one call keeps for its backward}``, a measured memory profile (its
    submeshes' ``residual_bytes``, per stage) or a function of ``(mesh, stage,
    microbatch)``; gives the peak activation bytes per submesh."""
    cost, source = as_cost(costs)
    tl = simulate(schedule, cost=cost, comm=comm)
    peak_mb = tuple(max(p, default=0) for p in live_activation_profile(schedule))
    peak_b = None
    if residual_bytes is not None:
        size = _non_negative_size(_key_size(schedule, residual_bytes))
        peak_b = tuple(max(p, default=0) for p in live_activation_profile(schedule, size))
    return Prediction(tl, source, peak_mb, peak_b)


def _non_negative_size(size: Callable[[tuple[int, int, int]], int]):
    def checked(key: tuple[int, int, int]) -> int:
        b = size(key)
        if not 0 <= b < math.inf:
            raise ScheduleError(f"residual bytes must be >= 0 and finite, got {b!r} for "
                                f"(submesh, stage, microbatch) {key}")
        return b

    return checked


def _key_size(schedule: Schedule, residual_bytes) -> Callable[[tuple[int, int, int]], int]:
    if callable(residual_bytes):
        return residual_bytes
    subs = getattr(residual_bytes, "submeshes", None)
    if subs is not None:  # a measured memory profile: one microbatch's bytes per submesh
        if len(subs) != schedule.num_meshes:
            raise ScheduleError(f"the memory profile has {len(subs)} submeshes, the "
                                f"schedule {schedule.num_meshes}; profile this program")
        return _profile_size(schedule, subs)
    if not isinstance(residual_bytes, Mapping):
        raise ScheduleError(f"residual_bytes must be {{forward fragment: bytes}}, a memory "
                            f"profile or a function of (mesh, stage, microbatch), got "
                            f"{type(residual_bytes).__name__}")
    per_key: dict[tuple[int, int, int], int] = {}
    for u in schedule.units:
        if not u.free and u.kind == "fwd":
            b = sum(int(residual_bytes.get(f, 0)) for f in u.fragment.split("+"))
            per_key[u.key] = per_key.get(u.key, 0) + b
    return lambda k: per_key.get(k, 0)


def _profile_size(schedule: Schedule, subs) -> Callable[[tuple[int, int, int]], int]:
    """One microbatch's bytes per (mesh, stage, microbatch) from a measured profile: its
    stage's own bytes (``stage_bytes``), summed over the forward tasks of a stage that
    runs several (a V's turn); the submesh's ``residual_bytes`` for a profile without
    ``stage_bytes``."""
    tasks: dict[tuple[int, int], set[str]] = {}
    for u in schedule.units:
        if not u.free and u.kind == "fwd":
            tasks.setdefault(u.key[:2], set()).add(u.task)

    def size(k: tuple[int, int, int]) -> int:
        s = subs[k[0]]
        per = getattr(s, "stage_bytes", None) or {}
        if not per:
            return int(s.residual_bytes)
        # a stage with nothing measured kept nothing (a first stage's batch slice)
        return sum(int(per[t][0]) for t in tasks.get(k[:2], ()) if t in per)
    return size


def time_text(t: float, source: str) -> str:
    if source == "unit":
        return f"{t:g} units"
    if t >= 1:
        return f"{t:.3g} s"
    return f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} µs"


def bytes_text(b: float) -> str:
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{int(b)} B"
