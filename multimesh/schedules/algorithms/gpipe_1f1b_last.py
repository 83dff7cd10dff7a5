"""GPipe with 1F1B on the last submesh (Shardy:MPMD's GPipeBut1F1BForLastMesh)."""

from __future__ import annotations

from ..plans import Slot, gpipe_plan, one_f_one_b_plan
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


@register_schedule
class GPipe1F1BLast(PlacedSchedule):
    """Shardy:MPMD's GPipeBut1F1BForLastMesh: GPipe, the last submesh 1F1B."""

    name = "gpipe-1f1b-last"
    aliases = ("GPipeBut1F1BForLastMesh",)
    placement = "contiguous"

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        if r == P - 1:  # the last submesh: F0 B0 F1 B1 ...
            return one_f_one_b_plan(chunks, prog.M, P, 0, True)
        return gpipe_plan(chunks, prog.M, prog.M, True)

    def bubble(self, P: int, M: int, V: int) -> float | None:
        # the last submesh's order moves no unit of the critical path
        return (P - 1) / (M + P - 1) if V == 1 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return (M if P > 1 else 1) if V == 1 else None
