"""Compile every fragment once on its submesh and dispatch a plan asynchronously.

Each fragment compiles through jax's own ``pxla.UnloadedMeshExecutable`` path,
so it takes and returns ordinary ``jax.Array``s. Dispatch never blocks: jax's
async dispatch queues work per device, ``jax.device_put`` moves arrays between
submeshes, and references to intermediates are dropped right after their last
use so their buffers are freed as soon as the device is done with them.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Set

import jax
import numpy as np
from jax.core import ShapedArray
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src import callbacks, jax_compat
from multimesh._src.caches import LRUCache
from multimesh._src.log import compile_log_level, logger
from multimesh._src.mlir import element_dtype, make_context, parse_module
from multimesh.runtime.guards import check_args
from multimesh.runtime.parallel import map_ordered
from multimesh.runtime.plan import Call, Fragment, Layout, Plan, Transfer, moved

# Compiled fragments by (text, device ids, donors), shared by every program; emptied
# by jax.clear_caches() / multimesh.clear_caches().
_COMPILE_CACHE = LRUCache("multimesh compiled fragments", max_size=512)
SKIP = object()
"""A step this process does not run (see ``distributed.ProcessPlan.step``)."""
_LOCK = threading.Lock()
xla_compiles = 0
"""How many fragment executables XLA has compiled in this process (for tests/benchmarks)."""


def layout_sharding(layout: Layout, devices: tuple) -> NamedSharding:
    pos, names, sizes, dims = layout
    mesh = Mesh(np.array([devices[p] for p in pos], dtype=object).reshape(sizes), names)
    spec = PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in dims])
    return NamedSharding(mesh, spec)


def _aval(t):
    shape, dtype = t
    return ShapedArray(shape, _dtype(dtype))


def _dtype(s: str) -> np.dtype:
    return element_dtype(s)


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

    def rel(lay: Layout) -> tuple:
        return (tuple(home.index(p) if p in home else -1 - p for p in lay[0]), *lay[1:])
    return (text, donors, len(home), tuple(map(rel, frag.in_layouts)),
            tuple(map(rel, frag.out_layouts)))


def _compile_one(frag: Fragment, devices: tuple, donors: tuple[int, ...] = (),
                 positions: tuple[int, ...] | None = None, like=None
                 ) -> tuple[jax.stages.Compiled, str]:
    """:func:`compile_fragment`, and where the executable came from (:data:`XLA`, ...).

    ``like``: the executable of a fragment with the same :func:`_shape_key` on other
    devices; loaded onto these devices instead of compiling, where jax can.
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


def _xla_compile(frag: Fragment, donors: tuple[int, ...], in_sh, out_sh, sub: tuple
                 ) -> tuple[jax.stages.Compiled, str]:
    module = parse_module(frag.text, make_context())
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


def _compile_all(jobs: list[Job], devices: tuple
                 ) -> list[tuple[jax.stages.Compiled, str, float]]:
    """``(executable, origin, seconds)`` of every job, in order.

    Each distinct executable is made once: fragments that differ only in their devices
    compile once and the others load that executable (:func:`_shape_key`); the ones
    that compile, compile concurrently (:mod:`.parallel`), then the rest load.
    """
    first: dict[tuple, int] = {}
    for j, (frag, donors, positions) in enumerate(jobs):
        first.setdefault(_fragment_key(frag, devices, donors, positions), j)
    leaders: dict[tuple, int] = {}
    for j in first.values():
        leaders.setdefault(_shape_key(jobs[j][0], jobs[j][1]), j)
    lead = list(leaders.values())
    done: dict[int, tuple[jax.stages.Compiled, str, float]] = {}
    # Only an executable XLA compiled in this process can be loaded elsewhere (jax
    # 0.10.2's CPU client re-serializes a loaded one without its code); with jax's
    # persistent cache on, each fragment compiles for its own cache entry, so that a
    # restarted process loads them all.
    share = not jax_compat.persistent_cache_on()

    def timed(j: int) -> tuple[jax.stages.Compiled, str, float]:
        frag, donors, positions = jobs[j]
        like = done.get(leaders[_shape_key(frag, donors)])
        t0 = time.perf_counter()
        exe, origin = _compile_one(frag, devices, donors, positions,
                                   like[0] if share and like and like[1] == XLA else None)
        return exe, origin, time.perf_counter() - t0

    done.update(zip(lead, map_ordered(timed, lead)))
    rest = [j for j in first.values() if j not in done]
    done.update(zip(rest, map_ordered(timed, rest)))
    return [done[j] if j in done else (done[first[k]][0], MEMORY, 0.0)
            for j, k in enumerate(_fragment_key(f, devices, d, p) for f, d, p in jobs)]


