"""The pass pipeline runner: no printing on success, repro files on failure, verification
once at the end (after every pass in debug mode), and compile-phase logging."""

from __future__ import annotations

import logging
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.errors import PassFailure
from multimesh._src.mlir import ir
from multimesh.jax._stages import compiled as _compiled
from multimesh.jax._stages import lowered as _lowered
from multimesh.jax._stages import pipeline_runner as _pipeline_runner
from multimesh.passes.insert_transfers import InsertTransfersPass
from multimesh.tools import mm_opt


def _two_stage():
    def body(w, x):
        return jnp.tanh(x @ w)

    tasks = [mm.task(body, name=f"s{k}", mesh=mm.TaskMesh(devices=range(4 * k, 4 * k + 4)))
             for k in range(2)]

    def loss(ws, x):
        for t, w in zip(tasks, ws):
            x = t(w, x)
        return (x ** 2).mean()

    ws = [jnp.eye(8) * 0.5 + 0.01 * k for k in range(2)]
    return loss, ws, jnp.linspace(-1, 1, 64).reshape(8, 8)


def _check_against_jax(compiled, loss, ws, x):
    value, grads = compiled(ws, x)
    with mm.ignore_transforms():
        ref_value, ref_grads = jax.value_and_grad(loss)(ws, x)
    np.testing.assert_allclose(np.asarray(value), np.asarray(ref_value), rtol=1e-5)
    for k, (g, r) in enumerate(zip(grads, ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-7)
        assert sorted(d.id for d in g.devices()) == list(range(4 * k, 4 * k + 4))


def test_compiling_prints_nothing(monkeypatch):
    """A successful compile never prints the module (printing costs as much as parsing);
    the final program is printed only when asked for."""
    printed = []
    real = _compiled.print_module
    for module in (_compiled, _lowered, _pipeline_runner):
        monkeypatch.setattr(module, "print_module",
                            lambda *a, **k: printed.append(1) or real(*a, **k))
    loss, ws, x = _two_stage()
    compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    assert printed == []
    _check_against_jax(compiled, loss, ws, x)
    assert "mm.fragment_call" in compiled.as_text() and printed == [1]


def test_verification_runs_once(monkeypatch):
    import multimesh.passes.base as base
    import multimesh.passes.pipeline as pipeline

    calls = []
    real, real_each = pipeline._verify, base.verify_module
    monkeypatch.setattr(pipeline, "_verify", lambda m, a: calls.append(a) or real(m, a))
    monkeypatch.setattr(base, "verify_module",
                        lambda m, a: calls.append(a) or real_each(m, a))
    loss, ws, x = _two_stage()
    monkeypatch.delenv(pipeline.VERIFY_EACH_ENV, raising=False)
    compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    assert calls == [None]
    _check_against_jax(compiled, loss, ws, x)
    calls.clear()
    monkeypatch.setenv(pipeline.VERIFY_EACH_ENV, "1")
    mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    assert calls == [s.argument for s in pipeline.parse_pipeline(
        mm.mjit(jax.value_and_grad(loss)).lower(ws, x).pipeline).steps]


def _repro_input(error: PassFailure) -> str:
    path = shlex.split(error.repro)[1]
    with open(path) as f:
        return f.read()


def test_failing_late_pass_writes_its_own_input(tmp_path, monkeypatch):
    """The repro file holds what the failing pass received (the passes before it are
    replayed), with locations, and the printed mm-opt line reproduces the error."""
    monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path))
    loss, ws, x = _two_stage()
    rows = [["s0", "s0", "s0_bwd", "s0_bwd"], ["s1", "s1_bwd", "s1", "s1_bwd", "s2", "s2"]]
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1,
                         custom_schedule=rows)
    with pytest.raises(PassFailure, match="names 's2'") as e:
        mm.mjit(step).lower(ws, x).compile()
    assert e.value.pass_argument == "mm-schedule-fragments"
    assert "Reproduce with:\n  mm-opt " in str(e.value)
    text = _repro_input(e.value)
    assert "mm.microbatch_loop" in text  # mm-form-microbatch-loop ran before it
    assert "mm.fragment_call" not in text  # mm-extract-fragments did not
    assert re.search(r'loc\(".*\.py":\d+', text), "the repro keeps source locations"
    argv = shlex.split(e.value.repro)[1:]
    assert mm_opt.main(argv) == 1


def _break_ir(module: ir.Module) -> None:
    """Make ``@main``'s signature disagree with its entry block (invalid IR)."""
    with module.context, ir.Location.unknown():
        for op in module.body.operations:
            op = op.operation
            if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                ft = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                extra = ir.RankedTensorType.get([3], ir.F32Type.get())
                op.attributes["function_type"] = ir.TypeAttr.get(
                    ir.FunctionType.get([*ft.inputs, extra], ft.results))


