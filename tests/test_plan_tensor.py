"""Tensor parallelism in ``plan_pipeline`` on the 8 CPU devices (issue 38 item 1).

A model whose shardings name a ``model`` axis (here flax's logical rules: ``mlp`` onto
``model``) gets stages whose submeshes are ``(data, model)``; the planner weighs each
``model`` size against data, fsdp and pipeline parallelism, from the units compiled on
a ``model`` axis of that size and their collectives priced by the device model. The
planned step is checked against ``jax.jit`` of the same model under the same rules on a
stage-shaped mesh: values and gradients (f32, rtol 1e-5), the gradients' devices and
partition specs, and each stage's per-device flops against the plan's prediction.
A model that names no ``model`` axis plans as before; misused ``logical_axes``,
``tensor`` and edited plan files are clear errors.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import multimesh.jax as mm
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from tests.layouts import spec_of
from tests.layouts import work_per_device as _work
from tests.models import nnx_sharded

RULES = (("batch", "data"), ("mlp", "model"), ("embed", None))
ROWS, WIDTH, HIDDEN = 8, 16, 512
# big weights, a small batch: tensor parallelism pays (its collectives each pay a
# latency, so the weights must outweigh them: at 16 x 512 the gradients' one
# all-reduce is predicted cheaper)
WIDE = (64, 2048)


class Block(nn.Module):
    """An MLP block sharded the flax way: its hidden dimension ``mlp``."""

    annotate: bool = True
    width: int = WIDTH
    hidden: int = HIDDEN

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.normal(0.1)

        def boxed(f, names):
            return nn.with_logical_partitioning(f, names) if self.annotate else f

        x = nn.with_logical_constraint(x, ("batch", "embed"))
        h = nn.Dense(self.hidden, kernel_init=boxed(init, ("embed", "mlp")),
                     bias_init=boxed(nn.initializers.zeros, ("mlp",)))(x)
        h = jnp.tanh(h)
        if self.annotate:
            h = nn.with_logical_constraint(h, ("batch", "mlp"))
        return x + nn.Dense(self.width, kernel_init=boxed(init, ("mlp", "embed")))(h)


class Net(nn.Module):
    annotate: bool = True
    width: int = WIDTH
    hidden: int = HIDDEN

    @nn.compact
    def __call__(self, x):
        for k in range(4):
            x = Block(self.annotate, width=self.width, hidden=self.hidden, name=f"b{k}")(x)
        return x


def _model(annotate=True, width=WIDTH, hidden=HIDDEN):
    net = Net(annotate, width=width, hidden=hidden)
    x = jax.random.normal(jax.random.key(1), (ROWS, width))
    params = nn.unbox(net.init(jax.random.key(0), x))

    def loss(p, x):
        return jnp.mean(net.apply(p, x) ** 2)

    return loss, params, x


@pytest.fixture(scope="module")
def tp():
    return _model()


@pytest.fixture(scope="module")
def wide():
    return _model(width=WIDE[0], hidden=WIDE[1])


@pytest.fixture(scope="module")
def plain():
    return _model(annotate=False)


def _stage_mesh(plan):
    d, t = len(plan.stages[0].devices), plan.tensor or 1
    grid = np.asarray(jax.devices()[:d]).reshape(d // t, t)
    return jax.sharding.Mesh(grid, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _run_and_check(plan, loss, params, x):
    """The planned step against jax.jit on a stage-shaped mesh under the same rules:
    values, gradients, their devices and partition specs; per-device flops of each
    stage within 10% of the plan's. Returns (predicted, measured) flops per stage."""
    with nn.logical_axis_rules(RULES):
        with plan:
            step = mm.mjit(plan.microbatch(jax.value_and_grad(loss)))
            compiled = step.lower(params, x).compile()
            value, grads = compiled(params, x)
        with jax.set_mesh(_stage_mesh(plan)):
            want_value, want_grads = jax.jit(jax.value_and_grad(loss))(params, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    work = _work(compiled)
    for k, st in enumerate(plan.stages):
        for u in st.units:
            for g, w in zip(jax.tree.leaves(grads["params"][u]),
                            jax.tree.leaves(want_grads["params"][u]), strict=True):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
                assert {d.id for d in g.devices()} == set(st.devices)
                assert spec_of(g.sharding, g.ndim) == spec_of(w.sharding, w.ndim), (u, g.sharding)
        got = work[st.positions[0]]
        assert abs(st.device_flops - got) <= 0.1 * got, (k, st.device_flops, got)
    return [(st.device_flops, work[st.positions[0]]) for st in plan.stages], grads


def test_a_model_axis_where_predicted_faster(wide):
    """Wide weights and 8 rows: data parallelism all-reduces the weights' gradients,
    tensor parallelism only the rows' activations; the planner puts the hidden
    dimension on a ``model`` axis, and the plan runs exact, in jax.jit's layout."""
    loss, params, x = wide
    with nn.logical_axis_rules(RULES):
        plan = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1)
        data_only = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1,
                                     tensor=1, fsdp=False)
    assert plan.tensor in (2, 4), plan.layout()
    assert plan.predicted_step_time < data_only.predicted_step_time
    assert data_only.tensor == 1 and data_only.layout() == "data=4,model=1"
    text = str(plan)
    assert f"model={plan.tensor}" in text and "tensor parallelism:" in text
    names = {t.mesh.axis_names for _, t in plan._rules()}
    assert names == {("data", "model")}
    assert f"axis_sizes={(4 // plan.tensor, plan.tensor)!r}" in plan.as_code()
    flops, grads = _run_and_check(plan, loss, params, x)
    kernel = grads["params"]["b0"]["Dense_0"]["kernel"]
    assert spec_of(kernel.sharding, 2) == (None, ("model",))  # the hidden dim, split
    assert kernel.addressable_shards[0].data.shape == (WIDE[0], WIDE[1] // plan.tensor)


def test_a_memory_limit_only_tensor_parallelism_meets(tp):
    """Replicated parameters (no fsdp) do not fit a quarter of their bytes per device on
    any stage count; split over a ``model`` axis of 4 they do."""
    loss, params, x = tp
    total = sum(a.nbytes for a in jax.tree.leaves(params))
    limit = 0.6 * total
    with nn.logical_axis_rules(RULES):
        with pytest.raises(MultimeshValueError, match="found no plan within memory_limit"):
            mm.plan_pipeline(loss, params, x, memory_limit=limit, fsdp=False, tensor=1,
                             num_stages=2)
        plan = mm.plan_pipeline(loss, params, x, memory_limit=limit, fsdp=False,
                                num_stages=2)
    assert plan.tensor in (2, 4) and max(st.memory_bytes for st in plan.stages) <= limit
    _run_and_check(plan, loss, params, x)


def test_one_stage_over_every_device(tp):
    """One stage of 8 devices, a ``model`` axis of the asked size beside ``data``: the
    rows split over ``data`` and the hidden dimension over ``model``."""
    loss, params, x = tp
    with nn.logical_axis_rules(RULES):
        plan = mm.plan_pipeline(loss, params, x, num_stages=1, num_microbatches=2, tensor=2)
    assert plan.layout() == "data=4,model=2" and plan.stages[0].devices == tuple(range(8))
    flops, _ = _run_and_check(plan, loss, params, x)
    print("predicted/measured per-device flops:", flops)


def test_a_model_without_model_annotations_plans_as_before(plain):
    loss, params, x = plain
    with nn.logical_axis_rules(RULES):
        plan = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1)
    assert plan.tensor is None and "tensor parallelism" not in plan.assumptions
    assert plan.layout() in ("data=4", "data=4+fsdp")
    assert {t.mesh.axis_names for _, t in plan._rules()} == {("data",)}
    assert json.loads(plan.to_json())["tensor"] is None
    with pytest.raises(MultimeshValueError, match="no sharding in the step names the mesh "
                                                  "axis 'model'"):
        mm.plan_pipeline(loss, params, x, num_stages=2, tensor=2)


