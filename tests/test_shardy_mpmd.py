"""Shardy:MPMD programs on multimesh's runtime, against multimesh tasks and plain jax.

The same 2-stage model goes three ways (``tools/sdy_mpmd.py``): written with
``named_computation``/``call`` and partitioned by jaxlib's own MPMD partitioner, then
run through :func:`multimesh.jax.compile_mpmd`; written with multimesh ``task``s under
``mjit``; and as plain ``jax.jit``. Values, gradients and where every array lives must
agree, for 2 stages and for 2 stages x 4 microbatches with 1F1B, on meshes of
different shapes. Shardy's front end is not installable here, so the programs are
lowered by the stand-in in ``tools/sdy_mpmd.py`` and go straight into
``jaxlib._sdy_mpmd``.
"""

from __future__ import annotations

import functools
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import PassFailure
from multimesh._src.mlir import make_context, parse_module
from multimesh.runtime import Executor, build_plan
from tests.tools import load_tool

ROOT = Path(__file__).resolve().parent.parent


S = load_tool("sdy_mpmd")

X4 = (("x", 4),)
X2Y2 = (("x", 2), ("y", 2))
CASES = {  # id -> (microbatches, partitioner schedule, m1 axes, m2 axes)
    "2stage-x4-x2y2": (1, None, X4, X2Y2),
    "2stage-x2y2-x4": (1, None, X2Y2, X4),
    "2x4-1f1b-x4-x2y2": (4, "1F1B", X4, X2Y2),
}


def _program(case: str):
    mb, schedule, m1, m2 = CASES[case]
    return S.TwoStage(mb, width=16, batch=8, m1=m1, m2=m2), schedule


def _where(x) -> dict[int, tuple]:
    """Device id -> the index of ``x`` that device holds (its shard layout)."""
    idx = x.sharding.devices_indices_map(x.shape)
    return {d.id: tuple((s.start, s.stop) for s in i) for d, i in idx.items()}


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


@functools.cache
def _three_ways(case: str):
    program, schedule = _program(case)
    params, xs = program.args()
    shardy = mm.compile_mpmd(program.partitioned(schedule), program.positions,
                             in_tree=jax.tree.structure((params, xs)),
                             out_tree=jax.tree.structure((0, (0, 0))))
    ours = mm.mjit(program.multimesh()).lower(params, xs).compile()
    return case, program, shardy, ours, (params, xs)


@pytest.fixture(params=sorted(CASES))
def three_ways(request):
    return _three_ways(request.param)


def test_values_and_gradients_agree(three_ways):
    _, program, shardy, ours, args = three_ways
    want = jax.jit(program.plain())(*args)
    got = shardy(*args)
    mine = ours(*args)
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(mine), jax.tree.leaves(want)):
        _close(a, c)
        _close(b, c)
    # a second step with other values: nothing is baked in
    params2, xs2 = program.args(seed=1)
    for a, c in zip(jax.tree.leaves(shardy(params2, xs2)),
                    jax.tree.leaves(jax.jit(program.plain())(params2, xs2))):
        _close(a, c)


def test_arrays_live_where_both_partitioners_put_them(three_ways):
    _, program, shardy, ours, args = three_ways
    m1 = set(program.positions["m1"])
    m2 = set(program.positions["m2"])
    loss, (dw1, dw2) = shardy(*args)
    assert {d.id for d in loss.devices()} == m2
    assert {d.id for d in dw1.devices()} == m1
    assert {d.id for d in dw2.devices()} == m2
    # the same shard on the same device as multimesh's own partitioning
    for a, b in zip(jax.tree.leaves((loss, (dw1, dw2))), jax.tree.leaves(ours(*args))):
        assert _where(a) == _where(b)
    # and what the compiled program declares is what it returns
    for a, s in zip(jax.tree.leaves((loss, (dw1, dw2))), jax.tree.leaves(shardy.output_shardings)):
        assert a.sharding.is_equivalent_to(s, a.ndim)
    # inputs: each weight on its stage's mesh, laid out as multimesh lays it out; the
    # batch on m1 split over m1's first axis (multimesh's microbatched step takes the
    # whole batch replicated and slices it inside, so only its devices are compared)
    s_in, o_in = shardy.input_shardings[0], ours.input_shardings[0]
    assert {d.id for d in s_in[0][0].device_set} == m1
    assert {d.id for d in s_in[0][1].device_set} == m2
    for a, b in zip(s_in[0], o_in[0]):
        assert a.is_equivalent_to(b, 2)
    assert s_in[1].device_set == o_in[1].device_set
    assert s_in[1].spec == P(None, program.m1[0][0], None)


