"""Pipeline schedules as a library: the unit model, a registry of algorithms, a simulator.

No MLIR here, and nothing above :mod:`multimesh._src` is imported: the front end
(``multimesh.jax``) and the passes (``mm-schedule-fragments``) are both clients, and so
are the docs, the benchmarks (P6) and the visualiser. ``multimesh.passes.schedules``
re-exports this package under its old name.

Layout: :mod:`.model` (units, stages, textbook pipelines), :mod:`.simulator` (the
event simulator, :class:`Schedule`, :class:`Timeline`, live activations),
:mod:`.plans` (slot plans shared by the algorithms), :mod:`.placement` (stage-placement
rules), :mod:`.custom` (custom schedules, parsed once into :class:`CustomSchedule`),
:mod:`.gantt` (text Gantt), :mod:`.registry` (:class:`ScheduleAlgorithm`,
:func:`register_schedule`, :func:`get_schedule`, :func:`all_schedules`), :mod:`.build`
(:func:`build_schedule` and the theory by name), and ``algorithms/``: one module per
schedule. Every algorithm writes a *plan* per submesh (the textbook order, as slots
``(kind, stage, microbatch)``) and runs it through the simulator with unit costs.
"""

from __future__ import annotations

from . import algorithms
from .build import build_schedule, check_placement, theoretical_bubble, theoretical_peak_live
from .custom import CustomSchedule, canonicalize_custom_schedule, check_custom_rows
from .gantt import format_gantt
from .model import (
    KINDS,
    Call,
    ScheduleError,
    ScheduleTypeError,
    Unit,
    default_cost,
    pipeline_units,
    unit_label,
    units_from_calls,
    v_shape_units,
)
from .registry import (
    ScheduleAlgorithm,
    alias_list,
    aliases,
    all_schedules,
    canonical_schedule_name,
    describe_schedules,
    get_schedule,
    register_schedule,
    schedule_names,
)
from .simulator import (
    Schedule,
    Timeline,
    chunk_of,
    live_activation_profile,
    live_activations,
    simulate,
)

__all__ = [
    "KINDS", "SCHEDULES", "ALIASES", "alias_list", "ScheduleError", "Unit", "Call", "Schedule",
    "Timeline", "units_from_calls", "pipeline_units", "build_schedule", "canonical_schedule_name",
    "canonicalize_custom_schedule", "check_custom_rows", "ScheduleTypeError", "unit_label", "default_cost", "simulate",
    "live_activations", "live_activation_profile", "theoretical_bubble", "format_gantt",
    "chunk_of", "SPLIT_SCHEDULES", "PLACEMENTS", "check_placement", "theoretical_peak_live",
    "v_shape_units", "CustomSchedule", "ScheduleAlgorithm", "register_schedule", "get_schedule",
    "all_schedules", "aliases", "algorithms", "schedule_names", "describe_schedules",
]

# Snapshots of the registry once the built-in algorithms are registered.
SCHEDULES: tuple[str, ...] = tuple(s.name for s in all_schedules())
SPLIT_SCHEDULES: tuple[str, ...] = tuple(s.name for s in all_schedules() if s.splits_backward)
"""Schedules that run weight gradients apart (``mm-split-backward{all=true}`` first)."""
ALIASES: dict[str, str] = aliases()
"""Other names of the schedules; matched case-insensitively (:func:`alias_list`)."""
PLACEMENTS: dict[str, str] = {s.name: s.placement for s in all_schedules()
                              if s.placement is not None}
"""The stage placement each schedule with a placement rule needs (:mod:`.placement`)."""
