"""Pipeline schedules: textbook orders, dependencies, memory, custom schedules, the pass,
the text Gantt, the PNG and the trace file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from multimesh._src.errors import DiagnosticError, DiagnosticWarning
from multimesh._src.mlir import parse_module, print_module
from multimesh.passes.schedule_fragments import ScheduleFragmentsPass, read_schedule
from multimesh.passes.schedules import (
    PLACEMENTS,
    SCHEDULES,
    Call,
    Schedule,
    ScheduleError,
    Unit,
    build_schedule,
    canonicalize_custom_schedule,
    check_placement,
    format_gantt,
    live_activation_profile,
    live_activations,
    pipeline_units,
    simulate,
    theoretical_bubble,
    units_from_calls,
)
from tests.tools import load_tool

ROOT = Path(__file__).resolve().parent.parent
BUILTIN = [s for s in SCHEDULES if s != "custom"]


def rows(sched: Schedule) -> list[str]:
    return [" ".join(r) for r in sched.labels()]


def fits(units, name) -> bool:
    """Whether the program's stages are placed as the schedule needs (PLACEMENTS); a
    schedule that does not fit must say which placement it needs."""
    try:
        check_placement(units, name)
    except ScheduleError as e:
        assert name in PLACEMENTS and f"schedule '{name}' needs" in str(e)
        with pytest.raises(ScheduleError, match=f"schedule '{name}' needs"):
            build_schedule(units, name)
        return False
    if name in ("dualpipe-v", "kimi-k2"):  # at least 2P microbatches; rounds of equal size
        try:
            build_schedule(units, name)
        except ScheduleError as e:
            assert "needs at least 2P" in str(e) or "do not fill equally" in str(e)
            return False
    return True


# ------------------------------------------------------------------ textbook orders

GPIPE_4x8 = ["F0 F1 F2 F3 F4 F5 F6 F7 B0 B1 B2 B3 B4 B5 B6 B7"] * 4

# PipeDream-flush (Narayanan et al. 2021, fig. 4 top): stage s warms up with P - s
# forwards, then alternates backward/forward, then drains the backwards.
ONE_F_ONE_B_4x8 = [
    "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
]


def test_gpipe_textbook_order():
    s = build_schedule(pipeline_units(4, 8), "gpipe")
    assert rows(s) == GPIPE_4x8
    for r, row in enumerate(s.rows()):
        assert {u.mesh for u in row} == {r}
        assert [u.stage for u in row] == [r] * 16


def test_1f1b_textbook_order():
    assert rows(build_schedule(pipeline_units(4, 8), "1f1b")) == ONE_F_ONE_B_4x8


def test_aliases_and_default():
    units = pipeline_units(4, 8)
    assert rows(build_schedule(units, "fill-drain")) == GPIPE_4x8
    assert rows(build_schedule(units, None)) == GPIPE_4x8
    assert rows(build_schedule(units, "WaveFront")) == ONE_F_ONE_B_4x8
    assert build_schedule(units, "wavefront").name == "1f1b"


def test_split_backward_keeps_w_after_b_in_1f1b():
    s = build_schedule(pipeline_units(4, 8, split_backward=True), "1f1b")
    for got, want in zip(rows(s), ONE_F_ONE_B_4x8, strict=True):
        assert got == " ".join(t if t[0] == "F" else f"{t} W{t[1:]}" for t in want.split())


def _megatron_interleaved(P: int, M: int, V: int, r: int) -> list[str]:
    """Megatron-LM's interleaved 1F1B on rank r (M % P == 0), written independently."""
    total = M * V

    def chunk(k, forward):
        c = (k % (P * V)) // P
        return c if forward else V - 1 - c

    def mb(k):
        return (k // (P * V)) * P + k % P

    warm = min((P - r - 1) * 2 + (V - 1) * P, total)
    seq = [f"F{mb(k)}c{chunk(k, True)}" for k in range(warm)]
    for i in range(total - warm):
        k = warm + i
        seq += [f"F{mb(k)}c{chunk(k, True)}", f"B{mb(i)}c{chunk(i, False)}"]
    seq += [f"B{mb(i)}c{chunk(i, False)}" for i in range(total - warm, total)]
    return seq


@pytest.mark.parametrize("P,M,V", [(4, 8, 2), (2, 4, 2), (2, 6, 3), (4, 16, 2), (3, 6, 2)])
def test_interleaved_1f1b_is_megatrons(P, M, V):
    s = build_schedule(pipeline_units(P, M, interleave=V), "interleaved-1f1b")
    for r, row in enumerate(s.rows()):
        got = [f"{'F' if u.kind == 'fwd' else 'B'}{u.microbatch}c{u.stage // P}" for u in row]
        assert got == _megatron_interleaved(P, M, V, r)
    assert s.bubble_fraction() == pytest.approx(theoretical_bubble("1f1b", P, M, V))


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 16), (3, 7), (8, 32), (1, 5), (5, 2)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_matches_theory(name, P, M):
    s = build_schedule(pipeline_units(P, M), name)
    assert s.bubble_fraction() == pytest.approx((P - 1) / (M + P - 1))


