"""``parallelize_step`` with microbatches: a pipelined Flax train step (issue 10)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import multimesh.jax as mm
from multimesh.jax.flax import parallelize_step
from multimesh.passes.schedules import build_schedule, pipeline_units
from tests.models import DenseBlocks, block_per_submesh

X = jnp.linspace(-1, 1, 32 * 16).reshape(32, 16)


def _step(**kw):
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=block_per_submesh)
        return parallelize_step(DenseBlocks(), optax.sgd(0.1), global_batch=X, **kw)


def _plain_step(params, reduction="mean", M=4):
    """optax SGD on the mean (or sum) of the per-microbatch value_and_grads, in plain JAX."""
    def loss(p, x):  # flax's layout: the TrainState's params are variables["params"]
        return DenseBlocks().apply({"params": p}, x)

    parts = [jax.value_and_grad(loss)(params, X[8 * m:8 * m + 8]) for m in range(M)]
    k = M if reduction == "mean" else 1
    loss = sum(p[0] for p in parts) / k
    grads = jax.tree.map(lambda *g: sum(g[1:], g[0]) / k, *[p[1] for p in parts])
    tx = optax.sgd(0.1)
    updates, _ = tx.update(grads, tx.init(params), params)
    return loss, optax.apply_updates(params, updates)


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_linen_step_pipelines_over_microbatches(schedule):
    step, state, _ = _step(num_microbatches=4, schedule=schedule)
    params = jax.device_get(state.params)
    loss, new = step(state, X)
    ref_loss, ref_params = _plain_step(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_close(jax.device_get(new.params), ref_params)
    # each block's parameters stay on its stage's submesh
    for i in range(2):
        for leaf in jax.tree.leaves(new.params[f"block_{i}"]):
            assert sorted(d.id for d in leaf.devices()) == list(range(4 * i, 4 * i + 4))
    assert step.schedule.labels() == build_schedule(pipeline_units(2, 4), schedule).labels()
    assert sum(c["microbatch"] is not None for c in step.calls) >= 2 * 2 * 4
    # the same step without microbatches gives the same numbers (a mean loss)
    step0, state0, _ = _step()
    loss0, new0 = step0(state0, X)
    np.testing.assert_allclose(loss, loss0, rtol=1e-5)
    _assert_close(jax.device_get(new.params), jax.device_get(new0.params))


def test_linen_step_sums_with_microbatch_size():
    step, state, _ = _step(microbatch_size=8, microbatch_reduction="sum")
    params = jax.device_get(state.params)
    loss, new = step(state, X)
    ref_loss, ref_params = _plain_step(params, reduction="sum")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_close(jax.device_get(new.params), ref_params)


def test_linen_step_resumes_from_given_parameters():
    variables = DenseBlocks().init(jax.random.key(7), X[:8])  # e.g. restored from a checkpoint
    params = variables["params"]
    step, state, _ = _step(num_microbatches=4, schedule="1f1b", init_state=variables)
    _assert_close(jax.device_get(state.params), params)
    loss, new = step(state, X)
    ref_loss, ref_params = _plain_step(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_close(jax.device_get(new.params), ref_params)
    # a different init key gives different parameters
    _, other, _ = _step(rng=jax.random.key(7))
    _assert_close(jax.device_get(other.params), params)


def test_linen_step_takes_a_train_state_with_its_own_optimizer_only():
    from flax.training.train_state import TrainState

    params = DenseBlocks().init(jax.random.key(7), X[:8])["params"]
    tx = optax.sgd(0.1)
    given = TrainState.create(apply_fn=DenseBlocks().apply, params=params, tx=tx)
    with mm.Context() as ctx:  # the state's own optimizer: it resumes
        ctx.register_task(r"(block_\d+)", callback=block_per_submesh)
        step, state, _ = parallelize_step(DenseBlocks(), tx, global_batch=X, num_microbatches=4,
                                          init_state=given)
    loss, new = step(state, X)
    ref_loss, ref_params = _plain_step(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_close(jax.device_get(new.params), ref_params)
    # another optimizer than the state's: one would be ignored, so neither is
    with pytest.raises(mm.MultimeshError, match=r"a TrainState with its own optimizer "
                                                r"\(`init_state.tx`\), and a different "
                                                r"`optimizer`") as e:
        parallelize_step(DenseBlocks(), optax.adam(1e-3), global_batch=X, init_state=given)
    assert isinstance(e.value, ValueError)


def test_nnx_step_pipelines_over_microbatches():
    from multimesh.jax.flax import task

    class Staged(nnx.Module):
        def __init__(self, rngs):
            self.l0 = task(nnx.Linear(16, 16, rngs=rngs), name="s0",
                           mesh=mm.TaskMesh(devices=range(4)))
            self.l1 = task(nnx.Linear(16, 16, rngs=rngs), name="s1",
                           mesh=mm.TaskMesh(devices=range(4, 8)))

        def __call__(self, x):
            return (jnp.tanh(self.l1(jnp.tanh(self.l0(x)))) ** 2).mean()

    model = Staged(nnx.Rngs(0))
    params = jax.device_get(nnx.state(model, nnx.Param))
    step, state, _ = parallelize_step(model, optax.sgd(0.1), global_batch=X,
                                      num_microbatches=4, schedule="1f1b")
    loss, state = step(state, X)

    ref = Staged(nnx.Rngs(0))
    nnx.update(ref, params)
    with mm.ignore_transforms():
        losses = []
        grads = None
        for m in range(4):
            lv, g = nnx.value_and_grad(lambda mod, b: mod(b))(ref, X[8 * m:8 * m + 8])
            losses.append(lv)
            grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    np.testing.assert_allclose(loss, sum(losses) / 4, rtol=1e-5)
    want = jax.tree.map(lambda p, g: p - 0.1 * g / 4, params, grads)
    _assert_close(jax.device_get(nnx.state(state.model, nnx.Param)), want)
    schedule = step.compiled.schedule
    assert schedule.labels() == build_schedule(pipeline_units(2, 4), "1f1b").labels()
    kernel = state.model.l1.kernel[...]
    assert sorted(d.id for d in kernel.devices()) == [4, 5, 6, 7]
    # per stage: forward, backward, the mean over microbatches and the update; neither
    # the step's input constraints (a pass-through) nor the zero accumulators compile
    names = sorted(f["name"] for f in step.compiled.fragments)
    assert names == ["mm_default_fwd", "s0_bwd", "s0_bwd_1", "s0_fwd_1", "s0_fwd_2",
                     "s1_bwd", "s1_bwd_1", "s1_fwd_1", "s1_fwd_2"]


def test_microbatch_options_are_checked():
    with pytest.raises(mm.MultimeshError, match="`num_microbatches` or `microbatch_size`, not "
                                                 "both"):
        _step(num_microbatches=2, microbatch_size=16)
    with pytest.raises(mm.MultimeshError, match="got `schedule` but no `num_microbatches`"):
        _step(schedule="1f1b")
    with pytest.raises(mm.MultimeshError, match="'mean' or 'sum', got 'max'"):
        _step(num_microbatches=2, microbatch_reduction="max")
    with pytest.raises(mm.MultimeshError, match="num_microbatches=3 does not divide the batch "
                                                 "of 32 rows"):
        _step(num_microbatches=3)
