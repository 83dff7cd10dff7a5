"""Zero-bubble H1 and H2 (Qi et al.): 1F1B with weight gradients filling the idle slots.

ZB-H1: 1F1B's order of forwards and (activation-)backwards; each weight-gradient part
runs in the first slot where its submesh would otherwise idle, or earlier when
deferring it would make the submesh hold more activations than 1F1B's peak on any
submesh (ZB-H1's memory bound: the first stage's P). ZB-H2: the same with about twice
1F1B's warm-up, so the forwards fill the start-up bubble, under twice that memory bound.

A weight half that reads nothing of its activation half (``remat=True``: it recomputes
from the stage input and the incoming cotangent, ``mm-split-backward{recompute=}``)
holds those two while it waits, where a microbatch awaiting its backward holds the stage
input alone. The paper's bound counts both as one activation, so later submeshes,
which 1F1B leaves lighter, would fill up to the first stage's count with pairs twice
that size. For such programs the bound is per submesh instead: at most 1F1B's (twice
for H2) live microbatches on each submesh, and at most one weight half deferred past
the submesh's next backward, so a submesh holds at most what it holds under 1F1B with
``remat=True`` plus one stage input's worth (the deferred cotangent).
"""

from __future__ import annotations

from ..model import default_cost
from ..plans import activation_halves, feasible_plans, recomputing_weight_halves
from ..registry import ScheduleAlgorithm, register_schedule
from ..simulator import Program, Sim, run_plans


class ZeroBubble(ScheduleAlgorithm):
    splits_backward = True
    h2 = False

    def simulate(self, prog, *, num_stages=None, unrolling=None, custom=None):
        ref = run_plans(prog, *feasible_plans(prog, num_stages),
                        strict=False, cost=default_cost)
        factor = 2 if self.h2 else 1
        if recomputing_weight_halves(prog):  # each submesh by its own 1F1B count
            limit = [p * factor for p in ref.peak]
        else:  # the paper's: 1F1B's peak (the first stage's) everywhere
            limit = [max(ref.peak, default=0) * factor] * prog.num_meshes
        plans, pos = feasible_plans(prog, num_stages, with_w=False, h2=self.h2)
        w_pool = {u.index for u in prog.units if not u.free and u.kind == "bwd_w"}
        for i in w_pool:
            pos[i] = -1  # scheduled by the chooser, not free
        return run_plans(prog, plans, pos, strict=False, cost=default_cost, name=self.name,
                         chooser=_chooser(prog, w_pool, limit, activation_halves(prog)))

    def bubble(self, P: int, M: int, V: int) -> float | None:
        return (P - 1) / (3 * M + P - 1) if V == 1 else None


def _chooser(prog: Program, w_pool: set[int], limit: list[int], act: dict[int, int]):
    """Run the plan's head unless it opens an activation over ``limit``, or it is an
    activation half while a recomputing weight half (one that reads nothing of its own
    activation half) is already deferred: then (or when the head is not ready) the
    oldest ready weight-gradient part whose activation half has run."""
    own = set(recomputing_weight_halves(prog))
    own_on: dict[int, list[int]] = {}
    for i in own:
        own_on.setdefault(prog.units[i].mesh, []).append(i)
    own_keys = {prog.units[i].key for i in own}

    def deferred(sim: Sim, m: int) -> bool:
        return any(sim.start[act[i]] is not None and sim.start[i] is None
                   for i in own_on.get(m, ()))

    def chooser(sim: Sim, m: int, ready: set[int], h: int | None):
        ws = sorted((i for i in ready if i in w_pool
                     and (i not in act or sim.start[act[i]] is not None)),
                    key=lambda i: (prog.mb_rank[prog.units[i].key[2]],
                                   -prog.units[i].key[1], i))
        if h is not None and h in ready:
            u = prog.units[h]
            opens = (u.kind == "fwd" and (u.mesh, u.stage, u.microbatch) in prog.has_bwd
                     and (u.mesh, u.stage, u.microbatch) not in sim.opened)
            if ws and opens and sim.live[m] + 1 > limit[m]:
                return ws[0]
            if ws and u.kind == "bwd" and u.key in own_keys and deferred(sim, m):
                return ws[0]
            return h
        return ws[0] if ws else None

    return chooser


@register_schedule
class ZeroBubbleH1(ZeroBubble):
    """ZB-H1: 1F1B's order with every weight-gradient half moved into idle slots, under
    1F1B's peak memory."""

    name = "zero-bubble-h1"
    aliases = ("zb-h1",)
    without_split = "1F1B's order"

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return min(P, M) if V == 1 else None


@register_schedule
class ZeroBubbleH2(ZeroBubble):
    """ZB-H2: a longer warm-up and the weight-gradient halves in the bubbles, under
    twice 1F1B's peak memory."""

    name = "zero-bubble-h2"
    aliases = ("zb-h2",)
    h2 = True
    without_split = "1F1B's order with a longer warm-up"

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        return min(2 * P, M) if V == 1 else None
