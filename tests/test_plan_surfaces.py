"""The planner's and profiles' surfaces never mislead (issue 31, items 1, 3, 4 and 6):
a plan's reduction, its JSON, schedule pictures, ``mm-opt -o``'s file mode, and the
inputs the planner, the simulator and the profiles refuse.

Every program that runs is checked against plain jax (values and gradients) and where
its arrays live.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from tests.models import named_tanh_layers


def _loss(ws, x):
    """A mean loss over two named layers."""
    return jnp.mean(named_tanh_layers(ws, x) ** 2)


def _args():
    key = jax.random.key(0)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (16, 16)) / 4 for i in range(2)]
    return ws, jax.random.normal(key, (8, 16))


@pytest.fixture(scope="module")
def plan():
    return mm.plan_pipeline(_loss, *_args(), num_stages=2, num_microbatches=2,
                            schedule="1f1b")


# --------------------------------------------------------------------------- item 1: reduction


def _run_plan(plan, ws, x):
    with plan:
        return mm.mjit(plan.microbatch(jax.value_and_grad(_loss)))(ws, x)


def test_plan_microbatch_averages_a_mean_loss_by_default(plan):
    ws, x = _args()
    assert plan.reduction == "mean"
    loss, grads = _run_plan(plan, ws, x)
    ref_loss, ref_grads = jax.value_and_grad(_loss)(ws, x)  # the whole batch at once
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r, st in zip(grads, ref_grads, plan.stages):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        assert sorted(d.id for d in g.devices()) == list(st.devices)
    # the code it prints says so, and running that code gives the same numbers
    code = plan.as_code()
    assert "reduction='mean'" in code.splitlines()[-1]
    scope: dict = {"jax": jax, "loss": _loss}
    try:
        exec(code, scope)
        loss2, _ = mm.mjit(scope["step"])(ws, x)
    finally:
        mm.clear_tasks()
    np.testing.assert_allclose(loss2, ref_loss, rtol=1e-5)


def test_plan_reduction_sum_accumulates():
    ws, x = _args()
    plan = mm.plan_pipeline(_loss, ws, x, num_stages=2, num_microbatches=2,
                            schedule="1f1b", reduction="sum")
    assert "reduction='sum'" in plan.as_code()
    loss, _ = _run_plan(plan, ws, x)
    parts = [_loss(ws, x[4 * m:4 * m + 4]) for m in range(2)]
    np.testing.assert_allclose(loss, parts[0] + parts[1], rtol=1e-5)
    assert mm.PipelinePlan.from_json(plan.to_json()).reduction == "sum"
    with pytest.raises(MultimeshValueError, match=r"reduction must be one of 'sum', 'mean', got 'avg'"):
        mm.plan_pipeline(_loss, ws, x, reduction="avg")


# --------------------------------------------------------------------------- item 1: plan JSON


def _edited(plan, **changes) -> str:
    d = json.loads(plan.to_json())
    for key, value in changes.items():
        if value is KeyError:
            d.pop(key)
        else:
            d[key] = value
    return json.dumps(d)


@pytest.mark.parametrize("changes, match", [
    ({"num_microbatches": 3}, r"`batch` must be \[argnum, dim, rows\] with rows divisible by "
                              r"num_microbatches=3, got \[1, 0, 8\]"),
    ({"num_microbatches": 0}, r"`num_microbatches` must be a positive integer, got 0"),
    ({"num_microbatches": 2.0}, r"`num_microbatches` must be a positive integer, got 2.0"),
    ({"schedule": KeyError}, r"the plan's keys must be .*'schedule'"),
    ({"schedule": "zigzag"}, r"`schedule` must be a registered schedule's name, got 'zigzag'"),
    ({"reduction": "avg"}, r"`reduction` must be one of \['sum', 'mean'\], got 'avg'"),
    ({"stages": []}, r"`stages` must be a non-empty list"),
    ({"stages": [{"index": 0}]}, r"stage 0 must be an object with the keys"),
    ({"interleave": 3}, r"`interleave` must be a divisor of the 2 stages, got 3"),
    ({"batch": "rows"}, r"`batch` must be \[argnum, dim, rows\]"),
    ({"logical_axes": [["batch"]]}, r"`logical_axes` must be a list of \[logical name, axis\]"),
    ({"predicted_step_time": -1}, r"`predicted_step_time` must be a finite non-negative"),
    ({"format_version": KeyError}, r"format_version is None, but this multimesh reads version 2 "
                                   r"\(a plan written before versions"),
    ({"format_version": 99}, r"format_version is 99"),
])
def test_plan_from_json_checks_every_field(plan, changes, match):
    with pytest.raises(MultimeshValueError, match=match):
        mm.PipelinePlan.from_json(_edited(plan, **changes))


def test_plan_from_json_refuses_other_documents(plan):
    assert mm.PipelinePlan.from_json(plan.to_json()) == plan
    with pytest.raises(MultimeshValueError, match=r"the document must be a JSON object"):
        mm.PipelinePlan.from_json("[1, 2]")
    with pytest.raises(MultimeshValueError, match=r"the text is not JSON"):
        mm.PipelinePlan.from_json("{")
    with pytest.raises(MultimeshTypeError, match=r"takes the JSON text .* got dict"):
        mm.PipelinePlan.from_json(json.loads(plan.to_json()))
    d = json.loads(plan.to_json())
    d["stages"][1]["positions"] = [4]
    with pytest.raises(MultimeshValueError, match=r"stage 1's `positions` must be 4 positions"):
        mm.PipelinePlan.from_json(json.dumps(d))


def test_plan_from_json_refuses_devices_this_process_lacks(plan):
    """A plan saved on a bigger machine names devices that are not here: said at load,
    not when its submeshes first run elsewhere."""
    d = json.loads(plan.to_json())
    d["stages"][1]["devices"] = [8, 9, 10, 11]
    with pytest.raises(MultimeshValueError, match=r"places its stages on devices \[8, 9, 10, "
                                                  r"11\], which this process does not have "
                                                  r"\(its devices are \[0, 1, 2, 3, 4, 5, 6, 7\]\)"):
        mm.PipelinePlan.from_json(json.dumps(d))
    d = json.loads(plan.to_json())
    d["stages"][1]["positions"] = [8, 9, 10, 11]
    with pytest.raises(MultimeshValueError, match=r"device position 11, past the 8 devices"):
        mm.PipelinePlan.from_json(json.dumps(d))


# --------------------------------------------------------------------------- item 1: pictures


def _pipelined(schedule="1f1b", n=2):
    """A two-task pipeline over ``n`` microbatches and its arguments."""
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=mm.TaskMesh(devices=(0, 1)))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mm.TaskMesh(devices=(2, 3)))

    def loss(ws, x):
        return jnp.mean(s1(ws[1], s0(ws[0], x)) ** 2)

    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8 // n, argnum=1,
                         schedule=schedule)
    ws, x = _args()
    return mm.mjit(step).lower(ws, x).compile(), ws, x


def _wide_step():
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=mm.TaskMesh(devices=(0, 1)))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mm.TaskMesh(devices=(2, 3)))
    return mm.microbatch(jax.value_and_grad(lambda ws, x: jnp.mean(s1(ws[1], s0(ws[0], x)))),
                         dim=0, size=4, argnum=1, schedule="1f1b")


def test_visualize_schedule_refuses_another_programs_memory_profile(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, ws, x = _pipelined("1f1b")
    b, _, _ = _pipelined("gpipe")
    c, _, _ = _pipelined("1f1b", n=4)
    prof = a.memory_profile(ws, x)
    for other in (b, c, c.schedule):
        with pytest.raises(MultimeshValueError, match=r"`memory` is the memory profile of "
                                                      r"another program"):
            mm.visualize_schedule(other, memory=prof)
    # a program with the same schedule on other shapes is another program too
    wide = mm.mjit(_wide_step()).lower(
        [jnp.ones((32, 32))] * 2, jnp.ones((8, 32))).compile()
    assert wide.schedule == a.schedule
    with pytest.raises(MultimeshValueError, match=r"memory profile of another program"):
        mm.visualize_schedule(wide, memory=prof)
    # its own program draws, and the path returned is the file written
    capsys.readouterr()
    out = mm.visualize_schedule(a, tmp_path / "gantt", memory=prof, print=False)
    assert out == str(tmp_path / "gantt.png") and (tmp_path / "gantt.png").exists()
    assert capsys.readouterr().out == ""  # print=False
    assert mm.visualize_schedule(a, tmp_path / "g.svg") == str(tmp_path / "g.svg")
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")
    assert "live activations" not in capsys.readouterr().out
    # a MemoryProfile prints as its table
    assert str(prof) == prof.format() and str(prof).startswith("devices")


# --------------------------------------------------------------------------- item 1: mm-opt -o

_IDENTITY = "func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {\n  return %arg0 : tensor<8xf32>\n}\n"


def test_mm_opt_output_honours_the_umask_and_keeps_a_files_mode(tmp_path, capsys):
    import os
    import stat

    from multimesh.tools.mm_opt import main

    src = tmp_path / "in.mlir"
    src.write_text(_IDENTITY)
    old = os.umask(0o022)
    try:
        assert main([str(src), "-o", str(tmp_path / "new.mlir")]) == 0
        assert stat.S_IMODE(os.stat(tmp_path / "new.mlir").st_mode) == 0o644
        os.umask(0o077)
        assert main([str(src), "-o", str(tmp_path / "private.mlir")]) == 0
        assert stat.S_IMODE(os.stat(tmp_path / "private.mlir").st_mode) == 0o600
        shared = tmp_path / "shared.mlir"
        shared.write_text("old")
        os.chmod(shared, 0o664)  # an existing file keeps its mode, wider than the umask
        assert main([str(src), "-o", str(shared)]) == 0
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o664
        assert "return %arg0" in shared.read_text()
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- items 3, 4: planner inputs


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(devices=[]), MultimeshValueError, r"got devices=\[\]; a pipeline needs at least two"),
    (dict(devices=[0, 1, 2, 3]), MultimeshTypeError,
     r"`devices` must be jax devices \(e.g. `jax.devices\(\)\[4:\]`\), got 0 \(int\)"),
    (dict(devices="cpu"), MultimeshTypeError, r"`devices` must be a list of jax devices"),
    (dict(schedule=3), MultimeshTypeError, r"schedule=3 is not a schedule's name"),
    (dict(memory_limit=float("nan")), MultimeshValueError,
     r"`memory_limit` must be a positive number or None, got nan"),
    (dict(device_flops=0), MultimeshValueError, r"`device_flops` must be a positive number"),
    (dict(device_flops=-1e9), MultimeshValueError, r"`device_flops` must be a positive number"),
    (dict(link_bandwidth=-1.0), MultimeshValueError, r"`link_bandwidth` must be a positive"),
    (dict(fragment_overhead=-1e-4), MultimeshValueError,
     r"`fragment_overhead` must be a finite number >= 0 \(seconds per fragment call\)"),
    (dict(optimizer_state_factor=-2), MultimeshValueError,
     r"`optimizer_state_factor` must be a finite number >= 0 \(optimizer state bytes"),
    (dict(logical_axes=3), MultimeshTypeError,
     r"^`plan_pipeline`: `logical_axes` must be a sequence of \(logical_name, device_axis\) "
     r"pairs, got int 3\.$"),
    (dict(logical_axes=[("batch",)]), MultimeshValueError,
     r"^`plan_pipeline`: `logical_axes` .* \('batch',\) is not such a pair\.$"),
])
def test_planner_refuses_bad_inputs_naming_them(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mm.plan_pipeline(_loss, *_args(), **kwargs)


def test_planner_refuses_duplicate_devices_and_empty_batches():
    d = jax.devices()
    with pytest.raises(MultimeshValueError, match=r"lists device\(s\) \[0\] more than once"):
        mm.plan_pipeline(_loss, *_args(), devices=[d[0], d[0], d[1], d[2]])
    ws, _ = _args()
    with pytest.raises(MultimeshValueError, match=r"cuts the batch \(argument 1\) along "
                                                  r"dimension 0, but it has no rows there"):
        mm.plan_pipeline(_loss, ws, jnp.ones((0, 16)))
    with pytest.raises(MultimeshValueError, match=r"no array with that dimension"):
        mm.plan_pipeline(_loss, ws, {})


def test_planner_looks_inside_a_jitted_loss(plan):
    got = mm.plan_pipeline(jax.jit(_loss), *_args(), num_stages=2, num_microbatches=2,
                           schedule="1f1b")
    assert [st.units for st in got.stages] == [st.units for st in plan.stages]


# --------------------------------------------------------------------------- item 6: plan text


def test_one_microbatch_plan_says_why_and_runs_without_the_library_warning():
    import warnings

    ws, x = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no one-microbatch warning from the plan's own call
        one = mm.plan_pipeline(_loss, ws, x, num_stages=2)
        assert one.num_microbatches == 1
        with one:
            loss, grads = mm.mjit(one.microbatch(jax.value_and_grad(_loss)))(ws, x)
    ref_loss, ref_grads = jax.value_and_grad(_loss)(ws, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r, st in zip(grads, ref_grads, one.stages):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        assert sorted(d.id for d in g.devices()) == list(st.devices)
    text = str(one)
    assert "1 microbatch (no pipeline: see microbatches)" in text
    assert "microbatches: one: the best plan with more (2, " in text
    assert "pass num_microbatches= to pipeline anyway" in text
    code = one.as_code()
    assert "schedule=" not in code and "# 1 microbatch(es) of 8 rows, no pipeline" in code
    asked = mm.plan_pipeline(_loss, ws, x, num_stages=2, num_microbatches=1)
    assert "microbatches: one, as asked (num_microbatches=1)" in str(asked)


def test_as_code_names_each_rules_units(plan):
    code = plan.as_code()
    lines = code.splitlines()
    for st in plan.stages:
        k = lines.index(f"# stage {st.index}: {', '.join(st.units)} on devices "
                        f"{', '.join(map(str, st.devices))} (positions {st.positions[0]}.."
                        f"{st.positions[-1]})")
        assert lines[k + 1] == "mm.register_task("
    assert max(len(line) for line in lines if "microbatch(" not in line) <= 100


# --------------------------------------------------------------------------- item 3: simulate


def test_simulate_refuses_infinite_costs_negative_transfers_and_bytes():
    from multimesh.schedules import ScheduleError, build_schedule, pipeline_units
    from multimesh.schedules.costs import simulate_stages

    sched = build_schedule(pipeline_units(2, 4), "1f1b")
    frags = {u.fragment for u in sched.units}
    inf = dict.fromkeys(frags, 1.0) | {sorted(frags)[0]: float("inf")}
    with pytest.raises(ScheduleError, match=r"must be a positive finite duration, got inf"):
        sched.simulate(inf)
    with pytest.raises(ScheduleError, match=r"must be a positive finite duration, got nan"):
        sched.simulate(lambda u: float("nan"))
    with pytest.raises(ScheduleError, match=r"comm \(seconds per transfer between submeshes\) "
                                            r"must be a finite number >= 0, got -1"):
        sched.simulate(comm=-1)
    with pytest.raises(ScheduleError, match=r"residual bytes must be >= 0 and finite, got -8"):
        sched.simulate(residual_bytes=dict.fromkeys(frags, -8))
    with pytest.raises(ScheduleError, match=r"residual bytes must be >= 0"):
        sched.simulate(residual_bytes=lambda key: -1)
    with pytest.raises(ScheduleError, match=r"stage costs must be positive and finite"):
        simulate_stages("1f1b", [1.0, float("inf")], [2.0, 2.0], num_microbatches=4)
    with pytest.raises(ScheduleError, match=r"activation_bytes must be >= 0 and finite"):
        simulate_stages("1f1b", [1.0, 1.0], [2.0, 2.0], num_microbatches=4,
                        activation_bytes=[-1, 4])
    with pytest.raises(ScheduleError, match=r"comm .* must be a finite number >= 0"):
        simulate_stages("1f1b", [1.0, 1.0], [2.0, 2.0], num_microbatches=4, comm=-0.5)
    # what is fine still runs: zero bytes, zero transfer time
    pred = sched.simulate(dict.fromkeys(frags, 1.0), residual_bytes=dict.fromkeys(frags, 0))
    assert pred.step_time > 0 and pred.peak_activation_bytes == (0, 0)


def test_planner_says_why_it_cannot_place_circular_reversed_backward_one_per_submesh():
    with pytest.raises(MultimeshValueError,
                       match=r"plans schedule 'circular-reversed-backward' with 2 stages per "
                             r"submesh \(round-robin\), so it needs a multiple of 2 stages on "
                             r"at least two submeshes \(4 stages or more\), but the candidates "
                             r"are \[1, 2\] stage\(s\) \(2 units, 8 devices\)"):
        mm.plan_pipeline(_loss, *_args(), schedule="circular-reversed-backward")


def _check_two_device_stages(value, grads, loss, ws, x):
    """Value and gradients equal plain jax's; stage ``k``'s gradient on devices 2k, 2k+1."""
    with mm.ignore_transforms():
        ref, ref_grads = jax.value_and_grad(loss)(ws, x)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    for k, (g, r) in enumerate(zip(grads, ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        assert sorted(d.id for d in g.devices()) == [2 * k, 2 * k + 1]


def test_circular_reversed_backward_one_stage_per_submesh_runs_as_documented():
    """GPipe with the backwards in descending order, the full batch's mean."""
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=mm.TaskMesh(devices=(0, 1)))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mm.TaskMesh(devices=(2, 3)))

    def loss(ws, x):
        return jnp.mean(s1(ws[1], s0(ws[0], x)) ** 2)

    ws, x = _args()
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=2, argnum=1,
                         schedule="circular-reversed-backward", reduction="mean")
    compiled = mm.mjit(step).lower(ws, x).compile()
    assert compiled.schedule.labels() == [["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0"]] * 2
    value, grads = compiled(ws, x)
    _check_two_device_stages(value, grads, loss, ws, x)


