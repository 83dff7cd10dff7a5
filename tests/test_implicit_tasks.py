"""Implicit tasks (issue 4): register_task, contexts, MultiMesh slices, mm-match-tasks.

Anchor E5 (mpmd-multimesh): a (2, 2, 2) ("stage", "batch", "model") global mesh and a
callback that sends layer n to the slice stage=n.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import (
    MeshError,
    MultimeshError,
    MultimeshTypeError,
    MultimeshValueError,
    PassFailure,
    PipelineError,
)
from multimesh._src.mlir import make_context, parse_module
from multimesh.jax import _global_mesh, _implicit_tasks, _registrations
from multimesh.jax import with_sharding_constraint as wsc
from multimesh.passes.match_tasks import find_matches, name_stack, parse_rules, rules_to_json
from multimesh.passes.pipeline import parse_pipeline
from tests.models import f, get_input_batch, init_params


@pytest.fixture(autouse=True)
def _clean_registry():
    mm.clear_tasks()
    depth = len(_registrations._local.frames)
    yield
    mm.clear_tasks()
    assert len(_registrations._local.frames) == depth, "a test left a Context entered"
    assert _global_mesh.active_multimesh() is None


def _layers(params, x, act=lambda y: y):
    """E1's two layers under the named scopes ``layer0``/``layer1`` (what registered
    tasks match), each followed by ``act``."""
    param_1, param_2 = params
    x = wsc(x, P("batch", None))
    param_1 = wsc(param_1, P("model", None))
    param_2 = wsc(param_2, P(None, "model"))
    with jax.named_scope("layer0"):
        x = act(f(param_1, x))
    with jax.named_scope("layer1"):
        x = act(f(param_2, x))
    return wsc(x, P("batch", None))


def model(params, x):
    return _layers(params, x)


def loss(params, x):
    return (_layers(params, x, jnp.tanh) ** 2).sum()


def float_args():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return ((jax.random.normal(k1, (8, 8)), jax.random.normal(k2, (8, 8))),
            jax.random.normal(k3, (8, 8)))


def global_mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("stage", "batch", "model"))


def layer_callback(name, backprop):
    layer = int(re.search(r"layer(\d+)", name).group(1))
    return mm.Task(name=f"layer{layer}_" + ("bwd" if backprop else "fwd"),
                   mesh_slice={"stage": layer})


def blocks(a):
    """{(row range, column range): sorted device ids} of a 2-D array."""
    out: dict = {}
    for s in a.addressable_shards:
        key = tuple((sl.start or 0, a.shape[i] if sl.stop is None else sl.stop)
                    for i, sl in enumerate(s.index))
        out.setdefault(key, set()).add(s.device.id)
    return {k: sorted(v) for k, v in sorted(out.items())}


def fragment_devices(compiled):
    return {fr["task"]: fr["devices"] for fr in compiled.fragments}


# --------------------------------------------------------------------------- E5


def test_e5_mpmd_multimesh_tutorial():
    multi_mesh = mm.MultiMesh(global_mesh=global_mesh())
    multi_mesh.register_task(r"layer\d+", callback=layer_callback)
    with multi_mesh:
        sharded_model, init_sharded_params, get_sharded_batch = mm.parallelize(
            model, init_params=init_params, get_input_batch=get_input_batch)
    param_1, param_2 = init_sharded_params()
    batch = get_sharded_batch()
    # Param 1 P("model", None) on stage 0 ([[0, 1], [2, 3]]): row blocks over {0,2}/{1,3}.
    assert blocks(param_1) == {((0, 4), (0, 8)): [0, 2], ((4, 8), (0, 8)): [1, 3]}
    # Param 2 P(None, "model") on stage 1 ([[4, 5], [6, 7]]): column blocks {4,6}/{5,7}.
    assert blocks(param_2) == {((0, 8), (0, 4)): [4, 6], ((0, 8), (4, 8)): [5, 7]}
    # The batch P("batch", None) is read by layer0: rows over the batch axis of stage 0.
    assert blocks(batch) == {((0, 4), (0, 8)): [0, 1], ((4, 8), (0, 8)): [2, 3]}
    assert fragment_devices(sharded_model) == {"layer0_fwd": [0, 1, 2, 3],
                                               "layer1_fwd": [4, 5, 6, 7]}
    out = sharded_model((param_1, param_2), batch)
    expected = f(init_params()[1], f(init_params()[0], get_input_batch()))
    assert jnp.array_equal(jax.device_get(out), expected)
    assert {d.id for d in out.devices()} == {4, 5, 6, 7}


def _check_value_and_grad(compiled, params, x):
    got = compiled(params, x)
    with mm.ignore_transforms():
        want = jax.value_and_grad(loss)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)
    return got


def test_e5_gradients_match_plain_jax():
    calls = []

    def callback(name, backprop):
        calls.append((name, backprop))
        return layer_callback(name, backprop)

    multi_mesh = mm.MultiMesh(global_mesh=global_mesh())
    multi_mesh.register_task(r"layer\d+", callback=callback)
    params, x = float_args()
    with multi_mesh:
        compiled = mm.mjit(jax.value_and_grad(loss)).lower(params, x).compile()
    # The callback runs once per distinct (matched name, backprop) pair.
    assert sorted(calls) == [("layer0", False), ("layer0", True), ("layer1", False),
                             ("layer1", True)]
    assert fragment_devices(compiled) == {
        "layer0_fwd": [0, 1, 2, 3], "layer0_bwd": [0, 1, 2, 3],
        "layer1_fwd": [4, 5, 6, 7], "layer1_bwd": [4, 5, 6, 7]}
    (_, (g1, g2)) = _check_value_and_grad(compiled, params, x)
    # Gradients come back where the backward tasks computed them, sharded like the params.
    assert blocks(g1) == {((0, 4), (0, 8)): [0, 2], ((4, 8), (0, 8)): [1, 3]}
    assert blocks(g2) == {((0, 8), (0, 4)): [4, 6], ((0, 8), (4, 8)): [5, 7]}


def test_forward_and_backward_on_different_submeshes():
    def callback(name, backprop):
        layer = int(name[len("layer"):])
        stage = 1 - layer if backprop else layer  # backward runs on the other stage
        return mm.Task(name=f"{name}_{'bwd' if backprop else 'fwd'}",
                       mesh_slice={"stage": stage})

    params, x = float_args()
    with mm.MultiMesh(global_mesh=global_mesh()) as multi_mesh:
        multi_mesh.register_task("layer[01]", callback=callback)
        compiled = mm.mjit(jax.value_and_grad(loss)).lower(params, x).compile()
    assert fragment_devices(compiled) == {
        "layer0_fwd": [0, 1, 2, 3], "layer0_bwd": [4, 5, 6, 7],
        "layer1_fwd": [4, 5, 6, 7], "layer1_bwd": [0, 1, 2, 3]}
    _check_value_and_grad(compiled, params, x)


def test_plain_names_and_regex_callback_give_the_same_placement():
    params, x = float_args()
    results = []
    for register in ("names", "regex"):
        multi_mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))
        if register == "names":
            multi_mesh.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
            multi_mesh.register_task("layer1", task=mm.Task(mesh_slice={"stage": 1}))
        else:
            multi_mesh.register_task(
                r"layer\d", callback=lambda name, bp: mm.Task(mesh_slice={"stage": int(name[-1])}))
        with multi_mesh:
            compiled = mm.mjit(jax.value_and_grad(loss)).lower(params, x).compile()
        results.append(compiled)
        _check_value_and_grad(compiled, params, x)
    by_names, by_regex = results
    # Without a Task name, the task is named after the matched name; forward and
    # backward share it (allowed: same devices).
    assert fragment_devices(by_names) == fragment_devices(by_regex) == {
        "layer0": [0, 1, 2, 3], "layer1": [4, 5, 6, 7]}
    assert jax.tree.map(str, by_names.input_shardings) == \
        jax.tree.map(str, by_regex.input_shardings)
    assert [(f["name"], f["devices"]) for f in by_names.fragments] == \
        [(f["name"], f["devices"]) for f in by_regex.fragments]


# --------------------------------------------------------------------------- matching rules


def test_explicit_task_wins_over_a_name_match():
    explicit = mm.task(f, name="explicit", mesh=mm.TaskMesh(
        devices=(4, 5, 6, 7), axis_names=("x",), axis_sizes=(4,)),
        logical_axes=(("batch", "x"),))

    def fun(params, x):
        with jax.named_scope("layer0"):
            x = explicit(params[0], x)  # an explicit task inside a matching scope
            x = jnp.sin(x)
        return x

    mm.register_task("layer0", task=mm.Task(mesh=mm.TaskMesh(
        devices=(0, 1), axis_names=("x",), axis_sizes=(2,))))
    params, x = float_args()
    compiled = mm.mjit(fun).lower(params, x).compile()
    assert fragment_devices(compiled) == {"explicit": [4, 5, 6, 7], "layer0": [0, 1]}
    with mm.ignore_transforms():
        want = fun(params, x)
    np.testing.assert_allclose(np.asarray(compiled(params, x)), np.asarray(want), rtol=1e-5)


def test_nested_jit_and_loops_inside_a_scope_join_the_task():
    @jax.jit
    def inner(x):
        return jnp.cos(x) * 2.0

    def fun(params, x):
        with jax.named_scope("layer0"):
            x = inner(f(params[0], x))
            x = jax.lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) + 1.0, x)
        with jax.named_scope("layer1"):
            x = inner(f(params[1], x))
        return x.sum()

    with mm.MultiMesh(global_mesh=global_mesh()) as multi_mesh:
        multi_mesh.register_task(r"layer\d+", callback=layer_callback)
        params, x = float_args()
        compiled = mm.mjit(jax.value_and_grad(fun)).lower(params, x).compile()
    assert fragment_devices(compiled) == {
        "layer0_fwd": [0, 1, 2, 3], "layer0_bwd": [0, 1, 2, 3],
        "layer1_fwd": [4, 5, 6, 7], "layer1_bwd": [4, 5, 6, 7]}
    got = compiled(params, x)
    with mm.ignore_transforms():
        want = jax.value_and_grad(fun)(params, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def _lowered_text(fun, *args):
    return mm.mjit(fun).lower(*args).as_text()


def test_prefix_pitfall_and_anchored_regex():
    def fun(x):
        with jax.named_scope("layer_1"):
            x = jnp.sin(x)
        with jax.named_scope("layer_10"):
            x = jnp.cos(x)
        return x

    module = parse_module(_lowered_text(fun, jnp.ones(4)), make_context())
    # A plain name is searched anywhere: "layer_1" also claims layer_10's ops.
    assert {(m.name, m.backprop) for m in find_matches(module, ["layer_1"])} == \
        {("layer_1", False)}
    stacks = _claimed_stacks(module, "layer_1")
    assert any("layer_10" in s for s in stacks)
    # Anchored: the name must end at a scope boundary.
    anchored = r"(layer_1)(?![0-9])"
    assert not any("layer_10" in s for s in _claimed_stacks(module, anchored))
    assert {m.name for m in find_matches(module, [anchored, r"(layer_\d+)"])} == \
        {"layer_1", "layer_10"}


def _claimed_stacks(module, matcher):
    rx = re.compile(matcher) if re.compile(matcher).groups else re.compile(f"({matcher})")
    out = []
    for op in module.body.operations[0].regions[0].blocks[0].operations:
        s = name_stack(op.operation.location)
        if s and rx.search(s):
            out.append(s)
    return out


def test_backward_ops_are_backprop_matches():
    def fun(x):
        with jax.named_scope("layer0"):
            return jnp.sin(x).sum()

    module = parse_module(_lowered_text(jax.grad(fun), jnp.ones(4)), make_context())
    assert {(m.name, m.backprop) for m in find_matches(module, ["layer0"])} == \
        {("layer0", False), ("layer0", True)}


def test_name_stack_reads_the_outermost_name():
    text = '''
    #f = loc("model.py":3:4)
    module {
      func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {
        %0 = stablehlo.sine %a : tensor<2xf32> loc("jit(f)/la\\22yer0/sin"(callsite("model"(#f) at "g.py":1:2)))
        %1 = stablehlo.cosine %0 : tensor<2xf32> loc(fused["a.py":1:1, "jit(f)/x/cos"("b.py":2:2)])
        %2 = stablehlo.cosine %1 : tensor<2xf32> loc("cosine:"("jit(f)/y/cos"(#f)))
        %3 = stablehlo.cosine %2 : tensor<2xf32> loc(callsite("model"(#f) at "g.py":1:2))
        %4 = stablehlo.cosine %3 : tensor<2xf32>
        return %4 : tensor<2xf32>
      }
    }'''
    module = parse_module(text, make_context())
    ops = list(module.body.operations[0].regions[0].blocks[0].operations)
    assert [name_stack(o.operation.location) for o in ops[:5]] == [
        'jit(f)/la"yer0/sin', "jit(f)/x/cos", "jit(f)/y/cos", None, None]


def test_rules_file_runs_in_mm_opt(tmp_path, capsys):
    from multimesh.tools.mm_opt import main

    def fun(x):
        with jax.named_scope("layer0"):
            x = jnp.sin(x)
        return x * 2.0

    src = tmp_path / "program.mlir"
    src.write_text(_lowered_text(fun, jnp.ones(8)))
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"matcher": "(layer0)", "task": {
        "devices": [2, 3], "axis_names": ["x"], "axis_sizes": [2]}}]}))
    rc = main([str(src), "--mlir-print-debuginfo", "-p",
               f"builtin.module(mm-match-tasks{{rules-file={rules}}},mm-inline-tasks)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert 'layer0 = {axis_names = ["x"], axis_sizes = [2], devices = [2, 3]' in out
    assert re.search(r'stablehlo\.sine .*mm\.task = \{name = "layer0", transpose_count = 0', out)
    assert not re.search(r"stablehlo\.multiply .*mm\.task", out)


def _match_pass(lowered):
    steps = [s for s in lowered.pipeline.steps if s.argument == "mm-match-tasks"]
    return steps[0] if steps else None


def test_mjit_hands_the_resolved_rules_over_in_memory(tmp_path, monkeypatch):
    """The pass is built with its rule table; no rules file is written anywhere."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MULTIMESH_DUMP_IR_TO", raising=False)
    mm.register_task("layer0", task=mm.Task(name="first", mesh=mm.TaskMesh(
        devices=(0, 1), axis_names=("x",), axis_sizes=(2,))))
    params, x = float_args()
    lowered = mm.mjit(model).lower(params, x)
    args = [s.argument for s in lowered.pipeline.steps]
    assert args.index("mm-match-tasks") < args.index("mm-inline-tasks")
    match = _match_pass(lowered)
    assert (match.rules, match.rules_file) == ("", "")
    assert rules_to_json(match.rule_table) == {"rules": [{"matcher": "(layer0)", "matches": [{
        "match": "layer0", "backprop": False, "task": {
            "name": "first", "devices": [0, 1], "axis_names": ["x"], "axis_sizes": [2],
            "logical_axes": [["x", "x"]]}}]}]}
    # the file form reads back into the same rules (what mm-opt replays)
    assert tuple(parse_rules(rules_to_json(match.rule_table), "test")) == match.rule_table
    compiled = lowered.compile()
    with mm.ignore_transforms():
        want = model(params, x)
    np.testing.assert_allclose(np.asarray(compiled(params, x)), np.asarray(want), rtol=1e-5)
    assert fragment_devices(compiled)["first"] == [0, 1]
    assert list(tmp_path.iterdir()) == []  # nothing written to the temporary directory
    # No registrations (or ignore_transforms): no matching pass at all.
    mm.clear_tasks()
    assert _match_pass(mm.mjit(model).lower(params, x)) is None


