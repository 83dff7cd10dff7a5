"""Planner time on a 100-unit model (issue 24: "seconds, not minutes").

    python tools/bench_planner.py [--units 100] [--repeat 3] [--json PATH]

A Flax linen language model with an embedding, ``units - 2`` MLP blocks and an output
head (100 units by default), planned on 8 CPU devices with ``plan_pipeline`` and
everything left to the planner (stages, microbatches, schedule) under a memory limit,
so the search tries every candidate. Reports the whole call (trace, XLA cost analysis
of the units, search) and the search alone, the best of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax._planner import _search  # noqa: E402


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x))))


class Deep(nn.Module):
    blocks: int
    vocab: int = 1024

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(self.vocab, 64, name="embed")(tok)
        for i in range(self.blocks):
            x = Block(name=f"layers_{i}")(x)
        logits = nn.Dense(self.vocab, name="head")(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[..., None], -1))


def run(units: int, repeat: int) -> dict:
    model = Deep(units - 2)
    tok = jnp.zeros((32, 32), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tok))
    calls = []
    searched = []
    original = _search.search

    def timed_search(*a, **k):
        t = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            searched.append(time.perf_counter() - t)

    _search.search = timed_search
    import multimesh.jax._planner._api as api

    api.search = timed_search
    try:
        for _ in range(repeat):
            t = time.perf_counter()
            plan = mm.plan_pipeline(model.apply, params, tok, memory_limit=64 * 2**20,
                                    optimizer_state_factor=2.0)
            calls.append(time.perf_counter() - t)
    finally:
        _search.search = original
        api.search = original
    return {"units": len(plan.units), "stages": plan.num_stages,
            "microbatches": plan.num_microbatches, "schedule": plan.schedule,
            "plan_s": min(calls), "search_s": min(searched)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = run(args.units, args.repeat)
    print(f"{out['units']} units -> {out['stages']} stages, {out['microbatches']} "
          f"microbatches, {out['schedule']}: plan_pipeline {out['plan_s']:.2f} s "
          f"(search {out['search_s']:.2f} s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