# --------------------------------------------------------------------------- item 3: with plan:


def test_mjit_built_in_with_plan_but_called_after_says_why(plan):
    import warnings

    from multimesh._src.errors import MultimeshWarning

    ws, x = _args()
    with plan:
        inside = mm.mjit(plan.microbatch(jax.value_and_grad(_loss)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", MultimeshWarning)
            placed = inside(ws, x)  # called in the block: the plan's rules, no warning
        late = mm.mjit(plan.microbatch(jax.value_and_grad(_loss)))
    with pytest.warns(MultimeshWarning, match=r"`mjit\(_loss\)` was built inside a `with "
                      r"plan:` \(or `with Context\(\):`\) block, but it is traced after the "
                      r"block exited, so the block's 2 task rule\(s\) .* do not apply") as rec:
        value, grads = late(ws, x)
    assert rec[0].filename == __file__
    ref, ref_grads = jax.value_and_grad(_loss)(ws, x)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(placed[0], ref, rtol=1e-5)
    assert sorted(d.id for d in placed[1][1].devices()) == list(plan.stages[1].devices)


# --------------------------------------------------------------------------- item 4: remat


def test_remat_errors_name_remat():
    ws, x = _args()
    with pytest.raises(MultimeshTypeError, match=r"`microbatch`: `remat` got "
                       r"`jax.checkpoint_policies.save_only_these_names` itself, which makes "
                       r"a policy when called"):
        mm.microbatch(jax.value_and_grad(_loss), dim=0, size=4, argnum=1,
                      remat=jax.checkpoint_policies.save_only_these_names)
    with pytest.raises(MultimeshTypeError, match=r"`remat` got .*save_any_names_but_these"):
        mm.Task(name="t", remat=jax.checkpoint_policies.save_any_names_but_these)


def test_remat_accepts_numpy_bools():
    ws, x = _args()
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=mm.TaskMesh(devices=(0, 1)),
                 remat=np.True_)
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mm.TaskMesh(devices=(2, 3)))

    def loss(ws, x):
        return jnp.mean(s1(ws[1], s0(ws[0], x)) ** 2)

    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1,
                         remat=np.True_, reduction="mean")
    value, grads = mm.mjit(step)(ws, x)
    _check_two_device_stages(value, grads, loss, ws, x)