def _conflicting_registration():
    """A registered task named like an explicit task but on other devices: the front end
    cannot see the clash, ``mm-match-tasks`` reports it."""
    mm.register_task("layer1", task=mm.Task(name="head", mesh=mm.TaskMesh(
        devices=(4, 5), axis_names=("x",), axis_sizes=(2,))))
    head = mm.task(lambda v: v * 2.0, name="head",
                   mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,)))

    def program(params, x):
        return head(model(params, x))

    return program


@pytest.mark.parametrize("dumping", [False, True])
def test_a_failing_match_replays_from_the_rules_file_next_to_its_repro(
        dumping, tmp_path, monkeypatch):
    from multimesh.tools.mm_opt import main

    if dumping:
        monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path))
    else:
        monkeypatch.delenv("MULTIMESH_DUMP_IR_TO", raising=False)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    params, x = float_args()
    with pytest.raises(PassFailure, match="two different submeshes") as e:
        mm.mjit(_conflicting_registration())(params, x)
    assert e.value.pass_argument == "mm-match-tasks"
    argv = shlex.split(e.value.repro)
    repro = Path(argv[1])
    m = re.fullmatch(r"builtin\.module\(mm-match-tasks\{rules-file=([^}]+)\}\)", argv[3])
    assert m, e.value.repro
    rules = Path(m.group(1))
    assert rules.parent == repro.parent and rules.name.startswith(repro.stem)
    doc = json.loads(rules.read_text())
    assert [r["matcher"] for r in doc["rules"]] == ["(layer1)"]
    assert doc["rules"][0]["matches"][0]["task"]["devices"] == [4, 5]
    if dumping:  # the dumps carry the rules too, for replaying from 00-input.mlir
        assert repro.parent.parent == tmp_path
        assert (repro.parent / "mm-match-tasks.rules.json").read_text() == rules.read_text()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv[1:])
    assert code == 1
    assert "task 'head' was given two different submeshes" in err.getvalue()


