"""Smoke-check multimesh on whatever accelerator jax sees (e.g. one GPU).

    python tools/gpu_smoke.py

Runs a two-task program (both tasks on the available devices), its gradient, a
microbatched 1F1B step and a transfer-bearing program if there are 2+ devices, and
compares every number with plain jax. Prints one line per check; exits 1 on mismatch.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm


def main() -> int:
    devs = jax.devices()
    print("jax", jax.__version__, "devices", devs)
    n = len(devs)
    half = max(1, n // 2)
    m0 = mm.TaskMesh(devices=range(0, half), axis_names=("x",), axis_sizes=(half,))
    m1 = m0.place(range(n - half, n))

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
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
