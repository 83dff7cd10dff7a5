"""``mm-schedule-fragments``: order ``@main``'s fragment calls by a pipeline schedule."""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlir_passes import _contract as c
from mlir_passes.base import ModulePass
from mlir_passes.schedules import (
    Call,
    Schedule,
    ScheduleError,
    build_schedule,
    canonical_schedule_name,
    units_from_calls,
)
from multimesh._src.errors import DiagnosticError, PipelineError
from multimesh._src.mlir import attr_to_py, dict_attr, ir

__all__ = ["ScheduleFragmentsPass", "SCHEDULE_ATTR", "CONFIG_ATTR", "SPLIT_ATTR",
           "read_calls", "read_schedule"]

SCHEDULE_ATTR = "mm.schedule"
CONFIG_ATTR = "mm.schedule_config"
_CONFIG_KEYS = ("schedule", "num_stages", "interleave", "custom_schedule")
SPLIT_ATTR = "mm.split"
_SPLITS = ("activation", "weight")


@dataclass(frozen=True)
class ScheduleFragmentsPass(ModulePass):
    """Reorder the fragment calls of ``@main`` into a pipeline schedule.

    Input is the MPMD form (``@main`` holds only ``func.call``\\ s marked
    ``mm.fragment``). Each call is a unit of ``mlir_passes/schedules.py``: its
    callee's ``mm.task`` gives the task, the direction (``transpose_count``) and the
    ``microbatch``, ``mm.devices`` the submesh (submeshes are numbered by first
    use), ``mm.split = "activation" | "weight"`` marks the two halves of a split
    backward, and SSA uses in ``@main`` give the data dependencies. Stages come from
    the forward fragments: a run of consecutive forward tasks on one submesh is one
    stage, so several stages on one submesh mean interleaving.

    Schedules: ``gpipe`` (fill-drain; aliases ``fill-drain``, ``breadth-first``),
    ``1f1b`` (PipeDream-flush, alias ``wavefront``; Megatron's interleaved 1F1B when
    submeshes run several stages, which ``interleaved-1f1b`` names explicitly),
    ``zero-bubble-h1`` (1F1B's order with every weight-gradient half moved into idle
    slots, under 1F1B's peak memory) and ``custom`` (rows from
    ``custom-schedule-file``, a JSON list of rows, or from ``custom_schedule`` in
    ``mm.schedule_config``; one row per submesh, entries ``"task"``, ``"task_bwd"``,
    ``"task_bwd_w"`` or ``[microbatch, name]``, each name once per microbatch).
    Every schedule is a per-submesh order that respects the data dependencies; the
    pass rewrites ``@main`` into one global order that merges them (the units sorted
    by start time in a unit-cost simulation) and records the result as the module
    attribute ``mm.schedule`` (see docs/ir.md). Calls without a microbatch, or that
    read a later microbatch's result, run as soon as their inputs are ready. A
    program with no microbatch index is left unchanged.

    Options not given on the command line are read from the module attribute
    ``mm.schedule_config = {schedule = "1f1b", num_stages = 4, interleave = 2,
    custom_schedule = [...]}`` (every key optional), so a saved module replays alone.
    """

    argument = "mm-schedule-fragments"
    summary = "Order the fragment calls of `@main` by a pipeline schedule (GPipe, 1F1B, ...)."
    consumes = ("mpmd",)

    schedule: str | None = None
    """gpipe, 1f1b, interleaved-1f1b, zero-bubble-h1 or custom (or an alias); default: the module's mm.schedule_config, else gpipe."""
    num_stages: int | None = None
    """Pipeline depth for 1F1B's warm-up (default: the number of pipeline submeshes)."""
    interleave: int | None = None
    """If set, every pipeline submesh must run exactly this many stages."""
    custom_schedule_file: str | None = None
    """JSON file with the custom schedule's rows (schedule=custom)."""

    def __post_init__(self):
        # Options given on the command line are checked before any module is read.
        if self.schedule is not None and str(self.schedule).strip().lower() != "custom":
            try:
                canonical_schedule_name(self.schedule)
            except ScheduleError as e:
                raise PipelineError(f"Pass '{self.argument}' option 'schedule': {e}.") from None
        for option in ("num_stages", "interleave"):
            if getattr(self, option) is not None and getattr(self, option) < 1:
                raise self.bad_option(option, "a positive integer")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            loc = module.operation.location
            try:
                name, custom, num_stages, interleave = self._config(module)
            except ScheduleError as e:
                raise DiagnosticError(str(e), loc) from None
            calls, ops, ret = read_calls(module)
            units, devices = units_from_calls(calls)
            if all(u.free for u in units):
                return
            try:
                sched = build_schedule(units, name, num_stages=num_stages,
                                       interleave=interleave, custom=custom, devices=devices)
            except ScheduleError as e:
                raise DiagnosticError(str(e), loc) from None
            for i in sched.order:
                ops[i].move_before(ret)
            module.operation.attributes[SCHEDULE_ATTR] = dict_attr(sched.to_dict())

    def _config(self, module: ir.Module):
        """``(schedule, custom rows, num_stages, interleave)``: options over mm.schedule_config."""
        attrs = module.operation.attributes
        cfg = attr_to_py(attrs[CONFIG_ATTR]) if CONFIG_ATTR in attrs else {}
        if not isinstance(cfg, dict) or set(cfg) - set(_CONFIG_KEYS):
            raise ScheduleError(
                f"'{CONFIG_ATTR}' must be a dictionary with keys among "
                f"{', '.join(_CONFIG_KEYS)}, got {cfg}")
        name = self.schedule if self.schedule is not None else cfg.get("schedule")
        if self.custom_schedule_file:
            try:
                with open(self.custom_schedule_file, encoding="utf-8") as f:
                    custom = json.load(f)
            except (OSError, ValueError) as e:
                raise ScheduleError(
                    f"cannot read custom schedule file '{self.custom_schedule_file}': {e}"
                ) from None
        elif self.schedule is None or str(self.schedule).strip().lower() == "custom":
            custom = cfg.get("custom_schedule")
        else:
            custom = None
        name = canonical_schedule_name(name, custom)
        if name == "custom" and custom is None:
            raise ScheduleError(
                "schedule 'custom' needs a custom schedule: pass custom-schedule-file=<json> "
                f"or set custom_schedule in the module attribute '{CONFIG_ATTR}'")
        num_stages = self.num_stages if self.num_stages is not None else cfg.get("num_stages")
        interleave = self.interleave if self.interleave is not None else cfg.get("interleave")
        return name, custom, num_stages, interleave


