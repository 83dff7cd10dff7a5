"""Inside a task the mesh is the task's mesh, however the task was made (issue 37, item 3).

Stages placed by ``register_task`` on ``TaskMesh``es with the axes ``("data", "model")``
(2 stages x 2x2 devices on 8 CPU devices), with no global mesh and with one: flax's
linen rules, NNX partition metadata and ``jax.lax.with_sharding_constraint`` written
for one 2x2 mesh shard each stage over its own devices, as they do for an explicit
``task(..., mesh=TaskMesh(...))``. Each case checks values and gradients against plain
jax, per-device flops against ``jax.jit`` with the same annotations on a 2x2 mesh, and
where every gradient lives and how it is sharded against that ``jax.jit``. A rule
naming an axis the stage's mesh lacks is an error naming the axis, the task and the
line.
"""

from __future__ import annotations

import contextlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.layouts import flops_of as _flops
from tests.layouts import global_mesh as _global_mesh
from tests.layouts import spec_of as _spec
from tests.layouts import stage_mesh as _stage_mesh
from tests.models import LOGICAL_RULES as RULES
from tests.models import LogicalBlock as Block
from tests.models import jit_reference, nnx_mlp, nnx_sharded, sliced_stages

AUTO2 = (AxisType.Auto,) * 2


class Net(nn.Module):
    """An unmodified linen model: its blocks are placed by a registered rule."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = Block(name=f"layers_{i}")(x)
        return x


def _task_meshes():
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"), axis_sizes=(2, 2))
    return {"layers_0": m0, "layers_1": m0.place((4, 5, 6, 7))}


@contextlib.contextmanager
def _registered(pattern=r"(layers_\d+)"):
    """``layers_<k>`` registered on its TaskMesh by a callback; cleared after."""
    meshes = _task_meshes()
    mm.clear_tasks()
    try:
        mm.register_task(pattern, callback=lambda name, bp: mm.Task(mesh=meshes[name]))
        yield
    finally:
        mm.clear_tasks()


def _reference(loss, args):
    """Plain ``jax.jit`` of the step with the same rules on one stage-shaped 2x2 mesh:
    ``(value, grads, flops)``, and the flops of one device."""
    value, grads, flops = jit_reference(loss, *args)
    one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("data", "model"),
                            axis_types=AUTO2)
    with nn.logical_axis_rules(RULES), jax.set_mesh(one):
        one_device = _flops(jax.jit(jax.value_and_grad(loss)).lower(*args).compile())
    return value, grads, flops, one_device


def _check(got, want, kernels) -> None:
    """Values, gradients and flops against the reference; each stage's kernels on its
    devices, sharded as ``jax.jit`` shards them (``kernels``: (stage, got, want))."""
    (value, grads, flops), (ref_value, ref_grads, ref_flops, one_device) = got, want
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    # Every device of a stage works: per-device flops as jax.jit's on a 2x2 mesh.
    assert flops <= 1.1 * ref_flops, (flops, ref_flops, one_device)
    assert flops <= 0.3 * one_device, (flops, one_device)
    for stage, g, r in kernels:
        assert {d.id for d in g.devices()} == set(range(4 * stage, 4 * stage + 4))
        assert _spec(g.sharding, g.ndim) == _spec(r.sharding, r.ndim), (g.sharding, r.sharding)
        assert _spec(g.sharding, g.ndim) != (None,) * g.ndim  # sharded, not replicated


@pytest.mark.parametrize("global_mesh", [False, True], ids=["no-global-mesh", "global-mesh"])
def test_linen_rules_shard_registered_taskmesh_stages(global_mesh):
    """linen blocks placed by ``register_task(r"(layers_\\d+)", callback=...)`` on
    TaskMeshes, under ``nn.logical_axis_rules``: each stage shards as the rules say."""
    model = Net()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    params = nn.unbox(model.init(jax.random.key(0), x))

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    with contextlib.ExitStack() as stack:
        stack.enter_context(_registered())
        if global_mesh:
            stack.enter_context(jax.set_mesh(_global_mesh()))
        stack.enter_context(nn.logical_axis_rules(RULES))
        step = mm.mjit(jax.value_and_grad(loss))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    want = _reference(loss, (params, x))
    kernels = [(k, grads["params"][f"layers_{k}"][d]["kernel"],
                want[1]["params"][f"layers_{k}"][d]["kernel"])
               for k in range(2) for d in ("Dense_0", "Dense_1")]
    _check((value, grads, flops), want, kernels)


def test_a_task_given_by_the_registration_shards_too():
    """``register_task(..., task=Task(mesh=...))`` (no callback), one rule per stage."""
    model = Net()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    params = nn.unbox(model.init(jax.random.key(0), x))

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    mm.clear_tasks()
    try:
        for name, mesh in _task_meshes().items():
            mm.register_task(name, task=mm.Task(mesh=mesh))
        with nn.logical_axis_rules(RULES):
            step = mm.mjit(jax.value_and_grad(loss))
            value, grads = step(params, x)
            flops = _flops(step.lower(params, x).compile())
    finally:
        mm.clear_tasks()
    want = _reference(loss, (params, x))
    kernels = [(k, grads["params"][f"layers_{k}"]["Dense_0"]["kernel"],
                want[1]["params"][f"layers_{k}"]["Dense_0"]["kernel"]) for k in range(2)]
    _check((value, grads, flops), want, kernels)


def test_jax_constraints_in_registered_named_scopes():
    """Plain jax: ``jax.named_scope`` blocks registered on TaskMeshes, sharded by
    ``jax.lax.with_sharding_constraint`` with ``PartitionSpec``s and no mesh in
    context (``jax.jit``'s reference runs under a 2x2 mesh)."""
    ks = jax.random.split(jax.random.key(0), 4)
    params = [{"w1": 0.3 * jax.random.normal(ks[2 * i], (16, 64)),
               "w2": 0.3 * jax.random.normal(ks[2 * i + 1], (64, 16))} for i in range(2)]
    x = jax.random.normal(jax.random.key(7), (16, 16))

    def loss(ps, x):
        for i, w in enumerate(ps):
            with jax.named_scope(f"layers_{i}"):
                x = jax.lax.with_sharding_constraint(x, P("data", None))
                w1 = jax.lax.with_sharding_constraint(w["w1"], P(None, "model"))
                h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w1), P("data", "model"))
                x = x + h @ w["w2"]
        return jnp.mean(x ** 2)

    with _registered():
        step = mm.mjit(jax.value_and_grad(loss))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    want = _reference(loss, (params, x))
    kernels = [(k, grads[k]["w1"], want[1][k]["w1"]) for k in range(2)]
    _check((value, grads, flops), want, kernels)


