"""A custom schedule: the user's rows, one per submesh (:class:`CustomSchedule`)."""

from __future__ import annotations

from ..custom import custom_plans
from ..model import ScheduleError, default_cost
from ..registry import ScheduleAlgorithm, register_schedule
from ..simulator import run_plans


@register_schedule
class Custom(ScheduleAlgorithm):
    """Your own order (``custom_schedule``): one row per submesh, entries ``"task"``,
    ``"task_bwd"``, ``"task_bwd_w"`` or ``[microbatch, name]``, each name once per
    microbatch."""

    def options(self) -> tuple[str, ...]:
        return ("custom_schedule",)

    name = "custom"
    has_textbook = False

    def simulate(self, prog, *, num_stages=None, unrolling=None, custom=None):
        if custom is None:
            raise ScheduleError("schedule 'custom' needs a custom_schedule")
        plans, pos = custom_plans(prog, custom)
        # strict: the user's order is run as written, or its deadlock is named
        return run_plans(prog, plans, pos, strict=True, cost=default_cost, name="custom")
