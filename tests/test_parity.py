"""MultiMesh parity (issue 11): what MultiMesh programs expect, point by point.

1. the same function wrapped as tasks on two submeshes; 2. Flax module names (in
test_anchor_tutorials.py, E3); 3. physical input shardings; 4. a MultiMesh is a
jax Mesh; 5. mesh_slice under jax's own mesh context; 6. one logical map shared by
submeshes of different shapes; 7. warnings and enable_fast_path. Every program is
checked against plain JAX numbers and against where its arrays live.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import MeshError, MultimeshWarning, PassFailure
from tests.models import named_tanh_layers


@pytest.fixture(autouse=True)
def _no_registrations():
    mm.clear_tasks()
    yield
    mm.clear_tasks()


def ids(x) -> list[int]:
    return sorted(d.id for d in x.devices())


def mesh_of(devs, names=("x",), sizes=None):
    return mm.TaskMesh(devices=devs, axis_names=names, axis_sizes=sizes or (len(devs),))


def stage(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ w)


def weights(n, key=0):
    k = jax.random.key(key)
    ws = [jax.random.normal(jax.random.fold_in(k, i), (16, 16)) / 4 for i in range(n)]
    return ws, jax.random.normal(jax.random.fold_in(k, 99), (8, 16))


def reference(loss, *args):
    with mm.ignore_transforms():
        return jax.value_and_grad(loss)(*args)


def check_two_halves(value, grads, loss, ws, x):
    """Value and gradients equal plain jax's; the first weight's gradient on devices 0-3,
    the second's on 4-7."""
    ref_value, ref_grads = reference(loss, ws, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r, want in zip(grads, ref_grads, ([0, 1, 2, 3], [4, 5, 6, 7])):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        assert ids(g) == want


# --------------------------------------------------------------------------- 1


def test_one_helper_wrapped_per_stage_runs_each_stage_on_its_submesh():
    # `task(stage, mesh=...)` in a loop: every task has the default name "stage".
    stages = [mm.task(stage, mesh=mesh_of(range(2 * i, 2 * i + 2)),
                      logical_axes=(("batch", "x"),)) for i in range(4)]

    def loss(ws, x):
        for s, w in zip(stages, ws):
            x = s(w, x)
        return jnp.mean(x ** 2)

    ws, x = weights(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)  # default names: no warning
        compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    value, grads = compiled(ws, x)
    ref_value, ref_grads = reference(loss, ws, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        assert ids(g) == [2 * i, 2 * i + 1]
    names = ["stage", "stage.1", "stage.2", "stage.3"]
    by_task = {}
    for fr in compiled.fragments:
        by_task.setdefault(fr["task"], set()).add((fr["direction"], tuple(fr["devices"])))
    assert by_task == {n: {("fwd", (2 * i, 2 * i + 1)), ("bwd", (2 * i, 2 * i + 1))}
                       for i, n in enumerate(names)}


def test_an_explicit_name_on_two_submeshes_warns_and_runs_as_two_tasks():
    a = mm.task(lambda w, x: stage(w, x), name="blk", mesh=mesh_of((0, 1, 2, 3)),
                logical_axes=(("batch", "x"),))
    b = mm.task(lambda w, x: stage(w, x), name="blk", mesh=mesh_of((4, 5, 6, 7)),
                logical_axes=(("batch", "x"),))

    def loss(ws, x):
        return jnp.sum(b(ws[1], a(ws[0], x)))

    ws, x = weights(2)
    with pytest.warns(MultimeshWarning, match=r"Task name 'blk' was given 2 different "
                                              r"submeshes .*'blk.1' on device positions "
                                              r"\[4, 5, 6, 7\]"):
        value, grads = mm.mjit(jax.value_and_grad(loss))(ws, x)
    check_two_halves(value, grads, loss, ws, x)


def test_one_name_on_one_submesh_stays_one_task():
    t = mm.task(lambda x: x * 2, name="t", mesh=mesh_of((4, 5)))
    c = mm.mjit(lambda x: t(t(x) + 1)).lower(jnp.ones(8)).compile()
    assert {fr["task"] for fr in c.fragments} == {"t"}
    np.testing.assert_allclose(c(jnp.ones(8)), (jnp.ones(8) * 2 + 1) * 2)


# --------------------------------------------------------------------------- 3


def _model(w, x):
    # `stage` on devices 0-3 as a 4x1 mesh; its mapping knows "batch" but not "d".
    t = mm.task(stage, name="s", mesh=mesh_of((0, 1, 2, 3), ("x", "y"), (4, 1)),
                logical_axes=(("batch", "x"),))
    return jnp.sum(t(w, x))


def test_mjit_keeps_a_physical_in_sharding_on_the_task_devices():
    ws, x = weights(1)
    s = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P("d", None))
    compiled = mm.mjit(_model, in_shardings=(None, s)).lower(ws[0], x).compile()
    (_, x_sh), _ = compiled.input_shardings
    assert x_sh.is_equivalent_to(s, 2) and x_sh.spec == P("d", None)
    assert not compiled.transfers, compiled.plan()  # read in place: P("d") == P("x")
    np.testing.assert_allclose(compiled(ws[0], x), jnp.sum(jnp.tanh(x @ ws[0])), rtol=1e-5)


def test_a_physical_in_sharding_elsewhere_is_kept_and_moved_inside():
    ws, x = weights(1)
    s = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")), P("a", "b"))
    compiled = mm.mjit(_model, in_shardings=(None, s)).lower(ws[0], x).compile()
    assert compiled.input_shardings[0][1].is_equivalent_to(s, 2)
    moves = compiled.transfers
    assert len(moves) == 1 and list(moves[0].layout[0]) == [0, 1, 2, 3]
    xs = jax.device_put(x, s)
    np.testing.assert_allclose(compiled(ws[0], xs), jnp.sum(jnp.tanh(x @ ws[0])), rtol=1e-5)


def test_committed_inputs_keep_their_sharding():
    ws, x = weights(1)
    s = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P("d", None))
    xs = jax.device_put(x, s)
    f = mm.mjit(_model)
    out = f(ws[0], xs)
    np.testing.assert_allclose(out, jnp.sum(jnp.tanh(x @ ws[0])), rtol=1e-5)
    compiled = f.lower(ws[0], xs).compile()
    assert compiled.input_shardings[0][1].is_equivalent_to(s, 2)
    # An uncommitted input goes where its consumer wants it: rows over the task's x.
    free = f.lower(ws[0], x).compile().input_shardings[0][1]
    assert free.spec == P("x", None) and free.mesh.axis_names == ("x", "y")


