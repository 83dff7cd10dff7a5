"""Eager 1F1B (JaxPP's Eager1F1B): 1F1B with 2(P - r) - 1 forwards before the first backward."""

from __future__ import annotations

from ..plans import Slot, one_f_one_b_plan
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


@register_schedule
class Eager1F1B(PlacedSchedule):
    """JaxPP's Eager1F1B: 1F1B with about twice its warm-up (2(P - r) - 1 forwards
    before the first backward)."""

    name = "eager-1f1b"
    aliases = ("Eager1F1B",)
    placement = "contiguous"

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        warm = 2 * ((num_stages or P) - r) - 2
        return one_f_one_b_plan(chunks, prog.M, P, max(0, min(prog.M * len(chunks), warm)),
                                True)

    def bubble(self, P: int, M: int, V: int) -> float | None:
        # the extra warm-up forwards move no unit of the critical path
        return (P - 1) / (M + P - 1) if V == 1 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return min(2 * P - 1, M) if V == 1 else None
