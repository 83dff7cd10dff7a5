"""Costs of a compiled program's fragments, measured steps, and schedule advice.

Two sources of per-fragment seconds feed the schedule simulator
(:mod:`multimesh.schedules.costs`): XLA's cost analysis of each compiled fragment
through a roofline :class:`DeviceModel` (:func:`xla_costs`), and real steps
(:class:`StepProfile`, from ``compiled.profile`` or ``compiled.step_profile``).
:func:`compare_schedules` simulates every registered schedule with them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.runtime.memory import _shard_bytes as shard_bytes
from multimesh.runtime.plan import Call
from multimesh.runtime.timing import StepTime
from multimesh.schedules import Schedule
from multimesh.schedules.costs import FragmentCosts, ScheduleComparison, compare
from multimesh.schedules.simulator import Timeline

__all__ = ["DeviceModel", "xla_costs", "residual_bytes", "StepProfile", "compare_schedules",
           "ScheduleComparison",
           "check_step_profile", "profile_from_times", "NO_TASKS"]


@dataclass(frozen=True)
class DeviceModel:
    """The one hardware model of every prediction: the planner (``plan_pipeline``),
    :func:`xla_costs`, :func:`compare_schedules` and the schedule simulator price
    work with it.

    One fragment call takes ``overhead + max(flops / peak_flops, bytes /
    memory_bandwidth)`` seconds (per device; XLA's counts are per device); moving
    ``n`` bytes between devices takes ``n / link_bandwidth`` seconds.

    :meth:`for_device` gives the documented defaults: datasheet peaks by device kind
    (which real kernels reach only in part, so they rank plans rather than time
    steps) and a CPU guess. :meth:`calibrate` measures the devices at hand instead
    (a matmul's achieved flop/s, a copy's bandwidth, one call's dispatch), so
    predicted steps come near measured ones.
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

    def __post_init__(self):
        if isinstance(self.compute_efficiency, bool) or not isinstance(
                self.compute_efficiency, (int, float)) or not 0 < self.compute_efficiency <= 1:
            raise MultimeshValueError(
                f"DeviceModel: `compute_efficiency` must be a number in (0, 1] (the "
                f"fraction of peak_flops that matmuls reach), got {self.compute_efficiency!r}.")
        for name in ("peak_flops", "memory_bandwidth", "overhead"):
            v = getattr(self, name)
            low = 0 if name == "overhead" else None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    (v >= 0 if low == 0 else v > 0) and v < float("inf")):
                raise MultimeshValueError(
                    f"DeviceModel: `{name}` must be a finite number "
                    f"{'>= 0 (seconds per call)' if low == 0 else '> 0 (per second)'}, got "
                    f"{v!r}.")

    def seconds(self, flops: float, bytes_accessed: float) -> float:
        return self.overhead + max(flops / (self.peak_flops * self.compute_efficiency),
                                   bytes_accessed / self.memory_bandwidth)

    def transfer_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` from one device to another."""
        return nbytes / self.link_bandwidth

    def all_reduce_seconds(self, nbytes: float, devices: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` over ``devices`` devices (each
        sends and receives ``2 (n - 1) / n`` of it); 0 on one device."""
        return 2.0 * (devices - 1) / devices * nbytes / self.link_bandwidth if devices > 1 else 0.0

    def collective_seconds(self, op: str, nbytes: float, devices: int,
                           across_nodes: bool = False) -> float:
        """Seconds of a ring collective over ``devices`` devices: ``op`` is
        ``"all-reduce"`` (each device sends ``2 (n - 1) / n`` of ``nbytes``),
        ``"all-gather"`` or ``"reduce-scatter"`` (``(n - 1) / n`` of the full
        ``nbytes``). A ring that leaves the node runs at the slower of the link and
        the network (``network_bandwidth`` per device: one NIC per GPU)."""
        if op not in _RING_FACTOR:
            raise MultimeshValueError(
                f"DeviceModel.collective_seconds: op={op!r} is not a collective; valid: "
                f"{sorted(_RING_FACTOR)}.")
        if devices <= 1:
            return 0.0
        bw = self.link_bandwidth
        if across_nodes and self.network_bandwidth is not None:
            bw = min(bw, self.network_bandwidth)
        return _RING_FACTOR[op] * (devices - 1) / devices * nbytes / bw

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
        return (f"{self.name}: {self.peak_flops:.3g} flop/s{eff}, {self.memory_bandwidth:.3g} "
                f"B/s memory, {self.link_bandwidth:.3g} B/s between devices{net}, "
                f"{self.overhead * 1e6:.3g} us per call")

    @classmethod
    def for_device(cls, device) -> DeviceModel:
        """The documented defaults by ``device.device_kind``: datasheet numbers (dense
        bf16 peak; HBM bandwidth; NVLink or ICI between devices) with 10 us per call,
        else a CPU guess of 100 GFLOP/s, 20 GB/s memory, 10 GB/s between devices and
        100 us per call."""
        kind = str(getattr(device, "device_kind", "")).lower()
        for key, flops, bw, link in _DATASHEET:
            if key in kind:
                return cls(flops, bw, name=key, link_bandwidth=link)
        return cls(1e11, 2e10, overhead=1e-4, name="cpu guess", link_bandwidth=1e10)

    @classmethod
    def calibrate(cls, devices: Sequence | None = None, *, refresh: bool = False) -> DeviceModel:
        """A model measured on ``devices`` (default ``jax.devices()``) in a second or
        two: the achieved flop/s of a small layer's training step (matmuls and the
        small ops around them) and the bandwidth of an elementwise op, both run on
        all the devices at once (so devices that share chips or
        cores see their share), the bandwidth of a copy from one device to another,
        and one small call's dispatch. Cached per device kind and count (``refresh``
        measures again)."""
        devices = list(jax.devices() if devices is None else devices)
        key = (devices[0].platform, str(devices[0].device_kind), len(devices))
        if refresh or key not in _CALIBRATED:
            _CALIBRATED[key] = _measure(cls, devices)
        return _CALIBRATED[key]


_RING_FACTOR = {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 1.0}

_DATASHEET = (("h200", 989e12, 4.8e12, 4.5e11), ("h100", 989e12, 3.35e12, 4.5e11),
              ("a100", 312e12, 2.0e12, 3e11), ("v5e", 197e12, 8.19e11, 2e11),
              ("v5p", 459e12, 2.76e12, 6e11), ("v4", 275e12, 1.2e12, 3e11))
_CALIBRATED: dict[tuple, DeviceModel] = {}


def _best(fn, *args, repeat: int = 5) -> float:
    """The best of ``repeat`` timed runs of ``fn(*args)`` after one warm-up."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def _step_flops(mesh, rows, n: int, overhead: float) -> float:
    """Achieved flop/s per device of a small layer's training step (two matmuls, a
    GELU and a softmax, forward and backward), its rows split over every device: the
    mix of matmuls and small ops a model's fragments run, rather than one large
    matmul's peak."""
    def loss(w, x):
        h = jax.nn.gelu(x @ w[0])
        return jnp.mean(jax.nn.log_softmax(h @ w[1]))

    w = jax.device_put((np.full((128, 256), 0.01, np.float32),
                        np.full((256, 128), 0.01, np.float32)),
                       NamedSharding(mesh, PartitionSpec()))
    x = jax.device_put(np.ones((64 * n, 128), np.float32), rows)
    step = jax.jit(jax.value_and_grad(loss))
    flops = float((step.lower(w, x).compile().cost_analysis() or {}).get("flops", 0.0))
    t = _best(step, w, x, repeat=3)
    return flops / max(t - overhead, t / 2)


