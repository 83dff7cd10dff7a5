"""2 processes x 4 devices: a debug.print in a task on process 0's devices and an ordered
io_callback in a task on process 1's, under value_and_grad (tests/test_callbacks.py).

A callback runs once, in the process that owns its fragment's first device.
"""
import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

from multimesh.jax import TaskMesh, mjit, task  # noqa: E402

log = []


def f1(w, x):
    y = jnp.tanh(x @ w)
    jax.debug.print("t1 {s}", s=y.sum())
    return y


def f2(w, x):
    y = jnp.tanh(x @ w)
    io_callback(lambda s: log.append(float(s)), None, jax.lax.stop_gradient(y).sum(), ordered=True)
    return y


mesh_a = TaskMesh(devices=(0, 1, 2, 3), axis_names=("x",), axis_sizes=(4,))
t1 = task(f1, name="t1", mesh=mesh_a)
t2 = task(f2, name="t2", mesh=mesh_a.place((4, 5, 6, 7)))


def loss(ws, x):
    return (t2(ws[1], t1(ws[0], x)) ** 2).sum()


def plain(ws, x):
    return (jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) ** 2).sum()


ws = (jnp.eye(8) * 0.5, jnp.eye(8) * 0.3)
x = jnp.linspace(0, 1, 64).reshape(8, 8)
value, grads = mjit(jax.value_and_grad(loss))(ws, x)
jax.effects_barrier()
ref_value, ref_grads = jax.jit(jax.value_and_grad(plain))(ws, x)
common.check("loss", value, ref_value, range(4, 8))
common.check_tree("grads", grads, ref_grads, (range(4), range(4, 8)))
want = float(jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]).sum())
print(f"log {log} want {want} t1 want {float(jnp.tanh(x @ ws[0]).sum())}", flush=True)
common.done()
