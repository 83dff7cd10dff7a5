"""Costs of a compiled program's fragments, measured steps, and schedule advice.

Two sources of per-fragment seconds feed the schedule simulator
(:mod:`multimesh.schedules.costs`): XLA's cost analysis of each compiled fragment
through a roofline :class:`DeviceModel` (:func:`xla_costs`), and real steps
(:class:`StepProfile`, from ``compiled.profile`` or ``compiled.step_profile``).
:func:`compare_schedules` simulates every registered schedule with them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._analysis.devices import DEVICE_KINDS, DeviceSpec, kind_of_device
from multimesh.runtime.memory import shard_bytes
from multimesh.runtime.plan import Call
from multimesh.runtime.timing import StepTime
from multimesh.schedules import Schedule
from multimesh.schedules.costs import FragmentCosts, ScheduleComparison, compare
from multimesh.schedules.simulator import Timeline

__all__ = ["DeviceModel", "xla_costs", "residual_bytes", "StepProfile", "compare_schedules",
           "edge_bytes", "transfer_costs", "fragment_collectives", "call_seconds",
           "ScheduleComparison",
           "check_step_profile", "profile_from_times", "NO_TASKS"]


@dataclass(frozen=True)
class DeviceModel:
    """The one hardware model of every prediction: the planner (``plan_pipeline``),
    :func:`xla_costs`, :func:`compare_schedules` and the schedule simulator price
    work with it.

    One fragment call takes ``overhead + max(flops / (peak_flops x
    compute_efficiency), bytes / memory_bandwidth)`` seconds (per device; XLA's
    counts are per device: :meth:`roofline_seconds`); moving ``n`` bytes between
    devices takes ``n / link_bandwidth`` seconds (:meth:`transfer_seconds`), and a
    collective its ring's share of that plus ``collective_latency`` per ring step
    (:meth:`collective_seconds`: the alpha-beta model). Nothing else in multimesh
    prices work (tests/test_one_cost_model.py checks).

    :meth:`for_device` gives the documented defaults: datasheet peaks by device kind
    (which real kernels reach only in part, so they rank plans rather than time
    steps) and a CPU guess. :meth:`calibrate` measures the devices at hand instead
    (a matmul's achieved flop/s, a copy's bandwidth, one call's dispatch, a chain of
    tiny all-gathers' latency, and on a host whose device threads share its cores the
    share of a call's compute that its collectives wait for: ``rendezvous``), so
    predicted steps come near measured ones.
    :meth:`to_json` and :meth:`from_json` write and read one (a file without the
    latency fields reads with their defaults).
    """

    peak_flops: float
    memory_bandwidth: float
    overhead: float = 1e-5
    name: str = "custom"
    link_bandwidth: float = 1e10
    compute_efficiency: float = 1.0
    """The fraction of ``peak_flops`` that matmul kernels reach (1: the datasheet's
    peak; a described cluster's kinds carry a published kernel's fraction)."""
    network_bandwidth: float | None = None
    """Bytes per second per device between nodes (None: ``link_bandwidth``)."""
    devices_per_node: int | None = None
    """Devices joined by ``link_bandwidth`` (None: every device)."""
    collective_latency: float = 0.0
    """Seconds each step of a ring collective waits besides its bytes (the alpha of
    the alpha-beta model; 0: bandwidth only). A ring over ``n`` devices runs ``n - 1``
    steps (an all-reduce ``2 (n - 1)``), so one collective pays ``(n - 1) x`` this."""
    network_latency: float | None = None
    """Seconds per ring step of a collective that leaves the node (None:
    ``collective_latency``)."""
    rendezvous: float = 0.0
    """The fraction of a call's compute that its collectives add by waiting for it
    (:meth:`rendezvous_seconds`; 0: none). On XLA:CPU a collective is a rendezvous of
    the devices' threads, and where they outnumber the host's cores it waits for
    every thread's compute since the collective before, so it costs more the more
    work lies between collectives. Only :meth:`calibrate` measures it; an
    accelerator's collective runs on its own links and the datasheet kinds have none."""

    def __post_init__(self):
        if isinstance(self.compute_efficiency, bool) or not isinstance(
                self.compute_efficiency, (int, float)) or not 0 < self.compute_efficiency <= 1:
            raise MultimeshValueError(
                f"DeviceModel: `compute_efficiency` must be a number in (0, 1] (the "
                f"fraction of peak_flops that matmuls reach), got {self.compute_efficiency!r}.")
        for name in ("peak_flops", "memory_bandwidth", "overhead", "collective_latency",
                     "network_latency", "rendezvous"):
            v = getattr(self, name)
            if name == "network_latency" and v is None:
                continue
            low = 0 if name in _SECONDS else None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    (v >= 0 if low == 0 else v > 0) and v < float("inf")):
                raise MultimeshValueError(
                    f"DeviceModel: `{name}` must be a finite number "
                    f"{'>= 0 (' + _SECONDS[name] + ')' if low == 0 else '> 0 (per second)'}, got "
                    f"{v!r}.")

    def roofline_seconds(self, flops: float, bytes_accessed: float) -> float:
        """THE roofline: seconds of ``flops`` and ``bytes_accessed`` on one device,
        without the per-call overhead (``max(flops / (peak_flops x
        compute_efficiency), bytes / memory_bandwidth)``). Every prediction's compute
        comes from here."""
        return max(flops / (self.peak_flops * self.compute_efficiency),
                   bytes_accessed / self.memory_bandwidth)

    def seconds(self, flops: float, bytes_accessed: float) -> float:
        """Seconds of one fragment call: ``overhead`` + :meth:`roofline_seconds`."""
        return self.overhead + self.roofline_seconds(flops, bytes_accessed)

    def bandwidth(self, across_nodes: bool = False) -> float:
        """Bytes per second one device sends: ``link_bandwidth``, or the slower of it
        and ``network_bandwidth`` (one NIC per device) when leaving the node."""
        if across_nodes and self.network_bandwidth is not None:
            return min(self.link_bandwidth, self.network_bandwidth)
        return self.link_bandwidth

    def transfer_seconds(self, nbytes: float, across_nodes: bool = False) -> float:
        """THE transfer cost: seconds to move ``nbytes`` (what one device receives)
        from one device to another, over the link or, ``across_nodes``, the network."""
        return nbytes / self.bandwidth(across_nodes)

    def all_reduce_seconds(self, nbytes: float, devices: int,
                           across_nodes: bool = False) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``devices`` devices:
        :meth:`collective_seconds` ``("all-reduce", ...)``."""
        return self.collective_seconds("all-reduce", nbytes, devices, across_nodes)

    def latency(self, across_nodes: bool = False) -> float:
        """Seconds one ring step of a collective waits besides its bytes:
        ``collective_latency``, or ``network_latency`` when the ring leaves the node."""
        if across_nodes and self.network_latency is not None:
            return self.network_latency
        return self.collective_latency

    def collective_seconds(self, op: str, nbytes: float, devices: int,
                           across_nodes: bool = False, count: int = 1) -> float:
        """THE collective model (alpha-beta, as NCCL's own tuning model prices a
        ring): seconds of ``count`` ring collectives over ``devices`` devices that
        move ``nbytes`` in all: ``op`` is ``"all-reduce"`` (``2 (n - 1)`` steps, each
        device sending ``2 (n - 1) / n`` of ``nbytes``), ``"all-gather"``,
        ``"reduce-scatter"`` or ``"all-to-all"`` (``n - 1`` steps, ``(n - 1) / n`` of
        the full ``nbytes``): each collective pays :meth:`latency` per step (alpha),
        the bytes a :meth:`transfer_seconds` (beta). A ring that leaves the node runs
        at the slower of the link and the network, each step at the network's
        latency. ``count``: the collectives the bytes are split over (fsdp gathers
        each parameter array apart; each pays its steps' latency)."""
        if op not in _RING_FACTOR:
            raise MultimeshValueError(
                f"DeviceModel.collective_seconds: op={op!r} is not a collective; valid: "
                f"{sorted(_RING_FACTOR)}.")
        if devices <= 1 or count <= 0:
            return 0.0
        steps = _RING_FACTOR[op] * (devices - 1)
        return (count * steps * self.latency(across_nodes)
                + self.transfer_seconds(steps / devices * nbytes, across_nodes))

    def rendezvous_seconds(self, compute_seconds: float, collectives: int) -> float:
        """Seconds that a call computing ``compute_seconds`` (its roofline, per
        device) waits in its ``collectives`` collectives besides their latency and
        bytes: ``rendezvous x compute_seconds`` if it runs any, else 0. Each
        collective waits for the compute since the one before it; summed over the
        call, that is its compute up to its last collective, taken as all of it (a
        data-parallel backward's gradient all-reduce comes at its end, fsdp's and
        tensor parallelism's collectives between its layers)."""
        return self.rendezvous * compute_seconds if collectives > 0 else 0.0

    def crosses_nodes(self, stride: int, size: int) -> bool:
        """Whether a group of ``size`` devices, ``stride`` apart in device order,
        spans more than one node."""
        return self.devices_per_node is not None and stride * size > self.devices_per_node

    def describe(self) -> str:
        """One line: the model's name and figures (``plan.assumptions`` shows it)."""
        eff = (f" ({self.compute_efficiency:.0%} reached by matmuls)"
               if self.compute_efficiency != 1 else "")
        net = (f", {self.network_bandwidth:.3g} B/s per device between nodes of "
               f"{self.devices_per_node}" if self.network_bandwidth is not None else "")
        lat = (f", {self.collective_latency * 1e6:.3g} us per collective step"
               if self.collective_latency else "")
        if self.network_latency is not None:
            lat += f" ({self.network_latency * 1e6:.3g} us between nodes)"
        if self.rendezvous:
            lat += f", collectives wait {self.rendezvous:.0%} of a call's compute"
        return (f"{self.name}: {self.peak_flops:.3g} flop/s{eff}, {self.memory_bandwidth:.3g} "
                f"B/s memory, {self.link_bandwidth:.3g} B/s between devices{net}, "
                f"{self.overhead * 1e6:.3g} us per call{lat}")

    def to_json(self) -> str:
        """The model as JSON (every field); :meth:`from_json` reads it back."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> DeviceModel:
        """The model :meth:`to_json` wrote. A field it lacks takes its default (a
        file written before the collective latency existed reads with none: 0); a
        key that is no field is refused."""
        d = json.loads(text)
        need = {"peak_flops", "memory_bandwidth"}
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or set(d) - names or not need <= set(d):
            got = sorted(d) if isinstance(d, dict) else d
            raise MultimeshValueError(
                f"`DeviceModel.from_json` takes an object with `peak_flops`, "
                f"`memory_bandwidth` and any of {sorted(names - need)}, got {got!r}. "
                f"Load the JSON that `DeviceModel.to_json()` wrote.")
        return cls(**d)

    @classmethod
    def from_spec(cls, spec: DeviceSpec, overhead: float = 1e-5) -> DeviceModel:
        """The model of a datasheet entry (:data:`DEVICE_KINDS`): its peak, the
        fraction a published kernel reaches, HBM bandwidth, link and network."""
        return cls(spec.peak_flops, spec.hbm_bandwidth, overhead=overhead, name=spec.kind,
                   link_bandwidth=spec.link_bandwidth,
                   compute_efficiency=spec.compute_efficiency,
                   network_bandwidth=spec.network_bandwidth,
                   devices_per_node=spec.devices_per_node,
                   collective_latency=spec.link_latency,
                   network_latency=spec.network_latency)

    @classmethod
    def for_device(cls, device) -> DeviceModel:
        """The documented defaults by ``device.device_kind``: the datasheet entry of
        its kind (:data:`DEVICE_KINDS`, the one table ``Cluster`` reads too: dense
        bf16 peak at a published kernel's efficiency, HBM bandwidth, NVLink or ICI
        between devices, NCCL's per-step ring latencies) with 10 us per call, else a
        CPU guess of 100 GFLOP/s, 20 GB/s memory, 10 GB/s between devices, 100 us per
        call and 10 us per collective step."""
        kind = kind_of_device(str(getattr(device, "device_kind", "")))
        if kind is not None:
            return cls.from_spec(DEVICE_KINDS[kind])
        return cls(1e11, 2e10, overhead=1e-4, name="cpu guess", link_bandwidth=1e10,
                   collective_latency=1e-5)

    @classmethod
    def calibrate(cls, devices: Sequence | None = None, *, refresh: bool = False) -> DeviceModel:
        """A model measured on ``devices`` (default ``jax.devices()``) in several
        seconds (:data:`CALIBRATION_ROUNDS`): the achieved flop/s of a small layer's
        training step (matmuls and the small ops around them; each device its own,
        with no collective) and the bandwidth of an elementwise op, both run on all
        the devices at once (so devices that share chips or cores see their share),
        the bandwidth of a copy from one device to another (each round's fastest:
        :data:`FASTEST_IN_ROUND`), one small call's dispatch, the latency of one
        ring step of a collective (a chain of tiny all-gathers over all the devices,
        less the dispatch, per all-gather and step), and the ``rendezvous`` (a chain
        of small layers with an all-gather after each, against the layers and the
        all-gathers alone, timed in pairs of one call of each chain; the median over
        the pairs). Cached per device kind and count (``refresh`` measures again)."""
        devices = list(jax.devices() if devices is None else devices)
        key = (devices[0].platform, str(devices[0].device_kind), len(devices))
        if refresh or key not in _CALIBRATED:
            _CALIBRATED[key] = _measure(cls, devices)
        return _CALIBRATED[key]


_RING_FACTOR = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0, "all-to-all": 1.0}
_SECONDS = {"overhead": "seconds per call", "collective_latency": "seconds per collective step",
            "network_latency": "seconds per collective step",
            "rendezvous": "the fraction of a call's compute its collectives add"}

_CALIBRATED: dict[tuple, DeviceModel] = {}


CALIBRATION_ROUNDS = 45
"""Rounds of :meth:`DeviceModel.calibrate`: each times every figure once, in turn. A
shared host's state (which cores its other work leaves) lasts seconds; 15 rounds (3 s
on the 2-core development host) let one state move a whole calibration by 30-48%, 45
(7 s) span several and hold every figure within 20% (docs/performance.md)."""


def _timed(fn, *args, calls: int = 1, pick=statistics.median) -> float:
    """``pick`` (the median) of the seconds of ``calls`` runs of ``fn(*args)``, each
    blocked on."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return pick(times)


FASTEST_IN_ROUND = frozenset({"copy"})
"""Probes whose round figure is the fastest of its calls, not their median: a copy's
destination is sometimes fresh pages from the operating system (the allocator gave the
last one back), which halves its bandwidth for as long as that state lasts; the
fastest copy of a round is the link's, and the median over the rounds still keeps one
lucky round out."""


def _probes(devices: list) -> dict:
    """The calibration's programs, compiled and warmed up: name -> (fn, args, calls).
    ``step``: a small layer's training step (two matmuls, a GELU and a softmax,
    forward and backward; the mix of matmuls and small ops a model's fragments run,
    rather than one large matmul's peak), one on every device at once, each on its
    own rows and weights (no collective: the compute alone); ``scale``: an
    elementwise op over 4 MiB per device; ``copy``: 16 MiB from one device to
    another; ``call``: one tiny call (the dispatch); ``gather``: a chain of tiny
    all-gathers (:func:`_gathers`); ``layers`` and ``between``: a chain of small
    layers, without and with an all-gather after each (:func:`_layers`), timed in
    pairs, one call of each in turn (:func:`_paired`)."""
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("d",))
    rows = NamedSharding(mesh, PartitionSpec("d"))

    def loss(w, x):
        h = jax.nn.gelu(x @ w[0])
        return jnp.mean(jax.nn.log_softmax(h @ w[1]))

    def local_step(w, x):
        value, grads = jax.value_and_grad(loss)(w, x)
        return value[None], grads

    w = jax.device_put((np.full((128 * n, 256), 0.01, np.float32),
                        np.full((256 * n, 128), 0.01, np.float32)), rows)
    x = jax.device_put(np.ones((64 * n, 128), np.float32), rows)
    step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=PartitionSpec("d"),
                                 out_specs=PartitionSpec("d")))
    probes: dict[str, tuple] = {"call": (jax.jit(lambda v: v + 1.0),
                       (jax.device_put(np.ones((n,), np.float32), rows),), 31),
              "step": (step, (w, x), 3),
              "scale": (jax.jit(lambda v: v * 2.0),
                        (jax.device_put(np.ones((n * 2 ** 20,), np.float32), rows),), 5)}
    if n > 1:
        one = jax.device_put(np.ones(4 * 2 ** 20, np.float32), devices[0])  # 16 MiB
        probes["copy"] = (lambda v: jax.device_put(v, devices[1]), (one,), 9)
        probes["gather"] = (_gathers(mesh), (jax.device_put(np.ones((8 * n,), np.float32),
                                                            rows),), 5)
        layer = (jax.device_put(np.ones((64 * n, LAYER_WIDTH), np.float32), rows),
                 jax.device_put(np.full((LAYER_WIDTH, LAYER_WIDTH), 0.01, np.float32),
                                NamedSharding(mesh, PartitionSpec())))
        probes["layers"] = (_layers(mesh, gather=False), layer, RENDEZVOUS_PAIRS)
        probes["between"] = (_layers(mesh, gather=True), layer, RENDEZVOUS_PAIRS)
    for fn, args, _ in probes.values():
        jax.block_until_ready(fn(*args))
    return probes


