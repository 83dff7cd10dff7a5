"""Run a plan under ``jax.distributed``: one process per host, every process the same plan.

Each process keeps the steps that touch its own devices (:class:`ProcessPlan`):

* a fragment call runs where its submesh has a device; a submesh spread over
  several processes is ordinary multi-controller SPMD for that fragment;
* a transfer between submeshes of this process stays a local ``device_put``;
  one that crosses processes is a small collective program over the union of the
  two submeshes (:class:`CrossTransfer`), run by every process that owns one of
  its devices;
* everything else is skipped. A value this process never holds is an ordinary
  global ``jax.Array`` with no addressable shards when it is an output.

Why a collective and not ``jax.experimental.transfer`` or cross-host
``device_put``: on jax 0.10.2 it needs no flags set before
``jax.distributed.initialize``, reshards in the same step, works for submeshes
that span processes, and measured fastest at 64 MB (docs/performance.md). Every
process dispatches the plan's steps in the same order, so the collectives of one
step meet in the same order everywhere.

Cross-process steps complete before the next one: the host waits for each
cross-process transfer to finish before it dispatches the following step. With
several such collectives in flight, each waiting for a different peer, jax's CPU
client deadlocked (4 processes, 1F1B over 8 microbatches; in-flight executions hold
its threads while they wait). Finishing each one in the plan's global order is the
blocking-send discipline that cannot deadlock; fragments still run asynchronously.

A dead peer: collectives with it fail at once, but a process that waits elsewhere
would only be stopped by jax's heartbeat abort (100 s by default). A watchdog
thread (:func:`start_watchdog`) keeps a heartbeat in jax's key-value store and
stops this process with a message naming the peer that went silent.
"""

from __future__ import annotations

import atexit
import enum
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src import jax_compat
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh._src.mlir import element_dtype
from multimesh.runtime.plan import Call, Plan, Transfer
from multimesh.runtime.steps import layout_sharding
from multimesh.runtime.steps import move as _move

__all__ = ["ProcessPlan", "CrossTransfer", "Route", "transfer_route", "cross_move", "fetch", "checkpointable",
           "one_per_process", "from_process_local", "is_multiprocess", "owner_init",
           "remote_array", "start_watchdog", "peer_timeout", "PEER_TIMEOUT_ENV",
           "EXIT_PEER_LOST"]

PEER_TIMEOUT_ENV = "MULTIMESH_PEER_TIMEOUT"
"""Seconds without a heartbeat after which a peer process counts as dead (default 20)."""
EXIT_PEER_LOST = 75
"""Exit status of a process stopped because a peer died (EX_TEMPFAIL)."""


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def remote_array(shape, dtype, sharding) -> jax.Array:
    """A global array of ``shape``/``dtype`` on ``sharding`` with this process's shards only.

    In a process that owns none of ``sharding``'s devices this is jax's ordinary
    array without addressable shards (``.is_fully_addressable`` False, values
    not fetchable here).
    """
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [],
                                                    dtype=np.dtype(dtype))


# --------------------------------------------------------------------------- transfers


def _procs(devices) -> set[int]:
    return {d.process_index for d in devices}


class Route(enum.StrEnum):
    """How this process takes part in moving a value from one device set to another
    (:func:`transfer_route`, the one place that decides)."""

    SKIP = "skip"
    """This process holds none of the devices: nothing to do (or an array without
    shards here)."""
    LOCAL = "local"
    """Every device is this process's: an ordinary ``jax.device_put``."""
    RESHARD = "reshard"
    """One device set spanning processes: jax's reshard, a collective over it."""
    PAIRED = "paired"
    """Two device sets of one size: a union collective, source shard k to destination
    device k (:class:`CrossTransfer`)."""
    REPLICATED = "replicated"
    """Two device sets of other sizes: whole copies sent over a union collective, then
    sliced on arrival (:class:`CrossTransfer`)."""