def test_parallelize_step_auto_refuses_a_remat_policy_naming_the_planner():
    import flax.linen as nn
    import optax

    from multimesh.jax import flax as mmf

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(nn.Dense(16, name="l1")(nn.Dense(16, name="l0")(x)) ** 2)

    _, x = _args()
    with pytest.raises(MultimeshValueError, match=r"num_stages='auto' and the checkpoint "
                       r"policy remat=`jax.checkpoint_policies.\w+`: the planner's "
                       r"stages are `register_task` rules"):
        mmf.parallelize_step(Two(), optax.sgd(0.1), global_batch=x, num_stages="auto",
                             num_microbatches=2, remat=jax.checkpoint_policies.dots_saveable)


# --------------------------------------------------------------------------- item 4: profiles


def test_profiles_of_a_program_without_tasks_say_so():
    plain = mm.mjit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    for call in (lambda: plain.memory_profile(jnp.ones(4)),
                 lambda: plain.step_profile(jnp.ones(4)),
                 lambda: mm.xla_costs(plain), lambda: mm.residual_bytes(plain)):
        with pytest.raises(MultimeshValueError, match=r"This program has no tasks, so "
                           r"multimesh compiled it as one `jax.jit` executable"):
            call()
    np.testing.assert_allclose(plain.profile(jnp.ones(4)), 2 * np.ones(4))