_shard_args = jax_compat.shard_args
_REUSE = [jax_compat.REUSE_INPUT]
_COPY = [jax_compat.ALWAYS_COPY]
_NO_LAYOUT = [None]


def _move(x, sharding):
    """``jax.device_put(x, sharding)`` for a jax.Array, minus its Python overhead.

    ``shard_args`` is what jit uses to place arguments: it copies a same-layout
    array to other devices in one batched call and reshards otherwise (~7 µs of
    Python here versus ~35 µs for ``device_put``).
    """
    return _shard_args([sharding], _NO_LAYOUT, _REUSE, [x])[0]


def _copy(x, sharding):
    """:func:`_move` into fresh buffers, for a source that is donated later in the step.

    A move onto devices the source also lives on reuses the source's buffers there
    (whatever the copy semantics), so the moved array is copied once more.
    """
    return _shard_args([sharding], _NO_LAYOUT, _COPY, [_move(x, sharding)])[0]


def _mark_donors(module, donors) -> None:
    from multimesh._src.ir_util import update_attr_dicts
    from multimesh._src.mlir import ir

    with module.context:
        for op in module.body.operations:
            op = op.operation
            if op.name != "func.func":
                continue
            donor = {"jax.buffer_donor": ir.BoolAttr.get(True)}
            n_args = len(op.regions[0].blocks[0].arguments)
            update_attr_dicts(op, "arg_attrs", {k: donor for k in donors if k < n_args})