def test_1f1b_order_is_the_partitioners():
    _, _, shardy, _, _ = _three_ways("2x4-1f1b-x4-x2y2")
    frags = {f["name"]: f for f in shardy.fragments}
    rows: dict[tuple, list[str]] = {}
    for step in shardy.plan_data.steps:
        if hasattr(step, "fragment"):
            f = frags[step.fragment]
            rows.setdefault(tuple(f["devices"]), []).append(
                "F" if f["direction"] == "fwd" else "B")
    # 1F1B after a warm-up of (stages - stage) forwards; Shardy runs microbatch 0's
    # backward last, merged with the gradient sum over microbatches.
    assert ["".join(r) for r in rows.values()] == ["FFFBFBBB", "FFBFBFBB"]
    assert len(shardy.transfers) == 8
    # identical microbatches share one fragment (compiled once)
    assert len(frags) == 7


def test_mm_opt_output_runs_on_the_runtime(tmp_path):
    """The golden inputs, imported by the mm-opt CLI, run through build_plan + Executor."""
    from multimesh.tools.mm_opt import main

    gen = load_tool("gen_import_mpmd_inputs")
    for name, (mb, _) in gen.CASES.items():
        out = tmp_path / f"{name}.out"
        src = ROOT / "tests" / "filecheck" / "Inputs" / name
        pipeline = "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7},mm-verify)"
        assert main([str(src), "-p", pipeline, "-o", str(out)]) == 0
        plan = build_plan(parse_module(out.read_text(), make_context()))
        program = S.TwoStage(mb, width=8, batch=16, m1=gen.M1, m2=gen.M2)
        params, xs = program.args()
        got = Executor(plan, tuple(jax.devices()))(*jax.tree.leaves((params, xs)))
        for a, c in zip(got, jax.tree.leaves(jax.jit(program.plain())(params, xs))):
            _close(a, c)


@pytest.mark.skipif(
    jax.__version__ != "0.10.2",
    reason="the saved inputs are jaxlib 0.10.2's partitioner output (the CI version); newer "
           "jax lowers the same program to different text (e.g. tanh's derivative), while "
           "the tests above check that the programs agree on every version")
def test_golden_inputs_up_to_date():
    gen = load_tool("gen_import_mpmd_inputs")
    with redirect_stdout(io.StringIO()) as out:
        assert gen.main(["--check"]) == 0, out.getvalue()


# --------------------------------------------------------------------------- the entry point

REDUCE = """
module {
  func.func public @main(%x: tensor<8xf32>, %y: tensor<8xf32>) -> tensor<8xf32> {
    %a = mpmd.named_computation<"left"> (%x) (%p: tensor<8xf32>) {
      %0 = stablehlo.sine %p : tensor<8xf32>
      mpmd.return %0 : tensor<8xf32>
    } : (tensor<8xf32>) -> tensor<8xf32>
    %b = mpmd.named_computation<"right"> (%y) (%p: tensor<8xf32>) {
      %0 = stablehlo.cosine %p : tensor<8xf32>
      mpmd.return %0 : tensor<8xf32>
    } : (tensor<8xf32>) -> tensor<8xf32>
    %r = mpmd.reduce<add> %a, %b : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    %d = mpmd.named_computation<"right"> (%r) (%p: tensor<8xf32>) {
      %0 = stablehlo.multiply %p, %p : tensor<8xf32>
      mpmd.return %0 : tensor<8xf32>
    } : (tensor<8xf32>) -> tensor<8xf32>
    return %d : tensor<8xf32>
  }
}
"""