LATENCY_CHAIN = 16
"""All-gathers in :meth:`DeviceModel.calibrate`'s latency probes, each reading the last."""


def _gathers(mesh: Mesh):
    """A chain of :data:`LATENCY_CHAIN` all-gathers of 32 bytes per device over
    ``mesh``'s axis, each reading the one before (so XLA can neither combine nor
    overlap them): their time is the collectives' latency."""
    def body(x):
        for _ in range(LATENCY_CHAIN):
            x = jax.lax.all_gather(x, "d", tiled=True)[:x.shape[0]] * 0.5 + x
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("d"),
                                 out_specs=PartitionSpec("d")))


LAYER_WIDTH = 256
"""Columns of the rendezvous probes' layers (64 rows by ``LAYER_WIDTH`` columns times
``LAYER_WIDTH`` x ``LAYER_WIDTH`` on each device)."""

RENDEZVOUS_PAIRS = 3
"""Pairs of calls (the chain of layers alone, the same chain with all-gathers) that
each round of :meth:`DeviceModel.calibrate` times for the rendezvous."""


def _layers(mesh: Mesh, gather: bool):
    """A chain of :data:`LATENCY_CHAIN` small layers (``tanh(x @ w)``, 64 x
    :data:`LAYER_WIDTH` rows by :data:`LAYER_WIDTH` x :data:`LAYER_WIDTH` on each
    device), with ``gather`` an all-gather of the layer's output after each, read by
    the next layer: the collectives as programs run them, between compute."""
    def body(x, w):
        for _ in range(LATENCY_CHAIN):
            x = jnp.tanh(x @ w)
            if gather:
                x = jax.lax.all_gather(x, "d", tiled=True)[:x.shape[0]] * 0.5 + x
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec("d"),
                                                            PartitionSpec()),
                                 out_specs=PartitionSpec("d")))


