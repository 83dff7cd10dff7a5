"""Compile time of a pipelined transformer LM: threads, jax.jit + scan, persistent cache.

    python tools/bench_compile.py [--quick] [--threads 1,2,4] [--schedules 1f1b,interleaved]
                                  [--no-persistent] [--json PATH] [--step]
    python tools/bench_compile.py --cold [--schedules 1f1b,interleaved] [--threads 2]

A transformer LM (vocabulary 8192, d=128, sequences of 64, 8 blocks; the embedding
in the first stage, the head and the loss in the last) on 4 submeshes x 2 devices,
``microbatch(value_and_grad(loss), ...)`` over M=8 microbatches of 2 sequences:

- ``1f1b``: 4 stages of 2 blocks, one per submesh;
- ``interleaved``: 8 one-block stages placed round-robin (V=2 per submesh),
  ``interleaved-1f1b``.

For each schedule it compiles the step with ``MULTIMESH_COMPILE_THREADS`` set to each
``--threads`` value, the thread counts side by side in every repetition (the machine
may be shared: compare ratios within one run), and ``jax.jit`` of the same step with a
``lax.scan`` over the microbatches (sharded over the same 8 devices). Caches (ours and
jax's) are cleared before every compile; figures are medians. Then, unless
``--no-persistent``, two fresh processes compile the first schedule with jax's
persistent compilation cache in a temporary directory: the second loads every
fragment from it. Also reported: XLA compilations per stage (task), and the process
CPU time of each compile (all threads), steadier than wall time on a shared machine.

``--cold`` (issue 31): for each schedule, fresh processes with jax's persistent cache on
and empty: one compiles the step (``--threads``, the last value), one ``jax.jit`` +
``lax.scan`` of it, then a second process compiles the step again from the filled cache;
each reports the process CPU time and wall time of its compile.
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

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/ (its helpers)
from _bench_common import write_json  # noqa: E402

VOCAB, D, SEQ, BLOCKS, SUBMESHES, M, MB_SIZE = 8192, 128, 64, 8, 4, 8, 2


def _block(p, x):
    import jax
    import jax.numpy as jnp

    def norm(h):
        mu = h.mean(-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6)

    h, heads = norm(x), 4
    q, k, v = (jnp.einsum("bsd,de->bse", h, p[n]).reshape(*h.shape[:2], heads, -1)
               for n in ("wq", "wk", "wv"))
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    logits = jnp.einsum("bqhe,bkhe->bhqk", q, k) / (D // heads) ** 0.5
    att = jax.nn.softmax(jnp.where(mask, logits, -1e9), -1)
    x = x + jnp.einsum("bhqk,bkhe->bqhe", att, v).reshape(x.shape) @ p["wo"]
    return x + jax.nn.gelu(norm(x) @ p["w1"]) @ p["w2"]


def model(schedule: str):
    """``(loss, params, tokens, schedule name)`` of the LM for one placement."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import multimesh.jax as mm

    n_stages = BLOCKS if schedule == "interleaved" else SUBMESHES
    per = BLOCKS // n_stages

    def stage_fn(k):
        def stage(ps, x):
            if k == 0:
                x = ps["embed"][x]
            x = mm.with_sharding_constraint(x, P("batch", None, None))
            for p in ps["blocks"]:
                x = _block(p, x)
            if k == n_stages - 1:
                x = x @ ps["head"]
            return x
        return stage

    def mesh(k):
        s = k % SUBMESHES
        return mm.TaskMesh(devices=(2 * s, 2 * s + 1), axis_names=("x",), axis_sizes=(2,))

    tasks = [mm.task(stage_fn(k), name=f"stage{k}", mesh=mesh(k),
                     logical_axes=(("batch", "x"),)) for k in range(n_stages)]

    def loss(params, tokens):
        x = tokens[:, :-1]
        for t, ps in zip(tasks, params):
            x = t(ps, x)
        logp = jax.nn.log_softmax(x, -1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

    key = jax.random.key(0)
    shapes = {"wq": (D, D), "wk": (D, D), "wv": (D, D), "wo": (D, D), "w1": (D, 4 * D),
              "w2": (4 * D, D)}

    def rnd(i, sh):
        return jax.random.normal(jax.random.fold_in(key, i), sh) / sh[0] ** 0.5

    params = []
    for k in range(n_stages):
        ps = {"blocks": [{n: rnd(1000 * k + 10 * b + j, sh) for j, (n, sh) in
                          enumerate(shapes.items())} for b in range(per)]}
        if k == 0:
            ps["embed"] = rnd(7, (VOCAB, D))
        if k == n_stages - 1:
            ps["head"] = rnd(8, (D, VOCAB))
        params.append(ps)
    tokens = jax.random.randint(jax.random.fold_in(key, 9), (M * MB_SIZE, SEQ + 1), 0, VOCAB)
    return loss, params, tokens, "interleaved-1f1b" if schedule == "interleaved" else "1f1b"


def _clear():
    import jax

    import multimesh.jax as mm

    mm.clear_caches()
    jax.clear_caches()


def ours(schedule: str, threads: int, share: bool = True) -> dict:
    """One compile of the step with ``threads`` compile threads (caches cleared);
    ``share=False`` compiles every fragment, also those identical up to their devices
    (what multimesh did before issue 25)."""
    import jax

    import multimesh.jax as mm
    from multimesh.runtime import executor

    loss, params, tokens, name = model(schedule)
    _clear()
    os.environ["MULTIMESH_COMPILE_THREADS"] = str(threads)
    shape_key = executor._shape_key
    if not share:  # every fragment its own group: nothing is loaded from another
        executor._shape_key = lambda frag, donors: (frag.text, frag.devices, donors)
    try:
        step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=MB_SIZE, argnum=1,
                             schedule=name)
        t0, c0 = time.perf_counter(), time.process_time()
        compiled = mm.mjit(step).lower(params, tokens).compile()
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        del os.environ["MULTIMESH_COMPILE_THREADS"]
        executor._shape_key = shape_key
    per_task: dict[str, int] = {}
    compiles: dict[str, int] = {}
    for f in compiled.fragments:
        per_task[f["task"]] = per_task.get(f["task"], 0) + 1
        compiles[f["task"]] = (compiles.get(f["task"], 0)
                               + (compiled.xla_sources[f["name"]] == "xla"))
    return {"total": total, "cpu": cpu, "xla": compiled.compile_times["xla"],
            "xla_sum": sum(compiled.xla_times.values()),
            "fragments": len(compiled.fragments), "xla_compiles": compiled._exec.xla_compiles,
            "per_task": per_task, "compiles_per_task": compiles, "sources": sorted(set(compiled.xla_sources.values()))}