def test_a_logically_constrained_committed_input_follows_its_constraint():
    ws, x = weights(1)
    t = mm.task(lambda w, x: jnp.tanh(x @ w), name="t", mesh=mesh_of((4, 5, 6, 7)),
                logical_axes=(("batch", "x"),))

    def f(w, x):
        return t(w, mm.with_sharding_constraint(x, P("batch", None)))

    xs = jax.device_put(x, jax.devices()[0])  # committed to device 0
    compiled = mm.mjit(f).lower(ws[0], xs).compile()
    x_sh = compiled.input_shardings[0][1]
    assert sorted(d.id for d in x_sh.device_set) == [4, 5, 6, 7] and x_sh.spec == P("x", None)
    np.testing.assert_allclose(compiled(ws[0], xs), jnp.tanh(x @ ws[0]), rtol=1e-5)


def test_names_a_task_maps_stay_logical():
    ws, x = weights(1)
    # "batch" is a logical name of the task: placed by the task's mapping (x on 0-3).
    s = NamedSharding(Mesh(np.array(jax.devices()).reshape(8, 1), ("batch", "m")),
                      P("batch", None))
    compiled = mm.mjit(_model, in_shardings=(None, s)).lower(ws[0], x).compile()
    x_sh = compiled.input_shardings[0][1]
    assert sorted(d.id for d in x_sh.device_set) == [0, 1, 2, 3]
    assert x_sh.shard_shape(x.shape) == (2, 16)
    np.testing.assert_allclose(compiled(ws[0], x), jnp.sum(jnp.tanh(x @ ws[0])), rtol=1e-5)


def test_a_physical_in_sharding_outside_the_program_is_an_error():
    ws, x = weights(1)
    s = NamedSharding(Mesh(np.array(jax.devices()[4:]), ("d",)), P("d", None))
    with pytest.raises(MeshError, match=r"in_shardings for args\[1\] is .* on devices "
                                        r"\[4, 5, 6, 7\], but the program runs on devices "
                                        r"\[0, 1, 2, 3\]"):
        mm.mjit(_model, devices=jax.devices()[:4], in_shardings=(None, s)).lower(ws[0], x)


# --------------------------------------------------------------------------- 4


