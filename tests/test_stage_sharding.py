"""Inside a task the mesh is the task's mesh: a model's own sharding code, written for
one mesh, shards each pipeline stage over its own devices (issue 30).

Two stages of 2x2 devices on 8 CPU devices, each stage sharding batch x model by the
model's own annotations (flax linen logical rules; ``jax.lax.with_sharding_constraint``
with a ``PartitionSpec``), with the stages as ``mesh_slice``s of a global mesh
``("stage", "data", "model")`` and as ``TaskMesh``es with the axes ``("data", "model")``.
Each case checks values and gradients against plain jax, per-device flops against
``jax.jit`` with the same annotations on a 2x2 mesh, and where every gradient lives and
how it is sharded against that ``jax.jit``.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.layouts import flops_of as _flops
from tests.layouts import global_mesh as _global_mesh
from tests.layouts import spec_of as _spec
from tests.layouts import stage_mesh as _stage_mesh
from tests.models import LOGICAL_RULES as RULES
from tests.models import LogicalBlock as Block
from tests.models import jit_reference, nnx_mlp, nnx_train_step, sliced_stages

AUTO3 = (AxisType.Auto,) * 3




def jax_block(w, x):
    """The same block in plain jax, sharded with ``jax.lax.with_sharding_constraint``."""
    x = jax.lax.with_sharding_constraint(x, P("data", None))
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w["w1"]), P("data", "model"))
    return x + h @ w["w2"]


def _linen_params():
    blk = Block()
    x = jnp.ones((16, 16))
    return blk.apply, tuple(nn.unbox(blk.init(jax.random.key(k), x)) for k in (0, 1))


def _jax_params():
    ks = jax.random.split(jax.random.key(0), 4)
    return jax_block, tuple({"w1": 0.3 * jax.random.normal(ks[2 * i], (16, 64)),
                             "w2": 0.3 * jax.random.normal(ks[2 * i + 1], (64, 16))}
                            for i in range(2))


MODELS = {"linen-rules": _linen_params, "jax-constraint": _jax_params}


def _stages(apply, placement):
    if placement == "mesh_slice":
        return [mm.task(apply, name=f"s{k}", mesh_slice={"stage": k}) for k in range(2)]
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"), axis_sizes=(2, 2))
    return [mm.task(apply, name="s0", mesh=m0), mm.task(apply, name="s1", mesh=m0.place((4, 5, 6, 7)))]


@contextlib.contextmanager
def _context(placement, mesh=None):
    with contextlib.ExitStack() as stack:
        if placement == "mesh_slice":
            stack.enter_context(jax.set_mesh(mesh or _global_mesh()))
        stack.enter_context(nn.logical_axis_rules(RULES))
        yield


def _loss_of(stages):
    def loss(ps, x):
        return jnp.mean(stages[1](ps[1], stages[0](ps[0], x)) ** 2)
    return loss


def _assert_like_jax(got, want) -> None:
    """``(value, grads, flops)`` of the MPMD program against plain jax's: the same
    numbers, and no more than 10% more flops per stage device."""
    (value, grads, flops), (ref_value, ref_grads, ref_flops) = got, want
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)


def _one_device_flops(loss, params, x) -> float:
    """The whole step's flops on one device (a 1x1 mesh, so the annotations apply)."""
    one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"),
                            axis_types=(AxisType.Auto,) * 2)
    with nn.logical_axis_rules(RULES), jax.set_mesh(one):
        return _flops(jax.jit(jax.value_and_grad(loss)).lower(params, x).compile())


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("placement", ["mesh_slice", "TaskMesh"])
def test_each_stage_is_sharded_as_the_model_says(model, placement):
    apply, params = MODELS[model]()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    plain = _loss_of([apply, apply])
    with _context(placement):
        step = mm.mjit(jax.value_and_grad(_loss_of(_stages(apply, placement))))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    # The reference: plain jax, with the same rules, on one stage-shaped 2x2 mesh.
    ref_value, ref_grads, ref_flops = jit_reference(plain, params, x)
    one_device = _one_device_flops(plain, params, x)

    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    # Every device of a stage works: per-device flops as jax.jit's on a 2x2 mesh.
    assert flops <= 1.1 * ref_flops, (flops, ref_flops, one_device)
    assert flops <= 0.3 * one_device, (flops, one_device)
    # Each gradient lives on its stage's devices, sharded as jax.jit shards it.
    for k in range(2):
        for g, r in zip(jax.tree.leaves(grads[k]), jax.tree.leaves(ref_grads[k]), strict=True):
            assert {d.id for d in g.devices()} == set(range(4 * k, 4 * k + 4))
            assert _spec(g.sharding, g.ndim) == _spec(r.sharding, r.ndim), (g.sharding, r.sharding)


