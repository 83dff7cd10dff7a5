"""Step traces that read like the schedule picture (issue 23, item 3).

``compiled.profile(..., trace_path=...)`` names every fragment slice after its unit of
the schedule (fragment, direction and microbatch, stage), orders the tracks as
``visualize_schedule``'s rows (submesh 0 on top) and draws each transfer as a flow
from the call that made its value to the transfer on the receiving submesh. Every
profiled step is checked against plain jax (values, gradients, where they live).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh.jax._analysis.visualize import _row_label
from multimesh.runtime.trace import write_trace
from tests.models import tanh_chain

LETTER = {"fwd": "F", "bwd": "B", "bwd_w": "W"}


def _model(stages: int, meshes: int):
    """``stages`` tasks, stage ``k`` on submesh ``k % meshes`` (8 devices split evenly)."""
    return tanh_chain(stages, meshes)


@functools.cache
def _profiled(stages: int, meshes: int, schedule: str | None, tmp: str):
    loss, ws, per = _model(stages, meshes)
    x = jnp.linspace(-1, 1, 32 * 16).reshape(32, 16)
    f = jax.value_and_grad(loss) if schedule is None else \
        mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule=schedule)
    compiled = mm.mjit(f).lower(ws, x).compile()
    path = f"{tmp}/{stages}-{meshes}-{schedule}.json"
    out = compiled.profile(ws, x, trace_path=path)
    with mm.ignore_transforms():
        want = jax.value_and_grad(loss)(ws, x)
    np.testing.assert_allclose(out[0], want[0], rtol=1e-5)
    for k, (a, b) in enumerate(zip(out[1], want[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        m = k % meshes
        assert sorted(d.id for d in a.devices()) == list(range(per * m, per * m + per))
    with open(path) as fh:
        return compiled, json.load(fh)["traceEvents"]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("traces"))


def _tracks(events) -> list[str]:
    """Track names in display order (``thread_sort_index``)."""
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events
             if e.get("name") == "thread_sort_index"}
    return [names[t] for t in sorted(names, key=lambda t: (order[t], t))]


def _slices(events, cat=None):
    return [e for e in events if e.get("ph") == "X" and (cat is None or e["cat"] == cat)]


CASES = [(2, 2, "1f1b"), (4, 2, "interleaved-1f1b"), (2, 2, "zero-bubble-h1")]


@pytest.mark.parametrize("stages,meshes,schedule", CASES)
def test_every_call_names_its_microbatch_direction_and_stage(tmp, stages, meshes, schedule):
    compiled, events = _profiled(stages, meshes, schedule, tmp)
    sched = compiled.schedule
    calls = _slices(events, "fragment")
    assert len(calls) == len(compiled.calls)
    pipelined = [e for e in calls if e["args"]["microbatch"] is not None]
    assert len(pipelined) == len(sched.units)
    for e in pipelined:
        a = e["args"]
        assert e["name"] == (f"{a['fragment']} {LETTER[a['direction']]}{a['microbatch']} "
                             f"(stage {a['stage']})")
        assert a["direction"] in ("fwd", "bwd", "bwd_w")
    # eight microbatch-4 slices of one fragment would all read the same without labels
    names = [e["name"] for e in pipelined]
    assert len(set(names)) == len(names)
    if schedule == "zero-bubble-h1":
        assert {e["args"]["direction"] for e in pipelined} == {"fwd", "bwd", "bwd_w"}
    if schedule == "interleaved-1f1b":  # stage k on submesh k % 2: stages 0..3
        assert {(e["args"]["stage"], e["args"]["submesh"]) for e in pipelined} == {
            (k, k % meshes) for k in range(stages)}


@pytest.mark.parametrize("stages,meshes,schedule", CASES)
def test_each_track_runs_its_submeshs_schedule_in_order(tmp, stages, meshes, schedule):
    compiled, events = _profiled(stages, meshes, schedule, tmp)
    sched = compiled.schedule
    tids = {name: tid for tid, name in
            ((e["tid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name")}
    for m, row in enumerate(sched.rows()):
        ids = ",".join(str(compiled.record.devices[p].id) for p in sched.devices[m])
        mine = sorted((e for e in _slices(events, "fragment")
                       if e["tid"] == tids[f"submesh {m} (devices {ids})"]
                       and e["args"]["microbatch"] is not None), key=lambda e: e["ts"])
        got = [(e["args"]["fragment"], e["args"]["direction"], e["args"]["microbatch"],
                e["args"]["stage"]) for e in mine]
        assert got == [(u.fragment, u.kind, u.microbatch, u.stage) for u in row]
        assert all(e["args"]["submesh"] == m for e in mine)


def test_track_order_is_the_pictures(tmp, capsys):
    compiled, events = _profiled(2, 2, "1f1b", tmp)
    sched = compiled.schedule
    tracks = [t for t in _tracks(events) if t.startswith("submesh")]
    # the picture's rows, top to bottom: submesh 0 first (visualize_schedule draws row
    # m at height G - 1 - m and labels it _row_label(m))
    rows = [_row_label(sched, m).replace("\n", " ").replace("(", "(devices ")
            for m in range(sched.num_meshes)]
    assert tracks == rows == ["submesh 0 (devices 0,1,2,3)", "submesh 1 (devices 4,5,6,7)"]
    # the first call of the step (the backward's accumulator on submesh 1) used to put
    # submesh 1 first; tids follow the picture too, for viewers that ignore sort_index
    tid = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
    assert tid[rows[0]] < tid[rows[1]]
    mm.visualize_schedule(compiled)
    out = capsys.readouterr().out
    assert out.index("submesh 0") < out.index("submesh 1")


@pytest.mark.parametrize("stages,meshes,schedule", CASES)
def test_transfers_are_flows_from_sender_to_receiver(tmp, stages, meshes, schedule):
    compiled, events = _profiled(stages, meshes, schedule, tmp)
    slices = _slices(events)
    starts = {e["id"]: e for e in events if e.get("ph") == "s"}
    ends = {e["id"]: e for e in events if e.get("ph") == "f"}
    assert starts and set(starts) == set(ends)

    def inside(flow, cat):
        """The slice of category ``cat`` on the flow's track that holds its time."""
        hits = [e for e in slices if e["tid"] == flow["tid"] and e["cat"] == cat
                and e["ts"] <= flow["ts"] <= e["ts"] + e["dur"]]
        assert len(hits) == 1, (flow, hits)
        return hits[0]

    plan = compiled.plan_data
    made = {r: s for s in plan.calls() for r in s.results}
    transfers = _slices(events, "transfer")
    from_calls = [t for t in transfers if t["args"]["src"] in made]
    assert len(starts) == len(from_calls) > 0
    crossing = 0
    for n, s in starts.items():
        f = ends[n]
        assert f["bp"] == "e" and s["name"] == f["name"]
        sender, move = inside(s, "fragment"), inside(f, "transfer")
        # the call that made the moved value, on its own submesh's track
        assert plan.steps[sender["args"]["plan_step"]] is made[move["args"]["src"]]
        assert sender["args"]["submesh"] == move["args"]["from_submesh"]
        assert move["args"]["microbatch"] == sender["args"]["microbatch"]
        crossing += sender["tid"] != move["tid"]
    assert crossing == len(starts)  # every transfer here crosses submeshes


