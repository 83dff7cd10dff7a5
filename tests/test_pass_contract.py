"""The pass contract, for every registered pass: a failing pass leaves the module untouched.

``ModulePass.run`` (what pipelines, ``mjit`` and ``mm-opt`` call) snapshots the module
with a C++-side clone and puts it back when the pass or the verifier after it raises,
so a repro written after a failure is exactly the failing pass's input. Checked two
ways for each pass in the registry:

* natural failures: golden inputs (``tests/filecheck``) and deterministic mutations
  of them, run with the options of their RUN lines and with defaults;
* late failures: on every golden input the pass rewrites, the verifier after it is made
  to fail, so the whole rewrite must be undone.

Each pass must fail at least once in each way, so the test cannot pass vacuously.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

import multimesh.passes.base as base
from multimesh._src.errors import DiagnosticError, MultimeshError, PassStepError
from multimesh._src.mlir import ir, make_context, print_module
from multimesh.passes import get_all_passes
from multimesh.passes.pipeline import NativeStep, Pipeline, parse_pipeline

sys.path.insert(0, str(Path(__file__).parent))
import test_fuzz_ir as fuzz  # noqa: E402

PASSES = sorted(get_all_passes())
# Shardy aborts the process on some malformed inputs (see test_fuzz_ir): only
# unmutated goldens go through mm-propagate-shardings here.
NO_MUTATION = {"mm-propagate-shardings"}
MUTATIONS = 2  # mutated copies of each golden chunk
MAX_FAILURES = 12  # natural failures checked per pass (enough; keeps the test quick)


def _snapshot(module: ir.Module) -> str:
    return print_module(module, debug_info=True, generic=True)


def _parse(text: str) -> ir.Module | None:
    try:
        with make_context():
            return ir.Module.parse(text)
    except ir.MLIRError:
        return None


def _instances(argument: str, seed) -> list:
    """The pass with default options plus every configuration of it in the seed's RUN lines."""
    out = []
    try:
        out.append(get_all_passes()[argument]()())
    except MultimeshError:  # no usable defaults (none so far)
        pass
    for pipe in seed.pipelines:
        try:
            steps = parse_pipeline(pipe).steps
        except MultimeshError:
            continue
        out += [s for s in steps if getattr(s, "argument", None) == argument and s not in out]
    return out


def _inputs(argument: str):
    rng = random.Random(12)
    for seed in fuzz.load_seeds():
        texts = [seed.text]
        if argument not in NO_MUTATION:
            for _ in range(MUTATIONS):
                t = seed.text
                for _ in range(rng.randint(1, 2)):
                    t = fuzz.MUTATORS[rng.choice(sorted(fuzz.MUTATORS))](t, rng)
                texts.append(t)
        for text in texts:
            yield seed, text


def test_every_pass_is_covered():
    assert len(PASSES) == 18, "a new pass: check that its inputs reach this test"


@pytest.mark.parametrize("argument", PASSES)
def test_a_failing_pass_leaves_the_module_untouched(argument):
    failures = 0
    for seed, text in _inputs(argument):
        for p in _instances(argument, seed):
            module = _parse(text)
            if module is None:
                continue
            before = _snapshot(module)
            try:
                p.run(module)
            except MultimeshError:
                failures += 1
                assert _snapshot(module) == before, (
                    f"{argument} changed the module it failed on ({seed.source}):\n{text}")
                module.operation.verify()
            if failures >= MAX_FAILURES:
                return
    assert failures, f"no input made {argument} fail; add one"


@pytest.mark.parametrize("argument", PASSES)
def test_a_rewrite_is_undone_when_the_verifier_after_it_fails(argument, monkeypatch):
    def failing_verifier(module, arg):
        raise DiagnosticError(f"injected verifier failure after '{arg}'")

    rewrites = 0
    for seed in fuzz.load_seeds():
        for p in _instances(argument, seed):
            module = _parse(seed.text)
            if module is None:
                continue
            before = _snapshot(module)
            try:
                p.run(module, verify=False)
            except MultimeshError:
                continue
            if _snapshot(module) == before:
                continue  # the pass had nothing to do here
            module = _parse(seed.text)
            monkeypatch.setattr(base, "verify_module", failing_verifier)
            with pytest.raises(DiagnosticError, match="injected verifier failure"):
                p.run(module)
            monkeypatch.undo()
            assert _snapshot(module) == before, f"{argument} on {seed.source} was not undone"
            module.operation.verify()
            rewrites += 1
            if rewrites >= 4:
                return
    if argument != "mm-verify":  # mm-verify never rewrites
        assert rewrites, f"no golden input is rewritten by {argument}"