def test_profiles_check_their_arguments_and_options():
    from multimesh.schedules import ScheduleError

    c, ws, x = _pipelined()
    for call in (c.memory_profile, c.step_profile, c.profile):
        with pytest.raises(MultimeshTypeError, match=r"called with args\[1\] of type "
                           r"float32\[8,8\], but it was compiled for float32\[8,16\]"):
            call(ws, jnp.ones((8, 8)))
        with pytest.raises(MultimeshValueError, match=r"called with arguments of structure"):
            call(ws[0], x)
    for steps in (2.5, 0, True):
        with pytest.raises(MultimeshValueError, match=r"`steps` must be a positive integer"):
            c.step_profile(ws, x, steps=steps)
    cmp = mm.compare_schedules(c)
    for limit in (float("nan"), -1, 0):
        with pytest.raises(ScheduleError, match=r"memory_limit must be a positive number of "
                                                r"bytes per device, or None"):
            cmp.best(memory_limit=limit)
    assert cmp.best().step_time > 0
    for kwargs in (dict(peak_flops=0, memory_bandwidth=1e9),
                   dict(peak_flops=1e12, memory_bandwidth=-1.0),
                   dict(peak_flops=float("nan"), memory_bandwidth=1e9),
                   dict(peak_flops=1e12, memory_bandwidth=1e9, overhead=-1e-5)):
        with pytest.raises(MultimeshValueError, match=r"DeviceModel: `\w+` must be a finite"):
            mm.DeviceModel(**kwargs)
    costs = mm.xla_costs(c, mm.DeviceModel(peak_flops=1e12, memory_bandwidth=1e10, overhead=0))
    assert all(v > 0 for v in costs.seconds.values())


