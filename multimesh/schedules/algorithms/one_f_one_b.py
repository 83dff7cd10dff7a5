"""1F1B (PipeDream-flush): warm-up forwards, then one forward and one backward in turn."""

from __future__ import annotations

from ..plans import Slot, feasible_plans, megatron_peak, one_f_one_b_plans
from ..registry import ScheduleAlgorithm, register_schedule
from ..simulator import Program


class OneFOneBFamily(ScheduleAlgorithm):
    """1F1B's plan with the warm-up lengthened just enough to run as written
    (:func:`feasible_plans`); interleaved chunks in Megatron's microbatch groups."""

    def slot_plans(self, prog: Program, num_stages: int | None,
                   unrolling: int | None) -> list[list[Slot]]:
        return one_f_one_b_plans(prog, num_stages)

    def simulate(self, prog, *, num_stages=None, unrolling=None, custom=None):
        return self.run(prog, *feasible_plans(prog, num_stages))

    def bubble(self, P: int, M: int, V: int) -> float | None:
        return (P - 1) / (V * M + P - 1)

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return megatron_peak(P, M, V)


@register_schedule
class OneFOneB(OneFOneBFamily):
    """PipeDream-flush: warm-up forwards, then one forward and one backward in turn
    (Megatron's interleaved 1F1B when submeshes run several stages)."""

    name = "1f1b"
    aliases = ("wavefront", "prefetch-wavefront", "pipedream-flush")

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return min(P, M) if V == 1 else megatron_peak(P, M, V)