def test_a_failing_match_is_reported_even_when_its_rules_cannot_be_named(
        tmp_path, monkeypatch):
    """A temporary directory whose path no pipeline can spell: the pass's own failure
    is raised, with a note saying why the repro line lacks the rules."""
    spaced = tmp_path / "with space"
    spaced.mkdir()
    monkeypatch.delenv("MULTIMESH_DUMP_IR_TO", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(spaced))
    params, x = float_args()
    with pytest.raises(PassFailure, match="two different submeshes") as e:
        mm.mjit(_conflicting_registration())(params, x)
    assert "the repro lacks this pass's in-memory state" in str(e.value)
    assert "spaces, commas, braces or quotes" in str(e.value)
    assert list(spaced.glob("*.rules.json")) == []


def test_bad_rules_are_reported_when_the_pipeline_is_parsed():
    with pytest.raises(PipelineError, match="not valid JSON"):
        parse_pipeline("builtin.module(mm-match-tasks{rules=[oops})")
    with pytest.raises(PipelineError, match="axis_sizes"):
        parse_pipeline('builtin.module(mm-match-tasks{rules={"rules":[{"matcher":"a",'
                       '"task":{"devices":[0,1],"axis_names":["x"],"axis_sizes":[4]}}]}})')
    with pytest.raises(PipelineError, match="matches the empty string"):
        parse_pipeline('builtin.module(mm-match-tasks{rules={"rules":[{"matcher":"a*",'
                       '"task":{"devices":[0]}}]}})')
    with pytest.raises(PipelineError, match="cannot be read"):
        parse_pipeline("builtin.module(mm-match-tasks{rules-file=/nonexistent/rules.json})")


