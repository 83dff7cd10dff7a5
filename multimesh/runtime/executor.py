"""Compile every fragment once on its submesh and dispatch a plan asynchronously.

Each fragment compiles through jax's own ``pxla.UnloadedMeshExecutable`` path,
so it takes and returns ordinary ``jax.Array``s. The plan becomes a list of typed
steps (:mod:`.steps`) that one loop dispatches without blocking: jax's async
dispatch queues work per device, and references to intermediates are dropped
right after their last use so their buffers are freed as soon as the device is
done with them.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Set
from typing import Any

import jax
import numpy as np
from jax.core import ShapedArray

from multimesh._src import callbacks, jax_compat
from multimesh._src.caches import LRUCache
from multimesh._src.ir_contract import DONOR_ATTR
from multimesh._src.ir_util import update_attr_dicts
from multimesh._src.layouts import Placement
from multimesh._src.log import compile_log_level, logger
from multimesh._src.mlir import element_dtype, ir, parse_module, reused_context
from multimesh.runtime import codegen, fragment_store, runahead, shared_blocks
from multimesh.runtime import steps as st
from multimesh.runtime.distributed import ProcessPlan, Route
from multimesh.runtime.guards import check_args
from multimesh.runtime.memory import SubmeshMemory, measure_step
from multimesh.runtime.parallel import map_ordered
from multimesh.runtime.plan import Call, Fragment, Plan, Transfer, moved
from multimesh.runtime.steps import layout_sharding
from multimesh.runtime.timing import StepTime, run_timed
from multimesh.runtime.zeros import Zeros

# Compiled fragments by (text, device ids, donors), shared by every program; emptied
# by jax.clear_caches() / multimesh.clear_caches().
_COMPILE_CACHE = LRUCache("multimesh compiled fragments", max_size=512)
_LOCK = threading.Lock()
xla_compiles = 0
"""How many fragment executables XLA has compiled in this process (for tests/benchmarks)."""


def _aval(t):
    shape, dtype = t
    return ShapedArray(shape, element_dtype(dtype))


def compile_fragment(frag: Fragment, devices: tuple, donors: tuple[int, ...] = (),
                     positions: tuple[int, ...] | None = None) -> jax.stages.Compiled:
    """Compile (or fetch from cache) one fragment for its devices.

    ``donors`` are argument positions whose buffers the call may reuse for its
    outputs (``jax.buffer_donor``); the cache key is the fragment's text, the
    devices and the donors, so identical fragments compile once.
    ``positions``: run it on these device positions instead of its own (a task
    that moves with the microbatch).
    """
    return _compile_one(frag, devices, donors, positions)[0]


XLA, PERSISTENT_CACHE, IDENTICAL, MEMORY = (
    "xla", "persistent cache", "identical fragment", "memory")
"""Where a fragment's executable came from: compiled by XLA now, loaded from jax's
persistent compilation cache, loaded from the executable of an identical fragment on
other devices, or compiled earlier in this process."""
_ORIGINS = (XLA, PERSISTENT_CACHE, IDENTICAL, MEMORY)
_MESH_DECL = re.compile(r'sdy\.mesh @("(?:[^"\\]|\\.)*"|[\w$.-]+)')
Job = tuple[Fragment, tuple[int, ...], tuple[int, ...] | None]
"""What to compile: ``(fragment, donors, device positions or None for its own)``."""


def _fragment_key(frag: Fragment, devices: tuple, donors: tuple[int, ...],
                  positions: tuple[int, ...] | None) -> tuple:
    sub = tuple(devices[p] for p in (positions or frag.devices))
    return (frag.text, tuple(d.id for d in sub), donors)


def _shape_key(frag: Fragment, donors: tuple[int, ...]) -> tuple:
    """:func:`_fragment_key` without the devices: the text up to its mesh names, the
    donors, and the layouts relative to the fragment's devices. Fragments that agree
    on it are one SPMD program (the same block on several submeshes)."""
    text = frag.text
    for i, name in enumerate(_MESH_DECL.findall(text)):
        text = re.sub(re.escape("@" + name) + r'(?![\w$.-])', f"@mm.mesh{i}", text)
    home = frag.devices

    def rel(lay: Placement) -> tuple:
        return (tuple(home.index(p) if p in home else -1 - p for p in lay[0]), *lay[1:])
    return (text, donors, len(home), tuple(map(rel, frag.in_layouts)),
            tuple(map(rel, frag.out_layouts)))


def _compile_one(frag: Fragment, devices: tuple, donors: tuple[int, ...] = (),
                 positions: tuple[int, ...] | None = None, like=None,
                 stored: bytes | None = None) -> tuple[jax.stages.Compiled, str]:
    """:func:`compile_fragment`, and where the executable came from (:data:`XLA`, ...).

    ``like``: the executable of a fragment with the same :func:`_shape_key` on other
    devices; loaded onto these devices instead of compiling, where jax can.
    ``stored``: such an executable from :mod:`.fragment_store`, loaded likewise.
    """
    home = frag.devices
    positions = positions or home
    sub = tuple(devices[p] for p in positions)
    key = _fragment_key(frag, devices, donors, positions)
    with _LOCK:
        exe = _COMPILE_CACHE.get(key)
    if exe is not None:
        return exe, MEMORY
    t0 = time.perf_counter()
    in_sh = [layout_sharding(moved(lay, home, positions), devices) for lay in frag.in_layouts]
    out_sh = [layout_sharding(moved(lay, home, positions), devices)
              for lay in frag.out_layouts]
    exe = like and jax_compat.load_on_devices(like, frag.name, in_sh, out_sh, sub)
    origin = IDENTICAL
    if exe is None and stored is not None:
        exe, origin = _load_stored(frag, donors, in_sh, out_sh, sub, stored)
    if exe is None:
        exe, origin = _xla_compile(frag, donors, in_sh, out_sh, sub)
    level = compile_log_level()
    if logger.isEnabledFor(level):
        logger.log(level, "multimesh: %s fragment %s on devices %s%s in %.3f s",
                   _SAY[origin], frag.name, [d.id for d in sub],
                   f" (donating arguments {list(donors)})" if donors else "",
                   time.perf_counter() - t0)
    with _LOCK:
        _COMPILE_CACHE[key] = exe
    return exe, origin


_SAY = {XLA: "XLA compiled", PERSISTENT_CACHE: "loaded from jax's persistent cache",
        IDENTICAL: "loaded an identical fragment's executable for"}


def _load_stored(frag: Fragment, donors: tuple[int, ...], in_sh, out_sh, sub: tuple,
                 stored: bytes) -> tuple[jax.stages.Compiled | None, str]:
    """A :mod:`.fragment_store` entry loaded onto ``sub``; None where it cannot be."""
    module = parse_module(frag.text, reused_context())
    if donors:
        _mark_donors(module, donors)
    try:
        exe = jax_compat.compile_module(
            frag.name, module, [_aval(t) for t in frag.in_types],
            [_aval(t) for t in frag.out_types], in_sh, out_sh, sub, serialized=stored)
    except Exception:  # noqa: BLE001 - a stale or damaged entry: compile instead
        return None, XLA
    return exe, PERSISTENT_CACHE


def _xla_compile(frag: Fragment, donors: tuple[int, ...], in_sh, out_sh, sub: tuple
                 ) -> tuple[jax.stages.Compiled, str]:
    module = parse_module(frag.text, reused_context())
    calls_back = callbacks.may_call_back(frag.text)
    host_callbacks = callbacks.take(module, frag.name) if calls_back else []
    if donors:
        _mark_donors(module, donors)
    effects = jax_compat.ORDERED_EFFECTS if calls_back and callbacks.ordered(module) else ()
    if effects:  # jax's runtime tokens order it against other ordered calls
        callbacks.thread_tokens(module, len(effects))
    global xla_compiles
    with _LOCK:
        xla_compiles += 1
    hits = jax_compat.persistent_cache_hits()
    # A jax.stages.Compiled: calls take jax's C++ dispatch path (a few µs, like a
    # jitted function) instead of MeshExecutable.call's Python checks (~15 µs); the
    # plan guarantees argument layouts. (With host callbacks, jax's Python path, which
    # keeps runtime tokens so that jax.effects_barrier() waits for them.)
    exe = jax_compat.compile_module(
        frag.name, module, [_aval(t) for t in frag.in_types],
        [_aval(t) for t in frag.out_types], in_sh, out_sh, sub, host_callbacks,
        effects)
    return exe, PERSISTENT_CACHE if jax_compat.persistent_cache_hits() > hits else XLA


_HEAVY_OPS = ("stablehlo.dot_general", "stablehlo.convolution", "stablehlo.reduce",
              "stablehlo.scatter", "stablehlo.gather", "stablehlo.while")


def _work(frag: Fragment) -> tuple[int, int]:
    """How long XLA takes to compile ``frag``, as an order: the contractions, reductions
    and loops it emits kernels for, then its length (an optimizer update, elementwise,
    is long text but a short compile)."""
    return sum(frag.text.count(op) for op in _HEAVY_OPS), len(frag.text)


def _groups(jobs: list[Job], devices: tuple
            ) -> tuple[dict[tuple, int], dict[tuple, int], dict[int, list[int]]]:
    """The first job of each executable (by :func:`_fragment_key`), the first of those
    of each :func:`_shape_key` (its leader, which compiles), and each leader's
    followers (the jobs that load its executable)."""
    first: dict[tuple, int] = {}
    for j, (frag, donors, positions) in enumerate(jobs):
        first.setdefault(_fragment_key(frag, devices, donors, positions), j)
    leaders: dict[tuple, int] = {}
    followers: dict[int, list[int]] = {}
    for j in first.values():
        lead = leaders.setdefault(_shape_key(jobs[j][0], jobs[j][1]), j)
        followers.setdefault(lead, [])
        if lead != j:
            followers[lead].append(j)
    return first, leaders, followers


def _compile_all(jobs: list[Job], devices: tuple) -> list[tuple[Any, str, float]]:
    """``(executable, origin, seconds)`` of every job, in order; a fragment that holds
    another distinct fragment's program runs as pieces, that program's executable
    shared (:mod:`.shared_blocks`: a :class:`~.shared_blocks.SplitExecutable`)."""
    splits = shared_blocks.plan_splits(jobs, _shape_key, devices[0] if devices else None)
    if not splits:
        return _compile_jobs(jobs, devices)
    flat: list[Job] = []
    spans = []
    for j, job in enumerate(jobs):
        start = len(flat)
        flat.extend(splits[j].jobs if j in splits else [job])
        spans.append((start, len(flat)))
    got = _compile_jobs(flat, devices)
    out: list[tuple[Any, str, float]] = []
    for j, (lo, hi) in enumerate(spans):
        if j in splits:
            exe, seconds = splits[j].assemble(got[lo:hi])
            out.append((exe, min((o for _, o, _ in got[lo:hi]), key=_ORIGINS.index),
                        seconds))
        else:
            out.append(got[lo])
    return out


def _compile_jobs(jobs: list[Job], devices: tuple
                  ) -> list[tuple[jax.stages.Compiled, str, float]]:
    """``(executable, origin, seconds)`` of every job, in order.

    Each distinct executable is made once: fragments that differ only in their devices
    compile once and the others load that executable (:func:`_shape_key`). The ones
    that compile, compile concurrently (:mod:`.parallel`), the longest first
    (:func:`_work`), so that the pool does not end on one long compile alone; each
    loads its followers as soon as it is compiled, in its thread, while the other
    threads still compile. An error is the one the first
    failing job in order raises, as in a serial loop.
    """
    first, leaders, followers = _groups(jobs, devices)
    # Only an executable XLA compiled in this process can be loaded elsewhere (jax
    # 0.10.2's CPU client re-serializes a loaded one without its code); with jax's
    # persistent cache on, the one XLA compiled is also stored for later processes.
    entries, stored = _stored_entries(leaders, jobs, devices)

    def timed(j: int, like) -> tuple[jax.stages.Compiled, str, float]:
        frag, donors, positions = jobs[j]
        shape = _shape_key(frag, donors)
        t0 = time.perf_counter()
        exe, origin = _compile_one(frag, devices, donors, positions,
                                   like[0] if like and like[1] == XLA else None,
                                   stored.get(shape))
        seconds = time.perf_counter() - t0
        if origin == XLA and shape in entries and stored.get(shape) is None:
            data = jax_compat.serialized_executable(exe)
            if data is not None:
                fragment_store.write(entries[shape], data, seconds)
        return exe, origin, seconds

    def group(j: int) -> list[tuple[int, Any]]:
        """The leader ``j`` then its followers: ``(job, result or the exception)``."""
        out: list[tuple[int, Any]] = []
        k = j
        try:
            lead = timed(j, None)
            out.append((j, lead))
            for k in followers[j]:
                out.append((k, timed(k, lead)))
        except Exception as e:  # noqa: BLE001 - raised below, in the jobs' order
            out.append((k, e))
        return out

    order = sorted(followers, key=lambda j: _work(jobs[j][0]), reverse=True)
    done = dict(pair for pairs in map_ordered(group, order) for pair in pairs)
    failed = sorted(j for j, r in done.items() if isinstance(r, BaseException))
    if failed:
        raise done[failed[0]]
    return [done[j] if j in done else (done[first[k]][0], MEMORY, 0.0)
            for j, k in enumerate(_fragment_key(f, devices, d, p) for f, d, p in jobs)]


def _stored_entries(leaders: dict[tuple, int], jobs: list[Job], devices: tuple
                    ) -> tuple[dict[tuple, str], dict[tuple, bytes | None]]:
    """With jax's persistent cache on: each distinct fragment's :mod:`.fragment_store`
    entry name, and its executable where a process stored one (one read each)."""
    if not jax_compat.persistent_cache_on():
        return {}, {}
    with _LOCK:
        todo = {shape: j for shape, j in leaders.items()
                if _COMPILE_CACHE.get(_fragment_key(jobs[j][0], devices, *jobs[j][1:])) is None
                and not callbacks.may_call_back(jobs[j][0].text)}
    entries = {shape: fragment_store.entry_key(shape, devices[0]) for shape in todo}
    return entries, {shape: fragment_store.read(key) for shape, key in entries.items()}


def _mark_donors(module, donors) -> None:
    with module.context:
        for op in module.body.operations:
            op = op.operation
            if op.name != "func.func":
                continue
            donor = {DONOR_ATTR: ir.BoolAttr.get(True)}
            n_args = len(op.regions[0].blocks[0].arguments)
            update_attr_dicts(op, "arg_attrs", {k: donor for k in donors if k < n_args})


class Executor:
    """Runs a :class:`Plan` on a concrete device list.

    Each (fragment, devices) pair compiles once, with the argument donations its
    calls share (a donation only some calls could make is skipped and the donated
    input is deleted after its last use instead: a :class:`~.steps.Free` step).
    Everything that does not depend on the values is decided here, as a list of
    typed steps (:mod:`.steps`): which executable each call runs, which arrays each
    step frees, and which transfers move together. In one process a transfer is
    dispatched as late as its first consumer allows, so the transfers that a point
    of the schedule needs go out in one batched call (:func:`_program`).
    """

    def __init__(self, plan: Plan, devices: tuple, donated: frozenset[int] = frozenset(),
                 leaf_name=None):
        self.plan = plan
        self.devices = tuple(devices)
        self.donated = donated
        self._leaf_name = leaf_name  # names argument i in errors
        # A donated value returned by the program is not donated: its buffer is the output.
        donated = frozenset(a for a in donated if a not in plan.outputs)
        # This process's share of the plan under jax.distributed, or None in one process.
        self.process_plan = ProcessPlan(plan, self.devices) if jax.process_count() > 1 else None
        before = xla_compiles
        exes = {i: jax_compat.dispatcher(e) for i, e in self._compile_calls(donated).items()}
        self.xla_compiles = xla_compiles - before
        """XLA compilations this executor caused (0 when every variant was cached)."""
        self.input_shardings = [layout_sharding(lay, self.devices) for lay in plan.inputs]
        # Inputs no step reads and the program does not return: left where they are
        # (jax.jit's keep_unused=False), not moved onto their sharding at every call.
        self._unread = frozenset(k for k, v in enumerate(plan.input_ids)
                                 if v not in plan.last_use and v not in plan.outputs)
        self.output_shardings = [layout_sharding(lay, self.devices) for lay in plan.out_layouts]
        layouts = plan.value_layouts()
        # Transfers of a donated input onto its own devices: they need fresh buffers.
        shared = frozenset(i for i, s in enumerate(plan.steps) if isinstance(s, Transfer)
                           and s.src in donated and set(s.layout[0]) & set(layouts[s.src][0]))
        self.transfer_count = sum(1 for s in plan.steps if not isinstance(s, Call))
        self.steps = _per_step(plan, self.devices, exes, self._skipped_donations, shared,
                               layouts, self.process_plan)
        """The plan's steps that this process runs, one by one, in plan order (traces,
        memory profiles, and every run under jax.distributed)."""
        self._env_template = self._constants()
        self._zeros = self._zero_sources()
        # One process: the precomputed dispatch program (batched transfers). Several
        # processes dispatch step by step, in the same global order everywhere.
        self._program = (_program(plan, self.devices, exes, self._skipped_donations,
                                  self._consumed, shared, layouts)
                         if self.process_plan is None else None)
        self.run_ahead: int | None = None
        """Fragment calls of one submesh that may be in flight at once (None: no bound;
        :mod:`.runahead`); set with :meth:`set_run_ahead`."""
        self.set_run_ahead(runahead.default_run_ahead(self.devices[0].platform))
        self.batched_transfers = (
            sum(1 for s in self._program if not isinstance(s, (st.FragmentCall, st.Free)))
            if self._program is not None else self.transfer_count)
        """Batched copy calls per run (each moves one or more arrays)."""

    @property
    def program(self) -> list:
        """What one run dispatches, in order: in one process the precomputed program
        (plain copies batched), else :attr:`steps` (benchmarks time it step by step)."""
        return self._program if self._program is not None else self.steps

    def set_run_ahead(self, limit: int | None) -> None:
        """Bound how far the host dispatches ahead of the devices (:mod:`.runahead`):
        at most ``limit`` fragment calls of one submesh in flight; None: no bound.
        One process only (several dispatch step by step, in lock step anyway)."""
        self.run_ahead = runahead.check_run_ahead(limit)
        program = self._program or self.steps
        if self._program is not None:
            program = runahead.bounded(program, self.plan, limit, self._consumed)
        self._bounded = program
        self._runs = [s.run for s in program]
        self._dispatch: Any = None  # written on the next call (:meth:`dispatch_function`)

    def dispatch_function(self):
        """The function an ordinary call runs in one process: the dispatch program,
        run-ahead waits included, as one straight-line function (:mod:`.codegen`;
        ``.source`` is its source). Written on first use and whenever
        :meth:`set_run_ahead` changes the program. None under jax.distributed (steps
        are dispatched one by one there)."""
        if self._dispatch is None and self._program is not None:
            self._dispatch = codegen.generate(
                self._bounded, inputs=self.plan.input_ids, outputs=self.plan.outputs,
                placements={k: sh for k, sh in enumerate(self.input_shardings)
                            if k not in self._unread},
                place=st.place, check=self._check,
                constants={v: a for v, a in enumerate(self._env_template) if a is not None},
                zeros=(self._zeros.ids, self._zeros.make))
        return self._dispatch

    def _check(self, args) -> None:
        check_args(args, self.donated, self._leaf_name)

    def _constants(self) -> list:
        """The value list every run starts from: the microbatch indices in place."""
        plan, pp = self.plan, self.process_plan
        n_values = 1 + max([*plan.input_ids, *plan.constants,
                            *(v for s in plan.steps for v in
                              (s.results if isinstance(s, Call) else [s.dst]))], default=0)
        env = [None] * n_values
        for vid, (value, lay) in plan.constants.items():
            if pp is None or pp.owns(lay[0]):
                env[vid] = jax.device_put(np.int32(value), layout_sharding(lay, self.devices))
        return env

    def _zero_sources(self) -> Zeros:
        """The zeros every run starts from (:attr:`Plan.zeros`, a loop's running sums),
        made without a fragment (:mod:`multimesh.runtime.zeros`)."""
        pp = self.process_plan
        mine = [(vid, t, lay) for vid, (t, lay) in self.plan.zeros.items()
                if pp is None or pp.owns(lay[0])]
        return Zeros([vid for vid, _, _ in mine],
                     [(shape, element_dtype(dtype)) for _, (shape, dtype), _ in mine],
                     [layout_sharding(lay, self.devices) for _, _, lay in mine])

    def _compile_calls(self, donated: frozenset[int]) -> dict[int, jax.stages.Compiled]:
        """The executable of every call this process runs (by step index), compiling only
        what is used: one executable per (fragment, devices), with the donations every
        call of it can make."""
        plan, pp = self.plan, self.process_plan
        wants: dict[tuple, list[tuple[int, tuple[int, ...]]]] = {}
        for i, s in enumerate(plan.steps):
            if isinstance(s, Call) and (pp is None or pp.owns(plan.call_devices(s))):
                frag = plan.fragments[s.fragment]
                donors = tuple(k for k, a in enumerate(s.args)
                               if a in donated and plan.last_use.get(a) == i
                               and s.args.count(a) == 1 and k not in frag.donors)
                wants.setdefault((s.fragment, s.devices), []).append((i, donors))
        exes: dict[int, jax.stages.Compiled] = {}
        self.exes: dict[str, Any] = {}
        """Fragment name -> one of its executables (for cost and memory analysis): a
        ``jax.stages.Compiled``, or a split fragment's :class:`~.shared_blocks.SplitExecutable`."""
        self.xla_seconds: dict[str, float] = {}
        """Fragment name -> seconds spent getting its executables (XLA, or the cache)."""
        self._skipped_donations: dict[int, list[int]] = {}
        self._consumed: dict[int, set[int]] = {}  # call -> values it donates (or deletes)
        jobs = []
        for (name, positions), calls in wants.items():
            common = set(calls[0][1]).intersection(*(d for _, d in calls[1:]))
            jobs.append((plan.fragments[name], tuple(sorted(common)), positions))
        self.xla_sources: dict[str, str] = {}
        """Fragment name -> where its executables came from (the first of
        :data:`_ORIGINS` that any of them came from: :data:`XLA`, ...)."""
        results = _compile_all(jobs, self.devices)
        self.split_pieces: dict[str, list[tuple[str, str, float]]] = {}
        """Fragment name -> ``(piece, origin, seconds)`` of each program it runs as,
        for a fragment split around another's program (:mod:`.shared_blocks`)."""
        for ((name, _), calls), (frag, common_t, _), (exe, origin, secs) in zip(
                wants.items(), jobs, results):
            common = self._record(name, exe, origin, secs, set(common_t))
            for i, donors in calls:
                exes[i] = exe
                skipped = [plan.steps[i].args[k] for k in donors if k not in common]
                if skipped:
                    self._skipped_donations[i] = skipped
                args = plan.steps[i].args
                self._consumed[i] = {args[k] for k in donors} | {
                    args[k] for k in frag.donors}
        return exes

    def _record(self, name: str, exe, origin: str, secs: float, common: set[int]
                ) -> set[int]:
        """Note one job's executable; the donations it makes (of ``common``)."""
        self.xla_seconds[name] = self.xla_seconds.get(name, 0.0) + secs
        self.xla_sources[name] = min(self.xla_sources.get(name, MEMORY), origin,
                                     key=_ORIGINS.index)
        self.exes.setdefault(name, exe)
        if isinstance(exe, shared_blocks.SplitExecutable):
            self.split_pieces.setdefault(name, exe.pieces)
            return common & exe.donated
        return common

    def place_inputs(self, args):
        if self.process_plan is not None:  # Hook: inputs may live on other processes
            return self.process_plan.place_inputs(args, self.input_shardings)
        out = []
        for k, (a, sh) in enumerate(zip(args, self.input_shardings)):
            s = getattr(a, "sharding", None)
            if s is not sh and s != sh and k not in self._unread:  # equal: there already
                a = st.place(a, sh)
            out.append(a)
        return out

    def start(self, args) -> list:
        """The value list of one run, holding its placed inputs (checked first).

        Values live in a flat list indexed by value id; a slot is cleared after the
        value's last use so its buffer can be freed while the step still runs.
        """
        self._check(args)
        env = self._env_template.copy()
        if self._zeros.ids:
            for i, z in zip(self._zeros.ids, self._zeros.make()):
                env[i] = z
        for i, a in zip(self.plan.input_ids, self.place_inputs(args)):
            env[i] = a
        return env

    def __call__(self, *args):
        fn = self._dispatch or self.dispatch_function()
        if fn is not None:
            return fn(args)
        return self.finish(st.run_program(self._runs, self.start(args)))

    def finish(self, env) -> list:
        """The outputs of a run whose value list (:meth:`start`) is ``env``."""
        outs = [env[o] for o in self.plan.outputs]
        if self.process_plan is not None:  # outputs that live on other processes
            outs = self.process_plan.finish(outs, self.output_shardings)
        return outs

    def run_traced(self, recorder, *args):
        """Like ``__call__`` but step by step, blocking after every step and recording
        its span on ``recorder`` (:class:`~multimesh.runtime.trace.TraceRecorder`)."""
        runs = st.traced(self.steps, recorder, self.devices, self.plan)
        return self.finish(st.run_program(runs, self.start(args)))

    def run_timed(self, recorder, args) -> tuple[list, list[StepTime]]:
        """Like :meth:`run_traced`, and each step's time beside its plan origin
        (:func:`~.timing.run_timed`): the outputs and the times."""
        return run_timed(self, recorder, args)

    def measure(self, args) -> list[SubmeshMemory]:
        """Run one step on ``args``, step by step, and measure the bytes each submesh
        holds (:func:`~.memory.measure_step`); the outputs are dropped."""
        return measure_step(self, args)


def _per_step(plan: Plan, devices: tuple, exes: dict, skipped: dict, shared: Set[int],
              layouts: dict[int, Placement], pp: ProcessPlan | None) -> list[st.Step]:
    """The plan's steps this process runs, in plan order, one step each (a call with
    a skipped donation is followed by its :class:`~.steps.Free`)."""
    outputs = set(plan.outputs)
    out: list[st.Step] = []
    for i, s in enumerate(plan.steps):
        where = pp.kind(s) if pp is not None else "run"
        if where == "skip":
            continue
        free = skipped.get(i, ())
        drop = [v for v in dict.fromkeys(st.reads(s)) if plan.last_use.get(v) == i
                and v not in outputs and v not in free]
        if isinstance(s, Call):
            out.append(st.FragmentCall(exes[i], s.args, s.results, drop, s))
            if free:
                out.append(st.Free(free, s))
            continue
        how = st.route(layouts[s.src], s.layout, fresh=i in shared,
                       local=where == "run" or where is Route.LOCAL)
        out.append(_transfer_step(how, s, devices, drop, pp, where))
    return out


def _transfer_step(how: str, s: Transfer, devices: tuple, drop, pp: ProcessPlan | None,
                   where: str) -> st.Step:
    """One transfer as a step of its own (a plain copy is a move of one array)."""
    if how == st.CROSS_PROCESS:
        assert pp is not None
        return st.CrossProcess(pp.mover(s, where), s.src, s.dst, drop, s)
    cls = st.FreshCopy if how == st.FRESH_COPY else st.Move
    return cls(layout_sharding(s.layout, devices), s.src, s.dst, drop, s)


def _program(plan: Plan, devices: tuple, exes: dict, skipped: dict, consumed: dict,
             shared: Set[int], layouts: dict[int, Placement]) -> list[st.Step]:
    """The steps of one run in one process, batched, for :meth:`Executor.__call__`.

    Calls keep the plan's order. A transfer may go anywhere between its place in
    the plan and its first reader (a call, another transfer, or the end of the run),
    but never past a call that donates its source (``consumed``: call -> values).
    The fewest points that cover every transfer's range are chosen (interval
    stabbing), and the transfers at one point that :func:`~.steps.route` calls plain
    copies go out in one :class:`~.steps.BatchedCopy`: the arrays that one point of
    the schedule needs cross in one host call.
    """
    order = _dispatch_order(plan, _transfer_slots(plan, consumed))
    last_read = _last_reads(plan, order)
    outputs = set(plan.outputs)

    def drops(k: int, reads, keep=()) -> tuple[int, ...]:
        return tuple(sorted({v for v in reads if last_read.get(v) == k
                             and v not in outputs and v not in keep}))

    program: list[st.Step] = []
    for k, item in enumerate(order):
        if isinstance(item, list):
            batch = _batch(plan, item, devices, layouts, shared)
            batch[-1].drop = drops(k, [plan.steps[i].src for i in item])
            program.extend(batch)
            continue
        s = plan.steps[item]
        assert isinstance(s, Call)
        free = skipped.get(item, ())
        program.append(st.FragmentCall(exes[item], s.args, s.results,
                                       drops(k, s.args, free), s))
        if free:  # donated, but this call's executable cannot reuse them
            program.append(st.Free(free, s))
    return program


def _batch(plan: Plan, item: list[int], devices: tuple, layouts: dict[int, Placement],
           shared: Set[int]) -> list[st.Step]:
    """One batch of transfers as steps: the plain copies share one batched copy, the
    rest go one by one."""
    out: list[st.Step] = []
    copies: list[Transfer] = []
    for i in item:
        t = plan.steps[i]
        how = st.route(layouts[t.src], t.layout, fresh=i in shared)
        if how == st.PLAIN_COPY:
            copies.append(t)
        else:
            out.append(_transfer_step(how, t, devices, (), None, "run"))
    if copies:
        out.append(st.BatchedCopy([layout_sharding(t.layout, devices) for t in copies],
                                  [t.src for t in copies], [t.dst for t in copies]))
    return out


def _transfer_slots(plan: Plan, consumed: dict) -> dict[int, list[int]]:
    """Slot -> the transfers dispatched there in one batch (slot j: just before step j).

    Each transfer's latest slot is its destination's first reader or the first later
    call that donates its source; the fewest slots that cover every range win.
    """
    n = len(plan.steps)
    first_read: dict[int, int] = {}
    for i, s in enumerate(plan.steps):
        for v in st.reads(s):
            first_read.setdefault(v, i)
    gone: dict[int, list[int]] = {}  # value -> calls that donate it
    for i, values in consumed.items():
        for v in values:
            gone.setdefault(v, []).append(i)
    moved_by = {s.dst for s in plan.steps if isinstance(s, Transfer)}
    ranges = []  # (latest slot, transfer index)
    for i, s in enumerate(plan.steps):
        if isinstance(s, Transfer):
            hi = min([first_read.get(s.dst, n), *(j for j in gone.get(s.src, ()) if j > i)])
            ranges.append((hi, i, s.src in moved_by))
    before: dict[int, list[int]] = {}
    point = None
    for hi, i, chained in sorted(ranges):
        if chained:  # reads another transfer: its own batch, later
            before.setdefault(hi, []).append(i)
        elif point is not None and i <= point:
            before[point].append(i)
        else:
            point = hi
            before.setdefault(point, []).append(i)
    return before


def _dispatch_order(plan: Plan, before: dict[int, list[int]]) -> list[int | list[int]]:
    """Calls in plan order, each batch of transfers in its slot."""
    n = len(plan.steps)
    order: list[int | list[int]] = []  # a call's step index, or a batch of transfers
    for i in range(n + 1):
        if i in before:
            order.append(before[i])
        if i < n and isinstance(plan.steps[i], Call):
            order.append(i)
    return order


def _last_reads(plan: Plan, order: list[int | list[int]]) -> dict[int, int]:
    """Value -> position in ``order`` of its last reader: when it can be dropped."""
    last_read: dict[int, int] = {}
    for k, item in enumerate(order):
        for i in (item if isinstance(item, list) else [item]):
            for v in st.reads(plan.steps[i]):
                last_read[v] = k
    return last_read