def test_parameters_in_the_global_layout_keep_it_on_their_stage():
    """flax's recipe: parameters placed by ``nn.logical_to_mesh_sharding`` on the global
    mesh (over ``model``, replicated over ``stage``) reach their stage's slice with the
    same spec on the kept axes, and their gradients come back in it."""
    apply, params = _linen_params()
    mesh = _global_mesh()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    specs = nn.get_partition_spec(jax.eval_shape(Block().init, jax.random.key(0), x))
    shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
    placed = tuple(jax.device_put(p, shardings) for p in params)
    with _context("mesh_slice", mesh):
        step = mm.mjit(jax.value_and_grad(_loss_of(_stages(apply, "mesh_slice"))))
        value, grads = step(placed, x)
    ref_value, ref_grads = jax.value_and_grad(_loss_of([apply, apply]))(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for k in range(2):
        kernel = grads[k]["params"]["Dense_0"]["kernel"]
        np.testing.assert_allclose(np.asarray(kernel),
                                   np.asarray(ref_grads[k]["params"]["Dense_0"]["kernel"]),
                                   rtol=1e-5, atol=1e-6)
        assert {d.id for d in kernel.devices()} == set(range(4 * k, 4 * k + 4))
        assert _spec(kernel.sharding, 2) == (None, ("model",))
        assert kernel.addressable_shards[0].data.shape == (16, 32)  # half of (16, 64)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_microbatched_stages_stay_sharded(schedule):
    """Under ``microbatch`` each stage's fragments shard as the model says, and values
    and gradients are plain jax's."""
    apply, params = _linen_params()
    x = jax.random.normal(jax.random.key(7), (32, 16))
    with _context("mesh_slice"):
        loss = _loss_of(_stages(apply, "mesh_slice"))
        step = mm.mjit(mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                                     schedule=schedule, reduction="mean"))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    ref_value, ref_grads = jax.value_and_grad(_loss_of([apply, apply]))(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    one_device = _one_device_flops(_loss_of([apply, apply]), params, x)
    assert flops <= 0.3 * one_device, (flops, one_device)


def test_a_constraint_over_a_global_mesh_named_sharding_in_a_stage():
    """A ``NamedSharding`` of the global mesh written inside a stage applies on the
    stage's slice: the sliced axis dropped, the others kept."""
    mesh = _global_mesh()
    data = NamedSharding(mesh, P("data", "model"))
    stages = [mm.task(lambda x: jax.lax.with_sharding_constraint(jnp.sin(x), data) * 2,
                      name=f"s{k}", mesh_slice={"stage": k}) for k in range(2)]
    x = jnp.arange(64.0).reshape(8, 8)
    with jax.set_mesh(mesh):
        out = mm.mjit(lambda x: stages[1](stages[0](x)))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.sin(jnp.sin(x) * 2) * 2),
                               rtol=1e-6)
    assert {d.id for d in out.devices()} == {4, 5, 6, 7}
    assert _spec(out.sharding, 2) == (("data",), ("model",))


class TwoBlocks(nn.Module):
    """An unmodified linen model: its blocks are placed by registered rules."""

    @nn.compact
    def __call__(self, x):
        return Block(name="b1")(Block(name="b0")(x))


def test_registered_stages_shard_as_the_models_rules_say():
    """Stages placed by ``register_task`` rules on mesh slices (no ``task`` in the
    model): flax's rules shard each stage over its own 2x2 devices."""
    model = TwoBlocks()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    params = nn.unbox(model.init(jax.random.key(0), x))

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    with sliced_stages("b", rules=RULES):
        step = mm.mjit(jax.value_and_grad(loss))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    ref_value, ref_grads, ref_flops = jit_reference(loss, params, x)
    _assert_like_jax((value, grads, flops), (ref_value, ref_grads, ref_flops))
    for k in range(2):
        kernel = grads["params"][f"b{k}"]["Dense_0"]["kernel"]
        assert {d.id for d in kernel.devices()} == set(range(4 * k, 4 * k + 4))
        want = ref_grads["params"][f"b{k}"]["Dense_0"]["kernel"].sharding
        assert _spec(kernel.sharding, 2) == _spec(want, 2)


def _explicit_block(w, x):
    x = jax.sharding.reshard(x, P("data", None))
    h = jnp.tanh(jnp.dot(x, w["w1"], out_sharding=P("data", "model")))
    return x + jnp.dot(h, w["w2"], out_sharding=P("data", None))


