"""GPipe (fill-drain): every forward, then every backward (in groups with ``unrolling``)."""

from __future__ import annotations

from ..plans import Slot, gpipe_plans
from ..registry import ScheduleAlgorithm, register_schedule
from ..simulator import Program


@register_schedule
class GPipe(ScheduleAlgorithm):
    """Fill-drain: every forward, then every backward (in groups of ``unrolling``)."""

    name = "gpipe"
    aliases = ("fill-drain", "breadth-first")
    takes_unrolling = True

    def slot_plans(self, prog: Program, num_stages: int | None,
                   unrolling: int | None) -> list[list[Slot]]:
        return gpipe_plans(prog, unrolling)

    def bubble(self, P: int, M: int, V: int) -> float | None:
        return (P - 1) / (M + P - 1) if V == 1 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return M if V == 1 else None
