"""2 processes x 4 devices: submeshes that span both processes.

stage0 runs on device positions (0, 1, 4, 5) and stage1 on (2, 3, 6, 7): both are
ordinary multi-controller SPMD over two processes, and the move between them keeps
each shard in its own process. stage2 (the loss head) runs on (6, 7) of process 1
only, so stage1 -> stage2 goes from 4 devices to 2. The weights of stage0 and stage1 are
sharded over their 4 devices, so their gradients are split across both processes.
"""

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402

logical = (("batch", "x"), ("model", "x"))


def layer(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    w = mm.with_sharding_constraint(w, P(None, "model"))
    return jnp.tanh(x @ w)


def head(w, x):
    return jnp.sum((x @ w) ** 2)


span0 = mm.TaskMesh(devices=(0, 1, 4, 5), axis_names=("x",), axis_sizes=(4,))
span1 = span0.place((2, 3, 6, 7))
local = mm.TaskMesh(devices=(6, 7), axis_names=("x",), axis_sizes=(2,))
stage0 = mm.task(layer, name="stage0", mesh=span0, logical_axes=logical)
stage1 = mm.task(layer, name="stage1", mesh=span1, logical_axes=logical)
stage2 = mm.task(head, name="stage2", mesh=local, logical_axes=logical)


def loss(ws, x):
    return stage2(ws[2], stage1(ws[1], stage0(ws[0], x)))


def plain_loss(ws, x):
    return jnp.sum((jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) @ ws[2]) ** 2)


key = jax.random.key(2)
ws = [jax.random.normal(jax.random.fold_in(key, k), (16, 16)) / 4 for k in range(3)]
x = jax.random.normal(key, (8, 16))
compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
value, grads = compiled(ws, x)
ref_value, ref_grads = jax.jit(jax.value_and_grad(plain_loss))(ws, x)

common.check("loss", value, ref_value, [6, 7], rtol=1e-4)
common.check_tree("grads", grads, ref_grads, ([0, 1, 4, 5], [2, 3, 6, 7], [6, 7]),
                  rtol=1e-4, atol=1e-5)
# the spanning stages' gradients are split by columns over both processes
for g in grads[:2]:
    assert not g.is_fully_addressable and len(g.addressable_shards) == 2
    assert {tuple(s.data.shape) for s in g.addressable_shards} == {(16, 4)}
# what each process does with each step
kinds = [line.split()[0] for line in compiled.process_plan().splitlines()[1:]]
# stage0 <-> stage1: shard to shard, within each process; stage1 <-> stage2: 4 <-> 2 devices
assert kinds.count("paired") == 2 and kinds.count("replicated") == 2, kinds
assert kinds.count("skip") == (2 if me == 0 else 0), kinds
common.done()
