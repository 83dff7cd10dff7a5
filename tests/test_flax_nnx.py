"""multimesh.jax.flax with NNX: module tasks, NNX-aware mjit, parallelize_step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh._src.errors import MultimeshError  # noqa: E402
from multimesh.jax.flax import (  # noqa: E402
    StateSharding,
    TaskModule,
    mjit,
    nnx_shard_axes,
    parallelize_step,
    task,
    with_sharding_constraint,
)
from tests.models import nnx_train_step as train_step  # noqa: E402

AXES = (("batch", "x"), ("data", "x"), ("model", "y"))


def _ids(a):
    return sorted(d.id for d in a.devices())


def _stage_mesh(i):
    return mm.TaskMesh(devices=range(4 * i, 4 * i + 4), axis_names=("x", "y"), axis_sizes=(2, 2))


class Block(nnx.Module):
    def __init__(self, din, dout, *, rngs):
        self.linear = nnx.Linear(din, dout, kernel_init=nnx_shard_axes("data", "model"),
                                 rngs=rngs)

    def __call__(self, x):
        x = with_sharding_constraint(x, P("batch", None))
        return jax.nn.relu(self.linear(x))


class MLP(nnx.Module):
    """Two stages, each a task on its own 4-device submesh (2x2)."""

    def __init__(self, *, rngs, tasks=True):
        blocks = [Block(8, 16, rngs=rngs), Block(16, 4, rngs=rngs)]
        if tasks:
            blocks = [task(b, name=f"stage_{i}", mesh=_stage_mesh(i), logical_axes=AXES)
                      for i, b in enumerate(blocks)]
        self.stages = nnx.List(blocks)

    def __call__(self, x):
        for s in self.stages:
            x = s(x)
        return jnp.mean(x ** 2)


def _flat_values(node):
    return [v.get_value() for _, v in nnx.to_flat_state(nnx.state(node, nnx.Param))]


X = jax.random.normal(jax.random.key(1), (8, 8))


@pytest.fixture(scope="module")
def trained():
    model = MLP(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = mjit(train_step)
    losses = [step(model, opt, X) for _ in range(2)]
    return model, opt, step, losses


def test_two_stage_adam_matches_plain_nnx(trained):
    model, opt, _, losses = trained
    ref = MLP(rngs=nnx.Rngs(0), tasks=False)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    ref_step = nnx.jit(train_step)
    with mm.ignore_transforms():  # plain NNX: the constraint in Block is a no-op
        ref_losses = [ref_step(ref, ref_opt, X) for _ in range(2)]
    np.testing.assert_allclose(np.asarray(losses), np.asarray(ref_losses), rtol=1e-5)
    got, want = _flat_values(model), _flat_values(ref)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert int(opt.step.get_value()) == int(ref_opt.step.get_value()) == 2


def test_two_stage_params_on_their_stages(trained):
    model, opt, step, _ = trained
    for i, stage in enumerate(model.stages):
        assert isinstance(stage, TaskModule)
        kernel = stage.linear.kernel.get_value()
        bias = stage.linear.bias.get_value()
        assert _ids(kernel) == _ids(bias) == list(range(4 * i, 4 * i + 4))
        # kernel names ("data", "model") -> ("x", "y") on the stage's 2x2 submesh
        assert kernel.sharding.spec == P("x", "y"), kernel.sharding
    for path, v in nnx.to_flat_state(nnx.state(opt)):
        if path[-1] == "kernel":  # adam moments live with their parameter
            assert path[2] in ("mu", "nu"), path
            i = path[path.index("stages") + 1]
            assert _ids(v.get_value()) == list(range(4 * i, 4 * i + 4)), path
    frags = {f["name"]: f["devices"] for f in next(iter(step._cache.values())).fragments}
    assert frags["stage_0_fwd"] == [0, 1, 2, 3] and frags["stage_1_bwd"] == [4, 5, 6, 7]


def test_parallelize_step_nnx_matches_plain():
    model = MLP(rngs=nnx.Rngs(0))
    step_fn, state, mesh, prepare_batch = parallelize_step(model, optax.adam(1e-2),
                                                           local_batch=X)
    assert state.model is model and mesh.devices.size == 8
    for i, stage in enumerate(model.stages):  # placed before the first step
        assert _ids(stage.linear.kernel.get_value()) == list(range(4 * i, 4 * i + 4))
    assert _ids(state.optimizer.step.get_value()) == list(range(8))
    loss, state2 = step_fn(state, prepare_batch(X))
    assert state2 is state
    ref = MLP(rngs=nnx.Rngs(0), tasks=False)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    with mm.ignore_transforms():
        ref_loss = nnx.jit(train_step)(ref, ref_opt, X)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for g, w in zip(_flat_values(model), _flat_values(ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    for i, stage in enumerate(model.stages):  # and still there after it
        assert _ids(stage.linear.kernel.get_value()) == list(range(4 * i, 4 * i + 4))
    with pytest.raises(ValueError):
        parallelize_step(model, optax.sgd(0.1))


class BNBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.linear(x)))


def test_task_writes_back_batch_stats_and_rng_counts():
    block = BNBlock(nnx.Rngs(0, dropout=1))
    wrapped = task(block, mesh=mm.TaskMesh(devices=(2, 3), axis_names=("x",), axis_sizes=(2,)))
    assert wrapped is block and isinstance(block, (BNBlock, TaskModule))
    out = mjit(lambda m, x: m(x).sum())(wrapped, X)
    ref_block = BNBlock(nnx.Rngs(0, dropout=1))
    ref_out = nnx.jit(lambda m, x: m(x).sum())(ref_block, X)
    np.testing.assert_allclose(float(out), float(ref_out), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(block.bn.mean.get_value()),
                               np.asarray(ref_block.bn.mean.get_value()), rtol=1e-5, atol=1e-7)
    assert int(block.drop.rngs.count.get_value()) == int(ref_block.drop.rngs.count.get_value()) == 1
    # parameters were not changed, so they were neither outputs nor written back
    assert _ids(block.linear.kernel.get_value()) == [0]
    with mm.ignore_transforms():  # plain NNX: the wrapper just calls the module
        assert nnx.jit(lambda m, x: m(x))(wrapped, X).shape == (8, 8)
    assert int(block.drop.rngs.count.get_value()) == 2


def test_task_on_function_with_modules_updates_in_place():
    counter = nnx.Variable(jnp.zeros((), jnp.int32))
    lin = nnx.Linear(8, 2, rngs=nnx.Rngs(0))

    def f(lin, counter, x):
        counter.set_value(counter.get_value() + 1)
        return lin(x)

    tf = task(f, mesh=mm.TaskMesh(devices=(1,), axis_names=("x",), axis_sizes=(1,)))
    y = mjit(tf)(lin, counter, X)
    np.testing.assert_allclose(np.asarray(y), np.asarray(lin(X)), rtol=1e-5)
    assert int(counter.get_value()) == 1


def test_state_sharding_and_state_prefixes():
    lin = task(nnx.Linear(8, 8, rngs=nnx.Rngs(0)),
               mesh=mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,)))
    by_filter = StateSharding({nnx.PathContains("kernel"): P("x", None), ...: None})
    c = mjit(lambda m, x: m(x), in_shardings=(by_filter, P("x"))).lower(lin, X).compile()
    (lin_sh, x_sh), kw = c.input_shardings
    assert kw == {} and isinstance(lin_sh, nnx.State)
    assert lin_sh["kernel"].spec == P("x", None)
    assert lin_sh["bias"].spec in (P(), P(None))
    assert x_sh.spec == P("x", None)
    assert sorted(d.id for d in lin_sh["kernel"].device_set) == [0, 1, 2, 3]

    by_state = {"kernel": P(None, "x"), "bias": P("x")}  # or an nnx.State
    c = mjit(lambda m, x: m(x), in_shardings=(by_state, None),
             out_shardings=NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",)),
                                         P("x"))).lower(lin, X).compile()
    (lin_sh, _), _ = c.input_shardings
    assert lin_sh["kernel"].spec == P(None, "x") and lin_sh["bias"].spec == P("x")
    assert c.output_shardings.spec == P("x", None)
    np.testing.assert_allclose(np.asarray(c(lin, X)), np.asarray(nnx.Linear(8, 8, rngs=nnx.Rngs(0))(X)),
                               rtol=1e-5)


def test_mjit_returns_modules():
    make = mjit(lambda: nnx.Linear(4, 3, rngs=nnx.Rngs(0)))
    new = make()
    assert isinstance(new, nnx.Linear) and new.kernel.get_value().shape == (4, 3)
    ref = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(new.kernel.get_value()),
                               np.asarray(ref.kernel.get_value()), rtol=1e-6)
    same = mjit(lambda m: m)(ref)
    assert same is ref


def test_structure_change_is_an_error():
    class Grows(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

        def __call__(self, x):
            self.extra = nnx.Param(jnp.ones(2))
            return x * self.w

    with pytest.raises(MultimeshError, match="changed its structure"):
        mjit(lambda m, x: m(x))(Grows(), jnp.ones(2))
    t = task(Grows(), mesh=mm.TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,)))
    with pytest.raises(MultimeshError, match="changed its structure"):
        mjit(lambda m, x: m(x))(t, jnp.ones(2))


def test_task_wants_an_nnx_instance():
    with pytest.raises(TypeError, match="instance"):
        task(nnx.Linear, mesh=mm.TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,)))


def test_compiled_rejects_other_structures():
    lin = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    c = mjit(lambda m, x: m(x)).lower(lin, X).compile()
    with pytest.raises(ValueError, match="differ"):
        c(nnx.Linear(8, 3, rngs=nnx.Rngs(0)), X)


def test_unnamed_stages_of_one_class_get_distinct_task_names():
    class Two(nnx.Module):
        def __init__(self):
            blocks = [Block(8, 16, rngs=nnx.Rngs(0)), Block(16, 4, rngs=nnx.Rngs(1))]
            self.stages = nnx.List([task(b, mesh=_stage_mesh(i), logical_axes=AXES)
                                    for i, b in enumerate(blocks)])

        def __call__(self, x):
            for s in self.stages:
                x = s(x)
            return x

    model = Two()
    c = mjit(lambda m, x: m(x)).lower(model, X).compile()
    names = sorted(f["name"] for f in c.fragments)
    assert names == ["Block_0_3_fwd", "Block_4_7_fwd"], names
    with mm.ignore_transforms():
        ref = nnx.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(np.asarray(c(model, X)), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_core_mjit_takes_typed_keys():
    out = mm.mjit(lambda k, x: x + jax.random.normal(k, x.shape))(jax.random.key(0), jnp.ones(4))
    assert out.shape == (4,)