# --------------------------------------------------------------------------- contexts


def _names(regs):
    return [r.matcher for r in regs]


def test_innermost_context_first_then_registration_order():
    mm.register_task("a", task=mm.Task(mesh_slice={"stage": 0}))
    outer, inner = mm.Context(), mm.Context()
    outer.register_task("b", task=mm.Task(mesh_slice={"stage": 0}))
    inner.register_task("c", task=mm.Task(mesh_slice={"stage": 0}))
    inner.register_task("d", task=mm.Task(mesh_slice={"stage": 0}))
    assert _names(_registrations.active_registrations()) == ["a"]
    with outer:
        with inner:
            assert _names(_registrations.active_registrations()) == ["c", "d", "b", "a"]
            mm.register_task("e", task=mm.Task(mesh_slice={"stage": 0}))  # goes to `inner`
            assert _names(_registrations.active_registrations()) == ["c", "d", "e", "b", "a"]
        assert _names(_registrations.active_registrations()) == ["b", "a"]
    assert _names(_registrations.active_registrations()) == ["a"]
    assert _names(inner.registered) == ["c", "d", "e"]


def test_clear_tasks_and_re_entering_a_context():
    ctx = mm.Context()
    ctx.register_task("b", task=mm.Task(mesh_slice={"stage": 0}))
    mm.register_task("a", task=mm.Task(mesh_slice={"stage": 0}))
    with ctx:
        mm.clear_tasks()
        assert _registrations.active_registrations() == []
    assert _registrations.active_registrations() == []  # the global "a" is gone for good
    with ctx:  # a context's own registrations come back when it is entered again
        assert _names(_registrations.active_registrations()) == ["b"]


