"""Smoke-check multimesh on whatever accelerator jax sees (e.g. one GPU).

    python tools/gpu_smoke.py [--memory-only] [--rows 4096] [--width 1024]

Runs a two-task program (both tasks on the available devices), its gradient, a
microbatched 1F1B step and a transfer-bearing program if there are 2+ devices, and
compares every number with plain jax. Prints one line per check; exits 1 on mismatch.

Then (issue 33) the real peak against theory, for 1F1B and ZB-H1 with and without
``remat=True``: a fresh program of two tanh stages per device half, compiled, then
run as two ordinary asynchronous calls; ``peak_bytes_in_use`` of each device's
``memory_stats()`` above its ``bytes_in_use`` before the calls, against
``memory_profile``'s most bytes that device's submesh holds beyond its inputs. The
allocator's peak counts from the process start, so the calls run before anything
else of that program (the step-by-step profile comes after). A backend without
memory statistics (the CPU) prints that it has none.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm


def _stage_meshes(n: int):
    half = max(1, n // 2)
    m0 = mm.TaskMesh(devices=range(0, half), axis_names=("x",), axis_sizes=(half,))
    return m0, m0.place(range(n - half, n))


def memory_program(schedule: str, remat: bool, rows: int, width: int, layers: int = 4):
    """(compiled, ws, x): two stage tasks of ``layers`` tanh layers, 8 microbatches."""
    m0, m1 = _stage_meshes(len(jax.devices()))

    def body(w, x):
        x = mm.with_sharding_constraint(x, P("batch", None))
        for i in range(layers):
            x = jnp.tanh(x @ w[i])
        return x

    s0 = mm.task(body, name="s0", mesh=m0, logical_axes=(("batch", "x"),))
    s1 = mm.task(body, name="s1", mesh=m1, logical_axes=(("batch", "x"),))

    def loss(ws, x):
        return (s1(ws[1], s0(ws[0], x)) ** 2).mean()

    key = jax.random.key(2)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (layers, width, width)) / width ** 0.5
          for i in range(2)]
    x = jax.random.normal(key, (rows, width))
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=rows // 8, argnum=1,
                         schedule=schedule, remat=True if remat else None)
    return mm.mjit(step).lower(ws, x).compile(), ws, x


def peak_vs_theory(compiled, args, stats=None) -> list[dict]:
    """Per device: the allocator's peak above its use before two ordinary calls of
    ``compiled`` (``stats(device)``: its ``memory_stats()``, None where the backend
    keeps none), and the theory: ``memory_profile``'s most bytes that device's
    submesh holds beyond its inputs (the profile runs after the calls)."""
    stats = stats or (lambda d: d.memory_stats())
    devices = jax.devices()
    before = {d.id: stats(d) for d in devices}
    if any(v is None for v in before.values()):
        return []
    jax.block_until_ready([compiled(*args), compiled(*args)])
    after = {d.id: stats(d) for d in devices}
    theory: dict[int, int] = {}
    for s in compiled.memory_profile(*args).submeshes:
        for i in s.devices:  # one device may hold several submeshes' stages
            theory[i] = theory.get(i, 0) + s.peak - s.inputs
    return [{"device": i, "peak": after[i]["peak_bytes_in_use"] - before[i]["bytes_in_use"],
             "theory": theory.get(i, 0)} for i in sorted(after)]


def memory_checks(rows: int, width: int, stats=None,
                  schedules=("1f1b", "zero-bubble-h1")) -> list[str]:
    """One line per (schedule, remat, device): real peak, theory and their ratio."""
    lines = []
    dev = jax.devices()[0]
    if (stats or (lambda d: d.memory_stats()))(dev) is None:
        return [f"--  {s}{r}: no memory_stats() on {dev.platform}"
                for s in schedules for r in ("", " remat")]
    for schedule in schedules:
        for remat in (False, True):
            compiled, ws, x = memory_program(schedule, remat, rows, width)
            got = peak_vs_theory(compiled, (ws, x), stats)
            label = f"{schedule}{' remat' if remat else ''}"
            for r in got:
                ratio = r["peak"] / r["theory"] if r["theory"] else float("nan")
                lines.append(f"mem {label} device {r['device']}: peak_bytes_in_use "
                             f"{r['peak'] / 2**20:.1f} MiB above the fixed part, theory "
                             f"{r['theory'] / 2**20:.1f} MiB, ratio {ratio:.2f} "
                             f"(run_ahead={compiled.run_ahead})")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-only", action="store_true", help="only the memory checks")
    ap.add_argument("--rows", type=int, default=4096, help="batch rows (memory checks)")
    ap.add_argument("--width", type=int, default=1024, help="layer width (memory checks)")
    args = ap.parse_args(argv)
    ok = args.memory_only or _checks()
    for line in memory_checks(args.rows, args.width):
        print(line, flush=True)
    return 0 if ok else 1


def _checks() -> bool:
    devs = jax.devices()
    print("jax", jax.__version__, "devices", devs)
    m0, m1 = _stage_meshes(len(devs))

    def body(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

    s0 = mm.task(body, name="s0", mesh=m0, logical_axes=(("batch", "x"),))
    s1 = mm.task(body, name="s1", mesh=m1, logical_axes=(("batch", "x"),))

    def loss(ws, x):
        return (s1(ws[1], s0(ws[0], x)) ** 2).mean()

    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (256, 256)) / 16 for i in range(2)]
    x = jax.random.normal(key, (64, 256))
    ok = True

    def check(name, got, want):
        nonlocal ok
        good = all(np.allclose(np.asarray(a), np.asarray(b), rtol=2e-3, atol=2e-4)
                   for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        ok &= good
        print(f"{'ok ' if good else 'BAD'} {name}")

    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(ws, x)
    compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    check("value_and_grad, 2 tasks", compiled(ws, x), ref)
    print(compiled.plan())
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=16, argnum=1, schedule="1f1b")
    out = mm.mjit(f)(ws, x)
    check("microbatched 1f1b (sum of 4 microbatches)", (out[0] / 4, jax.tree.map(lambda g: g / 4, out[1])), ref)
    return ok


if __name__ == "__main__":
    sys.exit(main())
