"""Linen ``parallelize_step`` state as flax lays it out, and resuming it (issue 31, item 5).

``TrainState.params`` is ``variables["params"]``, as ``TrainState.create`` is used in
flax's examples, so a checkpoint and parameter-path code written for flax fit. Resuming
with ``init_state=`` takes the state, the dict orbax restores for it, a variables dict
or the params alone, and an optimizer built the same way as the state's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax.flax import parallelize_step  # noqa: E402
from tests.models import DenseBlocks  # noqa: E402

X = jnp.linspace(-1, 1, 8 * 6).reshape(8, 6)


def _ids(a):
    return sorted(d.id for d in a.devices())


def _step(**kw):
    def stage(name, backprop):
        i = int(name.split("_")[1])
        return mm.Task(name=f"{name}_{'b' if backprop else 'f'}",
                       mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + 4)))

    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=stage)
        return parallelize_step(DenseBlocks(width=6), optax.adam(1e-2), global_batch=X, **kw)


def _plain(state: TrainState, steps: int):
    """``steps`` adam steps of plain flax from ``state`` (params = variables["params"])."""
    @jax.jit
    def one(s):
        loss, grads = jax.value_and_grad(
            lambda p: s.apply_fn({"params": p}, X))(s.params)
        return loss, s.apply_gradients(grads=grads)

    losses = []
    for _ in range(steps):
        loss, state = one(state)
        losses.append(float(loss))
    return losses, state


def _close(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=1e-7)


def _placed(state):
    for i in range(2):
        for leaf in jax.tree.leaves(state.params[f"block_{i}"]):
            assert _ids(leaf) == list(range(4 * i, 4 * i + 4))
        mu = state.opt_state[0].mu[f"block_{i}"]["kernel"]  # adam's moment with its param
        assert _ids(mu) == list(range(4 * i, 4 * i + 4))


def test_train_state_params_are_flax_params():
    step, state, _ = _step()
    want = DenseBlocks(width=6).init(jax.random.key(42), X)["params"]
    assert set(state.params) == {"block_0", "block_1"}  # no "params" level
    _close(jax.device_get(state.params), want)
    _placed(state)
    losses = []
    for _ in range(2):
        loss, state = step(state, X)
        losses.append(float(loss))
    ref = TrainState.create(apply_fn=DenseBlocks(width=6).apply, params=want, tx=optax.adam(1e-2))
    ref_losses, ref = _plain(ref, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _close(jax.device_get(state.params), ref.params)
    _close(jax.device_get(state.opt_state), ref.opt_state)
    _placed(state)


@pytest.fixture(scope="module")
def trained():
    """Two steps of adam, saved as a checkpoint would hold them (host values)."""
    step, state, _ = _step()
    for _ in range(2):
        _, state = step(state, X)
    return jax.device_get(state)


def _resumed(init_state, steps=1):
    step, state, _ = _step(init_state=init_state)
    _placed(state)
    losses = []
    for _ in range(steps):
        loss, state = step(state, X)
        losses.append(float(loss))
    return losses, state


def test_resume_accepts_a_freshly_built_equal_optimizer(trained):
    saved = trained.replace(tx=optax.adam(1e-2))  # the optimizer rebuilt after a restart
    losses, state = _resumed(saved)
    ref_losses, ref = _plain(TrainState.create(apply_fn=DenseBlocks(width=6).apply, params=trained.params,
                                               tx=optax.adam(1e-2)).replace(
        step=trained.step, opt_state=trained.opt_state), 1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _close(jax.device_get(state.params), ref.params)
    _close(jax.device_get(state.opt_state), ref.opt_state)
    assert int(state.step) == 3


def test_resume_from_orbax_raw_restore(trained, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", trained)
    ckpt.wait_until_finished()
    raw = ckpt.restore(tmp_path / "state")  # no target: nested dicts and lists
    assert isinstance(raw, dict) and set(raw) >= {"params", "opt_state", "step"}
    losses, state = _resumed(raw)
    ref_losses, ref = _plain(trained.replace(tx=optax.adam(1e-2)), 1)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _close(jax.device_get(state.params), ref.params)
    _close(jax.device_get(state.opt_state), ref.opt_state)


def test_resume_from_params_or_variables_restarts_the_optimizer(trained):
    for given in (trained.params, {"params": trained.params}):
        losses, state = _resumed(given)
        fresh = TrainState.create(apply_fn=DenseBlocks(width=6).apply, params=trained.params,
                                  tx=optax.adam(1e-2))
        ref_losses, ref = _plain(fresh, 1)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        _close(jax.device_get(state.params), ref.params)


def test_resume_from_a_dict_of_another_model_names_the_place(trained):
    bad = {"params": {"block_0": trained.params["block_0"]}}
    with pytest.raises(mm.MultimeshError, match=r"init_state\['params'\]\['block_1'\]") as e:
        _step(init_state=bad)
    assert isinstance(e.value, ValueError)
    wrong = jax.tree.map(lambda a: a[..., :3], trained.params)
    with pytest.raises(ValueError, match=r"has shape \(3,\), but the model's state has"):
        _step(init_state=wrong)
    with pytest.raises(ValueError, match=r"a different `optimizer`"):
        _step(init_state=trained.replace(tx=optax.adam(1e-3)))


def test_model_with_other_collections_is_refused_early():
    class WithStats(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=True)(x).mean()

    with pytest.raises(ValueError, match=r"also made the collections \['batch_stats'\]"):
        parallelize_step(WithStats(), optax.sgd(0.1), global_batch=X)