def test_explicit_mode_stages():
    """jax's explicit sharding mode (``reshard``, ``out_sharding=``) inside mesh-slice
    stages of an explicit global mesh: values and per-device flops as ``jax.jit``'s
    on an explicit 2x2 mesh."""
    _, params = _jax_params()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    explicit = (AxisType.Explicit,) * 3
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"), axis_types=explicit)
    stages = [mm.task(_explicit_block, name=f"s{k}", mesh_slice={"stage": k}) for k in range(2)]
    with jax.set_mesh(mesh):
        step = mm.mjit(jax.value_and_grad(_loss_of(stages)))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    stage = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"),
                              axis_types=explicit[:2])
    with jax.set_mesh(stage):
        ref = jax.jit(jax.value_and_grad(_loss_of([_explicit_block] * 2)))
        ref_value, ref_grads = ref(params, x)
        ref_flops = _flops(ref.lower(params, x).compile())
    _assert_like_jax((value, grads, flops), (ref_value, ref_grads, ref_flops))
    for k in range(2):
        assert {d.id for d in grads[k]["w1"].devices()} == set(range(4 * k, 4 * k + 4))


def _sharded_nnx_mlp(returns_loss: bool):
    """An NNX MLP sharded by its partition metadata, built as flax's guide builds it
    (inside ``nnx.jit``, under the mesh in context); call under ``jax.set_mesh``."""
    return nnx_mlp((None, "model"), ("model", None), constrain_input=True,
                   returns_loss=returns_loss)


def test_nnx_partition_metadata_shards_each_stage():
    """NNX state sharded by its partition metadata, the way flax's guide builds it (inside
    ``nnx.jit`` under ``jax.set_mesh``), with its blocks placed by rules on mesh slices:
    each stage's parameters and gradients keep the metadata's layout on its devices."""
    from flax import nnx

    from multimesh.jax.flax import mjit


    def step(m, x):
        return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)

    x = jax.random.normal(jax.random.key(7), (16, 16))
    with sliced_stages():
        model = _sharded_nnx_mlp(returns_loss=False)
        assert _spec(model.l0.kernel.get_value().sharding, 2) == (None, ("model",))
        loss, grads = mjit(step)(model, x)
        want_loss, want_grads = nnx.jit(step)(model, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for k, spec in ((0, (None, ("model",))), (1, (("model",), None))):
        got = grads[f"l{k}"]["kernel"].get_value()
        want = want_grads[f"l{k}"]["kernel"].get_value()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert {d.id for d in got.devices()} == set(range(4 * k, 4 * k + 4))
        assert _spec(got.sharding, 2) == spec
        assert got.addressable_shards[0].data.size == got.size // 2


def test_a_mesh_axis_name_reused_as_a_logical_name_is_an_error():
    """``("data", "model")`` on a mesh with both axes: ``data`` would mean one axis to
    jax's constraints and another to multimesh's; refused when the task is built into
    a program, naming both."""
    mesh = mm.TaskMesh(devices=range(4), axis_names=("data", "model"), axis_sizes=(2, 2))
    t = mm.task(lambda x: x * 2, name="t", mesh=mesh, logical_axes=(("data", "model"),))
    with pytest.raises(mm.errors.MeshError, match=(
            r"Task 't' maps the logical name 'data' onto the mesh axis 'model', but 'data' is "
            r"also an axis of the task's mesh \('data', 'model'\)")):
        mm.mjit(t)(jnp.ones(8))


def test_shard_map_over_the_kept_axes_inside_a_stage():
    """``jax.shard_map`` over a stage's kept axes (its ``psum`` over ``model``) runs on
    the stage's devices, forward and backward, as plain jax computes it."""
    mesh = _global_mesh()

    def body(w, x):
        def local(w, x):
            return jax.lax.psum(x @ w, "model")
        return jax.shard_map(local, in_specs=(P("model", None), P("data", "model")),
                             out_specs=P("data", None))(w, x)

    stages = [mm.task(body, name=f"s{k}", mesh_slice={"stage": k}) for k in range(2)]
    w = jax.random.normal(jax.random.key(0), (16, 16))
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def loss(w, x):
        return jnp.sum(stages[1](w, stages[0](w, x)) ** 2)

    with jax.set_mesh(mesh):
        value, grad = mm.mjit(jax.value_and_grad(loss))(w, x)
    ref_value, ref_grad = jax.value_and_grad(lambda w, x: jnp.sum(((x @ w) @ w) ** 2))(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-4, atol=1e-4)


def test_parallelize_step_under_a_global_mesh_and_flax_rules():
    """``parallelize_step`` of a linen model whose stages are mesh slices, under a global
    mesh and flax's rules: pipelined and sharded. The loss and the updated parameters
    are plain optax's; each kernel lives on its stage, sharded by the rules."""
    import optax

    from multimesh.jax.flax import parallelize_step
    from tests.models import SlicedBlocks as Net

    x = jax.random.normal(jax.random.key(1), (16, 16))
    with _context("mesh_slice"):
        step, state, _ = parallelize_step(Net(), optax.sgd(0.1), global_batch=x)
        before = jax.tree.leaves(state.params)  # a box is a pytree of its value
        loss, new_state = step(state, x)
        flops = _flops(step)
    with mm.ignore_transforms():
        params = jax.tree.unflatten(jax.tree.structure(nn.unbox(Net().init(jax.random.key(0), x))),
                                    [np.asarray(b) for b in before])
        ref_loss, ref_grads = jax.value_and_grad(Net().apply)(params, x)
        with nn.logical_axis_rules(RULES), jax.set_mesh(_stage_mesh(0)):
            ref_flops = _flops(jax.jit(jax.value_and_grad(Net().apply)).lower(params, x).compile())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    after = jax.tree.leaves(new_state.params)
    for a, p, g in zip(after, jax.tree.leaves(params), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), p - 0.1 * np.asarray(g), rtol=1e-5, atol=1e-6)
    kernels = [v for path, v in jax.tree_util.tree_flatten_with_path(new_state.params)[0]
               if "kernel" in jax.tree_util.keystr(path)]
    assert len(kernels) == 4
    for i, k in enumerate(kernels):
        stage = i // 2
        assert {d.id for d in k.devices()} == set(range(4 * stage, 4 * stage + 4))
        assert _spec(k.sharding, 2) == ((None, ("model",)) if i % 2 == 0 else (("model",), None))
    # the step also updates the parameters; its per-device work is jax.jit's gradient's
    # on a 2x2 mesh, plus the (sharded) update
    assert flops <= 1.15 * ref_flops, (flops, ref_flops)


