"""Anchor E1 (spmd-autosharding): one task over all 8 devices vs. no task."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.models import LOGICAL, e1_model, get_input_batch, init_params

model = e1_model


def _reference():
    with mm.ignore_transforms():
        return model(init_params(), get_input_batch())


def _device_ids(a):
    return {d.id for d in a.devices()}


def _assert_replicated(a):
    assert a.shape == (8, 8)
    spec = a.sharding.spec
    assert spec == P() or all(s is None for s in spec), spec
    assert _device_ids(a) == set(range(8))
    assert a.sharding.is_fully_replicated


def _assert_rows(a, devices):
    """Rows split evenly over ``devices`` in order: shard i holds row block i on devices[i]."""
    n = len(devices)
    rows = a.shape[0] // n
    assert _device_ids(a) == set(devices)
    assert not a.sharding.is_fully_replicated
    shards = sorted(a.addressable_shards, key=lambda s: s.device.id)
    assert len(shards) == n
    for i, s in enumerate(shards):
        assert s.device.id == devices[i]
        r, c = s.index
        assert (r.start or 0, r.stop) == (i * rows, (i + 1) * rows), s.index
        assert c == slice(None), s.index
        np.testing.assert_array_equal(np.asarray(s.data), np.asarray(a)[i * rows:(i + 1) * rows])


def _assert_cols(a, devices):
    n = len(devices)
    cols = a.shape[1] // n
    assert _device_ids(a) == set(devices)
    shards = sorted(a.addressable_shards, key=lambda s: s.device.id)
    assert len(shards) == n
    for i, s in enumerate(shards):
        assert s.device.id == devices[i]
        r, c = s.index
        assert r == slice(None), s.index
        assert (c.start or 0, c.stop) == (i * cols, (i + 1) * cols), s.index
        np.testing.assert_array_equal(np.asarray(s.data),
                                      np.asarray(a)[:, i * cols:(i + 1) * cols])


def test_no_task_replicates_everything():
    sharded_model, init_sharded_params, get_sharded_batch = mm.parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch)
    p1, p2 = init_sharded_params()
    batch = get_sharded_batch()
    for a in (p1, p2, batch):
        _assert_replicated(a)
    out = sharded_model((p1, p2), batch)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_reference()))
    assert set(range(8)) == _device_ids(out)


def _check_task_layout(mm_model):
    sharded_model, init_sharded_params, get_sharded_batch = mm.parallelize(
        mm_model, init_params=init_params, get_input_batch=get_input_batch)
    p1, p2 = init_sharded_params()
    batch = get_sharded_batch()
    all8 = list(range(8))
    _assert_rows(batch, all8)
    _assert_rows(p1, all8)
    _assert_cols(p2, all8)
    assert batch.sharding.spec in (P("x"), P("x", None))
    assert p1.sharding.spec in (P("x"), P("x", None))
    assert p2.sharding.spec == P(None, "x")
    out = sharded_model((p1, p2), batch)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_reference()))
    _assert_rows(out, all8)
    np.testing.assert_array_equal(np.asarray(p1), np.asarray(init_params()[0]))
    np.testing.assert_array_equal(np.asarray(batch), np.asarray(get_input_batch()))


def test_task_mesh_row_and_column_split():
    task_mesh = mm.TaskMesh(devices=range(0, 8), axis_names=("x",), axis_sizes=(8,))
    _check_task_layout(mm.task(model, mesh=task_mesh, logical_axes=LOGICAL))


def test_seed_syntax_devices_device_axes():
    _check_task_layout(mm.task(model, devices=np.array(jax.devices()), device_axes=("x",),
                               logical_axes=LOGICAL))


def test_initial_batch_variant():
    task_mesh = mm.TaskMesh(devices=range(0, 8), axis_names=("x",), axis_sizes=(8,))
    mm_model = mm.task(model, mesh=task_mesh, logical_axes=LOGICAL)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    example_batch = jax.jit(lambda: jnp.arange(64).reshape(8, 8),
                            out_shardings=NamedSharding(mesh, P("x", None)))()
    result = mm.parallelize(mm_model, init_params=init_params, initial_batch=example_batch)
    assert isinstance(result, tuple) and len(result) == 2
    sharded_model, init_sharded_params = result
    params = init_sharded_params()
    _assert_rows(params[0], list(range(8)))
    _assert_cols(params[1], list(range(8)))
    out = sharded_model(params, example_batch)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(_reference()))


def test_ignore_transforms_is_plain_jax():
    with mm.ignore_transforms():
        mm_model = mm.task(model, mesh=mm.TaskMesh(devices=range(8), axis_names=("x",),
                                                   axis_sizes=(8,)), logical_axes=LOGICAL)
        assert mm_model is model
        ref = model(init_params(), get_input_batch())
    p1, p2 = (np.arange(64).reshape(8, 8),) * 2
    np.testing.assert_array_equal(np.asarray(ref), np.arange(64).reshape(8, 8) @ p1 @ p2)