def test_a_pipeline_leaves_the_failing_steps_input():
    """The module after a failed pipeline is the failing step's input: earlier steps stay."""
    text = """
    func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = func.call @t(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64,
          devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}
          : (tensor<8xf32>) -> tensor<8xf32>
      return %0 : tensor<8xf32>
    }
    func.func private @t(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = stablehlo.sine %arg0 : tensor<8xf32>
      return %0 : tensor<8xf32>
    }
    """
    module = _parse(text)
    flat = _parse(text)
    parse_pipeline("builtin.module(mm-inline-tasks)").run(flat)
    with pytest.raises(DiagnosticError, match="mm-insert-transfers expects a module in MPMD") \
            as e:
        parse_pipeline("builtin.module(mm-inline-tasks,mm-insert-transfers)").run(module)
    # raised by the pipeline, typed, with the step; the pass's own error is its cause
    assert type(e.value) is PassStepError and e.value.__cause__ is e.value.error
    assert type(e.value.error) is DiagnosticError and e.value.message == e.value.error.message
    assert (e.value.failed_pass, e.value.failed_element, e.value.failed_index) == (
        "mm-insert-transfers", "mm-insert-transfers", 1)
    assert _snapshot(module) == _snapshot(flat)


def test_a_failing_native_step_is_undone_too():
    class Breaks(NativeStep):
        def apply(self, module):
            with module.context:
                module.operation.attributes["mm.half_done"] = ir.UnitAttr.get()
                for op in list(module.body.operations):
                    op.operation.erase()
            raise DiagnosticError("native pass failed half way")

    module = _parse("module attributes {mm.keep = 1 : i64} {\n  func.func @main() {\n"
                    "    return\n  }\n}\n")
    before = _snapshot(module)
    with pytest.raises(DiagnosticError, match="half way"):
        Pipeline([Breaks("canonicalize")]).run(module)
    assert _snapshot(module) == before


def test_stages_follow_the_pipeline():
    """stage_of reads each form of docs/ir.md as the default pipeline produces it."""
    from multimesh.jax._stages.pipeline import default_pipeline
    from multimesh.passes._stages import stage_of

    text = """
    func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = func.call @t(%arg0) {mm.task = {name = "t", transpose_count = 0 : i64,
          devices = [0, 1], axis_names = ["x"], axis_sizes = [2], logical_axes = []}}
          : (tensor<8xf32>) -> tensor<8xf32>
      %1 = stablehlo.cosine %0 : tensor<8xf32>
      return %1 : tensor<8xf32>
    }
    func.func private @t(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = stablehlo.sine %arg0 : tensor<8xf32>
      return %0 : tensor<8xf32>
    }
    """
    module = _parse(text)
    seen = [stage_of(module)[0]]
    for step in parse_pipeline(default_pipeline(8)).steps:
        step.run(module)
        seen.append(stage_of(module)[0])
    assert seen == ["front-end", "front-end", "flat", "flat", "flat", "mpmd", "mpmd", "mpmd",
                    "mpmd", "extracted"]
    identity = _parse("func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {\n"
                      "  return %arg0 : tensor<8xf32>\n}\n")
    assert stage_of(identity) == (None, None)
    parse_pipeline(default_pipeline(8)).run(identity)  # every pass accepts it


def test_strip_markers_checks_every_marker_before_its_first_edit():
    text = """
    func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = stablehlo.sine %arg0 {mm.task = {name = "t", transpose_count = 0 : i64}} : tensor<8xf32>
      %1 = stablehlo.custom_call @mm.logical_sharding(%0, %0) : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
      return %1 : tensor<8xf32>
    }
    """
    from multimesh.passes.strip_markers import StripMarkersPass

    module = _parse(text)
    before = _snapshot(module)
    with pytest.raises(DiagnosticError, match="exactly one operand and one result"):
        StripMarkersPass().apply(module)  # apply, not run: no snapshot to fall back on
    assert _snapshot(module) == before