def test_nnx_parallelize_step_under_a_global_mesh():
    """NNX ``parallelize_step`` of a model sharded by its partition metadata (built as
    flax's guide builds it), its layers placed by rules on mesh slices: the loss and the
    updated parameters are ``nnx.jit``'s, each kernel sharded over its stage's
    ``model`` axis."""
    import optax
    from flax import nnx

    from multimesh.jax.flax import parallelize_step


    plain_step = nnx.jit(nnx_train_step)

    x = jax.random.normal(jax.random.key(1), (16, 16))
    with sliced_stages():
        model = _sharded_nnx_mlp(returns_loss=True)
        ref = nnx.clone(model)
        step, state, _ = parallelize_step(model, optax.sgd(0.1), global_batch=x)
        loss, state = step(state, x)
        ref_loss = plain_step(ref, nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param), x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k, spec in ((0, (None, ("model",))), (1, (("model",), None))):
        got = getattr(model, f"l{k}").kernel.get_value()
        want = getattr(ref, f"l{k}").kernel.get_value()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert {d.id for d in got.devices()} == set(range(4 * k, 4 * k + 4))
        assert _spec(got.sharding, 2) == spec


def test_one_sharding_prefix_broadcast_for_constraints_and_in_shardings():
    """Issue 32: ``with_sharding_constraint``'s ``axis_resources`` and ``mjit``'s
    ``in_shardings`` spread a prefix over the leaves with one helper."""
    from multimesh.jax._stages.inputs import leaf_in_shardings
    from multimesh.jax._task import broadcast_prefix

    tree = {"a": (1, 2), "b": 3, "c": None}
    spec_a, spec_b = P("x"), P(None, "y")
    assert broadcast_prefix(spec_a, tree) == [spec_a] * 3
    assert broadcast_prefix({"a": spec_a, "b": spec_b, "c": None}, tree) == [spec_a, spec_a,
                                                                           spec_b]
    with pytest.raises(ValueError):
        broadcast_prefix({"a": spec_a}, tree)
    args = (tree, 4)
    assert leaf_in_shardings(({"a": spec_a, "b": None, "c": None}, spec_b), args, (), 2) == \
        [spec_a, spec_a, None, spec_b, None, None]
    assert leaf_in_shardings((spec_a,), args, (), 0) == []  # not one entry per argument
    assert leaf_in_shardings(({"a": spec_a}, None), args, (), 0) == []  # not a prefix