def test_cross_mesh_reduce_runs_once_partitioned():
    """The partitioner turns a cross-mesh ``mpmd.reduce`` into a transfer and a fragment."""
    text = S.partition(REDUCE, {"m1": (("x", 2),), "m2": (("x", 2),)},
                       {"left": "m1", "right": "m2"})
    assert "mpmd.reduce" not in text
    devices = jax.devices()
    meshes = {"m1": Mesh(np.array(devices[4:6]), ("x",)),
              "m2": Mesh(np.array(devices[6:8]), ("x",))}
    compiled = mm.compile_mpmd(parse_module(text, make_context()), meshes)
    x, y = jnp.linspace(0, 1, 8), jnp.linspace(1, 2, 8)
    (out,) = compiled(x, y)
    _close(out, (jnp.sin(x) + jnp.cos(y)) ** 2)
    assert {d.id for d in out.devices()} == {6, 7}
    assert [f["devices"] for f in compiled.fragments] == [[4, 5], [6, 7]]


def test_compiled_interface():
    program = S.TwoStage(1, width=8, batch=8, m1=X4, m2=X2Y2)
    compiled = mm.compile_mpmd(program.partitioned(), {"m1": [0, 1, 2, 3], "m2": range(4, 8)})
    params, xs = program.args()
    flat = jax.tree.leaves((params, xs))
    assert len(compiled.input_shardings[0]) == 3  # flat by default
    loss, dw1, dw2 = compiled(*flat)  # a tuple, one per @main result
    want_loss, (want1, want2) = jax.jit(program.plain())(params, xs)
    _close(loss, want_loss)
    _close(dw1, want1)
    assert "p0_stage1_fwd" in compiled.plan() and "transfer" in compiled.plan()
    assert [(f["task"], f["direction"]) for f in compiled.fragments] == [
        ("stage1", "fwd"), ("stage2", "fwd"), ("stage2", "bwd"), ("stage1", "bwd")]
    assert len(compiled.transfers) == 2
    assert "mm.fragment_call" in compiled.as_text() and "mpmd." not in compiled.as_text()
    profiled = compiled.profile(*flat)
    _close(profiled[0], want_loss)


SCALE = """
module {
  func.func public @main(%x: tensor<8xf32>, %y: tensor<8xf32>) -> (tensor<8xf32>, tensor<8xf32>) {
    %a = mpmd.named_computation<"a"> (%x) (%p: tensor<8xf32>) {
      %0 = stablehlo.add %p, %p : tensor<8xf32>
      mpmd.return %0 : tensor<8xf32>
    } : (tensor<8xf32>) -> tensor<8xf32>
    %b = mpmd.named_computation<"a"> (%y) (%p: tensor<8xf32>) {
      %0 = stablehlo.add %p, %p : tensor<8xf32>
      mpmd.return %0 : tensor<8xf32>
    } : (tensor<8xf32>) -> tensor<8xf32>
    return %a, %b : tensor<8xf32>, tensor<8xf32>
  }
}
"""


def test_donated_arguments_are_donated():
    """An argument the partitioner was told to donate is donated; the others are not."""
    text = S.partition(SCALE, {"m1": (("x", 2),)}, {"a": "m1"}, donate_argnums=(0,))
    compiled = mm.compile_mpmd(text, {"m1": (2, 3)})
    x, y = (jax.device_put(jnp.arange(8.0), s) for s in compiled.input_shardings[0])
    a, b = compiled(x, y)
    _close(a, 2 * jnp.arange(8.0))
    _close(b, 2 * jnp.arange(8.0))
    assert x.is_deleted() and not y.is_deleted()


MISMATCH = """
!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{"x"}]>>
!r1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>>
module {
  sdy.mesh @mesh = <["x"=4]>
  func.func public @main(%arg0: !m1) -> !r1 attributes {topology = #mpmd.topology<<"m1" : <["x"=4]>>>} {
    %0 = mpmd.fragment_call<mesh="m1", origin=["a"]> @f(%arg0) : (!m1) -> !r1
    return %0 : !r1
  }
  func.func @f(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mesh_shape = #sdy.mesh<["x"=4]>} {
    return %arg0 : tensor<8xf32>
  }
}
"""