def transfer_route(src: Sequence, dst: Sequence, *, me: int | None,
                   named: bool = True) -> Route:
    """The route of a move from devices ``src`` to devices ``dst`` (each in its sharding's
    order; anything with a ``process_index``) for process ``me``, or, with ``me`` None,
    the collective a move across processes takes (the same in every process: never
    :attr:`Route.SKIP` or :attr:`Route.LOCAL`). ``named``: the destination is a
    ``NamedSharding``, whose mesh a :attr:`Route.PAIRED` move keeps. ``cross_move``,
    :class:`ProcessPlan` and :class:`CrossTransfer` all ask here."""
    if me is not None:
        procs = _procs(src) | _procs(dst)
        if me not in procs:
            return Route.SKIP
        if procs == {me}:
            return Route.LOCAL
    if set(src) == set(dst):
        return Route.RESHARD
    return Route.PAIRED if named and len(set(src)) == len(set(dst)) else Route.REPLICATED


def _reshard(x: jax.Array, sharding) -> jax.Array:
    """``x`` onto ``sharding`` over the same device set (a collective if it spans processes)."""
    if x.sharding == sharding:
        return x
    if x.sharding.is_equivalent_to(sharding, x.ndim):  # same shards: relabel, no copy
        return jax.make_array_from_single_device_arrays(
            x.shape, sharding, [s.data for s in x.addressable_shards], dtype=x.dtype)
    if not sharding.has_addressable_devices:  # nothing to do here (jax would crash on it)
        return remote_array(x.shape, x.dtype, sharding)
    if x.is_fully_addressable and sharding.is_fully_addressable:
        return _move(x, sharding)
    return jax.device_put(x, sharding)


def _pair_up(src: Sequence, dst: Sequence) -> list:
    """A source device for each destination device, one-to-one (``len(src) == len(dst)``).

    A destination that is also a source keeps its own data; otherwise a source in
    the same process is preferred, so as few bytes as possible cross processes.
    """
    free = list(src)
    out: list = [None] * len(dst)
    for k, d in enumerate(dst):
        if d in free:
            out[k] = d
            free.remove(d)
    for k, d in enumerate(dst):
        if out[k] is None:
            same = [s for s in free if s.process_index == d.process_index]
            if same:
                out[k] = same[0]
                free.remove(same[0])
    for k in range(len(dst)):
        if out[k] is None:
            out[k] = free.pop(0)
    return out


def _rounds(senders: Sequence[int], receivers: Sequence[int]):
    """Split (sender, receiver) index pairs into permutation rounds (a sender once per round)."""
    rounds: list[list[tuple[int, int]]] = []
    for s, r in zip(senders, receivers):
        for rnd in rounds:
            if all(a != s for a, _ in rnd):
                rnd.append((s, r))
                break
        else:
            rounds.append([(s, r)])
    return tuple(tuple(r) for r in rounds)


_PROGRAMS: dict[tuple, Callable] = {}
_DUMMIES: dict[tuple, jax.Array] = {}
_LOCK = threading.Lock()


def _union_program(union: tuple, rounds: tuple) -> Callable:
    """A jitted ``shard_map`` over the union devices: each round one ``ppermute``."""
    key = (tuple(d.id for d in union), rounds)
    with _LOCK:
        cached = _PROGRAMS.get(key)
    if cached is not None:
        return cached
    mesh = Mesh(np.array(union, dtype=object), ("u",))
    recv_round = [0] * len(union)
    for r, perm in enumerate(rounds):
        for _, dst in perm:
            recv_round[dst] = r

    def body(block):
        if len(rounds) == 1:
            return lax.ppermute(block, "u", rounds[0])
        rid = jnp.asarray(recv_round, jnp.int32)[lax.axis_index("u")]
        out = block
        for r, perm in enumerate(rounds):
            out = jnp.where(rid == r, lax.ppermute(block, "u", perm), out)
        return out

    jitted = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("u"),
                                   out_specs=PartitionSpec("u")))

    def prog(*args):
        # the caller's mesh (jax.set_mesh around the step) is not this program's
        with jax_compat.mesh_scope(None):
            return jitted(*args)

    with _LOCK:
        _PROGRAMS[key] = prog
    return prog


def _dummy(shape, dtype, device) -> jax.Array:
    """A cached zero block: what a receiving device feeds into the union program."""
    key = (tuple(shape), np.dtype(dtype).str, device.id)
    with _LOCK:
        z = _DUMMIES.get(key)
    if z is None:
        z = jax.device_put(np.zeros(shape, dtype), device)
        with _LOCK:
            _DUMMIES[key] = z
    return z