PAIRED = ("layers", "between")
"""The probes that :func:`_measure` times in pairs (:func:`_paired`)."""


def _paired(first: tuple, second: tuple) -> list[tuple[float, float]]:
    """``calls`` pairs of one call of each of two probes (``(fn, args, calls)``), one
    after the other, the first first in every other pair: per pair, the seconds of
    each. A pair runs within milliseconds, under one load."""
    (fa, aa, calls), (fb, ab, _) = first, second
    pairs = []
    for k in range(calls):
        if k % 2:
            b, a = _timed(fb, *ab), _timed(fa, *aa)
        else:
            a, b = _timed(fa, *aa), _timed(fb, *ab)
        pairs.append((a, b))
    return pairs


def _rendezvous(pairs: Sequence[Sequence[tuple[float, float]]], gathers: Sequence[float],
                overhead: float) -> float:
    """The rendezvous from the calibration's timings: ``pairs[r]``, round ``r``'s pairs
    of calls of the chain of layers alone (``a`` seconds) and with an all-gather after
    each layer (``b``); ``gathers[r]``, that round's bare chain of all-gathers
    (``g``). Per pair, what the chain with all-gathers takes beyond the layers and the
    bare all-gathers, over the layers' own time (each less the dispatch, at most
    half): ``(b - a - g) / a``; the median over every pair of every round (one slow
    round or pair moves it little), 0 where it is not above 0."""
    ratios = [(b - a - max(g - overhead, g / 2)) / max(a - overhead, a / 2)
              for rp, g in zip(pairs, gathers) for a, b in rp]
    return max(statistics.median(ratios), 0.0) if ratios else 0.0


