"""2 processes x 4 devices: an Orbax checkpoint of per-stage parameters, and ``fetch``.

Stage 0's weight lives on process 0 only, stage 1's on process 1 only: Orbax refuses
such arrays ("host local") in a multi-process run, so ``checkpointable`` copies them to
one device of every process first. Restored arrays go back onto their stages with
``cross_move``; training from the restored state matches training
from the original one. ``fetch`` gives every process the loss that lives on process 1.
"""

import os
import tempfile

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.runtime import distributed  # noqa: E402


def layer(w, x):
    return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)


a = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x",), axis_sizes=(4,))
s0 = mm.task(layer, name="s0", mesh=a, logical_axes=(("batch", "x"),))
s1 = mm.task(layer, name="s1", mesh=a.place((4, 5, 6, 7)), logical_axes=(("batch", "x"),))


def loss(ws, x):
    return jnp.sum(s1(ws["b"], s0(ws["a"], x)) ** 2)


key = jax.random.key(0)
ws = {"a": jax.random.normal(key, (16, 16)) / 4,
      "b": jax.random.normal(jax.random.fold_in(key, 1), (16, 16)) / 4}
x = jnp.ones((8, 16))
step = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()


def train(params):
    value, grads = step(params, x)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


_, params = train(ws)
assert [params[k].is_fully_addressable for k in "ab"] == [me == 0, me == 1]

# one directory for all processes (a shared file system on a real cluster)
root = multihost_utils.broadcast_one_to_all(np.frombuffer(
    tempfile.mkdtemp(prefix="mm-ckpt-").ljust(64).encode(), np.uint8))
path = os.path.join(bytes(root).decode().strip(), "step1")
saved = distributed.checkpointable(params)
common.check_tree("saved", saved, jax.tree.map(np.asarray, distributed.fetch(params)),
                  {"a": [0, 4], "b": [0, 4]})
ckpt = ocp.StandardCheckpointer()
ckpt.save(path, saved)
ckpt.wait_until_finished()
abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=p.sharding),
                        saved)
restored = ckpt.restore(path, abstract)
# back onto the stages (where the step wants them)
restored = jax.tree.map(distributed.cross_move, restored, step.input_shardings[0][0])
common.check_tree("restored", restored, distributed.fetch(params),
                  {"a": range(4), "b": range(4, 8)})

ref_value, ref_params = train(params)
value, new_params = train(restored)
common.check("loss after restore", value, distributed.fetch(ref_value), [4, 5, 6, 7])
common.check_tree("params after restore", new_params, distributed.fetch(ref_params),
                  {"a": range(4), "b": range(4, 8)})
loss_everywhere = distributed.fetch(value)  # the loss lives on process 1; now all have it
assert isinstance(loss_everywhere, np.ndarray) and loss_everywhere.shape == ()
print(f"process {me}: loss {float(loss_everywhere):.6f}", flush=True)
common.done()
