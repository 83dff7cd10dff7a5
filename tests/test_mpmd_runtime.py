"""MPMD runtime behaviour: donation, introspection, loops, transfers, buffer freeing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import PassFailure
from tests.models import recomputable_program


def _stage(k: int, width: int = 4):
    def body(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

    mesh = mm.TaskMesh(devices=range(width * k, width * k + width), axis_names=("x",),
                       axis_sizes=(width,))
    return mm.task(body, name=f"stage{k}", mesh=mesh, logical_axes=(("batch", "x"),))


STAGES = [_stage(0), _stage(1)]


def loss(ws, x):
    for s, w in zip(STAGES, ws):
        x = s(w, x)
    return (x ** 2).sum()


def _weights():
    return [jnp.eye(16) * 0.5 + 0.01 * k for k in range(2)]


def _ids(a):
    return sorted(d.id for d in a.devices())


def test_optax_step_updates_in_place_with_donation():
    opt = optax.sgd(0.1)

    def step(ws, state, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        updates, state = opt.update(grads, state, ws)
        return optax.apply_updates(ws, updates), state, value

    ws, x = _weights(), jnp.linspace(0, 1, 8 * 16).reshape(8, 16)
    state = opt.init(ws)
    with mm.ignore_transforms():
        ref_ws, _, ref_loss = step(ws, state, x)
    compiled = mm.mjit(step, donate_argnums=(0,)).lower(ws, state, x).compile()
    placed = jax.device_put(ws, compiled.input_shardings[0][0])
    new_ws, _, value = compiled(placed, state, x)
    assert all(w.is_deleted() for w in placed), "donated parameters were not consumed"
    np.testing.assert_allclose(value, ref_loss, rtol=1e-5)
    for got, want in zip(new_ws, ref_ws):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert [_ids(w) for w in new_ws] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_without_donation_inputs_survive():
    ws, x = _weights(), jnp.ones((8, 16))
    compiled = mm.mjit(jax.grad(loss)).lower(ws, x).compile()
    placed = jax.device_put(ws, compiled.input_shardings[0][0])
    compiled(placed, x)
    assert not any(w.is_deleted() for w in placed)


def test_introspection_lists_fragments_transfers_and_costs():
    ws, x = _weights(), jnp.ones((8, 16))
    compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    frags = {(f["task"], f["direction"]): f["devices"] for f in compiled.fragments}
    assert frags[("stage0", "fwd")] == [0, 1, 2, 3]
    assert frags[("stage1", "fwd")] == [4, 5, 6, 7]
    assert frags[("stage1", "bwd")] == [4, 5, 6, 7]
    assert frags[("stage0", "bwd")] == [0, 1, 2, 3]
    assert all("func.func public @main" in f["module"] for f in compiled.fragments)
    # activations forward, their cotangents backward: one transfer each way
    moved = sorted(tuple(t.layout[0]) for t in compiled.transfers)
    assert moved == [(0, 1, 2, 3), (4, 5, 6, 7)]
    text = compiled.plan()
    assert "stage0_fwd" in text and "transfer" in text
    assert compiled.cost_analysis().get("flops", 0) > 0
    assert "mm.fragment_call" in compiled.as_text()


def test_outputs_are_plain_arrays_on_the_producing_submesh():
    ws, x = _weights(), jnp.ones((8, 16))
    out = mm.mjit(lambda ws, x: STAGES[1](ws[1], STAGES[0](ws[0], x)))(ws, x)
    assert isinstance(out, jax.Array)
    assert _ids(out) == [4, 5, 6, 7]
    with mm.ignore_transforms():
        ref = STAGES[1](ws[1], STAGES[0](ws[0], x))
    np.testing.assert_allclose(out, ref, rtol=1e-6)


def test_intermediates_are_freed_after_last_use():
    ws, x = _weights(), jnp.ones((8, 16))
    compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    plan = compiled.plan_data
    # every intermediate that is not an output has a last use, so the executor drops it
    produced = {r for s in plan.steps for r in getattr(s, "results", [getattr(s, "dst", None)])}
    for vid in produced - set(plan.outputs):
        assert vid in plan.last_use, f"value %{vid} is never released"


def test_tasks_on_one_submesh_inside_scan_work():
    t = _stage(0)

    def f(w, xs):
        def body(c, x):
            return c + t(w, x).sum(), None

        return jax.lax.scan(body, 0.0, xs)[0]

    w, xs = _weights()[0], jnp.ones((3, 8, 16))
    got = mm.mjit(f)(w, xs)
    with mm.ignore_transforms():
        want = f(w, xs)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_tasks_on_different_submeshes_inside_a_loop_are_rejected():
    def f(ws, xs):
        def body(c, x):
            return c + STAGES[1](ws[1], STAGES[0](ws[0], x)).sum(), None

        return jax.lax.scan(body, 0.0, xs)[0]

    with pytest.raises(PassFailure, match="Unroll the loop"):
        mm.mjit(f).lower(_weights(), jnp.ones((3, 8, 16))).compile()


def test_unrolled_loop_places_each_task_on_its_submesh():
    def f(ws, xs):
        total = 0.0
        for i in range(xs.shape[0]):
            total = total + STAGES[1](ws[1], STAGES[0](ws[0], xs[i])).sum()
        return total

    ws, xs = _weights(), jnp.ones((3, 8, 16))
    compiled = mm.mjit(f).lower(ws, xs).compile()
    with mm.ignore_transforms():
        want = f(ws, xs)
    np.testing.assert_allclose(compiled(ws, xs), want, rtol=1e-5)
    assert {tuple(f["devices"]) for f in compiled.fragments} >= {(0, 1, 2, 3), (4, 5, 6, 7)}


def test_enable_recomputation_removes_a_transfer_and_keeps_numbers():
    f, w, x, want = recomputable_program()
    counts = {}
    for on in (False, True):
        with mm.enable_recomputation(on):
            compiled = mm.mjit(f).lower(w, w, x).compile()
        counts[on] = len(compiled.transfers)
        out = compiled(w, w, x)
        np.testing.assert_allclose(out, want, rtol=1e-5)
        assert _ids(out) == [4, 5, 6, 7]
    assert counts == {False: 3, True: 2}


def test_prng_keys_cross_the_program_boundary():
    k = jax.random.key(0)
    f = lambda k, x: (x + jax.random.normal(k, x.shape), jax.random.split(k))  # noqa: E731
    out, keys = mm.mjit(f)(k, jnp.ones(4))
    want, want_keys = f(k, jnp.ones(4))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert keys.dtype == want_keys.dtype
    np.testing.assert_array_equal(jax.random.key_data(keys), jax.random.key_data(want_keys))


def test_in_shardings_may_be_a_prefix():
    from jax.sharding import Mesh, NamedSharding

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    params = {"a": jnp.ones((4, 4)), "b": jnp.ones(4)}
    f = mm.mjit(lambda p, x: p["a"] @ x + p["b"],
                in_shardings=(NamedSharding(mesh, P("x")), None))
    np.testing.assert_allclose(f(params, jnp.ones(4)), params["a"] @ jnp.ones(4) + 1)
