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
P4  full pass pipeline on a generated module of >= 250k ops / (parse + print of it):
    P4 = Pipeline.run with a replay source (how mjit and mm-opt run it: no snapshot per
    pass, one verification at the end), P4_mjit = run_pipeline as .compile() runs it
    (repro bookkeeping, dumps and logging hooks included), P4_contract = Pipeline.run
    without a replay source (every pass snapshots the module so a failure leaves its
    input, issue 12's contract); P4x4* are the same ratios for a module 4x larger
    (linear growth keeps them flat), "P4 <pass>" the seconds of each pass.
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

P11 dispatch-bound pipeline: 8 stages of 1 device, 32 microbatches, d=32, 1F1B
    value_and_grad; our step time / jax.jit of the same math as a 32-step Python
    loop on one device, with fragment calls, transfers, batched copy calls, host us per
    call and per transferred array, and per call over one bare jitted call of a
    stage's forward. P11_one_program: the floor of any dispatch, the same pipeline as
    ONE jax.jit executable over the 8 devices (shard_map, a ppermute per tick, GPipe
    order: no host dispatch at all) / the same jax.jit loop.

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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.models


def _seconds(fn, *args) -> float:
    """Wall seconds of one call ``fn(*args)``, blocked on."""
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


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

    def plain_stage(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    from tests.models import mean_square_loss

    loss, plain_loss = mean_square_loss(tasks), mean_square_loss([plain_stage] * stages)

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
        a.append(_seconds(ours, px, xx))
        b.append(_seconds(theirs, ps, xs))
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


def _p4(num_ops: int, reps: int = 1) -> dict[str, float]:
    """Pass pipeline time / parse+print time, bare and as mjit runs it (median of reps)."""
    from multimesh._src.mlir import make_context, parse_module, print_module
    from multimesh.jax._stages.pipeline import default_pipeline
    from multimesh.jax._stages.pipeline_runner import run_pipeline
    from multimesh.passes.pipeline import parse_pipeline

    text = generate_module(num_ops)
    pipeline = default_pipeline(8)
    base, bare, mjit, contract, per_pass = [], [], [], [], {}
    for _ in range(reps):  # interleaved
        t0 = time.perf_counter()
        m = parse_module(text, make_context())
        print_module(m)
        base.append(time.perf_counter() - t0)
        ctx = make_context()
        m = parse_module(text, ctx)
        t0 = time.perf_counter()
        timings = parse_pipeline(pipeline).run(
            m, replay=lambda ctx=ctx: parse_module(text, ctx))
        bare.append(time.perf_counter() - t0)
        for name, dt in timings:
            per_pass.setdefault(name, []).append(dt)
        m = parse_module(text, make_context())
        t0 = time.perf_counter()
        parse_pipeline(pipeline).run(m)
        contract.append(time.perf_counter() - t0)
        ctx = make_context()
        m = parse_module(text, ctx)
        t0 = time.perf_counter()
        run_pipeline(m, pipeline, source=lambda ctx=ctx: parse_module(text, ctx))
        mjit.append(time.perf_counter() - t0)
    b, p, j, k = (statistics.median(x) for x in (base, bare, mjit, contract))
    out = {"ratio": p / b, "mjit_ratio": j / b, "contract_ratio": k / b, "pipeline_s": p,
           "mjit_s": j, "contract_s": k, "parse_print_s": b}
    out.update({f"pass {k}": statistics.median(v) for k, v in per_pass.items()})
    return out


def _one_program_pipeline(stage, stages: int, micro: int):
    """P11's pipeline as one SPMD executable over ``stages`` devices (stage k's weight
    on device k; a ``lax.scan`` over the ``micro + stages - 1`` ticks, each device
    runs its stage and hands the result on with a ``ppermute``): what the step costs
    with no host dispatch at all, every hop a collective inside one program."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:stages]), ("s",))
    ring = [(i, (i + 1) % stages) for i in range(stages)]

    def local(w, xs):  # w: this device's (1, D, D); xs: (micro, rows, D), replicated
        k = jax.lax.axis_index("s")

        def tick(carry, t):
            buf, total = carry
            y = stage(w[0], jnp.where(k == 0, xs[jnp.clip(t, 0, micro - 1)], buf))
            last = (k == stages - 1) & (t >= stages - 1)
            return (jax.lax.ppermute(y, "s", ring), total + jnp.where(last, (y ** 2).mean(), 0.0)), None

        zero = jax.lax.pcast(jnp.zeros(xs.shape[1:], xs.dtype), "s", to="varying")
        tot0 = jax.lax.pcast(jnp.zeros((), xs.dtype), "s", to="varying")
        (_, total), _ = jax.lax.scan(tick, (zero, tot0), jnp.arange(micro + stages - 1))
        return jax.lax.psum(total, "s")[None]

    def loss(w, xs):
        return jax.shard_map(local, mesh=mesh, in_specs=(P("s"), P()), out_specs=P("s"))(w, xs)[0]

    return jax.jit(jax.value_and_grad(loss)), mesh


def _p11(reps: int) -> dict[str, float]:
    """The dispatch-bound case: host cost of many small fragments and transfers."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import multimesh.jax as mm

    S, M, D, MB = 8, 32, 32, 4  # stages, microbatches, width, rows per microbatch

    def stage(w, x):
        return jnp.tanh(x @ w)

    tasks = [mm.task(stage, name=f"s{k}", mesh=mm.TaskMesh(devices=(k,), axis_names=("x",),
                                                           axis_sizes=(1,))) for k in range(S)]

    from tests.models import mean_square_loss

    loss, plain_loss = mean_square_loss(tasks), mean_square_loss([stage] * S)

    def loop_math(ws, x):  # the same math as a microbatch loop, one jit on one device
        vg = jax.value_and_grad(plain_loss)
        total = None
        for m in range(M):
            r = vg(ws, x[m * MB:(m + 1) * MB])
            total = r if total is None else jax.tree.map(jnp.add, total, r)
        return total

    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, k), (D, D)) / D ** 0.5 for k in range(S)]
    x = jax.random.normal(key, (M * MB, D))
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=MB, argnum=1, schedule="1f1b")
    ours = mm.mjit(step).lower(ws, x).compile()
    wsp = jax.device_put(ws, ours.input_shardings[0][0])
    xp = jax.device_put(x, ours.input_shardings[0][1])
    dev0 = jax.devices()[0]
    ws0, x0 = jax.device_put(ws, dev0), jax.device_put(x, dev0)
    theirs = jax.jit(loop_math)
    got, want = ours(wsp, xp), theirs(ws0, x0)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    one, mesh = _one_program_pipeline(stage, S, M)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    wst = jax.device_put(jnp.stack(ws), NamedSharding(mesh, P("s")))
    xst = jax.device_put(x.reshape(M, MB, D), NamedSharding(mesh, P()))
    got1 = one(wst, xst)
    np.testing.assert_allclose(got1[0], want[0], rtol=1e-4)
    np.testing.assert_allclose(got1[1], jnp.stack(want[1]), rtol=1e-4, atol=1e-5)
    bare = jax.jit(stage)
    w1, h = ws0[0], x0[:MB]
    jax.block_until_ready(bare(w1, h))
    ex = ours._exec
    flat = jax.tree.leaves((wsp, xp))
    detail = getattr(ex, "_program", None) is not None  # (an older tree: step times only)
    a, b, c, calls_s, copies_s, bare_s = [], [], [], [], [], []
    for _ in range(reps):
        a.append(_seconds(ours, wsp, xp))
        b.append(_seconds(theirs, ws0, x0))
        c.append(_seconds(one, wst, xst))
        tc, tt = _timed_dispatch(ex, flat) if detail else (float("nan"),) * 2
        calls_s.append(tc)
        copies_s.append(tt)
        t0 = time.perf_counter()
        y = h
        for _ in range(64):
            y = bare(w1, y)
        jax.block_until_ready(y)
        bare_s.append((time.perf_counter() - t0) / 64)
    n_calls, n_moves = len(ours.calls), len(ours.transfers)
    med = statistics.median
    per_call = med(calls_s) / n_calls
    return {"P11": med(a) / med(b), "P11_step_ms": 1e3 * med(a),
            "P11_jit_loop_ms": 1e3 * med(b), "P11_one_program": med(c) / med(b),
            "P11_one_program_ms": 1e3 * med(c), "P11_calls": n_calls, "P11_transfers": n_moves,
            "P11_copy_calls": getattr(ex, "batched_transfers", n_moves),
            "P11_us_per_call": 1e6 * per_call,
            "P11_us_per_transfer": 1e6 * med(copies_s) / n_moves,
            "P11_bare_jit_us": 1e6 * med(bare_s),
            "P11_call_over_bare_jit": per_call / med(bare_s)}


