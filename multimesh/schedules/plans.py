"""Slot plans shared by the algorithms: ``(kind, stage, microbatch rank)`` per submesh.

GPipe's fill-and-drain groups and the 1F1B family (warm-up forwards, then one forward
and one backward in turn, interleaved chunks in Megatron's microbatch groups).
"""

from __future__ import annotations

from .model import ScheduleError, default_cost
from .simulator import Program, run_plans, unit_plans

__all__ = ["Slot", "warmup", "groups", "gpipe_plans", "one_f_one_b_plans", "add_backward",
           "gpipe_plan", "one_f_one_b_plan", "feasible_plans", "megatron_peak",
           "activation_halves", "recomputing_weight_halves"]

Slot = tuple[str, int, int]
"""``(kind, stage, microbatch rank)``: one entry of a submesh's plan."""


def warmup(P: int, r: int, V: int, total: int) -> int:
    """Forwards before the first backward's steady-state pair (Megatron's formula)."""
    w = (P - r - 1) if V == 1 else (P - r - 1) * 2 + (V - 1) * P
    return max(0, min(w, total))


def groups(M: int, size: int) -> list[range]:
    """Microbatches in groups of ``size``: interleaving runs every chunk over a group
    before the next group (Megatron's order). A short last group joins the one
    before: a group smaller than the pipeline leaves its submeshes waiting."""
    starts = list(range(0, M, size))
    if len(starts) > 1 and M - starts[-1] < size:
        starts.pop()
    return [range(a, starts[k + 1] if k + 1 < len(starts) else M) for k, a in enumerate(starts)]


def gpipe_plans(prog: Program, unrolling: int | None = None,
                with_w: bool = True) -> list[list[Slot]]:
    """Per submesh, GPipe's slot order; ``unrolling``: in groups of that many
    microbatches, each group filling and draining before the next."""
    return [gpipe_plan(chunks, prog.M, unrolling or prog.M, with_w) if chunks else []
            for chunks in prog.stages_of]


def one_f_one_b_plans(prog: Program, num_stages: int | None, with_w: bool = True,
                      extra: int = 0, h2: bool = False) -> list[list[Slot]]:
    """Per submesh, 1F1B's slot order (also the F/B skeleton of the zero-bubble
    schedules) with ``extra`` more warm-up forwards. ``h2``: ZB-H2's warm-up, about
    twice 1F1B's (``2(P - r) - 1`` forwards on the ``r``-th pipeline submesh)."""
    P = num_stages or prog.P
    plans: list[list[Slot]] = []
    for m, chunks in enumerate(prog.stages_of):
        if not chunks:
            plans.append([])
            continue
        w = warmup(P, prog.rank[m], len(chunks), prog.M * len(chunks))
        if h2:
            w = 2 * (P - prog.rank[m]) - 1 if len(chunks) == 1 else 2 * w + 1
        plans.append(one_f_one_b_plan(chunks, prog.M, max(1, prog.P), w + extra, with_w))
    return plans


def add_backward(seq: list[Slot], s: int, b: int, with_w: bool) -> None:
    seq.append(("bwd", s, b))
    if with_w:
        seq.append(("bwd_w", s, b))


def gpipe_plan(chunks: list[int], M: int, k: int, with_w: bool) -> list[Slot]:
    """All forwards of a group of ``k`` microbatches, then their backwards, per group."""
    seq: list[Slot] = []
    for lo in range(0, M, k):
        group = range(lo, min(M, lo + k))
        for s in chunks:
            seq += [("fwd", s, b) for b in group]
        for s in reversed(chunks):
            for b in group:
                add_backward(seq, s, b, with_w)
    return seq


def one_f_one_b_plan(chunks: list[int], M: int, group_size: int, warmup: int,
               with_w: bool) -> list[Slot]:
    """``warmup`` forwards, then one forward and one backward in turn, then the rest
    of the backwards (chunks interleaved in Megatron's microbatch groups)."""
    fseq: list[tuple[int, int]] = []
    bseq: list[tuple[int, int]] = []
    for group in groups(M, group_size):
        for c in chunks:
            fseq += [(c, b) for b in group]
        for c in reversed(chunks):
            bseq += [(c, b) for b in group]
    total = len(fseq)
    w = min(total, warmup)
    seq: list[Slot] = [("fwd", s, b) for s, b in fseq[:w]]
    for i in range(total - w):
        s, b = fseq[w + i]
        seq.append(("fwd", s, b))
        add_backward(seq, *bseq[i], with_w)
    for s, b in bseq[total - w:]:
        add_backward(seq, s, b, with_w)
    return seq


def feasible_plans(prog: Program, num_stages: int | None, with_w: bool = True,
                   h2: bool = False) -> tuple[list[list[int]], dict[int, int]]:
    """1F1B's unit plans with the warm-up lengthened just enough that they run as
    written (interleaving with a microbatch count that the number of submeshes does
    not divide needs this; a warm-up of everything is GPipe, which always runs).
    Programs no warm-up fixes fall back to the simulator's repair."""
    longest = max((len(s) for s in prog.stages_of), default=0) * max(prog.M, 1)
    first = None
    for extra in range(0, longest + 1):
        plans, pos = unit_plans(prog, one_f_one_b_plans(prog, num_stages, with_w, extra, h2))
        first = first or (plans, pos)
        try:
            run_plans(prog, plans, pos, strict=True, cost=default_cost)
        except ScheduleError:
            continue
        return plans, pos
    assert first is not None
    return first


def megatron_peak(P: int, M: int, V: int) -> int | None:
    """Interleaved 1F1B's peak activations (P dividing M): Megatron's warm-up plus one."""
    return min((V + 1) * P - 1, V * M) if M % P == 0 else None


def activation_halves(prog: Program) -> dict[int, int]:
    """Each weight-gradient part's activation half (the split ``bwd`` of its key)."""
    act_of = {u.key: u.index for u in prog.units
              if not u.free and u.kind == "bwd" and u.split}
    return {u.index: act_of[u.key] for u in prog.units
            if not u.free and u.kind == "bwd_w" and u.key in act_of}


def recomputing_weight_halves(prog: Program) -> dict[int, int]:
    """The weight halves that read nothing of their activation half (``remat=True``:
    they recompute from the stage input and the incoming cotangent), to that half.

    Deferred, such a weight half holds its stage input and a cotangent, twice what the
    microbatch held awaiting its backward, so ZB-H1 and ZB-H2 bound how many wait at
    once (:mod:`.algorithms.zero_bubble`)."""
    return {w: b for w, b in activation_halves(prog).items()
            if b not in prog.units[w].deps}