def _rounds(probes: dict, rounds: int) -> tuple[dict, list]:
    """``rounds`` rounds, each timing every probe its calls in turn, the
    :data:`PAIRED` ones last, in pairs: per probe, each round's median; each round's
    pairs."""
    seen: dict[str, list[float]] = {k: [] for k in probes if k not in PAIRED}
    pairs: list[list[tuple[float, float]]] = []
    for _ in range(rounds):
        for name in seen:
            fn, args, calls = probes[name]
            pick = min if name in FASTEST_IN_ROUND else statistics.median
            seen[name].append(_timed(fn, *args, calls=calls, pick=pick))
        if all(k in probes for k in PAIRED):
            pairs.append(_paired(*(probes[k] for k in PAIRED)))
    return seen, pairs


def _measure(cls, devices: list, rounds: int = CALIBRATION_ROUNDS) -> DeviceModel:
    """:meth:`DeviceModel.calibrate`'s measurements: ``rounds`` rounds, each timing
    every probe (:func:`_probes`) a few calls in turn (:func:`_rounds`), so a burst of
    load on a shared machine touches every figure alike; each figure is the median
    over the rounds, not the best (one lucky run is no figure to plan with). A run's
    dispatch (the tiny call's median) is taken off the step's, the elementwise op's
    and the chains'. The all-gather chain's rest, per all-gather and ring step
    (``n - 1`` of them), is the collective latency. The rendezvous (the share of the
    compute between collectives that each collective waits for) comes from pairs of
    calls, the chain of layers alone and with all-gathers one after the other: what
    the second takes beyond the first and the round's bare all-gathers, over the
    first's compute; the median over every pair (:func:`_rendezvous`; 0 where it is
    not above 0)."""
    n = len(devices)
    probes = _probes(devices)
    step_fn, step_args, _ = probes["step"]
    flops = float((step_fn.lower(*step_args).compile().cost_analysis() or {}).get(
        "flops", 0.0))
    seen, pairs = _rounds(probes, rounds)
    t = {k: statistics.median(v) for k, v in seen.items()}
    overhead = t["call"]

    def net(name: str) -> float:  # a probe's time less the dispatch (at least half)
        return max(t[name] - overhead, t[name] / 2)

    achieved = flops / net("step")
    memory = 8 * 2 ** 20 / net("scale")  # read + write
    link, latency, rendezvous = 1e10, 0.0, 0.0
    if n > 1:
        link = 16 * 2 ** 20 / t["copy"]
        latency = net("gather") / (LATENCY_CHAIN * (n - 1))
        rendezvous = _rendezvous(pairs, seen["gather"], overhead)
    return cls(achieved, memory, overhead=overhead, link_bandwidth=link,
               collective_latency=latency, rendezvous=rendezvous,
               name=f"calibrated on {n} {devices[0].platform} device(s)")