@pytest.mark.parametrize("each", [False, True])
def test_pass_that_breaks_the_ir_is_named(tmp_path, monkeypatch, each):
    """Verification at the end finds the broken IR; replaying the passes with
    verification after each names the pass that broke it (as debug mode does)."""
    import multimesh.passes.pipeline as pipeline

    monkeypatch.setenv("MULTIMESH_DUMP_IR_TO", str(tmp_path))
    if each:
        monkeypatch.setenv(pipeline.VERIFY_EACH_ENV, "1")
    else:
        monkeypatch.delenv(pipeline.VERIFY_EACH_ENV, raising=False)
    real = InsertTransfersPass.apply

    def broken(self, module):
        real(self, module)
        _break_ir(module)

    monkeypatch.setattr(InsertTransfersPass, "apply", broken)
    loss, ws, x = _two_stage()
    with pytest.raises(PassFailure, match="'mm-insert-transfers' produced invalid IR") as e:
        mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    assert e.value.pass_argument == "mm-insert-transfers"
    text = _repro_input(e.value)
    assert "mm.transfer" not in text and "mm.fragment" in text  # the pass's input


def test_mm_opt_verify_each_and_timing(tmp_path, capsys):
    src = tmp_path / "in.mlir"
    src.write_text("""module {
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @f(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64, devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @f(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
""")
    pipe = "builtin.module(mm-inline-tasks,mm-assign-tasks{num-devices=8})"
    assert mm_opt.main([str(src), "-p", pipe, "--mlir-timing"]) == 0
    err = capsys.readouterr().err
    for name in ("mm-inline-tasks", "mm-assign-tasks", "Verifier", "Total"):
        assert name in err, err
    assert mm_opt.main([str(src), "-p", pipe, "--verify-each", "--mlir-timing"]) == 0
    assert "Verifier" not in capsys.readouterr().err  # verified inside each pass's time


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_compile_phases_are_logged(caplog):
    """Every phase of a compile is logged on the ``multimesh`` logger: DEBUG records
    normally, WARNING ones under ``jax_log_compiles`` (like jax's own)."""
    from multimesh.runtime import executor

    loss, ws, x = _two_stage()
    executor._COMPILE_CACHE.clear()
    with caplog.at_level(logging.DEBUG, logger="multimesh"):
        compiled = mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    _check_against_jax(compiled, loss, ws, x)
    messages = [r.getMessage() for r in caplog.records if r.name == "multimesh"]
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "multimesh")
    text = "\n".join(messages)
    assert re.search(r"mjit\(loss\): traced and lowered in [\d.]+ s", text), text
    for step in ("mm-inline-tasks", "mm-outline-fragments", "mm-extract-fragments"):
        assert re.search(rf"pass {step} took [\d.]+ s", text), text
    assert "verified the module in" in text
    assert re.search(r"built the runtime plan in [\d.]+ s \(\d+ fragments", text)
    for f in compiled.fragments:
        assert re.search(rf"XLA compiled fragment {f['name']} on devices", text), f["name"]
    assert "finished compiling" in text
    # the same figures, on the compiled program
    names = [n for n, _ in compiled.pass_times]
    assert names[0] == "mm-import-gspmd" and names[-1] == "(verifier)", names
    assert sum(t for _, t in compiled.pass_times) <= compiled.compile_times["passes"]
    assert set(compiled.xla_times) == {f["name"] for f in compiled.fragments}
    # fragments compile concurrently (MULTIMESH_COMPILE_THREADS): their times overlap
    assert max(compiled.xla_times.values()) <= compiled.compile_times["xla"]
    caplog.clear()
    executor._COMPILE_CACHE.clear()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="multimesh"):
        mm.mjit(jax.value_and_grad(loss)).lower(ws, x).compile()
    ours = [r for r in caplog.records if r.name == "multimesh"]
    assert ours and all(r.levelno == logging.WARNING for r in ours)
    assert any("pass mm-propagate-shardings took" in r.getMessage() for r in ours)


def test_crash_after_invalid_ir_names_the_pass_that_broke_it():
    """Verification only at the end lets a later pass see broken IR; if it crashes,
    replaying with verification after each pass names the pass that broke the IR."""
    from dataclasses import dataclass

    from multimesh._src.errors import DiagnosticError
    from multimesh._src.mlir import make_context, parse_module
    from multimesh.passes.base import ModulePass
    from multimesh.passes.pipeline import Pipeline

    @dataclass(frozen=True)
    class Breaks(ModulePass):
        argument = "test-breaks"
        summary = "Makes the IR invalid."

        def apply(self, module):
            _break_ir(module)

    @dataclass(frozen=True)
    class Crashes(ModulePass):
        argument = "test-crashes"
        summary = "Crashes."

        def apply(self, module):
            raise KeyError("d0")

    text = "func.func @main(%a: tensor<2xf32>) -> tensor<2xf32> {\n  return %a : tensor<2xf32>\n}\n"
    ctx = make_context()
    pipe = Pipeline([Breaks(), Crashes()])
    with pytest.raises(KeyError):
        pipe.run(parse_module(text, ctx))
    with pytest.raises(DiagnosticError, match="'test-breaks' produced invalid IR") as e:
        pipe.run(parse_module(text, ctx), replay=lambda: parse_module(text, ctx))
    assert e.value.failed_index == 0