# ------------------------------------------------------------------ zero bubble


@pytest.mark.parametrize("P,M", [(2, 2), (2, 4), (4, 8), (4, 4), (3, 7), (8, 16)])
def test_zero_bubble_beats_1f1b(P, M):
    zb = build_schedule(pipeline_units(P, M, split_backward=True), "zero-bubble-h1")
    plain = build_schedule(pipeline_units(P, M), "1f1b")
    split = build_schedule(pipeline_units(P, M, split_backward=True), "1f1b")
    assert zb.bubble_fraction() < split.bubble_fraction() <= plain.bubble_fraction()
    assert zb.bubble_fraction() == pytest.approx(theoretical_bubble("zero-bubble-h1", P, M))
    assert max(live_activations(zb)) <= P  # ZB-H1 keeps 1F1B's peak memory


def test_zero_bubble_without_split_is_1f1b():
    units = pipeline_units(4, 8)
    assert rows(build_schedule(units, "zero-bubble-h1")) == ONE_F_ONE_B_4x8


def test_zero_bubble_runs_weight_gradients_in_bubbles():
    s = build_schedule(pipeline_units(4, 8, split_backward=True), "zero-bubble-h1")
    last = rows(s)[3].split()
    # The last stage runs B right after F and defers the W halves.
    assert last[:4] == ["F0", "B0", "F1", "B1"]
    assert last[-4:] == ["W4", "W5", "W6", "W7"]



def _recomputing(units):
    """``units`` with every weight half reading the stage input and the incoming
    cotangent, not its activation half (``remat=True``'s split backward)."""
    from dataclasses import replace
    out = []
    for u in units:
        if u.kind == "bwd_w":
            b = next(d for d in u.deps if units[d].kind == "bwd")
            u = replace(u, deps=tuple(sorted({*u.deps, *units[b].deps} - {b})))
        out.append(u)
    return out


def _held(sched) -> list[int]:
    """Per submesh, the most stage-sized tensors held: one per microbatch awaiting its
    backward, two (stage input, cotangent) per microbatch awaiting its weight half."""
    out = []
    for row in sched.rows():
        held = peak = 0
        for u in row:
            held += {"fwd": 1, "bwd": 1, "bwd_w": -2}[u.kind]
            peak = max(peak, held)
        out.append(peak)
    return out


@pytest.mark.parametrize("name,factor", [("zero-bubble-h1", 1), ("zero-bubble-h2", 2)])
@pytest.mark.parametrize("P,M", [(4, 8), (2, 4), (3, 7), (8, 16)])
def test_zero_bubble_with_recomputing_weight_halves_holds_1f1b_plus_one(name, factor, P, M):
    """With remat the weight half recomputes from the stage input and the cotangent,
    which it holds while deferred: every submesh holds at most 1F1B's stage inputs (twice
    for H2) and one cotangent, and the schedule still beats 1F1B's bubble."""
    one = build_schedule(pipeline_units(P, M), "1f1b")
    paper = build_schedule(pipeline_units(P, M, split_backward=True), name)
    zb = build_schedule(_recomputing(pipeline_units(P, M, split_backward=True)), name)
    bound = [factor * n + 1 for n in live_activations(one)]
    assert all(h <= b for h, b in zip(_held(zb), bound)), (_held(zb), bound)
    assert any(h > b for h, b in zip(_held(paper), bound))  # the paper's bound is global
    assert paper.bubble_fraction() <= zb.bubble_fraction() < one.bubble_fraction()
    for row in zb.rows():  # a weight half never runs before its activation half
        seen = set()
        for u in row:
            assert u.kind != "bwd_w" or ("bwd", u.microbatch) in seen
            seen.add((u.kind, u.microbatch))


# ------------------------------------------------------------------ memory


