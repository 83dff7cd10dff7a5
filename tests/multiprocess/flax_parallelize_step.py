"""2 processes x 4 devices: a Flax linen ``parallelize_step`` pipeline, two adam steps.

Each process reads its own half of the batch (``local_batch``); ``prepare_batch`` puts
the whole batch on layer 0's devices, all of them in process 0.

Layer i runs on device positions 4i..4i+3, so each process owns one layer's variables
(created there only: the other process holds arrays without local shards). Every process
checks its shards of the loss and of the whole new state against plain Flax + optax in
this one process.
"""

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax.flax import parallelize_step, shard_axes, task  # noqa: E402

AXES = (("batch", "x"), ("data", "x"), ("model", "y"))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = mm.with_sharding_constraint(x, P("batch"))
        return nn.relu(nn.Dense(4, kernel_init=shard_axes("data", "model"))(x))


class Pipeline(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            mesh = mm.TaskMesh(devices=range(4 * i, 4 * i + 4), axis_names=("x", "y"),
                               axis_sizes=(4, 1))
            x = task(Block, mesh=mesh, name=f"layer_{i}", logical_axes=AXES)()(x)
        return (x * x).sum()


# The same model in plain Flax: a parameter ``mod`` per layer under the name Task[Block]_i
# (MultiMesh's naming, which also seeds its initialisers), as Task[Block] keeps it.
class PlainBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.xavier_normal(), ("data", "model"))
        return nn.relu(nn.Dense(4, kernel_init=init)(x))


class PlainTaskBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        inner = PlainBlock(parent=None)
        mod = self.param("mod", lambda rng: {"params": inner.init(rng, x)["params"]})
        return inner.apply(mod, x)


class PlainPipeline(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = PlainTaskBlock(name=f"Task[Block]_{i}")(x)
        return (x * x).sum()


x = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
tx = optax.adam(0.05)
# each process loads its own 4 rows; prepare_batch moves them onto layer 0's devices
local = np.asarray(x)[4 * me:4 * me + 4]
step_fn, state, _, prepare_batch = parallelize_step(Pipeline(), tx, local_batch=local)
batch = prepare_batch(local)
common.check("batch", batch, x, range(4))

ref_state = TrainState.create(apply_fn=PlainPipeline().apply, tx=tx,
                              params=jax.jit(PlainPipeline().init)(jax.random.key(42), x)["params"])


@jax.jit
def ref_step(state, x):
    loss, grads = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, x))(state.params)
    return loss, state.apply_gradients(grads=grads)


def where(path_leaf):
    """Device positions of a state leaf: layer i's variables and adam moments on
    4i..4i+3; adam's step count where its first reader (layer 0's update) runs; the
    TrainState's step replicated on all 8."""
    name = jax.tree_util.keystr(path_leaf[0])
    for i in range(2):  # Task[Block]_i: MultiMesh's module naming (the task is layer_i)
        if f"Task[Block]_{i}" in name:
            return list(range(4 * i, 4 * i + 4))
    return list(range(4)) if name.endswith(".count") else list(range(8))


def check_state(tag, state, ref):
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(state))[0]
    refs = jax.tree.leaves(nn.meta.unbox(ref))
    assert len(flat) == len(refs), (len(flat), len(refs))
    for (path, leaf), r in zip(flat, refs):
        common.check(tag + jax.tree_util.keystr(path), leaf, r, where((path, leaf)),
                     rtol=1e-4, atol=1e-5)


check_state("init", state, ref_state)
kernel0 = nn.meta.unbox(state.params)["Task[Block]_0"]["mod"]["params"]["Dense_0"]["kernel"]
assert kernel0.is_fully_addressable == (me == 0)  # created only on its owner
for it in range(2):
    loss, state = step_fn(state, batch)
    ref_loss, ref_state = ref_step(ref_state, x)
    common.check(f"step{it}.loss", loss, ref_loss, range(4, 8), rtol=1e-4)
    check_state(f"step{it}", state, ref_state)
    if loss.is_fully_addressable:  # the last stage's process reads the loss
        print(f"step {it}: loss {float(loss):.5f}", flush=True)
common.done()
