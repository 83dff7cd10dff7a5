"""DualPipeV (deepseek-ai/DualPipe): 2P half-size stages placed in a V, split backwards,
forwards and backwards of two microbatches overlapped in the steady state."""

from __future__ import annotations

from ..plans import Slot
from ..registry import register_schedule
from ..simulator import Program
from ._placed import PlacedSchedule


@register_schedule
class DualPipeV(PlacedSchedule):
    """DeepSeek's DualPipeV: V-shape stages, two microbatch streams, split backwards, at
    least 2P microbatches."""

    name = "dualpipe-v"
    without_split = "DualPipeV's order with every weight gradient in its backward"
    aliases = ("DualPipeV",)
    splits_backward = True
    placement = "v-shape"
    interleave = 2

    def unfit(self, prog: Program) -> str | None:
        if 2 <= prog.P and prog.M < 2 * prog.P:
            return (f"schedule 'dualpipe-v' needs at least 2P = {2 * prog.P} microbatches for "
                    f"{prog.P} pipeline submeshes, but there are {prog.M}; use more "
                    f"microbatches (a smaller microbatch size) or another schedule")
        return None

    def mesh_plan(self, prog: Program, chunks: list[int], r: int, P: int,
                  num_stages: int | None) -> list[Slot]:
        return dualpipe_v_plan(r, P, prog.M, chunks[0], chunks[-1])

    def bubble(self, P: int, M: int, V: int) -> float | None:
        # the lower bound: 6M half-stage units each, the last submesh starts at P - 1
        return (P - 1) / (6 * M + P - 1) if M >= 2 * P else None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        # its warm-up's 2P and the forward each steady-state pair runs before its backward
        return 2 * P + 1 if M >= 2 * P else None


def dualpipe_v_ops(r: int, P: int, M: int) -> list[tuple]:
    """DualPipeV's eight steps on the ``r``-th of ``P`` submeshes (deepseek-ai/DualPipe,
    ``dualpipev.py``): ``("F", chunk)``, ``("B", chunk, defer_w)``, ``("W",)``. Chunk 0
    is the submesh's stage on the way down, chunk 1 its stage on the way back up; a
    backward with ``defer_w`` leaves its weight part to a later ``W`` (oldest first)."""
    ops: list[tuple] = [("F", 0)] * (2 * (P - r - 1))            # 1: nF0
    ops += [("F", 0), ("F", 1)] * (r + 1)                        # 2: nF0F1
    ops += [("B", 1, True), ("W",), ("F", 1)] * (P - r - 1)      # 3: nB1W1F1
    ops += [("F", 0), ("B", 1, False), ("F", 1), ("B", 0, False)] * (M - 2 * P + r + 1)  # 4
    ops += [("B", 1, False), ("F", 1), ("B", 0, False)] * (P - r - 1)  # 5: nB1F1B0
    defer = False
    for i in range(r + 1):                                       # 6: nB1B0
        defer = defer or (i == (r + 1) // 2 and r % 2 == 1)
        ops.append(("B", 1, defer))
        defer = defer or (i == (r + 1) // 2 and r % 2 == 0)
        ops.append(("B", 0, defer))
    ops += [("W",), ("B", 0, True)] * (P - r - 1)                # 7: nWB0
    return ops + [("W",)] * (r + 1)                              # 8: nW

def dualpipe_v_plan(r: int, P: int, M: int, down: int, up: int
                     ) -> list[tuple[str, int, int]]:
    """The slots of :func:`dualpipe_v_ops`; on the turning submesh the two stages may
    be one (they run back to back), which then sits where its first chunk does."""
    stage, nf, nb = (down, up), [0, 0], [0, 0]
    waiting: list[tuple[int, int]] = []
    seq: list[tuple[str, int, int]] = []
    for op in dualpipe_v_ops(r, P, M):
        if op[0] == "F":
            seq.append(("fwd", stage[op[1]], nf[op[1]]))
            nf[op[1]] += 1
        elif op[0] == "B":
            sl = (stage[op[1]], nb[op[1]])
            nb[op[1]] += 1
            seq.append(("bwd", *sl))
            if op[2]:
                waiting.append(sl)
            else:
                seq.append(("bwd_w", *sl))
        else:
            seq.append(("bwd_w", *waiting.pop(0)))
    return list(dict.fromkeys(seq))
