"""multimesh benchmarks. Ratios are measured side by side in one run (the machine is shared).

    python tools/bench.py [--quick] [--json PATH]

P1  steady-state step time of a 2-stage and a 4-stage MLP value_and_grad under mjit /
    the same math under one jax.jit over all 8 devices (pairs interleaved, median).
P2  per-fragment dispatch overhead / one jitted call's dispatch (no blocking);
    P2_transfer: the same for one cross-device transfer.
P3  mjit(f).lower().compile() time / jax.jit(f).lower().compile() time, one-task program.
P7  simulated peak bytes per device of an MPMD step / the fragments' own peaks
    (max over the fragments each device runs), summed over devices.
P6  bubble fraction and peak live activations per schedule, from the unit-cost
    simulator, next to theory (see tools/bench_schedules.py).
P8  moving a 4 MB / 64 MB float32 array from a 4-device submesh to another: between two
    processes (2 x 4 devices under jax.distributed, multimesh.launch; the union-mesh
    ppermute of multimesh.runtime.distributed, receiver's time) / within one process
    (8 devices, the executor's device_put path). Medians; P8_*_ms are the times.
P4  full pass pipeline on a generated module of >= 250k ops / (parse + print of it);
    P4x4 is the same ratio for a module 4x larger (linear growth keeps it flat).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _mlp_program(stages: int, width: int, batch: int, layers: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from multimesh.jax import TaskMesh, task, with_sharding_constraint

    per = 8 // stages

    def stage_fn(ws, x):
        for w in ws:
            x = jnp.tanh(with_sharding_constraint(x, P("batch", None)) @ w)
        return x

    tasks = [task(stage_fn, name=f"stage{k}",
                  mesh=TaskMesh(devices=range(k * per, (k + 1) * per), axis_names=("x",),
                                axis_sizes=(per,)), logical_axes=(("batch", "x"),))
             for k in range(stages)]

    def loss(params, x):
        for t, ws in zip(tasks, params):
            x = t(ws, x)
        return (x * x).mean()

    def plain_loss(params, x):
        for ws in params:
            for w in ws:
                x = jnp.tanh(x @ w)
        return (x * x).mean()

    key = jax.random.key(0)
    params = [[jax.random.normal(jax.random.fold_in(key, 10 * k + i), (width, width)) / width**0.5
               for i in range(layers)] for k in range(stages)]
    x = jax.random.normal(key, (batch, width))
    return loss, plain_loss, params, x


def _p1(stages: int, reps: int) -> float:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh.jax import mjit

    loss, plain_loss, params, x = _mlp_program(stages, 512, 256, 2)
    ours = mjit(jax.value_and_grad(loss)).lower(params, x).compile()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    xs = jax.device_put(x, NamedSharding(mesh, P("x", None)))
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    theirs = jax.jit(jax.value_and_grad(plain_loss))
    px = jax.device_put(params, ours.input_shardings[0][0])
    xx = jax.device_put(x, ours.input_shardings[0][1])
    jax.block_until_ready(ours(px, xx))
    jax.block_until_ready(theirs(ps, xs))
    a, b = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(ours(px, xx))
        a.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(theirs(ps, xs))
        b.append(time.perf_counter() - t0)
    return statistics.median(a) / statistics.median(b)


def _p2(reps: int) -> tuple[float, float]:
    """(per-fragment dispatch / jit dispatch, per-transfer dispatch / jit dispatch).

    Fragments: a chain of 8 tasks on one device (distinct names, so 8 fragments and
    no transfers). Transfers: the same chain with each task on its own device.
    """
    import jax
    import jax.numpy as jnp

    from multimesh.jax import TaskMesh, mjit, task

    def chain_of(devs):
        tasks = [task(lambda x: x + 1.0, name=f"t{k}",
                      mesh=TaskMesh(devices=(d,), axis_names=("x",), axis_sizes=(1,)))
                 for k, d in enumerate(devs)]

        def chain(x):
            for t in tasks:
                x = t(x)
            return x
        return chain

    x = jnp.ones((4,))
    plain = jax.jit(lambda x: x + 1.0)
    same = mjit(chain_of([0] * 8)).lower(x).compile()
    moving = mjit(chain_of(range(8))).lower(x).compile()
    x = jax.device_put(x, same.input_shardings[0][0])  # as jit's x: already in place
    n_frag = sum(1 for s in same.plan_data.steps if hasattr(s, "fragment"))
    n_move = len(moving.transfers)
    for f in (same, moving, plain):
        jax.block_until_ready(f(x))
    a, b, c = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = same(x)
        a.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        out = moving(x)
        b.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        out = plain(x)
        c.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    jit = statistics.median(c)
    per_fragment = statistics.median(a) / n_frag
    per_transfer = (statistics.median(b) - statistics.median(a)) / n_move
    return per_fragment / jit, per_transfer / jit


def _p7() -> float:
    import jax

    from multimesh.jax import mjit
    from multimesh.runtime.memory import simulated_peaks

    loss, _, params, x = _mlp_program(2, 512, 256, 2)
    compiled = mjit(jax.value_and_grad(loss)).lower(params, x).compile()
    step_peak, fragment_peak = simulated_peaks(compiled.plan_data, compiled._exec)
    return sum(step_peak.values()) / sum(fragment_peak.values())


def _p3(reps: int) -> float:
    """Compile time of one 8-device task under mjit / the same sharded program under jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh.jax import TaskMesh, mjit, task, with_sharding_constraint
    from multimesh.runtime import executor

    def body(w, x):
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return with_sharding_constraint(x, P("batch", None)).sum()

    mesh = Mesh(np.array(jax.devices()), ("x",))

    def plain(w, x):  # the same program, sharded the same way, as one jax.jit
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("x", None))).sum()

    t = task(body, name="one", mesh=TaskMesh(devices=range(8), axis_names=("x",),
                                            axis_sizes=(8,)),
             logical_axes=(("batch", "x"),))
    w = jnp.ones((256, 256)) * 0.01
    x = jnp.ones((64, 256))
    ours, theirs = [], []
    for _ in range(reps):
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.jit(plain).lower(w, x).compile()
        theirs.append(time.perf_counter() - t0)
        jax.clear_caches()
        executor._COMPILE_CACHE.clear()
        t0 = time.perf_counter()
        mjit(lambda w, x: t(w, x)).lower(w, x).compile()
        ours.append(time.perf_counter() - t0)
    return statistics.median(ours) / statistics.median(theirs)


