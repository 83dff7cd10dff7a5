"""2 processes x 4 devices: the README's two-stage value_and_grad program, two steps."""

import common

me = common.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from multimesh.jax import TaskMesh, mjit, task, with_sharding_constraint  # noqa: E402


def f(param, x):
    x = with_sharding_constraint(x, P("batch", None))
    return jnp.einsum("bm,mh->bh", x, param)


mesh_a = TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
mesh_b = mesh_a.place((4, 5, 6, 7))
logical = (("batch", "x"), ("model", "x"))
layer1 = task(f, name="layer1", mesh=mesh_a, logical_axes=logical)
layer2 = task(f, name="layer2", mesh=mesh_b, logical_axes=logical)


def model(params, x):
    return layer2(params[1], layer1(params[0], x))


def loss(params, x):
    return jnp.mean(model(params, x) ** 2)


def plain_loss(params, x):
    return jnp.mean(((x @ params[0]) @ params[1]) ** 2)


key = jax.random.key(0)
params = (jax.random.normal(key, (8, 8)) / 3, jax.random.normal(jax.random.fold_in(key, 1),
                                                                 (8, 8)) / 3)
x = jax.random.normal(jax.random.fold_in(key, 2), (8, 8))
step = mjit(jax.value_and_grad(loss))
ref_step = jax.jit(jax.value_and_grad(plain_loss))  # plain JAX, on this process's device 0
A, B = range(0, 4), range(4, 8)

ref_params = params
for it in range(2):
    value, grads = step(params, x)
    ref_value, ref_grads = ref_step(ref_params, x)
    common.check(f"step{it}.loss", value, ref_value, B)
    common.check_tree(f"step{it}.grads", grads, ref_grads, (A, B))
    # the process that does not hold the loss sees a global array without local shards
    assert value.is_fully_addressable == (me == 1)
    if me == 1:
        print(f"loss {it}: {float(value):.6f}", flush=True)
    # an ordinary update on global arrays; each process computes its own shards
    params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
    ref_params = jax.tree.map(lambda p, g: p - 0.5 * g, ref_params, ref_grads)
    common.check_tree(f"step{it}.params", params, ref_params, (A, B))

# profile(): the same step, blocking after each of this process's steps, with a trace
compiled = step.lower(params, x).compile()
value, grads = compiled.profile(params, x)
ref_value, ref_grads = ref_step(ref_params, x)
common.check("profiled.loss", value, ref_value, B)
common.check_tree("profiled.grads", grads, ref_grads, (A, B))
spans = {e[1] for e in compiled.last_trace.events}
mine, theirs = ("layer1", "layer2") if me == 0 else ("layer2", "layer1")
assert {f"{mine}_fwd", f"{mine}_bwd"} <= spans, spans
assert not {f"{theirs}_fwd", f"{theirs}_bwd"} & spans, spans  # the other process's fragments
assert any(name.startswith("transfer") for name in spans), spans
common.done()