class Executor:
    """Runs a :class:`Plan` on a concrete device list.

    Each (fragment, devices) pair compiles once, with the argument donations its
    calls share (a donation only some calls could make is skipped and the donated
    input is deleted after its last use instead). Everything that does not depend
    on the values is decided here: which executable each call runs, which arrays
    each step frees, and which transfers move together. A transfer is dispatched
    as late as its first consumer allows, so the transfers that a point of the
    schedule needs go out in one batched call.
    """

    def __init__(self, plan: Plan, devices: tuple, donated: frozenset[int] = frozenset(),
                 leaf_name=None):
        self.plan = plan
        self.devices = tuple(devices)
        self.donated = donated
        self._leaf_name = leaf_name  # names argument i in errors
        # A donated value returned by the program is not donated: its buffer is the output.
        donated = frozenset(a for a in donated if a not in plan.outputs)
        # Hook (multi-process): this process's share of the plan, or None in one process.
        self.process_plan = _process_plan(plan, self.devices)
        pp = self.process_plan
        before = xla_compiles
        exes = self._compile_calls(donated)
        self.xla_compiles = xla_compiles - before
        """XLA compilations this executor caused (0 when every variant was cached)."""
        self.input_shardings = [layout_sharding(lay, self.devices) for lay in plan.inputs]
        # Inputs no step reads and the program does not return: left where they are
        # (jax.jit's keep_unused=False), not moved onto their sharding at every call.
        self._unread = frozenset(k for k, v in enumerate(plan.input_ids)
                                 if v not in plan.last_use and v not in plan.outputs)
        self.output_shardings = [layout_sharding(lay, self.devices) for lay in plan.out_layouts]
        self._steps: list[tuple] = []  # (kind, executable or sharding, srcs, dsts, drop)
        self._kept: list = []  # the plan steps this process runs, parallel to _steps
        shared: set[int] = set()  # transfers of a donated input onto its own devices
        for i, s in enumerate(plan.steps):
            # Hook (multi-process): skip steps without our devices; cross-process moves
            # become steps of their own (a callable, dispatched like a fragment).
            mover = pp.step(s) if pp is not None else None
            if mover is SKIP:
                continue
            self._kept.append(s)
            if isinstance(s, Call):
                drop = [a for a in set(s.args) if plan.last_use.get(a) == i
                        and a not in plan.outputs]
                self._steps.append((0, exes[i], s.args, s.results, drop))
            else:
                drop = [s.src] if plan.last_use.get(s.src) == i and s.src not in plan.outputs \
                    else []
                if mover is not None:
                    self._steps.append((0, mover, [s.src], [s.dst], drop))
                    continue
                if s.src in donated and set(s.layout[0]) & set(plan.inputs[s.src][0]):
                    shared.add(i)
                self._steps.append((2 if i in shared else 1,
                                    layout_sharding(s.layout, self.devices), [s.src],
                                    [s.dst], drop))
        self.transfer_count = sum(1 for s in plan.steps if not isinstance(s, Call))
        n_values = 1 + max([*plan.input_ids, *plan.constants,
                            *(v for st in plan.steps for v in
                              (st.results if isinstance(st, Call) else [st.dst]))], default=0)
        self._env_template = [None] * n_values
        for vid, (value, lay) in plan.constants.items():  # the microbatch indices
            if pp is None or pp.owns(lay[0]):
                self._env_template[vid] = jax.device_put(np.int32(value),
                                                         layout_sharding(lay, self.devices))
        # One process: the precomputed dispatch program (batched transfers). Several
        # processes dispatch step by step (cross-process movers, skipped steps).
        self._program = (_program(plan, exes, self._steps, self._skipped_donations,
                                  self._consumed, shared) if pp is None else None)
        self.batched_transfers = (sum(1 for op in self._program if op[0] == 1)
                                  if self._program is not None else self.transfer_count)
        """Batched copy calls per run (each moves one or more arrays)."""

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
        self.exes: dict[str, jax.stages.Compiled] = {}
        """Fragment name -> one of its executables (for cost and memory analysis)."""
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
        for ((name, _), calls), (frag, common_t, _), (exe, origin, secs) in zip(
                wants.items(), jobs, results):
            common = set(common_t)
            self.xla_seconds[name] = self.xla_seconds.get(name, 0.0) + secs
            self.xla_sources[name] = min(self.xla_sources.get(name, MEMORY), origin,
                                         key=_ORIGINS.index)
            self.exes.setdefault(name, exe)
            for i, donors in calls:
                exes[i] = exe
                skipped = [plan.steps[i].args[k] for k in donors if k not in common]
                if skipped:
                    self._skipped_donations[i] = skipped
                args = plan.steps[i].args
                self._consumed[i] = {args[k] for k in donors} | {
                    args[k] for k in frag.donors}
        return exes

    def place_inputs(self, args):
        if self.process_plan is not None:  # Hook: inputs may live on other processes
            return self.process_plan.place_inputs(args, self.input_shardings)
        out = []
        for k, (a, sh) in enumerate(zip(args, self.input_shardings)):
            s = getattr(a, "sharding", None)
            if s is not sh and k not in self._unread:
                a = _move(a, sh) if isinstance(a, jax.Array) else jax.device_put(a, sh)
            out.append(a)
        return out

    def _start(self, args) -> list:
        """The value list of one run, holding its placed inputs (checked first).

        Values live in a flat list indexed by value id; a slot is cleared after the
        value's last use so its buffer can be freed while the step still runs.
        """
        check_args(args, self.donated, self._leaf_name)
        env = self._env_template.copy()
        for i, a in zip(self.plan.input_ids, self.place_inputs(args)):
            env[i] = a
        return env

    def __call__(self, *args):
        env = self._start(args)
        if self._program is None:
            return self._run_steps(env)
        get = env.__getitem__
        copy = jax_compat.batched_copy
        for kind, what, srcs, dsts, delete, drop in self._program:
            if kind == 0:  # a call: `what` is its dispatch function
                outs = what(*map(get, srcs))
                for d, o in zip(dsts, outs):
                    env[d] = o
                if delete:  # donated, but this call's executable cannot reuse them
                    for d in delete:
                        env[d].delete()
            elif kind == 1:  # plain copies: `what` is (device lists, shardings, semantics)
                for d, o in zip(dsts, copy(list(map(get, srcs)), *what)):
                    env[d] = o
            else:  # a reshard (2) or a fresh copy (3) of one array onto sharding `what`
                env[dsts] = (_move if kind == 2 else _copy)(env[srcs], what)
            for d in drop:
                env[d] = None
        return self._outputs(env)

    def _run_steps(self, env):
        """Dispatch step by step (several processes: hooks decide each step)."""
        for kind, what, srcs, dsts, drop in self._steps:
            if kind == 0:
                outs = what(*[env[a] for a in srcs])
                for d, o in zip(dsts, outs):
                    env[d] = o
            else:
                env[dsts[0]] = (_move if kind == 1 else _copy)(env[srcs[0]], what)
            for d in drop:
                env[d] = None
        return self._outputs(env)

    def _outputs(self, env):
        outs = [env[o] for o in self.plan.outputs]
        if self.process_plan is not None:  # Hook: outputs that live on other processes
            outs = self.process_plan.finish(outs, self.output_shardings)
        return outs

    def run_traced(self, recorder, *args):
        """Like ``__call__`` but blocks after every step and records its span."""
        env = self._start(args)
        for (kind, what, srcs, dsts, drop), step in zip(self._steps, self._kept):
            if kind == 0 and isinstance(step, Transfer):  # a cross-process transfer
                ids = ",".join(str(self.devices[p].id) for p in step.layout[0])
                with recorder.span(f"submesh devices {ids}", f"transfer %{step.src}",
                                   cat="transfer"):
                    env[dsts[0]] = jax.block_until_ready(what(env[srcs[0]])[0])
            elif kind == 0:
                where = self.plan.call_devices(step)
                track = f"submesh devices {','.join(str(self.devices[p].id) for p in where)}"
                with recorder.span(track, step.fragment):
                    outs = jax.block_until_ready(what(*[env[a] for a in srcs]))
                for d, o in zip(dsts, outs):
                    env[d] = o
            else:
                ids = ",".join(str(self.devices[p].id) for p in step.layout[0])
                with recorder.span(f"submesh devices {ids}", f"transfer %{step.src}",
                                   cat="transfer"):
                    env[dsts[0]] = jax.block_until_ready(
                        (_move if kind == 1 else _copy)(env[srcs[0]], what))
            for d in drop:
                env[d] = None
        return self._outputs(env)


