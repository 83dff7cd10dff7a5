"""The schedules with a stage-placement rule (issue 23): eager-1f1b, gpipe-1f1b-last,
interleaved-gpipe, circular-reversed-backward, dualpipe-v, zero-bubble-v, kimi-k2.

Textbook orders, bubble and peak live activations equal to the theory of
docs/schedules.md, the placement checks, the peers' spellings, and real programs
(explicit tasks and registered Flax blocks, 2 and 4 submeshes, 4 and 8 microbatches)
whose values and gradients equal plain JAX gradient accumulation and whose submeshes
dispatch in the schedule's order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh.passes.schedules import (
    PLACEMENTS,
    ScheduleError,
    build_schedule,
    check_placement,
    live_activations,
    pipeline_units,
    theoretical_bubble,
    theoretical_peak_live,
    v_shape_units,
)
from tests.models import DenseBlocks

PLACED = list(PLACEMENTS)


def rows(s) -> list[str]:
    return [" ".join(r) for r in s.labels()]


def _interleave(name: str) -> int:
    return 1 if PLACEMENTS[name] == "contiguous" else 2


def _units(name: str, P: int, M: int):
    if PLACEMENTS[name] == "v-shape":
        return v_shape_units(P, M)
    return pipeline_units(P, M, interleave=_interleave(name))


def _submesh(name: str, k: int, P: int) -> int:
    """Where layer ``k`` of ``P * V`` goes under the schedule's placement."""
    rule = PLACEMENTS[name]
    if rule == "v-shape":
        return k if k < P else 2 * P - 1 - k
    return k % P if rule == "round-robin" else k


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
    s = build_schedule(_units(name, P, M), name)
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
    ("DualPipeV", "dualpipe-v"), ("dualpipev", "dualpipe-v"),
    ("ZB-V", "zero-bubble-v"), ("zbv", "zero-bubble-v"), ("Zb-v", "zero-bubble-v"),
    ("KimiK2", "kimi-k2"), ("KIMIK2", "kimi-k2"),
])
def test_peer_spellings(alias, name):
    units = _units(name, 2, 4)
    s = build_schedule(units, alias)
    assert s.name == name and rows(s) == rows(build_schedule(units, name))


def _v_rows(s) -> list[str]:
    """Each submesh's order of a V-shape schedule on two submeshes, its units labelled
    ``a`` (the stage on the way down) or ``b`` (on the way back up)."""
    return [" ".join(f"{lab}{'ab'[u.stage >= 2]}" for lab, u in zip(r, row, strict=True))
            for r, row in zip(s.labels(), s.rows(), strict=True)]


def test_dualpipe_v_follows_the_published_steps():
    # deepseek-ai/DualPipe dualpipev.py, P = 2 and M = 4, written out by hand from its
    # eight steps: a = the submesh's stage on the way down, b = on the way back up; a
    # backward either runs its weight part at once (B W) or defers it to a later W
    s = build_schedule(v_shape_units(2, 4), "dualpipe-v")
    assert _v_rows(s) == [
        "F0a F1a F2a F0b B0b W0b F1b F3a B1b W1b F2b B0a W0a B2b W2b F3b B1a W1a B3b W3b "
        "B2a W2a B3a W3a",
        "F0a F0b F1a F1b F2a B0b W0b F2b B0a W0a F3a B1b W1b F3b B1a W1a B2b W2b B2a W2a "
        "B3b B3a W3b W3a",
    ]
    assert live_activations(s) == [5, 5]  # 2P + 1


def test_dualpipe_v_needs_2p_microbatches():
    with pytest.raises(ScheduleError, match=r"schedule 'dualpipe-v' needs at least 2P = 8 "
                                            r"microbatches for 4 pipeline submeshes, but there "
                                            r"are 6"):
        build_schedule(v_shape_units(4, 6), "dualpipe-v")