def test_pass_diagnostics_come_with_a_repro(tmp_path, monkeypatch):
    """A module the pass rejects fails with its diagnostic and an mm-opt line that
    replays it (the mesh map travels in the saved module as ``mm.meshes``)."""
    import shlex
    import subprocess

    monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path))
    with pytest.raises(PassFailure, match=r"(?s)multimesh pass 'mm-import-mpmd' failed: "
                       r"operand #0 of the call of '@f' is laid out as .*"
                       r"Reproduce with:\n  mm-opt ") as e:
        mm.compile_mpmd(MISMATCH, {"m1": range(4)})
    assert e.value.pass_argument == "mm-import-mpmd"
    proc = subprocess.run([sys.executable, "-m", "multimesh.tools.mm_opt",
                           *shlex.split(e.value.repro)[1:]], capture_output=True, text=True)
    assert proc.returncode == 1 and "operand #0 of the call of '@f'" in proc.stderr, \
        proc.stderr


# --------------------------------------------------------------------------- the schedule

# The partitioner's own 1F1B order, per mesh, from the call counters it logs as it
# lowers to fragment calls ("p2_stage0_fwd_calls1to3.loss ... call counter 2"):
# microbatch 0's backward runs last on both meshes, merged with the gradient sum.
SHARDY_1F1B = [["F0", "F1", "F2", "B1", "F3", "B2", "B3", "B0"],
               ["F0", "F1", "B1", "F2", "B2", "F3", "B3", "B0"]]


