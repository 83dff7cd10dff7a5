"""Compile time of the lm1b 4x2 M=8 step against jax.jit: cold, and warm restarts.

    python tools/bench_warm.py [--reps 3] [--schedules 1f1b,interleaved] [--json PATH]
    python tools/bench_warm.py --cold [--reps 3] [--schedules 1f1b,interleaved]

The step (issue 40): flax's lm1b-shaped ``TransformerLM`` (``tests/real_models.py``:
vocabulary 8192, 8 blocks, embedding 64, 4 heads, MLP 128, sequences of 32), a batch of
16 cut into M=8 microbatches, ``value_and_grad`` then an optax adam update, on 4
submeshes x 2 devices (``mesh_slice`` of a ``("stage", "data", "model")`` mesh, the
batch over ``data``): blocks 2k and 2k+1 on submesh k with 1F1B, or block k on submesh
k mod 4 with interleaved 1F1B. Against it, ``jax.jit`` of the same train step with a
``lax.scan`` over the 8 microbatches on the same 8 devices (batch over all of them).

Each measurement is a fresh process with jax's persistent compilation cache on (a
temporary directory per program, filled once by a first process): the second process's
whole ``trace`` + ``lower`` + ``compile``, and its phases (multimesh: trace, lower,
passes, plan, XLA; the passes are skipped on a hit of multimesh's own cache of the
pass pipeline, docs/performance.md "Warm restarts"). Every repetition runs the two
programs side by side (the machine may be shared: compare ratios within one run);
figures are medians. ``--no-pipeline-cache`` turns multimesh's cache of the pass
pipeline off (``MULTIMESH_PIPELINE_CACHE=0``), to see what it saves.

``--cold`` (issue 40, "CSCALE"): every cache cleared. Each measurement is a fresh
process with jax's persistent cache off and multimesh's pass cache off
(``MULTIMESH_PIPELINE_CACHE=0``), so XLA compiles every program; the multimesh and
``jax.jit`` processes alternate (which goes first alternates too). Reported: the whole
``trace`` + ``lower`` + ``compile`` of each, the ratio per pair and its median, and
multimesh's phases with every fragment's XLA compile (``compiled.xla_times``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/ (its helpers)
from _bench_common import write_json  # noqa: E402

LAYERS, SUBMESHES, BATCH, M = 8, 4, 16, 8


def model(schedule: str):
    """``(stages, params, batch, schedule name, submesh of stage k)``."""
    from tests.real_models import LmConfig, Stage, init_stages, token_batch

    cfg = LmConfig(vocab=8192, embed=64, heads=4, kv=16, mlp=128, length=32)
    n = LAYERS if schedule == "interleaved" else SUBMESHES
    per = LAYERS // n
    stages = [Stage(cfg, layers=per, first=k == 0, last=k == n - 1) for k in range(n)]
    batch = token_batch(BATCH, cfg)
    params = init_stages(stages, batch)
    name = "interleaved-1f1b" if schedule == "interleaved" else "1f1b"
    return stages, params, batch, name, (lambda k: k % SUBMESHES)


def _train(grad_fn):
    import optax

    opt = optax.adam(1e-3)

    def step(params, opt_state, batch):
        loss, grads = grad_fn(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return loss, optax.apply_updates(params, updates), opt_state
    return opt, step


def ours(schedule: str) -> dict:
    """Trace, lower and compile the multimesh step; seconds per phase."""
    import flax.linen as nn
    import jax
    from jax.sharding import AxisType

    import multimesh.jax as mm
    from multimesh.runtime.parallel import compile_threads
    from tests.real_models import RULES, loss_of

    stages, params, batch, name, submesh = model(schedule)
    mesh = jax.make_mesh((SUBMESHES, 2, 1), ("stage", "data", "model"),
                         axis_types=(AxisType.Auto,) * 3)
    tasks = [mm.task(s.apply, name=f"s{k}", mesh_slice={"stage": submesh(k)})
             for k, s in enumerate(stages)]
    grad = mm.microbatch(jax.value_and_grad(loss_of(tasks)), dim=0, size=BATCH // M,
                         argnum=1, schedule=name, reduction="mean")
    opt, step = _train(grad)
    state = opt.init(params)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        t0, c0 = time.perf_counter(), time.process_time()
        traced = mm.mjit(step).trace(params, state, batch)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3, c3 = time.perf_counter(), time.process_time()
    times = compiled.compile_times
    return {"total": t3 - t0, "cpu": c3 - c0, "trace": t1 - t0, "lower": t2 - t1,
            "compile": t3 - t2, "passes": times.get("passes", 0.0),
            "plan": times.get("plan", 0.0), "xla": times.get("xla", 0.0),
            "pipeline_cache": getattr(compiled, "pipeline_cache", None),
            "fragments": len(compiled.fragments), "xla_compiles": compiled._exec.xla_compiles,
            "sources": sorted(set(compiled.xla_sources.values())),
            **_per_compile(compiled),
            "split": {k: v[0] for k, v in compiled.split_fragments.items()},
            "threads": compile_threads()}


def _per_compile(compiled) -> dict:
    """Seconds and origin of each fragment, a split fragment's pieces in its place
    (``compiled.split_fragments``: the pieces XLA compiles, and the shared program
    it loads)."""
    seconds, sources = {}, {}
    for name, t in compiled.xla_times.items():
        pieces = compiled.split_fragments.get(name, (None, [(name, None, t)]))[1]
        for piece, origin, secs in pieces:
            seconds[piece] = round(secs, 4)
            sources[piece] = origin or compiled.xla_sources[name]
    return {"fragment_seconds": seconds, "fragment_sources": sources}


def jit_scan(schedule: str) -> dict:
    """Trace, lower and compile ``jax.jit`` of the step with a ``lax.scan``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    stages, params, batch, _, _ = model(schedule)
    from tests.real_models import loss_of

    vg = jax.value_and_grad(loss_of([s.apply for s in stages]))

    def grad(params, batch):
        xs = jax.tree.map(lambda a: a.reshape(M, BATCH // M, *a.shape[1:]), batch)

        def body(acc, xm):
            return jax.tree.map(jnp.add, acc, vg(params, xm)), None

        zero = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
        total = jax.lax.scan(body, zero, xs)[0]
        return jax.tree.map(lambda a: a / M, total)

    opt, step = _train(grad)
    state = opt.init(params)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    t0, c0 = time.perf_counter(), time.process_time()
    traced = jax.jit(step, in_shardings=(rep, rep, rows)).trace(params, state, batch)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3, c3 = time.perf_counter(), time.process_time()
    return {"total": t3 - t0, "cpu": c3 - c0, "trace": t1 - t0, "lower": t2 - t1,
            "compile": t3 - t2}


_CHILD = """
import json, os, sys
sys.path.insert(0, {tools!r})
import jax
if sys.argv[1] != "-":  # "-": cold, jax's persistent cache off
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import bench_warm
fn = bench_warm.jit_scan if sys.argv[3] == "jit" else bench_warm.ours
print(json.dumps(fn(sys.argv[2])))
"""


def fresh(cache: str | None, schedule: str, what: str, env: dict | None = None) -> dict:
    """One fresh process compiling ``what`` (``mm`` or ``jit``) with ``cache`` on, or with
    no persistent cache at all (``cache=None``)."""
    # PYTHONDONTWRITEBYTECODE dropped: a user's restart imports compiled modules
    # (the first process writes them), and this environment may forbid writing them
    base = {k: v for k, v in os.environ.items()
            if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE",
                         "PYTHONDONTWRITEBYTECODE")}
    p = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tools=os.path.dirname(__file__)),
         cache or "-", schedule, what], capture_output=True, text=True,
        env=dict(base, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
                 XLA_FLAGS="--xla_force_host_platform_device_count=8", **(env or {})))
    if p.returncode:
        raise RuntimeError(p.stderr[-4000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def _load() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def run(schedule: str, reps: int, env: dict) -> dict:
    """Cold processes fill both caches; then ``reps`` warm processes of each, side by side."""
    with tempfile.TemporaryDirectory() as c_mm, tempfile.TemporaryDirectory() as c_jit:
        cold_mm, cold_jit = fresh(c_mm, schedule, "mm", env), fresh(c_jit, schedule, "jit")
        warm_mm, warm_jit, loads = [], [], []
        for _ in range(reps):
            loads.append(_load())
            warm_mm.append(fresh(c_mm, schedule, "mm", env))
            warm_jit.append(fresh(c_jit, schedule, "jit"))
    med = {k: statistics.median(r[k] for r in warm_mm)
           for k in ("total", "cpu", "trace", "lower", "compile", "passes", "plan", "xla")}
    jmed = {k: statistics.median(r[k] for r in warm_jit)
            for k in ("total", "cpu", "trace", "lower", "compile")}
    ratios = [a["total"] / b["total"] for a, b in zip(warm_mm, warm_jit)]
    return {"schedule": schedule, "loads": loads, "cold_mm": cold_mm, "cold_jit": cold_jit,
            "warm_mm": med, "warm_jit": jmed, "ratio": med["total"] / jmed["total"],
            "ratio_cpu": med["cpu"] / jmed["cpu"], "pair_ratios": ratios,
            "warm_mm_runs": warm_mm, "warm_jit_runs": warm_jit}


def run_cold(schedule: str, reps: int) -> dict:
    """``reps`` pairs of fresh processes, every cache off; which goes first alternates."""
    env = {"MULTIMESH_PIPELINE_CACHE": "0"}
    mm_runs, jit_runs, loads = [], [], []
    for i in range(reps):
        loads.append(_load())
        order = ("mm", "jit") if i % 2 == 0 else ("jit", "mm")
        got = {w: fresh(None, schedule, w, env if w == "mm" else None) for w in order}
        mm_runs.append(got["mm"])
        jit_runs.append(got["jit"])
    med = {k: statistics.median(r[k] for r in mm_runs)
           for k in ("total", "cpu", "trace", "lower", "compile", "passes", "plan", "xla")}
    jmed = {k: statistics.median(r[k] for r in jit_runs)
            for k in ("total", "cpu", "trace", "lower", "compile")}
    frags = {n: statistics.median(r["fragment_seconds"].get(n, 0.0) for r in mm_runs)
             for n in mm_runs[-1]["fragment_seconds"]}
    ratios = [a["total"] / b["total"] for a, b in zip(mm_runs, jit_runs)]
    return {"schedule": schedule, "loads": loads, "mm": med, "jit": jmed,
            "fragments": frags, "sources": mm_runs[-1]["fragment_sources"],
            "ratio": statistics.median(ratios), "pair_ratios": ratios,
            "ratio_cpu": statistics.median(a["cpu"] / b["cpu"]
                                           for a, b in zip(mm_runs, jit_runs)),
            "mm_runs": mm_runs, "jit_runs": jit_runs}


def _print_cold(r: dict) -> None:
    w, j, s = r["mm"], r["jit"], r["schedule"]
    last = r["mm_runs"][-1]
    print(f"{s:12} cold multimesh {w['total']:5.2f} s (trace {w['trace']:.2f}, lower "
          f"{w['lower']:.2f}, passes {w['passes']:.2f}, plan {w['plan']:.2f}, XLA "
          f"{w['xla']:.2f}; CPU {w['cpu']:.2f}; {last['xla_compiles']} XLA compiles of "
          f"{last['fragments']} fragments, {last['threads']} threads)")
    compiled = [(n, t) for n, t in r["fragments"].items() if r["sources"][n] == "xla"]
    print(f"{s:12}   XLA compiles: " + ", ".join(f"{n} {t:.2f}" for n, t in compiled)
          + f" (sum {sum(t for _, t in compiled):.2f} s)")
    if last.get("split"):
        print(f"{s:12}   split around a shared program: " + ", ".join(
            f"{n} (shares {b})" for n, b in last["split"].items()))
    print(f"{s:12} cold jax.jit+scan {j['total']:5.2f} s (trace {j['trace']:.2f}, lower "
          f"{j['lower']:.2f}, compile {j['compile']:.2f}; CPU {j['cpu']:.2f})")
    print(f"{s:12} CSCALE {r['ratio']:.2f} (CPU {r['ratio_cpu']:.2f}; per pair "
          f"{', '.join(f'{x:.2f}' for x in r['pair_ratios'])}; load {' '.join(r['loads'])})")


def _print(r: dict) -> None:
    w, j, c = r["warm_mm"], r["warm_jit"], r["cold_mm"]
    last = r["warm_mm_runs"][-1]
    print(f"{r['schedule']:12} cold: multimesh {c['total']:5.2f} s ({c['xla_compiles']} XLA "
          f"compiles), jax.jit+scan {r['cold_jit']['total']:5.2f} s")
    print(f"{r['schedule']:12} warm multimesh {w['total']:5.2f} s (trace {w['trace']:.2f}, "
          f"lower {w['lower']:.2f}, passes {w['passes']:.2f}, plan {w['plan']:.2f}, "
          f"XLA/load {w['xla']:.2f}; CPU {w['cpu']:.2f}; {last['xla_compiles']} XLA compiles,"
          f" pipeline cache {last['pipeline_cache']})")
    print(f"{r['schedule']:12} warm jax.jit+scan {j['total']:5.2f} s (trace {j['trace']:.2f}, "
          f"lower {j['lower']:.2f}, compile {j['compile']:.2f}; CPU {j['cpu']:.2f})")
    print(f"{r['schedule']:12} warm ratio {r['ratio']:.2f} (CPU {r['ratio_cpu']:.2f}; per "
          f"pair {', '.join(f'{x:.2f}' for x in r['pair_ratios'])}; load {' '.join(r['loads'])})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--schedules", default="1f1b,interleaved")
    ap.add_argument("--no-pipeline-cache", action="store_true",
                    help="MULTIMESH_PIPELINE_CACHE=0 in the multimesh processes")
    ap.add_argument("--cold", action="store_true",
                    help="every cache off: fresh processes, no persistent cache (CSCALE)")
    ap.add_argument("--json", help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    env = {"MULTIMESH_PIPELINE_CACHE": "0"} if args.no_pipeline_cache else {}
    out = []
    for sched in args.schedules.split(","):
        r = run_cold(sched, args.reps) if args.cold else run(sched, args.reps, env)
        (_print_cold if args.cold else _print)(r)
        out.append(r)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