def test_zero_bubble_v_follows_the_reference_pattern():
    # sail-sg/zero-bubble-pipeline-parallelism, handcrafted_zb_v, P = 2 and M = 4,
    # written out by hand: 2(P - r) - 1 down forwards, r pairs F-up F-down, P - r
    # triples F B W up, the steady F B W down F B W up, then r pairs B-down B-up, P - r
    # pairs B-down W-down, the weight halves left (up, then down)
    s = build_schedule(v_shape_units(2, 4), "zero-bubble-v")
    assert _v_rows(s) == [
        "F0a F1a F2a F0b B0b W0b F1b B1b W1b F3a B0a W0a F2b B2b W2b B1a W1a F3b B3b W3b "
        "B2a W2a B3a W3a",
        "F0a F0b F1a F1b B0b W0b F2a B0a W0a F2b B1b W1b F3a B1a W1a F3b B2b W2b B2a B3b "
        "B3a W2a W3b W3a",
    ]
    assert live_activations(s) == [4, 4]  # 2P: 1F1B's P whole stages


@pytest.mark.parametrize("P", range(2, 9))
def test_zero_bubble_v_has_no_bubble_inside_any_span(P):
    from multimesh.schedules.algorithms.zero_bubble_v import zero_bubble_v_plan

    for M in range(2 * P - 1, 4 * P + 1):
        s = build_schedule(v_shape_units(P, M), "zero-bubble-v")
        # each submesh runs the pattern as written (no repair by the simulator)
        assert [[(u.kind, u.stage, u.microbatch) for u in row] for row in s.rows()] == \
            [zero_bubble_v_plan(r, P, M, r, 2 * P - 1 - r) for r in range(P)]
        tl = s.timeline()
        assert tl.stage_bubble_fraction() == 0.0, (P, M)
        assert [min(tl.start[i] for i in row) for row in s.orders] == list(range(P))
        assert tl.makespan == 6 * M + P - 1
        assert s.bubble_fraction() == pytest.approx(theoretical_bubble("ZB-V", P, M, 2))
        assert live_activations(s) == [2 * P] * P


@pytest.mark.parametrize("split", [True, False])
def test_zero_bubble_v_respects_dependencies(split):
    for P in range(1, 6):
        for M in range(1, 2 * P + 3):
            s = build_schedule(v_shape_units(P, M, split_backward=split), "zero-bubble-v")
            done: set[int] = set()
            for i in s.order:  # the global order runs every unit after its inputs
                assert set(s.units[i].deps) <= done
                done.add(i)
            for row in s.rows():  # each (stage, kind) runs its microbatches in order
                seen: dict = {}
                for u in row:
                    seen.setdefault((u.stage, u.kind), []).append(u.microbatch)
                assert all(v == list(range(M)) for v in seen.values())
            assert sorted(i for row in s.orders for i in row) == list(range(len(s.units)))


def test_zero_bubble_v_peak_live_for_every_shape():
    for P in range(1, 7):
        for M in range(1, 3 * P + 2):
            s = build_schedule(v_shape_units(P, M), "zero-bubble-v")
            assert max(live_activations(s)) == theoretical_peak_live("zero-bubble-v", P, M, 2)
    assert theoretical_bubble("zero-bubble-v", 4, 6, 2) is None  # fewer than 2P - 1


def test_kimi_k2_follows_jaxpp():
    # JaxPP's KimiK2: interleaved 1F1B (rounds of P microbatches) whose warm-up on
    # submesh r is (V - 1)P + 2(P - 1 - r) + 1 forwards, then F B in turn
    s = build_schedule(pipeline_units(2, 4, interleave=2), "KimiK2")
    got = [" ".join(f"{lab}{'ab'[u.stage >= 2]}" for lab, u in zip(r, row, strict=True))
           for r, row in zip(s.labels(), s.rows(), strict=True)]
    assert got == ["F0a F1a F0b F1b F2a F3a B0b F2b B1b F3b B0a B1a B2b B3b B2a B3a",
                   "F0a F1a F0b F1b B0b F2a B1b F3a B0a F2b B1a F3b B2b B3b B2a B3a"]
    assert live_activations(s) == [6, 4]