def _nnx_model():
    """Two NNX blocks ``layers_0``/``layers_1``, sharded by partition metadata and a
    constraint on their input, built as flax's guide builds them (inside ``nnx.jit``,
    under a 2x2 mesh in context)."""
    from flax import nnx

    class NBlock(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.3)
            self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, (None, "model")),
                                 rngs=rngs)
            self.down = nnx.Linear(64, 16,
                                   kernel_init=nnx.with_partitioning(init, ("model", None)),
                                   rngs=rngs)

        def __call__(self, x):
            x = jax.lax.with_sharding_constraint(x, P("data", None))
            return x + self.down(jnp.tanh(self.up(x)))

    class NNet(nnx.Module):
        def __init__(self, rngs):
            self.layers_0 = NBlock(rngs)
            self.layers_1 = NBlock(rngs)

        def __call__(self, x):
            return jnp.mean(self.layers_1(self.layers_0(x)) ** 2)

    with jax.set_mesh(_stage_mesh(0)):
        return nnx_sharded(NNet)


def test_nnx_metadata_shards_registered_taskmesh_stages():
    """NNX blocks placed by a registered rule on TaskMeshes, no global mesh at the
    call: each stage's kernels and gradients keep the metadata's layout on its own
    devices, and each stage's devices split the work."""
    from flax import nnx

    from multimesh.jax.flax import mjit

    def step(m, x):
        return nnx.value_and_grad(lambda m: m(x))(m)

    model = _nnx_model()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    with _registered():
        loss, grads = mjit(step)(model, x)
        flops = _flops(mjit(step).lower(model, x).compile())
    with jax.set_mesh(_stage_mesh(0)):
        ref = nnx.jit(step)
        ref_loss, ref_grads = ref(model, x)
        ref_flops = _flops(ref.lower(model, x).compile())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)
    for k in range(2):
        for layer, spec in (("up", (None, ("model",))), ("down", (("model",), None))):
            got = grads[f"layers_{k}"][layer]["kernel"].get_value()
            want = ref_grads[f"layers_{k}"][layer]["kernel"].get_value()
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
            assert {d.id for d in got.devices()} == set(range(4 * k, 4 * k + 4))
            assert _spec(got.sharding, 2) == _spec(want.sharding, 2) == spec


def test_a_rule_naming_an_axis_the_stage_lacks_is_an_error():
    """A linen rule mapping ``mlp`` onto ``stage``, in a registered stage whose TaskMesh
    has only ``("data", "model")``: an error naming the axis, the task, the matcher and
    the model's line (the block's, in tests/models.py), not a silently replicated stage."""
    model = Net()
    x = jax.random.normal(jax.random.key(7), (16, 16))
    params = nn.unbox(model.init(jax.random.key(0), x))

    def loss(p, x):
        return jnp.mean(model.apply(p, x) ** 2)

    with _registered(), nn.logical_axis_rules((("batch", "data"), ("mlp", "stage"))):
        with pytest.raises(mm.errors.MeshError, match=(
                r"A sharding inside task 'layers_0' \(matched by register_task\("
                r"'\(layers_\\\\d\+\)'\)\) names the mesh axis 'stage' .*which the task's mesh "
                r"lacks.*\('data', 'model'\).* \(at .*tests/models\.py:\d+\)")):
            mm.mjit(jax.value_and_grad(loss))(params, x)


