"""Schedules simulated with real costs (issue 23 items 2 and 5, issue 26 item 4):
per-fragment costs from XLA or from measured steps, predicted step time, bubble and
peak memory per submesh, ``compare_schedules`` and pictures labelled by their source."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh.schedules import ScheduleError, all_schedules, build_schedule, pipeline_units
from multimesh.schedules.costs import (
    FragmentCosts,
    compare,
    reshape_units,
    simulate_stages,
    textbook_schedule,
)

P_, M_ = 4, 4


def _stage(k):
    mesh = mm.TaskMesh(devices=range(2 * k, 2 * k + 2), axis_names=("x",), axis_sizes=(2,))
    return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"stage{k}", mesh=mesh)


def _loss(stages):
    def loss(ws, x):
        for s, w in zip(stages, ws):
            x = s(w, x)
        return (x ** 2).mean()
    return loss


def _args(d=128, rows=256):
    ws = [jnp.eye(d) * (0.5 + 0.1 * k) for k in range(P_)]
    x = jnp.linspace(-1, 1, rows * d).reshape(rows, d)
    return ws, x


@pytest.fixture(scope="module")
def program():
    ws, x = _args()
    step = mm.microbatch(jax.value_and_grad(_loss([_stage(k) for k in range(P_)])), dim=0,
                         size=x.shape[0] // M_, argnum=1, schedule="1f1b", reduction="mean")
    lowered = mm.mjit(step).lower(ws, x)
    return lowered.compile(), ws, x, lowered


def _check_against_jax(out, ws, x):
    plain_loss = _loss([lambda w, x: jnp.tanh(x @ w)] * P_)
    value, grads = jax.value_and_grad(plain_loss)(ws, x)
    np.testing.assert_allclose(out[0], value, rtol=1e-5)
    for g, want, k in zip(out[1], grads, range(P_)):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)
        assert sorted(d.id for d in g.devices()) == [2 * k, 2 * k + 1]


def test_profile_costs_reproduce_each_submesh_busy_time(program):
    """The acceptance test: simulated with costs from a profile of real steps, every
    submesh's busy time is the measured one (sum of its fragment durations) within 10%."""
    compiled, ws, x, lowered = program
    out = compiled.profile(ws, x)
    _check_against_jax(out, ws, x)
    one = compiled.last_profile
    assert one.steps == 1 and len(one.durations) == len(compiled.schedule.units)
    prof = compiled.step_profile(ws, x, steps=2)
    assert prof.steps == 2 and all(d > 0 for ds in prof.durations for d in ds)
    pred = compiled.schedule.simulate(prof)
    assert pred.source == "profile"
    for m in range(P_):
        assert math.isclose(pred.busy[m], prof.busy(m), rel_tol=0.1), (m, pred.busy, prof)
    # what the simulation overlaps, the measured (blocking) step ran one call at a time
    assert pred.step_time < sum(prof.busy(m) for m in range(P_)) + 1e-12
    assert pred.peak_microbatches == (4, 3, 2, 1)
    # the measured timeline keeps each submesh's dispatch order
    tl = prof.timeline()
    for row in compiled.schedule.orders:
        assert [tl.start[i] for i in row] == sorted(tl.start[i] for i in row)