@pytest.mark.parametrize("P,M", [(4, 8), (2, 4), (4, 2), (8, 16), (3, 3)])
def test_live_activation_bounds(P, M):
    f1 = build_schedule(pipeline_units(P, M), "1f1b")
    gp = build_schedule(pipeline_units(P, M), "gpipe")
    assert live_activations(f1) == [min(P - r, M) for r in range(P)]
    assert max(live_activations(f1)) <= P
    assert live_activations(gp) == [M] * P
    for prof in live_activation_profile(f1) + live_activation_profile(gp):
        assert prof[-1] == 0 and min(prof) >= 0


def test_num_stages_lengthens_warmup():
    s = build_schedule(pipeline_units(2, 8), "1f1b", num_stages=4)
    assert rows(s)[0].startswith("F0 F1 F2 F3 B0")
    assert live_activations(s) == [4, 3]


# ------------------------------------------------------------------ dependencies


def check_valid(s: Schedule) -> None:
    """Every unit once, on its own submesh; global order topological and merging rows."""
    n = len(s.units)
    assert sorted(s.order) == list(range(n))
    assert sorted(i for r in s.orders for i in r) == list(range(n))
    pos = {i: k for k, i in enumerate(s.order)}
    for m, row in enumerate(s.orders):
        assert all(s.units[i].mesh == m for i in row)
        assert [pos[i] for i in row] == sorted(pos[i] for i in row)
    for u in s.units:
        for d in u.deps:
            assert pos[d] < pos[u.index], (u, s.units[d])
    simulate(s)  # the per-submesh orders run without deadlock


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(P=st.integers(1, 6), M=st.integers(1, 10), V=st.integers(1, 3), split=st.booleans(),
       name=st.sampled_from(BUILTIN))
def test_every_schedule_respects_dependencies(P, M, V, split, name):
    units = pipeline_units(P, M, interleave=V, split_backward=split)
    if not fits(units, name):
        return
    s = build_schedule(units, name)
    check_valid(s)
    for row in s.rows():  # each (stage, kind) runs every microbatch once, in order
        seen: dict = {}
        for u in row:
            seen.setdefault((u.stage, u.kind), []).append(u.microbatch)
        for (_, kind), v in seen.items():  # circular-reversed-backward: backwards descend
            descending = name == "circular-reversed-backward" and kind != "fwd"
            assert v == (list(range(M))[::-1] if descending else list(range(M)))
    if V == 1 and not split and name in ("gpipe", "1f1b"):
        assert s.bubble_fraction() == pytest.approx((P - 1) / (M + P - 1))


@st.composite
def programs(draw):
    """Random microbatched programs: a chain of tasks on random submeshes (loop-dependent
    ones too), forward and backward per microbatch, plus free units and accumulators."""
    T = draw(st.integers(1, 5))
    G = draw(st.integers(1, 4))
    M = draw(st.integers(1, 5))
    mesh_of = [draw(st.integers(0, G - 1)) for _ in range(T)]
    moving = draw(st.booleans())
    split = draw(st.booleans())
    calls: list[Call] = []

    def dev(m):
        return (2 * m, 2 * m + 1)

    def add(frag, task, tc, m, mb, deps, sp=None):
        calls.append(Call(frag, task, tc, dev(m), mb, sp, tuple(deps)))
        return len(calls) - 1

    pre = add("pre", "pre", 0, 0, None, []) if draw(st.booleans()) else None
    acc = None
    for mb in range(M):
        prev = [pre] if pre is not None else []
        fw = []
        for t in range(T):
            m = (mesh_of[t] + (mb if moving and t == 0 else 0)) % G
            fw.append(add(f"t{t}_fwd_{mb}", f"t{t}", 0, m, mb, prev))
            prev = [fw[-1]]
        for t in reversed(range(T)):
            m = calls[fw[t]].devices[0] // 2
            b = add(f"t{t}_bwd_{mb}", f"t{t}", 1, m, mb, prev + [fw[t]],
                    "activation" if split else None)
            if split:
                add(f"t{t}_bwd_w_{mb}", f"t{t}", 1, m, mb, [b, fw[t]], "weight")
            prev = [b]
        acc = add(f"acc_{mb}", "acc", 0, 0, None, prev + ([acc] if acc is not None else []))
    return calls


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=programs(), name=st.sampled_from(BUILTIN))
def test_random_programs_get_valid_schedules(calls, name):
    units, devices = units_from_calls(calls)
    if fits(units, name):
        check_valid(build_schedule(units, name, devices=devices))