class CrossTransfer:
    """Move a value from one sharding to another when the move crosses processes.

    Three parts, each run only by the processes that hold its devices:

    1. on the source devices, reshard to ``mid``: the destination's layout on the
       source devices (or, when the two submeshes differ in size, replicated);
    2. on the union of both device sets, one ``ppermute`` per round: source
       device k's block goes to destination device k;
    3. on the destination devices, when ``mid`` was replicated, slice to the
       destination layout (no communication).
    """

    def __init__(self, src_sharding, dst_sharding: NamedSharding, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.dst = dst_sharding
        src_devs = list(jax_compat.device_assignment(src_sharding))
        dst_devs = list(jax_compat.device_assignment(dst_sharding))
        me = jax.process_index()
        self.on_src = me in _procs(src_devs)
        self.on_dst = me in _procs(dst_devs)
        ndim = len(self.shape)
        named = isinstance(dst_sharding, NamedSharding)
        route = transfer_route(src_devs, dst_devs, me=None, named=named)  # as every process
        if route is Route.PAIRED or (route is Route.RESHARD and named):  # shard to shard
            assert isinstance(dst_sharding, NamedSharding)
            pairs = _pair_up(src_devs, dst_devs)
            self.mid = NamedSharding(
                Mesh(np.array(pairs, dtype=object).reshape(dst_sharding.mesh.devices.shape),
                     dst_sharding.mesh.axis_names), dst_sharding.spec)
            self.landing = dst_sharding
            senders = pairs
        else:  # replicate on the source side, send whole copies, slice on arrival
            self.mid = NamedSharding(Mesh(np.array(src_devs, dtype=object), ("s",)),
                                     PartitionSpec())
            self.landing = NamedSharding(Mesh(np.array(dst_devs, dtype=object), ("d",)),
                                         PartitionSpec())
            senders = _pair_up_many(src_devs, dst_devs)
        self.block = tuple(self.mid.shard_shape(self.shape))
        union = list(src_devs) + [d for d in dst_devs if d not in set(src_devs)]
        index = {d: i for i, d in enumerate(union)}
        self.union = tuple(union)
        self.rounds = _rounds([index[s] for s in senders], [index[d] for d in dst_devs])
        self.src_set = set(src_devs)
        self.dst_set = set(dst_devs)
        self.local = [d for d in union if d.process_index == me]
        self.scalar = ndim == 0
        flat_block = (1,) if self.scalar else self.block
        self.union_sharding = NamedSharding(Mesh(np.array(union, dtype=object), ("u",)),
                                            PartitionSpec("u"))
        self.union_shape = (len(union) * flat_block[0],) + tuple(flat_block[1:])
        self.flat_block = flat_block
        self.program = _union_program(self.union, self.rounds)

    def __call__(self, x: jax.Array | None) -> jax.Array | None:
        blocks = {}
        if self.on_src:
            assert x is not None  # a process that holds the source passes it
            x = _reshard(x, self.mid)
            for s in x.addressable_shards:
                data = s.data
                blocks[s.device] = data.reshape(1) if self.scalar else data
        arrays = [blocks[d] if d in blocks else
                  _dummy(self.flat_block, self.dtype, d) for d in self.local]
        y = self.program(jax.make_array_from_single_device_arrays(
            self.union_shape, self.union_sharding, arrays))
        y.block_until_ready()  # see "Cross-process steps complete before the next one"
        if not self.on_dst:
            return None
        got = [s.data.reshape(()) if self.scalar else s.data for s in y.addressable_shards
               if s.device in self.dst_set]
        out: jax.Array = jax.make_array_from_single_device_arrays(self.shape, self.landing, got)
        if self.landing is not self.dst:
            out = _reshard(out, self.dst)
        return out


def _pair_up_many(src: Sequence, dst: Sequence) -> list:
    """A source device for each destination device; a source may serve several.

    Used when every source holds a whole copy: a destination that is a source
    serves itself, else a source in its own process, else the least used one.
    """
    load = {s: 0 for s in src}
    out = []
    for d in dst:
        if d in load:
            pick = d
        else:
            same = [s for s in src if s.process_index == d.process_index]
            pick = min(same or src, key=lambda s: load[s])
        load[pick] += 1
        out.append(pick)
    return out


_MOVES: dict[tuple, CrossTransfer] = {}


def cross_move(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``jax.device_put(x, sharding)`` for a global array, also between processes.

    Every process that owns a device of ``x`` or of ``sharding`` must call it (as
    for any collective). A process that owns none of ``sharding``'s devices gets an
    array without addressable shards.
    """
    if not isinstance(x, jax.Array):
        raise MultimeshTypeError(
            f"cross_move moves a jax.Array, got {type(x).__name__}; place host data with "
            f"jax.device_put(value, sharding) instead.")
    if not isinstance(sharding, jax.sharding.Sharding):
        raise MultimeshTypeError(
            f"cross_move needs a jax.sharding.Sharding to move onto, got "
            f"{type(sharding).__name__}.")
    src = x.sharding
    if src == sharding:
        return x
    route = transfer_route(jax_compat.device_assignment(src),
                           jax_compat.device_assignment(sharding), me=jax.process_index(),
                           named=isinstance(sharding, NamedSharding))
    if route is Route.SKIP:
        return remote_array(x.shape, x.dtype, sharding)
    if route is Route.LOCAL:
        return _move(x, sharding)
    if route is Route.RESHARD:
        return _reshard(x, sharding)
    key = (src, sharding, x.shape, x.dtype)
    t = _MOVES.get(key)
    if t is None:
        t = _MOVES[key] = CrossTransfer(src, sharding, x.shape, x.dtype)
    if not (t.on_src or t.on_dst):
        return remote_array(x.shape, x.dtype, sharding)
    y = t(x)
    return y if y is not None else remote_array(x.shape, x.dtype, sharding)


def one_per_process() -> NamedSharding:
    """Replicated on the first device of every process: every process holds the value."""
    firsts: dict[int, jax.Device] = {}
    for d in jax.devices():
        firsts.setdefault(d.process_index, d)
    devs = [firsts[k] for k in sorted(firsts)]
    return NamedSharding(Mesh(np.array(devs, dtype=object), ("processes",)), PartitionSpec())


def fetch(tree):
    """Every leaf of ``tree`` as a numpy array, in every process (a collective: all call it).

    Reads a loss that lives on the last stage, or any array another process holds.
    """
    target = one_per_process()

    def one(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_replicated and x.sharding.has_addressable_devices and \
                _procs(x.sharding.device_set) == set(range(jax.process_count())):
            return np.asarray(x.addressable_data(0))
        return np.asarray(cross_move(x, target).addressable_data(0))

    return jax.tree.map(one, tree)


def from_process_local(data, sharding, global_shape) -> jax.Array:
    """``jax.make_array_from_process_local_data`` for a sharding that leaves processes out.

    Process k's ``data`` is rows ``k*L .. (k+1)*L`` of the global array (L rows each),
    as data loaders deal them. When ``sharding`` (a pipeline's first stage, say) does
    not cover every process, the rows are first laid out by process over all devices,
    then moved onto ``sharding``.
    """
    every = set(range(jax.process_count()))
    if not is_multiprocess() or _procs(sharding.device_set) == every:
        return jax.make_array_from_process_local_data(sharding, data, global_shape)
    devs = np.array(jax.devices(), dtype=object).reshape(jax.process_count(), -1)
    spec = PartitionSpec("processes") if len(global_shape) and \
        np.shape(data)[:1] != tuple(global_shape[:1]) else PartitionSpec()
    staged = jax.make_array_from_process_local_data(
        NamedSharding(Mesh(devs, ("processes", "local")), spec), data, global_shape)
    return cross_move(staged, sharding)


def checkpointable(tree):
    """``tree`` with each array that one process holds entirely replicated to every process.

    Orbax refuses to save an array that is fully addressable in one process of a
    multi-process run ("Cannot serialize host local jax.Array"), which is what a
    pipeline stage's parameters on one host are. Arrays that already span processes
    are kept as they are. A collective: every process calls it.
    """
    if not is_multiprocess():
        return tree
    target = one_per_process()

    def one(x):
        if isinstance(x, jax.Array) and len(_procs(x.sharding.device_set)) == 1:
            return cross_move(x, target)
        return x

    return jax.tree.map(one, tree)


# --------------------------------------------------------------------------- plan


def _value_types(plan: Plan) -> dict[int, tuple]:
    """(shape, dtype) of every value the plan's fragments read or write."""
    types: dict[int, tuple] = {}
    for s in plan.steps:
        if isinstance(s, Call):
            f = plan.fragments[s.fragment]
            for v, t in zip(s.args, f.in_types):
                types.setdefault(v, t)
            for v, t in zip(s.results, f.out_types):
                types[v] = t
    for _ in range(2):  # transfers copy types both ways (chains of transfers are short)
        for s in plan.steps:
            if isinstance(s, Transfer):
                if s.src in types:
                    types.setdefault(s.dst, types[s.src])
                elif s.dst in types:
                    types[s.src] = types[s.dst]
    return {v: (tuple(shape), element_dtype(dt)) for v, (shape, dt) in types.items()}


class ProcessPlan:
    """This process's share of a plan: the hooks :class:`~multimesh.runtime.Executor` calls.

    * :meth:`owns` — does a submesh hold a device of this process (compile its fragments)?
    * :meth:`kind` — run or skip a call; a transfer's :class:`Route`;
    * :meth:`mover` — the collective of a move across processes;
    * :meth:`place_inputs` — arguments onto their input shardings, across processes;
    * :meth:`finish` — outputs this process never held, as arrays without shards here.
    """

    def __init__(self, plan: Plan, devices: tuple):
        self.plan = plan
        self.devices = devices
        self.me = jax.process_index()
        self.types = _value_types(plan)
        self.layouts = plan.value_layouts()
        self._mine = [d.process_index == self.me for d in devices]
        start_watchdog()

    def owns(self, positions) -> bool:
        return any(self._mine[p] for p in positions)

    def runs(self, step: Call) -> bool:
        return self.owns(self.plan.call_devices(step))

    def mover(self, step: Transfer, kind: str) -> Callable:
        """``fn(x) -> y`` for a transfer that crosses processes (``kind``, its route:
        :attr:`Route.RESHARD`, or a :attr:`Route.PAIRED` or :attr:`Route.REPLICATED`
        union collective); a collective that every process owning one of its devices
        runs."""
        dst = layout_sharding(step.layout, self.devices)
        if Route(kind) is Route.RESHARD:
            return lambda x: _reshard(x, dst)
        src = layout_sharding(self.layouts[step.src], self.devices)
        shape, dtype = self.types[step.src]
        return CrossTransfer(src, dst, shape, dtype)

    def kind(self, step) -> str:
        """What this process does for ``step``: ``"run"`` or ``"skip"`` a call; a
        transfer's :class:`Route` (:func:`transfer_route`; its destination is a
        ``NamedSharding``, :func:`~.steps.layout_sharding`)."""
        if isinstance(step, Call):
            return "run" if self.runs(step) else "skip"
        if not isinstance(step, Transfer):
            raise MultimeshValueError(
                f"Multi-process runs do not support the plan step {type(step).__name__} yet: "
                f"each process must know which of its devices the step uses.")
        return transfer_route([self.devices[p] for p in self.layouts[step.src][0]],
                              [self.devices[p] for p in step.layout[0]], me=self.me)

    def describe(self) -> str:
        """The plan as this process runs it: one line per step."""
        lines = [f"process {self.me} of {jax.process_count()}, devices "
                 f"{[p for p, m in enumerate(self._mine) if m]} of the program:"]
        for s in self.plan.steps:
            k = self.kind(s)
            if isinstance(s, Call):
                f = self.plan.fragments[s.fragment]
                lines.append(f"  {k:<10} {s.fragment} on {list(f.devices)}")
            else:
                lines.append(f"  {k:<10} transfer %{s.src} {list(self.layouts[s.src][0])} -> "
                             f"{list(s.layout[0])}")
        return "\n".join(lines)

    def place_inputs(self, args, shardings) -> list:
        out = []
        for a, sh in zip(args, shardings):
            s = getattr(a, "sharding", None)
            if s is sh or (s is not None and s == sh):
                out.append(a)
            elif isinstance(a, jax.Array) and a.committed:
                # A global array (as jax treats committed arrays): it may live on other
                # processes, so every process decides the same way from its devices.
                out.append(cross_move(a, sh))
            else:
                # Host data or an uncommitted array: every process holds the whole value
                # and keeps its own devices' shards (jax checks that the processes agree
                # when all of them share the sharding).
                out.append(jax.device_put(a, sh))
        return out

    def finish(self, outputs: list, output_shardings) -> list:
        out = []
        for o, v, sh in zip(outputs, self.plan.outputs, output_shardings):
            if o is None:
                shape, dtype = self.types[v]
                o = remote_array(shape, dtype, sh)
            out.append(o)
        return out


# --------------------------------------------------------------------------- initialization


def owner_init(fn: Callable, shardings, *args):
    """``jax.device_put(fn(*args), shardings)`` without computing what is not ours.

    Leaves are grouped by their sharding's device set; each group is one
    ``jax.jit(fn, out_shardings=...)`` that keeps only that group's outputs, run
    only by the processes that own those devices. Other processes get arrays
    without addressable shards. jit's results do not depend on the output
    sharding, so every leaf has the value ``fn(*args)`` has in one process.
    """
    out_avals = jax.eval_shape(fn, *args)
    leaves, tree = jax.tree.flatten(out_avals)
    sh_leaves = jax.tree.leaves(jax.tree.map(lambda _, s: s, out_avals, shardings),
                                is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    groups: dict[frozenset, list[int]] = {}
    for i, s in enumerate(sh_leaves):
        groups.setdefault(frozenset(s.device_set), []).append(i)
    me = jax.process_index()
    result: list = [None] * len(leaves)
    for devs, idx in groups.items():
        if me not in {d.process_index for d in devs}:
            for i in idx:
                result[i] = remote_array(leaves[i].shape, leaves[i].dtype, sh_leaves[i])
            continue

        def part(*a, idx=idx):
            flat = jax.tree.leaves(fn(*a))
            return [flat[i] for i in idx]

        outs = jax.jit(part, out_shardings=[sh_leaves[i] for i in idx])(*args)
        for i, o in zip(idx, outs):
            result[i] = o
    return jax.tree.unflatten(tree, result)


# --------------------------------------------------------------------------- failures


class _Watchdog:
    """Heartbeats in jax's key-value store; stops this process when a peer goes silent."""

    def __init__(self, client, timeout: float, period: float):
        self.client = client
        self.timeout = timeout
        self.period = period
        self.me = jax.process_index()
        self.n = jax.process_count()
        self.devices_of: dict[int, list[int]] = {}
        for d in jax.devices():  # read now: at exit jax may have torn its backends down
            self.devices_of.setdefault(d.process_index, []).append(d.id)
        self.seen: dict[int, tuple[str, float]] = {}
        self.beat = 0
        self.exiting = False  # set at interpreter exit: RPC errors then mean shutdown
        self.stopped = threading.Event()  # set at interpreter exit: the thread returns
        self.thread = threading.Thread(target=self._run, name="multimesh-watchdog", daemon=True)

    def leave(self) -> None:
        """At interpreter exit, before jax's shutdown: stop the thread and tell the peers
        that this process is exiting, so that none counts its silence (it may wait in
        jax's shutdown barrier for slower peers) as death. The thread must not be inside
        one of jaxlib's calls when the interpreter finalizes: a daemon thread that
        takes the GIL back then is unwound through C++ that cannot unwind, and the
        process aborts (exit 134, "FATAL: exception not rethrown") after its work."""
        self.exiting = True
        self.stopped.set()
        self.thread.join(timeout=max(10.0, 2 * self.period))
        try:
            self.client.key_value_set(f"{_ALIVE}{self.me}", _EXITING, allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordination service is already gone
            pass

    def _alive(self) -> bool:
        return jax_compat.distributed_client() is self.client

    def _run(self) -> None:
        prefix = _ALIVE
        while self._alive() and not self.stopped.is_set():
            now = time.monotonic()
            try:
                self.beat += 1
                self.client.key_value_set(f"{prefix}{self.me}", str(self.beat),
                                          allow_overwrite=True)
                entries = dict(self.client.key_value_dir_get("multimesh/"))
            except Exception as e:  # shutting down, or the coordination service is gone
                self.stopped.wait(self.period)
                if self.exiting or not self._alive():
                    return
                self._stop(f"it lost the jax.distributed coordination service, hosted by "
                           f"process 0 ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                           [0])
                return
            failed = [(int(k.rsplit("/", 1)[1]), v) for k, v in entries.items()
                      if k.startswith("multimesh/failed/")]
            failed = [(k, v) for k, v in failed if k != self.me]
            if failed:
                k, why = failed[0]
                self._stop(f"process {k} of {self.n} failed: {why}", [k])
                return
            for k in range(self.n):
                val = entries.get(f"{prefix}{k}")
                if k == self.me or val is None or val == _EXITING:  # judged after its
                    continue  # first beat, and no longer once it exits
                last = self.seen.get(k)
                if last is None or last[0] != val:
                    self.seen[k] = (val, now)
                elif now - last[1] > self.timeout:
                    self._stop(f"process {k} of {self.n} sent no heartbeat for "
                               f"{now - last[1]:.0f} s (it has died or hangs)", [k])
                    return
            self.stopped.wait(self.period)

    def _stop(self, why: str, peers: list[int]) -> None:
        devs = [i for k in peers for i in self.devices_of.get(k, [])]
        msg = (f"multimesh: process {self.me} is stopping because {why} (its devices: "
               f"{devs}). The multi-process program cannot go on without it; exiting with "
               f"status {EXIT_PEER_LOST}.")
        try:
            sys.stdout.flush()
        finally:
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()
            os._exit(EXIT_PEER_LOST)


_WATCHDOG: _Watchdog | None = None
_ALIVE, _EXITING = "multimesh/alive/", "exiting"
"""The heartbeats' keys in jax's key-value store, and the value a process leaves there
as it exits (:meth:`_Watchdog.leave`)."""


def peer_timeout() -> float:
    """Seconds of silence after which a peer counts as dead: ``$MULTIMESH_PEER_TIMEOUT``, or 20."""
    raw = os.environ.get(PEER_TIMEOUT_ENV, "20")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise MultimeshValueError(
            f"{PEER_TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}; for "
            f"example {PEER_TIMEOUT_ENV}=60.")
    return value


def start_watchdog(timeout: float | None = None, period: float = 1.0) -> None:
    """Start the peer watchdog once per process (a no-op in single-process runs).

    ``timeout`` defaults to ``$MULTIMESH_PEER_TIMEOUT`` or 20 seconds.
    """
    global _WATCHDOG
    if _WATCHDOG is not None or not is_multiprocess():
        return
    client = jax_compat.distributed_client()
    if client is None:
        return
    if timeout is None:
        timeout = peer_timeout()
    _WATCHDOG = w = _Watchdog(client, timeout, period)
    atexit.register(w.leave)  # runs before jax's shutdown (registered when jax was imported)
    previous = sys.excepthook

    def excepthook(tp, value, tb):
        """An uncaught exception: tell the peers, then exit without jax's shutdown
        barrier, where this process would wait for peers that wait for it."""
        try:
            previous(tp, value, tb)
        except BaseException:
            sys.stderr.write(f"{tp.__name__}: {value}\n")
        if issubclass(tp, jax.errors.JaxRuntimeError) and w.thread.is_alive():
            # Often a collective whose peer died: give the watchdog the time to name it
            # (it then exits this process); otherwise report this error to the peers.
            sys.stderr.write(f"multimesh: checking the other processes' heartbeats for up "
                             f"to {w.timeout:.0f} s before stopping...\n")
            sys.stderr.flush()
            deadline = time.monotonic() + w.timeout + 3 * w.period
            while time.monotonic() < deadline and w.thread.is_alive():
                time.sleep(0.1)
        try:
            first = (str(value).splitlines() or [""])[0][:300]
            client.key_value_set(f"multimesh/failed/{w.me}", f"{tp.__name__}: {first}",
                                 allow_overwrite=True)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    sys.excepthook = excepthook
    w.thread.start()