def test_xla_costs(program):
    compiled, ws, x, lowered = program
    costs = mm.xla_costs(compiled, mm.DeviceModel(1e12, 1e11, overhead=0.0))
    frags = {f["name"] for f in compiled.fragments}
    assert set(costs.seconds) == frags and all(v > 0 for v in costs.seconds.values())
    flops = compiled.cost_analysis(by_fragment=True)["stage0_fwd"]["flops"]
    assert costs.seconds["stage0_fwd"] >= flops / 1e12
    pred = compiled.schedule.simulate(costs)
    busy = [sum(costs.seconds[compiled.schedule.units[i].fragment] for i in row)
            for row in compiled.schedule.orders]
    assert np.allclose(pred.busy, busy) and max(busy) <= pred.step_time


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_residual_bytes_are_what_a_real_step_holds(schedule):
    """Issue 26 item 4: the simulator's peak activation bytes from the plan's residual
    sizes equal the measured residuals, and (GPipe) the measured peak within 10%."""
    ws, x = _args(d=64, rows=128)
    step = mm.microbatch(jax.value_and_grad(_loss([_stage(k) for k in range(P_)])), dim=0,
                         size=32, argnum=1, schedule=schedule)
    compiled = mm.mjit(step).lower(ws, x).compile()
    res = mm.residual_bytes(compiled)
    assert set(res) == {f"stage{k}_fwd" for k in range(P_)} and all(res.values())
    mp = compiled.memory_profile(ws, x)
    # the measured residual of the last stage also holds its 4-byte loss value
    assert np.allclose([res[f"stage{m}_fwd"] for m in range(P_)],
                       [s.residual_bytes for s in mp.submeshes], rtol=1e-3)
    pred = compiled.schedule.simulate(residual_bytes=res)
    assert compiled.schedule.simulate(residual_bytes=mp).peak_activation_bytes == \
        tuple(mp.predicted_activations)
    live = (4, 4, 4, 4) if schedule == "gpipe" else (4, 3, 2, 1)
    assert pred.peak_activation_bytes == tuple(n * res[f"stage{m}_fwd"]
                                               for m, n in enumerate(live))
    if schedule == "gpipe":
        for p, s in zip(pred.peak_activation_bytes, mp.submeshes):
            assert math.isclose(p, s.peak_activations, rel_tol=0.1), (p, s)


def test_compare_schedules_lists_every_schedule(program, capsys):
    compiled, ws, x, lowered = program
    table = mm.compare_schedules(lowered, costs="unit")  # a lowered one compiles
    names = {p.schedule.name for p in table.rows} | set(table.not_applicable)
    assert names == {s.name for s in all_schedules()}
    assert "V-shape" in table.not_applicable["dualpipe-v"]
    assert table["gpipe"].peak_microbatches == (4, 4, 4, 4)
    assert table["1f1b"].peak_microbatches == (4, 3, 2, 1)
    assert math.isclose(table["1f1b"].bubble, 3 / 7)
    assert table["zb-h1"].bubble < table["1f1b"].bubble  # split from the unsplit program
    print(table)
    text = capsys.readouterr().out
    assert "zero-bubble-h1" in text and "not applicable" in text
    xla = mm.compare_schedules(compiled)
    assert xla.source == "xla" and xla["1f1b"].peak_activation_bytes is not None
    # with M = P every schedule holds all 4 microbatches on the first submesh
    res = mm.residual_bytes(compiled)["stage0_fwd"]
    assert max(xla.best(memory_limit=4 * res).peak_activation_bytes) <= 4 * res
    with pytest.raises(mm.errors.ScheduleError, match="no schedule keeps its activations"):
        xla.best(memory_limit=4 * res - 1)