# --------------------------------------------------------------------------- item 4: dumps


def test_dump_directory_that_cannot_be_made_names_the_variable(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(blocker / "dumps"))
    _, x = _args()
    t = mm.task(lambda x: x * 2, name="t", mesh=mm.TaskMesh(devices=(0, 1)))
    with pytest.raises(MultimeshValueError, match=r"MULTIMESH_DUMP_IR_TO='.*a-file/dumps' "
                       r"names a directory multimesh cannot make or write \(Not a directory"):
        mm.mjit(lambda x: t(x) + 1).lower(x).compile()
    monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path / "ok"))
    out = mm.mjit(lambda x: t(x) + 1)(x)
    np.testing.assert_allclose(out, x * 2 + 1)
    assert any((tmp_path / "ok").iterdir())


# --------------------------------------------------------------------------- item 4: schedules


def test_too_few_microbatches_for_a_schedule_refused_before_tracing():
    from multimesh.schedules import ScheduleError

    traced = []

    def grad_fn(ws, x):
        traced.append(x.shape)
        return jax.value_and_grad(_loss)(ws, x)

    ws, x = _args()
    for kwargs in (dict(), dict(num_stages=4)):
        step = mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="dualpipe-v", **kwargs)
        with pytest.raises(ScheduleError, match=r"`microbatch` got 2 microbatch\(es\) for "
                           r"schedule 'dualpipe-v', which it accepts on no pipeline .* \(checked "
                           r"before tracing\): schedule 'dualpipe-v' needs at least 2P = 4"):
            mm.mjit(step).lower(ws, x)
    assert traced == []  # refused before the function was traced