def read_calls(module: ir.Module) -> tuple[list[Call], list[ir.Operation], ir.Operation]:
    """``@main``'s fragment calls as :class:`Call`\\ s (program order), the call ops and
    the return op. Raises :class:`DiagnosticError` outside the MPMD form."""
    main = c.main_func(module)
    funcs = c.func_by_name(module)
    block = c.entry_block(main)
    ops = [o.operation for o in block.operations]
    ret = ops.pop()
    index: dict[ir.Value, int] = {}
    calls = []
    for k, op in enumerate(ops):
        if op.name != "func.call" or "mm.fragment" not in op.attributes:
            raise DiagnosticError(
                f"mm-schedule-fragments expects @main to hold only fragment calls (MPMD form, "
                f"after mm-outline-fragments), found '{op.name}'", op.location)
        callee = c.callee_of(op)
        fn = funcs.get(callee)
        if fn is None:
            raise DiagnosticError(f"fragment call to unknown function @{callee}", op.location)
        task = dict(attr_to_py(fn.attributes[c.TASK_ATTR])) if c.TASK_ATTR in fn.attributes \
            else {}
        if c.TASK_ATTR in op.attributes:
            task.update(attr_to_py(op.attributes[c.TASK_ATTR]))
        if "name" not in task or "transpose_count" not in task:
            raise DiagnosticError(f"fragment @{callee} has no 'mm.task' with a name and a "
                                  "transpose_count", op.location)
        if "mm.devices" not in fn.attributes:
            raise DiagnosticError(f"fragment @{callee} has no 'mm.devices'", op.location)
        split = None
        for holder in (fn, op):
            if SPLIT_ATTR in holder.attributes:
                split = attr_to_py(holder.attributes[SPLIT_ATTR])
        if split is not None and split not in _SPLITS:
            raise DiagnosticError(
                f"fragment @{callee} has {SPLIT_ATTR} = {split!r}; expected \"activation\" "
                "or \"weight\"", op.location)
        deps = [index[v] for v in op.operands if v in index]
        mb = task.get("microbatch")
        calls.append(Call(callee, str(task["name"]), int(task["transpose_count"]),
                          tuple(int(d) for d in attr_to_py(fn.attributes["mm.devices"])),
                          None if mb is None else int(mb), split, tuple(deps)))
        for r in op.results:  # keyed by value: an Operation's hash follows its contents
            index[r] = k
    return calls, ops, ret


def read_schedule(module: ir.Module) -> Schedule | None:
    """The schedule ``mm-schedule-fragments`` recorded on ``module``, if any."""
    attrs = module.operation.attributes
    if SCHEDULE_ATTR not in attrs:
        return None
    return Schedule.from_dict(attr_to_py(attrs[SCHEDULE_ATTR]))