def test_a_multimesh_is_a_jax_mesh():
    gm = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "x"))
    multi = mm.MultiMesh(global_mesh=gm)
    assert isinstance(multi, Mesh) and multi == gm and hash(multi) == hash(gm)
    s = NamedSharding(multi, P("stage", "x"))
    assert s == NamedSharding(gm, P("stage", "x"))
    a = jnp.arange(32.0).reshape(4, 8)
    placed = jax.device_put(a, s)
    assert placed.sharding.shard_shape(a.shape) == (2, 2) and ids(placed) == list(range(8))
    out = jax.jit(lambda v: v * 2, out_shardings=s)(placed)
    np.testing.assert_array_equal(out, a * 2)
    doubled = jax.shard_map(lambda v: v * 2, mesh=multi, in_specs=P("stage"),
                            out_specs=P("stage"))(placed)
    np.testing.assert_array_equal(doubled, a * 2)
    with jax.set_mesh(multi):
        assert jax.sharding.get_abstract_mesh().axis_names == ("stage", "x")
    # ... and an mjit physical input sharding on it.
    compiled = mm.mjit(lambda v: v + 1, in_shardings=s).lower(a).compile()
    assert compiled.input_shardings[0][0].is_equivalent_to(s, 2)
    np.testing.assert_array_equal(compiled(placed), a + 1)


# --------------------------------------------------------------------------- 5


def _layered(params, x):
    return jnp.sum(named_tanh_layers(params, x) ** 2)


