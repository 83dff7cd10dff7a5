"""Pricing one layout of a :class:`Transformer` on a described :class:`Cluster`, and
the search over layouts (pipeline x data x tensor x fsdp, microbatches, schedule,
virtual stages, recompute per stage).

Everything is arithmetic on the counts of one layer's jaxpr (:mod:`._transformer`),
priced through :class:`~multimesh.jax.DeviceModel`; pipeline bubbles and in-flight
microbatches come from the schedule library's theory. The accounting, stated once:

* memory per device: bf16 weights (2 B) and gradients (2 B) per parameter, sharded
  over ``tensor`` and ``fsdp``; fp32 master weights and Adam's two moments (12 B),
  sharded over ``tensor``, ``fsdp`` and ``data`` (ZeRO-1, Megatron's distributed
  optimizer) -- 16 B per parameter in all; activations per Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models") written out for
  a Llama layer (GQA, SwiGLU, no dropout, a flash attention core that keeps its
  output and log-sum-exp, not the s x s scores), divided by ``tensor`` (sequence
  parallelism), times the microbatches the schedule holds in flight;
* time per microbatch and layer: matmul flops / (peak x efficiency) or their bytes /
  HBM bandwidth, whichever is longer (the causal attention core runs half its
  counted flops), plus elementwise bytes / HBM bandwidth; tensor parallelism with
  sequence parallelism: 4 all-gathers or reduce-scatters of the layer's activations
  forward and 4 backward (8 more with full recompute), not overlapped; pipeline
  transfers not overlapped; fsdp's per-layer gathers overlapped with that layer's
  compute; the data axis's gradient reduce-scatter and weight all-gather once a step,
  not overlapped; gradients are reduced in fp32 (:data:`GRAD_REDUCE_BYTES`), the
  weights gathered in bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

from multimesh.jax._analysis.costs import DeviceModel
from multimesh.jax._planner._cluster import Cluster
from multimesh.jax._planner._transformer import Counts, LayerCosts, Transformer
from multimesh.schedules import theoretical_bubble, theoretical_peak_live

__all__ = ["ClusterLayout", "Priced", "price", "layouts", "RECOMPUTE", "SCHEDULES"]

RECOMPUTE = ("none", "selective", "full")
"""Per stage, lightest first: keep every activation; recompute the elementwise ops
(norms, RoPE, SwiGLU) from the matmuls' inputs; keep only each layer's input and
run its forward again."""
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
STEP_BYTES_PER_PARAM = 16  # bf16 weights 2 + bf16 grads 2 + fp32 master 4 + Adam m, v 8
GRAD_REDUCE_BYTES = 4.0
"""Bytes per parameter of a gradient reduction (data-parallel and fsdp
reduce-scatters): fp32. Megatron-LM's megatron/training/arguments.py: "bfloat16
requires gradient accumulation and all-reduce to be done in fp32" (it sets
accumulate_allreduce_grads_in_fp32 for bf16); the Llama 3 paper (arXiv:2407.21783,
section 3.3.2, numerical stability): "reduce-scatter gradients in FP32 across data
parallel workers in FSDP". The weights' all-gathers stay bf16 (2 B)."""
VIRTUAL = (2, 3, 4, 5, 6, 8)


@dataclasses.dataclass(frozen=True)
class ClusterLayout:
    pipeline: int
    data: int
    tensor: int
    fsdp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int = 1


@dataclasses.dataclass(frozen=True)
class Priced:
    """One layout priced: per pipeline stage (submesh) its layers, recompute and
    memory (bytes: params, grads, optimizer, activations, total), and the step's
    breakdown (seconds)."""

    layout: ClusterLayout
    chunk_layers: tuple[int, ...]
    recompute: tuple[str, ...]
    memory: tuple[dict, ...]
    breakdown: dict
    step_time: float
    model_flops: float
    bubble: float


@dataclasses.dataclass(frozen=True)
class PlanContext:
    model: Transformer
    cluster: Cluster
    costs: LayerCosts
    dm: DeviceModel
    memory_limit: float


def _seconds(dm: DeviceModel, c: Counts, k: float) -> float:
    """Seconds of ``c`` scaled by ``k`` (matmuls: roofline; elementwise: bytes), no
    per-call overhead; the causal attention core runs half its counted flops."""
    flops = (c.flops - c.attention_flops / 2) * k
    return (dm.roofline_seconds(flops, c.matmul_bytes * k)
            + dm.roofline_seconds(0.0, c.elementwise_bytes * k))


def act_bytes(m: Transformer, recompute: str, b: int, t: int) -> float:
    """Activation bytes one layer keeps for its backward, per microbatch of ``b``
    sequences, per device of a ``t``-way tensor (and sequence) parallel group."""
    h, f, a = m.d_model, m.ffn, m.heads
    kv = m.kv_heads * m.head_dim
    per_token = {"none": 12 * h + 4 * kv + 4 * a + 6 * f,
                 "selective": 8 * h + 4 * kv + 4 * a + 4 * f,
                 "full": 2 * h}[recompute]
    return per_token * m.seq * b / t