_P8_SIZES = {"4MB": (1024, 1024), "64MB": (4096, 4096)}


def _p8_same(reps: int) -> dict:
    """Same-process transfer times (ms): devices 0-3 -> 4-7 of one 8-device process."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh.runtime.executor import _move

    devs = jax.devices()
    sh_a = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
    sh_b = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P("x"))
    out = {}
    for label, shape in _P8_SIZES.items():
        x = jax.device_put(np.ones(shape, np.float32), sh_a)
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(_move(x, sh_b))
            ts.append(time.perf_counter() - t0)
        out[label] = 1e3 * statistics.median(ts[1:])
    return out


def _p8_child(reps: int) -> None:
    """In each of 2 processes x 4 devices: time cross-process moves, print JSON (process 1)."""
    import jax

    jax.distributed.initialize()
    import numpy as np
    from jax._src import distributed as jd
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh.runtime.distributed import CrossTransfer

    me = jax.process_index()
    kv = jd.global_state.client
    devs = jax.devices()
    sh_a = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
    sh_b = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P("x"))
    out = {}
    for label, shape in _P8_SIZES.items():
        ref = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
        x = jax.make_array_from_callback(shape, sh_a, lambda i, ref=ref: ref[i], dtype=np.float32)
        move = CrossTransfer(sh_a, sh_b, shape, np.float32)
        ts = []
        for rep in range(reps + 1):
            kv.wait_at_barrier(f"p8-{label}-{rep}", 120_000)
            t0 = time.perf_counter()
            y = move(x if me == 0 else None)
            jax.block_until_ready(y if me == 1 else x)
            ts.append(time.perf_counter() - t0)
            if me == 1 and rep == 0:
                assert all(np.array_equal(np.asarray(s.data), ref[s.index])
                           for s in y.addressable_shards)
        out[label] = 1e3 * statistics.median(ts[1:])
    kv.wait_at_barrier("p8-done", 120_000)
    if me == 1:
        print("P8-RESULT " + json.dumps(out), flush=True)


def _p8(reps: int) -> dict:
    import subprocess

    same = _p8_same(reps)
    cmd = [sys.executable, "-m", "multimesh.launch", "-n", "2", "--devices-per-process", "4",
           "--timeout", "600", os.path.abspath(__file__), "--p8-child", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if "P8-RESULT " in ln]
    if proc.returncode or not line:
        raise RuntimeError(f"P8 child run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cross = json.loads(line[0].split("P8-RESULT ", 1)[1])
    res = {}
    for label in _P8_SIZES:
        res[f"P8_{label}"] = cross[label] / same[label]
        res[f"P8_{label}_cross_ms"] = cross[label]
        res[f"P8_{label}_same_ms"] = same[label]
    return res


def generate_module(num_ops: int, tasks: int = 4) -> str:
    """A jax-style module: `tasks` task calls, each a chain of elementwise ops."""
    per = max(1, num_ops // tasks)
    lines = ["module @bench attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32} {"]
    lines.append("  func.func public @main(%arg0: tensor<8x16xf32>) -> tensor<8x16xf32> {")
    prev = "%arg0"
    for k in range(tasks):
        dev = ", ".join(str(d) for d in range(2 * (k % 4), 2 * (k % 4) + 2))
        lines.append(
            f'    %t{k} = func.call @body{k}({prev}) {{mm.task = {{name = "stage{k}", '
            f'transpose_count = 0 : i64, devices = [{dev}], axis_names = ["x"], '
            f'axis_sizes = [2], logical_axes = [["batch", "x"]]}}}} : '
            f"(tensor<8x16xf32>) -> tensor<8x16xf32>")
        prev = f"%t{k}"
    lines.append(f"    return {prev} : tensor<8x16xf32>")
    lines.append("  }")
    for k in range(tasks):
        lines.append(f"  func.func private @body{k}(%a: tensor<8x16xf32>) -> tensor<8x16xf32> {{")
        lines.append('    %c = stablehlo.custom_call @mm.logical_sharding(%a) '
                     '{mm.axes = [["batch"], []]} : (tensor<8x16xf32>) -> tensor<8x16xf32>')
        p = "%c"
        for i in range(per):
            op = ("stablehlo.add", "stablehlo.multiply", "stablehlo.subtract")[i % 3]
            lines.append(f"    %v{i} = {op} {p}, %a : tensor<8x16xf32>")
            p = f"%v{i}"
        lines.append(f"    return {p} : tensor<8x16xf32>")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


def _p4(num_ops: int) -> tuple[float, float, float]:
    from mlir_passes.pipeline import parse_pipeline
    from multimesh._src.mlir import make_context, parse_module, print_module
    from multimesh.jax._mjit import default_pipeline

    text = generate_module(num_ops)
    t0 = time.perf_counter()
    m = parse_module(text, make_context())
    print_module(m)
    base = time.perf_counter() - t0
    m = parse_module(text, make_context())
    t0 = time.perf_counter()
    parse_pipeline(default_pipeline(8)).run(m)
    pipe = time.perf_counter() - t0
    return pipe / base, pipe, base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller P4x4")
    ap.add_argument("--json", help="write results as JSON to this path")
    ap.add_argument("--only", help="comma-separated groups to run (e.g. P8); default all")
    ap.add_argument("--p8-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.p8_child is not None:
        _p8_child(args.p8_child)
        return 0
    res = {}
    reps = 5 if args.quick else 20
    if args.only:
        groups = {"P8": lambda: _p8(reps)}
        for g in args.only.split(","):
            res.update(groups[g]())
        _report(res, args.json)
        return 0
    res["P1_2stage"] = _p1(2, reps)
    res["P1_4stage"] = _p1(4, reps)
    res["P2"], res["P2_transfer"] = _p2(200 if args.quick else 2000)
    res["P7"] = _p7()
    res["P3"] = _p3(3 if args.quick else 7)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_schedules import P6

    res.update(P6())
    n = 250_000
    r, pipe, base = _p4(n)
    res["P4"], res["P4_pipeline_s"], res["P4_parse_print_s"] = r, pipe, base
    r4, pipe4, base4 = _p4(4 * n)
    res["P4x4"], res["P4x4_pipeline_s"], res["P4x4_parse_print_s"] = r4, pipe4, base4
    res.update(_p8(reps))
    _report(res, args.json)
    return 0


def _report(res: dict, path: str | None) -> None:
    print(f"{'measure':<22}{'value':>10}")
    for k, v in res.items():
        print(f"{k:<22}{v:>10.3f}")
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
