"""Microbatching and pipeline schedules end to end (issue 5 acceptance)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import MultimeshError
from tests.models import tanh_chain

SCHEDULES = ["gpipe", "1f1b", "zero-bubble-h1"]


def _pipeline(stages: int):
    return tanh_chain(stages)


def _check(out, ref):
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    for a, b in zip(out[1], ref[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8)])
def test_microbatched_grads_equal_full_batch(schedule, stages, micro):
    loss, ws, per = _pipeline(stages)
    x = jnp.linspace(-1, 1, 8 * micro * 16).reshape(8 * micro, 16)
    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(ws, x)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule=schedule)
    compiled = mm.mjit(f).lower(ws, x).compile()
    out = compiled(ws, x)
    _check(out, ref)
    for k, g in enumerate(out[1]):
        assert sorted(d.id for d in g.devices()) == list(range(per * k, per * k + per))
    sched = compiled.schedule
    assert sched is not None and len(sched.orders) == stages


def _labels(compiled):
    return compiled.schedule.labels()


def _four_stage_schedules(*names: str) -> dict:
    """The compiled schedule of a 4-stage pipeline over 8 microbatches, per schedule name."""
    loss, ws, _ = _pipeline(4)
    x = jnp.ones((64, 16))
    out = {}
    for s in names:
        f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule=s)
        out[s] = mm.mjit(f).lower(ws, x).compile().schedule
    return out


def test_gpipe_and_1f1b_orders_are_textbook():
    orders = _four_stage_schedules("gpipe", "1f1b")
    P_, M = 4, 8
    for row in orders["gpipe"].rows():
        kinds = [(u.kind, u.microbatch) for u in row if not u.free]
        assert kinds == [("fwd", m) for m in range(M)] + [("bwd", m) for m in range(M)]
    for stage, row in enumerate(orders["1f1b"].rows()):
        kinds = [(u.kind, u.microbatch) for u in row if not u.free]
        warm = P_ - stage
        want = [("fwd", m) for m in range(warm)]
        f, b = warm, 0
        while b < M:
            want.append(("bwd", b))
            b += 1
            if f < M:
                want.append(("fwd", f))
                f += 1
        assert kinds == want, (stage, kinds)


def test_zero_bubble_has_a_smaller_bubble_than_1f1b():
    bubbles = {s: sched.bubble_fraction()
               for s, sched in _four_stage_schedules("1f1b", "zero-bubble-h1").items()}
    assert bubbles["zero-bubble-h1"] < bubbles["1f1b"]
    # theory (P-1)/(M+P-1) = 3/11; the input-slicing fragment adds one unit step
    assert bubbles["1f1b"] == pytest.approx(3 / 11, abs=0.02)


def test_live_activations_bounds():
    live = {s: sched.live_activations()
            for s, sched in _four_stage_schedules("gpipe", "1f1b").items()}
    assert max(live["1f1b"]) <= 4
    assert max(live["gpipe"]) == 8


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_each_fragment_compiles_once_and_runs_per_microbatch():
    from multimesh.runtime import executor

    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    executor._COMPILE_CACHE.clear()
    before = executor.xla_compiles
    compiled = mm.mjit(f).lower(ws, x).compile()
    names = sorted(fr["name"] for fr in compiled.fragments)
    # one forward and one backward per stage: the zero accumulators the runs start
    # from (the IR's s*_acc_init) are put on the devices by the runtime, not compiled
    assert names == ["s0_bwd", "s0_fwd", "s1_bwd", "s1_fwd"]
    assert executor.xla_compiles - before == len(names)
    zeros = sorted((lay[0], t) for t, lay in compiled.plan_data.zeros.values())
    assert zeros == [((0, 1, 2, 3), ((16, 16), "f32")), ((4, 5, 6, 7), ((), "f32")),
                     ((4, 5, 6, 7), ((16, 16), "f32"))]  # grads of ws; the loss
    per = compiled.calls_per_submesh()
    assert per[(0, 1, 2, 3)] == ["s0_fwd@0", "s0_fwd@1", "s0_bwd@0", "s0_fwd@2",
                                 "s0_bwd@1", "s0_fwd@3", "s0_bwd@2", "s0_bwd@3"]
    assert per[(4, 5, 6, 7)] == [
        f"s1_{d}@{m}" for m in range(4) for d in ("fwd", "bwd")]
    with mm.ignore_transforms():
        _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))


def test_png_and_trace(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    loss, ws, _ = _pipeline(2)
    x = jnp.ones((32, 16))
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    compiled = mm.mjit(f).lower(ws, x).compile()
    png = tmp_path / "schedule.png"
    mm.visualize_schedule(compiled, png)
    assert png.stat().st_size > 1000
    assert "submesh" in capsys.readouterr().out
    trace = tmp_path / "trace.json"
    out = compiled.profile(ws, x, trace_path=trace)
    with mm.ignore_transforms():
        _check(out, jax.value_and_grad(loss)(ws, x))
    data = json.loads(trace.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    tracks = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") ==
              "thread_name"}
    assert len(tracks) == 2, tracks


def test_one_microbatch_is_a_plain_call():
    loss, ws, _ = _pipeline(2)
    x = jnp.ones((8, 16))
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1)
    compiled = mm.mjit(f).lower(ws, x).compile()
    assert compiled.schedule is None


def test_custom_schedule_runs_and_matches():
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    rows = [["s0", "s0", "s0_bwd", "s0", "s0_bwd", "s0", "s0_bwd", "s0_bwd"],
            ["s1", "s1_bwd", "s1", "s1_bwd", "s1", "s1_bwd", "s1", "s1_bwd"]]
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, custom_schedule=rows)
    compiled = mm.mjit(f).lower(ws, x).compile()
    with mm.ignore_transforms():
        _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))


def test_validation_errors():
    loss, ws, _ = _pipeline(2)
    g = jax.value_and_grad(loss)
    with pytest.raises(MultimeshError, match="same size along dim 0, got sizes \\[4, 6\\]"):
        mm.mjit(mm.microbatch(lambda a: a[0].sum() + a[1].sum(), dim=0, size=2))(
            (jnp.ones((4, 2)), jnp.ones((6, 2))))
    with pytest.raises(MultimeshError, match="does not divide"):
        mm.mjit(mm.microbatch(g, dim=0, size=3, argnum=1))(ws, jnp.ones((8, 16)))
    with pytest.raises(ValueError, match="schedule must be 'custom' or None"):
        mm.microbatch(g, dim=0, size=2, schedule="1f1b", custom_schedule=[["s0"]])
    with pytest.raises(ValueError, match="has 1 microbatches"):
        mm.mjit(mm.microbatch(g, dim=0, size=8, argnum=1, custom_schedule=[["s0"], ["s1"]]))(
            ws, jnp.ones((16, 16)))
    with pytest.raises(ValueError, match="valid schedules are"):
        mm.microbatch(g, dim=0, size=2, schedule="round-robin")


def test_loop_dependent_mesh_slice_moves_a_task_per_microbatch():
    gm = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("x", "y"))

    def emb_body(w, x):
        return x @ w

    emb = mm.task(emb_body, name="emb", mesh_slice={"x": 0},
                  loop_dependent_mesh_slice=lambda i: {"x": i % 2})
    layer = mm.task(lambda w, x: jnp.tanh(x @ w), name="layer",
                    mesh=mm.TaskMesh(devices=range(4, 8), axis_names=("y",), axis_sizes=(4,)))

    def loss(ws, x):
        return (layer(ws[1], emb(ws[0], x)) ** 2).sum()

    ws = [jnp.eye(16) * 0.3, jnp.eye(16) * 0.7]
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1)
    with gm:
        compiled = mm.mjit(f).lower(ws, x).compile()
    with mm.ignore_transforms():
        _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))
    placed = {(c["direction"], c["microbatch"]): c["devices"] for c in compiled.calls
              if c["task"] == "emb" and c["microbatch"] is not None}
    for m in range(4):  # one traced task, placed per microbatch
        want = [0, 1, 2, 3] if m % 2 == 0 else [4, 5, 6, 7]
        assert placed["fwd", m] == want and placed["bwd", m] == want
    # its gradient is summed across the two submeshes it moves between
    assert sorted(d.id for d in compiled(ws, x)[1][0].devices()) == [4, 5, 6, 7]


def test_loop_dependent_mesh_slice_must_keep_the_device_count():
    gm = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("x", "y"))
    emb = mm.task(lambda w, x: x @ w, name="emb", mesh_slice={"x": 0},
                  loop_dependent_mesh_slice=lambda i: {"x": 0, "y": i % 4})
    f = mm.microbatch(lambda ws, x: emb(ws, x).sum(), dim=0, size=8, argnum=1)
    with gm, pytest.raises(MultimeshError, match="same number of devices"):
        mm.mjit(f).lower(jnp.eye(16), jnp.ones((16, 16)))


def test_interleaved_1f1b_two_stages_per_submesh():
    def mk(k):
        sub = k % 2
        mesh = mm.TaskMesh(devices=range(4 * sub, 4 * sub + 4), axis_names=("x",),
                           axis_sizes=(4,))
        return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"v{k}", mesh=mesh)

    tasks = [mk(k) for k in range(4)]

    def loss(ws, x):
        for t, w in zip(tasks, ws):
            x = t(w, x)
        return (x ** 2).sum()

    ws = [jnp.eye(16) * 0.5 + 0.01 * k for k in range(4)]
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                      schedule="interleaved-1f1b", interleave=2)
    compiled = mm.mjit(f).lower(ws, x).compile()
    with mm.ignore_transforms():
        _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))
    sched = compiled.schedule
    assert len(sched.orders) == 2
    gp = mm.mjit(mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                               schedule="gpipe")).lower(ws, x).compile().schedule
    assert sched.bubble_fraction() <= gp.bubble_fraction()


def test_task_split_backprop_splits_and_names_the_backward():
    def mk(k, split):
        mesh = mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))
        return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"sp{k}", mesh=mesh,
                       split_backprop=split)

    tasks = [mk(0, None), mk(1, ("_activations", "_gradients"))]

    def loss(ws, x):
        for t, w in zip(tasks, ws):
            x = t(w, x)
        return (x ** 2).sum()

    ws = [jnp.eye(16) * 0.5, jnp.eye(16) * 0.6]
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    compiled = mm.mjit(f).lower(ws, x).compile()
    with mm.ignore_transforms():
        _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))
    names = {fr["name"] for fr in compiled.fragments}
    assert "sp1_bwd_activations" in names and "sp1_bwd_gradients" in names
    assert not any(n.startswith("sp0_bwd") and n.endswith("_activations") for n in names)


def test_program_size_does_not_grow_with_microbatches():
    loss, ws, _ = _pipeline(2)
    sizes = {}
    for M in (2, 16):
        x = jnp.linspace(0, 1, 8 * M * 16).reshape(8 * M, 16)
        f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
        lowered = mm.mjit(f).lower(ws, x)
        compiled = lowered.compile()
        text = compiled.as_text()
        ops = [ln for ln in lowered.as_text().splitlines() if " = " in ln]
        sizes[M] = (len(ops), len(compiled.fragments), text.count("mm.fragment_call"))
        with mm.ignore_transforms():
            _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))
        assert sum(c["microbatch"] is not None for c in compiled.calls) == 4 * M
    assert sizes[2] == sizes[16]


def test_outputs_that_do_not_depend_on_the_microbatch():
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)

    def f(ws, x):
        return ws[0], 3, loss(ws, x), jnp.int32(2) * jnp.sum(x > 0.5)

    out = mm.mjit(mm.microbatch(f, dim=0, size=8, argnum=1))(ws, x)
    np.testing.assert_allclose(out[0], 4 * ws[0])
    assert int(out[1]) == 12
    with mm.ignore_transforms():
        np.testing.assert_allclose(out[2], sum(loss(ws, x[8 * m:8 * m + 8]) for m in range(4)),
                                   rtol=1e-5)
    assert int(out[3]) == 2 * int(jnp.sum(x > 0.5)) and out[3].dtype == jnp.int32


def test_arg_shardings_constrain_the_whole_batch():
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                      arg_shardings=P("batch", None))
    out = mm.mjit(f)(ws, x)
    with mm.ignore_transforms():
        _check(out, jax.value_and_grad(loss)(ws, x))


def test_transformations_around_microbatch_unroll_with_a_warning():
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(loss, dim=0, size=8, argnum=1, schedule="1f1b")
    with pytest.warns(mm.MultimeshWarning, match="unrolled into straight-line code"):
        out = mm.mjit(jax.value_and_grad(f))(ws, x)
    with mm.ignore_transforms():
        _check(out, jax.value_and_grad(loss)(ws, x))
    with pytest.warns(mm.MultimeshWarning, match="jax.vmap"):
        batched = jax.vmap(lambda w: f([w, ws[1]], x))(jnp.stack([ws[0], 2 * ws[0]]))
    with mm.ignore_transforms():
        np.testing.assert_allclose(batched[1], loss([2 * ws[0], ws[1]], x), rtol=1e-5)


def test_plain_jax_runs_the_loop():
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1)
    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(ws, x)
    _check(jax.jit(f)(ws, x), ref)  # tasks and the loop lower as plain jax


def test_one_microbatch_with_a_schedule_warns_and_nesting_is_rejected():
    loss, ws, _ = _pipeline(2)
    x = jnp.ones((8, 16))
    with pytest.warns(mm.MultimeshWarning, match="exactly one microbatch"):
        mm.mjit(mm.microbatch(loss, dim=0, size=8, argnum=1, schedule="1f1b"))(ws, x)
    inner = mm.microbatch(loss, dim=0, size=4, argnum=1)
    outer = mm.microbatch(lambda ws, x: inner(ws, x), dim=0, size=8, argnum=1)
    with pytest.raises(MultimeshError, match="nested microbatch loops are not supported"):
        mm.mjit(outer)(ws, jnp.ones((16, 16)))


def test_unrolling_groups_gpipe_and_is_gpipe_only():
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 64 * 16).reshape(64, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, unrolling=2)
    compiled = mm.mjit(f).lower(ws, x).compile()
    assert compiled.schedule.labels()[0] == ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3",
                                              "F4", "F5", "B4", "B5", "F6", "F7", "B6", "B7"]
    with mm.ignore_transforms():
        _check(compiled(ws, x), jax.value_and_grad(loss)(ws, x))
    with pytest.raises(MultimeshError, match="unrolling=2 applies to the GPipe schedule only"):
        mm.microbatch(loss, dim=0, size=8, argnum=1, unrolling=2, schedule="1f1b")


@pytest.mark.parametrize("alias,name", [("zb-h1", "zero-bubble-h1"), ("pipedream-flush", "1f1b"),
                                        ("prefetch-wavefront", "1f1b"),
                                        ("fill-drain", "gpipe"), ("zb-h2", "zero-bubble-h2")])
def test_schedule_aliases(alias, name):
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule=alias)
    assert mm.mjit(f).lower(ws, x).compile().schedule.name == name


def test_custom_schedule_is_checked_when_microbatch_is_called():
    """Its form (rows, entries) at ``microbatch(...)``; numpy microbatch numbers are
    ints; the names are the pass's to check (against the program's tasks)."""
    from multimesh.schedules import canonicalize_custom_schedule

    with pytest.raises(TypeError, match=r"custom_schedule row 1 has entry \('s1', 0\)"):
        mm.microbatch(lambda x: x, dim=0, size=2, custom_schedule=[["s0"], [("s1", 0)]])
    with pytest.raises(ValueError, match="custom_schedule is empty"):
        mm.microbatch(lambda x: x, dim=0, size=2, custom_schedule=[])
    rows = canonicalize_custom_schedule([[(np.int64(1), "a"), "a"], ["b", "b"]], 2)
    assert rows == [[(1, "a"), (0, "a")], [(0, "b"), (1, "b")]]
    assert all(type(mb) is int for row in rows for mb, _ in row)


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_fragments_that_compute_nothing_are_not_compiled():
    """``in_shardings`` constraints outside the loop are pass-through fragments and the
    running sums' ``*_acc_init`` are zeros: both stay in the IR, neither compiles."""
    import re

    from multimesh.runtime import executor

    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    executor._COMPILE_CACHE.clear()
    before = executor.xla_compiles
    compiled = mm.mjit(f, in_shardings=(P(), P())).lower(ws, x).compile()
    in_ir = sorted(set(re.findall(r"mm.fragment = @(\w+)", compiled.as_text())))
    assert in_ir == ["s0_acc_init", "s0_bwd", "s0_fwd", "s0_fwd_1",
                     "s1_acc_init", "s1_bwd", "s1_fwd", "s1_fwd_1"]
    names = sorted(fr["name"] for fr in compiled.fragments)
    assert names == ["s0_bwd", "s0_fwd_1", "s1_bwd", "s1_fwd_1"]
    assert executor.xla_compiles - before == 4
    assert {c["fragment"] for c in compiled.calls} == set(names)
    assert compiled.plan().count("  zeros %") == 3  # the two gradients and the loss
    for _ in range(2):  # fresh zeros every run (the first run's were donated)
        value, grads = compiled(ws, x)
        with mm.ignore_transforms():
            _check((value, grads), jax.value_and_grad(loss)(ws, x))
    assert [sorted(d.id for d in g.devices()) for g in grads] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    # a pass-through that the program returns is called: jax.jit returns fresh arrays
    def step(ws, x):
        return f(ws, x), ws

    kept = mm.mjit(step, in_shardings=(P(), P())).lower(ws, x).compile()
    assert "s0_fwd" in {fr["name"] for fr in kept.fragments}
    (value, grads), ws_out = kept(ws, x)
    assert all(a is not b for a, b in zip(ws_out, ws))
    np.testing.assert_array_equal(ws_out[1], ws[1])
    with mm.ignore_transforms():
        _check((value, grads), jax.value_and_grad(loss)(ws, x))


