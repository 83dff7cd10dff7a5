"""Typed shardings survive the backward (issue 37, item 2).

In jax's explicit sharding mode (a mesh of ``AxisType.Explicit`` axes) a weight sharded
``P(None, "model")`` is typed ``float32[16,64@model]``, and ``jax.jit``'s backward types
its gradient the same way (the transpose of a dot types the weight's cotangent like the
weight). Each case runs a step on two stages of an explicit ``(stage, data, model)``
(or ``(stage, fsdp, tp)``) mesh and checks, against ``jax.jit`` (``nnx.jit``) on one
stage's devices (the same mesh minus ``stage``): values and gradients (rtol 1e-5), every
gradient's partition spec, per-device flops (at most 1.1x), and that each gradient
lives on its stage's devices. Before the fix the gradients came back ``P(None, None)``
and the backward did 1.32-1.40x the work.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.layouts import flops_of as _flops
from tests.layouts import spec_of as _spec
from tests.models import nnx_train_step

EXPLICIT = AxisType.Explicit
SPECS = {"w1": P(None, "model"), "w2": P("model", None)}


def _stage_devices(k: int) -> set[int]:
    return set(range(4 * k, 4 * k + 4))


def _key(entry):
    """A key path entry's index or key."""
    return getattr(entry, "idx", getattr(entry, "key", None))


def _meshes(names=("data", "model")):
    """The explicit global mesh ``(stage, *names)`` and one stage's mesh (``names``, on
    devices 0-3): where ``jax.jit`` runs the reference."""
    mesh = jax.make_mesh((2, 2, 2), ("stage", *names), axis_types=(EXPLICIT,) * 3)
    stage = jax.make_mesh((2, 2), names, axis_types=(EXPLICIT,) * 2, devices=jax.devices()[:4])
    return mesh, stage


def _assert_gradients(got, want, stage_of) -> None:
    """``got`` (pytree of gradients) equal to ``want`` (``jax.jit``'s), with the same
    spec, each on the devices of its stage (``stage_of(path)``)."""
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for (path, g), w in zip(got_leaves, want_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        assert _spec(g.sharding, g.ndim) == _spec(w.sharding, w.ndim), \
            (name, g.sharding.spec, w.sharding.spec)
        assert {d.id for d in g.devices()} == _stage_devices(stage_of(path)), name


# --------------------------------------------------------------------------- (a) two layers


def _block(w, x):
    x = jax.sharding.reshard(x, P("data", None))
    h = jnp.tanh(jnp.dot(x, w["w1"], out_sharding=P("data", "model")))
    return x + jnp.dot(h, w["w2"], out_sharding=P("data", None))


def _raw_weights():
    ks = jax.random.split(jax.random.key(0), 4)
    return tuple({"w1": 0.3 * jax.random.normal(ks[2 * i], (16, 64)),
                  "w2": 0.3 * jax.random.normal(ks[2 * i + 1], (64, 16))} for i in range(2))


def _typed(weights):
    """The weights typed ``P(None, "model")``/``P("model", None)`` over the mesh in context."""
    return jax.tree.map(lambda w, s: jax.sharding.reshard(w, s), weights, (SPECS, SPECS))


def _train(loss):
    """A step: the loss, the gradients and the SGD-updated weights."""
    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return value, grads, jax.tree.map(lambda w, g: w - 0.1 * g, ws, grads)
    return step


def _chain(first, second):
    return lambda ws, x: jnp.mean(second(ws[1], first(ws[0], x)) ** 2)


def _named_blocks(ws, x):
    """The two blocks under the name scopes ``b0``/``b1`` (for registered tasks)."""
    with jax.named_scope("b0"):
        y = _block(ws[0], x)
    with jax.named_scope("b1"):
        y = _block(ws[1], y)
    return jnp.mean(y ** 2)


@contextlib.contextmanager
def _placement(kind):
    """The loss of the two blocks placed on the stages as ``kind`` says."""
    mm.clear_tasks()
    try:
        if kind == "mesh_slice":
            yield _chain(*[mm.task(_block, name=f"s{k}", mesh_slice={"stage": k})
                           for k in range(2)])
        elif kind == "TaskMesh":
            m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"),
                             axis_sizes=(2, 2))
            yield _chain(mm.task(_block, name="s0", mesh=m0),
                         mm.task(_block, name="s1", mesh=m0.place((4, 5, 6, 7))))
        elif kind == "registered":
            for k in range(2):
                mm.register_task(f"b{k}", task=mm.Task(mesh_slice={"stage": k}))
            yield _named_blocks
        else:  # "callback"
            mm.register_task(r"(b\d)", callback=lambda name, backprop: mm.Task(
                mesh_slice={"stage": int(name[1])}))
            yield _named_blocks
    finally:
        mm.clear_tasks()