def test_nnx_metadata_over_the_sliced_axis_warns():
    """NNX metadata ``("stage", None)`` on a kernel of a stage cut by ``mesh_slice``:
    the stage keeps ``("data", "model")``, so the kernel moves onto it without its
    ``stage`` sharding. Not silently: a warning names the axis and the task (once), and
    the values are still plain jax's."""
    from flax import nnx

    from multimesh.jax.flax import mjit

    def step(m, x):
        return nnx.value_and_grad(lambda m: m(x))(m)

    x = jax.random.normal(jax.random.key(7), (16, 16))
    with sliced_stages():
        model = nnx_mlp(("stage", None), ("model", None))
        with pytest.warns(mm.errors.DiagnosticWarning) as record:
            loss, grads = mjit(step)(model, x)
        want_loss, want_grads = nnx.jit(step)(model, x)
    lost = [str(w.message) for w in record if "dropped from its layout" in str(w.message)]
    assert len(lost) == 1, lost
    assert re.search(r"is placed sharded over the mesh axis 'stage' .*which task 'l0' that uses "
                     r"it slices away: inside a task the mesh is the task's mesh, with the axes "
                     r"\['data', 'model'\]", lost[0]), lost[0]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def _explicit_block(w, x):
    x = jax.sharding.reshard(x, P("data", None))
    h = jnp.tanh(x @ w["w1"])
    return x + h @ w["w2"]


def test_explicit_axes_beside_auto_ones_need_no_sliced_axis():
    """A global mesh of axis types (Explicit, Explicit, Auto), stages cut by
    ``mesh_slice={"stage": k}``, a body that only does ``reshard(x, P("data", None))``:
    explicit mode writes "replicated over ``stage``" into each sharding, which names
    nothing the stage could shard over. It runs (it used to be refused as naming the
    sliced axis), with plain jax's values and ``jax.jit``'s per-device flops on the
    stage-shaped mesh."""
    ks = jax.random.split(jax.random.key(0), 4)
    params = [{"w1": 0.3 * jax.random.normal(ks[2 * i], (16, 64)),
               "w2": 0.3 * jax.random.normal(ks[2 * i + 1], (64, 16))} for i in range(2)]
    x = jax.random.normal(jax.random.key(7), (16, 16))
    types = (AxisType.Explicit, AxisType.Explicit, AxisType.Auto)
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"), axis_types=types)
    stages = [mm.task(_explicit_block, name=f"s{k}", mesh_slice={"stage": k}) for k in range(2)]

    def loss_of(blocks):
        return lambda ps, x: jnp.mean(blocks[1](ps[1], blocks[0](ps[0], x)) ** 2)

    with jax.set_mesh(mesh):
        step = mm.mjit(jax.value_and_grad(loss_of(stages)))
        value, grads = step(params, x)
        flops = _flops(step.lower(params, x).compile())
    stage = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"),
                              axis_types=types[1:])
    with jax.set_mesh(stage):
        ref = jax.jit(jax.value_and_grad(loss_of([_explicit_block] * 2)))
        ref_value, ref_grads = ref(params, x)
        ref_flops = _flops(ref.lower(params, x).compile())
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)
    for k in range(2):
        assert {d.id for d in grads[k]["w1"].devices()} == set(range(4 * k, 4 * k + 4))


def test_a_rule_does_not_reach_inside_an_explicit_task():
    """A named scope inside an explicit task's body belongs to that task (mm-match-tasks
    never claims its ops), so a rule matching it does not change the mesh there: the
    body's ``P("data")`` resolves on the explicit task's ``("data", "model")`` mesh, and
    the rule, which places nothing, warns so."""
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"), axis_sizes=(2, 2))

    def body(x):
        with jax.named_scope("inner"):
            return jax.lax.with_sharding_constraint(jnp.sin(x), P("data")) * 2

    t = mm.task(body, name="t", mesh=m0)
    x = jnp.arange(64.0).reshape(8, 8)
    with mm.Context():
        mm.register_task("inner", task=mm.Task(mesh=mm.TaskMesh(
            devices=(4, 5, 6, 7), axis_names=("x",), axis_sizes=(4,))))
        with pytest.warns(mm.errors.MultimeshWarning, match="'inner' claimed no op"):
            out = mm.mjit(t)(x)
    np.testing.assert_allclose(np.asarray(out), np.sin(np.asarray(x)) * 2, rtol=1e-6)
    assert {d.id for d in out.devices()} == {0, 1, 2, 3}
    assert _spec(out.sharding, 2) == (("data",), None)
