"""The schedules with a stage-placement rule (issue 23): eager-1f1b, gpipe-1f1b-last,
interleaved-gpipe, circular-reversed-backward.

Textbook orders, bubble and peak live activations equal to the theory of
docs/schedules.md, the placement checks, the peers' spellings, and real programs
(explicit tasks and registered Flax blocks, 2 and 4 submeshes, 4 and 8 microbatches)
whose values and gradients equal plain JAX gradient accumulation and whose submeshes
dispatch in the schedule's order.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from multimesh.passes.schedules import (
    PLACEMENTS,
    ScheduleError,
    build_schedule,
    check_placement,
    live_activations,
    pipeline_units,
    theoretical_bubble,
    theoretical_peak_live,
)

import multimesh.jax as mm

PLACED = list(PLACEMENTS)


def rows(s) -> list[str]:
    return [" ".join(r) for r in s.labels()]


def _interleave(name: str) -> int:
    return 2 if PLACEMENTS[name] == "round-robin" else 1


# ------------------------------------------------------------------ textbook orders

def test_eager_1f1b_warms_up_2p_minus_2r_minus_1_forwards():
    # JaxPP's Eager1F1B: submesh r runs 2(P - r) - 1 forwards before its first backward
    s = build_schedule(pipeline_units(4, 8), "eager-1f1b")
    assert rows(s) == [
        "F0 F1 F2 F3 F4 F5 F6 B0 F7 B1 B2 B3 B4 B5 B6 B7",
        "F0 F1 F2 F3 F4 B0 F5 B1 F6 B2 F7 B3 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]


def test_gpipe_1f1b_last_is_gpipe_but_the_last_submesh():
    s = build_schedule(pipeline_units(3, 4), "gpipe-1f1b-last")
    assert rows(s) == ["F0 F1 F2 F3 B0 B1 B2 B3"] * 2 + ["F0 B0 F1 B1 F2 B2 F3 B3"]


def test_interleaved_gpipe_runs_megatron_groups_forward_then_backward():
    s = build_schedule(pipeline_units(2, 4, interleave=2), "interleaved-gpipe")
    got = [[f"{lab}{'ab'[u.stage // 2]}" for lab, u in zip(r, row, strict=True)]
           for r, row in zip(s.labels(), s.rows(), strict=True)]
    want = "F0a F1a F0b F1b F2a F3a F2b F3b B0b B1b B0a B1a B2b B3b B2a B3a".split()
    assert got == [want, want]


def test_circular_reversed_backward_mirrors_the_forwards():
    # Shardy:MPMD's CircularWithReversedBackward: backwards in descending
    # (phase, stage, microbatch), the forward order reversed
    s = build_schedule(pipeline_units(2, 4, interleave=2), "circular-reversed-backward")
    for row in s.rows():
        f = [(u.stage, u.microbatch) for u in row if u.kind == "fwd"]
        b = [(u.stage, u.microbatch) for u in row if u.kind == "bwd"]
        assert b == f[::-1]
        assert [m for _, m in b if _ == row[0].stage] == [3, 2, 1, 0]
    split = build_schedule(pipeline_units(2, 4, interleave=2, split_backward=True),
                           "circular-reversed-backward")
    assert "W3" in rows(split)[0]


@pytest.mark.parametrize("name", PLACED)
@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 16), (8, 32), (3, 6)])
def test_bubble_and_peak_live_equal_theory(name, P, M):
    V = _interleave(name)
    s = build_schedule(pipeline_units(P, M, interleave=V), name)
    assert s.bubble_fraction() == pytest.approx(theoretical_bubble(name, P, M, V))
    assert max(live_activations(s)) == theoretical_peak_live(name, P, M, V)


def test_eager_peak_live_per_submesh():
    s = build_schedule(pipeline_units(4, 8), "eager-1f1b")
    assert live_activations(s) == [7, 5, 3, 1]  # 2(P - r) - 1
    assert live_activations(build_schedule(pipeline_units(4, 8), "gpipe-1f1b-last")) == \
        [8, 8, 8, 1]


@pytest.mark.parametrize("alias,name", [
    ("Eager1F1B", "eager-1f1b"), ("InterleavedGPipe", "interleaved-gpipe"),
    ("GPipeBut1F1BForLastMesh", "gpipe-1f1b-last"),
    ("CircularWithReversedBackward", "circular-reversed-backward"),
    ("circularwithreversedbackward", "circular-reversed-backward"),
])
def test_peer_spellings(alias, name):
    units = pipeline_units(2, 4, interleave=_interleave(name))
    s = build_schedule(units, alias)
    assert s.name == name and rows(s) == rows(build_schedule(units, name))


# ------------------------------------------------------------------ placement

@pytest.mark.parametrize("name", ["eager-1f1b", "gpipe-1f1b-last"])
def test_contiguous_schedules_reject_interleaving(name):
    with pytest.raises(ScheduleError, match=rf"schedule '{name}' needs one pipeline stage per "
                                            r"submesh .*but submesh 0 runs 2 stages"):
        build_schedule(pipeline_units(2, 4, interleave=2), name)


def _v_shape(P: int, M: int):
    """Stage k on submesh k for k < P and on 2P-1-k after: not round-robin."""
    units = pipeline_units(P, M, interleave=2)
    return [u.__class__(**{**u.__dict__, "mesh": u.stage if u.stage < P else 2 * P - 1 - u.stage})
            for u in units]


@pytest.mark.parametrize("name", ["interleaved-gpipe", "circular-reversed-backward"])
def test_round_robin_schedules_reject_other_placements(name):
    with pytest.raises(ScheduleError, match=rf"schedule '{name}' needs round-robin placement "
                                            r".*but stage 2 runs on submesh 1, where "
                                            r"round-robin puts it on submesh 0"):
        build_schedule(_v_shape(2, 4), name)
    check_placement(pipeline_units(2, 4), name)  # one stage per submesh is round-robin too
    check_placement(_v_shape(2, 4), "gpipe")  # schedules without a rule take any


# ------------------------------------------------------------------ real programs

def _layer(k: int, P: int):
    per = 8 // P
    mesh = mm.TaskMesh(devices=range(per * (k % P), per * (k % P) + per))
    return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"layer{k}", mesh=mesh)


def _check_run(compiled, value, grads, ref_value, ref_grads, devices_of):
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    leaves = jax.tree_util.tree_leaves_with_path(grads)
    for (path, g), r in zip(leaves, jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
        assert sorted(d.id for d in g.devices()) == devices_of(path)


def _check_dispatch(compiled, name, P, M, V):
    sched = compiled.schedule
    assert sched.name == name and len(sched.orders) == P
    want = build_schedule(pipeline_units(P, M, interleave=V), name)
    assert sched.labels() == want.labels()
    dispatched = {k: [c for c in v if "@" in c] for k, v in compiled.calls_per_submesh().items()}
    for devs, row in zip(sched.devices, sched.rows(), strict=True):
        assert dispatched[tuple(devs)] == [f"{u.fragment}@{u.microbatch}" for u in row]


@pytest.mark.parametrize("name", PLACED)
@pytest.mark.parametrize("P,M", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_explicit_tasks(name, P, M):
    V = _interleave(name)
    layers = [_layer(k, P) for k in range(P * V)]

    def loss(ws, x):
        for f, w in zip(layers, ws, strict=True):
            x = f(w, x)
        return jnp.mean(x ** 2)

    ws = [jnp.eye(16) * (0.5 + 0.05 * k) + 0.01 for k in range(P * V)]
    x = jnp.sin(jnp.arange(4 * M * 16.0)).reshape(4 * M, 16)
    with mm.ignore_transforms():
        parts = [jax.value_and_grad(loss)(ws, x[4 * m:4 * m + 4]) for m in range(M)]
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule=name)
    compiled = mm.mjit(step).lower(ws, x).compile()
    value, grads = compiled(ws, x)
    per = 8 // P
    _check_run(compiled, value, grads, sum(p[0] for p in parts),
               [sum(g[k] for _, g in parts) for k in range(P * V)],
               lambda path: list(range(per * (path[0].idx % P), per * (path[0].idx % P) + per)))
    _check_dispatch(compiled, name, P, M, V)


class Net(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = jnp.tanh(nn.Dense(16, name=f"block_{i}")(x))
        return (x ** 2).mean()


@pytest.mark.parametrize("name", PLACED)
@pytest.mark.parametrize("P,M", [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_registered_flax_blocks(name, P, M):
    V = _interleave(name)
    per = 8 // P

    def submesh(i):  # round-robin when interleaved, contiguous otherwise
        return i % P if V > 1 else i

    def callback(block, backprop):
        s = submesh(int(block.split("_")[1]))
        return mm.Task(name=f"{block}_{'bwd' if backprop else 'fwd'}",
                       mesh=mm.TaskMesh(devices=range(per * s, per * s + per)))

    model = Net(layers=P * V)
    x = jnp.linspace(-1, 1, 8 * M * 16).reshape(8 * M, 16)
    params = model.init(jax.random.key(0), x[:8])
    parts = [jax.value_and_grad(model.apply)(params, x[8 * m:8 * m + 8]) for m in range(M)]
    step = mm.microbatch(jax.value_and_grad(model.apply), dim=0, size=8, argnum=1,
                         schedule=name)
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=callback)
        compiled = mm.mjit(step).lower(params, x).compile()
    value, grads = compiled(params, x)

    def devices_of(path):
        s = submesh(int(jax.tree_util.keystr(path).split("block_")[1].split("'")[0]))
        return list(range(per * s, per * s + per))

    _check_run(compiled, value, grads, sum(p[0] for p in parts),
               jax.tree.map(lambda *g: sum(g[1:], g[0]), *[p[1] for p in parts]), devices_of)
    _check_dispatch(compiled, name, P, M, V)


def test_contiguous_schedule_on_interleaved_program_is_an_error():
    layers = [_layer(k, 2) for k in range(4)]

    def loss(ws, x):
        for f, w in zip(layers, ws, strict=True):
            x = f(w, x)
        return jnp.mean(x ** 2)

    ws = [jnp.eye(16)] * 4
    x = jnp.ones((16, 16))
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1,
                         schedule="Eager1F1B")
    with pytest.raises(mm.MultimeshError, match="schedule 'eager-1f1b' needs one pipeline "
                                                "stage per submesh"):
        mm.mjit(step).lower(ws, x).compile()


def test_p6_bubble_and_peak_live_equal_theory():
    from tests.tools import load_tool

    mod = load_tool("bench_schedules")
    rows = mod.P6_rows(shapes=((2, 4), (4, 8)))
    assert {r["schedule"] for r in rows} >= set(PLACED)
    for r in rows:
        if r["theory"] is not None:
            assert r["bubble"] == pytest.approx(r["theory"]), r
        assert r["peak_live"] == r["peak_theory"], r
    assert "circular-reversed-backward" in mod.format_table(rows)


def test_custom_schedule_may_run_backwards_in_any_order():
    # the running gradient sums accumulate in the order the schedule runs the backwards
    # (here 3, 1, 0, 2 on submesh 0), not in microbatch order
    layers = [_layer(k, 2) for k in range(2)]

    def loss(ws, x):
        return jnp.mean(layers[1](ws[1], layers[0](ws[0], x)) ** 2)

    ws = [jnp.eye(16) * 0.6 + 0.01, jnp.eye(16) * 0.7 - 0.02]
    x = jnp.cos(jnp.arange(16 * 16.0)).reshape(16, 16)
    with mm.ignore_transforms():
        parts = [jax.value_and_grad(loss)(ws, x[4 * m:4 * m + 4]) for m in range(4)]
    rows_ = [["layer0"] * 4 + [(3, "layer0_bwd"), (1, "layer0_bwd"), (0, "layer0_bwd"),
                               (2, "layer0_bwd")],
             ["layer1", "layer1_bwd"] * 4]
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1,
                         custom_schedule=rows_)
    compiled = mm.mjit(step).lower(ws, x).compile()
    value, grads = compiled(ws, x)
    _check_run(compiled, value, grads, sum(p[0] for p in parts),
               [sum(g[k] for _, g in parts) for k in range(2)],
               lambda path: list(range(4 * path[0].idx, 4 * path[0].idx + 4)))
    assert compiled.schedule.labels()[0] == ["F0", "F1", "F2", "F3", "B3", "B1", "B0", "B2"]
