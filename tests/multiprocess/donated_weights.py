"""2 processes x 4 devices: donated weights read by every microbatch are freed.

Each weight is read by all four microbatches' forward and backward calls, so only its
last call could donate it, which would need a second executable: the donation is
skipped and the runtime deletes the weight after its last use instead, in every
process that holds it, as in one process.
"""

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.runtime import steps  # noqa: E402

A = mm.TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,))
B = A.place((4,))
stage0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="stage0", mesh=A)
stage1 = mm.task(lambda w, x: jnp.sum((x @ w) ** 2), name="stage1", mesh=B)


def loss(ws, x):
    return stage1(ws[1], stage0(ws[0], x))


def plain_loss(ws, x):
    return jnp.sum((jnp.tanh(x @ ws[0]) @ ws[1]) ** 2)


key = jax.random.key(3)
ws = [jax.random.normal(jax.random.fold_in(key, k), (8, 8)) / 3 for k in range(2)]
x = jax.random.normal(key, (16, 8))
step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule="gpipe")
compiled = mm.mjit(step, donate_argnums=(0,)).lower(ws, x).compile()
mine = compiled._exec
assert mine._skipped_donations, "the weights' donation should be skipped"
assert any(isinstance(s, steps.Free) for s in mine.steps), [type(s) for s in mine.steps]

placed = [jax.device_put(np.asarray(w), sh) for w, sh in zip(ws, compiled.input_shardings[0][0])]
value, grads = compiled(placed, x)

ref_value = sum(plain_loss(ws, x[k:k + 4]) for k in range(0, 16, 4))
ref_grads = [sum(g) for g in zip(*(jax.grad(plain_loss)(ws, x[k:k + 4])
                                   for k in range(0, 16, 4)))]
common.check("loss", value, ref_value, [4], rtol=1e-4)
common.check_tree("grads", grads, ref_grads, ([0], [4]), rtol=1e-4, atol=1e-5)
held = placed[me]  # process 0 holds stage0's weight, process 1 stage1's
assert held.is_fully_addressable and held.is_deleted(), (me, held.is_deleted())
common.done()