# --------------------------------------------------------------------------- item 4: mjit traced


def test_mjit_under_jax_transformations_says_so():
    inner = mm.mjit(lambda x: x * 2)
    x = jnp.ones(4)
    for call, where in ((lambda: jax.jit(inner)(x), r"jax.jit"),
                        (lambda: jax.grad(lambda x: inner(x).sum())(x), r"jax.grad"),
                        (lambda: jax.vmap(inner)(jnp.ones((2, 4))), r"jax.vmap")):
        with pytest.raises(MultimeshTypeError, match=rf"`mjit\(<lambda>\)` was called under "
                           rf"{where}.* Put the transformation inside it"):
            call()
    with pytest.raises(MultimeshTypeError, match=r"inside another `mjit` program while it "
                                                 r"was traced; `mjit` functions do not nest"):
        mm.mjit(lambda x: inner(x) + 1)(x)
    # the supported way round: the transformation inside
    np.testing.assert_allclose(mm.mjit(jax.grad(lambda x: (x * 2).sum()))(x), 2 * np.ones(4))
    np.testing.assert_allclose(inner(x), 2 * np.ones(4))


_ONE_DEVICE = """
import jax, jax.numpy as jnp
import multimesh.jax as mm
t = mm.task(lambda x: x * 2, name="t", mesh=mm.TaskMesh(devices=(0, 1)))
try:
    mm.mjit(lambda x: t(x) + 1)(jnp.ones(4))
except Exception as e:
    print(type(e).__name__, e)
"""


