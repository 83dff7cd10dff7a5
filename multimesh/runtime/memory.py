"""Memory accounting for a plan: live buffers per device over the dispatch order.

Used by the P7 benchmark and by tests that bound live activations. Sizes are
per-device shard bytes, from each value's layout; a fragment's own peak is its
arguments + outputs + XLA temporaries (``get_compiled_memory_stats``).
:func:`measure_step` measures instead of simulating: it runs a real step and
counts the buffers the runtime holds after every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import numpy as np

from multimesh._src.mlir import element_dtype
from multimesh.runtime import steps
from multimesh.runtime.plan import Call, Plan, Transfer


def shard_bytes(shape, dtype: str, layout) -> int:
    """Bytes of one device's shard of a ``shape``/``dtype`` array laid out as ``layout``."""
    _, names, sizes, dims = layout
    size_of = dict(zip(names, sizes))
    n = 1
    for d, axes in zip(shape, dims):
        n *= math.ceil(d / math.prod(size_of[a] for a in axes)) if axes else d
    return n * np.dtype(element_dtype(dtype)).itemsize


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
        b = shard_bytes(shape, dtype, lay)
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


# ----------------------------------------------------------------------------- measured

INPUTS, ACTIVATIONS, TRANSIENT, OTHER = "inputs", "activations", "transient", "other"


