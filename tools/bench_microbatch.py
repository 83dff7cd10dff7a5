"""P8: compile time of a pipelined transformer against the number of microbatches.

    python tools/bench_microbatch.py [--quick] [--json PATH]
    python tools/bench_microbatch.py --where    # one compile, phase by phase

A transformer-like model (d=256, sequences of 128, 2 stages x 8 layers, each stage a
task on 4 devices) trained with ``microbatch(value_and_grad(loss), schedule="1f1b")``
for M = 1, 4, 16 and 64 microbatches of 2 sequences. For each M it reports the
phases of ``mjit(step).lower(...).compile()`` (trace + lower, the pass pipeline, the
runtime plan, XLA), the number of XLA compilations and of distinct fragments, and,
side by side, ``jax.jit`` of the same step with a ``lax.scan`` over the microbatches
(sharded over the same 8 devices). Caches (ours and jax's) are cleared before every
compile; each figure is the median of the repetitions.

Goals (issue 10): everything but XLA grows by at most 1.2x from M=1 to M=64, and the
whole compile at M=16 is within 1.3x of the jax.jit + scan compile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/ (its helpers)
from _bench_common import pipelined_transformer, write_json  # noqa: E402

D, SEQ, LAYERS, STAGES, MB_SIZE = 256, 128, 8, 2, 2


def _model():
    """(loss, params): ``STAGES`` stage tasks of ``LAYERS`` blocks, stage k on devices
    ``[4k, 4k + 4)``."""
    per = 8 // STAGES
    return pipelined_transformer(STAGES, LAYERS, D, 4,
                                 lambda k: range(per * k, per * k + per))


def _clear():
    import jax

    from multimesh.runtime import executor

    executor._COMPILE_CACHE.clear()
    jax.clear_caches()


def _ours(loss, params, x, M):
    import jax

    import multimesh.jax as mm
    from multimesh.runtime import executor

    _clear()
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=MB_SIZE, argnum=1,
                         schedule="1f1b")
    before = executor.xla_compiles
    compiled = mm.mjit(step).lower(params, x).compile()
    times = dict(compiled.compile_times)
    times["total"] = sum(times.values())
    times["xla_compiles"] = executor.xla_compiles - before
    times["fragments"] = len(compiled.fragments)
    times["calls"] = len(compiled.calls)
    return times


def _jit_scan(loss, params, x, M):
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import multimesh.jax as mm

    _clear()

    def step(params, x):
        xs = x.reshape(M, MB_SIZE, *x.shape[1:])
        vg = jax.value_and_grad(loss)

        def body(acc, xm):
            v, g = vg(params, xm)
            return jax.tree.map(jax.numpy.add, acc, (v, g)), None

        zero = jax.tree.map(jax.numpy.zeros_like, (jax.numpy.zeros(()), params))
        return jax.lax.scan(body, zero, xs)[0]

    mesh = Mesh(np.array(jax.devices()), ("x",))
    t0 = time.perf_counter()
    with mm.ignore_transforms():
        jax.jit(step, in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "x")))
                ).lower(params, x).compile()
    return time.perf_counter() - t0


def P8(ms=(1, 4, 16, 64), reps=3) -> dict:
    import jax
    import jax.numpy as jnp

    loss, params = _model()
    out = {}
    rows = []
    for M in ms:
        x = jax.random.normal(jax.random.key(1), (M * MB_SIZE, SEQ, D), jnp.float32)
        runs = [_ours(loss, params, x, M) for _ in range(reps)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        jit = statistics.median(_jit_scan(loss, params, x, M) for _ in range(reps))
        med["jit_scan"] = jit
        rows.append((M, med))
        for k, v in med.items():
            out[f"P8_M{M}_{k}"] = v
    base = rows[0][1]
    last = rows[-1][1]
    non_xla = ("trace_lower", "passes", "plan")
    out["P8_non_xla_growth_M1_to_M64"] = (sum(last[k] for k in non_xla)
                                          / sum(base[k] for k in non_xla))
    m16 = dict(rows)[16] if 16 in dict(rows) else last
    out["P8_total_over_jit_scan_M16"] = m16["total"] / m16["jit_scan"]
    print(f"{'M':>4} {'trace+lower':>12} {'passes':>8} {'plan':>8} {'xla':>8} {'total':>8} "
          f"{'jit+scan':>9} {'compiles':>9} {'fragments':>10} {'calls':>6}")
    for M, r in rows:
        print(f"{M:>4} {r['trace_lower']:>12.3f} {r['passes']:>8.3f} {r['plan']:>8.3f} "
              f"{r['xla']:>8.3f} {r['total']:>8.3f} {r['jit_scan']:>9.3f} "
              f"{int(r['xla_compiles']):>9} {int(r['fragments']):>10} {int(r['calls']):>6}")
    print(f"non-XLA growth M={ms[0]} -> M={ms[-1]}: "
          f"{out['P8_non_xla_growth_M1_to_M64']:.2f}x; total / jit+scan at M=16: "
          f"{out['P8_total_over_jit_scan_M16']:.2f}")
    return out


def where(M: int = 16) -> dict:
    """Where the time of one compile goes (``--where``): the pipelined transformer at
    ``M`` microbatches, caches cleared, every phase, every pass and every fragment's
    XLA compile, as ``compiled.compile_times``, ``pass_times`` and ``xla_times`` give
    them (the same figures the ``multimesh`` logger reports)."""
    import jax

    import multimesh.jax as mm

    loss, params = _model()
    x = jax.random.normal(jax.random.key(1), (M * MB_SIZE, SEQ, D))
    _clear()
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=MB_SIZE, argnum=1,
                         schedule="1f1b")
    compiled = mm.mjit(step).lower(params, x).compile()
    times = compiled.compile_times
    total = sum(times.values())
    rows = [("trace + lower", times["trace_lower"])]
    rows.append(("passes (parse, run, verify)", times["passes"]))
    rows += [(f"  {name}", t) for name, t in compiled.pass_times]
    rows.append(("runtime plan", times["plan"]))
    rows.append((f"XLA ({len(compiled.xla_times)} fragments)", times["xla"]))
    rows += [(f"  {name}", t) for name, t in sorted(compiled.xla_times.items(),
                                                      key=lambda kv: -kv[1])]
    print(f"one compile: transformer d={D}, {STAGES} stages x {LAYERS} layers, M={M}, 1F1B")
    print(f"{'phase':<40}{'seconds':>9}{'share':>8}")
    for name, t in rows:
        print(f"{name:<40}{t:>9.3f}{100 * t / total:>7.1f}%")
    print(f"{'total':<40}{total:>9.3f}")
    return {f"where {name.strip()}": t for name, t in rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repetition")
    ap.add_argument("--json", help="write results as JSON to this path")
    ap.add_argument("--where", action="store_true",
                    help="where the time of one compile (M=16) goes, phase by phase")
    args = ap.parse_args(argv)
    res = where() if args.where else P8(reps=1 if args.quick else 3)
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