def test_one_cpu_device_hints_at_simulating_more():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    out = subprocess.run([sys.executable, "-c", _ONE_DEVICE], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert "valid positions are 0..0). jax sees 1 CPU device(s); to simulate more, set " \
           "XLA_FLAGS=--xla_force_host_platform_device_count=8" in out, out


# --------------------------------------------------------------------------- item 6: stacklevel


def test_warnings_point_at_the_users_line():
    import warnings

    from multimesh._src.errors import MultimeshWarning

    ws, x = _args()
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s", mesh=mm.TaskMesh(devices=(0, 1)))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s", mesh=mm.TaskMesh(devices=(2, 3)))
    slid = mm.task(lambda x: x + 1, name="slid", mesh=mm.TaskMesh(devices=(0, 1)),
                   loop_dependent_mesh_slice=lambda i: {"x": i % 2})

    def loss(ws, x):
        return jnp.mean(s1(ws[1], s0(ws[0], x)) ** 2)

    one = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    inner = mm.microbatch(loss, dim=0, size=4, argnum=1)
    calls = {
        "one microbatch": lambda: mm.mjit(one)(ws, x),
        "renamed tasks": lambda: mm.mjit(loss)(ws, x),
        "loop slice outside a loop": lambda: mm.mjit(slid)(x),
        "unrolled loop": lambda: mm.mjit(jax.grad(inner))(ws, x),
        "matcher registered twice": lambda: (
            mm.register_task("a", task=mm.Task(mesh=mm.TaskMesh(devices=(0,)))),
            mm.register_task("a", task=mm.Task(mesh=mm.TaskMesh(devices=(1,))))),
    }
    try:
        for what, call in calls.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                call()
            mine = [w for w in caught if issubclass(w.category, MultimeshWarning)]
            assert mine, what
            assert {w.filename for w in mine} == {__file__}, (what, [
                (w.filename, str(w.message)[:60]) for w in mine])
    finally:
        mm.clear_tasks()