@pytest.mark.parametrize("kind", ["mesh_slice", "TaskMesh", "registered", "callback"])
def test_typed_weights_keep_their_sharding_through_the_backward(kind):
    """Two stages of a block whose weights are typed ``P(None, "model")`` and
    ``P("model", None)``: the gradients and the updated weights come back typed as
    ``jax.jit``'s, on their stage's devices, at ``jax.jit``'s per-device work; a
    second step from the updated weights (typed over a stage's submesh now) stays so."""
    raw, x = _raw_weights(), jax.random.normal(jax.random.key(7), (16, 16))
    mesh, stage_mesh = _meshes()
    with jax.set_mesh(stage_mesh):
        ref = jax.jit(_train(_chain(_block, _block)))
        ws = _typed(raw)
        want = ref(ws, x)
        want2 = ref(want[2], x)
        ref_flops = _flops(ref.lower(ws, x).compile())
    with _placement(kind) as loss, jax.set_mesh(mesh):
        step = mm.mjit(_train(loss))
        ws = _typed(raw)
        got = step(ws, x)
        got2 = step(got[2], x)  # the updated weights, as a training loop feeds them back
        flops = _flops(step.lower(ws, x).compile())
    for (value, grads, new), (ref_value, ref_grads, ref_new) in ((got, want), (got2, want2)):
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        _assert_gradients((grads, new), (ref_grads, ref_new), lambda path: _key(path[1]))
    assert jax.typeof(got[2][1]["w1"]).sharding.spec == P(None, "model")  # typed, as jax's
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)


# --------------------------------------------------------------------------- (b) Gemma-like


def test_gemma_like_fsdp_tp_model_on_registered_stages():
    """A Gemma-like NNX decoder (tests/real_models_explicit.py) with its parameters
    declared as flax's ``ShardingConfig.fsdp_tp_sharding()`` declares them, on an
    explicit ``(stage, fsdp, tp)`` mesh, its two stages placed by rules: every one of
    its 19 gradients has ``nnx.jit``'s spec on the stage's ``(fsdp, tp)`` mesh (all 19
    came back whole before), at ``nnx.jit``'s per-device work (1.32x before)."""
    from flax import nnx

    from multimesh.jax.flax import mjit
    from tests import real_models_explicit as rm

    mesh, stage_mesh = _meshes(("fsdp", "tp"))
    shd = rm.Sharding.fsdp_tp()
    tokens, targets = rm.batch()

    def placed(x):
        return jax.sharding.reshard(x, P("fsdp", None))

    with jax.set_mesh(stage_mesh):
        ref_model = rm.GemmaLike(shd, rngs=nnx.Rngs(0))
        ref = nnx.jit(rm.train_step)
        ref_loss, ref_grads = ref(ref_model, placed(tokens), placed(targets))
        ref_flops = _flops(ref.lower(ref_model, placed(tokens), placed(targets)).compile())
    mm.clear_tasks()
    try:
        for k in range(2):
            mm.register_task(f"stages/{k}", task=mm.Task(mesh_slice={"stage": k}))
        with jax.set_mesh(mesh):
            model = rm.GemmaLike(shd, rngs=nnx.Rngs(0))
            assert jax.typeof(model.stages[0].embedding[...]).sharding.spec == P("tp", "fsdp")
            step = mjit(rm.train_step)
            loss, grads = step(model, placed(tokens), placed(targets))
            flops = _flops(step.lower(model, placed(tokens), placed(targets)).compile())
    finally:
        mm.clear_tasks()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    got, want = nnx.state(grads), nnx.state(ref_grads)
    assert len(jax.tree.leaves(got)) == 19
    _assert_gradients(got, want, lambda path: int(_key(path[1])))  # ['stages'][k]...
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)


# --------------------------------------------------------------------------- (c) NNX eager


