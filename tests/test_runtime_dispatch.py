"""Host dispatch of the runtime: compile-once variants, donation, batched transfers.

Every test checks numbers against plain jax on the same program and where the
arrays live.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh.runtime import executor, steps
from multimesh.runtime.plan import Call


def _one_device_stages(n):
    def body(w, x):
        return jnp.tanh(x @ w)

    return [mm.task(body, name=f"s{k}", mesh=mm.TaskMesh(devices=(k,), axis_names=("x",),
                                                         axis_sizes=(1,)))
            for k in range(n)]


def _loss(stages):
    def loss(ws, x):
        for t, w in zip(stages, ws):
            x = t(w, x)
        return (x * x).mean()
    return loss


def _weights(n, d=8):
    key = jax.random.key(0)
    return [jax.random.normal(jax.random.fold_in(key, k), (d, d)) / d ** 0.5 for k in range(n)]


def _summed(loss, ws, x, size):
    """Plain jax: value and gradient summed over microbatches of ``size`` rows."""
    with mm.ignore_transforms():
        parts = [jax.value_and_grad(loss)(ws, x[i:i + size]) for i in range(0, len(x), size)]
    return jax.tree.map(lambda *a: sum(a), *parts)


def _check(got, want):
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_pipeline_transfers_go_out_in_batches():
    """4 one-device stages, 8 microbatches, 1F1B: the transfers that a point of the
    schedule needs cross in one host call, and the results are jax's."""
    n, m = 4, 8
    stages = _one_device_stages(n)
    loss = _loss(stages)
    ws, x = _weights(n), jnp.linspace(-1, 1, 8 * m * 8).reshape(8 * m, 8)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    compiled = mm.mjit(step).lower(ws, x).compile()
    exe = compiled._exec
    assert exe.transfer_count == 2 * (n - 1) * m  # activations forward, gradients back
    assert exe.batched_transfers < exe.transfer_count / 2, (
        exe.batched_transfers, exe.transfer_count)
    got = compiled(ws, x)
    _check(got, _summed(loss, ws, x, 8))
    assert [sorted(d.id for d in g.devices()) for g in got[1]] == [[k] for k in range(n)]
    # run twice: the precomputed program holds no values of the first run
    _check(compiled(ws, x), got)


