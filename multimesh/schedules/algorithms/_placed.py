"""The shared shape of the schedules with a placement rule (docs/schedules.md): check the
placement, write each pipeline submesh's textbook slot order, simulate."""

from __future__ import annotations

from ..plans import Slot
from ..registry import ScheduleAlgorithm
from ..simulator import Program


class PlacedSchedule(ScheduleAlgorithm):
    def slot_plans(self, prog: Program, num_stages: int | None,
                   unrolling: int | None) -> list[list[Slot]]:
        P = max(1, prog.P)
        return [self.mesh_plan(prog, chunks, prog.rank.get(m, 0), P, num_stages)
                if chunks else []
                for m, chunks in enumerate(prog.stages_of)]

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        """The slot order of the ``r``-th of ``P`` pipeline submeshes (stages ``chunks``)."""
        raise NotImplementedError