# ------------------------------------------------------------------ stages


def test_stages_from_forward_runs():
    def call(task, dev, tc=0, mb=0, deps=()):
        return Call(f"{task}_{tc}_{mb}", task, tc, dev, mb, None, deps)

    # embed+layer1 on one submesh, layer2+loss on the next: two stages.
    calls = [call("embed", (0,)), call("layer1", (0,), deps=(0,)), call("layer2", (1,), deps=(1,)),
             call("loss", (1,), deps=(2,)), call("loss", (1,), 1, deps=(3,)),
             call("layer1", (0,), 1, deps=(4,))]
    units, devices = units_from_calls(calls)
    assert devices == [(0,), (1,)]
    assert [u.stage for u in units] == [0, 0, 1, 1, 1, 0]
    assert [u.kind for u in units] == ["fwd", "fwd", "fwd", "fwd", "bwd", "bwd"]
    # Round-robin over two submeshes: four stages, two per submesh (interleaving).
    calls = [call(f"l{k}", (k % 2,), deps=(k - 1,) if k else ()) for k in range(4)]
    units, _ = units_from_calls(calls)
    assert [(u.stage, u.mesh) for u in units] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    with pytest.raises(ScheduleError, match="interleave=1, but submesh 0 runs 2 pipeline"):
        build_schedule(units, "1f1b", interleave=1)
    build_schedule(units, "1f1b", interleave=2)


def test_split_calls_become_bwd_and_bwd_w():
    calls = [Call("f", "t", 0, (0,), 0), Call("ba", "t", 1, (0,), 0, "activation", (0,)),
             Call("bw", "t", 1, (0,), 0, "weight", (0, 1))]
    units, _ = units_from_calls(calls)
    assert [(u.kind, u.split) for u in units] == [("fwd", False), ("bwd", True),
                                                  ("bwd_w", False)]


# ------------------------------------------------------------------ custom schedules


def test_custom_reproduces_1f1b():
    units = pipeline_units(4, 8)
    custom = [[(int(t[1:]), f"stage{r}" if t[0] == "F" else f"stage{r}_bwd")
               for t in row.split()] for r, row in enumerate(ONE_F_ONE_B_4x8)]
    s = build_schedule(units, "custom", custom=custom)
    assert rows(s) == ONE_F_ONE_B_4x8
    assert build_schedule(units, None, custom=custom).name == "custom"


def test_custom_bare_names_count_microbatches():
    units = pipeline_units(2, 2)
    s = build_schedule(units, "custom", custom=[["stage0", "stage0", "stage0_bwd", "stage0_bwd"],
                                                ["stage1", "stage1_bwd", "stage1", "stage1_bwd"]])
    assert rows(s) == ["F0 F1 B0 B1", "F0 B0 F1 B1"]
    assert canonicalize_custom_schedule([["a", [0, "b"], "a", "b"]], 2) == \
        [[(0, "a"), (0, "b"), (1, "a"), (1, "b")]]