def _eager_mlp():
    """An NNX MLP sharded eagerly by its ``with_partitioning`` metadata (created under
    ``jax.set_mesh`` of an explicit mesh, no ``nnx.jit``), written for explicit mode."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.3)
            self.l0 = nnx.Linear(16, 64, use_bias=False, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, SPECS["w1"]))
            self.l1 = nnx.Linear(64, 16, use_bias=False, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, SPECS["w2"]))

        def __call__(self, x):
            x = jax.sharding.reshard(x, P("data", None))
            h = jnp.tanh(self.l0(x, out_sharding=P("data", "model")))
            return jnp.mean((x + self.l1(h, out_sharding=P("data", None))) ** 2)

    return MLP(nnx.Rngs(0))


@contextlib.contextmanager
def _nnx_layers_as_stages(mesh):
    mm.clear_tasks()
    try:
        for k in range(2):
            mm.register_task(f"l{k}", task=mm.Task(mesh_slice={"stage": k}))
        with jax.set_mesh(mesh):
            yield
    finally:
        mm.clear_tasks()


def test_nnx_eager_sharding_through_flax_mjit():
    """NNX's eager sharding on an explicit mesh, the layers placed by rules, through
    multimesh's flax ``mjit``: gradients typed and laid out as ``nnx.jit``'s."""
    from flax import nnx

    from multimesh.jax.flax import mjit

    def step(m, x):
        return nnx.value_and_grad(lambda m: m(x))(m)

    x = jax.random.normal(jax.random.key(7), (16, 16))
    mesh, stage_mesh = _meshes()
    with jax.set_mesh(stage_mesh):
        ref_model = _eager_mlp()
        ref = nnx.jit(step)
        ref_loss, ref_grads = ref(ref_model, x)
        ref_flops = _flops(ref.lower(ref_model, x).compile())
    with _nnx_layers_as_stages(mesh):
        model = _eager_mlp()
        assert jax.typeof(model.l0.kernel[...]).sharding.spec == SPECS["w1"]
        loss, grads = mjit(step)(model, x)
        flops = _flops(mjit(step).lower(model, x).compile())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    _assert_gradients(nnx.state(grads), nnx.state(ref_grads), lambda path: int(_key(path[0])[1]))
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)


def test_nnx_eager_sharding_through_parallelize_step():
    """The same model through the NNX ``parallelize_step`` (SGD): the loss and the
    updated kernels are ``nnx.jit``'s, each kept typed in its layout on its stage."""
    import optax
    from flax import nnx

    from multimesh.jax.flax import parallelize_step

    plain_step = nnx.jit(nnx_train_step)

    x = jax.random.normal(jax.random.key(7), (16, 16))
    mesh, stage_mesh = _meshes()
    with jax.set_mesh(stage_mesh):
        ref = _eager_mlp()
        ref_loss = plain_step(ref, nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param), x)
    with _nnx_layers_as_stages(mesh):
        model = _eager_mlp()
        step, state, _ = parallelize_step(model, optax.sgd(0.1), global_batch=x)
        loss, state = step(state, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for k in range(2):
        got = getattr(model, f"l{k}").kernel.get_value()
        want = getattr(ref, f"l{k}").kernel.get_value()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        assert _spec(got.sharding, 2) == _spec(want.sharding, 2)
        assert jax.typeof(got).sharding.spec == jax.typeof(want).sharding.spec
        assert {d.id for d in got.devices()} == _stage_devices(k)


def test_microbatched_typed_stages_keep_the_gradients_layout():
    """Under ``microbatch`` (1F1B, four microbatches) the summed gradients of typed
    weights come back typed and laid out as ``jax.jit``'s whole-batch gradients, on
    their stage's devices."""
    raw, x = _raw_weights(), jax.random.normal(jax.random.key(7), (32, 16))
    mesh, stage_mesh = _meshes()
    with jax.set_mesh(stage_mesh):
        ref_value, ref_grads = jax.jit(jax.value_and_grad(_chain(_block, _block)))(
            _typed(raw), x)
    with _placement("mesh_slice") as loss, jax.set_mesh(mesh):
        step = mm.mjit(mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                                     schedule="1f1b", reduction="mean"))
        value, grads = step(_typed(raw), x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    _assert_gradients(grads, ref_grads, lambda path: _key(path[0]))