def jit_scan(schedule: str) -> tuple[float, float]:
    """Seconds (wall, process CPU) to compile ``jax.jit`` of the same step, a ``lax.scan``
    over microbatches."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import multimesh.jax as mm

    loss, params, tokens, _ = model(schedule)
    _clear()

    def step(params, tokens):
        xs = tokens.reshape(M, MB_SIZE, *tokens.shape[1:])
        vg = jax.value_and_grad(loss)

        def body(acc, xm):
            return jax.tree.map(jax.numpy.add, acc, vg(params, xm)), None

        zero = jax.tree.map(jax.numpy.zeros_like, (jax.numpy.zeros(()), params))
        return jax.lax.scan(body, zero, xs)[0]

    mesh = Mesh(np.array(jax.devices()), ("x",))
    t0, c0 = time.perf_counter(), time.process_time()
    with mm.ignore_transforms():
        jax.jit(step, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("x")))
                ).lower(params, tokens).compile()
    return time.perf_counter() - t0, time.process_time() - c0


def step_time(schedule: str, reps: int = 7, calls: int = 5) -> dict:
    """Milliseconds per run of the compiled step (median and min over ``reps`` batches of
    ``calls`` runs), and its fragment calls per run."""
    import jax

    import multimesh.jax as mm

    loss, params, tokens, name = model(schedule)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=MB_SIZE, argnum=1,
                         schedule=name)
    compiled = mm.mjit(step).lower(params, tokens).compile()
    for _ in range(3):
        jax.block_until_ready(compiled(params, tokens))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = compiled(params, tokens)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times),
            "calls": len(compiled.calls)}


_CHILD = """
import json, sys, time
sys.path.insert(0, {tools!r})
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import bench_compile
if sys.argv[3] == "jit":
    wall, cpu = bench_compile.jit_scan(sys.argv[2])
    print(json.dumps({{"total": wall, "cpu": cpu}}))
else:
    print(json.dumps(bench_compile.ours(sys.argv[2], int(sys.argv[3]))))
