"""4 processes x 2 devices: a 4-stage model, 8 microbatches, schedule="1f1b".

Stage k runs on device positions (2k, 2k+1), that is on process k. Every process checks
the loss and the gradients it holds against plain JAX on the full batch in this process.
"""

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402


def body(w, x):
    return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)


stages = [mm.task(body, name=f"s{k}", logical_axes=(("batch", "x"),),
                  mesh=mm.TaskMesh(devices=(2 * k, 2 * k + 1), axis_names=("x",),
                                   axis_sizes=(2,)))
          for k in range(4)]


def loss(ws, x):
    for t, w in zip(stages, ws):
        x = t(w, x)
    return (x ** 2).sum()


def plain_loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return (x ** 2).sum()


key = jax.random.key(1)
ws = [jnp.eye(64) * 0.5 + 0.05 * jax.random.normal(jax.random.fold_in(key, k), (64, 64))
      for k in range(4)]
x = jax.random.normal(key, (64, 64))
step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
compiled = mm.mjit(step).lower(ws, x).compile()

# the schedule every process runs its share of: stage k warms up with 4 - k forwards
rows = [" ".join(u for u in r if "*" not in u) for r in compiled.schedule.labels()]
assert rows[0] == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7", rows
assert rows[3] == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7", rows

ref_value, ref_grads = jax.jit(jax.value_and_grad(plain_loss))(ws, x)
for it in range(3):  # several steps in flight: the cross-process moves must not deadlock
    value, grads = compiled(ws, x)
    common.check(f"call{it}.loss", value, ref_value, [6, 7], rtol=1e-4)
    common.check_tree(f"call{it}.grads", grads, ref_grads,
                      [[2 * k, 2 * k + 1] for k in range(4)], rtol=1e-4, atol=1e-5)
    # this process holds exactly its own stage's gradient
    assert [g.is_fully_addressable for g in grads] == [k == me for k in range(4)]
common.done()