def test_a_step_without_microbatches_names_directions_and_stages(tmp):
    compiled, events = _profiled(2, 2, None, tmp)
    assert compiled.schedule is None
    names = [e["name"] for e in _slices(events, "fragment")]
    assert names == ["s0_fwd fwd (stage 0)", "s1_fwd fwd (stage 1)",
                     "s1_bwd bwd (stage 1)", "s0_bwd bwd (stage 0)"]
    assert _tracks(events) == ["submesh 0 (devices 0,1,2,3)", "submesh 1 (devices 4,5,6,7)"]


def test_the_runtime_record_keeps_its_plain_names(tmp):
    """``last_trace`` (what cost models read) keeps fragment names and gains arguments."""
    compiled, _ = _profiled(2, 2, "1f1b", tmp)
    calls = [e for e in compiled.last_trace.events if e[4].get("cat") is None]
    assert [e[1] for e in calls] == [c.fragment for c in compiled.plan_data.calls()]
    assert [e[4].get("microbatch") for e in calls] == \
        [c.microbatch for c in compiled.plan_data.calls()]


def test_write_trace_flows(tmp_path):
    ev = [("a", "x", 0.0, 1.0), ("b", "y", 1.0, 3.0)]
    t = write_trace(ev, tmp_path / "t.json", flows=[(0, 1)])
    s, f = (e for e in t["traceEvents"] if e["ph"] in "sf")
    assert (s["tid"], s["ts"], f["tid"], f["ts"]) == (1, 0.5e6, 2, 2.0e6)
    assert s["id"] == f["id"] and f["bp"] == "e"
    with pytest.raises(ValueError, match="names an event that is not in the trace"):
        write_trace(ev, tmp_path / "u.json", flows=[(0, 2)])


def test_a_plain_jit_program_traces_as_submesh_0(tmp_path):
    """A program with no task runs as one jitted call (the fast path): one slice on
    one track, named as the MPMD traces name theirs."""
    f = mm.mjit(lambda x: jnp.sin(x) * 2)
    x = jnp.linspace(0, 1, 8)
    compiled = f.lower(x).compile()
    assert compiled.fast_path
    out = compiled.profile(x, trace_path=tmp_path / "fast.json")
    np.testing.assert_allclose(out, jnp.sin(x) * 2, rtol=1e-6)
    events = json.loads((tmp_path / "fast.json").read_text())["traceEvents"]
    ids = ",".join(str(d.id) for d in sorted(out.devices(), key=lambda d: d.id))
    assert _tracks(events) == [f"submesh 0 (devices {ids})"]
    assert [e["name"] for e in _slices(events)] == ["fast_path"]