@pytest.mark.parametrize("custom,msg", [
    ([["stage0", "stage0_bwd", "stage0_bwd"], ["stage1", "stage1", "stage1_bwd", "stage1_bwd"]],
     "task 'stage0' has 1 microbatches in custom_schedule row 0, but there are 2 microbatches"),
    ([["stage0", "stage0", "stage0_bwd", "stage0_bwd"], ["stage1", "stage1"]],
     "task 'stage1_bwd' has 0 microbatches in custom_schedule row 1, but there are 2"),
    ([["stage0", "stage0", "stage0_bwd", "stage0_bwd"],
      ["stage1", "stage1", "stage1_bwd", "stage1_bwd", "nope", "nope"]],
     "custom_schedule row 1 entry 4 names 'nope', which is not a task of submesh 1 "
     "(its tasks: stage1, stage1_bwd)"),
    # a misspelling is named as such (it used to read as a count), with the closest name
    ([["stage0", "stage0", "stage0_bwd", "stage0_bdw"], ["stage1", "stage1_bwd"] * 2],
     "custom_schedule row 0 entry 3 names 'stage0_bdw', which is not a task of submesh 0 "
     "(its tasks: stage0, stage0_bwd); did you mean 'stage0_bwd'?"),
    # a task of another submesh
    ([["stage0", "stage0", "stage0_bwd", "stage0_bwd"], ["stage1", "stage1_bwd"] * 2 + ["stage0"]],
     "custom_schedule row 1 entry 4 names 'stage0', which is not a task of submesh 1 "
     "(its tasks: stage1, stage1_bwd); it runs on submesh 0"),
    ([["stage0", "stage0", "stage0_bwd", "stage0_bwd"]],
     "custom_schedule has 1 rows for 2 submeshes; give one row per submesh"),
    # an extra row is counted before its contents are read
    ([["stage0", "stage0", "stage0_bwd", "stage0_bwd"], ["stage1", "stage1_bwd"] * 2, ["x"]],
     "custom_schedule has 3 rows for 2 submeshes"),
    ([], "custom_schedule is empty; give one row per submesh"),
    ([[(0, "stage0"), (0, "stage0"), "stage0_bwd", "stage0_bwd"], []],
     "task 'stage0' appears twice for microbatch 0 in custom_schedule row 0"),
    ([[(5, "stage0")], []], "microbatch 5 of task 'stage0' is out of range"),
    ([[3.5], []], "custom_schedule row 0 has entry 3.5; entries are task names or (microbatch, "
                  "task name) pairs."),
    ("stage0", "custom_schedule must be a list of rows"),
    ([["stage0", "stage0_bwd", "stage0", "stage0_bwd"],
      [(1, "stage1"), (1, "stage1_bwd"), (0, "stage1"), (0, "stage1_bwd")]],
     "custom schedule deadlocks: row 0 runs 'stage0_bwd' microbatch 0 before its input "
     "'stage1_bwd' microbatch 0 (row 1) can be computed"),
])
def test_custom_schedule_errors(custom, msg):
    with pytest.raises(ScheduleError) as e:
        build_schedule(pipeline_units(2, 2), "custom", custom=custom)
    assert msg in str(e.value)
    assert isinstance(e.value, ValueError)


def test_custom_with_other_schedule_is_an_error():
    with pytest.raises(ScheduleError, match="When custom_schedule is provided, schedule must be "
                                            "'custom' or None, but got 'gpipe'"):
        build_schedule(pipeline_units(2, 2), "gpipe", custom=[["stage0"]])


def test_unknown_schedule_lists_choices():
    with pytest.raises(ScheduleError, match="unknown schedule 'zero-bubble-h3'; valid schedules: "
                                            "1f1b, circular-reversed-backward, custom, "
                                            "dualpipe-v, eager-1f1b, gpipe, gpipe-1f1b-last, "
                                            "interleaved-1f1b, interleaved-gpipe, kimi-k2, "
                                            "zero-bubble-h1, zero-bubble-h2, zero-bubble-v"):
        build_schedule(pipeline_units(2, 2), "zero-bubble-h3")


# ------------------------------------------------------------------ the pass


def mpmd_module(units: list[Unit], config: str | None = None) -> str:
    """A loop-form module whose body calls one fragment per unit of microbatch 0.

    ``units`` is a whole pipeline (every microbatch, as ``pipeline_units`` makes it);
    the body is its first microbatch and ``mm.num_microbatches`` the count.
    """
    M = len({u.microbatch for u in units})
    units = [u for u in units if u.microbatch == 0]
    users = {d for u in units for d in u.deps}
    roots = [u for u in units if not u.deps]
    lines = [f"module attributes {{{config}}} {{" if config else "module {"]
    args = ", ".join(f"%arg{k}: tensor<4xf32>" for k in range(len(roots)))
    lines.append(f"  func.func @main({args}) {{")
    lines.append(f"    stablehlo.custom_call @mm.microbatch_loop("
                 f"{', '.join(f'%arg{k}' for k in range(len(roots)))}) {{mm.body = "
                 f"@microbatch_loop, mm.num_microbatches = {M} : i64}} : "
                 f"({', '.join('tensor<4xf32>' for _ in roots)}) -> ()")
    lines.append("    return")
    lines.append("  }")
    root_arg = {u.index: k for k, u in enumerate(roots)}
    body_args = ", ".join(f"%b{k}: tensor<4xf32>" for k in range(len(roots)))
    lines.append(f"  func.func private @microbatch_loop(%i: tensor<i32>, {body_args}) {{")
    for u in units:
        ops = [f"%v{d}" for d in u.deps] or [f"%b{root_arg[u.index]}"]
        ty = ", ".join("tensor<4xf32>" for _ in ops)
        lines.append(f"    %v{u.index} = call @f{u.index}({', '.join(ops)}) {{mm.fragment}} : "
                     f"({ty}) -> tensor<4xf32>")
    lines.append("    return")
    lines.append("  }")
    for u in units:
        n = max(1, len(u.deps))
        params = ", ".join(f"%a{k}: tensor<4xf32>" for k in range(n))
        tc = {"fwd": 0, "bwd": 1, "bwd_w": 1}[u.kind]
        split = (', mm.split = "weight"' if u.kind == "bwd_w"
                 else ', mm.split = "activation"' if u.split else "")
        lines.append(f"  func.func private @f{u.index}({params}) -> tensor<4xf32> attributes "
                     f"{{mm.devices = [{2 * u.mesh}, {2 * u.mesh + 1}]{split}, mm.task = "
                     f'{{name = "{u.task}", transpose_count = {tc} : i64, loop = 0 : i64}}}} {{')
        lines.append("    return %a0 : tensor<4xf32>")
        lines.append("  }")
    del users
    lines.append("}")
    return "\n".join(lines)


