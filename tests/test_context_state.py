"""Context state: exit order, the mjit cache key, and per-thread task rules."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.errors import MultimeshError
from multimesh.jax import _contexts, _global_mesh, _multimesh, _registrations
from tests.models import named_tanh_layers, recomputable_program


@pytest.fixture(autouse=True)
def _clean():
    mm.clear_tasks()
    yield
    mm.clear_tasks()
    assert len(_registrations._local.frames) == 1 and _global_mesh.active_multimesh() is None
    assert _contexts.state.autoshard is False and not _contexts.state.overrides


def _ids(x) -> list[int]:
    return sorted(d.id for d in x.devices())


def _mesh(k: int) -> mm.TaskMesh:
    return mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))


def _two_stage():
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=_mesh(0))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=_mesh(1))

    def loss(ws, x):
        return (s1(ws[1], s0(ws[0], x)) ** 2).sum()

    def plain(ws, x):
        return (jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) ** 2).sum()

    ws = [jnp.eye(16) * 0.5, jnp.eye(16) * 0.25]
    return loss, plain, ws, jnp.linspace(0, 1, 128).reshape(8, 16)


# ----------------------------------------------------------------- item 5: exit order


def test_multimeshes_exited_out_of_order_restore_autoshard():
    a = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    b = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))
    a.__enter__()
    b.__enter__()
    assert _contexts.state.autoshard
    assert _global_mesh.active_multimesh() is b
    a.__exit__(None, None, None)  # out of order
    assert _contexts.state.autoshard, "b is still open"
    assert _global_mesh.active_multimesh() is b
    b.__exit__(None, None, None)
    assert _contexts.state.autoshard is False
    assert _global_mesh.active_multimesh() is None


def test_out_of_order_exit_interleaved_with_autoshard_contexts():
    a = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))
    off = mm.autoshard(False)
    a.__enter__()
    off.__enter__()
    assert _contexts.state.autoshard is False
    a.__exit__(None, None, None)
    assert _contexts.state.autoshard is False
    off.__exit__(None, None, None)
    assert _contexts.state.autoshard is False


def test_registrations_of_an_out_of_order_exit_are_gone():
    a = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    b = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    a.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
    a.__enter__()
    b.__enter__()
    assert [r.matcher for r in _registrations.active_registrations()] == ["layer0"]
    a.__exit__(None, None, None)
    assert _registrations.active_registrations() == []
    b.__exit__(None, None, None)


@pytest.mark.parametrize("cls", [mm.MultiMesh, mm.Context])
def test_exit_without_enter_is_a_clear_error(cls):
    ctx = cls(axis_sizes=(8,), axis_names=("x",)) if cls is mm.MultiMesh else cls()
    with pytest.raises(MultimeshError, match=r"__exit__ was called without a matching "
                                             r"__enter__") as e:
        ctx.__exit__(None, None, None)
    assert isinstance(e.value, ValueError)
    with ctx:  # still usable
        pass


# ----------------------------------------------------------- item 6: the mjit cache key


def test_a_program_first_called_under_ignore_transforms_is_not_reused():
    loss, plain, ws, x = _two_stage()
    step = mm.mjit(jax.value_and_grad(loss))
    ref_v, ref_g = jax.jit(jax.value_and_grad(plain))(ws, x)
    with mm.ignore_transforms():
        v, g = step(ws, x)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    assert _ids(g[1]) == list(range(8)), "plain jax: one program on all devices"
    v, g = step(ws, x)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert _ids(g[0]) == [0, 1, 2, 3] and _ids(g[1]) == [4, 5, 6, 7]
    assert len(step._cache) == 2


def test_turning_on_recomputation_after_a_first_call_recompiles():
    f, w, x, want = recomputable_program()
    step = mm.mjit(f)
    transfers = []
    for on in (False, True, False):
        with mm.enable_recomputation(on):
            out = step(w, w, x)
        transfers.append(len(step._cache.values()[-1].transfers))
        np.testing.assert_allclose(out, want, rtol=1e-5)
        assert _ids(out) == [4, 5, 6, 7]
    assert transfers == [3, 2, 3]
    assert len(step._cache) == 2


def test_registering_a_task_or_entering_a_multimesh_recompiles():
    def model(ws, x):
        with jax.named_scope("layer0"):
            x = jnp.tanh(x @ ws[0])
        return x.sum()

    ws, x = [jnp.eye(16)], jnp.ones((8, 16))
    grad = mm.mjit(jax.grad(model))
    assert _ids(grad(ws, x)[0]) == list(range(8))
    mm.register_task("layer0", task=mm.Task(mesh=_mesh(1)))
    assert _ids(grad(ws, x)[0]) == [4, 5, 6, 7]
    mm.clear_tasks()
    with mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x")) as multi:
        multi.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
        assert _ids(grad(ws, x)[0]) == [0, 1, 2, 3]
    np.testing.assert_allclose(grad(ws, x)[0], jax.grad(model)(ws, x)[0], rtol=1e-5)
    assert _ids(grad(ws, x)[0]) == list(range(8))


def test_the_cache_key_holds_every_switch():
    base = _multimesh.compile_token()
    for ctx in (mm.ignore_transforms(), mm.enable_recomputation(), mm.enable_fast_path(False),
                mm.autoshard(), jax.numpy_rank_promotion("raise")):
        with ctx:
            assert _multimesh.compile_token() != base, ctx
    assert _multimesh.compile_token() == base


# ------------------------------------------------------------- item 7: per-thread rules


def test_a_multimesh_entered_in_another_thread_leaves_this_threads_placement_alone():
    def model(ws, x):
        return named_tanh_layers(ws, x).sum()

    ws, x = [jnp.eye(16) * 0.5, jnp.eye(16) * 0.25], jnp.linspace(0, 1, 128).reshape(8, 16)
    ref = jax.grad(model)(ws, x)
    grad = mm.mjit(jax.grad(model))
    entered, done = threading.Event(), threading.Event()
    seen: dict = {}

    def other():
        try:
            with mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x")) as multi:
                multi.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
                multi.register_task("layer1", task=mm.Task(mesh_slice={"stage": 1}))
                g = grad(ws, x)
                seen["ids"] = [_ids(a) for a in g]
                seen["vals"] = g
                entered.set()
                done.wait(600)
        except BaseException as e:  # surfaced by the main thread
            seen["error"] = e
            entered.set()

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(600)
    try:
        assert "error" not in seen, seen.get("error")
        assert _global_mesh.active_multimesh() is None
        assert _registrations.active_registrations() == []
        assert _contexts.state.autoshard is False
        g = grad(ws, x)  # while the other thread's MultiMesh is open
        assert [_ids(a) for a in g] == [list(range(8))] * 2
        for a, b in zip(g, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        done.set()
        t.join(600)
    assert seen["ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for a, b in zip(seen["vals"], ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_global_registrations_are_shared_by_threads():
    mm.register_task("layer0", task=mm.Task(mesh=_mesh(1)))
    seen = {}
    t = threading.Thread(target=lambda: seen.update(
        regs=[r.matcher for r in _registrations.active_registrations()]))
    t.start()
    t.join()
    assert seen["regs"] == ["layer0"]


def test_registering_into_a_context_entered_in_another_thread_reaches_it():
    ctx = mm.Context()
    entered, registered, done = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def other():
        with ctx:
            entered.set()
            registered.wait(600)
            seen["regs"] = [r.matcher for r in _registrations.active_registrations()]
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert entered.wait(600)
    ctx.register_task("layer1", task=mm.Task(mesh=_mesh(0)))
    assert _registrations.active_registrations() == []  # not entered in this thread
    registered.set()
    t.join(600)
    assert seen["regs"] == ["layer1"]


def test_nnx_mjit_cache_key_holds_the_context_state():
    nnx = pytest.importorskip("flax.nnx")
    from multimesh.jax.flax import mjit as nnx_mjit
    from multimesh.jax.flax import task as nnx_task

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx_task(nnx.Linear(8, 8, rngs=rngs), name="a", mesh=_mesh(0))
            self.b = nnx_task(nnx.Linear(8, 8, rngs=rngs), name="b", mesh=_mesh(1))

        def __call__(self, x):
            return self.b(self.a(x))

    model = Two(nnx.Rngs(0))
    x = jnp.linspace(0, 1, 64).reshape(8, 8)
    with mm.ignore_transforms():  # the plain layers
        want = model.b(model.a(x))
    f = nnx_mjit(lambda m, x: m(x))
    with mm.ignore_transforms():
        y = f(model, x)
    assert _ids(y) == list(range(8))
    y = f(model, x)
    assert _ids(y) == [4, 5, 6, 7]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ item 9: values, not errors


def test_a_string_axis_name_is_one_name_as_for_jax_mesh():
    mesh = mm.TaskMesh(devices=range(2), axis_names="xy", axis_sizes=(2,))
    assert mesh.axis_names == ("xy",) and mesh.axis_sizes == (2,)
    assert jax.sharding.Mesh(np.array(jax.devices()[:2]), "xy").axis_names == ("xy",)
    multi = mm.MultiMesh(axis_sizes=(8,), axis_names="stage")
    assert multi.axis_names == ("stage",)
    t = mm.task(lambda x: x * 2, name="t", devices=[0, 1], device_axes="xy")
    y = mm.mjit(t)(jnp.arange(4.0))
    np.testing.assert_array_equal(y, [0, 2, 4, 6])
    assert _ids(y) == [0, 1]


def test_negative_microbatch_argnum_counts_from_the_end():
    loss, plain, ws, x = _two_stage()
    grad = jax.value_and_grad(loss)
    got = mm.mjit(mm.microbatch(grad, dim=0, size=4, argnum=-1))(ws, x)
    want = mm.mjit(mm.microbatch(grad, dim=0, size=4, argnum=1))(ws, x)
    ref = jax.value_and_grad(plain)(ws, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    for a, b in zip(got[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert _ids(got[1][1]) == [4, 5, 6, 7]
