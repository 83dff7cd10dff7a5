"""2 processes x 4 devices: process $VICTIM SIGKILLs itself in the middle of step 3.

The victim dies between two steps of the plan (right before its part of a
cross-process transfer), so the survivor is mid-step too. The survivor must stop by
itself, with a message naming the dead process, well before jax's heartbeat abort.
"""

import os
import signal
import time

import common

me = common.init()
VICTIM = int(os.environ.get("VICTIM", "1"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.runtime import distributed  # noqa: E402


def layer(w, x):
    return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)


a = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x",), axis_sizes=(4,))
stage0 = mm.task(layer, name="stage0", mesh=a, logical_axes=(("batch", "x"),))
stage1 = mm.task(layer, name="stage1", mesh=a.place((4, 5, 6, 7)), logical_axes=(("batch", "x"),))


def loss(ws, x):
    return jnp.sum(stage1(ws[1], stage0(ws[0], x)) ** 2)


step = mm.mjit(jax.value_and_grad(loss))
ws = [jnp.eye(64) * 0.5, jnp.eye(64) * 0.5]
x = jnp.ones((64, 64))

state = {"step": 0, "moves": 0}
if me == VICTIM:
    real_call = distributed.CrossTransfer.__call__

    def dying_call(self, value):
        state["moves"] += 1
        if state["step"] == 3 and state["moves"] == 2:
            print(f"victim: SIGKILL at {time.time():.2f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_call(self, value)

    distributed.CrossTransfer.__call__ = dying_call

for i in range(10**6):
    state["step"], state["moves"] = i, 0
    value, grads = step(ws, x)
    jax.block_until_ready(grads)
    if i == 2:
        print(f"process {me}: 3 steps done at {time.time():.2f}", flush=True)