def run_pass(text: str, **options):
    module = parse_module(text)
    ScheduleFragmentsPass(**options).apply(module)
    return module


@pytest.mark.parametrize("name", BUILTIN)
@pytest.mark.parametrize("P,M,V,split", [(4, 8, 1, False), (2, 4, 2, False), (3, 5, 1, True)])
def test_pass_matches_schedule(name, P, M, V, split):
    units = pipeline_units(P, M, interleave=V, split_backward=split)
    if not fits(units, name):
        with pytest.raises(DiagnosticError, match=f"schedule '{name}' needs"):
            run_pass(mpmd_module(units), schedule=name)
        return
    if name in ("interleaved-1f1b", "interleaved-gpipe") and V == 1:  # nothing to interleave
        with pytest.warns(DiagnosticWarning, match="has nothing to interleave: each of the "
                                                   f"{P} submeshes runs one pipeline stage"):
            module = run_pass(mpmd_module(units), schedule=name)
    elif name.startswith("zero-bubble") and not split:  # no weight half: 1F1B's order
        with pytest.warns(DiagnosticWarning, match="has no weight-gradient half to defer"):
            module = run_pass(mpmd_module(units), schedule=name)
    else:
        module = run_pass(mpmd_module(units), schedule=name)
    got = read_schedule(module)
    want = build_schedule(units, name)
    assert got.name == want.name
    assert rows(got) == rows(want)
    assert got.devices == tuple((2 * m, 2 * m + 1) for m in range(P))
    check_valid(got)
    # the recorded global order is the schedule's, and the module still verifies
    assert got.order == want.order
    assert module.operation.verify()
    if name == "1f1b" and (P, M, V) == (4, 8, 1):
        assert rows(got) == ONE_F_ONE_B_4x8


def test_pass_options_override_config_and_read_custom_file(tmp_path):
    units = pipeline_units(2, 2)
    text = mpmd_module(units, 'mm.schedule_config = {schedule = "gpipe"}')
    assert rows(read_schedule(run_pass(text))) == ["F0 F1 B0 B1"] * 2
    assert rows(read_schedule(run_pass(text, schedule="1f1b"))) == ["F0 F1 B0 B1",
                                                                   "F0 B0 F1 B1"]
    path = tmp_path / "custom.json"
    path.write_text(json.dumps([["stage0", "stage0", [1, "stage0_bwd"], [0, "stage0_bwd"]],
                                ["stage1", "stage1_bwd", "stage1", "stage1_bwd"]]))
    s = read_schedule(run_pass(text, schedule="custom", custom_schedule_file=str(path)))
    assert rows(s) == ["F0 F1 B1 B0", "F0 B0 F1 B1"]
    with pytest.raises(DiagnosticError, match="must be 'custom' or None, but got '1f1b'"):
        run_pass(text, schedule="1f1b", custom_schedule_file=str(path))
    with pytest.raises(DiagnosticError, match="cannot read custom schedule file"):
        run_pass(text, schedule="custom", custom_schedule_file=str(tmp_path / "missing.json"))
    with pytest.raises(DiagnosticError, match="schedule 'custom' needs a custom schedule"):
        run_pass(text, schedule="custom")
    with pytest.raises(DiagnosticError, match="interleave=2, but submesh 0 runs 1"):
        run_pass(text, interleave=2)


