"""Nothing silent: tasks traced outside ``mjit``, logical names that no task maps, and
jax's ``with_sharding_constraint`` with logical names inside a task (issue 20, item 5).

Every program that runs is checked against plain jax (values, and gradients where
there are any) and where its arrays live; every warning by class and message, and by
how often it comes (once per task function or program, not once per call).
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import (
    DiagnosticWarning,
    MeshError,
    MultimeshValueError,
    MultimeshWarning,
)


def _mesh(first: int) -> mm.TaskMesh:
    return mm.TaskMesh(devices=range(first, first + 4), axis_names=("x",), axis_sizes=(4,))


def _stage(w, x):
    return jnp.tanh(x @ w)


def _plain_loss(ws, x):
    return (_stage(ws[1], _stage(ws[0], x)) ** 2).sum()


def _two_stage_loss():
    """A fresh two-task loss (fresh task functions: each warns once of its own)."""
    s0 = mm.task(_stage, name="s0", mesh=_mesh(0))
    s1 = mm.task(_stage, name="s1", mesh=_mesh(4))

    def loss(ws, x):
        return (s1(ws[1], s0(ws[0], x)) ** 2).sum()

    return loss


def _args():
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (8, 8)) / 3 for i in range(2)]
    return ws, jax.random.normal(key, (16, 8))


def _ids(a) -> set[int]:
    return {d.id for d in a.devices()}


def _outside(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, MultimeshWarning)
            and "traced outside `multimesh.jax.mjit`" in str(w.message)]


# --------------------------------------------------------------------------- outside mjit


def test_eager_tasks_warn_once_per_task_and_keep_values():
    loss = _two_stage_loss()
    ws, x = _args()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [loss(ws, x) for _ in range(3)]
    msgs = _outside(caught)
    assert len(msgs) == 2, msgs  # one per task function, not one per call
    assert "Task 's0'" in msgs[0] and "device positions [0, 1, 2, 3]" in msgs[0]
    assert "Task 's1'" in msgs[1] and "device positions [4, 5, 6, 7]" in msgs[1]
    want = _plain_loss(ws, x)
    for out in outs:
        np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6)
        assert _ids(out) == {jax.devices()[0].id}  # a plain call on jax's default device
    assert caught[0].filename == __file__  # points at the caller's line


def test_jax_jit_of_tasks_warns_once_and_keeps_values_and_gradients():
    loss = _two_stage_loss()
    ws, x = _args()
    step = jax.jit(jax.value_and_grad(loss))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [step(ws, x) for _ in range(3)]
    msgs = _outside(caught)
    assert len(msgs) == 2, msgs  # traced once by jax.jit: s0 and s1
    assert re.match(r"Task 's0' is traced outside `multimesh\.jax\.mjit` \(called eagerly, or "
                    r"under jax\.jit or another jax transformation that runs it\), so its "
                    r"placement is ignored: .*"
                    r"The values are the same\. To place it, compile the program with "
                    r"`multimesh\.jax\.mjit` \(or `parallelize`\); to run plain jax on "
                    r"purpose, call it under `multimesh\.jax\.ignore_transforms\(\)`\.",
                    msgs[0]), msgs[0]
    want_v, want_g = jax.value_and_grad(_plain_loss)(ws, x)
    for v, g in results:
        np.testing.assert_allclose(np.asarray(v), np.asarray(want_v), rtol=1e-5)
        for a, b in zip(g, want_g):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
            assert _ids(a) == {jax.devices()[0].id}


def test_eval_shape_of_tasks_is_quiet_and_a_later_jit_warns():
    """Nothing runs under ``jax.eval_shape``, so nothing is misplaced: no warning. A
    later ``jax.jit`` of the same tasks runs them unplaced and warns, and so does
    each other program that runs them (issue 31)."""
    loss = _two_stage_loss()
    ws, x = _args()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.eval_shape(loss, ws, x)
    assert _outside(caught) == []
    assert (out.shape, out.dtype) == ((), jnp.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = jax.jit(loss)(ws, x)
        jax.jit(loss)(ws, x * 2)  # the same program, retraced: said already
    assert [m[:30] for m in _outside(caught)] == ["Task 's0' is traced outside `m",
                                                  "Task 's1' is traced outside `m"]
    assert {w.filename for w in caught} == {__file__}  # the line that runs it
    np.testing.assert_allclose(np.asarray(value), np.asarray(_plain_loss(ws, x)), rtol=1e-6)

    def other(ws, x):
        return loss(ws, x) * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(other)(ws, x)
    assert len(_outside(caught)) == 2  # another program that runs them unplaced


def test_jit_traced_inside_mjit_then_run_outside_warns():
    """jax.jit keeps the jaxpr it traced inside ``mjit``; run outside, the task is not
    bound again, so the lowering rule is what notices (once per process per task)."""
    t = mm.task(lambda x: jnp.sin(x) * 2, name="cached_in_jit", mesh=_mesh(4))
    inner = jax.jit(lambda x: t(x) + 1)
    x = jnp.arange(8.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        placed = mm.mjit(lambda x: inner(x) * 3)(x)
        assert not _outside(caught)
        plain = [inner(x) for _ in range(3)]
    msgs = _outside(caught)
    assert len(msgs) == 1 and msgs[0].startswith("Task 'cached_in_jit' is traced outside")
    np.testing.assert_allclose(np.asarray(placed), np.asarray((jnp.sin(x) * 2 + 1) * 3),
                               rtol=1e-6)
    assert _ids(placed) == {4, 5, 6, 7}
    for out in plain:
        np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.sin(x) * 2 + 1), rtol=1e-6)
        assert _ids(out) == {jax.devices()[0].id}


def test_cached_jit_jaxpr_under_ignore_transforms_is_quiet():
    """The same cache hit under ``ignore_transforms`` (a plain-jax reference run) is
    plain jax on purpose: no warning."""
    t = mm.task(lambda x: jnp.sin(x) * 2, name="cached_quiet", mesh=_mesh(4))
    inner = jax.jit(lambda x: t(x) + 1)
    x = jnp.arange(8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        placed = mm.mjit(lambda x: inner(x) * 3)(x)
        with mm.ignore_transforms():
            ref = jax.jit(lambda x: inner(x) * 3)(x)
    np.testing.assert_allclose(np.asarray(placed), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(ref), np.asarray((jnp.sin(x) * 2 + 1) * 3),
                               rtol=1e-6)


def test_mjit_and_ignore_transforms_do_not_warn():
    ws, x = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        loss = _two_stage_loss()
        v, g = mm.mjit(jax.value_and_grad(loss))(ws, x)
        with mm.ignore_transforms():
            v_plain = loss(ws, x)
    want_v, want_g = jax.value_and_grad(_plain_loss)(ws, x)
    np.testing.assert_allclose(np.asarray(v), np.asarray(want_v), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(v_plain), np.asarray(want_v), rtol=1e-6)
    for i, (a, b) in enumerate(zip(g, want_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        assert _ids(a) == set(range(4 * i, 4 * i + 4))  # each gradient on its stage


def test_parallelize_traces_and_calls_its_init_quietly():
    """``parallelize`` runs ``init_params`` itself (shapes, then values it places): a task
    inside it is multimesh's own business, so nothing warns."""
    scale = mm.task(lambda a: a * 2.0, name="scale", mesh=_mesh(4))
    loss = _two_stage_loss()

    def init_params():
        return [scale(jnp.eye(8)), jnp.eye(8)]

    def get_batch():
        return jnp.arange(128.0).reshape(16, 8) / 128

    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        fn, init, batch = mm.parallelize(loss, init_params=init_params,
                                         get_input_batch=get_batch)
        params, b = init(), batch()
        out = fn(params, b)
    np.testing.assert_allclose(np.asarray(params[0]), 2 * np.eye(8))
    assert _ids(params[0]) == set(range(4))  # placed for s0, its consumer
    np.testing.assert_allclose(np.asarray(out), np.asarray(
        _plain_loss([2 * jnp.eye(8), jnp.eye(8)], get_batch())), rtol=1e-5)


