"""2 processes x 4 devices: an NNX two-stage MLP with ``parallelize_step`` (adam).

Stage i runs on device positions 4i..4i+3 (process i). Every process checks the loss
and its shards of every parameter against plain NNX + ``nnx.jit`` in this process.
"""

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from multimesh.jax import TaskMesh, ignore_transforms  # noqa: E402
from multimesh.jax.flax import (  # noqa: E402
    nnx_shard_axes,
    parallelize_step,
    task,
    with_sharding_constraint,  # noqa: E402
)

LOGICAL = (("batch", "x"), ("data", "x"), ("model", "y"))


class Block(nnx.Module):
    def __init__(self, din, dout, *, rngs):
        self.linear = nnx.Linear(din, dout, kernel_init=nnx_shard_axes("data", "model"),
                                 rngs=rngs)

    def __call__(self, x):
        return jax.nn.tanh(self.linear(with_sharding_constraint(x, P("batch", None))))


class MLP(nnx.Module):
    def __init__(self, *, rngs, stages=True):
        blocks = [Block(8, 32, rngs=rngs), Block(32, 1, rngs=rngs)]
        if stages:
            blocks = [task(b, name=f"stage_{i}", logical_axes=LOGICAL,
                           mesh=TaskMesh(devices=range(4 * i, 4 * i + 4), axis_names=("x", "y"),
                                         axis_sizes=(2, 2)))
                      for i, b in enumerate(blocks)]
        self.stages = nnx.List(blocks)

    def __call__(self, batch):
        x, y = batch
        for stage in self.stages:
            x = stage(x)
        return jnp.mean((x[:, 0] - y) ** 2)


kx, kw = jax.random.split(jax.random.key(0))
inputs = jax.random.normal(kx, (32, 8))
batch = (inputs, jnp.tanh(inputs @ jax.random.normal(kw, (8,)) / 3))

step_fn, state, _ = parallelize_step(MLP(rngs=nnx.Rngs(0)), optax.adam(1e-2), global_batch=batch)
plain = MLP(rngs=nnx.Rngs(0), stages=False)
plain_opt = nnx.Optimizer(plain, optax.adam(1e-2), wrt=nnx.Param)


def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: m(batch))(model)
    optimizer.update(model, grads)
    return loss


with ignore_transforms():
    plain_step = nnx.jit(train_step)
for it in range(3):
    loss, state = step_fn(state, batch)
    with ignore_transforms():
        ref = plain_step(plain, plain_opt, batch)
    common.check(f"step{it}.loss", loss, ref, range(4, 8), rtol=1e-4)
for i in range(2):
    for name in ("kernel", "bias"):
        got = getattr(state.model.stages[i].linear, name).get_value()
        want = getattr(plain.stages[i].linear, name).get_value()
        common.check(f"stage{i}.{name}", got, want, range(4 * i, 4 * i + 4), rtol=1e-4,
                     atol=1e-5)
common.done()
