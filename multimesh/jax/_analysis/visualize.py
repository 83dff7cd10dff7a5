"""``visualize_schedule``: a pipeline schedule as a text Gantt chart and a PNG."""

from __future__ import annotations

import builtins
import os
import warnings
from collections.abc import Callable, Mapping

import numpy as np

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError, user_stacklevel
from multimesh._src.ir_contract import SCHEDULE_ATTR
from multimesh._src.mlir import parse_module
from multimesh.jax._analysis.costs import xla_costs
from multimesh.jax._analysis.memory import program_fingerprint
from multimesh.passes.api import read_schedule
from multimesh.schedules import Schedule, Timeline, Unit, chunk_of, format_gantt, simulate
from multimesh.schedules.costs import as_cost
from multimesh.schedules.gantt import format_timeline, memory_lanes

__all__ = ["visualize_schedule", "as_schedule"]

# Forward blue, backward orange, weight-gradient half green, anything else grey.
COLORS = {"fwd": "#4C78A8", "bwd": "#F58518", "bwd_w": "#54A24B", "other": "#9D9D9D"}


def as_schedule(obj) -> Schedule:
    """A :class:`Schedule` from a compiled program, a module, its text, a dict or itself."""
    if isinstance(obj, Schedule):
        return obj
    if isinstance(obj, Mapping):
        return Schedule.from_dict(obj)
    sched = getattr(obj, "schedule", None)
    if callable(sched) and not isinstance(sched, (Schedule, Mapping)):
        sched = sched()
    if sched is not None:
        return as_schedule(sched)
    module = _schedule_module(obj)
    if module is None:
        raise MultimeshTypeError(
            f"visualize_schedule expects a compiled program, a module or a Schedule, got "
            f"{type(obj).__name__}.")
    s = read_schedule(module)
    if s is None:
        raise MultimeshValueError(_NO_SCHEDULE)
    return s


_NO_SCHEDULE = ("This program has no pipeline schedule (it is not microbatched: use "
                "multimesh.jax.microbatch).")


def _schedule_module(obj):
    """The module to read a schedule from: parsed from text (``obj`` or its
    ``as_text()``), ``obj`` itself if it is a module, else None."""
    text = None
    if isinstance(obj, str):
        text = obj
    elif hasattr(obj, "as_text") and callable(obj.as_text):
        text = obj.as_text()
    if text is None:
        return obj if hasattr(obj, "operation") else None
    if SCHEDULE_ATTR not in text:  # cheaper than parsing a large module to find nothing
        raise MultimeshValueError(_NO_SCHEDULE)
    return parse_module(text)


