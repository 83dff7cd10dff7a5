"""multimesh benchmarks. Ratios are measured side by side in one run (the machine is shared).

    python tools/bench.py [--quick] [--json PATH]

P3  mjit(f).lower().compile() time / jax.jit(f).lower().compile() time, one-task program.
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


def _p3(reps: int) -> float:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from multimesh.jax import TaskMesh, mjit, task, with_sharding_constraint

    def body(w, x):
        for _ in range(8):
            x = jnp.tanh(x @ w)
        return with_sharding_constraint(x, P("batch", None)).sum()

    t = task(body, name="one", mesh=TaskMesh(devices=range(8), axis_names=("x",),
                                            axis_sizes=(8,)),
             logical_axes=(("batch", "x"),))
    w = jnp.ones((256, 256)) * 0.01
    x = jnp.ones((64, 256))
    ours, theirs = [], []
    for i in range(reps):
        jax.clear_caches()
        t0 = time.perf_counter()
        jax.jit(body_plain).lower(w, x).compile() if False else None
        with_marker = jax.jit(lambda w, x: _plain(w, x))
        with_marker.lower(w, x).compile()
        theirs.append(time.perf_counter() - t0)
        jax.clear_caches()
        t0 = time.perf_counter()
        mjit(lambda w, x: t(w, x)).lower(w, x).compile()
        ours.append(time.perf_counter() - t0)
    return statistics.median(ours) / statistics.median(theirs)


def _plain(w, x):
    import jax.numpy as jnp

    for _ in range(8):
        x = jnp.tanh(x @ w)
    return x.sum()


body_plain = _plain


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
    args = ap.parse_args(argv)
    res = {}
    res["P3"] = _p3(3 if args.quick else 7)
    n = 250_000
    r, pipe, base = _p4(n)
    res["P4"], res["P4_pipeline_s"], res["P4_parse_print_s"] = r, pipe, base
    r4, pipe4, base4 = _p4(4 * n)
    res["P4x4"], res["P4x4_pipeline_s"], res["P4x4_parse_print_s"] = r4, pipe4, base4
    print(f"{'measure':<22}{'value':>10}")
    for k, v in res.items():
        print(f"{k:<22}{v:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
