"""The front end's door into the passes: typed options in, pass instances out.

``mjit`` says what a program needs (:class:`PipelineOptions`: its device count, the
registered tasks' rules, which backwards split and which recompute, whether it is
microbatched) and :func:`build_pipeline` turns that into the pass pipeline, so the
pass layer alone knows which pass does what and in which order, and no option travels
as text to be parsed back. The other names here are what the front end reads from
the passes' side (the pipeline runner, the task-rule records, the schedule reader,
the Shardy:MPMD topology readers); ``multimesh.jax`` imports the pass layer through
this module only (``tests/test_layering.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from multimesh._src.errors import PipelineError

from .base import ModulePass
from .import_mpmd import parse_mesh_tensor, read_topology
from .match_tasks import Rule, RuleTask, compile_matcher, find_matches
from .pipeline import VERIFIER, Pipeline, PipelineHooks, parse_pipeline
from .registry import get_all_passes
from .schedule_fragments import read_schedule, schedule_from_order

__all__ = ["PipelineOptions", "SplitBackward", "MergeFragments", "build_pipeline", "Pipeline", "PipelineHooks",
           "VERIFIER", "parse_pipeline", "Rule", "RuleTask", "compile_matcher", "find_matches",
           "read_schedule", "schedule_from_order", "parse_mesh_tensor", "read_topology"]


class SplitBackward(enum.Enum):
    """Which backward fragments ``mm-split-backward`` splits into activation and weight
    halves."""

    NONE = "none"
    """No split (the pass does not run)."""
    FLAGGED = "flagged"
    """Only the backwards of tasks with ``split_backprop``."""
    ALL = "all"
    """Every backward (zero-bubble schedules)."""


class MergeFragments(enum.Enum):
    """Which runs of consecutive fragments on one submesh ``mm-merge-fragments`` merges
    into one fragment call."""

    OFF = "off"
    """None (the pass does not run)."""
    ONE_SUBMESH = "one-submesh"
    """Only in a program whose fragments all run on one submesh (the default)."""
    ALL = "all"
    """In every program (a pipeline's last stage's forward and backward, ...)."""


@dataclass(frozen=True)
class PipelineOptions:
    """What a program needs from the passes (see :func:`build_pipeline`)."""

    num_devices: int
    """The program's device count (``mm-assign-tasks``' default task spans them)."""
    task_rules: tuple[Rule, ...] = ()
    """The registered tasks' rules (``mm-match-tasks``, in memory); none: no matching."""
    remat_tasks: tuple[str, ...] = ()
    """Registered tasks whose backward recomputes its forward (``mm-recompute-forward``)."""
    remat_inputs_of: tuple[str, ...] = ()
    """Explicit tasks traced under ``jax.checkpoint`` (``mm-recompute-forward``)."""
    split_backward: SplitBackward = SplitBackward.NONE
    recompute_transfers: bool = False
    """Recompute cheap values instead of moving them (``mm-recompute-transfers``)."""
    microbatched: bool = False
    """Form the microbatch loop and schedule it; the schedule's options are the module's
    ``mm.schedule_config``."""
    merge_fragments: MergeFragments = MergeFragments.ONE_SUBMESH
    """Merge runs of consecutive fragments on one submesh (``mm-merge-fragments``); not
    with ``remat_tasks``, whose backwards recompute what merging would share again."""

    def __post_init__(self):
        n = self.num_devices
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise PipelineError(
                f"PipelineOptions.num_devices must be a positive integer, got {n!r}.")
        if not isinstance(self.split_backward, SplitBackward):
            raise PipelineError(
                f"PipelineOptions.split_backward must be a SplitBackward "
                f"({', '.join(s.name for s in SplitBackward)}), got {self.split_backward!r}.")
        for name in ("task_rules", "remat_tasks", "remat_inputs_of"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not isinstance(self.merge_fragments, MergeFragments):
            raise PipelineError(
                f"PipelineOptions.merge_fragments must be a MergeFragments "
                f"({', '.join(s.name for s in MergeFragments)}), got {self.merge_fragments!r}.")
        if any(not isinstance(r, Rule) for r in self.task_rules):
            raise PipelineError("PipelineOptions.task_rules must hold "
                                "multimesh.passes.api.Rule values.")


def _new(argument: str, **options) -> ModulePass:
    return get_all_passes()[argument]()(**options)


def build_pipeline(options: PipelineOptions) -> Pipeline:
    """The pass pipeline for a program (``str()`` of it is its ``builtin.module(...)``
    text, which ``mm-opt`` replays)."""
    steps = [_new("mm-import-gspmd")]
    if options.task_rules:
        steps.append(_new("mm-match-tasks", rule_table=options.task_rules))
    steps += [_new("mm-inline-tasks"), _new("mm-assign-tasks", num_devices=options.num_devices),
              _new("mm-resolve-logical-shardings"), _new("mm-outline-fragments")]
    if options.remat_tasks or options.remat_inputs_of:
        steps.append(_new("mm-recompute-forward", tasks=options.remat_tasks,
                          inputs_of=options.remat_inputs_of))
    if options.split_backward is not SplitBackward.NONE:
        steps.append(_new("mm-split-backward", all=options.split_backward is SplitBackward.ALL,
                          recompute=options.remat_tasks + options.remat_inputs_of))
    if options.recompute_transfers:
        steps.append(_new("mm-recompute-transfers"))
    steps.append(_new("mm-propagate-shardings"))
    if options.microbatched:
        steps += [_new("mm-form-microbatch-loop"), _new("mm-schedule-fragments")]
    # merged with its forward, a backward that recomputes the forward's residuals
    # (remat=True) would share them again: XLA computes equal values once
    if options.merge_fragments is not MergeFragments.OFF and not options.remat_tasks:
        steps.append(_new("mm-merge-fragments", scope=options.merge_fragments.value))
    steps += [_new("mm-insert-transfers"), _new("mm-extract-fragments")]
    return parse_pipeline(steps)
