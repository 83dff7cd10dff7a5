"""The pass pipeline ``mjit`` runs, assembled from the features a program uses.

Each feature contributes its passes through one small function here, so the
order of the whole pipeline is visible in one place; below it, the translation of a
trace's notes (microbatch loop, split and recomputed tasks) into its options.
"""

from __future__ import annotations

from multimesh.passes.base import ModulePass
from multimesh.passes.pipeline import Pipeline, parse_pipeline
from multimesh.schedules import get_schedule

__all__ = ["build_pipeline", "default_pipeline", "schedule_config_of", "wants_split",
           "remat_options", "schedule_options"]


def build_pipeline(num_devices: int, *, implicit_tasks: ModulePass | None = None,
                   recompute: bool = False, schedule: str | None = None,
                   split_backward: str | None = None,
                   remat: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> Pipeline:
    """The pass pipeline for a program on ``num_devices`` devices (``str()`` of it is
    its ``builtin.module(...)`` text).

    ``implicit_tasks``: the ``mm-match-tasks`` pass with the registered tasks' rules
    in memory, if any.
    ``recompute``: run the comm-avoiding recompute pass.
    ``split_backward``: options for ``mm-split-backward`` ("all=true" for zero-bubble
    schedules, "" for only tasks with ``split_backprop``), or None.
    ``schedule``: options text for ``mm-schedule-fragments`` if the program is
    microbatched ("" = take them from the module's ``mm.schedule_config``); the
    loop is formed (``mm-form-microbatch-loop``) just before it.
    ``remat``: ``mm-recompute-forward``'s ``tasks`` (registered tasks whose backward
    recomputes its forward) and ``inputs-of`` (explicit tasks under
    ``jax.checkpoint``), run before any split of the backward.
    """
    steps: list[str | ModulePass] = ["mm-import-gspmd"]
    if implicit_tasks is not None:
        steps.append(implicit_tasks)
    steps += ["mm-inline-tasks", f"mm-assign-tasks{{num-devices={num_devices}}}",
              "mm-resolve-logical-shardings", "mm-outline-fragments"]
    if any(remat):
        from multimesh.passes.recompute_forward import RecomputeForwardPass

        steps.append(RecomputeForwardPass(tasks=remat[0], inputs_of=remat[1]).pipeline_element())
    if split_backward is not None:
        steps.append(f"mm-split-backward{{{split_backward}}}" if split_backward
                     else "mm-split-backward")
    if recompute:
        steps.append("mm-recompute-transfers")
    steps.append("mm-propagate-shardings")
    if schedule is not None:
        steps.append("mm-form-microbatch-loop")
        steps.append(f"mm-schedule-fragments{{{schedule}}}" if schedule
                     else "mm-schedule-fragments")
    steps += ["mm-insert-transfers", "mm-extract-fragments"]
    return parse_pipeline(steps)


def default_pipeline(num_devices: int) -> str:
    """The pass pipeline for a plain program (also printed in repro commands)."""
    return str(build_pipeline(num_devices))


def schedule_config_of(notes: dict) -> dict | None:
    """The microbatch loop's schedule, stored on the module (so repros replay it).

    Only what the program asked for: the pass warns about a schedule that cannot
    apply, and a default GPipe was not asked for.
    """
    cfg = notes.get("microbatch")
    if cfg is None:
        return None
    out = {}
    if cfg.get("requested"):
        out["schedule"] = cfg["schedule"]
    for key in ("num_stages", "interleave", "unrolling"):
        if cfg.get(key):
            out[key] = int(cfg[key])
    if cfg.get("custom"):
        out["custom_schedule"] = [[[int(mb), name] for mb, name in row] for row in cfg["custom"]]
    return out


def wants_split(notes: dict) -> str | None:
    """Options for mm-split-backward: all backwards (zero-bubble) or flagged tasks."""
    cfg = notes.get("microbatch")
    if cfg and get_schedule(cfg["schedule"]).splits_backward:
        return "all=true"
    return "" if notes.get("split_backprop") else None


def remat_options(notes: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(registered tasks to recompute, explicit tasks traced under jax.checkpoint)."""
    return (tuple(sorted(notes.get("remat_tasks", ()))),
            tuple(sorted(notes.get("remat_inputs_of", ()))))


def schedule_options(notes: dict) -> str | None:
    # The options live in the module's mm.schedule_config; the pass reads them there.
    return "" if notes.get("microbatch") is not None else None