def _measure(cls, devices: list) -> DeviceModel:
    """:meth:`DeviceModel.calibrate`'s measurements (a run's dispatch is taken off
    the matmul's and the elementwise op's times)."""
    n = len(devices)
    mesh = Mesh(np.asarray(devices), ("d",))
    rows = NamedSharding(mesh, PartitionSpec("d"))
    tiny = jax.device_put(np.ones((n,), np.float32), rows)
    step = jax.jit(lambda x: x + 1.0)
    jax.block_until_ready(step(tiny))
    calls = []
    for _ in range(30):
        t0 = time.perf_counter()
        jax.block_until_ready(step(tiny))
        calls.append(time.perf_counter() - t0)
    overhead = statistics.median(calls)
    flops = _step_flops(mesh, rows, n, overhead)
    big = jax.device_put(np.ones((n * 2 ** 20,), np.float32), rows)  # 4 MiB per device
    t = _best(jax.jit(lambda x: x * 2.0), big)
    memory = 8 * 2 ** 20 / max(t - overhead, t / 2)
    one = jax.device_put(np.ones(2 ** 20, np.float32), devices[0])  # 4 MiB
    link = (4 * 2 ** 20 / _best(lambda x: jax.device_put(x, devices[1]), one)
            if n > 1 else 1e10)
    return cls(flops, memory, overhead=overhead, link_bandwidth=link,
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
    """Seconds per fragment call from XLA's cost analysis (``flops``, ``bytes
    accessed``) through ``device_model`` (default: :meth:`DeviceModel.for_device` of
    the program's first device)."""
    c = _mpmd(compiled)
    if device_model is not None and not isinstance(device_model, DeviceModel):
        raise MultimeshTypeError(
            f"`device_model` must be a multimesh.jax.DeviceModel (for example "
            f"DeviceModel.for_device(jax.devices()[0]), or DeviceModel(peak_flops=..., "
            f"memory_bandwidth=...)) or None, got {type(device_model).__name__} "
            f"{device_model!r}.")
    model = device_model or DeviceModel.for_device(c.record.devices[0])
    per = c.cost_analysis(by_fragment=True)
    secs = {name: model.seconds(float(d.get("flops", 0.0)), float(d.get("bytes accessed", 0.0)))
            for name, d in per.items()}
    return FragmentCosts(secs, "xla")


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


def compare_schedules(compiled_or_lowered, costs="xla", *, memory="plan", comm: float = 0.0,
                      device_model: DeviceModel | None = None) -> ScheduleComparison:
    """Simulate every registered schedule on this program's fragments; a table.

    ``costs``: ``"xla"`` (:func:`xla_costs`), ``"unit"``, a :class:`StepProfile`, a
    ``{fragment: seconds}`` mapping or a :class:`FragmentCosts`. ``memory``:
    ``"plan"`` (:func:`residual_bytes`), None, or a ``memory_profile()`` result
    (its measured residual bytes per stage). Schedules that do not fit the program's
    stage placement are listed with the reason. ``comm``: seconds per transfer.
    """
    c = _compiled(compiled_or_lowered)
    sched = c.schedule
    if sched is None:
        raise MultimeshValueError(
            "compare_schedules needs a pipelined program, but this one has no schedule "
            "(it is not microbatched: use multimesh.jax.microbatch).")
    return compare(sched.units, _costs_of(c, costs, device_model),
                   residual_bytes=_memory_of(c, sched, memory), comm=comm,
                   devices=sched.devices)


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