def _process_plan(plan: Plan, devices: tuple):
    """This process's share of ``plan`` under jax.distributed; None in a single process."""
    if jax.process_count() == 1:
        return None
    from multimesh.runtime.distributed import ProcessPlan

    return ProcessPlan(plan, devices)


def _program(plan: Plan, exes: dict, steps: list, skipped: dict,
             consumed: dict, shared: Set[int] = frozenset()) -> list[tuple]:
    """The steps of one run as flat tuples for :meth:`Executor.__call__`.

    Calls keep the plan's order. A transfer may go anywhere between its place in
    the plan and its first reader (a call, another transfer, or the end of the run),
    but never past a call that donates its source (``consumed``: call -> values).
    The fewest points that cover every transfer's range are chosen (interval
    stabbing), and the transfers at one point that only copy shards to other devices
    (same layout, other devices) go out in one
    ``batched_copy_array_to_devices_with_sharding`` call: the arrays that one point of
    the schedule needs cross in one host call. A transfer of a donated input onto its
    own devices (``shared``) gets fresh buffers (:func:`_copy`), never a batched copy.
    """
    order = _dispatch_order(plan, _transfer_slots(plan, consumed))
    last_read = _last_reads(plan, order)
    outputs = set(plan.outputs)
    layout = _value_layouts(plan)

    def drops(k: int, reads) -> tuple[int, ...]:
        return tuple(sorted({v for v in reads if last_read.get(v) == k and v not in outputs}))

    program: list[tuple] = []
    for k, item in enumerate(order):
        if isinstance(item, list):
            ops = _transfer_ops(plan, item, steps, layout, shared)
            ops[-1] = ops[-1][:-1] + (drops(k, [plan.steps[i].src for i in item]),)
            program.extend(ops)
            continue
        s = plan.steps[item]
        assert isinstance(s, Call)
        program.append((0, jax_compat.dispatcher(exes[item]), tuple(s.args), tuple(s.results),
                        tuple(skipped.get(item, ())), drops(k, s.args)))
    return program


