"""Stage-placement rules of the placed schedules (docs/schedules.md): ``contiguous``
(one stage per submesh, stage k on the k-th submesh), ``round-robin`` (stage k on
submesh k % P, the same number of stages on every submesh) or ``v-shape`` (2P stages,
stage i and stage 2P - 1 - i on submesh i)."""

from __future__ import annotations

from .model import ScheduleError
from .simulator import Program

__all__ = ["RULES", "PLACEMENT_TEXT", "check_rule"]

RULES = ("contiguous", "round-robin", "v-shape")


PLACEMENT_TEXT = {
    "contiguous": "one pipeline stage per submesh (contiguous placement: consecutive "
                  "layers on one submesh, stage k on the k-th submesh)",
    "round-robin": "round-robin placement (stage k on submesh k % P for P pipeline "
                   "submeshes, every submesh running the same number of stages)",
    "v-shape": "V-shape placement (2P stages on P submeshes: stage i and stage 2P - 1 - i "
               "on submesh i, so the forward goes down the submeshes and back up)",
}


def check_rule(prog: Program, key: str, rule: str) -> None:
    """Raise :class:`ScheduleError` when the stages of ``prog`` are not placed by
    ``rule`` (one of :data:`RULES`), naming the schedule ``key`` that needs it."""
    piped = sorted(prog.rank, key=prog.rank.__getitem__)
    counts = {m: len(prog.stages_of[m]) for m in piped}
    wrong = None
    if rule == "v-shape":
        wrong = _v_shape_mismatch(prog, piped)
    elif rule == "contiguous":
        m = next((m for m in piped if counts[m] != 1), None)
        if m is not None:
            wrong = f"submesh {m} runs {counts[m]} stages (stages {prog.stages_of[m]})"
    elif len(set(counts.values())) > 1:
        m = max(piped, key=counts.__getitem__)
        wrong = (f"submesh {m} runs {counts[m]} stages (stages {prog.stages_of[m]}) and "
                 f"submesh {min(piped, key=counts.__getitem__)} runs fewer")
    else:
        for k, stage in enumerate(sorted(prog.home)):
            if piped and prog.home[stage] != piped[k % len(piped)]:
                wrong = (f"stage {stage} runs on submesh {prog.home[stage]}, where "
                         f"round-robin puts it on submesh {piped[k % len(piped)]}")
                break
    if wrong is not None:
        raise ScheduleError(
            f"schedule '{key}' needs {PLACEMENT_TEXT[rule]}, but {wrong}; place the "
            f"tasks that way, or choose a schedule without a placement rule (gpipe, 1f1b)")


def _v_shape_mismatch(prog: Program, piped: list[int]) -> str | None:
    """Why the stages do not go down the submeshes and back up, if they do not. The
    turning submesh's two stages follow each other, so they may be one stage."""
    seq = [prog.home[st] for st in sorted(prog.home)]
    visits = [m for k, m in enumerate(seq) if k == 0 or seq[k - 1] != m]
    want = piped + piped[-2::-1]
    if visits == want:
        return None
    return f"its stages run on submeshes {visits} in order, where V-shape needs {want}"
