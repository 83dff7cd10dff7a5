"""``plan_cluster``: a layout for a cluster you have not got, from shapes alone;
``ClusterPlan``: its answer, as a table, code and JSON."""

from __future__ import annotations

import dataclasses
import json
import time

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._planner._cluster import GB, Cluster
from multimesh.jax._planner._cluster_search import (
    RECOMPUTE,
    SCHEDULES,
    ClusterLayout,
    PlanContext,
    Priced,
    layouts,
    price,
)
from multimesh.jax._planner._transformer import Transformer, layer_costs

__all__ = ["ClusterPlan", "plan_cluster", "CLUSTER_PLAN_FORMAT_VERSION"]

CLUSTER_PLAN_FORMAT_VERSION = 1
_PINS = ("tensor", "pipeline", "data", "fsdp", "microbatch_size", "schedule",
         "virtual_stages")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterPlan(ClusterLayout):
    """A layout for ``model`` on ``cluster``: pipeline x data x tensor x fsdp, the
    microbatches and schedule, recompute per pipeline stage, per-device memory
    against HBM, and the predicted step with its breakdown. ``print(plan)`` shows
    it; :meth:`as_code` is a program for that cluster; :meth:`to_json` /
    :meth:`from_json` round-trip it. The layout's fields are :class:`ClusterLayout`'s,
    the search's candidate, so a plan is the candidate it chose plus what was priced."""

    model: Transformer
    cluster: Cluster
    stage_layers: tuple[int, ...]
    """Layers per virtual stage, in pipeline order (the last also runs the head)."""
    recompute: tuple[str, ...]
    """Per pipeline stage (submesh): ``none``, ``selective`` or ``full``."""
    memory: tuple[dict, ...]
    """Per pipeline stage, bytes per device: params, grads, optimizer, activations,
    total (and ``parameters``: the parameter count each device holds a shard of)."""
    breakdown: dict
    step_time: float
    model_flops: float
    bubble: float
    memory_limit: float
    considered: int
    plan_seconds: float
    assumptions: dict

    @property
    def mfu(self) -> float:
        """Model flops (the jaxpr's matmuls, forward and backward, the causal
        attention's half of its s x s products; no recompute) over the step time and
        every device's dense bf16 peak."""
        return self.model_flops / (self.step_time * self.cluster.spec.peak_flops
                                   * self.cluster.devices)

    @property
    def tokens_per_second(self) -> float:
        return self.model.global_batch * self.model.seq / self.step_time

    @property
    def fits(self) -> bool:
        return all(m["total"] <= self.memory_limit for m in self.memory)

    def layout(self) -> str:
        return (f"pipeline {self.pipeline} x data {self.data} x tensor {self.tensor} x fsdp "
                f"{self.fsdp}")

    def __str__(self) -> str:
        m, c = self.model, self.cluster
        V = self.virtual_stages
        sched = f"{self.schedule!r}" + (f" with {V} virtual stages per device" if V > 1 else "")
        if self.pipeline == 1:
            sched = "none (one stage: the microbatches accumulate gradients)"
        lines = [
            f"ClusterPlan: {m.name} ({m.num_params / 1e9:.1f}B parameters) on {c.describe()}",
            f"layout: {self.layout()} (tensor inside a node, sequence parallel)",
            f"microbatches: {self.num_microbatches} of {self.microbatch_size} sequence(s) "
            f"per replica, schedule {sched}, bubble {self.bubble:.1%}",
            f"layers per virtual stage: {_runs(self.stage_layers)} (the last also runs the head)",
            f"recompute per stage: {_runs(self.recompute)}",
            f"memory per device (GB, limit {self.memory_limit / GB:.1f}):",
            "  stage  params  grads  optimizer  activations  total"]
        for j, mem in _distinct(self.memory):
            lines.append(f"  {j:<5}  {mem['params'] / GB:6.1f}  {mem['grads'] / GB:5.1f}  "
                         f"{mem['optimizer'] / GB:9.1f}  {mem['activations'] / GB:11.1f}  "
                         f"{mem['total'] / GB:5.1f}")
        lines.append(f"predicted step {self.step_time:.3f} s, MFU {self.mfu:.1%}, "
                     f"{self.tokens_per_second:,.0f} tokens/s")
        for k, v in self.breakdown.items():
            lines.append(f"  {k:<36} {v:8.3f} s  {v / self.step_time:6.1%}")
        lines.append(f"searched {self.considered} layouts in {self.plan_seconds:.1f} s")
        lines.append("assumptions:")
        lines += [f"  {k}: {v}" for k, v in self.assumptions.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"ClusterPlan({self.layout()}, microbatches={self.num_microbatches}, "
                f"schedule={self.schedule!r}, step={self.step_time:.3g} s, mfu={self.mfu:.3f})")

    def pins(self) -> dict:
        """The layout as ``plan_cluster`` keywords that reproduce it."""
        return {"tensor": self.tensor, "pipeline": self.pipeline, "data": self.data,
                "fsdp": self.fsdp, "microbatch_size": self.microbatch_size,
                "schedule": self.schedule, "virtual_stages": self.virtual_stages}

    def as_code(self) -> str:
        """A self-contained program for the plan's cluster: it describes the model and
        cluster, plans again with the layout pinned, and (on that cluster's devices)
        builds the device mesh and the pipeline's tasks."""
        return _code(self)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["model"] = self.model.to_dict()
        d["cluster"] = self.cluster.to_dict()
        d["format_version"] = CLUSTER_PLAN_FORMAT_VERSION
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> ClusterPlan:
        """The plan :meth:`to_json` wrote (its model, cluster and layout checked)."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise MultimeshValueError(
                f"`ClusterPlan.from_json` takes the JSON `plan.to_json()` wrote; this is not "
                f"JSON ({e}).") from None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(d, dict) or d.pop("format_version", None) != \
                CLUSTER_PLAN_FORMAT_VERSION or set(d) != names:
            raise MultimeshValueError(
                f"`ClusterPlan.from_json`: the document is not a version "
                f"{CLUSTER_PLAN_FORMAT_VERSION} ClusterPlan (keys {sorted(names)} and "
                f"'format_version'). Plan again with `plan_cluster` and save `plan.to_json()`.")
        try:
            d["model"] = Transformer(**d["model"])
            d["cluster"] = Cluster(**d["cluster"])
        except TypeError as e:
            raise MultimeshValueError(
                f"`ClusterPlan.from_json`: the plan's model or cluster has other fields than "
                f"this multimesh's ({e}). Plan again with `plan_cluster`.") from None
        if d["schedule"] not in SCHEDULES or any(r not in RECOMPUTE for r in d["recompute"]):
            raise MultimeshValueError(
                f"`ClusterPlan.from_json`: schedule {d['schedule']!r} or recompute "
                f"{d['recompute']!r} is not one the planner writes.")
        for k in ("stage_layers", "recompute", "memory"):
            d[k] = tuple(d[k])
        return cls(**d)


def _runs(values) -> str:
    """``a x 3, b`` for runs of equal values."""
    out, prev, n = [], None, 0
    for v in [*values, object()]:
        if v == prev:
            n += 1
            continue
        if n:
            out.append(f"{prev} x {n}" if n > 1 else str(prev))
        prev, n = v, 1
    return ", ".join(out)


def _distinct(memory) -> list[tuple[str, dict]]:
    """Rows of the memory table: the first, the last and the largest stage."""
    P = len(memory)
    big = max(range(P), key=lambda j: memory[j]["total"])
    return [(str(j), memory[j]) for j in sorted({0, big, P - 1})]


def _code(plan: ClusterPlan) -> str:
    m, c = plan.model, plan.cluster
    P, D, T, F = plan.pipeline, plan.data, plan.tensor, plan.fsdp
    model = ", ".join(f"{k}={v!r}" for k, v in m.to_dict().items())
    cluster = ", ".join(f"{k}={v!r}" for k, v in c.to_dict().items() if v is not None)
    pins = ", ".join(f"{k}={v!r}" for k, v in plan.pins().items())
    interleave = f", interleave={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    schedule = f", schedule={plan.schedule!r}" if P > 1 else ""  # one stage: accumulation
    return "\n".join([
        f"# {m.name} on {c.devices} x {c.spec.kind}: {plan.layout()}, "
        f"{plan.num_microbatches} microbatches, schedule {plan.schedule!r}",
        "import jax",
        "import numpy as np",
        "import multimesh.jax as mm",
        "",
        f"model = mm.Transformer({model})",
        f"cluster = mm.Cluster({cluster})",
        f"plan = mm.plan_cluster(model, cluster, {pins})",
        "",
        "# device positions: pipeline x data x fsdp x tensor (tensor fastest: inside a node)",
        f"grid = np.arange({c.devices}).reshape({P}, {D}, {F}, {T})",
        "# recompute per pipeline stage: none, selective (keep the matmuls' outputs), full",
        "policy = {'none': None, 'selective': jax.checkpoint_policies.dots_saveable, "
        "'full': True}",
        "remat = [policy[r] for r in plan.recompute]",
        f"for k in range({len(plan.stage_layers)}):  # virtual stage k runs on submesh k % {P}",
        "    mm.register_task(",
        "        rf\"stage{k}(?=[/)]|$)\",",
        "        task=mm.Task(",
        "            name=f\"stage{k}\",",
        f"            mesh=mm.TaskMesh(devices=tuple(grid[k % {P}].flat), "
        f"axis_names=('data', 'fsdp', 'tensor'), axis_sizes=({D}, {F}, {T})),",
        "            logical_axes=(('batch', 'data'), ('batch', 'fsdp'), ('heads', 'tensor'),",
        "                          ('mlp', 'tensor'),",
        "                          ('embed', 'fsdp')),",
        f"            remat=remat[k % {P}]))",
        "loss = mm.transformer_loss(model, plan.stage_layers)",
        "step = mm.microbatch(jax.value_and_grad(loss), dim=0, argnum=1, "
        f"size={plan.microbatch_size * D * F}{schedule}{interleave}, "
        "reduction='mean')",
        f"# on the cluster: mm.mjit(step)(params, tokens), params as "
        f"model.params_shapes() lays them out, tokens [{m.global_batch}, {m.seq}] int32",
        ""])


def _check_model(model) -> Transformer:
    if not isinstance(model, Transformer):
        raise MultimeshTypeError(
            f"`plan_cluster` plans a `multimesh.jax.Transformer` (layers, width, heads, KV "
            f"heads, FFN, vocabulary, sequence, global batch; `Transformer.llama3('70b')` "
            f"for Meta's sizes), got {type(model).__name__} {model!r}.")
    return model


def _check_pins(model: Transformer, cluster: Cluster, pins: dict, recompute) -> None:
    for k, v in pins.items():
        if v is None or k == "schedule":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MultimeshValueError(
                f"`plan_cluster`: `{k}` must be a positive integer or None, got {v!r}.")
    if pins.get("schedule") is not None and pins["schedule"] not in SCHEDULES:
        raise MultimeshValueError(
            f"`plan_cluster`: schedule={pins['schedule']!r} is not one the cluster planner "
            f"weighs; valid: {list(SCHEDULES)} or None (choose).")
    if recompute is not None and recompute not in RECOMPUTE:
        raise MultimeshValueError(
            f"`plan_cluster`: recompute={recompute!r} is not a recompute policy; valid: "
            f"{list(RECOMPUTE)} or None (the lightest that fits, per stage).")
    t = pins.get("tensor")
    node = cluster.spec.devices_per_node
    if t is not None and t > node:
        raise MultimeshValueError(
            f"`plan_cluster`: tensor={t} spans more than a node of {node} devices; tensor "
            f"parallelism runs inside a node (NVLink, ICI). Use pipeline or data across nodes.")


def plan_cluster(model: Transformer, cluster: Cluster, *, tensor: int | None = None,
                 pipeline: int | None = None, data: int | None = None,
                 fsdp: int | None = None, microbatch_size: int | None = None,
                 schedule: str | None = None, virtual_stages: int | None = None,
                 recompute: str | None = None, memory_fraction: float = 0.9) -> ClusterPlan:
    """The fastest layout of ``model`` on ``cluster`` that fits every device's HBM.

    Nothing is materialised: one layer (:func:`llama_layer`) and the head are traced
    to jaxprs on
    ``jax.ShapeDtypeStruct`` s and their matmuls counted; every layout
    (pipeline x data x tensor x fsdp, microbatch size, schedule and virtual stages)
    is priced through the cluster's :class:`DeviceModel`, each pipeline stage with
    the lightest recompute that fits ``memory_fraction`` of HBM. Any of the layout
    keywords pins that choice; ``recompute`` pins every stage's.
    """
    t0 = time.perf_counter()
    model = _check_model(model)
    if not isinstance(cluster, Cluster):
        raise MultimeshTypeError(
            f"`plan_cluster`: `cluster` must be a `multimesh.jax.Cluster` (for example "
            f"Cluster('h100', devices=256)), got {type(cluster).__name__} {cluster!r}.")
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) \
            or not 0 < memory_fraction <= 1:
        raise MultimeshValueError(
            f"`plan_cluster`: `memory_fraction` is the share of HBM a plan may use, in "
            f"(0, 1]; got {memory_fraction!r}.")
    pins = dict(tensor=tensor, pipeline=pipeline, data=data, fsdp=fsdp,
                microbatch_size=microbatch_size, schedule=schedule,
                virtual_stages=virtual_stages)
    _check_pins(model, cluster, pins, recompute)
    dm = cluster.device_model()
    ctx = PlanContext(model, cluster, layer_costs(model), dm,
                  memory_fraction * cluster.spec.hbm_bytes)
    best, n = _search(ctx, pins, recompute)
    if best is None:
        raise MultimeshValueError(_no_fit(model, cluster, pins, recompute, n, ctx))
    return _plan(ctx, best, n, time.perf_counter() - t0, memory_fraction)


def _search(ctx: PlanContext, pins: dict, recompute) -> tuple[Priced | None, int]:
    best, n = None, 0
    for lay in layouts(ctx, pins):
        n += 1
        p = price(ctx, lay, recompute)
        if p is not None and (best is None or _key(p) < _key(best)):
            best = p
    return best, n


def _key(p: Priced) -> tuple:
    lay = p.layout
    return (round(p.step_time, 9), lay.pipeline, lay.tensor, lay.fsdp, lay.virtual_stages)


def _no_fit(model: Transformer, cluster: Cluster, pins: dict, recompute, n: int,
            ctx: PlanContext) -> str:
    fixed = {k: v for k, v in pins.items() if v is not None}
    if recompute is not None:
        fixed["recompute"] = recompute
    if n == 0:
        return (f"`plan_cluster`: no layout of {model.name} on {cluster.devices} devices "
                f"matches {fixed or 'the model'}: tensor must divide the heads "
                f"({model.heads}) and KV heads ({model.kv_heads}) and a node's "
                f"{cluster.spec.devices_per_node} devices, and data x fsdp x microbatch size "
                f"must divide the global batch ({model.global_batch}).")
    need = 16.0 * model.num_params / cluster.devices
    return (f"`plan_cluster`: none of the {n} layouts of {model.name} "
            f"({model.num_params / 1e9:.1f}B parameters) on {cluster.devices} x "
            f"{cluster.spec.kind}{f' with {fixed}' if fixed else ''} fits "
            f"{ctx.memory_limit / GB:.1f} GB per device, even with full recompute (the "
            f"weights and Adam state alone need {need / GB:.1f} GB per device spread "
            f"evenly). Use more devices, a device with more HBM, or fewer pins.")


def _plan(ctx: PlanContext, p: Priced, n: int, seconds: float, fraction: float) -> ClusterPlan:
    lay: ClusterLayout = p.layout
    c = ctx.cluster
    assumptions = {
        "cluster": c.spec.source,
        "device model": ctx.dm.describe(),
        "memory": f"16 B per parameter (bf16 weights and grads over tensor x fsdp; fp32 "
                  f"master and Adam m, v over tensor x fsdp x data); activations per "
                  f"Korthikanti et al. 2022 for a Llama layer with flash attention; "
                  f"{fraction:.0%} of HBM usable",
        "time": "matmul flops and bytes from one layer's jaxpr (identical layers costed "
                "once); tensor parallelism with sequence parallelism, not overlapped; "
                "pipeline transfers not overlapped; fsdp gathers overlapped per layer; "
                "data-axis reduce-scatter and all-gather once a step",
        "mfu": "model flops = the jaxpr's forward and backward matmul flops (causal "
               "attention: half its s x s products; recompute not counted) over step x "
               "devices x dense bf16 peak",
    }
    return ClusterPlan(
        model=ctx.model, cluster=c, pipeline=lay.pipeline, data=lay.data, tensor=lay.tensor,
        fsdp=lay.fsdp, microbatch_size=lay.microbatch_size,
        num_microbatches=lay.num_microbatches, schedule=lay.schedule,
        virtual_stages=lay.virtual_stages, stage_layers=p.chunk_layers,
        recompute=p.recompute, memory=p.memory, breakdown=p.breakdown,
        step_time=p.step_time, model_flops=p.model_flops, bubble=p.bubble,
        memory_limit=ctx.memory_limit, considered=n, plan_seconds=seconds,
        assumptions=assumptions)
