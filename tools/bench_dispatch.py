"""Host cost of a call, in one process (issue 40 item 3).

    PYTHONPATH=. python tools/bench_dispatch.py [--rounds 4000]

p2      P2's program (8 one-op tasks on device 0): an ordinary call (the generated
        dispatch function), the same program through the interpreted step loop (what
        ``profile`` runs, without its blocking), and one jitted call, alternated call by
        call; medians per fragment and over the jitted call.
p11     P11's program (8 stages x 1 device, 32 microbatches, 1F1B): step time of an
        ordinary call against the interpreted loop, alternated, median of 40.
leaves  a training loop over 64 leaves through two tasks on one device, each step's
        outputs passed back: host time per step of the compiled program and of the
        ``mjit`` function (median of 300).

The interpreted loop is ``Executor.start`` + ``run_program`` over the steps'
``run``, the conversion around it the calling convention's, as in ``profile``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.models


def _interpreted(compiled):
    from multimesh.runtime import steps as st

    ex, conv = compiled._exec, compiled.convention

    def run(*args):
        flat = conv.inputs(args, {})
        return conv.results(ex.finish(st.run_program(ex._runs, ex.start(flat))))
    return run


def _alternate(fns: dict, args, rounds: int, block_each: bool) -> dict[str, float]:
    import jax

    for f in fns.values():
        jax.block_until_ready(f(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            out = f(*args)
            if block_each:
                jax.block_until_ready(out)
            times[k].append(time.perf_counter() - t0)
            jax.block_until_ready(out)
    return {k: statistics.median(v) for k, v in times.items()}


def p2(rounds: int) -> None:
    import jax
    import jax.numpy as jnp

    from multimesh.jax import TaskMesh, mjit, task

    mesh = TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,))
    tasks = [task(lambda x: x + 1.0, name=f"t{k}", mesh=mesh) for k in range(8)]

    def chain(x):
        for t in tasks:
            x = t(x)
        return x
    x = jnp.ones((4,))
    compiled = mjit(chain).lower(x).compile()
    x = jax.device_put(x, compiled.input_shardings[0][0])
    m = _alternate({"generated": compiled, "interpreted": _interpreted(compiled),
                    "jit": jax.jit(lambda x: x + 1.0)}, (x,), rounds, False)
    jit = m.pop("jit")
    print("p2   " + ", ".join(f"{k} {v / 8 * 1e6:.2f} us per fragment ({v / 8 / jit:.3f} jit)"
                              for k, v in m.items()) + f"; jit {jit * 1e6:.2f} us")


def p11(rounds: int) -> None:
    import jax
    import jax.numpy as jnp

    import multimesh.jax as mm
    from tests.models import mean_square_loss

    S, M, D, MB = 8, 32, 32, 4
    tasks = [mm.task(lambda w, x: jnp.tanh(x @ w), name=f"s{k}",
                     mesh=mm.TaskMesh(devices=(k,), axis_names=("x",), axis_sizes=(1,)))
             for k in range(S)]
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, k), (D, D)) / D ** 0.5 for k in range(S)]
    x = jax.random.normal(key, (M * MB, D))
    step = mm.microbatch(jax.value_and_grad(mean_square_loss(tasks)), dim=0, size=MB,
                         argnum=1, schedule="1f1b")
    compiled = mm.mjit(step).lower(ws, x).compile()
    args = (jax.device_put(ws, compiled.input_shardings[0][0]),
            jax.device_put(x, compiled.input_shardings[0][1]))
    m = _alternate({"generated": compiled, "interpreted": _interpreted(compiled)}, args,
                   rounds, True)
    print(f"p11  step: generated {m['generated'] * 1e3:.1f} ms, interpreted "
          f"{m['interpreted'] * 1e3:.1f} ms ({m['generated'] / m['interpreted']:.3f})")


def leaves(steps: int, n: int = 64) -> None:
    import jax
    import jax.numpy as jnp

    import multimesh.jax as mm

    mesh = mm.TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,))
    t0 = mm.task(lambda xs: [x + 1 for x in xs], name="t0", mesh=mesh)
    t1 = mm.task(lambda xs: [x * 2 for x in xs], name="t1", mesh=mesh)
    f = mm.mjit(lambda xs: t1(t0(xs)))
    xs = [jnp.full(4, float(i)) for i in range(n)]
    compiled = f.lower(xs).compile()
    xs = f(jax.device_put(xs, compiled.input_shardings[0][0]))
    out = {}
    for name, g in (("compiled", compiled), ("mjit function", f)):
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            ys = g(xs)
            times.append(time.perf_counter() - t)
            jax.block_until_ready(ys)
            xs = ys
        out[name] = statistics.median(times)
    print(f"leaves  {n} leaves fed back: " + ", ".join(
        f"{k} {v * 1e6:.0f} us per step" for k, v in out.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4000, help="p2's calls of each kind")
    ap.add_argument("--only", default="p2,p11,leaves")
    args = ap.parse_args(argv)
    print(f"load {' '.join(open('/proc/loadavg').read().split()[:3])}")
    only = args.only.split(",")
    if "p2" in only:
        p2(args.rounds)
    if "p11" in only:
        p11(40)
    if "leaves" in only:
        leaves(300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
