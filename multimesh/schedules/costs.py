"""Schedules under real costs: predicted step time, bubble and memory per submesh (no jax).

The algorithms order units with unit costs; that order is what the runtime runs.
Here the same order is simulated with each unit's real duration (per fragment, from
XLA's cost analysis or a measured step; ``multimesh.jax`` makes both) and, given
each forward fragment's residual bytes, the schedule's peak activation bytes per
submesh. :func:`simulate_stages` does the same from per-stage numbers alone (the
planner's view), and :func:`compare` runs every registered schedule on one program.

Costs of units that a comparison derives from the program's own (a backward split
for a zero-bubble schedule, or halves merged back) are named after their fragments:
``f|dx`` and ``f|dw`` are the activation- and weight-gradient halves of backward
``f`` (``split_share`` of its cost goes to the weight half, by default one half, the
zero-bubble paper's B = W), and ``f+g`` is ``f`` followed by ``g``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .build import build_schedule
from .model import ScheduleError, Unit, pipeline_units, v_shape_units
from .registry import all_schedules, get_schedule
from .simulator import (
    Comm,
    FragmentCosts,
    Prediction,
    Program,
    as_cost,
    bytes_text,
    check_comm,
    predict,
    time_text,
)

__all__ = ["FragmentCosts", "Prediction", "predict", "reshape_units", "simulate_stages",
           "textbook_schedule", "ScheduleComparison", "compare"]


# ----------------------------------------------------------------------------- reshaping


def reshape_units(units: Sequence[Unit], split: bool) -> list[Unit]:
    """``units`` with every pipeline backward split into activation- and
    weight-gradient halves (``split``), or with split halves merged back; names per
    the module docstring. Units already in that form come back unchanged."""
    if split and not any(u.kind == "bwd_w" for u in units):
        return _split(units)
    if not split and any(u.kind == "bwd_w" for u in units):
        return _merge(units)
    return list(units)


def _split(units: Sequence[Unit]) -> list[Unit]:
    new: dict[int, list[int]] = {}  # old index -> its new indices
    out: list[Unit] = []
    for u in units:
        deps = tuple(sorted({n for d in u.deps for n in new[d][:1 if u.kind == "bwd" else None]}))
        if u.free or u.kind != "bwd":
            new[u.index] = [len(out)]
            out.append(replace(u, index=len(out), deps=deps))
            continue
        b = len(out)
        out.append(replace(u, index=b, deps=deps, split=True, fragment=f"{u.fragment}|dx"))
        out.append(replace(u, index=b + 1, kind="bwd_w", deps=(b, *deps),
                           fragment=f"{u.fragment}|dw"))
        new[u.index] = [b, b + 1]
    return out


def _merge(units: Sequence[Unit]) -> list[Unit]:
    # each weight half joins the backward half of its (mesh, stage, microbatch)
    into: dict[int, int] = {}
    first: dict[tuple[int, int, int], int] = {}
    for u in units:
        if not u.free and u.kind == "bwd":
            first.setdefault(u.key, u.index)
        elif not u.free and u.kind == "bwd_w" and u.key in first:
            into[u.index] = first[u.key]
    extra: dict[int, list[Unit]] = {}
    for w, b in into.items():
        extra.setdefault(b, []).append(units[w])
    pos: dict[int, int] = {}
    kept = [u for u in units if u.index not in into]
    for k, u in enumerate(kept):
        pos[u.index] = k
    for w, b in into.items():
        pos[w] = pos[b]
    out = []
    for k, u in enumerate(kept):
        parts = [u, *extra.get(u.index, ())]
        deps = {pos[d] for p in parts for d in p.deps} - {k}
        out.append(replace(u, index=k, deps=tuple(sorted(deps)), split=False,
                           fragment="+".join(p.fragment for p in parts)))
    return out


# ----------------------------------------------------------------------------- planner


def simulate_stages(schedule: str, forward: Sequence[float], backward: Sequence[float], *,
                    num_microbatches: int, num_meshes: int | None = None,
                    weight_gradient: Sequence[float] | None = None,
                    activation_bytes: Sequence[int] | None = None,
                    comm: Comm = 0.0) -> Prediction:
    """Predict a textbook pipeline from per-stage numbers (the planner's question).

    ``forward[s]``/``backward[s]``: seconds of stage ``s``'s forward and whole
    backward per microbatch; ``weight_gradient[s]``: the part of ``backward[s]`` that
    a splitting schedule runs apart (default half); ``activation_bytes[s]``: what one
    microbatch keeps from its forward to its backward on stage ``s``. ``num_meshes``
    (default: one per stage) submeshes hold the stages by the schedule's placement
    (round-robin, or a V for ``v-shape``); ``comm``: seconds per transfer.
    """
    S = len(forward)
    P = S if num_meshes is None else num_meshes
    _check_stages(schedule, forward, backward, weight_gradient, activation_bytes, S, P)
    algo = get_schedule(schedule)
    if algo.placement == "v-shape" and S != 2 * P:
        raise ScheduleError(f"schedule '{algo.name}' places 2 stages per submesh in a V: "
                            f"{S} stages need num_meshes={S // 2}, got {P}")
    w = list(weight_gradient) if weight_gradient is not None else [b / 2 for b in backward]
    secs: dict[str, float] = {}
    for s in range(S):
        secs[f"stage{s}_fwd"] = forward[s]
        secs[f"stage{s}_bwd"] = backward[s] - w[s] if algo.splits_backward else backward[s]
        secs[f"stage{s}_bwd_w"] = w[s]
    sched = textbook_schedule(schedule, P, S // P, num_microbatches)
    res = None if activation_bytes is None else (lambda k: int(activation_bytes[k[1]]))

    def cost(u: Unit) -> float:
        return secs[f"stage{u.stage}_{u.kind}"]

    return predict(sched, cost, residual_bytes=res, comm=comm)


def textbook_schedule(name: str, num_meshes: int, interleave: int, num_microbatches: int):
    """The named schedule of a textbook pipeline: ``num_meshes`` submeshes, each with
    ``interleave`` stages (two in a V for a ``v-shape`` schedule), ``num_microbatches``
    microbatches. Built once per registered algorithm and shape: the planner asks for
    the same few schedules for each of its hundreds of candidate cuts, and a schedule
    is immutable. Raises :class:`ScheduleError` where the schedule refuses the shape."""
    return _textbook(get_schedule(name), num_meshes, interleave, num_microbatches)


@functools.lru_cache(maxsize=256)
def _textbook(algo, P: int, V: int, M: int):
    """:func:`textbook_schedule`, keyed by the algorithm object (a schedule registered
    again under its name is a new key)."""
    split = algo.splits_backward
    units = (v_shape_units(P, M, split_backward=split) if algo.placement == "v-shape"
             else pipeline_units(P, M, interleave=V, split_backward=split))
    return build_schedule(units, algo.name)


def _check_stages(schedule, forward, backward, weight_gradient, activation_bytes,
                  S: int, P: int) -> None:
    lengths = {"backward": backward, "weight_gradient": weight_gradient,
               "activation_bytes": activation_bytes}
    for name, seq in lengths.items():
        if seq is not None and len(seq) != S:
            raise ScheduleError(f"simulate_stages got {S} forward costs but {len(seq)} "
                                f"{name} values; give one per stage")
    if S == 0 or P < 1 or S % P:
        raise ScheduleError(f"simulate_stages needs at least one stage and a number of "
                            f"stages divisible by num_meshes, got {S} stages on {P} "
                            f"submeshes")
    if any(not 0 < c < math.inf for c in (*forward, *backward)):
        raise ScheduleError(f"stage costs must be positive and finite, got "
                            f"forward={list(forward)} backward={list(backward)} for "
                            f"schedule '{schedule}'")
    if activation_bytes is not None and any(not 0 <= b < math.inf for b in activation_bytes):
        raise ScheduleError(f"activation_bytes must be >= 0 and finite, got "
                            f"{list(activation_bytes)}")


# ----------------------------------------------------------------------------- comparing


@dataclass
class ScheduleComparison:
    """Every registered schedule on one program: a :class:`Prediction` for each that
    applies (``rows``), and why the others do not (``not_applicable``)."""

    rows: list[Prediction] = field(default_factory=list)
    not_applicable: dict[str, str] = field(default_factory=dict)
    source: str = "unit"

    def __getitem__(self, name: str) -> Prediction:
        key = get_schedule(name).name
        for p in self.rows:
            if p.schedule.name == key:
                return p
        raise KeyError(f"schedule '{key}' does not apply: {self.not_applicable.get(key)}")

    def best(self, memory_limit: int | None = None) -> Prediction:
        """The applicable schedule with the shortest predicted step; with
        ``memory_limit`` (bytes per device), among those whose peak activation bytes
        stay within it on every submesh."""
        rows = self.rows
        if memory_limit is not None:
            if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
                    or not 0 < memory_limit < math.inf:
                raise ScheduleError(f"memory_limit must be a positive number of bytes per "
                                    f"device, or None (no limit), got {memory_limit!r}")
            if any(p.peak_activation_bytes is None for p in rows):
                raise ScheduleError("memory_limit needs residual sizes: compare with "
                                    "memory='plan' or a memory profile")
            rows = [p for p in rows if max(p.peak_activation_bytes or (0,)) <= memory_limit]
            if not rows:
                least = min(self.rows, key=lambda p: max(p.peak_activation_bytes or (0,)))
                raise ScheduleError(
                    f"no schedule keeps its activations within {bytes_text(memory_limit)}; "
                    f"the least, '{least.schedule.name}', holds "
                    f"{bytes_text(max(least.peak_activation_bytes or (0,)))} on a submesh "
                    f"(recompute stages with remat=, or use more microbatches)")
        return min(rows, key=lambda p: p.step_time)

    def format(self, *, times: bool = True) -> str:
        """The table: step time (``times``), bubble, peak live microbatches and
        activation bytes per submesh, then the schedules that do not apply and why."""
        head = f"{'schedule':<28}" + (f"{'step':>10}" if times else "") + \
            f"{'bubble':>8}  peak live per submesh"
        lines = [f"schedules simulated with {self.source} costs", head]
        for p in self.rows:
            mem = " ".join(str(n) for n in p.peak_microbatches)
            if p.peak_activation_bytes is not None:
                mem += "  (" + " ".join(bytes_text(b) for b in p.peak_activation_bytes) + ")"
            step = f"{time_text(p.step_time, self.source):>10}" if times else ""
            lines.append(f"{p.schedule.name:<28}{step}{100 * p.bubble:>7.1f}%  {mem}")
        for name, why in self.not_applicable.items():
            lines.append(f"{name:<28}not applicable: {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def compare(units: Sequence[Unit], costs=None, *, residual_bytes=None, comm: Comm = 0.0,
            devices: Sequence[Sequence[int]] | None = None) -> ScheduleComparison:
    """Schedule ``units`` (one program's, in program order) with every registered
    schedule and predict each with ``costs`` (see :func:`predict`); ``comm``: seconds
    per transfer, or a function of the sending and receiving units
    (``multimesh.jax.compare_schedules`` prices their bytes with its device model)."""
    _, source = as_cost(costs)
    check_comm(comm)  # once, not as every schedule's reason not to apply
    out = ScheduleComparison(source=source)
    prog = Program(units)
    one_stage = all(len(s) <= 1 for s in prog.stages_of)
    for algo in all_schedules():
        if not algo.has_textbook:
            out.not_applicable[algo.name] = "it runs the order you give (custom_schedule=)"
            continue
        if algo.without_interleaving and one_stage:
            title, other = algo.without_interleaving
            out.not_applicable[algo.name] = (f"every submesh runs one stage, so it runs as "
                                             f"{title} ('{other}')")
            continue
        try:
            sched = build_schedule(reshape_units(units, algo.splits_backward), algo.name,
                                   devices=devices)
            out.rows.append(predict(sched, costs, residual_bytes=residual_bytes, comm=comm))
        except ScheduleError as e:
            out.not_applicable[algo.name] = str(e)
            if algo.name == "gpipe":  # it takes any program: its failure is the input's
                raise ScheduleError(f"no schedule can be simulated with these costs: {e}") \
                    from None
    return out


