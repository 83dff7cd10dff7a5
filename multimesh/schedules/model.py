"""The unit model: fragment calls as :class:`Unit`\\ s, their stages, and the textbook
pipelines the docs and benchmarks schedule (no MLIR; ``mm-schedule-fragments`` builds
units from ``@main`` with :func:`units_from_calls`).

A **unit** is one fragment call: its position in program order (``index``), the
submesh it runs on (``mesh``, numbered by first use), its pipeline ``stage``, its
``microbatch``, its ``kind`` (``"fwd"``, ``"bwd"`` — a whole backward or, when the
backward is split, the activation-gradient part —, ``"bwd_w"`` — the
weight-gradient part — or ``"other"``) and the units whose results it reads
(``deps``). Stages are derived from the forward fragments in program order: a run of
consecutive forward tasks on one submesh is one stage, so ``embed -> layer1`` on
submesh 0 and ``layer2 -> loss`` on submesh 1 are stages 0 and 1, and eight layers
placed round-robin on four submeshes are eight stages, two per submesh
(interleaving). A backward unit has its forward task's stage. Units without a
microbatch or a stage are *free*: every schedule runs them as soon as they are
ready. A call that reads the result of a later microbatch (an accumulation across
microbatches) gets no stage, so it is free too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from multimesh._src.calls import Call
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError

__all__ = ["KINDS", "ScheduleError", "ScheduleTypeError", "Unit", "Call", "units_from_calls", "pipeline_units",
           "v_shape_units", "unit_label", "short_label", "default_cost"]


KINDS = ("fwd", "bwd", "bwd_w", "other")


class ScheduleError(MultimeshValueError):
    """A schedule name, option or custom schedule is invalid for the program."""


class ScheduleTypeError(MultimeshTypeError, ScheduleError):
    """A custom schedule, a row or an entry of it is not of the form a schedule takes:
    a ``TypeError`` first, and a :class:`ScheduleError` (so ``except ScheduleError``
    catches every schedule failure)."""


@dataclass(frozen=True)
class Unit:
    """One fragment call. ``index`` is its position in program order (0..N-1)."""

    index: int
    mesh: int
    kind: str
    microbatch: int | None = None
    stage: int | None = None
    deps: tuple[int, ...] = ()
    task: str = ""
    fragment: str = ""
    split: bool = False  # a "bwd" whose weight-gradient part is a separate "bwd_w" unit
    own_name: bool = False  # a backward task named apart from its forward (``layer0_bwd``)

    @property
    def free(self) -> bool:
        """Not part of the pipeline proper: no microbatch, no stage or kind "other"."""
        return self.microbatch is None or self.stage is None or self.kind == "other"

    @property
    def key(self) -> tuple[int, int, int]:
        """``(mesh, stage, microbatch)`` of a pipeline unit (one that is not free)."""
        assert self.stage is not None and self.microbatch is not None, self
        return self.mesh, self.stage, self.microbatch


def _where(call: Call) -> tuple[int, ...]:
    """A call's devices: a schedule's calls always name theirs (only a runtime plan
    leaves a call on its fragment's own devices as None)."""
    assert call.devices is not None, call
    return call.devices


def units_from_calls(calls: Sequence[Call]) -> tuple[list[Unit], list[tuple[int, ...]]]:
    """Units (with submeshes and stages) for calls in program order; also the device lists.

    Submeshes are the distinct device lists in order of first use. Stages: see the
    module docstring.
    """
    meshes: list[tuple[int, ...]] = []
    mesh_of: dict[tuple[int, ...], int] = {}
    for where in map(_where, calls):
        if where not in mesh_of:
            mesh_of[where] = len(meshes)
            meshes.append(where)
    # Stages from the first forward appearance of each task (microbatched calls only).
    stage_of: dict[str, int] = {}
    last_mesh = None
    stage = -1
    for c in calls:
        if c.transpose_count != 0 or c.microbatch is None or c.task in stage_of:
            continue
        m = mesh_of[_where(c)]
        if m != last_mesh:
            stage += 1
            last_mesh = m
        stage_of[c.task] = stage
    _backward_stages(calls, stage_of, mesh_of)
    weight_split = {(c.task, c.microbatch) for c in calls
                    if c.transpose_count == 1 and c.split == "weight"}
    # A call that reads a later microbatch's result combines microbatches (a sum over
    # them, say): it cannot hold its microbatch's slot, so it runs as a free unit.
    combines = _combining(calls)
    units = []
    for i, c in enumerate(calls):
        if c.transpose_count == 0:
            kind = "fwd"
        elif c.transpose_count == 1:
            kind = "bwd_w" if c.split == "weight" else "bwd"
        else:
            kind = "other"
        split = kind == "bwd" and (c.split == "activation"
                                   or (c.task, c.microbatch) in weight_split)
        units.append(Unit(i, mesh_of[_where(c)], kind, c.microbatch,
                          stage_of.get(c.task) if c.microbatch is not None and i not in combines
                          else None,
                          tuple(sorted(set(c.deps))), c.task, c.fragment, split,
                          kind != "fwd" and c.forward is not None))
    return units, meshes


def _combining(calls: Sequence[Call]) -> set[int]:
    """Calls that read a later microbatch's result (they combine microbatches)."""
    out = set()
    for i, call in enumerate(calls):
        mb = call.microbatch
        if mb is None:
            continue
        later = [m for d in call.deps if (m := calls[d].microbatch) is not None and m > mb]
        if later:
            out.add(i)
    return out


def _backward_stages(calls: Sequence[Call], stage_of: dict[str, int], mesh_of) -> None:
    """Stages of backward tasks named apart from their forward (``layer0_bwd`` next to
    ``layer0_fwd``, as MultiMesh callbacks name them): their forward's (``Call.forward``,
    which ``mm-match-tasks`` records), else the stage of the forward on the same submesh
    whose results the backward reads (the latest such), else the only stage of that
    submesh."""
    by_mesh: dict[tuple[int, ...], set[int]] = {}
    for c in calls:
        if c.transpose_count and c.forward in stage_of and c.task not in stage_of:
            stage_of[c.task] = stage_of[c.forward]
    for c in calls:
        if c.transpose_count == 0 and c.task in stage_of:
            by_mesh.setdefault(_where(c), set()).add(stage_of[c.task])
    for c in calls:
        if c.transpose_count == 0 or c.microbatch is None or c.task in stage_of:
            continue
        read = [stage_of[calls[d].task] for d in c.deps
                if calls[d].transpose_count == 0 and calls[d].task in stage_of
                and _where(calls[d]) == _where(c) and calls[d].microbatch == c.microbatch]
        if read:
            stage_of[c.task] = max(read)
        elif len(by_mesh.get(_where(c), ())) == 1:
            stage_of[c.task] = next(iter(by_mesh[_where(c)]))


def pipeline_units(P: int, M: int, *, interleave: int = 1,
                   split_backward: bool = False) -> list[Unit]:
    """The units of a textbook pipeline: ``P`` submeshes, ``M`` microbatches.

    ``P * interleave`` stages, stage ``k`` on submesh ``k % P`` (task ``stage<k>``);
    per microbatch, in program order, the forwards of every stage, then the
    backwards from the last stage down (each followed by its weight-gradient part
    when ``split_backward``). Backward ``k`` reads backward ``k+1`` and forward ``k``.
    """
    if P < 1 or M < 1 or interleave < 1:
        raise ScheduleError("pipeline_units needs P >= 1, M >= 1 and interleave >= 1")
    S = P * interleave
    units: list[Unit] = []

    def add(kind, m, k, deps, split=False):
        units.append(Unit(len(units), k % P, kind, m, k, tuple(sorted(deps)), f"stage{k}",
                          f"stage{k}_{kind}_{m}", split))
        return len(units) - 1

    for m in range(M):
        f: list[int] = []
        for k in range(S):
            f.append(add("fwd", m, k, [f[-1]] if f else []))
        prev = None
        for k in reversed(range(S)):
            b = add("bwd", m, k, [f[k]] + ([prev] if prev is not None else []), split_backward)
            if split_backward:
                add("bwd_w", m, k, [b, f[k]])
            prev = b
    return units


def v_shape_units(P: int, M: int, *, split_backward: bool = True) -> list[Unit]:
    """:func:`pipeline_units` with ``2P`` stages placed in a V: stage ``k`` on submesh
    ``k`` for ``k < P`` and on ``2P - 1 - k`` after (DualPipeV's placement)."""
    units = pipeline_units(P, M, interleave=2, split_backward=split_backward)
    return [replace(u, mesh=k if (k := u.stage or 0) < P else 2 * P - 1 - k) for u in units]


def unit_label(u: Unit) -> str:
    """The name a custom schedule uses: ``task`` (forward), ``task_bwd``, ``task_bwd_w``;
    a backward task named apart from its forward by a callback keeps its own name
    (``layer0_bwd``, ``layer0_bwd_w``)."""
    if u.kind == "fwd":
        return u.task
    if u.kind == "bwd":
        return u.task if u.own_name else f"{u.task}_bwd"
    if u.kind == "bwd_w":
        return f"{u.task}_w" if u.own_name else f"{u.task}_bwd_w"
    return u.fragment or u.task


def short_label(u: Unit) -> str:
    letter = {"fwd": "F", "bwd": "B", "bwd_w": "W"}.get(u.kind, "X")
    return f"{letter}{u.microbatch}" if u.microbatch is not None else f"{letter}*"


def default_cost(u: Unit) -> float:
    """Unit costs: forward 1, weight-gradient part 1, backward 2 (1 when split off)."""
    if u.kind == "bwd":
        return 1.0 if u.split else 2.0
    return 1.0
