"""Pipelines of an unmodified Flax model placed only by ``register_task`` (issue 10).

The model has no multimesh call; one callback places each block on a stage's submesh
(forward and backward under their own names, as MultiMesh programs name them). Each
schedule must instantiate every block's fragments once per microbatch, dispatch them
in the schedule's order on every submesh, and give the values and gradients of plain
JAX gradient accumulation over the same microbatches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh.passes.schedules import build_schedule, pipeline_units
from tests.models import DenseBlocks

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1", "zero-bubble-h2"]


def _placement(stages: int, interleave: int):
    per = 8 // stages
    layers = stages * interleave

    def stage(i):  # round-robin when interleaved, contiguous otherwise
        return i % stages if interleave > 1 else i * stages // layers

    def callback(name, backprop):
        s = stage(int(name.split("_")[1]))
        return mm.Task(name=f"{name}_{'bwd' if backprop else 'fwd'}",
                       mesh=mm.TaskMesh(devices=range(per * s, per * s + per)))

    return callback, per, stage


def _compile(schedule, stages, M):
    V = 2 if schedule == "interleaved-1f1b" else 1
    callback, per, stage = _placement(stages, V)
    model = DenseBlocks(layers=stages * V)
    x = jnp.linspace(-1, 1, 8 * M * 16).reshape(8 * M, 16)
    params = model.init(jax.random.key(0), x[:8])

    def loss(p, xb):
        return model.apply(p, xb)

    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule=schedule,
                         interleave=V if V > 1 else None)
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=callback)
        compiled = mm.mjit(step).lower(params, x).compile()
    return compiled, loss, params, x, per, stage, V


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages,M", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_registered_blocks_pipeline(schedule, stages, M):
    compiled, loss, params, x, per, stage, V = _compile(schedule, stages, M)
    # values and gradients: plain JAX gradient accumulation over the same microbatches
    value, grads = compiled(params, x)
    parts = [jax.value_and_grad(loss)(params, x[8 * m:8 * m + 8]) for m in range(M)]
    ref_value = sum(p[0] for p in parts)
    ref_grads = jax.tree.map(lambda *g: sum(g[1:], g[0]), *[p[1] for p in parts])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads),
                            jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
        # each block's gradient lives on its stage's submesh
        i = int(jax.tree_util.keystr(path).split("block_")[1].split("'")[0])
        s = stage(i)
        assert sorted(d.id for d in g.devices()) == list(range(per * s, per * s + per))
    # every block's forward and backward, once per microbatch
    in_loop = [c for c in compiled.calls if c["microbatch"] is not None]
    assert len(in_loop) >= 2 * stages * V * M
    for i in range(stages * V):
        for d in ("fwd", "bwd"):
            mbs = [c["microbatch"] for c in in_loop
                   if c["task"] == f"block_{i}_{d}" and c["direction"] == d]
            per_mb = {m: mbs.count(m) for m in set(mbs)}  # 2 for a split backward
            assert sorted(per_mb) == list(range(M)) and len(set(per_mb.values())) == 1, (i, d)
    # the runtime dispatches each submesh's calls in the schedule's order
    sched = compiled.schedule
    assert sched.name == schedule and len(sched.orders) == stages
    dispatched = {k: [c for c in v if "@" in c] for k, v in compiled.calls_per_submesh().items()}
    for devs, row in zip(sched.devices, sched.rows()):
        assert dispatched[tuple(devs)] == [f"{u.fragment}@{u.microbatch}" for u in row]
    _check_order(sched, schedule, stages, M, V)


def _check_order(sched, schedule, P, M, V):
    """The per-submesh order is the textbook one (split backwards: its properties)."""
    labels = [[lab for lab in row] for row in sched.labels()]
    if schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        want = build_schedule(pipeline_units(P, M, interleave=V), schedule).labels()
        assert labels == want
        return
    for row in sched.rows():  # weight halves after their activation halves, in order
        seen = set()
        for u in row:
            if u.kind == "bwd":
                seen.add((u.stage, u.microbatch))
            if u.kind == "bwd_w":
                assert (u.stage, u.microbatch) in seen
    assert any(u.kind == "bwd_w" for u in sched.units)
    f1 = build_schedule(sched.units, "1f1b")
    assert sched.bubble_fraction() < f1.bubble_fraction()
    if schedule == "zero-bubble-h1":  # under 1F1B's activation memory
        assert max(sched.live_activations()) <= max(f1.live_activations())


def test_interleave_on_contiguous_stages_is_rejected():
    callback, _, _ = _placement(2, 1)  # contiguous: one stage per submesh
    model = DenseBlocks(layers=2)
    x = jnp.ones((32, 16))
    params = model.init(jax.random.key(0), x[:8])
    step = mm.microbatch(jax.value_and_grad(lambda p, xb: model.apply(p, xb)), dim=0, size=8,
                         argnum=1, schedule="interleaved-1f1b", interleave=2)
    with mm.Context() as ctx, pytest.raises(mm.MultimeshError, match="interleave=2"):
        ctx.register_task(r"(block_\d+)", callback=callback)
        mm.mjit(step).lower(params, x).compile()


def test_schedule_without_tasks_warns():
    model = DenseBlocks(layers=2)
    x = jnp.ones((32, 16))
    params = model.init(jax.random.key(0), x[:8])
    step = mm.microbatch(jax.value_and_grad(lambda p, xb: model.apply(p, xb)), dim=0, size=8,
                         argnum=1, schedule="1f1b")
    with pytest.warns(mm.MultimeshWarning, match="schedule '1f1b' does not apply: the "
                                                  "microbatch loop holds no task"):
        compiled = mm.mjit(step).lower(params, x).compile()
    value, _ = compiled(params, x)
    np.testing.assert_allclose(value, sum(model.apply(params, x[8 * m:8 * m + 8])
                                          for m in range(4)), rtol=1e-5)


def _two_blocks(x_rows=32):
    model = DenseBlocks(layers=2)
    x = jnp.linspace(-1, 1, x_rows * 16).reshape(x_rows, 16)
    params = model.init(jax.random.key(0), x[:8])

    def loss(p, xb):
        return model.apply(p, xb)

    def reference(M):
        parts = [jax.value_and_grad(loss)(params, x[8 * m:8 * m + 8]) for m in range(M)]
        return (sum(p[0] for p in parts),
                jax.tree.map(lambda *g: sum(g[1:], g[0]), *[p[1] for p in parts]))

    return loss, params, x, reference


def _close(out, ref):
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(out[1]), jax.tree.leaves(ref[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_registered_custom_schedule_uses_the_callback_names():
    loss, params, x, reference = _two_blocks()
    callback, _, _ = _placement(2, 1)
    rows = [["block_0_fwd", "block_0_fwd", "block_0_bwd", "block_0_fwd", "block_0_bwd",
             "block_0_fwd", "block_0_bwd", "block_0_bwd"],
            ["block_1_fwd", "block_1_bwd"] * 4]
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                         custom_schedule=rows)
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=callback)
        compiled = mm.mjit(step).lower(params, x).compile()
    _close(compiled(params, x), reference(4))
    assert compiled.schedule.labels()[0] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


def test_registered_split_backprop_and_zero_bubble_h2():
    # the anchor's test_microbatch_zbh2: fwd/bwd colours, the backward split in two
    loss, params, x, reference = _two_blocks()

    def callback(name, backprop):
        i = int(name.split("_")[1])
        mesh = mm.TaskMesh(devices=range(4 * i, 4 * i + 4))
        if backprop:
            return mm.Task(name=f"{name}_bwd", mesh=mesh,
                           split_backprop=("_activations", "_gradients"))
        return mm.Task(name=f"{name}_fwd", mesh=mesh)

    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                         schedule="zero-bubble-h2")
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=callback)
        compiled = mm.mjit(step).lower(params, x).compile()
    _close(compiled(params, x), reference(4))
    names = {f["name"] for f in compiled.fragments}
    assert {"block_1_bwd_activations", "block_1_bwd_gradients"} <= names
    assert "W0" in compiled.schedule.labels()[1]


def test_registered_loop_dependent_mesh_slice():
    # the anchor's test_microbatch_lb: an embedding-like first block that moves with the
    # microbatch over the slices of the global mesh
    loss, params, x, reference = _two_blocks()
    gm = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("x", "y"))

    def callback(name, backprop):
        if name == "block_0":
            return mm.Task(name=name, mesh_slice={"x": 0},
                           loop_dependent_mesh_slice=lambda i: {"x": i % 2})
        return mm.Task(name=name, mesh_slice={"x": 1})

    gm.register_task(r"(block_\d+)", callback=callback)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    with gm:
        compiled = mm.mjit(step).lower(params, x).compile()
    _close(compiled(params, x), reference(4))
    placed = {(c["direction"], c["microbatch"]): c["devices"] for c in compiled.calls
              if c["task"] == "block_0" and c["microbatch"] is not None}
    for m in range(4):
        assert placed["fwd", m] == ([0, 1, 2, 3] if m % 2 == 0 else [4, 5, 6, 7])