def test_one_check_of_a_custom_schedules_form(tmp_path):
    """``microbatch(custom_schedule=...)`` and the pass's JSON file are checked by one
    function (``check_custom_rows``): the same rows fail with the same sentence, typed
    where the failure is known (no message re-wrapped on its way)."""
    import multimesh.jax as mm
    from multimesh.schedules import ScheduleTypeError

    text = mpmd_module(pipeline_units(2, 2))
    path = tmp_path / "custom.json"
    for rows, cls, message in [
        ([["stage0"], ["stage1", 3.5]], ScheduleTypeError,
         "custom_schedule row 1 has entry 3.5; entries are task names or (microbatch, task "
         "name) pairs."),
        ([], ScheduleError,
         "custom_schedule is empty; give one row per submesh, in the order the program "
         "first uses them, each listing that submesh's tasks once per microbatch. For "
         "example: [['s0', 's0', 's0_bwd', 's0_bwd'], ['s1', 's1_bwd', 's1', 's1_bwd']] "
         "for 2 microbatches."),
    ]:
        with pytest.raises(cls) as front:
            mm.microbatch(lambda x: x, dim=0, size=2, custom_schedule=rows)
        assert type(front.value) is cls and str(front.value) == message
        path.write_text(json.dumps(rows))
        with pytest.raises(DiagnosticError) as in_pass:
            run_pass(text, schedule="custom", custom_schedule_file=str(path))
        assert in_pass.value.message == message
    with pytest.raises(ScheduleError) as e:  # needs the microbatch count: when it is known
        canonicalize_custom_schedule([["a", (2, "a")]], 2)
    assert type(e.value) is ScheduleError and str(e.value) == (
        "custom_schedule row 0: microbatch 2 of task 'a' is out of range (there are 2 "
        "microbatches).")