@pytest.mark.parametrize("V", [1, 2, 3])
def test_kimi_k2_is_interleaved_1f1b_with_one_more_warmup_forward(V):
    # with one stage per submesh JaxPP's interleaved warm-up is 2(P - 1 - r), eager 1F1B's
    other = "interleaved-1f1b" if V > 1 else "eager-1f1b"
    for P in range(2, 6):
        for M in (P, 2 * P, 3 * P):
            kimi = build_schedule(pipeline_units(P, M, interleave=V), "kimi-k2")
            ref = build_schedule(pipeline_units(P, M, interleave=V), other)
            for k_row, r_row in zip(kimi.labels(), ref.labels(), strict=True):
                warm = k_row.index(next(x for x in k_row if x[0] == "B"))
                if warm < V * M:
                    assert warm == r_row.index(next(x for x in r_row if x[0] == "B")) + 1
                assert sorted(k_row) == sorted(r_row)
            assert kimi.bubble_fraction() == pytest.approx(
                theoretical_bubble("kimi-k2", P, M, V))
            assert max(live_activations(kimi)) == theoretical_peak_live("kimi-k2", P, M, V)


def test_kimi_k2_needs_equal_rounds():
    # JaxPP: rounds of M // max(1, M // P) microbatches; 9 microbatches on 4 submeshes
    # are 2 rounds of 4.5
    with pytest.raises(ScheduleError, match=r"schedule 'kimi-k2' runs the microbatches in 2 "
                                            r"rounds for 4 pipeline submeshes, which 9 "
                                            r"microbatches do not fill equally; use a multiple "
                                            r"of 4 microbatches \(or fewer than 8\)"):
        build_schedule(pipeline_units(4, 9, interleave=2), "kimi-k2")
    six = build_schedule(pipeline_units(4, 6, interleave=2), "kimi-k2")  # one round of 6
    assert six.rows()[0][:6] == [u for u in six.rows()[0] if u.kind == "fwd"][:6]


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


@pytest.mark.parametrize("name", ["dualpipe-v", "zero-bubble-v"])
def test_v_shape_schedule_rejects_other_placements(name):
    with pytest.raises(ScheduleError, match=rf"schedule '{name}' needs V-shape placement "
                                            r".*but its stages run on submeshes \[0, 1, 0, 1\] "
                                            r"in order, where V-shape needs \[0, 1, 0\]"):
        build_schedule(pipeline_units(2, 4, interleave=2, split_backward=True), name)
    check_placement(_v_shape(2, 4), name.upper())


@pytest.mark.parametrize("name", ["interleaved-gpipe", "circular-reversed-backward", "kimi-k2"])
def test_round_robin_schedules_reject_other_placements(name):
    with pytest.raises(ScheduleError, match=rf"schedule '{name}' needs round-robin placement "
                                            r".*but stage 2 runs on submesh 1, where "
                                            r"round-robin puts it on submesh 0"):
        build_schedule(_v_shape(2, 4), name)
    check_placement(pipeline_units(2, 4), name)  # one stage per submesh is round-robin too
    check_placement(_v_shape(2, 4), "gpipe")  # schedules without a rule take any


# ------------------------------------------------------------------ real programs

def _layer(k: int, P: int, at: int | None = None):
    per, at = 8 // P, k % P if at is None else at
    mesh = mm.TaskMesh(devices=range(per * at, per * at + per))
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
    if PLACEMENTS[name] == "v-shape":
        # the first stage's backward has no activation half to split off and the turning
        # submesh's two layers are one stage: the textbook rows on this program's units
        assert sched.labels() == build_schedule(sched.units, name).labels()
        assert any(u.kind == "bwd_w" for u in sched.units)
        if name == "zero-bubble-v":  # the published pattern, less the slots it lacks
            from multimesh.schedules.algorithms.zero_bubble_v import zero_bubble_v_plan

            for r, row in enumerate(sched.rows()):  # a slot's units (two tasks) adjacent
                slots = [(u.kind, u.stage, u.microbatch) for u in row]
                have = [sl for k, sl in enumerate(slots) if k == 0 or slots[k - 1] != sl]
                stages = sorted({st for _, st, _ in have})
                plan = zero_bubble_v_plan(r, P, M, stages[0], stages[-1])
                assert have == [sl for sl in plan if sl in set(have)], r
        for row in sched.rows():  # every weight half after its activation half
            done = set()
            for u in row:
                done.add((u.kind, u.stage, u.microbatch))
                assert u.kind != "bwd_w" or ("bwd", u.stage, u.microbatch) in done
    else:
        want = build_schedule(pipeline_units(P, M, interleave=V), name)
        assert sched.labels() == want.labels()
        # and each unit's stage too (layer k is stage k in both)
        assert [[u.stage for u in row] for row in sched.rows()] == \
            [[u.stage for u in row] for row in want.rows()]
    dispatched = {k: [c for c in v if "@" in c] for k, v in compiled.calls_per_submesh().items()}
    for devs, row in zip(sched.devices, sched.rows(), strict=True):
        assert dispatched[tuple(devs)] == [f"{u.fragment}@{u.microbatch}" for u in row]


