"""multimesh.jax.flax with linen: task, shard_axes, tabulate, parallelize_step (anchor E3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import linen as nn  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh._src.errors import MultimeshError, MultimeshValueError  # noqa: E402
from multimesh.jax.flax import (  # noqa: E402
    parallelize_step,
    shard_axes,
    task,
    with_sharding_constraint,
)

SEED = Path("/work/shared/seeds/flax-task.txt")


def _ids(a):
    return sorted(d.id for d in a.devices())


def _row_blocks(a):
    """[(device id, row start, row stop)] for an array split along rows only."""
    out = []
    for s in sorted(a.addressable_shards, key=lambda s: s.device.id):
        assert all(sl == slice(None) for sl in s.index[1:]), s.index
        out.append((s.device.id, s.index[0].start or 0, s.index[0].stop))
    return out


def _box_lines(text):
    lines = [ln.rstrip() for ln in text.splitlines()]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("┏"))
    stop = next(i for i, ln in enumerate(lines) if ln.startswith("└"))
    return lines[start:stop + 1], lines


# --------------------------------------------------------------------------- tabulate


def test_tabulate_task_dense_matches_seed():
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("x", "y"))
    DenseTask = task(nn.Dense, mesh=mesh)
    assert DenseTask.__name__ == "Task[Dense]"
    model = DenseTask(features=16, kernel_init=shard_axes("x", None))
    text = model.tabulate(jax.random.key(0), jnp.ones((16, 9)),
                          console_kwargs={"force_terminal": False, "width": 120})
    box, lines = _box_lines(text)
    assert "Task[Dense] Summary" in [ln.strip() for ln in lines]
    assert "Total Parameters: 160 (640 B)" in [ln.strip() for ln in lines]
    if SEED.exists():
        seed_box, _ = _box_lines(SEED.read_text().split("Which produces the output:")[1])
        assert box == seed_box, "\n".join(box)
    assert "│      │ Task[Dense] │ float32[16,9] │ float32[16,16] │ mod:" in text
    assert "kernel: float32[9,16] P(x, None)" in text


def test_tabulate_shard_axes_dense():
    model = nn.Dense(features=16, kernel_init=shard_axes("batch", "model"))
    text = model.tabulate(jax.random.key(0), jnp.ones((16, 9)),
                          console_kwargs={"force_terminal": False, "width": 120})
    box, lines = _box_lines(text)
    assert "Dense Summary" in [ln.strip() for ln in lines]
    body = "\n".join(box)
    for piece in ("│ Dense  │ float32[16,9] │ float32[16,16] │ bias: float32[16]",
                  "kernel: float32[9,16] P(batch, model)", "160 (640 B)", "Total"):
        assert piece in body, body
    assert "Total Parameters: 160 (640 B)" in [ln.strip() for ln in lines]


def test_shard_axes_is_xavier_with_names():
    init = shard_axes("data", None)
    box = init(jax.random.key(0), (64, 32), jnp.float32)
    assert isinstance(box, nn.Partitioned) and box.names == ("data", None)
    ref = nn.initializers.xavier_normal()(jax.random.key(0), (64, 32), jnp.float32)
    np.testing.assert_array_equal(np.asarray(box.value), np.asarray(ref))
    with pytest.raises(TypeError):
        shard_axes(3)


def test_with_sharding_constraint_is_the_multimesh_one():
    assert with_sharding_constraint is mm.with_sharding_constraint


# --------------------------------------------------------------------------- E3


class MLPBlock(nn.Module):
    features: int = 4

    @nn.compact
    def __call__(self, x):
        x = with_sharding_constraint(x, P("batch"))
        x = nn.Dense(self.features, kernel_init=shard_axes("data", "model"))(x)
        return nn.relu(x)


AXIS_MAP = (("batch", "x"), ("data", "x"), ("model", "y"))


class Pipeline(nn.Module):
    n_layers: int = 2
    shape: tuple = (4, 1)
    axes: tuple = ("x", "y")
    axis_map: tuple = AXIS_MAP

    def submesh(self, layer):
        return mm.TaskMesh(devices=range(layer * 4, layer * 4 + 4), axis_names=self.axes,
                           axis_sizes=self.shape)

    @nn.compact
    def __call__(self, x):
        for i in range(self.n_layers):
            x = task(MLPBlock, mesh=self.submesh(i), name=f"layer_{i}",
                     logical_axes=self.axis_map)()(x)
        return (x * x).sum()


# The same model in plain Flax (no multimesh anywhere): one parameter ``mod``
# per layer holding the block's variables, as Task[MLPBlock] does, in a module
# that Flax auto-names from its class name: Task[MLPBlock]_0, Task[MLPBlock]_1
# (MultiMesh's naming; `name=` of the task transform names only the task).
class PlainBlock(nn.Module):
    features: int = 4

    @nn.compact
    def __call__(self, x):
        init = nn.with_partitioning(nn.initializers.xavier_normal(), ("data", "model"))
        return nn.relu(nn.Dense(self.features, kernel_init=init)(x))


class PlainTaskBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        inner = PlainBlock(parent=None)
        mod = self.param("mod", lambda rng: {"params": inner.init(rng, x)["params"]})
        return inner.apply(mod, x)


PlainTaskBlock.__name__ = "Task[MLPBlock]"


class PlainPipeline(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = PlainTaskBlock()(x)
        return (x * x).sum()


def _plain_step(x, lr=0.02):
    params = jax.jit(PlainPipeline().init)(jax.random.key(42), x)["params"]
    state = TrainState.create(apply_fn=PlainPipeline().apply, params=params, tx=optax.sgd(lr))

    @jax.jit
    def step(state, x):
        loss, grads = jax.value_and_grad(
            lambda p: state.apply_fn({"params": p}, x))(state.params)
        return loss, state.apply_gradients(grads=grads)

    loss, new = step(state, x)
    return state, loss, new


@pytest.fixture(scope="module")
def e3():
    x = jnp.arange(16)
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("x", "y"))
    step_fn, state, mesh_out, prepare_batch = parallelize_step(
        model=Pipeline(), optimizer=optax.sgd(learning_rate=0.02), mesh=mesh, local_batch=x)
    assert mesh_out is mesh
    batch = prepare_batch(x)
    loss, new_state = step_fn(state, batch)
    return x, step_fn, state, batch, loss, new_state


def _leaves(state):
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(state))[0]
    return {jax.tree_util.keystr(p): v for p, v in flat}


def test_e3_placement(e3):
    _, _, state, _, _, new_state = e3
    for st in (state, new_state):
        leaves = _leaves(st)
        step = leaves[".step"]
        assert step.shape == () and _ids(step) == list(range(8))
        assert step.sharding.is_fully_replicated
        k0 = leaves[".params['Task[MLPBlock]_0']['mod']['params']['Dense_0']['kernel']"]
        b0 = leaves[".params['Task[MLPBlock]_0']['mod']['params']['Dense_0']['bias']"]
        k1 = leaves[".params['Task[MLPBlock]_1']['mod']['params']['Dense_0']['kernel']"]
        b1 = leaves[".params['Task[MLPBlock]_1']['mod']['params']['Dense_0']['bias']"]
        assert k0.shape == (16, 4) and k1.shape == (4, 4) and b0.shape == b1.shape == (4,)
        assert _row_blocks(k0) == [(0, 0, 4), (1, 4, 8), (2, 8, 12), (3, 12, 16)]
        assert _row_blocks(k1) == [(4, 0, 1), (5, 1, 2), (6, 2, 3), (7, 3, 4)]
        assert _ids(b0) == [0, 1, 2, 3] and b0.sharding.is_fully_replicated
        assert _ids(b1) == [4, 5, 6, 7] and b1.sharding.is_fully_replicated
        assert len(leaves) == 5  # sgd has no state


def test_e3_loss_and_update_match_plain_flax(e3):
    x, _, state, _, loss, new_state = e3
    ref_state, ref_loss, ref_new = _plain_step(x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for before, ref in ((state, ref_state), (new_state, ref_new)):
        got = jax.tree.leaves(nn.meta.unbox(before.params))
        want = jax.tree.leaves(nn.meta.unbox(ref.params))
        assert len(got) == len(want) == 4
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1


def test_e3_second_step_keeps_layout(e3):
    x, step_fn, state, batch, loss, new_state = e3
    assert jax.tree.leaves(jax.tree.map(lambda a: a.sharding, state)) == \
        jax.tree.leaves(jax.tree.map(lambda a: a.sharding, new_state))
    loss2, state2 = step_fn(new_state, batch)
    assert float(loss2) < float(loss)
    assert int(state2.step) == 2
    k1 = _leaves(state2)[".params['Task[MLPBlock]_1']['mod']['params']['Dense_0']['kernel']"]
    assert _ids(k1) == [4, 5, 6, 7]
    frags = {f["name"]: f["devices"] for f in step_fn.fragments}
    assert frags["layer_0_fwd"] == [0, 1, 2, 3] and frags["layer_1_bwd"] == [4, 5, 6, 7]


def test_e3_under_ignore_transforms_same_structure_and_loss(e3):
    x, _, state, _, loss, _ = e3
    with mm.ignore_transforms():
        variables = jax.jit(Pipeline().init)(jax.random.key(42), x)
        ref = jax.jit(Pipeline().apply)(variables, x)
    assert jax.tree.structure(nn.meta.unbox(variables["params"])) == \
        jax.tree.structure(nn.meta.unbox(state.params))
    np.testing.assert_allclose(float(ref), float(loss), rtol=1e-5)


# --------------------------------------------------------------------------- task API


def test_task_class_fields_name_and_nesting():
    Block = task(MLPBlock, name="blk", mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,)),
                 logical_axes=(("batch", "x"),))
    assert Block.__name__ == "Task[MLPBlock]" and Block.wrapped_model is MLPBlock
    assert Block.mm_task.logical_axes == (("batch", "x"),)
    m = Block(features=3)
    assert m.features == 3

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block(features=3)(x) + Block(features=3, name="other")(x)

    v = Outer().init(jax.random.key(0), jnp.ones((2, 5)))
    assert set(v["params"]) == {"Task[MLPBlock]_0", "other"}  # `name` names the task only
    assert jax.tree.map(jnp.shape, nn.meta.unbox(v["params"]["Task[MLPBlock]_0"])) == \
        {"mod": {"params": {"Dense_0": {"bias": (3,), "kernel": (5, 3)}}}}


def test_task_accepts_legacy_device_kwargs_and_validates():
    T = task(nn.Dense, devices=np.array(jax.devices()[:4]).reshape(2, 2), device_axes=("x", "y"),
             logical_axes=(("batch", "x"),))
    y, _ = T(features=2).init_with_output(jax.random.key(0), jnp.ones((4, 3)))
    assert y.shape == (4, 2)
    # A pair naming a device axis the mesh lacks is only an error where it is used.
    task(nn.Dense, mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,)),
         logical_axes=(("batch", "nope"),))
    with pytest.raises(MultimeshError):
        task(nn.Dense, mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,)),
             logical_axes=("batch", "x"))
    with pytest.raises(TypeError):
        task(nn.Dense, bogus=1)


class BNDropBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(4)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        return nn.Dropout(0.5, deterministic=not train)(x)


def test_task_mutable_collections_rngs_and_static_args():
    T = task(BNDropBlock, mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,)))
    model = T()
    x = jax.random.normal(jax.random.key(1), (8, 3))
    variables = jax.jit(model.init, static_argnames="train")(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, train=False)
    assert set(variables) == {"params", "batch_stats"}
    assert set(variables["batch_stats"]) == {"mod"}

    def run(v, x):
        return model.apply(v, x, train=True, rngs={"dropout": jax.random.key(2)},
                           mutable=["batch_stats"])

    y, upd = mm.mjit(run)(variables, x)
    with mm.ignore_transforms():
        y_ref, upd_ref = jax.jit(run)(variables, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(upd), jax.tree.leaves(upd_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(upd["batch_stats"]["mod"]["BatchNorm_0"]["mean"]), 0)


class Repeat(nn.Module):
    @nn.compact
    def __call__(self, x, n):
        dense = nn.Dense(x.shape[-1])
        for _ in range(n):  # a Python int stays a Python int inside the task
            x = dense(x)
        return x


def test_task_python_scalars_stay_static():
    T = task(Repeat, mesh=mm.TaskMesh(devices=(4, 5), axis_names=("x",), axis_sizes=(2,)))
    x = jnp.ones((2, 3))
    variables = jax.jit(T().init, static_argnums=2)(jax.random.key(0), x, 2)
    y = mm.mjit(lambda v, x: T().apply(v, x, 3))(variables, x)
    with mm.ignore_transforms():
        ref = jax.jit(T().apply, static_argnums=2)(variables, x, 3)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5)
    assert _ids(y) == [4, 5]


# --------------------------------------------------------------------------- errors / packaging


def test_parallelize_step_needs_a_batch():
    with pytest.raises(MultimeshValueError, match="global_batch=.*local_batch="):
        parallelize_step(Pipeline(), optax.sgd(0.1))
    with pytest.raises(ValueError, match="not both"):
        parallelize_step(Pipeline(), optax.sgd(0.1), global_batch=jnp.ones(16),
                         local_batch=jnp.ones(16))


def test_parallelize_step_global_batch_returns_three():
    class Small(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = task(nn.Dense, mesh=mm.TaskMesh(devices=(2, 3), axis_names=("x",), axis_sizes=(2,)),
                     logical_axes=(("data", "x"),))(2, kernel_init=shard_axes("data", None))(x)
            return (y ** 2).mean()

    x = jnp.ones((4, 6))
    out = parallelize_step(Small(), optax.sgd(0.1), global_batch=x)
    assert len(out) == 3
    step_fn, state, mesh = out
    assert mesh.axis_names == ("x",) and mesh.devices.size == 8
    kernel = nn.meta.unbox(state.params)["Task[Dense]_0"]["mod"]["params"]["kernel"]
    assert _row_blocks(kernel) == [(2, 0, 3), (3, 3, 6)]
    loss, state = step_fn(state, x)
    assert np.isfinite(float(loss))


def test_importing_multimesh_jax_does_not_import_flax():
    code = ("import sys, multimesh.jax; "
            "assert 'flax' not in sys.modules and 'optax' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('flax', 'optax')))")
    subprocess.run([sys.executable, "-c", code], check=True, env={
        "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})


# --------------------------------------------------------------------------- E4


class E4Block(nn.Module):
    """The E3 block with no multimesh call but the (logical) constraint."""

    features: int = 4

    @nn.compact
    def __call__(self, x):
        x = with_sharding_constraint(x, P("batch"))
        init = nn.with_partitioning(nn.initializers.xavier_normal(), ("data", "model"))
        return nn.relu(nn.Dense(self.features, kernel_init=init)(x))


class E4Pipeline(nn.Module):
    n_layers: int = 2

    @nn.compact
    def __call__(self, x):
        for i in range(self.n_layers):
            x = E4Block(name=f"layer_{i}")(x)
        return (x * x).sum()


class PlainE4Pipeline(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = PlainBlock(name=f"layer_{i}")(x)
        return (x * x).sum()


def _e4_registrations(kind):
    if kind == "by_name":
        tm = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
        mm.register_task("layer_0", task=mm.Task(mesh=tm, logical_axes=AXIS_MAP))
        mm.register_task("layer_1", task=mm.Task(mesh=tm.place((4, 5, 6, 7)),
                                                  logical_axes=AXIS_MAP))
    else:
        def callback(name, backprop):
            layer = int(name.split("_")[1])
            tm = mm.TaskMesh(devices=range(4 * layer, 4 * layer + 4), axis_names=("x", "y"),
                             axis_sizes=(4, 1))
            return mm.Task(name=f"layer_{layer}", mesh=tm, logical_axes=AXIS_MAP)

        mm.register_task(r"(layer_\d+)", callback=callback)


@pytest.mark.parametrize("kind", ["by_name", "by_callback"])
def test_e4_implicit_flax_tasks(kind):
    x = jnp.arange(16)
    mm.clear_tasks()
    try:
        _e4_registrations(kind)
        mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("x", "y"))
        step_fn, state, _, prepare_batch = parallelize_step(
            model=E4Pipeline(), mesh=mesh, optimizer=optax.sgd(0.02), local_batch=x)
        loss, new_state = step_fn(state, prepare_batch(x))
    finally:
        mm.clear_tasks()
    leaves = _leaves(state)
    assert _ids(leaves[".step"]) == list(range(8))
    k0 = leaves[".params['layer_0']['Dense_0']['kernel']"]
    k1 = leaves[".params['layer_1']['Dense_0']['kernel']"]
    assert _row_blocks(k0) == [(0, 0, 4), (1, 4, 8), (2, 8, 12), (3, 12, 16)]
    assert _row_blocks(k1) == [(4, 0, 1), (5, 1, 2), (6, 2, 3), (7, 3, 4)]
    b0 = leaves[".params['layer_0']['Dense_0']['bias']"]
    b1 = leaves[".params['layer_1']['Dense_0']['bias']"]
    assert _ids(b0) == [0, 1, 2, 3] and b0.sharding.is_fully_replicated
    assert _ids(b1) == [4, 5, 6, 7] and b1.sharding.is_fully_replicated

    params = jax.jit(PlainE4Pipeline().init)(jax.random.key(42), x)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(PlainE4Pipeline().apply))(params, x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    ref_new = jax.tree.map(lambda p, g: p - 0.02 * g, nn.meta.unbox(params),
                           nn.meta.unbox(ref_grads))
    for g, w in zip(jax.tree.leaves(nn.meta.unbox(new_state.params)), jax.tree.leaves(ref_new)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