def test_batched_program_reads_every_value_after_it_is_made():
    """The reordered dispatch program never reads a value before it is produced or
    after it was dropped, and it moves every transfer of the plan exactly once."""
    n, m = 4, 4
    loss = _loss(_one_device_stages(n))
    ws, x = _weights(n), jnp.ones((8 * m, 8))
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    exe = mm.mjit(step).lower(ws, x).compile()._exec
    plan = exe.plan
    alive = set(plan.input_ids) | set(plan.constants) | set(plan.zeros)  # made by _start
    moved = []
    for step in exe._program:
        if not isinstance(step, (steps.FragmentCall, steps.Free)):
            moved.extend(step.dsts)
        assert set(step.srcs) <= alive, (type(step).__name__, step.srcs, sorted(alive))
        alive |= set(step.dsts)
        alive -= set(step.drop)
    assert sorted(moved) == sorted(s.dst for s in plan.steps if not isinstance(s, Call))
    assert set(plan.outputs) <= alive


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_a_fragment_compiles_once_when_only_its_last_call_could_donate():
    """A donated weight read by every microbatch could only be donated at the last
    one, which would need a second executable: the fragment compiles once, without
    the donation, and the input is deleted after its last use instead."""
    n, m = 2, 4
    stages = _one_device_stages(n)
    loss = _loss(stages)
    ws, x = _weights(n), jnp.linspace(0, 1, 8 * m * 8).reshape(8 * m, 8)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="gpipe")
    executor._COMPILE_CACHE.clear()
    before = executor.xla_compiles
    compiled = mm.mjit(step, donate_argnums=(0,)).lower(ws, x).compile()
    names = {f["name"] for f in compiled.fragments}
    assert executor.xla_compiles - before == len(names) == compiled._exec.xla_compiles
    placed = jax.device_put([w.copy() for w in ws], compiled.input_shardings[0][0])
    got = compiled(placed, x)
    assert all(w.is_deleted() for w in placed)
    _check(got, _summed(loss, ws, x, 8))


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_donated_input_read_once_is_donated_to_xla():
    """Outside a loop the donating call is the fragment's only call: one executable,
    with the buffer donor, and no plain variant compiled beside it."""
    stages = _one_device_stages(2)
    loss = _loss(stages)

    def step(ws, x):
        g = jax.grad(loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g)]

    ws, x = _weights(2), jnp.ones((8, 8))
    executor._COMPILE_CACHE.clear()
    compiled = mm.mjit(step, donate_argnums=(0,)).lower(ws, x).compile()
    assert compiled._exec.xla_compiles == len(compiled.fragments)
    assert not compiled._exec._skipped_donations
    placed = jax.device_put([w.copy() for w in ws], compiled.input_shardings[0][0])
    got = compiled(placed, x)
    assert all(w.is_deleted() for w in placed)
    with mm.ignore_transforms():
        want = step(ws, x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_resharding_transfers_stay_correct(schedule):
    """Stages on 2-device meshes with different layouts: transfers that reshard
    (not plain copies) take jax's resharding path, in the batched program too."""
    from jax.sharding import PartitionSpec as P

    def body_a(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

    def body_b(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P(None, "model")) @ w)

    a = mm.task(body_a, name="a", mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",),
                                                   axis_sizes=(2,)),
                logical_axes=(("batch", "x"),))
    b = mm.task(body_b, name="b", mesh=mm.TaskMesh(devices=(2, 3), axis_names=("y",),
                                                   axis_sizes=(2,)),
                logical_axes=(("model", "y"),))

    def loss(ws, x):
        return (b(ws[1], a(ws[0], x)) ** 2).mean()

    ws, x = _weights(2), jnp.linspace(-1, 1, 32 * 8).reshape(32, 8)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule=schedule)
    compiled = mm.mjit(step).lower(ws, x).compile()
    kinds = {type(step) for step in compiled._exec._program}
    assert steps.Move in kinds  # at least one reshard
    got = compiled(ws, x)
    _check(got, _summed(loss, ws, x, 8))
    assert sorted(d.id for d in got[1][1].devices()) == [2, 3]


def test_one_function_routes_every_transfer():
    """``steps.route`` alone decides how a value moves: across processes, into fresh
    buffers (a donated input onto its own devices), a plain shard-to-device copy (same
    mesh shape and axes), or a reshard."""
    row = ((0, 1), ("x",), (2,), (("x",), ()))
    assert steps.route(row, ((2, 3), *row[1:])) == steps.PLAIN_COPY
    assert steps.route(row, ((2, 3), ("x",), (2,), ((), ("x",)))) == steps.MOVE
    assert steps.route(row, ((2,), ("x",), (1,), ((), ()))) == steps.MOVE
    assert steps.route(None, row) == steps.MOVE
    assert steps.route(row, ((1, 2), *row[1:]), fresh=True) == steps.FRESH_COPY
    assert steps.route(row, ((2, 3), *row[1:]), local=False) == steps.CROSS_PROCESS


def test_traced_run_wraps_the_same_steps():
    """``profile()`` runs the executor's own steps, blocking after each: one span per
    fragment call and per transfer, and the same numbers as a plain call."""
    n, m = 2, 2
    loss = _loss(_one_device_stages(n))
    ws, x = _weights(n), jnp.linspace(-1, 1, 8 * m * 8).reshape(8 * m, 8)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="gpipe")
    compiled = mm.mjit(step).lower(ws, x).compile()
    got = compiled.profile(ws, x)
    _check(got, _summed(loss, ws, x, 8))
    events = compiled.last_trace.events
    plan = compiled._exec.plan
    calls = [e for e in events if len(e) == 4 or e[4].get("cat") != "transfer"]
    moves = [e for e in events if len(e) == 5 and e[4].get("cat") == "transfer"]
    assert [e[1] for e in calls] == [s.fragment for s in plan.calls()]
    assert len(moves) == compiled._exec.transfer_count
    assert {e[0] for e in calls} == {f"submesh devices {k}" for k in range(n)}
