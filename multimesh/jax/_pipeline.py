"""The pass pipeline ``mjit`` runs, assembled from the features a program uses.

Each feature contributes its passes through one small function here, so the
order of the whole pipeline is visible in one place.
"""

from __future__ import annotations

__all__ = ["build_pipeline"]


def build_pipeline(num_devices: int, *, implicit_tasks: str | None = None,
                   recompute: bool = False, schedule: str | None = None) -> str:
    """The ``builtin.module(...)`` string for a program on ``num_devices`` devices.

    ``implicit_tasks``: options text for ``mm-match-tasks`` (registered tasks), if any.
    ``recompute``: run the comm-avoiding recompute pass.
    ``schedule``: options text for the pipeline-schedule pass, if the program is microbatched.
    """
    steps = ["mm-import-gspmd"]
    if implicit_tasks:
        steps.append(f"mm-match-tasks{{{implicit_tasks}}}")
    steps += ["mm-inline-tasks", f"mm-assign-tasks{{num-devices={num_devices}}}",
              "mm-resolve-logical-shardings", "mm-outline-fragments"]
    if recompute:
        steps.append("mm-recompute-transfers")
    steps.append("mm-propagate-shardings")
    if schedule and _registered("mm-schedule-fragments"):
        steps.append(f"mm-schedule-fragments{{{schedule}}}")
    steps += ["mm-insert-transfers", "mm-extract-fragments"]
    return "builtin.module(" + ",".join(steps) + ")"


def _registered(argument: str) -> bool:
    from mlir_passes import get_all_passes

    return argument in get_all_passes()
