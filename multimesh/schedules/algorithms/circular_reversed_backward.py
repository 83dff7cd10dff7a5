"""Circular with reversed backward (Shardy:MPMD's CircularWithReversedBackward): the
interleaved forwards, then the backwards in their mirror order."""

from __future__ import annotations

from ..plans import Slot, add_backward, one_f_one_b_plan
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


@register_schedule
class CircularReversedBackward(PlacedSchedule):
    """Shardy:MPMD's CircularWithReversedBackward: round-robin stages, every forward,
    then the backwards in the mirror of the forwards."""

    name = "circular-reversed-backward"
    aliases = ("CircularWithReversedBackward",)
    placement = "round-robin"
    interleave = 2

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        total = prog.M * len(chunks)
        fwd = [sl for sl in one_f_one_b_plan(chunks, prog.M, P, total, False)
               if sl[0] == "fwd"]
        seq = list(fwd)
        for _, st, b in reversed(fwd):
            add_backward(seq, st, b, True)
        return seq

    def bubble(self, P: int, M: int, V: int) -> float | None:
        return (P - 1) / (V * M + P - 1) if M % P == 0 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return V * M