def _chunks(n: int, layers: int, t_layer: float, t_head: float) -> tuple[int, ...]:
    """Layers per virtual stage (``n`` of them; the last also runs the head): the
    split with the least loaded slowest stage, the last taking fewer layers."""
    if n == 1:
        return (layers,)
    best = None
    for k in range(math.ceil(layers / n), math.ceil(layers / (n - 1)) + 1):
        last = layers - (n - 1) * k
        if last < 0:
            break
        load = max(k * t_layer, last * t_layer + t_head)
        if best is None or load < best[0] - 1e-12:
            best = (load, k, last)
    if best is None:  # fewer than two layers a stage: spread them, the last fewest
        q, r = divmod(layers, n)
        return tuple(q + (i < r) for i in range(n))
    return (best[1],) * (n - 1) + (best[2],)


@functools.lru_cache(maxsize=4096)
def _live(lay: ClusterLayout, j: int) -> int:
    """Chunk activations submesh ``j`` holds at its peak (the schedule library's
    textbook for submesh 0; later submeshes hold fewer by the schedule's warm-up)."""
    P, M, V = lay.pipeline, lay.num_microbatches, lay.virtual_stages
    if P == 1:
        return 1
    if j:
        drop = {"gpipe": 0, "1f1b": 1, "interleaved-1f1b": 2}[lay.schedule]
        return max(1, _live(lay, 0) - drop * j)
    return theoretical_peak_live(lay.schedule, P, M, V) or M * V


@dataclasses.dataclass(frozen=True)
class _Times:
    fwd: float
    bwd: float
    elementwise: float
    tp: float  # one of a layer's tensor-parallel collectives (10 forward and backward)
    head: float
    calls: int


def _times(ctx: PlanContext, lay: ClusterLayout) -> _Times:
    m, c, dm, t, b = ctx.model, ctx.costs, ctx.dm, lay.tensor, lay.microbatch_size
    k = b / t
    act = 2.0 * b * m.seq * m.d_model  # bf16 activations of one microbatch
    across = dm.crosses_nodes(1, t)
    one = dm.collective_seconds("all-gather", act, t, across)
    head = _seconds(dm, c.head_fwd, k) + _seconds(dm, c.head_bwd, k) + 2 * one
    calls = c.layer_fwd.kernels + c.layer_bwd.kernels
    return _Times(_seconds(dm, c.layer_fwd, k), _seconds(dm, c.layer_bwd, k),
                  dm.roofline_seconds(0.0, c.layer_fwd.elementwise_bytes * k),
                  one, head, calls)


def _layer_time(tm: _Times, recompute: str) -> tuple[float, float]:
    """(compute, tensor-parallel comm) seconds of one layer's forward and backward."""
    extra = {"none": 0.0, "selective": tm.elementwise, "full": tm.fwd}[recompute]
    return tm.fwd + tm.bwd + extra, tm.tp * (14 if recompute == "full" else 10)


def _stage_memory(ctx: PlanContext, lay: ClusterLayout, j: int, layers: int, first: bool, last: bool,
                  recompute: str, chunk: int) -> dict:
    m, t, f, d, b = ctx.model, lay.tensor, lay.fsdp, lay.data, lay.microbatch_size
    params = (layers * m.layer_params + first * m.embed_params + last * m.head_params) / t
    acts = _live(lay, j) * chunk * act_bytes(m, recompute, b, t)
    if recompute == "full":  # one layer's activations while it is recomputed
        acts += act_bytes(m, "none", b, t)
    if last:  # the float32 logits and their gradient, one microbatch
        acts += 2 * 4.0 * b * m.seq * m.vocab / t
    gather = 2 * 2.0 * m.layer_params / t if f > 1 else 0.0  # fsdp: a layer and the next
    mem = {"params": 2.0 * params / f + gather, "grads": 2.0 * params / f,
           "optimizer": 12.0 * params / (f * d), "activations": acts,
           "parameters": params}
    mem["total"] = mem["params"] + mem["grads"] + mem["optimizer"] + acts
    return mem


def price(ctx: PlanContext, lay: ClusterLayout, recompute: str | None = None) -> Priced | None:
    """``lay`` priced, each stage with the lightest recompute that fits (or
    ``recompute``); None when a stage fits with none."""
    m, P, V = ctx.model, lay.pipeline, lay.virtual_stages
    tm = _times(ctx, lay)
    t_layer = sum(_layer_time(tm, "none"))
    chunks = _chunks(P * V, m.layers, t_layer, tm.head)
    choices = RECOMPUTE if recompute is None else (recompute,)
    stages = []
    for j in range(P):
        mine = [chunks[j + P * v] for v in range(V)]
        first, last = j == 0, j == P - 1
        for rec in choices:
            mem = _stage_memory(ctx, lay, j, sum(mine), first, last, rec, max(mine))
            if mem["total"] <= ctx.memory_limit:
                stages.append((rec, mem, sum(mine), last))
                break
        else:
            return None
    return _step(ctx, lay, tm, chunks, stages)