def test_a_logical_axis_onto_model_needs_stages_with_one(plain, tp):
    loss, params, x = plain
    with pytest.raises(MultimeshValueError, match=(
            r"^`plan_pipeline`: logical_axes maps 'mlp' onto the mesh axis 'model', but "
            r"each stage's submesh has only the axes \('data',\); stages get a 'model' "
            r"axis only where the model's own shardings name it")):
        mm.plan_pipeline(loss, params, x, logical_axes=(("mlp", "model"),))
    # the same edit in a plan's JSON
    plan = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1)
    saved = json.loads(plan.to_json())
    saved["logical_axes"] = [["mlp", "model"]]
    with pytest.raises(MultimeshValueError, match=(
            r"logical_axes maps 'mlp' onto the mesh axis 'model', but the plan's stages "
            r"have only the axes \('data',\)")):
        mm.PipelinePlan.from_json(json.dumps(saved))
    # on a tensor-parallel plan the pair is valid
    loss, params, x = tp
    with nn.logical_axis_rules(RULES):
        ok = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1, tensor=2,
                              logical_axes=(("mlp", "model"),))
    assert ("mlp", "model") in ok._logical()


def test_plan_files_with_a_model_axis(tp):
    loss, params, x = tp
    with nn.logical_axis_rules(RULES):
        plan = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1, tensor=2)
    again = mm.PipelinePlan.from_json(plan.to_json())
    assert again == plan and again.tensor == 2
    saved = json.loads(plan.to_json())
    saved["stages"][0]["devices"] = [0, 1, 2]
    saved["stages"][0]["positions"] = [0, 1, 2]
    saved["stages"][1]["devices"] = [3, 4, 5, 6, 7]
    saved["stages"][1]["positions"] = [3, 4, 5, 6, 7]
    with pytest.raises(MultimeshValueError, match=(
            r"`PipelinePlan.from_json`: the stages have 3 and 5 devices; every stage of a plan "
            r"has the "
            r"same number")):
        mm.PipelinePlan.from_json(json.dumps(saved))
    saved = json.loads(plan.to_json())
    saved["tensor"] = 3
    with pytest.raises(MultimeshValueError, match=r"`tensor` must be null \(no `model` "
                                                  r"axis\) or a divisor of the 4 devices"):
        mm.PipelinePlan.from_json(json.dumps(saved))
    saved = json.loads(plan.to_json())
    del saved["tensor"]  # a plan written before tensor parallelism
    assert mm.PipelinePlan.from_json(json.dumps(saved)).tensor is None


