"""Anchor E2 (mpmd-autosharding), E6 (hello world) and pipelined MLP gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax import with_sharding_constraint as wsc
from tests.models import e2_model, get_input_batch, init_params

model = e2_model()


def _reference():
    with mm.ignore_transforms():
        return model(init_params(), get_input_batch())


def _ids(a):
    return {d.id for d in a.devices()}


def _blocks(a, axis):
    """[(device id, start, stop)] along ``axis`` sorted by device id; other axis whole."""
    out = []
    for s in sorted(a.addressable_shards, key=lambda s: s.device.id):
        sl = s.index[axis]
        assert s.index[1 - axis] == slice(None), s.index
        out.append((s.device.id, sl.start or 0, sl.stop))
    return out


def test_place_keeps_axes():
    task_mesh = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    placed = task_mesh.place((4, 5, 6, 7))
    assert placed.axis_names == ("x", "y") and placed.axis_sizes == (4, 1)
    assert list(placed.devices.flat) == [4, 5, 6, 7]


def test_e2_get_input_batch():
    sharded_model, init_sharded_params, get_sharded_batch = mm.parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch)
    p1, p2 = init_sharded_params()
    batch = get_sharded_batch()
    assert _blocks(p1, 0) == [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    assert _blocks(p2, 1) == [(4, 0, 2), (5, 2, 4), (6, 4, 6), (7, 6, 8)]
    assert _blocks(batch, 0) == [(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)]
    out = sharded_model((p1, p2), batch)
    assert _ids(out) == {4, 5, 6, 7}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_reference()))
    frags = {fr["name"]: fr["devices"] for fr in sharded_model.fragments}
    assert frags["layer1_fwd"] == [0, 1, 2, 3]
    assert frags["layer2_fwd"] == [4, 5, 6, 7]
    assert sharded_model.transfers, sharded_model.plan()


def test_e2_initial_batch_on_all_devices():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    example_batch = jax.jit(lambda: jnp.arange(64).reshape(8, 8),
                            out_shardings=NamedSharding(mesh, P("x", None)))()
    assert _ids(example_batch) == set(range(8))
    result = mm.parallelize(model, init_params=init_params, initial_batch=example_batch)
    assert len(result) == 2
    sharded_model, init_sharded_params = result
    p1, p2 = init_sharded_params()
    assert _ids(p1) == {0, 1, 2, 3} and _ids(p2) == {4, 5, 6, 7}
    out = sharded_model((p1, p2), example_batch)
    assert _ids(out) == {4, 5, 6, 7}
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_reference()))


# --------------------------------------------------------------------------- E6

def test_e6_hello_world():
    def hf(x):
        return jnp.cos(x), jnp.sin(x)

    def hg(x, y):
        return x * x + y * y

    mm_f = mm.task(hf, mesh=mm.TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,)))
    mm_g = mm.task(hg, mesh=mm.TaskMesh(devices=(1,), axis_names=("x",), axis_sizes=(1,)))
    devices = jax.devices()[:2]
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    batch = jax.device_put(jnp.arange(8.0, dtype=jnp.float32), sharding)
    mm_c = mm.mjit(lambda x: mm_g(*mm_f(x)), devices=devices, in_shardings=(sharding,))
    result = mm_c(batch)
    assert result.devices() == {jax.devices()[1]}
    with mm.ignore_transforms():
        ref = hg(*hf(jnp.arange(8.0, dtype=jnp.float32)))
    np.testing.assert_allclose(np.asarray(result), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(result), np.ones(8), atol=1e-6)


# --------------------------------------------------------------------------- MLP pipeline

def _stage_fn(w, x):
    x = wsc(x, P("batch", None))
    w = wsc(w, P(None, "model"))
    return jnp.tanh(x @ w)


def _make_loss(n_stages, per_stage):
    stages = []
    for i in range(n_stages):
        tm = mm.TaskMesh(devices=range(i * per_stage, (i + 1) * per_stage), axis_names=("x",),
                         axis_sizes=(per_stage,))
        stages.append(mm.task(_stage_fn, name=f"stage{i}", mesh=tm,
                              logical_axes=(("batch", "x"),)))

    def loss(ws, x):
        for s, w in zip(stages, ws):
            x = s(w, x)
        return jnp.mean(x ** 2)

    return loss


@pytest.mark.parametrize("n_stages,per_stage", [(2, 4), (4, 2)])
def test_mlp_value_and_grad_pipeline(n_stages, per_stage):
    key = jax.random.PRNGKey(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (16, 16), jnp.float32) / 4
          for i in range(n_stages)]
    x = jax.random.normal(key, (8, 16), jnp.float32)
    loss = _make_loss(n_stages, per_stage)
    step = mm.mjit(jax.value_and_grad(loss), devices=jax.devices())
    compiled = step.lower(ws, x).compile()
    value, grads = compiled(ws, x)
    with mm.ignore_transforms():
        l_ref, g_ref = jax.value_and_grad(loss)(ws, x)
    np.testing.assert_allclose(np.asarray(value), np.asarray(l_ref), rtol=1e-5)
    assert len(grads) == n_stages
    for i, (g, gr) in enumerate(zip(grads, g_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-5, atol=1e-7)
        assert _ids(g) == set(range(i * per_stage, (i + 1) * per_stage)), (i, g.sharding)
    by_key = {}
    for fr in compiled.fragments:
        by_key.setdefault((fr["task"], fr["direction"]), []).append(fr["devices"])
    for i in range(n_stages):
        want = list(range(i * per_stage, (i + 1) * per_stage))
        for direction in ("fwd", "bwd"):
            assert (f"stage{i}", direction) in by_key, compiled.plan()
            assert all(d == want for d in by_key[(f"stage{i}", direction)]), by_key
    names = [fr["name"] for fr in compiled.fragments]
    assert "stage0_fwd" in names and f"stage{n_stages - 1}_bwd" in names