def test_tasks_configurable_scopes_registrations():
    mm.register_task("old", task=mm.Task(mesh_slice={"stage": 0}))

    class Config:
        def __call__(self):
            mm.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))

    with mm.tasks(Config):
        assert _names(_registrations.active_registrations()) == ["layer0"]
    assert _registrations.active_registrations() == []
    with mm.tasks():
        assert _registrations.active_registrations() == []


def test_inner_context_overrides_outer_registration():
    mm.register_task("layer0", task=mm.Task(name="outer", mesh_slice={"stage": 0}))
    mm.register_task("layer1", task=mm.Task(mesh_slice={"stage": 1}))
    params, x = float_args()
    with mm.MultiMesh(global_mesh=global_mesh()):
        with mm.Context() as ctx:
            ctx.register_task("layer0", task=mm.Task(name="inner", mesh_slice={"stage": 1}))
            compiled = mm.mjit(model).lower(params, x).compile()
    assert fragment_devices(compiled) == {"inner": [4, 5, 6, 7], "layer1": [4, 5, 6, 7]}


def test_mjit_recompiles_when_registrations_change():
    params, x = float_args()
    fun = mm.mjit(model)
    multi_mesh = mm.MultiMesh(global_mesh=global_mesh())
    with multi_mesh:
        mm.register_task("layer[01]", task=mm.Task(mesh_slice={"stage": 0}))
        a = fun(params, x)
    with multi_mesh:  # the registration went into multi_mesh: still in effect
        b = fun(params, x)
    with multi_mesh:
        mm.clear_tasks()
        mm.register_task("layer[01]", task=mm.Task(mesh_slice={"stage": 1}))
        c = fun(params, x)
    assert {d.id for d in a.devices()} == {d.id for d in b.devices()} == {0, 1, 2, 3}
    assert {d.id for d in c.devices()} == {4, 5, 6, 7}
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-5)


