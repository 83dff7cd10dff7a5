"""The front end's typed door into the passes, and the typed notes of a trace.

``multimesh.passes.build_pipeline(PipelineOptions(...))`` builds the pipeline ``mjit``
runs, pass instances throughout; its text is what repros and ``mm-opt`` replay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import multimesh.jax as mm
import multimesh.passes
from multimesh._src.errors import MultimeshValueError, PipelineError
from multimesh.jax._stages import pipeline as _pipeline
from multimesh.jax._trace_notes import TraceNotes
from multimesh.passes.api import (
    MergeFragments,
    PipelineOptions,
    Rule,
    SplitBackward,
    build_pipeline,
    compile_matcher,
)
from multimesh.passes.base import ModulePass

HEAD = ("mm-import-gspmd,mm-inline-tasks,mm-assign-tasks{num-devices=8},"
        "mm-resolve-logical-shardings,mm-outline-fragments")
TAIL = "mm-merge-fragments,mm-insert-transfers,mm-extract-fragments"


def _text(**options) -> str:
    return str(build_pipeline(PipelineOptions(8, **options)))


def test_the_package_exports_the_door():
    assert multimesh.passes.build_pipeline is build_pipeline
    assert multimesh.passes.PipelineOptions is PipelineOptions
    with pytest.raises(AttributeError, match="no attribute 'build_pipelines'"):
        multimesh.passes.build_pipelines  # noqa: B018


def test_a_plain_program_runs_the_default_passes():
    pipe = build_pipeline(PipelineOptions(8))
    assert all(isinstance(s, ModulePass) for s in pipe.steps)
    assert str(pipe) == f"builtin.module({HEAD},mm-propagate-shardings,{TAIL})"
    assert _pipeline.default_pipeline(8) == str(pipe)


@pytest.mark.parametrize("options,middle", [
    ({"split_backward": SplitBackward.FLAGGED}, "mm-split-backward,mm-propagate-shardings"),
    ({"split_backward": SplitBackward.ALL}, "mm-split-backward{all=true},mm-propagate-shardings"),
    ({"recompute_transfers": True}, "mm-recompute-transfers,mm-propagate-shardings"),
    ({"remat_tasks": ("b", "a"), "remat_inputs_of": ("c",)},
     "mm-recompute-forward{tasks={b,a},inputs-of=c},mm-propagate-shardings"),
    ({"microbatched": True},
     "mm-propagate-shardings,mm-form-microbatch-loop,mm-schedule-fragments"),
    ({"split_backward": SplitBackward.ALL, "recompute_transfers": True, "microbatched": True},
     "mm-split-backward{all=true},mm-recompute-transfers,mm-propagate-shardings,"
     "mm-form-microbatch-loop,mm-schedule-fragments"),
])
def test_each_option_adds_its_pass_in_order(options, middle):
    tail = TAIL.removeprefix("mm-merge-fragments,") if "remat_tasks" in options else TAIL
    assert _text(**options) == f"builtin.module({HEAD},{middle},{tail})"


def test_merging_fragments_is_an_option(monkeypatch):
    """``merge_fragments``: the default merges a one-submesh program's fragments; ``ALL``
    every run, ``OFF`` leaves the pass out; mjit reads ``$MULTIMESH_MERGE_FRAGMENTS``."""
    tail = TAIL.removeprefix("mm-merge-fragments,")
    middle = f"{HEAD},mm-propagate-shardings"
    assert _text(merge_fragments=MergeFragments.OFF) == f"builtin.module({middle},{tail})"
    assert _text(merge_fragments=MergeFragments.ALL) == \
        f"builtin.module({middle},mm-merge-fragments{{scope=all}},{tail})"
    # a backward that recomputes its forward (remat=True) stays apart from it
    assert "mm-merge-fragments" not in _text(remat_tasks=("a",))
    monkeypatch.setenv("MULTIMESH_MERGE_FRAGMENTS", "all")
    assert "mm-merge-fragments{scope=all}" in _pipeline.default_pipeline(8)
    monkeypatch.setenv("MULTIMESH_MERGE_FRAGMENTS", "off")
    assert "mm-merge-fragments" not in _pipeline.default_pipeline(8)
    monkeypatch.setenv("MULTIMESH_MERGE_FRAGMENTS", "sometimes")
    with pytest.raises(MultimeshValueError, match="must be one of off, one-submesh, all, got "
                                                  "'sometimes'"):
        _pipeline.default_pipeline(8)


def test_task_rules_run_the_matcher_first():
    rule = Rule("layer.*", compile_matcher("layer.*"))
    pipe = build_pipeline(PipelineOptions(8, task_rules=[rule]))
    assert pipe.steps[1].argument == "mm-match-tasks"
    assert pipe.steps[1].rule_table == (rule,)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_devices": 0}, "num_devices must be a positive integer, got 0"),
    ({"num_devices": True}, "num_devices must be a positive integer, got True"),
    ({"num_devices": 8, "split_backward": "all"},
     r"split_backward must be a SplitBackward \(NONE, FLAGGED, ALL\), got 'all'"),
    ({"num_devices": 8, "task_rules": ("layer.*",)}, "task_rules must hold"),
    ({"num_devices": 8, "merge_fragments": "all"},
     r"merge_fragments must be a MergeFragments \(OFF, ONE_SUBMESH, ALL\), got 'all'"),
])
def test_bad_options_are_rejected_early(kwargs, match):
    with pytest.raises(PipelineError, match=match) as e:
        PipelineOptions(**kwargs)
    assert isinstance(e.value, MultimeshValueError)


def test_trace_notes_reject_a_misspelt_field():
    notes = TraceNotes()
    with pytest.raises(AttributeError):
        notes.split_backprops = True  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        notes.logical_name  # type: ignore[attr-defined]  # noqa: B018


def test_mjit_builds_its_pipeline_from_the_notes():
    """A zero-bubble schedule splits every backward; the pipeline mjit lowers with is
    the door's, and the program still computes plain jax's numbers."""
    def stage(k):
        mesh = mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))
        return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"s{k}", mesh=mesh)

    s0, s1 = stage(0), stage(1)

    def loss(ws, x):
        return (s1(ws[1], s0(ws[0], x)) ** 2).sum()

    ws, x = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.25], jnp.linspace(0, 1, 64).reshape(8, 8)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=2, argnum=1, schedule="zb-h1")
    lowered = mm.mjit(step).lower(ws, x)
    assert str(lowered.pipeline) == str(build_pipeline(PipelineOptions(
        8, split_backward=SplitBackward.ALL, microbatched=True)))
    value, grads = lowered.compile()(ws, x)
    with mm.ignore_transforms():
        want_value, want_grads = jax.value_and_grad(loss)(ws, x)
    assert jnp.allclose(value, want_value, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        assert jnp.allclose(g, w, rtol=1e-5, atol=1e-6)
    assert sorted(d.id for d in grads[1].devices()) == [4, 5, 6, 7]
