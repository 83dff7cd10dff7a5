"""The planner's search: contiguous stage cuts, microbatches and schedule.

For each number of stages ``S`` (dividing the devices evenly, ``d = N / S`` each),
dynamic programming over the units' prefix sums finds the contiguous cut whose
slowest stage is fastest, subject to the memory limit (Alpa's inter-operator pass,
without its submesh-shape search: every stage gets ``d`` devices). Each candidate
``(S, microbatches, schedule)`` is then run through the schedule simulator with the
stages' predicted times; the shortest simulated step wins (ties, within a part in
a billion: fewer stages, fewer microbatches, then the simpler schedule, in the order
given, so the result is deterministic). A schedule that splits the backward
(zero-bubble) runs each stage's weight-gradient part apart: one more fragment call
per microbatch, and the activations held until it ran (the simulator's peak).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

from multimesh._src.errors import MultimeshValueError
from multimesh.jax._analysis.costs import DeviceModel
from multimesh.schedules import (
    ScheduleError,
    get_schedule,
    live_activations,
)
from multimesh.schedules.costs import simulate_stages, textbook_schedule

__all__ = ["Costs", "Limits", "Choice", "Layout", "search", "best_cut", "mesh_of", "data_ways"]


@dataclasses.dataclass(frozen=True)
class Costs:
    """Per unit (whole batch): forward and backward flops, parameter and residual
    bytes; per cut between units ``i`` and ``i + 1``: the activation bytes crossing it."""

    names: tuple[str, ...]
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    params: tuple[int, ...]
    residuals: tuple[int, ...]
    cuts: tuple[int, ...]
    wgrad: tuple[float, ...] | None = None
    """Per unit, the part of ``bwd`` that computes parameter gradients (None: half)."""
    fwd_bytes: tuple[float, ...] | None = None
    bwd_bytes: tuple[float, ...] | None = None
    """Per unit, XLA's bytes accessed by the forward and the backward (None: not
    priced; the roofline then counts flops only)."""
    work: tuple[int, ...] | None = None
    """Per unit, the most bytes its backward's temporaries hold at once (whole batch;
    None: not priced)."""
    bwd_params: tuple[int, ...] | None = None
    """Per unit, the parameter bytes its backward reads (None: not priced)."""
    comm_fwd: tuple[float, ...] | None = None
    comm_bwd: tuple[float, ...] | None = None
    """Per unit, seconds of the tensor-parallel collectives its forward and backward
    run, their bytes' part (whole batch, one data replica; None: none)."""
    comm_latency_fwd: tuple[float, ...] | None = None
    comm_latency_bwd: tuple[float, ...] | None = None
    """Per unit, the latency part of those collectives' seconds: one call's, whatever
    its microbatch's size (None: none)."""
    leaves: tuple[int, ...] | None = None
    bwd_leaves: tuple[int, ...] | None = None
    """Per unit, the parameter arrays its forward and its backward read: an fsdp stage
    all-gathers each apart in each pass, and reduce-scatters each one's gradient
    (None: one collective per stage and pass)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a plan must respect, and the one hardware model that prices it: every
    second below comes from ``model`` (:class:`~multimesh.jax.DeviceModel`: its
    roofline, transfer and collective costs); nothing here is a second model."""

    model: DeviceModel
    num_devices: int
    memory_limit: float | None  # bytes per device
    optimizer_state_factor: float  # optimizer state bytes per parameter byte
    batch_rows: int | None = None  # the example batch's rows (None: always divisible)

    @property
    def fragment_overhead(self) -> float:
        """Seconds per fragment call (the model's ``overhead``)."""
        return self.model.overhead