SHAPES = [(2, 4), (2, 8), (4, 4), (4, 8)]
CASES = [(n, P, M) for n in PLACED for P, M in SHAPES if n != "dualpipe-v" or M >= 2 * P]


@pytest.mark.parametrize("name,P,M", CASES)
def test_explicit_tasks(name, P, M):
    V = _interleave(name)
    layers = [_layer(k, P, _submesh(name, k, P)) for k in range(P * V)]

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
               lambda path: [per * _submesh(name, path[0].idx, P) + d for d in range(per)])
    _check_dispatch(compiled, name, P, M, V)


@functools.cache
def _blocks_reference(layers: int, M: int):
    """``DenseBlocks(layers)``, its parameters, M microbatches of 8 rows, and plain jax's
    value and gradients summed over the microbatches: the same for every schedule of
    that shape (27 cases, 6 shapes), so computed once per shape (op by op, 0.3-1.8 s)."""
    model = DenseBlocks(layers=layers)
    x = jnp.linspace(-1, 1, 8 * M * 16).reshape(8 * M, 16)
    params = model.init(jax.random.key(0), x[:8])
    parts = [jax.value_and_grad(model.apply)(params, x[8 * m:8 * m + 8]) for m in range(M)]
    return (model, params, x, sum(p[0] for p in parts),
            jax.tree.map(lambda *g: sum(g[1:], g[0]), *[p[1] for p in parts]))


@pytest.mark.parametrize("name,P,M", CASES)
def test_registered_flax_blocks(name, P, M):
    V = _interleave(name)
    per = 8 // P

    def submesh(i):
        return _submesh(name, i, P)

    def callback(block, backprop):
        s = submesh(int(block.split("_")[1]))
        return mm.Task(name=f"{block}_{'bwd' if backprop else 'fwd'}",
                       mesh=mm.TaskMesh(devices=range(per * s, per * s + per)))

    model, params, x, ref_value, ref_grads = _blocks_reference(P * V, M)
    step = mm.microbatch(jax.value_and_grad(model.apply), dim=0, size=8, argnum=1,
                         schedule=name)
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=callback)
        compiled = mm.mjit(step).lower(params, x).compile()
    value, grads = compiled(params, x)

    def devices_of(path):
        s = submesh(int(jax.tree_util.keystr(path).split("block_")[1].split("'")[0]))
        return list(range(per * s, per * s + per))

    _check_run(compiled, value, grads, ref_value, ref_grads, devices_of)
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


@pytest.mark.parametrize("name,V,split", [
    ("gpipe", 1, False), ("1f1b", 1, False), ("interleaved-1f1b", 2, False),
    ("interleaved-1f1b", 3, False), ("zero-bubble-h1", 1, True), ("zero-bubble-h2", 1, True),
    ("eager-1f1b", 1, False), ("gpipe-1f1b-last", 1, False), ("interleaved-gpipe", 2, False),
    ("circular-reversed-backward", 2, False)])
def test_peak_live_theory_for_every_shape(name, V, split):
    for P in range(1, 6):
        for M in range(1, 3 * P + 2):
            want = theoretical_peak_live(name, P, M, V)
            if want is None:  # interleaved 1F1B without P dividing M: no closed form
                assert name in ("1f1b", "interleaved-1f1b") and M % P
                continue
            s = build_schedule(pipeline_units(P, M, interleave=V, split_backward=split), name)
            assert max(live_activations(s)) == want, (P, M)