NO_TASKS = (
    "This program has no tasks, so multimesh compiled it as one `jax.jit` executable "
    "(the fast path): it has no fragments, submeshes or schedule to cost, profile or "
    "measure. Time it with `compiled.profile(...)`; place work with `task`/"
    "`register_task` to make it an MPMD program.")


def _compiled(obj):
    """The compiled program behind ``obj`` (a lowered one is compiled)."""
    if hasattr(obj, "cost_analysis") and hasattr(obj, "schedule"):
        return obj
    if hasattr(obj, "compile") and hasattr(obj, "as_text"):
        return _compiled(obj.compile())
    raise MultimeshTypeError(
        f"Expected a compiled or lowered multimesh program (mjit(f).lower(...) or its "
        f".compile()), got {type(obj).__name__}.")


def _mpmd(obj):
    """The compiled MPMD program behind ``obj``; a program without tasks is refused."""
    c = _compiled(obj)
    if getattr(c, "fast_path", False):
        raise MultimeshValueError(NO_TASKS)
    return c


def xla_costs(compiled, device_model: DeviceModel | None = None) -> FragmentCosts:
    """Seconds per fragment call: XLA's cost analysis (``flops``, ``bytes accessed``)
    through ``device_model`` (default: :meth:`DeviceModel.for_device` of the
    program's first device), plus the collectives the fragment's compiled program runs
    (:func:`fragment_collectives`, each :meth:`DeviceModel.collective_seconds`; not
    overlapped with its compute) and their wait for it
    (:meth:`DeviceModel.rendezvous_seconds`): :func:`call_seconds`."""
    c = _mpmd(compiled)
    if device_model is not None and not isinstance(device_model, DeviceModel):
        raise MultimeshTypeError(
            f"`device_model` must be a multimesh.jax.DeviceModel (for example "
            f"DeviceModel.for_device(jax.devices()[0]), or DeviceModel(peak_flops=..., "
            f"memory_bandwidth=...)) or None, got {type(device_model).__name__} "
            f"{device_model!r}.")
    model = device_model or DeviceModel.for_device(c.record.devices[0])
    per = c.cost_analysis(by_fragment=True)
    secs = {name: call_seconds(model, float(d.get("flops", 0.0)),
                               float(d.get("bytes accessed", 0.0)),
                               fragment_collectives(c.as_text(name)))
            for name, d in per.items()}
    return FragmentCosts(secs, "xla")