@pytest.mark.parametrize("tensor, exc, match", [
    (3, MultimeshValueError, r"`plan_pipeline`: tensor=3 does not divide the 4 devices of a "
                             r"stage \(8 devices in all\); choose one of \[1, 2, 4\]"),
    ("2", MultimeshTypeError, r"`tensor` must be the size of each stage's `model` axis"),
])
def test_tensor_misuse(tp, tensor, exc, match):
    loss, params, x = tp
    with pytest.raises(exc, match=match):
        mm.plan_pipeline(loss, params, x, num_stages=2, tensor=tensor)


def test_nnx_partition_metadata_plans_a_model_axis():
    """NNX parameters sharded by their metadata (built as flax's guide builds them,
    under a mesh with a ``model`` axis): the planner costs the units with them placed
    so, chooses a ``model`` axis, and the step's gradients come back in ``nnx.jit``'s
    layout on each stage's devices, its per-device flops as predicted."""
    from flax import nnx

    from multimesh.jax.flax import mjit

    init = nnx.initializers.normal(0.1)

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.l0 = nnx.Linear(*WIDE, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, (None, "model")))
            self.l1 = nnx.Linear(*WIDE[::-1], rngs=rngs,
                                 kernel_init=nnx.with_partitioning(init, ("model", None)))

        def __call__(self, x):
            return x + self.l1(jnp.tanh(self.l0(x)))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Mlp(rngs) for _ in range(4)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return jnp.mean(x ** 2)

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4), ("data", "model"),
                             axis_types=(AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = nnx_sharded(Stack)
    x = jax.random.normal(jax.random.key(1), (ROWS, WIDE[0]))

    def loss(m, x):
        return m(x)

    def step(m, x):
        return nnx.value_and_grad(loss)(m, x)

    plan = mm.plan_pipeline(loss, model, x, num_stages=2, num_microbatches=1)
    assert plan.tensor == 4 and plan.layout() == "model=4"
    with plan:
        value, grads = mjit(step)(model, x)
    with jax.set_mesh(mesh):
        want_value, want_grads = nnx.jit(step)(model, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for k in range(4):
        st = plan.stages[k // 2]
        for name in ("l0", "l1"):
            got = grads["blocks"][k][name]["kernel"].get_value()
            want = want_grads["blocks"][k][name]["kernel"].get_value()
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
            assert {d.id for d in got.devices()} == set(st.devices)
            assert spec_of(got.sharding, 2) == spec_of(want.sharding, 2)
            assert got.addressable_shards[0].data.size == got.size // 4


def test_the_model_axis_stays_inside_a_node_unless_asked(tp):
    """Nodes of 2 devices joined by a slow network: ``model`` groups of 4 would cross
    it, so only 1 and 2 are weighed; ``tensor=4`` asks for it anyway."""
    import dataclasses

    loss, params, x = tp
    nodes = dataclasses.replace(mm.DeviceModel.for_device(jax.devices()[0]),
                                devices_per_node=2, network_bandwidth=1e8)
    with nn.logical_axis_rules(RULES):
        plan = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1,
                                device_model=nodes)
        asked = mm.plan_pipeline(loss, params, x, num_stages=2, num_microbatches=1,
                                 device_model=nodes, tensor=4)
    assert plan.tensor in (1, 2) and "of size 1 or 2 weighed" in plan.assumptions[
        "tensor parallelism"]
    assert asked.tensor == 4