def test_flax_init_is_quiet_and_flax_apply_outside_mjit_warns():
    nn = pytest.importorskip("flax.linen")
    from multimesh.jax.flax import task as flax_task

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(8)(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = flax_task(Block, name="b0", mesh=_mesh(0))()(x)
            return flax_task(Block, name="b1", mesh=_mesh(4))()(x).sum()

    x = jnp.ones((16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        variables = Model().init(jax.random.key(0), x)
        shapes = jax.eval_shape(Model().init, jax.random.key(0), x)
        got = mm.mjit(Model().apply)(variables, x)
    assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eager = Model().apply(variables, x)
    assert [m[:9] for m in _outside(caught)] == ["Task 'b0'", "Task 'b1'"]
    assert {w.filename for w in caught} == {__file__}  # the model's line, not flax's
    with mm.ignore_transforms():
        want = Model().apply(variables, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(want), rtol=1e-6)


# --------------------------------------------------------------------------- logical names


def _constrained_program(spec, logical_axes):
    """``x -> sin(x) * 2 + 1`` in one task on positions 0-3 that constrains ``x`` to
    ``spec`` (logical names), compiled by ``mjit``."""
    t = mm.task(lambda x: jnp.sin(mm.with_sharding_constraint(x, spec)) * 2,
                name="t", mesh=_mesh(0), logical_axes=logical_axes)
    return mm.mjit(lambda x: t(x) + 1)


def _run_replicated(prog):
    """Run ``prog`` three times; its result equals plain jax and is replicated on the
    task's devices (the constraint named nothing that a task maps)."""
    x = jnp.arange(16.0)
    for _ in range(3):
        out = prog(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.sin(x) * 2 + 1), rtol=1e-6)
    assert _ids(out) == {0, 1, 2, 3}
    assert all(s.data.shape == (16,) for s in out.addressable_shards)  # not sharded


@pytest.mark.parametrize("spec,logical_axes,match", [
    (P("btach"), (("batch", "x"),),
     r"logical axis name 'btach' is mapped by no task of the program, so it leaves its "
     r"dimension unsharded in task 't'; did you mean 'batch'\? \(the logical names the "
     r"tasks map: 'batch'\) \(at .*test_never_silent\.py:\d+:\d+\)"),
    (P("x"), (("batch", "x"),),
     r"logical axis name 'x' .*; 'x' is a mesh axis of task 't', not a logical name: use "
     r"a logical name that task 't' maps onto it \('batch'\)"),
    (P("batch"), (("x", "batch"),),
     r"logical axis name 'batch' .*; task 't' has the pair \('x', 'batch'\), which maps "
     r"its mesh axis 'x' as a logical name onto 'batch', not an axis of its mesh: the "
     r"pair looks swapped, write \('batch', 'x'\) in its logical_axes"),
])
def test_logical_name_no_task_maps_warns_once_per_program(spec, logical_axes, match):
    prog = _constrained_program(spec, logical_axes)
    with pytest.warns(DiagnosticWarning, match=match) as caught:
        _run_replicated(prog)
    assert len([w for w in caught if w.category is DiagnosticWarning]) == 1


def test_right_logical_name_shards_and_does_not_warn():
    prog = _constrained_program(P("batch"), (("batch", "x"),))
    x = jnp.arange(16.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        out = prog(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jnp.sin(x) * 2 + 1), rtol=1e-6)
    assert sorted((s.device.id, s.index[0].start) for s in out.addressable_shards) == [
        (0, 0), (1, 4), (2, 8), (3, 12)]


@pytest.mark.parametrize("spec,logical_axes", [
    (P("seq"), (("batch", "x"),)),  # resembles no mapped name: replicated on purpose
    (P("batch"), None),  # no mapping at all (identity over x): "batch" means replicated
])
def test_deliberately_unmapped_names_are_quiet(spec, logical_axes):
    prog = _constrained_program(spec, logical_axes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultimeshWarning)
        _run_replicated(prog)


# --------------------------------------------------------------------------- jax's constraint


def test_jax_with_sharding_constraint_in_a_task_points_to_multimesh():
    """Inside a task the mesh is the task's mesh: a logical name given to jax's own
    constraint is an axis that mesh lacks, and the error says to use multimesh's."""
    t = mm.task(lambda x: jax.lax.with_sharding_constraint(x, P("batch")) * 2, name="t",
                mesh=_mesh(0), logical_axes=(("batch", "x"),))
    with pytest.raises(MeshError, match=(
            r"A sharding inside task 't' names the mesh axis 'batch' .*which the task's mesh "
            r"lacks: inside a task the mesh is the task's mesh, with the axes \('x',\).*"
            r"'batch' is a logical name that the task maps \('batch' -> 'x'\): name it with "
            r"`multimesh\.jax\.with_sharding_constraint\(x, spec\)`")):
        mm.mjit(lambda x: t(x))(jnp.ones(8))


def test_jax_with_sharding_constraint_in_a_task_uses_the_tasks_mesh():
    """``jax.lax.with_sharding_constraint(x, P("x"))`` inside a task shards over the
    task's own axis ``x`` on its devices, as ``jax.jit`` on that mesh would."""
    t = mm.task(lambda x: jax.lax.with_sharding_constraint(x * 2, P("x")), name="t",
                mesh=_mesh(4))
    x = jnp.arange(8.0)
    out = mm.mjit(lambda x: t(x) + 1)(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x * 2 + 1))
    assert sorted((s.device.id, s.index[0].start) for s in out.addressable_shards) == [
        (4, 0), (5, 2), (6, 4), (7, 6)]


def test_jax_with_sharding_constraint_outside_tasks_points_to_multimesh():
    with pytest.raises(MultimeshValueError, match=(
            r"with a `PartitionSpec` in an `mjit` program needs a jax mesh in context.*"
            r"multimesh\.jax\.with_sharding_constraint")):
        mm.mjit(lambda x: jax.lax.with_sharding_constraint(x, P("batch")))(jnp.ones(8))


def test_the_fix_runs_and_places():
    """What the error asks for: multimesh's constraint, values and layout checked."""
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")) * 2, name="t",
                mesh=_mesh(4), logical_axes=(("batch", "x"),))
    x = jnp.arange(8.0)
    out = mm.mjit(lambda x: t(x))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x * 2))
    assert sorted((s.device.id, s.index[0].start) for s in out.addressable_shards) == [
        (4, 0), (5, 2), (6, 4), (7, 6)]


def test_programs_freed_and_lowered_again_are_told_apart():
    """The unplaced-task warning is said once per task and program. A program is told
    apart by more than its module's id, which Python reuses once the module is freed:
    otherwise a later program would pass for one already warned about (a test order
    once silenced this file's eval_shape test)."""
    import types as pytypes

    from multimesh._src.mlir import ir
    from multimesh.jax import _primitives

    names = []
    with ir.Context(), ir.Location.unknown():
        for _ in range(50):
            module = ir.Module.create()
            ctx = pytypes.SimpleNamespace(module_context=pytypes.SimpleNamespace(module=module))
            names.append(_primitives._program_name(ctx))
            del ctx, module
    assert len(set(names)) == len(names), names
