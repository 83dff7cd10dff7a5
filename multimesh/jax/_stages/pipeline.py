"""The pass pipeline ``mjit`` runs, from what the trace learnt about the program.

The front end only says what the program needs (:class:`PipelineOptions`); which
passes run, in which order, is the pass layer's (``multimesh.passes.build_pipeline``).
The loop's schedule travels on the module instead (``schedule_config_of``), so a repro
replays it.
"""

from __future__ import annotations

import os

from multimesh._src.errors import MultimeshValueError
from multimesh.jax._trace_notes import MicrobatchNote, TraceNotes
from multimesh.passes.api import (
    MergeFragments,
    Pipeline,
    PipelineOptions,
    Rule,
    SplitBackward,
    build_pipeline,
)
from multimesh.schedules import get_schedule

__all__ = ["program_pipeline", "plain_pipeline", "default_pipeline", "schedule_config_of",
           "merge_fragments", "MERGE_ENV"]

MERGE_ENV = "MULTIMESH_MERGE_FRAGMENTS"
"""Which consecutive fragments on one submesh become one call (``mm-merge-fragments``):
``one-submesh`` (the default), ``all`` or ``off``."""


def merge_fragments() -> MergeFragments:
    """``$MULTIMESH_MERGE_FRAGMENTS``, checked (docs/performance.md, "Fewer calls")."""
    raw = os.environ.get(MERGE_ENV, "")
    env = raw.strip().lower()
    if not env:
        return MergeFragments.ONE_SUBMESH
    for choice in MergeFragments:
        if env == choice.value:
            return choice
    raise MultimeshValueError(
        f"{MERGE_ENV} must be one of {', '.join(m.value for m in MergeFragments)}, got "
        f"{raw!r}; for example {MERGE_ENV}=all to merge a pipeline's last stage's forward "
        f"and backward too, or {MERGE_ENV}=off to keep every fragment a call of its own.")


def plain_pipeline(num_devices: int) -> Pipeline:
    """The pipeline of a program with no registered tasks, loop, split or recompute."""
    return build_pipeline(PipelineOptions(num_devices, merge_fragments=merge_fragments()))


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
        microbatched=mb is not None, merge_fragments=merge_fragments()))


def _split_backward(notes: TraceNotes) -> SplitBackward:
    """All backwards (a zero-bubble schedule), the flagged tasks', or none."""
    mb = notes.microbatch
    if mb is not None and get_schedule(mb.schedule).splits_backward:
        return SplitBackward.ALL
    return SplitBackward.FLAGGED if notes.split_backprop else SplitBackward.NONE


def default_pipeline(num_devices: int) -> str:
    """The pass pipeline for a plain program (also printed in repro commands)."""
    return str(plain_pipeline(num_devices))


def schedule_config_of(notes: TraceNotes) -> dict | None:
    """The microbatch loop's schedule, stored on the module (so repros replay it).

    Only what the program asked for: the pass warns about a schedule that cannot
    apply, and a default GPipe was not asked for.
    """
    cfg: MicrobatchNote | None = notes.microbatch
    if cfg is None:
        return None
    out: dict = {}
    if cfg.requested:
        out["schedule"] = cfg.schedule
    for key in ("num_stages", "interleave", "unrolling"):
        if getattr(cfg, key):
            out[key] = int(getattr(cfg, key))
    if cfg.custom:
        out["custom_schedule"] = [[[int(mb), name] for mb, name in row] for row in cfg.custom]
    return out