@dataclasses.dataclass(frozen=True)
class Choice:
    """One plan: stage bounds ``[start, end)`` over the units, and its predictions."""

    num_stages: int
    bounds: tuple[tuple[int, int], ...]
    num_microbatches: int
    schedule: str
    fwd_time: tuple[float, ...]  # per stage, one microbatch
    bwd_time: tuple[float, ...]  # the whole backward, weight-gradient part included
    wgrad_time: tuple[float, ...]  # the part a splitting schedule runs apart
    memory: tuple[float, ...]  # per stage, bytes per device of its submesh at the peak
    live: tuple[int, ...]  # per stage, peak microbatches in flight on its submesh
    step_time: float  # the simulated step
    interleave: int = 1  # stages per submesh (:func:`mesh_of` places them)
    v_shape: bool = False
    data: int = 1  # devices each microbatch's rows split over in a stage (1: replicated)
    fsdp: bool = False  # parameters sharded over the stage's devices (ZeRO-3)
    model: int = 1  # the size of each stage's tensor-parallel ``model`` axis


def mesh_of(k: int, S: int, P: int, v_shape: bool = False) -> int:
    """The submesh of stage ``k`` of ``S`` on ``P``: one each (contiguous), ``k % P``
    (round-robin) or down and back up the submeshes (V-shape)."""
    if v_shape:
        return k if k < P else 2 * P - 1 - k
    return k % P


class _Prefix:
    """Prefix sums of the per-unit figures, so a stage's cost is O(1)."""

    def __init__(self, costs: Costs):
        acc = itertools.accumulate
        self.flops = [0.0, *acc(f + b for f, b in zip(costs.fwd, costs.bwd))]
        self.fwd = [0.0, *acc(costs.fwd)]
        wgrad = costs.wgrad if costs.wgrad is not None else [b / 2 for b in costs.bwd]
        self.wgrad = [0.0, *acc(wgrad)]
        self.params = [0, *acc(costs.params)]
        self.residuals = [0, *acc(costs.residuals)]
        self.fwd_bytes = [0.0, *acc(costs.fwd_bytes or [0.0] * len(costs.names))]
        self.bwd_bytes = [0.0, *acc(costs.bwd_bytes or [0.0] * len(costs.names))]
        self.bwd_params = [0, *acc(costs.bwd_params or [0] * len(costs.names))]
        self.work = list(costs.work or [0] * len(costs.names))
        self.comm_fwd = [0.0, *acc(costs.comm_fwd or [0.0] * len(costs.names))]
        self.comm_bwd = [0.0, *acc(costs.comm_bwd or [0.0] * len(costs.names))]
        zero = [0.0] * len(costs.names)
        self.lat_fwd = [0.0, *acc(costs.comm_latency_fwd or zero)]
        self.lat_bwd = [0.0, *acc(costs.comm_latency_bwd or zero)]
        self.leaves = None if costs.leaves is None else [0, *acc(costs.leaves)]
        self.bwd_leaves = None if costs.bwd_leaves is None else [0, *acc(costs.bwd_leaves)]
        self.cuts = costs.cuts
        self.n = len(costs.names)

    def cut(self, i: int) -> float:
        """Bytes crossing the boundary before unit ``i`` (none at the ends)."""
        return float(self.cuts[i - 1]) if 0 < i < self.n else 0.0


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a stage uses its ``d`` devices: ``model`` of them (neighbours) split the
    model's tensor-parallel dimensions, the ``d / model`` groups of them each
    microbatch's rows (``data``; 1 where the rows do not divide), parameters
    replicated or sharded over those groups (``fsdp``)."""

    d: int
    data: int
    fsdp: bool = False
    model: int = 1

    @property
    def replicas(self) -> int:
        """The devices of the stage's ``data`` axis (fsdp's and the all-reduce's)."""
        return self.d // self.model


