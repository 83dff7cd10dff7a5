"""Interleaved GPipe (JaxPP's InterleavedGPipe): every forward in Megatron's groups, then
the backwards."""

from __future__ import annotations

from ..plans import Slot, one_f_one_b_plan
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


@register_schedule
class InterleavedGPipe(PlacedSchedule):
    """JaxPP's InterleavedGPipe: round-robin stages, every forward in Megatron's groups,
    then the backwards in group order."""

    name = "interleaved-gpipe"
    without_interleaving = ("GPipe", "gpipe")
    aliases = ("InterleavedGPipe",)
    placement = "round-robin"
    interleave = 2

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        return one_f_one_b_plan(chunks, prog.M, P, prog.M * len(chunks), True)

    def bubble(self, P: int, M: int, V: int) -> float | None:
        return (P - 1) / (V * M + P - 1) if M % P == 0 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return V * M