def _reads(s: Call | Transfer) -> list[int]:
    """The values one plan step reads."""
    return s.args if isinstance(s, Call) else [s.src]


def _transfer_slots(plan: Plan, consumed: dict) -> dict[int, list[int]]:
    """Slot -> the transfers dispatched there in one batch (slot j: just before step j).

    Each transfer's latest slot is its destination's first reader or the first later
    call that donates its source; the fewest slots that cover every range win.
    """
    n = len(plan.steps)
    first_read: dict[int, int] = {}
    for i, s in enumerate(plan.steps):
        for v in _reads(s):
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
            for v in _reads(plan.steps[i]):
                last_read[v] = k
    return last_read


def _transfer_ops(plan: Plan, item: list[int], steps: list, layout: dict[int, Layout],
                  shared: Set[int]) -> list[tuple]:
    """One batch of transfers as ops (kind, what, srcs, dsts, delete, drop), as for a call.

    Plain copies (same layout, other devices) share one batched copy; the rest,
    and donated inputs onto their own devices (``shared``), go one by one.
    """
    transfers = [plan.steps[i] for i in item]
    shardings = [steps[i][1] for i in item]
    copies = [j for j, t in enumerate(transfers) if item[j] not in shared
              and _plain_copy(layout[t.src], t.layout)]
    ops: list[tuple] = [(3 if item[j] in shared else 2, sh, t.src, t.dst, (), ())
                        for j, (t, sh) in enumerate(zip(transfers, shardings))
                        if j not in copies]
    if copies:
        ops.append((1, ([jax_compat.device_list(shardings[j]) for j in copies],
                        [shardings[j] for j in copies],
                        [jax_compat.REUSE_INPUT] * len(copies)),
                    tuple(transfers[j].src for j in copies),
                    tuple(transfers[j].dst for j in copies), (), ()))
    return ops


def _value_layouts(plan: Plan) -> dict[int, Layout]:
    """Where every value of one run lives."""
    out: dict[int, Layout] = dict(zip(plan.input_ids, plan.inputs))
    out.update({vid: lay for vid, (_, lay) in plan.constants.items()})
    for s in plan.steps:
        if isinstance(s, Call):
            frag = plan.fragments[s.fragment]
            for r, lay in zip(s.results, frag.out_layouts):
                out[r] = moved(lay, frag.devices, s.devices) if s.devices else lay
        else:
            out[s.dst] = s.layout
    return out


def _plain_copy(src: Layout | None, dst: Layout) -> bool:
    """Whether moving from ``src`` to ``dst`` only copies each shard to another device:
    the same mesh shape and per-dimension axes (then shard ``i`` goes to device ``i``)."""
    return src is not None and src[1:] == dst[1:] and len(src[0]) == len(dst[0])

