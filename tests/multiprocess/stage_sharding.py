"""2 processes x 4 devices: one pipeline stage per process, each stage sharded over its
process's 2x2 devices by flax's logical rules, on a global mesh ("stage", "data",
"model") whose stage axis is the process.

Every process checks its shards of the loss and the gradients against plain Flax in this
one process, where each gradient lives, and that each kernel's gradient is split over
its stage's ``model`` axis (half of it on each device).
"""

import common

me = common.init()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from tests.models import LOGICAL_RULES as RULES  # noqa: E402
from tests.models import LogicalBlock  # noqa: E402

block = LogicalBlock()
x = jnp.linspace(-1.0, 1.0, 16 * 16).reshape(16, 16)
params = tuple(nn.unbox(block.init(jax.random.key(k), x)) for k in (0, 1))
devices = np.asarray(jax.devices()).reshape(2, 2, 2)  # stage k = process k's devices
mesh = jax.sharding.Mesh(devices, ("stage", "data", "model"), axis_types=(AxisType.Auto,) * 3)
stages = [mm.task(block.apply, name=f"s{k}", mesh_slice={"stage": k}) for k in (0, 1)]


def loss(ps, x):
    return jnp.mean(stages[1](ps[1], stages[0](ps[0], x)) ** 2)


def plain(ps, x):
    return jnp.mean(block.apply(ps[1], block.apply(ps[0], x)) ** 2)


with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    value, grads = mm.mjit(jax.value_and_grad(loss))(params, x)
with mm.ignore_transforms():
    ref_value, ref_grads = jax.jit(jax.value_and_grad(plain))(params, x)
A, B = range(0, 4), range(4, 8)
common.check("loss", value, ref_value, B)
common.check_tree("grads", grads, ref_grads,
                  (jax.tree.map(lambda _: A, grads[0]), jax.tree.map(lambda _: B, grads[1])))
for k in (0, 1):
    kernel = grads[k]["params"]["Dense_0"]["kernel"]
    if kernel.addressable_shards:
        assert kernel.addressable_shards[0].data.shape == (16, 32), kernel.sharding
common.done()