def data_ways(m: Limits, d: int, M: int) -> int:
    """Devices a stage of ``d`` splits each of ``M`` microbatches' rows over."""
    rows = m.batch_rows
    return d if rows is None or (rows // M) % d == 0 else 1


def _compute(m: Limits, flops: float, nbytes: float, ways: int) -> float:
    """The model's roofline seconds of work divided over ``ways`` devices (no call
    overhead)."""
    return m.model.roofline_seconds(flops / ways, nbytes / ways)


def _stage_times(p: _Prefix, m: Limits, d: int | Layout, M: int, i: int, j: int,
                 split: bool = False) -> tuple[float, float, float]:
    """Forward, whole backward and weight-gradient seconds of units ``[i, j)`` for one
    microbatch; ``split``: the weight-gradient part is a fragment call of its own.
    Data parallelism adds the gradients' all-reduce over the stage's devices to each
    backward; sharded parameters (``fsdp``) an all-gather to the forward, and an
    all-gather and a reduce-scatter to the backward, instead. A pass that runs any
    collective also waits in them for its compute
    (:meth:`~multimesh.jax.DeviceModel.rendezvous_seconds`)."""
    lay = d if isinstance(d, Layout) else Layout(d, d)
    w_, dm = lay.data, m.model
    # what one device receives: its share of the microbatch's activations
    move = dm.transfer_seconds((p.cut(i) + p.cut(j)) / M / _spread(lay))
    f_fl = p.fwd[j] - p.fwd[i]
    b_fl = p.flops[j] - p.flops[i] - f_fl
    f_c = _compute(m, f_fl / M, (p.fwd_bytes[j] - p.fwd_bytes[i]) / M, w_)
    b_c = _compute(m, b_fl / M, (p.bwd_bytes[j] - p.bwd_bytes[i]) / M, w_)
    # tensor-parallel collectives: their bytes shrink with the microbatch, not their latency
    tp_f = (p.comm_fwd[j] - p.comm_fwd[i]) / M / w_ + p.lat_fwd[j] - p.lat_fwd[i]
    tp_b = (p.comm_bwd[j] - p.comm_bwd[i]) / M / w_ + p.lat_bwd[j] - p.lat_bwd[i]
    w = _compute(m, (p.wgrad[j] - p.wgrad[i]) / M, 0.0, w_)
    d_f = _data_comm(p, m, lay, i, j, backward=False)
    d_b = _data_comm(p, m, lay, i, j, backward=True)
    # a pass that runs collectives waits in them for its compute (a rendezvous)
    fwd = f_c + move + tp_f + d_f + dm.rendezvous_seconds(f_c, _collectives(lay, False))
    bwd = b_c + move + tp_b + d_b + dm.rendezvous_seconds(b_c, _collectives(lay, True))
    fwd += m.fragment_overhead
    if split:
        w += m.fragment_overhead
        bwd += m.fragment_overhead
    return fwd, bwd + m.fragment_overhead, w


def _collectives(lay: Layout, backward: bool) -> int:
    """Whether a stage's forward or backward in layout ``lay`` runs collectives (1) or
    not (0): tensor parallelism's, fsdp's gathers (and scatters), a data-parallel
    backward's gradient all-reduce."""
    data = lay.replicas > 1 and (lay.fsdp or (backward and lay.data > 1))
    return int(lay.model > 1 or data)


def _data_comm(p: _Prefix, m: Limits, lay: Layout, i: int, j: int, backward: bool) -> float:
    """Seconds of the data axis's collectives in one microbatch's forward or backward
    of units ``[i, j)``. With ``fsdp`` the forward all-gathers each parameter array it
    reads, one collective each, and the backward gathers each it reads and
    reduce-scatters each array's gradient (XLA gathers a sharded array where it is
    read; none combines them on XLA:CPU). Data parallel: one all-reduce of the
    gradients (XLA's all-reduce combiner joins the arrays' into one collective per
    backward, as the compiled fragments show)."""
    params = float(p.params[j] - p.params[i])
    r, dm = lay.replicas, m.model  # the data axis: with a model axis, each device's shard
    if lay.fsdp and r > 1:
        fwd = _span(p.leaves, i, j)
        if not backward:
            return dm.collective_seconds("all-gather", params, r, count=fwd)
        bwd = _span(p.bwd_leaves, i, j) if p.bwd_leaves is not None else fwd
        return (dm.collective_seconds("all-gather", params, r, count=max(bwd, 1))
                + dm.collective_seconds("reduce-scatter", params, r, count=fwd))
    if backward and lay.data > 1:
        return dm.all_reduce_seconds(params, r)  # the gradients, ring
    return 0.0


def _span(sums: list[int] | None, i: int, j: int) -> int:
    """Units ``[i, j)``'s total of a per-unit count (None: 1, one per stage)."""
    return 1 if sums is None else max(sums[j] - sums[i], 1)


def _stage_params(p: _Prefix, m: Limits, i: int, j: int, lay: Layout) -> float:
    """Bytes per device of units ``[i, j)``'s parameters, gradients and optimizer state
    (replicated in the stage, or split over its ``d`` devices with ``fsdp``)."""
    shards = lay.replicas if lay.fsdp else 1
    return (p.params[j] - p.params[i]) * (2.0 + m.optimizer_state_factor) / shards


def _spread(lay: Layout) -> int:
    """Devices a microbatch's activations are split over: its rows' ``data`` devices,
    or with ``fsdp`` all ``d`` (where the rows do not divide, the compiled program
    splits the activations along the dimensions the sharded parameters give them)."""
    return lay.replicas if lay.fsdp else lay.data


def _held(p: _Prefix, M: int, i: int, j: int, lay: Layout) -> float:
    """Bytes per device one microbatch keeps from its forward for its backward: the
    residuals, split over :func:`_spread` devices, and with ``fsdp`` the shards of the
    parameters the backward reads (each microbatch's forward hands its own)."""
    rows = (p.residuals[j] - p.residuals[i]) / M / _spread(lay)
    return rows + ((p.bwd_params[j] - p.bwd_params[i]) / lay.replicas if lay.fsdp else 0.0)


def _temporaries(p: _Prefix, M: int, i: int, j: int, lay: Layout) -> float:
    """Bytes per device the stage's backward holds while it runs beside what is live:
    the largest unit's temporaries for one microbatch on one device, or the
    microbatch's gradients (twice where they are both reduced over the stage's
    devices and accumulated over microbatches), whichever is more."""
    work = max(p.work[i:j], default=0) / M / _spread(lay)
    shards = lay.replicas if lay.fsdp else 1
    copies = 2.0 if M > 1 and lay.replicas > 1 else 1.0
    return max(work, copies * (p.params[j] - p.params[i]) / shards)


def _stage_memory(p: _Prefix, m: Limits, M: int, live: int, i: int, j: int,
                  lay: Layout | None = None) -> float:
    """Bytes per device at the stage's peak: parameters, gradients and optimizer state,
    ``live`` microbatches of what the forward keeps (:func:`_held`), and the
    backward's temporaries (:func:`_temporaries`)."""
    lay = Layout(1, 1) if lay is None else lay
    return (_stage_params(p, m, i, j, lay) + _held(p, M, i, j, lay) * live
            + _temporaries(p, M, i, j, lay))


def best_cut(n: int, S: int, cost: Callable[[int, int], float],
             fits: Callable[[int, int, int], bool]) -> tuple[tuple[int, int], ...] | None:
    """Contiguous split of ``n`` units into ``S`` non-empty stages minimising the
    largest ``cost(i, j)``, every stage ``k`` with ``fits(k, i, j)``; None if none fits.
    Ties go to the earliest cut, so the answer is deterministic."""
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(S + 1)]
    arg = [[-1] * (n + 1) for _ in range(S + 1)]
    best[0][0] = 0.0
    for k in range(1, S + 1):
        for j in range(k, n - (S - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev == inf or not fits(k - 1, i, j):
                    continue
                value = max(prev, cost(i, j))
                if value < best[k][j]:
                    best[k][j], arg[k][j] = value, i
    if best[S][n] == inf:
        return None
    bounds, j = [], n
    for k in range(S, 0, -1):
        i = arg[k][j]
        bounds.append((i, j))
        j = i
    return tuple(reversed(bounds))


def _live(P: int, V: int, M: int, name: str) -> tuple[int, ...] | None:
    """Peak live microbatches per submesh; None where the schedule refuses ``M``."""
    try:
        sched = textbook_schedule(name, P, V, M)
    except ScheduleError:  # e.g. kimi-k2 needs rounds of P microbatches
        return None
    return tuple(max(v, 1) for v in live_activations(sched))


def _candidate(p: _Prefix, m: Limits, S: int, M: int, name: str, cache: dict,
               fsdp: bool = False, model: int | None = None) -> Choice | None:
    """The best cut for ``S`` stages, ``M`` microbatches and schedule ``name``; an
    interleaved schedule puts ``V`` stages on each of ``P = S / V`` submeshes
    (:func:`mesh_of`); ``fsdp``: each stage's parameters sharded over its devices;
    ``model``: its tensor-parallel axis (``p`` holds the units' costs at that size;
    None: it has none), where the model's own constraints put the rows on ``data``,
    so that rows which do not divide it are no candidate."""
    algo = get_schedule(name)
    V, split = algo.interleave, algo.splits_backward
    P = S // V
    vs = algo.placement == "v-shape"
    live = _live(P, V, M, name) if S % V == 0 and (P >= 2 or V == 1) else None
    if live is None or m.num_devices % P:
        return None
    cache["applies"] = True  # some candidate suits the schedule; memory decides
    d = m.num_devices // P
    t = model or 1
    if d % t or (model is not None and d // t > 1 and data_ways(m, d // t, M) == 1):
        return None
    lay = Layout(d, data_ways(m, d // t, M), fsdp, t)
    # the cut depends on the microbatches through the data split and the memory limit
    key = (S, lay, split, M if m.memory_limit is not None or m.batch_rows else None,
           live if m.memory_limit is not None else None)
    if key not in cache:
        limit = m.memory_limit

        def cost(i, j):
            f, b, _ = _stage_times(p, m, lay, M, i, j, split)
            return f + b

        def fits(k, i, j):
            where = live[mesh_of(k, S, P, vs)]
            return limit is None or _stage_memory(p, m, M, where, i, j, lay) <= limit

        cache[key] = best_cut(p.n, S, cost, fits)
    bounds = cache[key]
    return None if bounds is None else _predict(p, m, bounds, lay, M, name, P, split, vs)


def _predict(p: _Prefix, m: Limits, bounds, lay: Layout, M: int, name: str, P: int,
             split: bool, vs: bool) -> Choice | None:
    """Simulate the cut; None where a submesh's memory breaks the limit."""
    S = len(bounds)
    times = [_stage_times(p, m, lay, M, i, j, split) for i, j in bounds]
    fwd, bwd, w = (tuple(t[k] for t in times) for k in range(3))
    held = [int(_held(p, M, i, j, lay)) for i, j in bounds]
    pred = simulate_stages(name, fwd, bwd, num_microbatches=M, num_meshes=P,
                           weight_gradient=w, activation_bytes=held)
    peak = pred.peak_activation_bytes or (0,) * P
    mesh = [float(peak[r]) for r in range(P)]
    where = [mesh_of(k, S, P, vs) for k in range(S)]
    temp = [0.0] * P  # the temporaries of one backward at a time on a submesh
    for k, (i, j) in enumerate(bounds):
        mesh[where[k]] += _stage_params(p, m, i, j, lay)
        temp[where[k]] = max(temp[where[k]], _temporaries(p, M, i, j, lay))
    mesh = [a + b for a, b in zip(mesh, temp)]
    if m.memory_limit is not None and max(mesh) > m.memory_limit:
        return None
    return Choice(S, bounds, M, name, fwd, bwd, w, tuple(mesh[r] for r in where),
                  tuple(max(pred.peak_microbatches[r], 1) for r in where),
                  pred.step_time, S // P, vs, lay.data, lay.fsdp, lay.model)


def search(costs: Costs, m: Limits, stages: Sequence[int], microbatches: Sequence[int],
           schedules: Sequence[str], layouts: Sequence[bool] = (False, True),
           tensor: Mapping[int, Costs] | None = None) -> Choice:
    """The fastest feasible plan over the candidates; a clear error when none fits.
    ``layouts``: the parameter layouts tried in each stage (False: replicated, True:
    sharded over its devices); ``tensor``: per ``model`` axis size, the units' costs
    at that size (None: ``{1: costs}``, no tensor parallelism; fsdp is not combined
    with a ``model`` axis); on a tie the earlier wins."""
    tables = {1: costs} if tensor is None else dict(tensor)
    prefixes = {t: _Prefix(c) for t, c in sorted(tables.items())}
    p = next(iter(prefixes.values()))
    cache: dict = {}
    best: Choice | None = None
    for S in stages:
        if S > p.n:
            continue
        for M in microbatches:
            for name in schedules:
                for (t, pt), fsdp in itertools.product(prefixes.items(), layouts):
                    if fsdp and (m.num_devices == S or t > 1):
                        continue  # nothing to shard over, or the model axis shards
                    c = _candidate(pt, m, S, M, name, cache, fsdp,
                                   None if tensor is None else t)
                    # a part in a billion: equal schedules' float noise is no gain
                    if c is not None and (best is None
                                          or c.step_time < best.step_time * (1 - 1e-9)):
                        best = c
    if best is None:
        if m.memory_limit is None or not cache.get("applies"):
            raise _nothing_applies(stages, microbatches, schedules)
        t = max(tables)
        raise _no_plan(tables[t], prefixes[t], m, stages, microbatches,
                       any(layouts) and t == 1, t)
    return best


def _nothing_applies(stages, microbatches, schedules) -> MultimeshValueError:
    return MultimeshValueError(
        f"`plan_pipeline` found no plan: schedule(s) {list(schedules)} accept none of "
        f"{list(stages)} stage(s) with {list(microbatches)} microbatch(es). A schedule "
        f"with V stages per submesh needs a multiple of V stages, at least two submeshes "
        f"that divide the devices, and some need more microbatches (dualpipe-v: at "
        f"least 2 per submesh, twice). Allow more stages or microbatches, or name "
        f"another schedule.")


def _no_plan(costs: Costs, p: _Prefix, m: Limits, stages, microbatches,
             fsdp: bool = False, model: int = 1) -> MultimeshValueError:
    """Why no candidate fits: the unit too big on its own (in the stage layout that
    needs least: the most devices per stage, sharded where allowed), or the split as a
    whole."""
    M, d = max(microbatches), m.num_devices // min(stages)
    lay = Layout(d, data_ways(m, d // model, M), fsdp and d > 1, model)
    need = [_stage_memory(p, m, M, 1, k, k + 1, lay) for k in range(p.n)]
    worst = max(range(p.n), key=lambda k: need[k])
    limit = m.memory_limit
    if need[worst] > (limit or 0):
        return MultimeshValueError(
            f"`plan_pipeline` found no plan within memory_limit={limit:,.0f} bytes per "
            f"device: unit {costs.names[worst]!r} alone needs {need[worst]:,.0f} bytes per "
            f"device on a stage of {d} ({costs.params[worst]:,} parameter bytes x "
            f"{2 + m.optimizer_state_factor:g} for the gradient and optimizer state"
            f"{f', sharded over {d}' if lay.fsdp else ''}"
            f"{f', its model-sharded parameters split over {model}' if model > 1 else ''}"
            f", plus one microbatch of "
            f"{costs.residuals[worst] / M:,.0f} residual bytes at {M} microbatches"
            f"{f', its rows split over {lay.data}' if lay.data > 1 else ''}, and its "
            f"backward's temporaries). "
            f"Raise the limit, shard the unit inside its stage, or split it into smaller "
            f"named parts.")
    return MultimeshValueError(
        f"`plan_pipeline` found no plan within memory_limit={limit:,.0f} bytes per device "
        f"for {' or '.join(str(s) for s in stages)} stage(s) and {list(microbatches)} "
        f"microbatches: every unit fits alone (the largest, {costs.names[worst]!r}, needs "
        f"{need[worst]:,.0f} bytes), but no contiguous split keeps every stage under the "
        f"limit. Allow more stages or more microbatches, or raise the limit.")