def visualize_schedule(compiled_or_schedule, path: str | os.PathLike | None = None, *,
                       cost: Callable[[Unit], float] | None = None,
                       costs=None, memory=None, print: bool = True) -> str | None:
    """Print the schedule as a text Gantt chart; with ``path``, also save it as a PNG.

    ``compiled_or_schedule``: what ``mjit(f).lower(...).compile()`` returns, the
    module after ``mm-schedule-fragments`` (or its text), a :class:`Schedule`, or a
    measured :class:`~multimesh.jax.StepProfile` (drawn as it ran, labelled
    "measured"). Times come from a simulation with unit costs (forward 1, backward
    2, each half of a split backward 1) unless ``costs`` gives real ones (``"xla"``
    for a compiled program, a ``StepProfile``, ``{fragment: seconds}``; labelled
    "simulated (costs: ...)"; ``"unit"``, the default) or ``cost`` maps a unit to its
    duration (in units of time). The PNG
    has one row per submesh, forward/backward/weight-gradient boxes in three
    colours with the microbatch number inside (hatched: a submesh's second stage
    under interleaving); it needs matplotlib (without it a
    warning is issued and no file is written). Returns the path of the file it
    wrote (``path``, with ``.png`` added when it has no extension), or None.
    ``print=False`` leaves the text chart out (only the file is written).

    ``memory``: True adds a memory lane per submesh (its live activations, in
    microbatches, over the timeline); a ``MemoryProfile``
    (``compiled.memory_profile(...)`` of this same program) also puts what a real
    step measured beside each lane: the peak activation bytes and microbatches, and
    the theory's bytes.
    """
    _check_output(path, print)
    if cost is not None and not callable(cost):
        raise MultimeshTypeError(
            f"visualize_schedule's `cost` must be a function of a unit (its duration in "
            f"units of time) or None; for seconds per fragment use `costs=`; got "
            f"{type(cost).__name__} {cost!r}.")
    tl, label = _timeline(compiled_or_schedule, cost, costs)
    notes = _memory_notes(memory, compiled_or_schedule, tl.schedule)
    lanes = False if memory is None else notes or True
    if print:
        _print_chart(tl, label, cost, lanes, notes)
    if path is None:
        return None
    try:  # local: matplotlib is optional (a PNG only when it is installed)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        warnings.warn("matplotlib is not installed: no PNG written "
                      "(pip install matplotlib)", stacklevel=user_stacklevel())
        return None
    seconds = cost is None and "unit" not in label
    span = 40.0 if seconds else tl.makespan  # real seconds: a fixed width
    fig = Figure(figsize=(max(6.0, min(24.0, 0.35 * span + 2)),
                          0.6 * tl.schedule.num_meshes + 1.4 + (2.2 if lanes else 0)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2 if lanes else 1, 1, 1)
    _draw(ax, tl, label, seconds=seconds)
    if lanes:
        _draw_lanes(fig.add_subplot(2, 1, 2, sharex=ax), tl, notes, 1e3 if seconds else 1.0)
    fig.tight_layout()
    out = os.fspath(path)
    if not os.path.splitext(out)[1]:  # matplotlib adds the format's extension
        out += ".png"
    fig.savefig(out, dpi=100)
    return out


def _check_output(path, print) -> None:
    """``path`` a file name in a directory that exists (or None), ``print`` a bool:
    refused before anything is drawn."""
    if not isinstance(print, (bool, np.bool_)):
        raise MultimeshTypeError(
            f"visualize_schedule's `print` must be True (print the text chart) or False, "
            f"got {type(print).__name__} {print!r}.")
    if path is None:
        return
    if not isinstance(path, (str, os.PathLike)):
        raise MultimeshTypeError(
            f"visualize_schedule's `path` must be a file name (str or os.PathLike) or None "
            f"(no PNG), got {type(path).__name__} {path!r}.")
    where = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(where):
        raise MultimeshValueError(
            f"visualize_schedule cannot write {os.fspath(path)!r}: the directory {where!r} "
            f"does not exist. Create it first, or give a path in an existing directory.")


def _print_chart(tl: Timeline, label: str, cost, lanes, notes) -> None:
    if "unit" in label or cost is not None:  # a grid of whole units of time
        builtins.print(format_gantt(tl.schedule, cost=cost, memory=lanes))
        return
    builtins.print(format_timeline(tl, label))
    if lanes:
        for m, lane in enumerate(memory_lanes(tl.schedule, tl)):
            note = f"  {notes[m]}" if notes and m < len(notes) else ""
            builtins.print(f"submesh {m} live activations: peak {lane.peak}{note}")


def _timeline(obj, cost, costs) -> tuple[Timeline, str]:
    """The timeline to draw and how it was made."""
    if getattr(obj, "measured", False):
        if cost is not None or costs is not None:
            raise MultimeshValueError("A measured StepProfile is drawn as it ran; cost= and "
                                      "costs= apply to a schedule, not to a measurement.")
        return obj.timeline(), "measured"
    sched = as_schedule(obj)
    if costs is None or (isinstance(costs, str) and costs == "unit"):
        return simulate(sched, cost=cost), ("simulated (unit costs)" if cost is None
                                            else "simulated (costs: given)")
    if cost is not None:
        raise MultimeshValueError("Give cost= or costs=, not both.")
    if isinstance(costs, str) and costs == "xla":
        if isinstance(obj, (Schedule, Mapping)):
            raise MultimeshValueError("costs='xla' needs the compiled program, not its "
                                      "Schedule: pass the compiled program.")
        costs = xla_costs(obj)
    fn, source = as_cost(costs)
    return simulate(sched, cost=fn), f"simulated (costs: {source})"


def _draw(ax, tl: Timeline, label: str, seconds: bool) -> None:
    # local: matplotlib is optional (drawn only when visualize_schedule found it)
    from matplotlib.patches import Patch

    sched = tl.schedule
    chunk = chunk_of(sched)
    G = sched.num_meshes
    scale = 1e3 if seconds else 1.0
    for m, row in enumerate(sched.orders):
        y = G - 1 - m
        for i in row:
            u = sched.units[i]
            s, e = tl.start[i] * scale, tl.end[i] * scale
            ax.broken_barh([(s, e - s)], (y - 0.4, 0.8), facecolors=COLORS.get(u.kind, "#9D9D9D"),
                           edgecolors="black", linewidth=0.5,
                           hatch="//" if chunk.get(i, 0) % 2 else None)
            text = "" if u.microbatch is None else str(u.microbatch)
            ax.text((s + e) / 2, y, text, ha="center", va="center", fontsize=8, color="white")
    ax.set_yticks([G - 1 - m for m in range(G)])
    ax.set_yticklabels([_row_label(sched, m) for m in range(G)])
    ax.set_xlim(0, max(tl.makespan * scale, 1e-9 if seconds else 1.0))
    ax.set_ylim(-0.6, G - 0.4)
    ax.set_xlabel("time (ms)" if seconds else "time (unit costs)")
    ax.set_title(f"{sched.name}, {label}: {G} submeshes x {sched.num_microbatches} "
                 f"microbatches, bubble {100 * tl.bubble_fraction():.1f}%")
    kinds = [k for k in ("fwd", "bwd", "bwd_w", "other") if any(u.kind == k for u in sched.units)]
    names = {"fwd": "forward", "bwd": "backward", "bwd_w": "weight gradient", "other": "other"}
    ax.legend(handles=[Patch(facecolor=COLORS[k], label=names[k]) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, title=label)


def _row_label(s: Schedule, m: int) -> str:
    if m < len(s.devices):
        return f"submesh {m}\n({','.join(str(d) for d in s.devices[m])})"
    return f"submesh {m}"


def _memory_notes(memory, obj, sched: Schedule) -> list[str] | None:
    """Per submesh, what a real step measured (``memory``: a MemoryProfile of the
    program drawn), or None."""
    if memory is None or memory is True or memory is False:
        return None
    rows = getattr(memory, "submeshes", None)
    if rows is None:
        raise MultimeshTypeError(
            f"visualize_schedule's `memory` must be True or a MemoryProfile (what "
            f"compiled.memory_profile(...) returns), got {type(memory).__name__}.")
    _check_same_program(memory, obj, sched)
    return [f"measured {_size(s.peak_activations)} ({s.peak_microbatches} mb), "
            f"theory {_size(t)}" for s, t in zip(rows, memory.predicted_activations)]


def _check_same_program(memory, obj, sched: Schedule) -> None:
    """``memory`` was measured on the program drawn: the same schedule and, for a
    compiled program, the same program."""
    source = getattr(memory, "source", None)
    program = getattr(memory, "program", None)
    other = source is None or source != sched or len(memory.submeshes) != sched.num_meshes
    if not other and program is not None and hasattr(obj, "record"):
        other = program_fingerprint(obj) != program
    if other:
        raise MultimeshValueError(
            f"visualize_schedule's `memory` is the memory profile of another program "
            f"(schedule {memory.schedule!r} on {len(memory.submeshes)} submesh(es)) than "
            f"the one drawn (schedule {sched.name!r} on {sched.num_meshes}); pass "
            f"`compiled.memory_profile(...)` of the program you draw.")


def _size(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _draw_lanes(ax, tl: Timeline, notes: list[str] | None, scale: float) -> None:
    """The memory lanes: live microbatches per submesh over time, a step line each."""
    for m, lane in enumerate(memory_lanes(tl.schedule, tl)):
        xs = [0.0] + [t * scale for t, _ in lane.steps] + [tl.makespan * scale]
        ys = [0] + [c for _, c in lane.steps]
        ys.append(ys[-1])
        label = f"submesh {m}: peak {lane.peak}"
        if notes and m < len(notes):
            label += f"; {notes[m]}"
        ax.step(xs, ys, where="post", label=label)
    ax.set_ylabel("live microbatches")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