"""


def _fresh(cache: str, schedule: str, what: str) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", _CHILD.format(tools=os.path.dirname(__file__)), cache,
         schedule, what], capture_output=True, text=True, check=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    return json.loads(p.stdout.strip().splitlines()[-1])


def cold(schedules: list[str], threads: int) -> None:
    """Fresh processes, jax's persistent cache on and empty: the step and jax.jit + scan;
    then the step again in a fresh process from the filled cache."""
    for sched in schedules:
        with tempfile.TemporaryDirectory() as c1, tempfile.TemporaryDirectory() as c2:
            first = _fresh(c1, sched, str(threads))
            scan = _fresh(c2, sched, "jit")
            second = _fresh(c1, sched, str(threads))
        print(f"{sched:12} cold, persistent cache on: step CPU {first['cpu']:6.2f} s "
              f"(wall {first['total']:6.2f} s, {first['xla_compiles']} XLA compiles of "
              f"{first['fragments']} fragments); jax.jit+scan CPU {scan['cpu']:6.2f} s "
              f"(wall {scan['total']:6.2f} s): {first['cpu'] / scan['cpu']:4.2f}x CPU, "
              f"{first['total'] / scan['total']:4.2f}x wall; warm process CPU "
              f"{second['cpu']:6.2f} s (wall {second['total']:6.2f} s, "
              f"{second['xla_compiles']} XLA compiles, sources {second['sources']})")


def persistent(schedule: str, threads: int) -> dict:
    """Two fresh processes compile the step with jax's persistent cache on."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for run in ("first process", "second process"):
            p = subprocess.run(
                [sys.executable, "-c", _CHILD.format(tools=os.path.dirname(__file__)), cache,
                 schedule, str(threads)], capture_output=True, text=True, check=True,
                env=dict(os.environ, JAX_PLATFORMS="cpu"))
            out[run] = json.loads(p.stdout.strip().splitlines()[-1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition (default 3)")
    ap.add_argument("--threads", default="1,2,4", help="compile thread counts to compare")
    ap.add_argument("--schedules", default="1f1b,interleaved")
    ap.add_argument("--no-persistent", action="store_true",
                    help="skip the two-process persistent-cache measurement")
    ap.add_argument("--json", help="write results as JSON to this path")
    ap.add_argument("--step", action="store_true",
                    help="only time one run of each compiled step (ms), no compiles timed")
    ap.add_argument("--cold", action="store_true",
                    help="fresh processes with jax's persistent cache on (issue 31)")
    args = ap.parse_args(argv)
    if args.cold:
        cold(args.schedules.split(","), int(args.threads.split(",")[-1]))
        return 0
    if args.step:
        for sched in args.schedules.split(","):
            r = step_time(sched)
            print(f"{sched:12} step {r['median_ms']:8.2f} ms (min {r['min_ms']:8.2f} ms), "
                  f"{r['calls']} fragment calls")
        return 0
    threads = [int(t) for t in args.threads.split(",")]
    reps = 1 if args.quick else 3
    print(f"{os.cpu_count()} CPUs; compile threads {threads}; {reps} repetition(s)")
    res: dict = {}
    for sched in args.schedules.split(","):
        # (threads, share): before issue 25 (serial, every fragment compiled), then
        # identical fragments once, then each thread count
        setups = [(1, False)] + [(t, True) for t in threads]
        runs: dict[tuple, list[dict]] = {st: [] for st in setups}
        scans = []
        for _ in range(reps):  # side by side: every setup in every repetition
            for st in setups:
                runs[st].append(ours(sched, *st))
            scans.append(jit_scan(sched))
        scan = statistics.median(w for w, _ in scans)
        scan_cpu = statistics.median(c for _, c in scans)
        base = statistics.median(r["total"] for r in runs[setups[0]])
        for st in setups:
            total = statistics.median(r["total"] for r in runs[st])
            xla = statistics.median(r["xla"] for r in runs[st])
            cpu = statistics.median(r["cpu"] for r in runs[st])
            last = runs[st][-1]
            label = f"threads={st[0]}{'' if st[1] else ' no sharing'}"
            res[f"{sched} {label}"] = {**last, "total": total, "xla": xla, "cpu": cpu,
                                       "/jit+scan": total / scan, "/before": total / base,
                                       "cpu/jit+scan": cpu / scan_cpu}
            print(f"{sched:12} {label:22}: compile {total:6.2f} s (XLA {xla:6.2f} s, "
                  f"{last['xla_compiles']:2} XLA compiles of {last['fragments']} fragments), "
                  f"{total / scan:4.2f}x jax.jit+scan, {total / base:4.2f}x before; process "
                  f"CPU {cpu:6.2f} s, {cpu / scan_cpu:4.2f}x jax.jit+scan's")
        print(f"{sched:12} jax.jit + lax.scan: {scan:6.2f} s (CPU {scan_cpu:6.2f} s); "
              f"fragments per stage: "
              f"{runs[setups[0]][-1]['per_task']}; XLA compiles per stage: "
              f"{runs[setups[1]][-1]['compiles_per_task']}")
        res[f"{sched} jit+scan"] = scan
        res[f"{sched} jit+scan cpu"] = scan_cpu
    if not args.no_persistent:
        sched = args.schedules.split(",")[0]
        pc = persistent(sched, threads[-1])
        first, second = pc["first process"]["total"], pc["second process"]["total"]
        print(f"{sched:12} persistent cache, threads={threads[-1]}: first process "
              f"{first:6.2f} s, second {second:6.2f} s ({second / first:4.2f}x); sources "
              f"{pc['first process']['sources']} then {pc['second process']['sources']}")
        res[f"{sched} persistent"] = pc
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
