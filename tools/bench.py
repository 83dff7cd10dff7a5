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
P4  full pass pipeline on a generated module of >= 250k ops / (parse + print of it);
    P4x4 is the same ratio for a module 4x larger (linear growth keeps it flat).
P9  enable_fast_path on a program with no task (48-layer MLP value_and_grad):
    P9_compile = mjit compile time with the fast path / without it (pass pipeline +
    runtime); P9_call = one call (dispatch + run, small arrays) with / without it.
P8  compile phases of a pipelined transformer for M = 1, 4, 16, 64 microbatches, and
    the whole compile at M=16 over jax.jit of the same step with a lax.scan over
    microbatches (see tools/bench_microbatch.py).
P5  partitioning time of a 2-stage x 4-microbatch 1F1B value_and_grad step: multimesh's
    pipeline (parse + run_pipeline, as .compile() runs it) on the step written with
    tasks / Shardy's apply_mpmd_partitioning (parse + partition) on the same step
    written with named computations. P5_passes: ours without run_pipeline's hooks;
    P5_import: parse + mm-import-mpmd + mm-verify of Shardy's output, / theirs.

P10 moving a 4 MB / 64 MB float32 array from a 4-device submesh to another: between two
    processes (2 x 4 devices under jax.distributed, multimesh.launch; the union-mesh
    ppermute of multimesh.runtime.distributed, receiver's time) / within one process
    (8 devices, the executor's device_put path). Medians; P10_*_ms are the times.

--only P1,P9 runs just the named measures.
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


class _quiet:
    """Shardy's partitioner logs ~40 lines per call (fds 1 and 2); keep them out of the
    report."""

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        for fd, saved in zip((1, 2), self._saved):
            os.dup2(saved, fd)
            os.close(saved)


def _p5(reps: int) -> dict[str, float]:
    """Partitioning time of the same 2 x 4 1F1B step: multimesh's passes / Shardy's."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sdy_mpmd

    from mlir_passes.pipeline import parse_pipeline
    from multimesh._src.mlir import ir, make_context, parse_module, py_to_attr
    from multimesh.jax import mjit
    from multimesh.jax._mjit import run_pipeline

    program = sdy_mpmd.TwoStage(4, width=64, batch=16, m1=(("x", 4),), m2=(("x", 4),))
    params, xs = program.args()
    lowered = mjit(program.multimesh()).lower(params, xs)
    ours_text = lowered.as_text()
    theirs_text = program.lowered_text()
    sdy = sdy_mpmd.partitioner()
    n_in, n_out = 3, 3
    meshes = [(k, list(v)) for k, v in program.meshes.items()]
    assignment = {"stage1": ("m1", 0), "stage2": ("m2", 1)}
    with _quiet():
        imported = sdy_mpmd.partition(theirs_text, program.meshes, assignment,
                                      schedule="1F1B")
    import_pipeline = "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7},mm-verify)"

    def ours_module():  # what MpmdLowered.compile() parses and annotates
        m = parse_module(ours_text, make_context())
        with m.context:
            m.operation.attributes["mm.schedule_config"] = py_to_attr(lowered.schedule_config)
            m.operation.attributes["mm.num_devices"] = ir.IntegerAttr.get(
                ir.IntegerType.get_signless(64), 8)
        return m

    def ours():
        run_pipeline(ours_module(), lowered.pipeline)

    def ours_passes():
        parse_pipeline(lowered.pipeline).run(ours_module())

    def theirs():
        m = parse_module(theirs_text, make_context())
        with m.context:
            sdy.apply_mpmd_partitioning(
                m, "main", meshes, assignment, [None] * n_in, [None] * n_out, [],
                partitioning_options={"mpmd_pipeline_schedule": "1F1B"},
                fragment_merge_rules=[], fragment_schedule_rules=[],
                phases=sdy.PartitioningPhase.ALL)

    def import_():
        parse_pipeline(import_pipeline).run(parse_module(imported, make_context()))

    times: dict[str, list[float]] = {"ours": [], "passes": [], "theirs": [], "import": []}
    with _quiet():
        for f in (ours, ours_passes, theirs, import_):  # warm-up
            f()
        for _ in range(reps):
            for key, f in (("ours", ours), ("theirs", theirs), ("passes", ours_passes),
                           ("import", import_)):
                t0 = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"P5": med["ours"] / med["theirs"], "P5_passes": med["passes"] / med["theirs"],
            "P5_import": med["import"] / med["theirs"], "P5_ours_ms": 1e3 * med["ours"],
            "P5_passes_ms": 1e3 * med["passes"], "P5_shardy_ms": 1e3 * med["theirs"],
            "P5_import_ms": 1e3 * med["import"]}


def _p9(reps: int) -> tuple[float, float]:
    """(fast-path compile / MPMD compile, fast-path call / MPMD call) of a task-less MLP."""
    import jax
    import jax.numpy as jnp

    from multimesh.jax import enable_fast_path, mjit
    from multimesh.runtime import executor

    def plain(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return (x * x).mean()

    ws = [jnp.eye(64) * 0.5 for _ in range(48)]
    x = jnp.ones((16, 64))
    step = jax.value_and_grad(plain)
    compile_s = {True: [], False: []}
    compiled = {}
    for _ in range(reps):
        for fast in (True, False):
            jax.clear_caches()
            executor._COMPILE_CACHE.clear()
            with enable_fast_path(fast):
                t0 = time.perf_counter()
                compiled[fast] = mjit(step).lower(ws, x).compile()
                compile_s[fast].append(time.perf_counter() - t0)
    assert compiled[True].fast_path and not compiled[False].fast_path
    calls = {True: [], False: []}
    for c in compiled.values():
        jax.block_until_ready(c(ws, x))
    for _ in range(50 * reps):
        for fast in (True, False):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[fast](ws, x))
            calls[fast].append(time.perf_counter() - t0)
    med = statistics.median
    return (med(compile_s[True]) / med(compile_s[False]),
            med(calls[True]) / med(calls[False]))


_P10_SIZES = {"4MB": (1024, 1024), "64MB": (4096, 4096)}


def _p10_same(reps: int) -> dict:
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
    for label, shape in _P10_SIZES.items():
        x = jax.device_put(np.ones(shape, np.float32), sh_a)
        ts = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            jax.block_until_ready(_move(x, sh_b))
            ts.append(time.perf_counter() - t0)
        out[label] = 1e3 * statistics.median(ts[1:])
    return out


def _p10_child(reps: int) -> None:
    """In each of 2 processes x 4 devices: time cross-process moves, print JSON (process 1)."""
    import jax

    jax.distributed.initialize()
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from multimesh._src.jax_compat import distributed_client
    from multimesh.runtime.distributed import CrossTransfer

    me = jax.process_index()
    kv = distributed_client()
    devs = jax.devices()
    sh_a = NamedSharding(Mesh(np.array(devs[:4]), ("x",)), P("x"))
    sh_b = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P("x"))
    out = {}
    for label, shape in _P10_SIZES.items():
        ref = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
        x = jax.make_array_from_callback(shape, sh_a, lambda i, ref=ref: ref[i], dtype=np.float32)
        move = CrossTransfer(sh_a, sh_b, shape, np.float32)
        ts = []
        for rep in range(reps + 1):
            kv.wait_at_barrier(f"p10-{label}-{rep}", 120_000)
            t0 = time.perf_counter()
            y = move(x if me == 0 else None)
            jax.block_until_ready(y if me == 1 else x)
            ts.append(time.perf_counter() - t0)
            if me == 1 and rep == 0:
                assert all(np.array_equal(np.asarray(s.data), ref[s.index])
                           for s in y.addressable_shards)
        out[label] = 1e3 * statistics.median(ts[1:])
    kv.wait_at_barrier("p10-done", 120_000)
    if me == 1:
        print("P10-RESULT " + json.dumps(out), flush=True)


def _p10(reps: int) -> dict:
    import subprocess

    same = _p10_same(reps)
    cmd = [sys.executable, "-m", "multimesh.launch", "-n", "2", "--devices-per-process", "4",
           "--timeout", "600", os.path.abspath(__file__), "--p10-child", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [ln for ln in proc.stdout.splitlines() if "P10-RESULT " in ln]
    if proc.returncode or not line:
        raise RuntimeError(f"P10 child run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cross = json.loads(line[0].split("P10-RESULT ", 1)[1])
    res = {}
    for label in _P10_SIZES:
        res[f"P10_{label}"] = cross[label] / same[label]
        res[f"P10_{label}_cross_ms"] = cross[label]
        res[f"P10_{label}_same_ms"] = same[label]
    return res



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, smaller P4x4")
    ap.add_argument("--json", help="write results as JSON to this path")
    ap.add_argument("--only", help="run only these measures, e.g. P8 or P1,P3")
    ap.add_argument("--p10-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.p10_child is not None:
        _p10_child(args.p10_child)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    runs = _measures(args)
    names = args.only.split(",") if args.only else list(runs)
    res = {}
    for name in names:
        if name not in runs:
            raise SystemExit(f"--only: unknown measure {name!r}; choose from {sorted(runs)}")
        res.update(runs[name]())
    return _report(res, args.json)


def _measures(args) -> dict:
    """Every measure, by name, in the order a full run takes them."""
    quick = args.quick
    reps = 5 if quick else 20

    def p4():
        n = 250_000
        r, pipe, base = _p4(n)
        r4, pipe4, base4 = _p4(4 * n)
        return {"P4": r, "P4_pipeline_s": pipe, "P4_parse_print_s": base, "P4x4": r4,
                "P4x4_pipeline_s": pipe4, "P4x4_parse_print_s": base4}

    def p6():
        from bench_schedules import P6

        return P6()

    def p8():
        from bench_microbatch import P8

        return P8(reps=1 if quick else 3)

    return {"P1": lambda: {"P1_2stage": _p1(2, reps), "P1_4stage": _p1(4, reps)},
            "P2": lambda: dict(zip(("P2", "P2_transfer"), _p2(200 if quick else 2000))),
            "P7": lambda: {"P7": _p7()},
            "P3": lambda: {"P3": _p3(3 if quick else 7)},
            "P9": lambda: dict(zip(("P9_compile", "P9_call"), _p9(3 if quick else 7))),
            "P6": p6,
            "P8": p8,
            "P4": p4,
            "P5": lambda: _p5(10 if quick else 30),
            "P10": lambda: _p10(reps)}


def _report(res: dict, path: str | None) -> int:
    print(f"{'measure':<22}{'value':>10}")
    for k, v in res.items():
        print(f"{k:<22}{v:>10.3f}")
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