# The partitioner's schedules, in the order its log gives (the call counters it logs
# per mesh as it lowers to fragment calls, checked by hand: its log is off under
# pytest). Circular with reversed backward runs the backwards of microbatches 3, 2, 1
# under one fragment it names `..._calls3from1`.
SHARDY_ORDERS = {
    "1F1B": SHARDY_1F1B,
    "GPipe": [["F0", "F1", "F2", "F3", "B1", "B2", "B3", "B0"]] * 2,
    "CircularWithReversedBackward": [["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]] * 2,
    "GPipeBut1F1BForLastMesh": [["F0", "F1", "F2", "F3", "B1", "B2", "B3", "B0"],
                                ["F0", "F1", "B1", "F2", "B2", "F3", "B3", "B0"]],
}


@pytest.mark.parametrize("schedule", sorted(SHARDY_ORDERS))
def test_recovered_order_is_the_partitioners(schedule):
    program = S.TwoStage(4, width=16, batch=8, m1=X4, m2=X2Y2)
    compiled = mm.compile_mpmd(program.partitioned(schedule), program.positions)
    params, xs = program.args()
    got = compiled(*jax.tree.leaves((params, xs)))
    for a, c in zip(got, jax.tree.leaves(jax.jit(program.plain())(params, xs))):
        _close(a, c)
    assert {d.id for d in got[1].devices()} == set(program.positions["m1"])
    sched = compiled.schedule
    assert sched.labels() == SHARDY_ORDERS[schedule]


def _golden_1f1b(text: str | None = None):
    """The saved 1F1B input, compiled, with its program and arguments."""
    gen = load_tool("gen_import_mpmd_inputs")
    mb, _ = gen.CASES["import_mpmd_1f1b.mlir"]
    program = S.TwoStage(mb, width=8, batch=16, m1=gen.M1, m2=gen.M2)
    if text is None:
        text = (ROOT / "tests" / "filecheck" / "Inputs" / "import_mpmd_1f1b.mlir").read_text()
    compiled = mm.compile_mpmd(text, {"m1": range(4), "m2": range(4, 8)})
    params, xs = program.args()
    got = compiled(*jax.tree.leaves((params, xs)))
    for a, c in zip(got, jax.tree.leaves(jax.jit(program.plain())(params, xs))):
        _close(a, c)
    assert {d.id for d in got[1].devices()} == {0, 1, 2, 3}  # dw1 on m1
    assert {d.id for d in got[2].devices()} == {4, 5, 6, 7}  # dw2 on m2
    return compiled


def test_imported_program_has_the_partitioners_schedule(tmp_path):
    """``compiled.schedule``, ``calls_per_submesh()`` and ``visualize_schedule`` work
    for a program from Shardy:MPMD: the order recovered from its calls is the
    partitioner's (its logged call counters), directions from the origins' transpose
    counts, submeshes from its meshes."""
    pytest.importorskip("matplotlib")
    _, program, shardy, _, args = _three_ways("2x4-1f1b-x4-x2y2")
    for a, c in zip(jax.tree.leaves(shardy(*args)),
                    jax.tree.leaves(jax.jit(program.plain())(*args))):
        _close(a, c)
    sched = shardy.schedule
    assert sched.name == "shardy-mpmd" and sched.num_microbatches == 4
    assert sched.labels() == SHARDY_1F1B
    assert [tuple(d) for d in sched.devices] == [program.positions["m1"],
                                                program.positions["m2"]]
    per = shardy.calls_per_submesh()
    assert list(per) == [program.positions["m1"], program.positions["m2"]]
    for row, (_, labels) in zip(sched.rows(), per.items()):
        assert labels == [f"{u.fragment}@{u.microbatch}" for u in row]
    assert per[program.positions["m1"]][:3] == [
        "p0_stage0_fwd_call0.loss@0", "p2_stage0_fwd_calls1to3.loss@1",
        "p2_stage0_fwd_calls1to3.loss@2"]
    png = tmp_path / "shardy.png"
    assert mm.visualize_schedule(shardy, png) == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_saved_input_recovers_the_same_schedule():
    """The saved partitioner output (tests/filecheck/Inputs) gives the same order."""
    compiled = _golden_1f1b()
    assert compiled.schedule.labels() == SHARDY_1F1B
    stages = {(u.kind, u.stage) for u in compiled.schedule.units if u.microbatch != 0}
    assert stages == {("fwd", 0), ("fwd", 1), ("bwd", 0), ("bwd", 1)}


def test_unpipelined_import_has_no_schedule():
    program = S.TwoStage(1, width=8, batch=8, m1=X4, m2=X2Y2)
    compiled = mm.compile_mpmd(program.partitioned(), {"m1": [0, 1, 2, 3], "m2": range(4, 8)})
    params, xs = program.args()
    got = compiled(*jax.tree.leaves((params, xs)))
    _close(got[0], jax.jit(program.plain())(params, xs)[0])
    assert compiled.schedule is None
    with pytest.raises(mm.errors.MultimeshValueError, match="no pipeline schedule"):
        mm.visualize_schedule(compiled)


def test_unnumbered_calls_stay_unnumbered_with_one_warning():
    """A call whose name lost its microbatch numbers is left unnumbered, not guessed."""
    text = (ROOT / "tests" / "filecheck" / "Inputs" / "import_mpmd_1f1b.mlir").read_text()
    text = text.replace("p2_stage0_fwd_calls1to3.loss", "p2_stage0_fwd.loss")
    with pytest.warns(mm.errors.MultimeshWarning) as record:
        compiled = _golden_1f1b(text)
    mine = [w for w in record if "microbatch number" in str(w.message)]
    assert len(mine) == 1
    assert "3 fragment calls of the imported program carry no microbatch number " \
        "(p2_stage0_fwd.loss)" in str(mine[0].message)
    assert compiled.schedule.labels()[0] == ["F0", "F*", "F*", "B1", "F*", "B2", "B3", "B0"]
    # the other stage's calls still get theirs, from the calls they read
    assert compiled.schedule.labels()[1] == SHARDY_1F1B[1]


def test_imported_trace_names_microbatches(tmp_path):
    import json

    _, program, shardy, _, args = _three_ways("2x4-1f1b-x4-x2y2")
    path = tmp_path / "shardy.json"
    out = shardy.profile(*args, trace_path=path)
    for a, c in zip(jax.tree.leaves(out), jax.tree.leaves(jax.jit(program.plain())(*args))):
        _close(a, c)
    events = json.loads(path.read_text())["traceEvents"]
    rows: dict[int, list[str]] = {}
    for e in events:
        if e.get("ph") == "X" and e["cat"] == "fragment":
            rows.setdefault(e["args"]["submesh"], []).append(e["name"].split()[1])
    assert [rows[0], rows[1]] == SHARDY_1F1B
    assert any(e["name"] == "p2_stage0_fwd_calls1to3.loss F1 (stage 0)" for e in events)
