"""Building a schedule by name, and its theory, through the registry."""

from __future__ import annotations

from collections.abc import Sequence

from .custom import CustomSchedule
from .model import ScheduleError, Unit
from .placement import check_rule
from .registry import ScheduleAlgorithm, all_schedules, canonical_schedule_name, get_schedule
from .simulator import Program, Schedule, finish

__all__ = ["build_schedule", "check_placement", "theoretical_bubble", "theoretical_peak_live"]


def build_schedule(units: Sequence[Unit], name: str | None = "gpipe", *,
                   num_stages: int | None = None, interleave: int | None = None,
                   custom: Sequence[Sequence] | CustomSchedule | None = None,
                   devices: Sequence[Sequence[int]] | None = None,
                   unrolling: int | None = None) -> Schedule:
    """Schedule ``units`` (program order) with the named algorithm.

    ``num_stages``: pipeline depth used for 1F1B's warm-up (default: the number of
    submeshes with stages); a larger value runs more forwards before the first
    backward. ``interleave``: if given, every pipeline submesh must run exactly that
    many stages. ``custom``: one row per submesh (see :func:`canonicalize_custom_schedule`)
    or a parsed :class:`CustomSchedule`. ``devices``: per submesh device lists, kept for
    display. ``unrolling`` (GPipe only): fill and drain the pipeline in groups of that
    many microbatches.
    """
    key = canonical_schedule_name(name, custom)
    algo = get_schedule(key)
    prog = Program(units)
    _check_options(prog, algo, num_stages, interleave, unrolling)
    algo.check(prog)
    sim = algo.simulate(prog, num_stages=num_stages, unrolling=unrolling, custom=custom)
    return finish(prog, key, sim, devices)


def _check_options(prog: Program, algo: ScheduleAlgorithm, num_stages: int | None,
                   interleave: int | None, unrolling: int | None) -> None:
    if unrolling is not None:
        if not algo.takes_unrolling:
            takers = " and ".join(s.name for s in all_schedules() if s.takes_unrolling)
            raise ScheduleError(
                f"unrolling={unrolling} applies to the {takers} schedule only, not "
                f"'{algo.name}'")
        if unrolling < 1:
            raise ScheduleError(f"unrolling must be >= 1, got {unrolling}")
    if num_stages is not None and num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if interleave is None:
        return
    if interleave < 1:
        raise ScheduleError(f"interleave must be >= 1, got {interleave}")
    for m in range(prog.num_meshes):
        if prog.stages_of[m] and len(prog.stages_of[m]) != interleave:
            raise ScheduleError(
                f"interleave={interleave}, but submesh {m} runs "
                f"{len(prog.stages_of[m])} pipeline stage(s) (stages {prog.stages_of[m]})")


def check_placement(units: Sequence[Unit], name: str) -> None:
    """Raise :class:`ScheduleError` when the stages of ``units`` are not placed as the
    schedule ``name`` needs (:data:`PLACEMENTS`); other schedules take any placement."""
    algo = get_schedule(canonical_schedule_name(name))
    if algo.placement is not None:
        check_rule(Program(units), algo.name, algo.placement)


def theoretical_bubble(name: str, P: int, M: int, interleave: int = 1) -> float | None:
    """Textbook bubble fraction with unit costs (each schedule's ``bubble``).

    GPipe and 1F1B: (P-1)/(M+P-1); interleaved 1F1B with V stages per submesh:
    (P-1)/(V*M+P-1); ZB-H1 (forward, activation- and weight-gradient halves all
    cost 1): the paper's bubble (P-1)(F+B-W) over a step of 3M+(P-1), i.e.
    (P-1)/(3M+P-1); ZB-H2 the same over one step (its gain is inside each submesh's
    span, :meth:`Timeline.stage_bubble_fraction`, which is 0); eager 1F1B and GPipe
    with 1F1B on the last submesh as GPipe; interleaved GPipe and circular with
    reversed backward (P dividing M) as interleaved 1F1B; DualPipeV (M >= 2P) and ZB-V
    (M >= 2P - 1) the lower bound (P-1)/(6M+P-1); Kimi-K2 (P dividing M) as
    interleaved 1F1B. None where there is no closed form (custom).
    """
    return get_schedule(canonical_schedule_name(name)).bubble(P, M, interleave)


def theoretical_peak_live(name: str, P: int, M: int, interleave: int = 1) -> int | None:
    """The most (stage, microbatch) activations one submesh holds, by the textbook.

    GPipe: M; 1F1B and ZB-H1: min(P, M) (submesh 0); ZB-H2: min(2P, M); interleaved
    1F1B (P dividing M): Megatron's warm-up plus one, min((V+1)P - 1, VM); eager 1F1B: min(2P - 1,
    M); GPipe with 1F1B on the last submesh: M (1 on the last submesh); interleaved
    GPipe and circular with reversed backward: every forward before any backward, VM;
    DualPipeV (M >= 2P): 2P + 1 half-size activations, its warm-up's 2P and the forward
    that each steady-state pair runs before its backward; ZB-V: 2 min(P, M) half-size
    activations, 1F1B's memory; Kimi-K2 (P dividing M): one more than interleaved
    1F1B, min((V+1)P, VM).
    """
    return get_schedule(canonical_schedule_name(name)).peak_live(P, M, interleave)