@dataclass
class SubmeshMemory:
    """One submesh's memory during a real step, in bytes per device (its fullest device).

    ``peak`` is the most the runtime held at once (live arrays + the running fragment's
    XLA temporaries), split at that moment into ``inputs`` (parameters, optimizer
    state, the batch), ``activations`` (forward results of microbatches still in
    flight, and stage inputs received for them), ``transient`` (a stage output
    awaiting its transfer, and what the running step reads for the last time, such
    as a forward's input that its backward does not keep), ``other`` (gradients,
    accumulators, cotangents, running sums) and ``temporaries``. ``peak_activations``
    is the most activation bytes held at any moment, by ``peak_microbatches``
    (stage, microbatch) pairs; ``residual_bytes`` is the most one microbatch held
    here for one stage between its forward and its backward (outside its own forward
    calls and transfers), and ``weight_bytes`` the most it held between the two
    halves of a split backward; ``stage_bytes`` has both per stage.
    """

    devices: tuple[int, ...]  # device ids
    peak: int = 0
    inputs: int = 0
    activations: int = 0
    transient: int = 0
    other: int = 0
    temporaries: int = 0
    peak_activations: int = 0
    peak_microbatches: int = 0
    residual_bytes: int = 0
    weight_bytes: int = 0
    """What one microbatch keeps between the two halves of a split backward (per stage)."""
    stages: int = 1  # pipeline stages (forward tasks in the loop) on this submesh
    peak_transient: int = 0
    """The most ``transient`` bytes held at any moment."""
    stage_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per stage (its forward task) on this submesh: (``residual_bytes``,
    ``weight_bytes``) of that stage alone; stages differ under interleaving."""


def measure_step(executor, args) -> list[SubmeshMemory]:
    """Run one step as ``executor`` does, step by step, recording after each step the
    bytes of the arrays it holds on every device, and of the step's arguments (one
    buffer counted once)."""
    plan = executor.plan
    cls, pair, stage_of = _classes(plan)
    env = executor.start(args)
    # the caller holds its arguments through the step (unless donated): count them
    held = [(v, env[v]) for v in plan.input_ids]
    meter = _Meter(executor, cls, pair, stage_of)

    def metered(step: steps.Step):
        if isinstance(step, steps.CrossProcess):
            raise NotImplementedError("memory profiles measure one process")

        def run(env: list) -> None:
            # what the step reads last is alive while it runs: count it after the step
            reading = [(v, env[v]) for v in step.drop]
            step.run(env)
            jax.block_until_ready([env[d] for d in step.dsts])
            if not isinstance(step, steps.Free):
                meter.record([*held, *reading, *enumerate(env)], step.origin,
                             {v for v, _ in reading})
        return run

    steps.run_program([metered(s) for s in executor.steps], env)
    executor.finish(env)
    return meter.result(_stages(plan))


Pair = tuple[str, int]
"""(stage, microbatch): the stage named by its forward task."""


def _classes(plan: Plan) -> tuple[dict[int, str], dict[int, Pair], dict[int, str]]:
    """Each value's class (inputs / activations / other) and, for activations, its
    (stage, microbatch); and the stage of each loop call (by ``id``). Activations are
    a loop forward's results and what a backward keeps for a later backward of the
    same task and microbatch (a zero-bubble schedule's weight-gradient inputs); a
    transferred value keeps its source's class. A backward's stage is the one whose
    activations it reads."""
    cls = {v: INPUTS for v in plan.input_ids}
    mb: dict[int, Pair] = {}
    stage_of: dict[int, str] = {}
    home: dict[tuple[int, ...], set[str]] = {}  # devices -> stages whose forward ran there
    made_by: dict[int, Call] = {}
    # without a microbatch loop the whole step is one microbatch (0)
    no_loop = not any(c.microbatch is not None for c in plan.calls())
    seen_loop = False
    for s in plan.steps:
        if isinstance(s, Call):
            fwd = plan.fragments[s.fragment].transpose_count == 0 and (
                s.microbatch is not None or no_loop)
            seen_loop = seen_loop or s.microbatch is not None
            # before the loop: the inputs as the step uses them (e.g. constrained weights)
            before = (not no_loop and not seen_loop and bool(s.args)
                      and all(cls.get(a) == INPUTS for a in s.args))
            stage_of[id(s)] = _stage(plan, s, fwd, cls, mb, home)
            for r in s.results:
                cls[r] = ACTIVATIONS if fwd else INPUTS if before else OTHER
                made_by[r] = s
                if fwd:
                    mb[r] = (stage_of[id(s)], s.microbatch or 0)
            for a in s.args:
                src = made_by.get(a)
                if src is None and fwd and a in mb:  # a stage input: this stage's now
                    mb[a] = (stage_of[id(s)], mb[a][1])
                elif src is not None and src is not s and _kept_for(plan, src, s):
                    cls[a], mb[a] = ACTIVATIONS, (stage_of[id(src)], s.microbatch or 0)
        else:
            cls[s.dst] = cls.get(s.src, OTHER)
            if s.src in mb:
                mb[s.dst] = mb[s.src]
    _not_kept(plan, cls, mb)
    return cls, mb, stage_of


def _stage(plan: Plan, call: Call, fwd: bool, cls: dict[int, str], mb: dict[int, Pair],
           home: dict[tuple[int, ...], set[str]]) -> str:
    """A call's stage: a forward's task; for a backward, the stage on its devices whose
    activations of the same microbatch it reads, else the one stage there (a backward
    that recomputes from a batch slice reads none), else its own task."""
    where = plan.call_devices(call)
    if fwd:
        home.setdefault(where, set()).add(plan.fragments[call.fragment].task)
        return plan.fragments[call.fragment].task
    here = home.get(where, set())
    read = [mb[a][0] for a in call.args if cls.get(a) == ACTIVATIONS and a in mb
            and mb[a][1] == (call.microbatch or 0)]
    for st in read:
        if st in here:
            return st
    if len(here) == 1:
        return next(iter(here))
    return read[0] if read else plan.fragments[call.fragment].task


def _not_kept(plan: Plan, cls: dict[int, str], mb: dict[int, Pair]) -> None:
    """Activations that no backward keeps where they are. Transient: a stage output
    that only transfers read, for the next stages' forwards (in transit; its copy
    there is that stage's input), and the copy of a value moved in for the backward
    that reads it (until then the sender held it for that backward). Other: a value
    a later microbatch's call reads (the loss summed over microbatches)."""
    readers: dict[int, list] = {}
    for s in plan.steps:
        for v in (s.args if isinstance(s, Call) else [s.src]):
            readers.setdefault(v, []).append(s)
    moved = {s.dst for s in plan.steps if isinstance(s, Transfer)}
    outputs = set(plan.outputs)

    def fwd(r) -> bool:
        return isinstance(r, Call) and plan.fragments[r.fragment].transpose_count == 0

    for v, c in list(cls.items()):
        rs = readers.get(v, [])
        if c != ACTIVATIONS or v not in mb or not rs or v in outputs:
            continue
        if all(isinstance(r, Transfer) and fwd(readers.get(r.dst, [None])[0]) for r in rs):
            cls[v] = TRANSIENT
        elif v in moved and not any(fwd(r) or isinstance(r, Transfer) for r in rs):
            cls[v] = TRANSIENT
        elif any(isinstance(r, Call) and r.microbatch is not None
                 and r.microbatch != mb[v][1] for r in rs):
            cls[v] = OTHER


def _kept_for(plan: Plan, src: Call, dst: Call) -> bool:
    """``src`` (a backward) hands a value to a later backward of the same task,
    microbatch and devices: the weight-gradient half of a split backward."""
    a, b = plan.fragments[src.fragment], plan.fragments[dst.fragment]
    return (a.transpose_count > 0 and b.transpose_count > 0 and a.task == b.task
            and src.microbatch is not None and src.microbatch == dst.microbatch
            and plan.call_devices(src) == plan.call_devices(dst))


def handed_over(plan: Plan) -> set[str]:
    """Stages (forward tasks) whose split backward's first half hands values to its
    second (not so when the weight half recomputes them: ``remat=True``, issue 33)."""
    _, _, stage_of = _classes(plan)
    made_by = {r: c for c in plan.calls() for r in c.results}
    out = set()
    for c in plan.calls():
        for a in c.args:
            src = made_by.get(a)
            if src is not None and src is not c and _kept_for(plan, src, c):
                out.add(stage_of[id(src)])
    return out


def _stages(plan: Plan) -> dict[tuple[int, ...], int]:
    """Per submesh, the number of pipeline stages (forward tasks in the loop) on it."""
    tasks: dict[tuple[int, ...], set[str]] = {}
    for s in plan.calls():
        where = plan.call_devices(s)
        tasks.setdefault(where, set())
        if s.microbatch is not None and plan.fragments[s.fragment].transpose_count == 0:
            tasks[where].add(plan.fragments[s.fragment].task)
    return {w: max(1, len(t)) for w, t in tasks.items()}


class _Meter:
    """Live bytes per device and class after each step; the peaks per device."""

    def __init__(self, executor, cls, mb, stage_of) -> None:
        self.ex, self.cls, self.mb, self.stage_of = executor, cls, mb, stage_of
        self.pos = {d.id: p for p, d in enumerate(executor.devices)}
        self.peak: dict[int, tuple[int, dict[str, int], int]] = {}  # pos -> (total, split, temp)
        self.act: dict[int, tuple[int, int]] = {}  # pos -> (activation bytes, microbatches)
        self.transient: dict[int, int] = {}  # pos -> most transient bytes
        # state -> (pos, stage) -> bytes
        self.per_mb: dict[str, dict[tuple[int, str], int]] = {"fb": {}, "bw": {}}
        plan = executor.plan
        self.sub_of = {p: plan.call_devices(c) for c in plan.calls() for p in plan.call_devices(c)}
        self.bwd_total: dict[tuple, int] = {}  # (submesh, pair) -> backward calls
        for c in plan.calls():
            if c.microbatch is not None and plan.fragments[c.fragment].transpose_count > 0:
                k = (plan.call_devices(c), self._pair(c))
                self.bwd_total[k] = self.bwd_total.get(k, 0) + 1
        self.seen: dict[tuple, list[int]] = {}  # (submesh, pair) -> [fwd, bwd] calls run

    def _pair(self, call: Call) -> Pair:
        return self.stage_of[id(call)], call.microbatch or 0

    def record(self, values, step, reading=frozenset()) -> None:
        """One step's live bytes; ``reading``: values the step read for the last time
        (alive while it ran; a loop forward's are transient, held for nothing after it)."""
        fresh = set(step.results) if isinstance(step, Call) else {step.dst}
        if not (isinstance(step, Call) and step.microbatch is not None
                and self.ex.plan.fragments[step.fragment].transpose_count == 0):
            reading = frozenset()  # a backward's last reads are what it kept
        live, mbs = self._live(values, fresh, reading)
        busy, temp, where = self._step(step)
        for p, split in live.items():
            t = temp if p in where else 0
            total = sum(split.values()) + t
            if total > self.peak.get(p, (-1,))[0]:
                self.peak[p] = (total, dict(split), t)
            a = split.get(ACTIVATIONS, 0)
            if a > self.act.get(p, (-1, 0))[0]:
                self.act[p] = (a, len(mbs.get(p, {})))
            self.transient[p] = max(self.transient.get(p, 0), split.get(TRANSIENT, 0))
            for m, (old, new) in mbs.get(p, {}).items():
                if m != busy:
                    self._keep(p, m, old, new, step)
        if isinstance(step, Call) and step.microbatch is not None:
            k = self.seen.setdefault((where, self._pair(step)), [0, 0])
            k[self.ex.plan.fragments[step.fragment].transpose_count > 0] += 1

    def _state(self, p: int, m: Pair, after: int = 0) -> str | None:
        """Microbatch ``m`` on device ``p``'s submesh: "fb" (forward run, backward to
        come), "bw" (some of its backward run, the rest to come) or None."""
        where = self.sub_of.get(p)
        fwd, bwd = self.seen.get((where, m), [0, 0])
        bwd += after
        if not fwd or bwd >= self.bwd_total.get((where, m), 0):
            return None
        return "fb" if bwd == 0 else "bw"

    def _keep(self, p: int, m: Pair, old: int, new: int, step) -> None:
        """Count what pair ``m`` holds on ``p`` towards its state's most; at its own
        backward call, what the call made belongs to the state after it."""
        own = (isinstance(step, Call) and step.microbatch is not None
               and self._pair(step) == m and p in self.ex.plan.call_devices(step))
        states = ([(self._state(p, m), old), (self._state(p, m, 1), new)] if own
                  else [(self._state(p, m), old + new)])
        for st, n in states:
            if st is not None:
                self.per_mb[st][p, m[0]] = max(self.per_mb[st].get((p, m[0]), 0), n)

    def _live(self, values, fresh, reading) -> tuple[dict, dict]:
        """Bytes per device and class, and activation bytes per device and microbatch,
        (older, made by this step: ``fresh``)."""
        live: dict[int, dict[str, int]] = {}
        mbs: dict[int, dict[Pair, list[int]]] = {}
        seen: set[tuple[int, int]] = set()
        for vid, x in values:
            if not isinstance(x, jax.Array) or x.is_deleted():
                continue
            for sh in x.addressable_shards:
                key = (sh.device.id, sh.data.unsafe_buffer_pointer())
                if key in seen:
                    continue
                seen.add(key)
                p, n, c = self.pos[sh.device.id], sh.data.nbytes, self.cls.get(vid, OTHER)
                if c == ACTIVATIONS and vid in reading:
                    c = TRANSIENT
                live.setdefault(p, {}).setdefault(c, 0)
                live[p][c] += n
                if c == ACTIVATIONS and vid in self.mb:
                    by = mbs.setdefault(p, {}).setdefault(self.mb[vid], [0, 0])
                    by[vid in fresh] += n
        return live, mbs

    def _step(self, step) -> tuple[Pair | None, int, tuple[int, ...]]:
        """(the microbatch whose forward runs or whose value moves now, whose bytes at
        this step are not what it keeps for its backward; the step's XLA temporaries;
        the devices they are on)."""
        if not isinstance(step, Call):
            return self.mb.get(step.src), 0, ()
        fwd = self.ex.plan.fragments[step.fragment].transpose_count == 0
        temp = self.ex.exes[step.fragment].memory_analysis().temp_size_in_bytes
        busy = self._pair(step) if fwd and step.microbatch is not None else None
        return busy, temp, self.ex.plan.call_devices(step)

    def result(self, stages: dict[tuple[int, ...], int]) -> list[SubmeshMemory]:
        out = []
        for where, v in stages.items():
            p = max(where, key=lambda q: self.peak.get(q, (0,))[0])
            total, split, temp = self.peak.get(p, (0, {}, 0))
            a, n = max((self.act.get(q, (0, 0)) for q in where), default=(0, 0))
            per = self._per_stage(where)
            res, w = (max((b[k] for b in per.values()), default=0) for k in (0, 1))
            out.append(SubmeshMemory(
                tuple(self.ex.devices[q].id for q in where), total, split.get(INPUTS, 0),
                split.get(ACTIVATIONS, 0), split.get(TRANSIENT, 0), split.get(OTHER, 0),
                temp, a, n, res, w, v, max(self.transient.get(q, 0) for q in where), per))
        return out

    def _per_stage(self, where: tuple[int, ...]) -> dict[str, tuple[int, int]]:
        """Per stage on ``where``: what one microbatch holds (awaiting its backward,
        awaiting its weight half), at the fullest device."""
        stages = {st for per in self.per_mb.values() for q, st in per if q in where}
        return {st: tuple(max(self.per_mb[k].get((q, st), 0) for q in where)  # type: ignore
                          for k in ("fb", "bw")) for st in sorted(stages)}
