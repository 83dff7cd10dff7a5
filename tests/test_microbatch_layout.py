"""A microbatch keeps its batch's layout (issue 37).

An lm1b-shaped linen model with its own logical annotations (``tests/real_models.py``;
like lm1b it never constrains its activations' batch dimension) runs as pipeline stages
of 2x2 devices, mesh slices of a global ``("stage", "data", "model")`` mesh, with the
batch placed ``P("data")`` and cut into microbatches. Before, each microbatch was
sliced out of the sharded batch by a dynamic slice, which XLA answers by gathering the
batch: every microbatch ran unsplit on both devices of its stage's ``data`` axis, twice
``jax.jit``'s work per device. Now the batch is split once per step so that each
microbatch's rows are sharded as the batch's are.

Each case checks values and gradients against plain jax (rtol 1e-5), per-device flops
(every fragment summed, one microbatch's worth) against ``jax.jit`` of the same
microbatched step on one stage's 2x2 ``(data, model)`` mesh with the same rules (a
Python loop over the microbatches, its flops divided by their number), and every
gradient's devices and partition spec against ``jax.jit``'s.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax.flax import parallelize_step
from tests.layouts import flops_of as _flops
from tests.layouts import global_mesh as _global_mesh
from tests.layouts import spec_of as _spec
from tests.layouts import stage_mesh as _stage_mesh
from tests.real_models import RULES, Lm1b, init_stages, stage_modules, stage_specs, token_batch
from tests.real_models import loss_of as _loss_of

BATCH, SIZE = 16, 4
M = BATCH // SIZE
AUTO = (AxisType.Auto,) * 3

# schedule -> (stages, the submesh of stage k): contiguous, round-robin and V-shaped
PLACEMENTS = {
    "gpipe": (2, lambda k: k),
    "1f1b": (2, lambda k: k),
    "zero-bubble-h1": (2, lambda k: k),
    "interleaved-1f1b": (4, lambda k: k % 2),
    "dualpipe-v": (4, lambda k: k if k < 2 else 3 - k),
}


class Reference:
    """The model cut into ``num_stages`` stages, its parameters, plain jax's value and
    gradients on the whole batch, and ``jax.jit``'s microbatched step on one 2x2 mesh."""

    def __init__(self, num_stages: int):
        self.batch = token_batch(BATCH)
        self.stages = stage_modules(num_stages)
        self.params = init_stages(self.stages, self.batch)
        self.specs = stage_specs(self.stages, self.batch)
        self.plain = _loss_of([s.apply for s in self.stages])
        self.value, self.grads = jax.value_and_grad(self.plain)(self.params, self.batch)
        mesh = _stage_mesh()
        with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
            params = self.placed_params(mesh)
            batch = jax.device_put(self.batch, NamedSharding(mesh, P("data")))
            step = jax.jit(self._looped).lower(params, batch).compile()
            self.flops = _flops(step) / M  # one microbatch's share, as mjit counts
            self.jit_grads = step(params, batch)[1]

    def placed_params(self, mesh):
        """The parameters laid out by their logical names on ``mesh`` (flax's recipe)."""
        return [jax.device_put(p, nn.logical_to_mesh_sharding(s, mesh, RULES))
                for p, s in zip(self.params, self.specs, strict=True)]

    def _looped(self, params, batch):
        """The microbatched step as plain jax writes it: a loop over the microbatches."""
        total = None
        for i in range(M):
            part = jax.tree.map(lambda a, i=i: a[i * SIZE:(i + 1) * SIZE], batch)
            out = jax.value_and_grad(self.plain)(params, part)
            total = out if total is None else jax.tree.map(jnp.add, total, out)
        return jax.tree.map(lambda a: a / M, total)

    def check(self, value, grads, flops, devices_of) -> None:
        """Values, gradients, their layouts (stage ``k``'s on ``devices_of(k)``), flops."""
        np.testing.assert_allclose(value, self.value, rtol=1e-5)
        for k, (g, want, jit) in enumerate(zip(grads, self.grads, self.jit_grads, strict=True)):
            for a, b, c in zip(jax.tree.leaves(g), jax.tree.leaves(want), jax.tree.leaves(jit),
                               strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
                assert {d.id for d in a.devices()} == set(devices_of(k))
                assert _spec(a.sharding, a.ndim) == _spec(c.sharding, c.ndim), (
                    k, a.sharding, c.sharding)
        # every device of a stage works on its own rows of each microbatch: within 10%
        # of jax.jit's flops per device (unsplit microbatches made it 2x)
        assert flops <= 1.1 * self.flops, (flops, self.flops)


@functools.cache
def _reference(num_stages: int) -> Reference:
    return Reference(num_stages)


@pytest.mark.parametrize("schedule", list(PLACEMENTS))
def test_each_microbatch_keeps_the_batchs_layout(schedule):
    num_stages, submesh = PLACEMENTS[schedule]
    ref = _reference(num_stages)
    mesh = _global_mesh()
    tasks = [mm.task(s.apply, name=f"s{k}", mesh_slice={"stage": submesh(k)})
             for k, s in enumerate(ref.stages)]
    batch = jax.device_put(ref.batch, NamedSharding(mesh, P("data")))
    params = ref.placed_params(mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        step = mm.mjit(mm.microbatch(jax.value_and_grad(_loss_of(tasks)), dim=0, size=SIZE,
                                     argnum=1, schedule=schedule, reduction="mean"))
        compiled = step.lower(params, batch).compile()
        value, grads = compiled(params, batch)
    ref.check(value, grads, _flops(compiled),
              lambda k: range(4 * submesh(k), 4 * submesh(k) + 4))
    # the batch is taken as placed, and split once per step on each submesh that reads it
    assert _spec(compiled.input_shardings[0][1]["inputs"], 2) == (("data",), None)
    fragments = compiled.cost_analysis(by_fragment=True)
    assert {"s0_microbatches", f"s{num_stages - 1}_microbatches"} <= set(fragments)


@pytest.mark.parametrize("how", ["placed", "arg_shardings"])
def test_task_mesh_stages(how):
    """Stages on ``TaskMesh``es with axes ``("data", "model")`` (no global mesh): the
    batch placed ``P("data")`` on the first stage's devices, or constrained so by
    ``microbatch``'s ``arg_shardings`` before it is cut."""
    ref = _reference(2)
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"), axis_sizes=(2, 2))
    meshes = [m0, m0.place((4, 5, 6, 7))]
    tasks = [mm.task(s.apply, name=f"s{k}", mesh=m) for k, (s, m) in
             enumerate(zip(ref.stages, meshes, strict=True))]
    params = [ref.placed_params(_stage_mesh(4 * k))[k] for k in range(2)]
    if how == "placed":
        batch, options = jax.device_put(ref.batch, NamedSharding(_stage_mesh(), P("data"))), {}
    else:
        batch, options = ref.batch, {"arg_shardings": P("data")}
    with nn.logical_axis_rules(RULES):
        step = mm.mjit(mm.microbatch(jax.value_and_grad(_loss_of(tasks)), dim=0, size=SIZE,
                                     argnum=1, schedule="1f1b", reduction="mean", **options))
        compiled = step.lower(params, batch).compile()
        value, grads = compiled(params, batch)
    ref.check(value, grads, _flops(compiled), lambda k: range(4 * k, 4 * k + 4))


def test_parallelize_step_keeps_a_placed_batchs_layout():
    """``parallelize_step(..., num_microbatches=4)`` of the whole model, its stages
    registered on mesh slices, with ``global_batch`` placed ``P("data")`` and
    ``replicate_inputs=False``: the step takes the batch as placed and each microbatch
    keeps its layout. One SGD step equals plain jax's; the new parameters are laid out as
    flax's rules lay them out (``nn.logical_to_mesh_sharding``, what lm1b's jitted step
    returns them in)."""
    ref = _reference(2)
    mesh = _global_mesh()
    model = Lm1b()
    batch = jax.device_put(ref.batch, NamedSharding(mesh, P("data")))

    def stage_of(name, backprop):
        return mm.Task(mesh_slice={"stage": int(name.split("_")[1])})

    with mm.Context() as ctx, jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        ctx.register_task(r"(stage_\d+)", callback=stage_of)
        step, state, _ = parallelize_step(
            model, optax.sgd(0.1), mesh=mesh, global_batch=batch, replicate_inputs=False,
            num_microbatches=M, schedule="1f1b")
        start = jax.device_get(state.params)
        loss, new = step(state, batch)
        flops = _flops(step)
    # the same parameters, named as Lm1b names them, and their plain jax step
    stages = [start[f"stage_{k}"] for k in range(2)]
    value, grads = jax.value_and_grad(ref.plain)([{"params": p} for p in stages], ref.batch)
    np.testing.assert_allclose(loss, value, rtol=1e-5)
    assert _spec(step.input_shardings[0][1]["inputs"], 2) == (("data",), None)
    update = _sgd_flops(ref)
    laid_out = ref.placed_params(_stage_mesh())
    for k in range(2):
        got = jax.tree.leaves(new.params[f"stage_{k}"])
        want = jax.tree.leaves(jax.tree.map(lambda p, g: p - 0.1 * g, stages[k],
                                            grads[k]["params"]))
        for a, b, c in zip(got, want, jax.tree.leaves(laid_out[k]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
            assert {d.id for d in a.devices()} == set(range(4 * k, 4 * k + 4))
            assert _spec(a.sharding, a.ndim) == _spec(c.sharding, c.ndim)
    assert flops <= 1.1 * (ref.flops + update), (flops, ref.flops, update)


def _sgd_flops(ref: Reference) -> float:
    """``jax.jit``'s flops per device for SGD's update of the parameters on a 2x2 mesh."""
    mesh = _stage_mesh()
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        params = ref.placed_params(mesh)
        tx = optax.sgd(0.1)

        def update(p, g):
            return optax.apply_updates(p, tx.update(g, tx.init(p), p)[0])

        return _flops(jax.jit(update).lower(params, params).compile())


def test_nnx_parallelize_step_takes_a_placed_batch():
    """The NNX flavour of ``parallelize_step``: with ``replicate_inputs=False`` a placed
    ``global_batch`` is taken as placed, split once per step on the stage that reads it,
    and one SGD step equals plain jax's."""
    from flax import nnx

    from multimesh.jax.flax import task

    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"), axis_sizes=(2, 2))

    class Staged(nnx.Module):
        def __init__(self, rngs):
            self.l0 = task(nnx.Linear(16, 16, rngs=rngs), name="s0", mesh=m0)
            self.l1 = task(nnx.Linear(16, 16, rngs=rngs), name="s1", mesh=m0.place((4, 5, 6, 7)))

        def __call__(self, x):
            return (jnp.tanh(self.l1(jnp.tanh(self.l0(x)))) ** 2).mean()

    x = jnp.linspace(-1, 1, BATCH * 16).reshape(BATCH, 16)
    placed = jax.device_put(x, NamedSharding(_stage_mesh(), P("data")))
    model = Staged(nnx.Rngs(0))
    params = jax.device_get(nnx.state(model, nnx.Param))
    step, state, _ = parallelize_step(model, optax.sgd(0.1), global_batch=placed,
                                      replicate_inputs=False, num_microbatches=M,
                                      schedule="1f1b")
    loss, state = step(state, placed)
    ref = Staged(nnx.Rngs(0))
    nnx.update(ref, params)
    with mm.ignore_transforms():
        value, grads = nnx.value_and_grad(lambda m: m(x))(ref)
    np.testing.assert_allclose(loss, value, rtol=1e-5)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, nnx.state(grads, nnx.Param))
    for a, b in zip(jax.tree.leaves(jax.device_get(nnx.state(state.model, nnx.Param))),
                    jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert _spec(step.compiled.input_shardings[0][1], 2) == (("data",), None)
    assert "s0_microbatches" in {f["name"] for f in step.compiled.fragments}
