"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, and "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024): 2P stages placed in a V, the
backward split into its activation half B and weight half W, and a fixed order per
submesh that leaves no bubble inside any submesh's span when F = B = W while holding
1F1B's activation memory (2P half-size stages, the P full-size stages of 1F1B).

The order is the hand-written one of the reference implementation
(sail-sg/zero-bubble-pipeline-parallelism, ``handcrafted_zb_v``), restated here: on the
r-th of P submeshes, with chunk 0 its stage on the way down and chunk 1 on the way
back up, and N = max(M, 2P - 1) microbatches (those past M are left out):

1. warm-up: 2(P - r) - 1 forwards of chunk 0, then r pairs F1 F0, then P - r
   triples F1 B1 W1 (the last submesh turns the first microbatch round at once);
2. steady state: F0 B0 W0 F1 B1 W1 (no F0 once all N are in) until every
   forward has run;
3. cool-down: r pairs B0 B1, then P - r pairs B0 W, then the weight halves left
   (chunk 1's, then chunk 0's, oldest first): the W deferred by the pairs fill the
   time the backwards spend coming down the V.

With unit costs and M >= 2P - 1 no submesh idles between its first unit and its last
(the bubble is (P - 1)/(6M + P - 1), the same lower bound DualPipeV reaches) and a
submesh holds at most 2P half-size activations. Fewer microbatches run the same
pattern with the missing ones left out, like the reference, with idle slots inside
the step.
"""

from __future__ import annotations

from ..plans import Slot
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


@register_schedule
class ZeroBubbleV(PlacedSchedule):
    """ZB-V of Qi et al.: V-shape stages, split backwards, no bubble inside a submesh's
    span from 2P - 1 microbatches on."""

    name = "zero-bubble-v"
    aliases = ("ZB-V", "ZBV")
    without_split = "ZB-V's order with every weight gradient in its backward"
    splits_backward = True
    placement = "v-shape"
    interleave = 2

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        return zero_bubble_v_plan(r, P, prog.M, chunks[0], chunks[-1])

    def bubble(self, P: int, M: int, V: int) -> float | None:
        # 6M unit-cost units per submesh and, from 2P - 1 microbatches on, none idle
        # inside its span: submesh r runs from r to 6M + r
        return (P - 1) / (6 * M + P - 1) if M >= 2 * P - 1 else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        # the warm-up ends holding 2P - 1 - r down and r + 1 up activations, and from
        # then on each backward frees one before the next forward takes one
        return 2 * min(P, M)


def zero_bubble_v_ops(r: int, P: int, M: int) -> list[tuple[str, int, int]]:
    """ZB-V's order on the ``r``-th of ``P`` submeshes: ``(kind, chunk, microbatch)``
    with kind ``F``, ``B`` (activation half) or ``W`` (weight half)."""
    n = max(M, 2 * P - 1)
    count = dict.fromkeys(("F0", "F1", "B0", "B1", "W0", "W1"), 0)
    ops: list[tuple[str, int, int]] = []

    def run(pattern: str, times: int = 1) -> None:
        for _ in range(times):
            for op in pattern.split():  # each op takes its kind's and chunk's next microbatch
                ops.append((op[0], int(op[1]), count[op]))
                count[op] += 1

    run("F0", 2 * (P - r) - 1)
    run("F1 F0", r)
    run("F1 B1 W1", P - r)
    while count["F1"] < count["F0"] or count["F0"] < n:
        run("F0 B0 W0 F1 B1 W1" if count["F0"] < n else "B0 W0 F1 B1 W1")
    run("B0 B1", r)
    run("B0 W0", P - r)
    run("W1", count["B1"] - count["W1"])
    run("W0", count["B0"] - count["W0"])
    return [op for op in ops if op[2] < M]


def zero_bubble_v_plan(r: int, P: int, M: int, down: int, up: int) -> list[Slot]:
    """The slots of :func:`zero_bubble_v_ops`; on the turning submesh the two stages
    may be one (they run back to back), which then sits where its first chunk does."""
    kinds = {"F": "fwd", "B": "bwd", "W": "bwd_w"}
    stage = (down, up)
    return list(dict.fromkeys((kinds[k], stage[c], mb)
                              for k, c, mb in zero_bubble_v_ops(r, P, M)))