def call_seconds(model: DeviceModel, flops: float, bytes_accessed: float,
                 collectives: Sequence[tuple[str, int, int]] = ()) -> float:
    """Seconds of one compiled call through ``model``: :meth:`DeviceModel.seconds` of
    its per-device flops and bytes, each of its ``collectives`` (``(op, bytes,
    devices)``, :func:`fragment_collectives`) :meth:`DeviceModel.collective_seconds`,
    and their wait for its compute (:meth:`DeviceModel.rendezvous_seconds`)."""
    return (model.seconds(flops, bytes_accessed)
            + sum(model.collective_seconds(op, n, k) for op, n, k in collectives)
            + model.rendezvous_seconds(model.roofline_seconds(flops, bytes_accessed),
                                       len(collectives)))


_COLLECTIVE = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


def _type_bytes(text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(text):
        bits = 8 if dtype == "pred" else int((re.search(r"\d+", dtype) or [8])[0])
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def _group_size(rest: str) -> int:
    """Devices in each of a collective's groups, from its ``replica_groups``: a mesh
    and axes (``mesh['x'=4,'y'=2] {'x'}``), an iota (``[2,4]<=[8]``) or a list
    (``{{0,1,2,3},...}``); collective-permute: 2."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    return 2


def fragment_collectives(hlo_text: str) -> list[tuple[str, int, int]]:
    """The collectives a compiled fragment runs, from its optimized HLO text:
    ``(op, bytes, devices)`` per instruction, ``bytes`` the full buffer
    (:meth:`DeviceModel.collective_seconds`' ``nbytes``: an all-reduce's, an
    all-gather's result, a reduce-scatter's operand, an all-to-all's buffer); a
    collective-permute is one transfer (an ``all-to-all`` of 2)."""
    out = []
    for line in hlo_text.splitlines():
        # a long tuple's type carries index comments (``/*index=5*/``): not its '='
        m = _COLLECTIVE.search(_COMMENT.sub("", line) if "/*" in line else line)
        if m is None:
            continue
        op, kind = m.group("op"), m.group("type")
        if m.group("start") and op == "all-gather":  # (operand, result): the result
            kind = _ARRAY.findall(kind)[-1][0] + "[" + _ARRAY.findall(kind)[-1][1] + "]"
        n, k = _type_bytes(kind), _group_size(m.group("rest"))
        if op == "reduce-scatter":
            n *= k
        if op == "collective-permute":
            op, n, k = "all-to-all", 2 * n, 2
        if k > 1:
            out.append((op, n, k))
    return out


def residual_bytes(compiled) -> dict[str, int]:
    """Per forward fragment of the microbatch loop, the bytes per device that one call
    leaves for its microbatch's backward on the same submesh: the values it reads
    (not the program's inputs: parameters stay anyway) or makes that such a backward
    reads, sized by their layouts. The schedule's live activations times these are
    its activation memory (``schedule.simulate(residual_bytes=...)``)."""
    plan = _mpmd(compiled).plan_data
    kept = _read_by_backward(plan)
    inputs = set(plan.input_ids)
    out: dict[str, int] = {}
    for s in plan.calls():
        f = plan.fragments[s.fragment]
        if s.microbatch is None or f.transpose_count != 0:
            continue
        typed = [*zip(s.args, f.in_types, f.in_layouts), *zip(s.results, f.out_types,
                                                                f.out_layouts)]
        seen: set[int] = set()
        total = 0
        for v, (shape, dtype), lay in typed:
            if v in kept.get((s.microbatch, plan.call_devices(s)), ()) and v not in inputs \
                    and v not in seen:
                seen.add(v)
                total += shard_bytes(shape, dtype, lay)
        out[s.fragment] = max(out.get(s.fragment, 0), total)
    return out


def _read_by_backward(plan) -> dict[tuple[int, tuple[int, ...]], set[int]]:
    """(microbatch, devices) -> the values a backward call of that microbatch reads there."""
    out: dict[tuple[int, tuple[int, ...]], set[int]] = {}
    for s in plan.calls():
        if s.microbatch is not None and plan.fragments[s.fragment].transpose_count != 0:
            out.setdefault((s.microbatch, plan.call_devices(s)), set()).update(s.args)
    return out


@dataclass
class StepProfile:
    """Measured steps of a pipelined program, per schedule unit.

    ``durations[i]``: seconds of unit ``i`` (``schedule.units[i]``) in each measured
    step; ``starts``/``ends``: its span in the first step, from the start of the
    step's first unit (calls before the microbatch loop are left out);
    ``other``: seconds per step of everything else (calls outside the microbatch
    loop, transfers). Each call was timed alone (the runtime blocks after every
    dispatch step while profiling), so a unit's duration is its own, without overlap.
    """

    schedule: Schedule
    durations: list[list[float]]
    starts: list[float]
    ends: list[float]
    other: float = 0.0
    comm: float = 0.0
    """Mean seconds of one transfer step (pass as ``simulate(..., comm=)``)."""

    measured = True

    @property
    def steps(self) -> int:
        return min((len(d) for d in self.durations), default=0)

    def duration(self, i: int) -> float:
        """Mean seconds of unit ``i`` over the measured steps."""
        return statistics.fmean(self.durations[i])

    def busy(self, mesh: int) -> float:
        """Mean seconds per step that submesh ``mesh`` spent in its units."""
        return sum(self.duration(i) for i in self.schedule.orders[mesh])

    def per_call(self) -> dict[str, float]:
        """Mean seconds of each call, as ``calls_per_submesh()`` names them
        (``fragment@microbatch``)."""
        return {f"{u.fragment}@{u.microbatch}" if u.microbatch is not None else u.fragment:
                self.duration(u.index) for u in self.schedule.units}

    def fragment_costs(self) -> FragmentCosts:
        """Seconds per fragment call: the mean over its calls in every step (so a
        simulation with them keeps each submesh's measured busy time)."""
        per: dict[str, list[float]] = {}
        for u, d in zip(self.schedule.units, self.durations):
            per.setdefault(u.fragment, []).extend(d)
        return FragmentCosts({f: statistics.fmean(v) for f, v in per.items()}, "profile")

    def timeline(self) -> Timeline:
        """The first measured step as a :class:`Timeline` (what ``visualize_schedule``
        draws as "measured")."""
        return Timeline(self.schedule, tuple(self.starts), tuple(self.ends))

    def __str__(self) -> str:
        busy = " ".join(f"{self.busy(m) * 1e3:.3g}" for m in range(self.schedule.num_meshes))
        return (f"StepProfile({self.schedule.name}: {self.steps} step(s), busy ms per "
                f"submesh {busy}, other {self.other * 1e3:.3g} ms, a transfer "
                f"{self.comm * 1e3:.3g} ms)")


def profile_from_times(schedule: Schedule, steps: Sequence[Sequence[StepTime]]) -> StepProfile:
    """Attribute each measured step's fragment calls to ``schedule``'s units: a call
    is unit ``i`` when its fragment and microbatch are unit ``i``'s, in dispatch order."""
    n = len(schedule.units)
    durations: list[list[float]] = [[] for _ in range(n)]
    starts, ends = [0.0] * n, [0.0] * n
    other = 0.0
    moves = [t.end - t.start for ts in steps for t in ts if t.cat == "transfer"]
    for k, times in enumerate(steps):
        queue: dict[tuple[str, int | None], list[int]] = {}
        for i in schedule.order:
            u = schedule.units[i]
            queue.setdefault((u.fragment, u.microbatch), []).append(i)
        t0 = min((t.start for t in times if _unit_key(t) in queue), default=0.0)
        for t in times:
            key = _unit_key(t)
            if key is None or not queue.get(key):
                other += t.end - t.start
                continue
            i = queue[key].pop(0)
            durations[i].append(t.end - t.start)
            if k == 0:
                starts[i], ends[i] = t.start - t0, t.end - t0
        left = [schedule.units[i].fragment for q in queue.values() for i in q]
        if left:
            raise MultimeshValueError(
                f"The measured step ran no call of {sorted(set(left))} that the schedule "
                f"'{schedule.name}' lists; the profile does not belong to this schedule.")
    return StepProfile(schedule, durations, starts, ends, other / max(len(steps), 1),
                       statistics.fmean(moves) if moves else 0.0)


def _unit_key(t: StepTime) -> tuple[str, int | None] | None:
    o = t.origin
    return (o.fragment, o.microbatch) if isinstance(o, Call) else None


def check_step_profile(schedule: Schedule | None, steps, donates: bool) -> Schedule:
    """The schedule whose units ``compiled.step_profile(..., steps=steps)`` times, once
    it is known that the program has one and can run ``steps`` steps on one set of
    arguments (``donates``: it donates some of them)."""
    if schedule is None:
        raise MultimeshValueError(
            "This program has no pipeline schedule (it is not microbatched: use "
            "multimesh.jax.microbatch), so it has no units to profile.")
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise MultimeshValueError(f"step_profile: `steps` must be a positive integer (the "
                                  f"number of steps to time), got {steps!r}.")
    if steps > 1 and donates:
        raise MultimeshValueError(
            f"steps={steps} reruns the program on the same arguments, but it donates "
            "some of them; profile one step at a time (steps=1) with fresh arguments.")
    return schedule


def compare_schedules(compiled_or_lowered, costs="xla", *, memory="plan",
                      comm: float | None = None,
                      device_model: DeviceModel | None = None) -> ScheduleComparison:
    """Simulate every registered schedule on this program's fragments; a table.

    ``costs``: ``"xla"`` (:func:`xla_costs`), ``"unit"``, a :class:`StepProfile`, a
    ``{fragment: seconds}`` mapping or a :class:`FragmentCosts`. ``memory``:
    ``"plan"`` (:func:`residual_bytes`), None, or a ``memory_profile()`` result
    (its measured residual bytes per stage). Schedules that do not fit the program's
    stage placement are listed with the reason. ``comm``: None (default) prices each
    transfer between submeshes by the bytes the program moves on that edge, through
    ``device_model`` (:meth:`DeviceModel.transfer_seconds`; free with ``"unit"``
    costs), or a number of seconds per transfer.
    """
    c = _compiled(compiled_or_lowered)
    sched = c.schedule
    if sched is None:
        raise MultimeshValueError(
            "compare_schedules needs a pipelined program, but this one has no schedule "
            "(it is not microbatched: use multimesh.jax.microbatch).")
    fragment_costs = _costs_of(c, costs, device_model)
    if comm is None:
        comm = 0.0 if fragment_costs is None else transfer_costs(c, device_model)
    return compare(sched.units, fragment_costs, residual_bytes=_memory_of(c, sched, memory),
                   comm=comm, devices=sched.devices)


def edge_bytes(compiled) -> dict[tuple[str, str], int]:
    """``(sending fragment, receiving fragment) -> bytes`` one receiving device gets
    in one call's transfers from that fragment (the most over its microbatches),
    sized by the destination layouts."""
    plan = _mpmd(compiled).plan_data
    made: dict[int, tuple[str, tuple]] = {}  # value -> (fragment, (shape, dtype))
    moved: dict[int, tuple[int, object]] = {}  # transferred value -> (source, layout)
    for s in plan.steps:
        if isinstance(s, Call):
            for r, t in zip(s.results, plan.fragments[s.fragment].out_types):
                made[r] = (s.fragment, t)
        else:
            moved[s.dst] = (s.src, s.layout)
    out: dict[tuple[str, str], int] = {}
    for s in plan.calls():
        got: dict[str, int] = {}
        for a in s.args:
            if a not in moved:
                continue
            src, lay = moved[a]
            while src in moved:
                src = moved[src][0]
            if src in made:
                frag, (shape, dtype) = made[src]
                got[frag] = got.get(frag, 0) + shard_bytes(shape, dtype, lay)
        for frag, n in got.items():
            key = (frag, s.fragment)
            out[key] = max(out.get(key, 0), n)
    return out


def transfer_costs(compiled, device_model: DeviceModel | None = None):
    """The simulator's ``comm``: seconds of what one unit sends another on a different
    submesh, :meth:`DeviceModel.transfer_seconds` of :func:`edge_bytes` (across
    nodes where the two submeshes' devices are in different nodes)."""
    c = _mpmd(compiled)
    dm = device_model or DeviceModel.for_device(c.record.devices[0])
    sizes = edge_bytes(c)
    devices = c.schedule.devices

    def parts(name: str) -> list[str]:  # "f|dx" and "f+g" name their fragments
        return [p.split("|")[0] for p in name.split("+")]

    def node(mesh: int) -> set[int]:
        per = dm.devices_per_node
        return {d // per for d in devices[mesh]} if per and devices else set()

    def comm(src, dst) -> float:
        n = sum(sizes.get((a, b), 0) for a in parts(src.fragment) for b in parts(dst.fragment))
        return dm.transfer_seconds(n, node(src.mesh) != node(dst.mesh))

    return comm


def _costs_of(c, costs, device_model):
    if isinstance(costs, str):
        if costs == "xla":
            return xla_costs(c, device_model)
        if costs == "unit":
            return None
        raise MultimeshValueError(
            f"costs={costs!r} is not a cost source; valid: 'xla', 'unit', a StepProfile "
            "(compiled.step_profile(...)), a {fragment: seconds} mapping or a FragmentCosts.")
    return costs


def _memory_of(c, sched: Schedule, memory):
    if memory is None:
        return None
    if isinstance(memory, str):
        if memory == "plan":
            return residual_bytes(c)
        raise MultimeshValueError(
            f"memory={memory!r} is not a memory source; valid: 'plan', None or a "
            "compiled.memory_profile(...) result.")
    if getattr(memory, "submeshes", None) is None:
        raise MultimeshTypeError(
            f"memory must be 'plan', None or the memory_profile() of this program, got "
            f"{type(memory).__name__}.")
    return memory