def _step(ctx: PlanContext, lay: ClusterLayout, tm: _Times, chunks, stages) -> Priced:
    m, dm, P, V, M = ctx.model, ctx.dm, lay.pipeline, lay.virtual_stages, lay.num_microbatches
    t, f, d, b = lay.tensor, lay.fsdp, lay.data, lay.microbatch_size
    act = 2.0 * b * m.seq * m.d_model / t
    hop = dm.transfer_seconds(act, dm.crosses_nodes(1, t * f * d))
    transfers = 2 * V * M * hop if P > 1 else 0.0
    layer_params = m.layer_params / t
    fsdp_one = (2 * dm.collective_seconds("all-gather", 2.0 * layer_params, f,
                                          dm.crosses_nodes(t, f))
                + dm.collective_seconds("reduce-scatter", GRAD_REDUCE_BYTES * layer_params, f,
                                        dm.crosses_nodes(t, f)))
    busiest, parts = -1.0, {}
    for rec, mem, layers, last in stages:
        compute, tp = _layer_time(tm, rec)
        fsdp = max(0.0, fsdp_one - compute) * layers * M
        busy = M * (layers * (compute + tp) + last * tm.head) + transfers + fsdp
        if busy > busiest:
            busiest = busy
            params = mem["parameters"]
            parts = {"compute": M * (layers * compute + last * (tm.head - 2 * tm.tp)),
                     "tensor": M * (layers * tp + last * 2 * tm.tp),
                     "transfers": transfers, "fsdp": fsdp,
                     "overhead": M * layers * tm.calls * dm.overhead}
    bubble = (theoretical_bubble(lay.schedule, P, M, V) or 0.0) if P > 1 else 0.0
    pipe = (busiest + parts["overhead"]) / (1.0 - bubble)
    across = dm.crosses_nodes(t * f, d)
    data = (dm.collective_seconds("reduce-scatter", GRAD_REDUCE_BYTES * params / f, d, across)
            + dm.collective_seconds("all-gather", 2.0 * params / f, d, across))
    update = dm.roofline_seconds(0.0, 2 * STEP_BYTES_PER_PARAM * params / (f * d))
    step = pipe + data + update
    breakdown = {"compute": parts["compute"] + update,
                 "tensor-parallel communication": parts["tensor"],
                 "pipeline bubble": pipe - busiest - parts["overhead"],
                 "pipeline transfers": parts["transfers"],
                 "data-parallel / fsdp communication": data + parts["fsdp"],
                 "per-call overhead": parts["overhead"]}
    c = ctx.costs
    causal = [x.flops - x.attention_flops / 2 for x in (c.layer_fwd, c.layer_bwd)]
    per_seq = m.layers * sum(causal) + c.head_fwd.flops + c.head_bwd.flops
    return Priced(lay, tuple(chunks), tuple(s[0] for s in stages),
                  tuple(s[1] for s in stages), breakdown, step, per_seq * m.global_batch,
                  bubble)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(ctx: PlanContext, pins: dict) -> Iterator[ClusterLayout]:
    """Every layout the search weighs, narrowed by ``pins`` (layout fields fixed by
    the caller)."""
    m, N = ctx.model, ctx.cluster.devices
    node = min(ctx.dm.devices_per_node or N, N)
    for t in _divisors(node):
        if m.kv_heads % t or m.heads % t or not _ok(pins, "tensor", t):
            continue
        for P in _divisors(N // t):
            if P > m.layers or not _ok(pins, "pipeline", P):
                continue
            rest = N // (t * P)
            for f in _divisors(rest):
                if not _ok(pins, "fsdp", f) or not _ok(pins, "data", rest // f):
                    continue
                yield from _batches(ctx, pins, P, rest // f, t, f)


def _batches(ctx: PlanContext, pins: dict, P: int, d: int, t: int, f: int) -> Iterator[ClusterLayout]:
    m = ctx.model
    for b in (1, 2, 4, 8):
        replicas = d * f
        if m.global_batch % (replicas * b) or not _ok(pins, "microbatch_size", b):
            continue
        M = m.global_batch // (replicas * b)
        if P == 1:
            if _ok(pins, "schedule", "1f1b") and _ok(pins, "virtual_stages", 1):
                yield ClusterLayout(1, d, t, f, b, M, "1f1b")
            continue
        for s in SCHEDULES:
            if not _ok(pins, "schedule", s):
                continue
            for V in (VIRTUAL if s == "interleaved-1f1b" else (1,)):
                if (V > 1 and (M % P or P * V > m.layers)) or not _ok(pins, "virtual_stages", V):
                    continue
                yield ClusterLayout(P, d, t, f, b, M, s, V)


def _ok(pins: dict, name: str, value) -> bool:
    return pins.get(name) is None or pins[name] == value