def test_ignore_transforms_turns_matching_off():
    mm.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
    with mm.ignore_transforms():
        assert _implicit_tasks.implicit_task_rules("module {}") is None


# --------------------------------------------------------------------------- MultiMesh


def test_multimesh_slices_and_mesh_surface():
    multi_mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "batch", "model"))
    assert multi_mesh.axis_names == ("stage", "batch", "model")
    assert multi_mesh.axis_sizes == (2, 2, 2) and multi_mesh.size == 8
    assert repr(multi_mesh).startswith("MultiMesh(Mesh(")
    s = multi_mesh.slice(stage=1)
    assert isinstance(s, Mesh) and s.axis_names == ("stage", "batch", "model")
    assert s.devices.shape == (1, 2, 2)
    assert [d.id for d in s.devices.flat] == [4, 5, 6, 7]
    assert multi_mesh.single_slice_ids(stage=0, model=1) == [1, 3]
    with pytest.raises(MeshError, match=r"unknown axis name\(s\) \['pipe'\].*stage"):
        multi_mesh.slice(pipe=0)
    with pytest.raises(MeshError, match="out of range for axis 'stage' of size 2"):
        multi_mesh.slice(stage=2)


def test_multimesh_enter_and_decorator():
    multi_mesh = mm.MultiMesh(global_mesh=global_mesh())
    from multimesh.jax import _contexts

    assert not _contexts.state.autoshard

    @multi_mesh
    def inside():
        assert _contexts.state.autoshard
        assert _global_mesh.active_multimesh() is multi_mesh
        return True

    assert inside()
    assert _global_mesh.active_multimesh() is None and not _contexts.state.autoshard