def test_pass_from_pipeline_string():
    from multimesh.passes.pipeline import parse_pipeline

    module = parse_module(mpmd_module(pipeline_units(2, 3)))
    parse_pipeline("builtin.module(mm-schedule-fragments{schedule=1f1b,num-stages=2})").run(module)
    assert rows(read_schedule(module)) == ["F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]
    assert "mm.schedule = {name = \"1f1b\"" in print_module(module)


def test_schedule_round_trips_through_dict():
    s = build_schedule(pipeline_units(3, 4, split_backward=True), "zero-bubble-h1",
                       devices=[(0,), (1,), (2,)])
    t = Schedule.from_dict(json.loads(json.dumps(s.to_dict())))
    assert rows(t) == rows(s) and t.devices == s.devices
    assert t.bubble_fraction() == pytest.approx(s.bubble_fraction())
    assert live_activations(t) == live_activations(s)


# ------------------------------------------------------------------ seeing it

GANTT_1F1B_2x2 = """\
1f1b: 2 submeshes x 2 microbatches, makespan 9, bubble 33.3%
submesh 0 |F0 F1 .  .  B0 ---.  B1 ---
submesh 1 |.  F0 B0 ---F1 B1 ---.  ."""


def test_text_gantt():
    assert format_gantt(build_schedule(pipeline_units(2, 2), "1f1b")) == GANTT_1F1B_2x2


def test_visualize_prints_gantt(capsys):
    from multimesh.jax._analysis.visualize import visualize_schedule

    s = build_schedule(pipeline_units(2, 2), "1f1b")
    assert visualize_schedule(s) is None
    assert capsys.readouterr().out.strip() == GANTT_1F1B_2x2
    # From a module after the pass, from its text, from the dict, from a "compiled" object.
    module = run_pass(mpmd_module(pipeline_units(2, 2)), schedule="1f1b")

    class Compiled:
        def __init__(self, text):
            self._text = text

        def as_text(self):
            return self._text

    for obj in (module, print_module(module), s.to_dict(), Compiled(print_module(module))):
        visualize_schedule(obj)
        assert capsys.readouterr().out.strip() == GANTT_1F1B_2x2
    with pytest.raises(ValueError, match="no pipeline schedule"):
        visualize_schedule(parse_module("module {}"))


def test_visualize_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from multimesh.jax._analysis.visualize import visualize_schedule

    s = build_schedule(pipeline_units(4, 8, split_backward=True), "zero-bubble-h1",
                       devices=[(0, 1), (2, 3), (4, 5), (6, 7)])
    out = visualize_schedule(s, tmp_path / "zb.png")
    data = (tmp_path / "zb.png").read_bytes()
    assert out == str(tmp_path / "zb.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "zero-bubble-h1: 4 submeshes x 8 microbatches" in capsys.readouterr().out


def test_trace_json_one_track_per_submesh(tmp_path):
    from multimesh.runtime.trace import TraceRecorder, write_trace

    s = build_schedule(pipeline_units(4, 8), "1f1b", devices=[(0, 1), (2, 3), (4, 5), (6, 7)])
    tl = s.timeline()
    path = tmp_path / "trace.json"
    write_trace(tl.events(scale=1e-3), path)
    trace = json.loads(path.read_text())
    ev = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert sorted(tracks.values()) == [f"submesh {m} (devices {2 * m},{2 * m + 1})"
                                       for m in range(4)]
    slices = [e for e in ev if e["ph"] == "X"]
    assert len(slices) == len(s.units)
    assert {e["tid"] for e in slices} == set(tracks)
    for m, tid in enumerate(sorted(tracks)):
        mine = sorted((e for e in slices if e["tid"] == tid), key=lambda e: e["ts"])
        assert [e["name"].split()[-1] for e in mine] == ONE_F_ONE_B_4x8[m].split()
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-6 for a, b in zip(mine, mine[1:], strict=False))

    rec = TraceRecorder()
    with rec.span("submesh 0", "f mb0"):
        pass
    rec.record("submesh 1", "transfer x", 0.0, 0.5, cat="transfer", nbytes=16)
    t = rec.write(tmp_path / "rec.json")
    names = [e["args"]["name"] for e in t["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["submesh 0", "submesh 1"]
    x = [e for e in t["traceEvents"] if e["ph"] == "X"]
    assert x[1]["cat"] == "transfer" and x[1]["args"] == {"nbytes": 16}
    assert min(e["ts"] for e in x) == 0.0


# ------------------------------------------------------------------ P6


def test_p6():
    mod = load_tool("bench_schedules")
    res = mod.P6(shapes=((4, 8),))
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        assert res[f"P6/{name}/P4M8/bubble"] == pytest.approx(res[f"P6/{name}/P4M8/theory"])
    assert res["P6/zero-bubble-h1/P4M8/bubble"] < res["P6/1f1b/P4M8/bubble"]
    assert res["P6/1f1b/P4M8/peak_live"] == 4 and res["P6/gpipe/P4M8/peak_live"] == 8
    assert "zero-bubble-h1" in mod.format_table(mod.P6_rows(shapes=((2, 4),)))


def test_schedule_names_have_one_source():
    """Every place that lists the schedules lists exactly schedules.SCHEDULES and its
    aliases: the front end's error, microbatch's docstring and the pass option's doc
    (both made from the registry), and the schedules page; the pass's docstring points
    at its option rather than list them again."""
    import pathlib

    from multimesh.jax import _microbatch
    from multimesh.passes.schedule_fragments import ScheduleFragmentsPass
    from multimesh.passes.schedules import ALIASES, SPLIT_SCHEDULES, get_schedule

    assert _microbatch.SCHEDULES is SCHEDULES
    assert set(SPLIT_SCHEDULES) <= set(SCHEDULES)
    assert set(ALIASES.values()) <= set(SCHEDULES)
    passes_md = (pathlib.Path(__file__).parent.parent / "docs" / "passes.md").read_text()
    option = next(ln for ln in passes_md.splitlines() if ln.startswith("| `schedule`"))
    page = (pathlib.Path(__file__).parent.parent / "docs" / "schedules.md").read_text()
    assert "listed with\n    the ``schedule`` option below" in ScheduleFragmentsPass.__doc__
    for name in SCHEDULES:
        listed = get_schedule(name).describe()  # "name (traits): summary"
        assert f"\n    - {listed}\n" in _microbatch.microbatch.__doc__, name
        assert listed in option, name
        assert f'"{name}"' in page, name


def test_schedules_and_the_runtime_share_one_call_record():
    """Issue 32: one fragment call is one record (``multimesh._src.calls.Call``): the
    schedule library links calls by position, the runtime plan by value id, and the
    front end turns a plan's call into a schedule's with ``dataclasses.replace``."""
    import dataclasses

    from multimesh._src.calls import Call as Record
    from multimesh.passes import schedule_fragments
    from multimesh.runtime import plan

    assert Call is Record and plan.Call is Record and schedule_fragments.Call is Record
    assert not hasattr(schedule_fragments, "LoopCall")
    step = Record("f", devices=None, microbatch=1, args=[0], results=[1])
    unit = dataclasses.replace(step, task="t", devices=(0,), deps=(), args=(), results=())
    [u], meshes = units_from_calls([unit])
    assert (u.fragment, u.task, u.kind, u.microbatch, meshes) == ("f", "t", "fwd", 1, [(0,)])
