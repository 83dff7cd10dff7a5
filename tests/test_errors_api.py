"""Bad input raises clear multimesh errors that name the offending value."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import PassFailure


def test_taskmesh_wrong_device_count():
    with pytest.raises(mm.MultimeshError) as ei:
        mm.TaskMesh(devices=range(6), axis_names=("x", "y"), axis_sizes=(2, 2))
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "6 devices" in msg and "(2, 2)" in msg


def test_taskmesh_duplicate_axis_names():
    with pytest.raises(mm.MultimeshError) as ei:
        mm.TaskMesh(devices=range(4), axis_names=("x", "x"), axis_sizes=(2, 2))
    assert isinstance(ei.value, ValueError)
    assert "('x', 'x')" in str(ei.value)


def test_task_device_outside_program_devices():
    far = mm.task(lambda x: x * 2, name="far",
                  mesh=mm.TaskMesh(devices=range(4, 8), axis_names=("x",), axis_sizes=(4,)))
    with pytest.raises(mm.MultimeshError) as ei:
        mm.mjit(far, devices=jax.devices()[:4])(jnp.ones(8))
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "'far'" in msg and "4" in msg and "0..3" in msg


def test_logical_axis_to_unknown_device_axis():
    # Only a constraint that uses the logical name needs the device axis (MultiMesh).
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")), name="t",
                mesh=mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,)),
                logical_axes=(("batch", "z"),))
    with pytest.raises(mm.MultimeshError) as ei:
        mm.mjit(t)(jnp.ones(8))
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "'batch'" in msg and "'z'" in msg and "task 't'" in msg and "'x'" in msg


def test_logical_sharding_not_dividing_dim():
    bad = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")) * 2, name="bad",
                  mesh=mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,)),
                  logical_axes=(("batch", "x"),))
    with pytest.raises(PassFailure) as ei:
        mm.mjit(bad, devices=jax.devices()[:4])(jnp.ones(6))
    err = ei.value
    assert isinstance(err, mm.MultimeshError) and isinstance(err, ValueError)
    msg = str(err)
    assert "(6,)" in msg            # the shape
    assert "dimension 0" in msg     # the dim
    assert "'x'" in msg and "size 4" in msg  # the axis
    assert "mm-opt" in msg and "mm-resolve-logical-shardings" in msg
    assert err.repro and err.repro.startswith("mm-opt ")
    assert err.pass_argument == "mm-resolve-logical-shardings"


def test_parallelize_without_batch():
    with pytest.raises(mm.MultimeshError) as ei:
        mm.parallelize(lambda p, b: p, init_params=lambda: jnp.ones(3))
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "get_input_batch" in msg and "initial_batch" in msg


def test_unknown_task_keyword():
    with pytest.raises(mm.MultimeshError) as ei:
        mm.task(lambda x: x, meshes=3)
    assert isinstance(ei.value, TypeError)
    assert "meshes" in str(ei.value)


def test_task_and_mesh_slice_exclusive():
    with pytest.raises(mm.MultimeshError) as ei:
        mm.Task(mesh=mm.TaskMesh(devices=range(2)), mesh_slice={"x": 0})
    assert isinstance(ei.value, ValueError)
    assert "mesh_slice" in str(ei.value)


def test_seed_syntax_mesh_and_devices_exclusive():
    with pytest.raises(mm.MultimeshError) as ei:
        mm.task(lambda x: x, mesh=mm.TaskMesh(devices=range(2)), devices=jax.devices()[:2],
                device_axes=("x",))
    assert isinstance(ei.value, ValueError)
