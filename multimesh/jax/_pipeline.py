"""The pass pipeline ``mjit`` runs, from what the trace learnt about the program.

The front end only says what the program needs (:class:`PipelineOptions`); which
passes run, in which order, is the pass layer's (``multimesh.passes.build_pipeline``).
"""

from __future__ import annotations

from multimesh.jax._trace_notes import TraceNotes
from multimesh.passes.api import Pipeline, PipelineOptions, Rule, SplitBackward, build_pipeline
from multimesh.schedules import get_schedule

__all__ = ["program_pipeline", "plain_pipeline"]


def plain_pipeline(num_devices: int) -> Pipeline:
    """The pipeline of a program with no registered tasks, loop, split or recompute."""
    return build_pipeline(PipelineOptions(num_devices))


def program_pipeline(num_devices: int, notes: TraceNotes, task_rules: tuple[Rule, ...] | None,
                     recompute_transfers: bool) -> Pipeline:
    """The pipeline of a traced program on ``num_devices`` devices.

    ``task_rules``: the registered tasks' rules (None: no registered task matched).
    """
    mb = notes.microbatch
    return build_pipeline(PipelineOptions(
        num_devices, task_rules=task_rules or (),
        remat_tasks=tuple(sorted(notes.remat_tasks)),
        remat_inputs_of=tuple(sorted(notes.remat_inputs_of)),
        split_backward=_split_backward(notes), recompute_transfers=recompute_transfers,
        microbatched=mb is not None))


def _split_backward(notes: TraceNotes) -> SplitBackward:
    """All backwards (a zero-bubble schedule), the flagged tasks', or none."""
    mb = notes.microbatch
    if mb is not None and get_schedule(mb.schedule).splits_backward:
        return SplitBackward.ALL
    return SplitBackward.FLAGGED if notes.split_backprop else SplitBackward.NONE