def test_zeros_on_an_accelerator_are_filled_on_the_devices(monkeypatch):
    """Off the CPU the running sums' zeros come from one jitted fill per submesh, not a
    host copy per step; forced here, it gives the same zeros, shardings and results."""
    from functools import partial

    from jax.sharding import NamedSharding

    from multimesh.runtime import executor
    from multimesh.runtime.zeros import Zeros

    devs = jax.devices()
    a = NamedSharding(jax.sharding.Mesh(np.array(devs[:4]), ("x",)), P("x"))
    b = NamedSharding(jax.sharding.Mesh(np.array(devs[4:]), ("x",)), P())
    a0 = NamedSharding(a.mesh, P())
    avals = [((8, 4), np.dtype(jnp.bfloat16)), ((4,), np.dtype(np.int32)), ((), np.dtype(np.float32))]
    host = Zeros([3, 5, 9], avals, [a, b, a0], on_device=False)
    dev = Zeros([3, 5, 9], avals, [a, b, a0], on_device=True)
    assert not host.on_device and dev.on_device and len(dev._fills) == 2  # one per submesh
    for h, d in zip(host.make(), dev.make()):
        assert h.dtype == d.dtype and h.shape == d.shape and h.sharding == d.sharding
        np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(d, np.float32))
        assert not np.any(np.asarray(d, np.float32))

    monkeypatch.setattr(executor, "Zeros", partial(Zeros, on_device=True))
    loss, ws, _ = _pipeline(2)
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    compiled = mm.mjit(f).lower(ws, x).compile()
    for _ in range(2):
        value, grads = compiled(ws, x)
        with mm.ignore_transforms():
            _check((value, grads), jax.value_and_grad(loss)(ws, x))
    assert [sorted(d.id for d in g.devices()) for g in grads] == [[0, 1, 2, 3], [4, 5, 6, 7]]