def _timed_dispatch(ex, flat) -> tuple[float, float]:
    """One step through the executor's dispatch program, timing fragment calls and
    copy calls apart (seconds of host time each)."""
    import jax

    from multimesh.runtime.steps import FragmentCall, Free

    env = ex.start(flat)  # placed inputs and the run's zeros, as a call makes them
    tc = tt = 0.0
    clock = time.perf_counter
    for step in ex.program:
        t0 = clock()
        step.run(env)
        dt = clock() - t0
        if isinstance(step, FragmentCall):
            tc += dt
        elif not isinstance(step, Free):
            tt += dt
    jax.block_until_ready([env[o] for o in ex.plan.outputs])
    return tc, tt


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

    from multimesh._src.mlir import ir, make_context, parse_module, py_to_attr
    from multimesh.jax import mjit
    from multimesh.jax._stages.pipeline_runner import run_pipeline
    from multimesh.passes.pipeline import parse_pipeline

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

    from multimesh.runtime.steps import move as _move

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
        res = {}
        for key, size in (("P4", n), ("P4x4", 4 * n)):
            r = _p4(size, 1 if quick else 3)
            res[key], res[f"{key}_mjit"] = r["ratio"], r["mjit_ratio"]
            res[f"{key}_contract"] = r["contract_ratio"]
            for k in ("pipeline_s", "mjit_s", "contract_s", "parse_print_s"):
                res[f"{key}_{k}"] = r[k]
            if key == "P4":
                res.update({f"P4 {k[5:]}": v for k, v in r.items() if k.startswith("pass ")})
        return res

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
            "P11": lambda: _p11(10 if quick else 30),
            "P5": lambda: _p5(10 if quick else 30),
            "P10": lambda: _p10(reps)}


def _report(res: dict, path: str | None) -> int:
    print(f"{'measure':<34}{'value':>10}")
    for k, v in res.items():
        print(f"{k:<34}{v:>10.3f}")
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