def test_visualize_measured_and_simulated(program, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    compiled, ws, x, lowered = program
    prof = compiled.step_profile(ws, x, steps=1)
    assert mm.visualize_schedule(prof, tmp_path / "measured.png")
    assert "1f1b, measured" in capsys.readouterr().out
    assert mm.visualize_schedule(compiled, tmp_path / "sim.png", costs=prof)
    assert "1f1b, simulated (costs: profile)" in capsys.readouterr().out
    mm.visualize_schedule(compiled, costs="xla")
    assert "simulated (costs: xla)" in capsys.readouterr().out
    assert (tmp_path / "measured.png").stat().st_size > 0


def test_best_schedule_within_a_memory_limit():
    """Issue 26 item 4: a memory limit picks the fastest schedule that fits."""
    units = pipeline_units(4, 8)
    table = compare(units, residual_bytes=lambda k: 100)
    assert table.best().schedule.name == "zero-bubble-h1"   # 27 units, H2 ties later
    fits = [p for p in table.rows if max(p.peak_activation_bytes) <= 400]
    assert {p.schedule.name for p in fits} == {"1f1b", "zero-bubble-h1"}
    assert table.best(memory_limit=400).step_time == min(p.step_time for p in fits)
    with pytest.raises(ScheduleError, match=r"within 399 B; the least, '1f1b', holds 400 B"):
        table.best(memory_limit=399)
    with pytest.raises(ScheduleError, match="memory_limit needs residual sizes"):
        compare(units).best(memory_limit=400)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zero-bubble-h1", "interleaved-1f1b"])
def test_simulate_stages_with_unit_costs_is_the_theory(name):
    V = 2 if name == "interleaved-1f1b" else 1
    pred = simulate_stages(name, [1.0] * (4 * V), [2.0] * (4 * V), num_microbatches=8,
                           num_meshes=4, activation_bytes=[100] * (4 * V))
    want = build_schedule(pipeline_units(4, 8, interleave=V, split_backward=name.startswith("z")),
                          name)
    assert math.isclose(pred.bubble, want.bubble_fraction())
    assert list(pred.peak_microbatches) == want.live_activations()
    assert pred.peak_activation_bytes == tuple(100 * n for n in pred.peak_microbatches)


@pytest.mark.parametrize("name,P,V", [("1f1b", 4, 1), ("interleaved-1f1b", 2, 2),
                                      ("zero-bubble-h1", 4, 1), ("dualpipe-v", 2, 2)])
def test_textbook_schedules_are_built_once_and_are_the_built_ones(name, P, V):
    """The planner asks for the same schedule for each of its candidate cuts: it is
    built once per shape, and is the schedule ``build_schedule`` makes of the units."""
    from multimesh.schedules import get_schedule, v_shape_units

    algo = get_schedule(name)
    units = (v_shape_units(P, 8, split_backward=algo.splits_backward)
             if algo.placement == "v-shape"
             else pipeline_units(P, 8, interleave=V, split_backward=algo.splits_backward))
    got = textbook_schedule(name, P, V, 8)
    assert got == build_schedule(units, name)
    assert textbook_schedule(name, P, V, 8) is got
    assert textbook_schedule(name, P, V, 4) is not got
    with pytest.raises(ScheduleError):
        textbook_schedule("dualpipe-v", 4, 1, 3)  # needs at least 2P microbatches


def test_simulate_stages_with_a_slow_stage():
    """A stage twice as slow as the others sets the pace of the steady state."""
    pred = simulate_stages("1f1b", [1, 2, 1, 1], [2, 4, 2, 2], num_microbatches=16)
    assert pred.busy == (48.0, 96.0, 48.0, 48.0)
    assert 96 < pred.step_time < 96 + 3 * 6
    assert pred.bubble > simulate_stages("1f1b", [1] * 4, [2] * 4, num_microbatches=16).bubble


def test_reshaped_units_keep_the_work():
    units = pipeline_units(4, 4)
    split = reshape_units(units, True)
    assert sum(u.kind == "bwd_w" for u in split) == 16
    merged = reshape_units(split, False)
    assert [(u.kind, u.mesh, u.microbatch, u.deps) for u in merged] == \
        [(u.kind, u.mesh, u.microbatch, u.deps) for u in units]
    costs = FragmentCosts({u.fragment: 1.0 + (u.kind == "bwd") for u in units})
    for us in (split, merged):
        s = build_schedule(us, "1f1b")
        assert math.isclose(sum(s.simulate(costs).busy), 48.0)


def _placed_stage(k, first):
    mesh = mm.TaskMesh(devices=range(first, first + 4), axis_names=("x",), axis_sizes=(4,))
    return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"layer{k}", mesh=mesh)


