"""multimesh demo: the "mpmd-autosharding" program (two tasks on two 4-device submeshes).

Run with ``python examples/demo.py``. On a machine without accelerators it simulates
8 CPU devices. It

1. builds ``model(params, x)`` whose two layers are tasks on devices 0-3 and 4-7,
   with *logical* sharding constraints (``batch``, ``model``) that each task maps
   onto its own mesh axes;
2. ``parallelize``s it, shows where every parameter, the batch and the output
   live, and checks the result against plain jax;
3. compiles a training step, ``mjit(jax.value_and_grad(loss))``, checks it against
   plain jax and prints its fragment plan.

Exits non-zero if any check fails.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax import (  # noqa: E402
    TaskMesh,
    mjit,
    parallelize,
    task,
    with_sharding_constraint,
)


def f(param, x):
    return jnp.einsum("bm,mh->bh", x, param)


def init_params():
    return jnp.arange(64).reshape(8, 8), jnp.arange(64).reshape(8, 8)


def get_input_batch():
    return jnp.arange(64).reshape(8, 8)


# Two tasks with the same logical->physical mapping on two disjoint submeshes.
task_mesh = TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
logical_axes = (("batch", "x"), ("model", "x"))
layer1 = task(f, name="layer1", mesh=task_mesh, logical_axes=logical_axes)
layer2 = task(f, name="layer2", mesh=task_mesh.place((4, 5, 6, 7)), logical_axes=logical_axes)


def model(params, x):
    param_1, param_2 = params
    x = with_sharding_constraint(x, P("batch", None))
    param_1 = with_sharding_constraint(param_1, P("model", None))
    param_2 = with_sharding_constraint(param_2, P(None, "model"))
    x = layer1(param_1, x)
    x = layer2(param_2, x)
    return with_sharding_constraint(x, P("batch", None))


def reference_model(params, x):
    """The same computation in plain jax, on one device."""
    param_1, param_2 = params
    return f(param_2, f(param_1, x))


def where(label, x):
    ids = sorted(d.id for d in x.devices())
    print(f"  {label:<8} {str(x.shape):<8} devices={ids}")
    print(f"  {'':<8} {x.sharding}")
    return ids


failures = []


def check(ok, what):
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        failures.append(what)


def main():
    print(f"jax {jax.__version__}, {jax.device_count()} devices: {jax.devices()}")

    # ---- 1. parallelize: forward pass on two submeshes -------------------------------
    print("\n== parallelize(model) ==")
    sharded_model, init_sharded_params, get_sharded_batch = parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch)
    param_1, param_2 = init_sharded_params()
    batch = get_sharded_batch()
    out = sharded_model((param_1, param_2), batch)

    p1_ids = where("param_1", param_1)
    p2_ids = where("param_2", param_2)
    batch_ids = where("batch", batch)
    out_ids = where("output", out)

    check(p1_ids == [0, 1, 2, 3], "param_1 lives on layer1's submesh (0-3)")
    check(param_1.sharding.shard_shape(param_1.shape) == (2, 8), "param_1 is split by rows")
    check(p2_ids == [4, 5, 6, 7], "param_2 lives on layer2's submesh (4-7)")
    check(param_2.sharding.shard_shape(param_2.shape) == (8, 2), "param_2 is split by columns")
    check(batch_ids == [0, 1, 2, 3], "the batch lives where layer1 reads it (0-3)")
    check(out_ids == [4, 5, 6, 7], "the output lives where layer2 writes it (4-7)")

    expected = reference_model(init_params(), get_input_batch())
    check(bool(jnp.array_equal(jax.device_get(out), expected)), "output == plain jax")

    # ---- 2. mjit: a training step (forward + backward tasks) -------------------------
    print("\n== mjit(jax.value_and_grad(loss)) ==")

    def loss(params, x):
        return jnp.mean(model(params, x) ** 2)

    def reference_loss(params, x):
        return jnp.mean(reference_model(params, x) ** 2)

    params_f = tuple(p.astype(jnp.float32) / 64 for p in init_params())
    batch_f = get_input_batch().astype(jnp.float32) / 64

    step = mjit(jax.value_and_grad(loss))
    with mm.autoshard(True):
        compiled = step.lower(params_f, batch_f).compile()
    value, grads = compiled(params_f, batch_f)
    where("loss", value)
    where("grad_1", grads[0])
    where("grad_2", grads[1])

    ref_value, ref_grads = jax.value_and_grad(reference_loss)(params_f, batch_f)
    check(bool(jnp.allclose(value, ref_value, rtol=1e-4)), "loss == plain jax")
    check(all(bool(jnp.allclose(g, r, rtol=1e-4, atol=1e-4)) for g, r in zip(grads, ref_grads, strict=True)),
          "gradients == plain jax")

    if hasattr(compiled, "plan"):
        print("\n== fragment plan ==")
        print(compiled.plan())

    if failures:
        print(f"\n{len(failures)} check(s) failed: {failures}")
        raise SystemExit(1)
    print("\nall checks passed")


if __name__ == "__main__":
    main()
