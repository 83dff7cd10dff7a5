"""The cluster planner against the published record (issue 38, item 7).

For each published large-model training run (docs/planning.md cites each): the
published layout and efficiency, the planner's own choice on the same described
cluster (layout, predicted MFU, time to plan), and the planner's prediction for the
published layout itself (pinned). Nothing here is fitted to these rows: the device
model's figures are the datasheets' and its one efficiency factor is a published
kernel's (multimesh/jax/_analysis/devices.py); gradients are reduced in fp32, as
Megatron-LM and the Llama 3 paper do (GRAD_REDUCE_BYTES in
multimesh/jax/_planner/_cluster_search.py).

    PYTHONPATH=. python tools/bench_planner_scale.py [--markdown]

MFU convention: model flops (forward and backward, no recompute; the causal
attention's half of its s x s products) over step time x devices x dense bf16 peak. Megatron-LM 2021 reports flops
*with* full recompute (its eq. 3, 96 B s l h^2 ...), so its published MFU here is its
figure x 3/4. NVIDIA's H100 Llama 3 recipes are FP8 runs: their layouts are
compared, their throughput is not (this planner plans bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import multimesh.jax as mm


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    source: str
    model: mm.Transformer
    cluster: mm.Cluster
    published: dict  # the published layout as plan_cluster pins
    mfu: float | None  # published model-flops utilisation (None: not comparable)
    note: str = ""


def _gpt(layers: int, d: int, heads: int, batch: int, name: str) -> mm.Transformer:
    """A GPT-3-style model (MHA, a 4h GELU MLP) as a Transformer: a SwiGLU of width
    8h/3 has the GELU MLP's parameters and flops."""
    return mm.Transformer(layers=layers, d_model=d, heads=heads, kv_heads=heads,
                          ffn=8 * d // 3, vocab=51200, seq=2048, global_batch=batch, name=name)


def rows() -> list[Row]:
    llama = "Llama 3 paper (arXiv:2407.21783), Table 4"
    nv = "NVIDIA Megatron-Bridge performance summary, DGX-H100 (FP8)"
    meg = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1"
    l405 = mm.Transformer.llama3("405b", global_batch=2048)
    return [
        Row("Llama 3 405B", llama, l405, mm.Cluster("h100", 8192),
            dict(tensor=8, pipeline=16, data=64, fsdp=1), 0.43),
        Row("Llama 3 405B", llama, l405, mm.Cluster("h100", 16384),
            dict(tensor=8, pipeline=16, data=128, fsdp=1), 0.41),
        Row("Llama 3 8B", nv, mm.Transformer.llama3("8b", global_batch=128),
            mm.Cluster("h100", 8), dict(tensor=1, pipeline=1, data=1, fsdp=8), None,
            "FP8; 14,079 tokens/s/GPU"),
        Row("Llama 3 70B", nv, mm.Transformer.llama3("70b", global_batch=128),
            mm.Cluster("h100", 64), dict(tensor=4, pipeline=8, data=2, fsdp=1,
                                         virtual_stages=5), None,
            "FP8; VP 5; 1,619 tokens/s/GPU"),
        Row("GPT 39.1B", meg, _gpt(48, 8192, 64, 1536, "gpt-39b"), mm.Cluster("a100", 512),
            dict(tensor=8, pipeline=2, data=32, fsdp=1, recompute="full"), 0.44 * 0.75, "44% with recompute"),
        Row("GPT 145.6B", meg, _gpt(80, 12288, 96, 2304, "gpt-146b"),
            mm.Cluster("a100", 1536), dict(tensor=8, pipeline=8, data=24, fsdp=1, recompute="full"),
            0.47 * 0.75, "47% with recompute"),
        Row("GPT 1T", meg, _gpt(128, 25600, 160, 3072, "gpt-1t"), mm.Cluster("a100", 3072),
            dict(tensor=8, pipeline=64, data=6, fsdp=1, recompute="full"), 0.52 * 0.75, "52% with recompute"),
    ]


def _layout(p: mm.ClusterPlan) -> str:
    v = f" VP{p.virtual_stages}" if p.virtual_stages > 1 else ""
    return f"TP{p.tensor} PP{p.pipeline} DP{p.data} FSDP{p.fsdp}{v} mb{p.microbatch_size}"


def _pub(d: dict) -> str:
    v = f" VP{d['virtual_stages']}" if d.get("virtual_stages", 1) > 1 else ""
    r = f", recompute {d['recompute']}" if "recompute" in d else ""
    return f"TP{d['tensor']} PP{d['pipeline']} DP{d['data']} FSDP{d['fsdp']}{v}{r}"


def measure(row: Row) -> dict:
    t0 = time.perf_counter()
    chosen = mm.plan_cluster(row.model, row.cluster)
    seconds = time.perf_counter() - t0
    try:
        pinned = mm.plan_cluster(row.model, row.cluster, **row.published)
    except mm.MultimeshError as e:
        pinned = str(e).split(";")[0]
    return {"row": row, "chosen": chosen, "seconds": seconds, "pinned": pinned}


def _mfu(plan, published) -> str:
    if isinstance(plan, str):
        return "does not fit"
    rel = f" ({plan.mfu / published - 1:+.0%})" if published else ""
    return f"{plan.mfu:.1%}{rel}"


def table(results: list[dict]) -> str:
    head = ("| run | devices | published layout | published MFU | planner's layout | "
            "its MFU | published layout, predicted MFU | plan time |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        row, c = r["row"], r["chosen"]
        pub = f"{row.mfu:.1%}" if row.mfu is not None else f"n/a ({row.note})"
        if row.mfu is not None and row.note:
            pub += f" ({row.note})"
        lines.append(
            f"| {row.name} | {row.cluster.devices} {row.cluster.spec.kind} | "
            f"{_pub(row.published)} | {pub} | {_layout(c)}, {c.schedule}, recompute "
            f"{c.recompute[0]} | {_mfu(c, row.mfu)} | {_mfu(r['pinned'], row.mfu)} | "
            f"{r['seconds']:.1f} s |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print only the markdown table")
    args = ap.parse_args()
    results = [measure(r) for r in rows()]
    print(table(results))
    if not args.markdown:
        for r in results:
            print(f"\n{r['row'].name} on {r['row'].cluster.devices}: {r['row'].source}")
            print(r["chosen"])


if __name__ == "__main__":
    main()