def test_explicit_task_with_mesh_slice():
    def fun(params, x):
        return mm.task(f, name="sliced", mesh_slice={"stage": 1})(params[0], x)

    params, x = float_args()
    with mm.MultiMesh(global_mesh=global_mesh()):
        compiled = mm.mjit(fun).lower(params, x).compile()
    assert fragment_devices(compiled) == {"sliced": [4, 5, 6, 7]}


# --------------------------------------------------------------------------- errors


def test_error_matcher_matches_empty_string():
    task = mm.Task(mesh_slice={"stage": 0})
    for matcher in ("", "x*", "(a|)"):
        with pytest.raises(MultimeshValueError, match="matches the empty string") as e:
            mm.register_task(matcher, task=task)
        assert isinstance(e.value, ValueError)
    with pytest.raises(MultimeshValueError, match="not a valid regular expression"):
        mm.register_task("layer(", task=task)


def test_error_empty_capture_group_at_compile_time():
    def fun(x):
        with jax.named_scope("layer"):
            return jnp.sin(x)

    mm.register_task(r"layer(\d*)", task=mm.Task(mesh=mm.TaskMesh(devices=(0,))))
    with pytest.raises(MultimeshValueError,
                       match=r"matcher 'layer\(\\d\*\)' produced an empty match on the op "
                             r"name stack 'jit\(fun\)/layer/sin'"):
        mm.mjit(fun).lower(jnp.ones(4))


def test_error_one_name_two_device_sets():
    def callback(name, backprop):
        return mm.Task(name="layer", mesh_slice={"stage": int(name[-1])})

    params, x = float_args()
    with mm.MultiMesh(global_mesh=global_mesh()) as multi_mesh:
        multi_mesh.register_task(r"layer\d", callback=callback)
        with pytest.raises(MultimeshValueError,
                           match=r"Task name 'layer' was given two different device sets: "
                                 r"match 'layer0' \(forward\).* \[0, 1, 2, 3\].*match 'layer1' "
                                 r"\(forward\).* \[4, 5, 6, 7\]"):
            mm.mjit(model).lower(params, x)


def test_error_callback_returns_non_task():
    mm.register_task("layer0", callback=lambda name, backprop: {"mesh_slice": {"stage": 0}})
    params, x = float_args()
    with pytest.raises(MultimeshTypeError, match="must return a multimesh.jax.Task.*dict") as e:
        mm.mjit(model).lower(params, x)
    assert isinstance(e.value, TypeError)


def test_error_neither_callback_nor_task():
    with pytest.raises(MultimeshValueError, match="needs either `callback=`.*or `task=`"):
        mm.register_task("layer0")
    with pytest.raises(MultimeshValueError, match="got both `callback=` and `task=`"):
        mm.register_task("layer0", callback=layer_callback,
                         task=mm.Task(mesh_slice={"stage": 0}))
    with pytest.raises(MultimeshValueError, match="neither `mesh` nor `mesh_slice`"):
        mm.register_task("layer0", task=mm.Task(name="x"))
    with pytest.raises(MultimeshTypeError, match="must be a multimesh.jax.Task"):
        mm.register_task("layer0", task={"mesh_slice": {"stage": 0}})


def test_error_both_mesh_and_mesh_slice():
    with pytest.raises(MultimeshValueError,
                       match="cannot have both `mesh` and `mesh_slice`; give one of them"):
        mm.Task(mesh=mm.TaskMesh(devices=(0, 1)), mesh_slice={"stage": 0})


def test_error_mesh_slice_outside_multimesh():
    mm.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
    params, x = float_args()
    with pytest.raises(MeshError, match=r"Task 'layer0' has mesh_slice=\{'stage': 0\}, but "
                                        r"there is no global mesh to slice"):
        mm.mjit(model).lower(params, x)


def test_error_mesh_slice_names_unknown_axis():
    mm.register_task("layer0", task=mm.Task(mesh_slice={"pipe": 0}))
    params, x = float_args()
    with mm.MultiMesh(global_mesh=global_mesh()):
        with pytest.raises(MeshError, match=r"Task 'layer0' mesh_slice: unknown axis name"):
            mm.mjit(model).lower(params, x)


def test_errors_are_multimesh_errors():
    for cls in (MeshError, MultimeshTypeError, MultimeshValueError):
        assert issubclass(cls, MultimeshError)