def test_costs_survive_splitting_and_merging_backwards():
    """A zero-bubble program's profile simulates every schedule with the same work per
    submesh: split halves merge for 1F1B, whole backwards stay split for ZB-H2."""
    ws, x = _args(d=64, rows=128)
    step = mm.microbatch(jax.value_and_grad(_loss([_stage(k) for k in range(P_)])), dim=0,
                         size=32, argnum=1, schedule="zero-bubble-h1")
    compiled = mm.mjit(step).lower(ws, x).compile()
    assert any(u.kind == "bwd_w" for u in compiled.schedule.units)
    prof = compiled.step_profile(ws, x, steps=1)
    table = mm.compare_schedules(compiled, prof, memory=None)
    for name in ("gpipe", "1f1b", "zero-bubble-h1", "zero-bubble-h2"):
        assert np.allclose(table[name].busy, [prof.busy(m) for m in range(P_)], rtol=1e-9)
    assert not any(u.kind == "bwd_w" for u in table["1f1b"].schedule.units)


def test_compare_schedules_on_interleaved_stages():
    """Four layers round-robin on two submeshes: the interleaved schedules apply, the
    contiguous ones are listed with the placement they need."""
    layers = [_placed_stage(k, 4 * (k % 2)) for k in range(4)]
    ws, x = _args(d=32, rows=64)
    step = mm.microbatch(jax.value_and_grad(_loss(layers)), dim=0, size=16, argnum=1,
                         schedule="interleaved-1f1b", reduction="mean")
    compiled = mm.mjit(step).lower(ws, x).compile()
    out = compiled(ws, x)
    plain = jax.value_and_grad(_loss([lambda w, x: jnp.tanh(x @ w)] * 4))(ws, x)
    np.testing.assert_allclose(out[0], plain[0], rtol=1e-5)
    for g, want in zip(out[1], plain[1]):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)
    table = mm.compare_schedules(compiled, costs="unit")
    assert {"interleaved-1f1b", "interleaved-gpipe", "1f1b"} <= {p.schedule.name
                                                                for p in table.rows}
    assert "one pipeline stage per submesh" in table.not_applicable["eager-1f1b"]
    assert math.isclose(table["interleaved-1f1b"].bubble, 1 / 9)  # (P-1)/(VM+P-1)
    assert table["interleaved-1f1b"].peak_microbatches == (5, 3)   # gpipe: 8, 8
    assert table["gpipe"].peak_microbatches == (8, 8)


def test_registered_blocks(capsys):
    """Tasks placed by ``register_task`` on Flax blocks: profiled, simulated, compared."""
    pytest.importorskip("flax.linen")
    from tests.models import DenseBlocks, block_per_submesh

    model = DenseBlocks(width=64)
    x = jnp.linspace(-1, 1, 128 * 64).reshape(128, 64)
    params = model.init(jax.random.key(0), x[:32])
    step = mm.microbatch(jax.value_and_grad(model.apply), dim=0, size=32, argnum=1,
                         schedule="1f1b", reduction="mean")
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=block_per_submesh)
        compiled = mm.mjit(step).lower(params, x).compile()
    loss, grads = compiled.profile(params, x)
    want_loss, want_grads = jax.value_and_grad(model.apply)(params, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    prof = compiled.last_profile
    calls = prof.per_call()
    per_submesh = compiled.calls_per_submesh()
    for m, devices in enumerate(compiled.schedule.devices):  # device ids = positions here
        looped = [c for c in per_submesh[tuple(devices)] if "@" in c]
        assert looped and all(calls[c] > 0 for c in looped)
        assert math.isclose(sum(calls[c] for c in looped), prof.busy(m))
    pred = compiled.schedule.simulate(prof, residual_bytes=mm.residual_bytes(compiled))
    assert np.allclose(pred.busy, [prof.busy(m) for m in range(2)], rtol=0.1)
    assert pred.peak_microbatches == (2, 1) and all(pred.peak_activation_bytes)
    print(mm.compare_schedules(compiled, costs=prof))
    assert "gpipe-1f1b-last" in capsys.readouterr().out
