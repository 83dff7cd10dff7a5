"""flax's own helpers work on what ``parallelize_step`` returns (issue 37, item 7).

A linen ``parallelize_step`` state, pipelined over two mesh-slice stages of a global mesh
``("stage", "data", "model")`` and sharded by flax's rules: under that global mesh and
the rules, ``nn.unbox`` and ``nn.get_partition_spec`` read it as
they read a ``jax.jit`` state (each box names the mesh its value lives on, its stage's
slice), and orbax saves it and restores it onto the same devices, from which the step
resumes. An NNX state's ``nnx.get_partition_spec`` gives its metadata's specs.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax.flax import parallelize_step
from tests.layouts import global_mesh as _global_mesh
from tests.models import LOGICAL_RULES as RULES
from tests.models import SlicedBlocks as Net
from tests.models import nnx_mlp, sliced_stages


def _kernels(params):
    """``(stage, path, box)`` of every kernel, in order."""
    out = []
    for path, box in jax.tree_util.tree_flatten_with_path(
            params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]:
        name = jax.tree_util.keystr(path)
        if "kernel" in name:
            out.append((0 if "_0" in name.split("'mod'")[0] else 1, name, box))
    return out


def _check_state(params) -> None:
    """Every kernel box names its value's mesh (its stage's slice), and the helpers read
    it: unbox gives the value where it is, sharded as the rules say."""
    kernels = _kernels(params)
    assert len(kernels) == 4
    specs = jax.tree.leaves(nn.get_partition_spec(params))
    assert P("embed", "mlp") in specs and P("mlp", "embed") in specs
    unboxed = nn.unbox(params)
    for (stage, name, box), value in zip(kernels, [v for p, v in jax.tree_util.tree_flatten_with_path(
            unboxed)[0] if "kernel" in jax.tree_util.keystr(p)], strict=True):
        assert isinstance(box, nn.LogicallyPartitioned)
        assert box.mesh is box.value.sharding.mesh, name
        assert {d.id for d in box.mesh.devices.flat} == set(range(4 * stage, 4 * stage + 4))
        assert value.sharding == box.value.sharding, name
        np.testing.assert_array_equal(np.asarray(value), np.asarray(box.value))
        want = NamedSharding(box.mesh, nn.logical_to_mesh_axes(box.names, RULES))
        assert value.sharding.is_equivalent_to(want, value.ndim), (name, value.sharding, want)


def _setup():
    x = jax.random.normal(jax.random.key(1), (16, 16))
    step, state, _ = parallelize_step(Net(), optax.sgd(0.1, momentum=0.9), global_batch=x)
    return step, state, x


def test_linen_helpers_on_the_state_under_the_global_mesh_and_rules():
    """``nn.unbox``/``nn.get_partition_spec`` on the first state and
    on a step's state, under ``jax.set_mesh(global mesh)`` and the rules; the step
    takes the state back, and its result is plain optax's."""
    with jax.set_mesh(_global_mesh()), nn.logical_axis_rules(RULES):
        step, state, x = _setup()
        _check_state(state.params)
        _check_state(state.opt_state[0].trace)  # the optimizer's state mirrors the params
        loss, new_state = step(state, x)
        _check_state(new_state.params)
        loss2, _ = step(new_state, x)
    with mm.ignore_transforms():
        params = jax.tree.map(np.asarray, nn.meta.unbox(jax.tree.map(
            lambda b: b.replace(mesh=None) if isinstance(b, nn.Partitioned) else b,
            state.params, is_leaf=lambda b: isinstance(b, nn.Partitioned))))
        tx = optax.sgd(0.1, momentum=0.9)
        ref_loss, grads = jax.value_and_grad(lambda p: Net().apply({"params": p}, x))(params)
        updates, _ = tx.update(grads, tx.init(params), params)
        ref_params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    got = jax.tree.leaves(nn.meta.unbox(jax.tree.map(
        lambda b: b.replace(mesh=None) if isinstance(b, nn.Partitioned) else b,
        new_state.params, is_leaf=lambda b: isinstance(b, nn.Partitioned))))
    for g, r in zip(got, jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    assert float(loss2) < float(loss)


def test_orbax_saves_and_restores_the_state(tmp_path):
    """orbax saves the state and restores it, with its shardings as the target, onto
    the same devices; the step resumes from the restored state exactly as from the
    state it saved."""
    ocp = pytest.importorskip("orbax.checkpoint")
    with jax.set_mesh(_global_mesh()), nn.logical_axis_rules(RULES):
        step, state, x = _setup()
        _, state = step(state, x)
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
        restored = ckpt.restore(tmp_path / "state", target)
        _check_state(restored.params)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
            assert a.sharding == b.sharding
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        want_loss, want = step(state, x)
        got_loss, got = step(restored, x)
    np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(want_loss))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_get_partition_spec_on_the_state():
    """NNX: ``nnx.get_partition_spec`` of a ``parallelize_step`` state gives the
    metadata's specs, and each kernel lives on its stage sharded by them."""
    from flax import nnx

    x = jax.random.normal(jax.random.key(1), (16, 16))
    with sliced_stages():
        model = nnx_mlp((None, "model"), ("model", None))
        step, state, _ = parallelize_step(model, optax.sgd(0.1), global_batch=x)
        _, state = step(state, x)
        specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    for k, spec in ((0, P(None, "model")), (1, P("model", None))):
        assert specs[f"l{k}"]["kernel"].get_value() == spec
        kernel = getattr(model, f"l{k}").kernel.get_value()
        assert {d.id for d in kernel.devices()} == set(range(4 * k, 4 * k + 4))
        assert kernel.sharding.spec == spec