@pytest.mark.parametrize("how", ["set_mesh", "with_mesh"])
def test_mesh_slice_cuts_jax_current_mesh(how):
    gm = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "x"))

    def callback(name, backprop):
        layer = int(re.search(r"layer(\d)", name).group(1))
        return mm.Task(name=f"layer{layer}_{'bwd' if backprop else 'fwd'}",
                       mesh_slice={"stage": layer})

    mm.register_task(r"layer\d", callback=callback)
    ws, x = weights(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` (jax 0.10)
        with jax.set_mesh(gm) if how == "set_mesh" else gm:
            value, grads = mm.mjit(jax.value_and_grad(_layered))(ws, x)
    check_two_halves(value, grads, _layered, ws, x)


# --------------------------------------------------------------------------- 6


def test_one_logical_map_for_submeshes_of_different_shapes():
    # MaxText-style: one map for all tasks; the first mesh has no "y" axis.
    logical = (("batch", "x"), ("model", "y"))
    first = mm.task(lambda w, x: jnp.tanh(mm.with_sharding_constraint(x, P("batch")) @ w),
                    name="first", mesh=mesh_of((0, 1, 2, 3)), logical_axes=logical)
    second = mm.task(
        lambda w, x: jnp.tanh(x @ mm.with_sharding_constraint(w, P(None, "model"))),
        name="second", mesh=mesh_of((4, 5, 6, 7), ("x", "y"), (2, 2)), logical_axes=logical)

    def loss(ws, x):
        return jnp.sum(second(ws[1], first(ws[0], x)) ** 2)

    ws, x = weights(2)
    value, grads = mm.mjit(jax.value_and_grad(loss))(ws, x)
    ref_value, ref_grads = reference(loss, ws, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    assert ids(grads[0]) == [0, 1, 2, 3] and ids(grads[1]) == [4, 5, 6, 7]
    assert grads[1].sharding.shard_shape((16, 16)) == (16, 8)  # model -> y (size 2)


def test_using_a_name_the_mesh_cannot_map_is_an_error_at_the_constraint():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("model")) * 2, name="t",
                mesh=mesh_of((0, 1, 2, 3)), logical_axes=(("batch", "x"), ("model", "y")))
    with pytest.raises(PassFailure, match=r"Logical axis 'model' is mapped to device axis "
                                          r"'y', which is not an axis of the mesh of task "
                                          r"'t'\. Valid device axis names are: 'x'\."):
        mm.mjit(t)(jnp.ones(8))


# --------------------------------------------------------------------------- 7


def _scoped(x):
    with jax.named_scope("encoderdecoderblock_0"):
        x = jnp.sin(x)
    with jax.named_scope("layer1"):
        x = x * 2
    return x


def test_a_matcher_that_claims_nothing_warns_with_the_name_it_missed():
    mm.register_task(r"EncoderDecoder1DBlock_\d+", task=mm.Task(mesh=mesh_of((0, 1))))
    mm.register_task(r"layer1", task=mm.Task(mesh=mesh_of((2, 3))))
    with pytest.warns(MultimeshWarning) as record:
        out = mm.mjit(_scoped)(jnp.ones(8))
    (w,) = [r for r in record if issubclass(r.category, MultimeshWarning)]
    assert re.search(r"Task matcher 'EncoderDecoder1DBlock_\\\\d\+' claimed no op of this "
                     r"program: no op's name stack contains a match, so it places nothing\. "
                     r"Did you mean 'encoderdecoderblock_0'\?", str(w.message)), w.message
    np.testing.assert_allclose(out, jnp.sin(jnp.ones(8)) * 2, rtol=1e-6)
    assert ids(out) == [2, 3]  # layer1's task still placed its ops


def test_a_shadowed_matcher_warns_an_inner_override_does_not():
    mm.register_task(r"layer\d", task=mm.Task(mesh=mesh_of((0, 1))))
    mm.register_task(r"layer1", task=mm.Task(mesh=mesh_of((2, 3))))
    with pytest.warns(MultimeshWarning, match=r"'layer1' claimed no op .* claimed by a rule "
                                              r"registered before it in the same context"):
        mm.mjit(_scoped)(jnp.ones(8))
    mm.clear_tasks()
    mm.register_task(r"layer1", task=mm.Task(mesh=mesh_of((2, 3))))
    with mm.Context() as ctx, warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        ctx.register_task(r"layer1", task=mm.Task(mesh=mesh_of((4, 5))))
        out = mm.mjit(_scoped)(jnp.ones(8))
    assert ids(out) == [4, 5]


def test_re_registering_a_matcher_replaces_its_rule_with_a_warning():
    mm.register_task("layer1", task=mm.Task(mesh=mesh_of((0, 1))))
    same = mm.Task(mesh=mesh_of((0, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        mm.register_task("layer1", task=same)  # the same rule again: nothing to say
    with pytest.warns(MultimeshWarning, match=r"register_task\('layer1'\): this matcher is "
                                              r"already registered in this context; the new "
                                              r"task replaces the earlier task"):
        mm.register_task("layer1", task=mm.Task(mesh=mesh_of((6, 7))))
    out = mm.mjit(lambda x: _scoped(x) + 0)(jnp.ones(8))
    assert ids(out) == [6, 7]
    np.testing.assert_allclose(out, jnp.sin(jnp.ones(8)) * 2, rtol=1e-6)


def _plain(w, x):
    return jnp.tanh(x @ w).sum(axis=1), x * 3


def test_fast_path_compiles_a_plain_program_with_jax_jit():
    ws, x = weights(1)
    fast = mm.mjit(_plain).lower(ws[0], x).compile()
    with mm.enable_fast_path(False):
        slow = mm.mjit(_plain).lower(ws[0], x).compile()
    assert fast.fast_path and not slow.fast_path
    assert not fast.fragments and "fast path" in fast.plan()
    want = _plain(ws[0], x)
    for got_fast, got_slow, ref in zip(fast(ws[0], x), slow(ws[0], x), want):
        np.testing.assert_allclose(got_fast, ref, rtol=1e-5)
        np.testing.assert_allclose(got_slow, ref, rtol=1e-5)
        assert ids(got_fast) == ids(got_slow) == list(range(8))
        assert got_fast.sharding.is_fully_replicated and got_slow.sharding.is_fully_replicated
    for a, b in zip(jax.tree.leaves(fast.input_shardings), jax.tree.leaves(slow.input_shardings)):
        assert a.is_equivalent_to(b, 2)


def test_fast_path_keeps_pinned_inputs_and_donation():
    ws, x = weights(1)
    s = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b")), P("a", None))
    f = mm.mjit(_plain, in_shardings=(None, s), donate_argnums=1)
    compiled = f.lower(ws[0], x).compile()
    assert compiled.fast_path and compiled.input_shardings[0][1] == s
    xs = jax.device_put(x, s)
    total, tripled = compiled(ws[0], xs)
    np.testing.assert_allclose(total, jnp.tanh(x @ ws[0]).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(tripled, x * 3, rtol=1e-6)
    assert xs.is_deleted()  # donated, as jax.jit does
    assert ids(tripled) == list(range(8))


def test_no_fast_path_with_tasks_constraints_or_matches():
    ws, x = weights(1)
    t = mm.task(lambda x: x * 2, mesh=mesh_of(range(8)))
    assert not mm.mjit(lambda x: t(x)).lower(x).compile().fast_path
    constrained = mm.mjit(lambda x: mm.with_sharding_constraint(x, P("batch")) * 2)
    assert not constrained.lower(x).compile().fast_path
    mm.register_task("layer1", task=mm.Task(mesh=mesh_of((2, 3))))
    assert not mm.mjit(_scoped).lower(x).compile().fast_path
    # A registered matcher that claims nothing leaves a plain program (it warns).
    with pytest.warns(MultimeshWarning):
        assert mm.mjit(_plain).lower(ws[0], x).compile().fast_path
