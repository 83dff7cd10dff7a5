"""Kimi-K2 (NVIDIA JaxPP's ``KimiK2`` schedule, ``jaxpp/schedules.py``; Moonshot AI's
Kimi K2 technical report, arXiv:2507.20534, section 2.4 and figure 7, "VPP + 1
warmup"): interleaved 1F1B with one more warm-up forward on every submesh, so each
submesh has a forward in hand to compute while another microbatch's communication
(in the report, the expert-parallel all-to-all) is in flight.

JaxPP builds it on its interleaved 1F1B (PyTorch's ``ScheduleInterleaved1F1B``): the
microbatches run in rounds of ``G = M // max(1, M // P)`` (``M`` must divide into
those rounds), every chunk of a submesh over one round before the next round, and
the ``r``-th of ``P`` submeshes with ``V`` chunks runs ``(V - 1) G + 2(P - 1 - r) + 1``
forwards (at most ``VM``) before it alternates one forward and one backward; the
backwards it has left close the step. Kimi-K2's warm-up is JaxPP's interleaved 1F1B
warm-up plus that one forward; backwards are not split.
"""

from __future__ import annotations

from ..plans import Slot, one_f_one_b_plan
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


def round_size(P: int, M: int) -> int | None:
    """Microbatches per round (JaxPP: ``M // max(1, M // P)``), None when they do not
    divide into equal rounds."""
    rounds = max(1, M // P)
    return M // rounds if M % rounds == 0 else None


@register_schedule
class KimiK2(PlacedSchedule):
    """JaxPP's KimiK2: round-robin stages, interleaved 1F1B with one more warm-up
    forward."""

    name = "kimi-k2"
    aliases = ("KimiK2",)
    placement = "round-robin"
    interleave = 2

    def unfit(self, prog: Program) -> str | None:
        P, M = max(1, prog.P), prog.M
        if round_size(P, M) is None:
            return (f"schedule 'kimi-k2' runs the microbatches in {max(1, M // P)} rounds for "
                    f"{P} pipeline submeshes, which {M} microbatches do not fill equally; use "
                    f"a multiple of {P} microbatches (or fewer than {2 * P})")
        return None

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        G = round_size(P, prog.M) or P
        warm = (len(chunks) - 1) * G + 2 * ((num_stages or P) - 1 - r) + 1
        return one_f_one_b_plan(chunks, prog.M, G, min(warm, prog.M * len(chunks)), True)

    def bubble(self, P: int, M: int, V: int) -> float | None:
        # the extra forward moves no unit of interleaved 1F1B's critical path
        return (P - 1) / (V * M + P - 1) if M % P == 0 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        # submesh 0: its warm-up, (V - 1)P + 2P - 1, and the steady state's forward
        return min((V + 1) * P, V * M) if M % P == 0 else None
