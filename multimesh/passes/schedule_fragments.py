"""``mm-schedule-fragments``: the order in which a microbatch loop's fragment calls run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from multimesh._src import ir_attrs as ta
from multimesh._src.errors import DiagnosticError, PipelineError
from multimesh._src.mlir import ir
from multimesh.schedules import (
    Call,
    Schedule,
    ScheduleError,
    build_schedule,
    canonical_schedule_name,
    check_custom_rows,
    describe_schedules,
    get_schedule,
    schedule_names,
    units_from_calls,
)

from . import _contract as c
from .base import ModulePass, generated_doc

__all__ = ["ScheduleFragmentsPass", "SCHEDULE_ATTR", "CONFIG_ATTR", "SPLIT_ATTR",
           "read_loop", "loop_calls", "read_schedule", "find_loop"]

SCHEDULE_ATTR = c.SCHEDULE_ATTR
CONFIG_ATTR = c.SCHEDULE_CONFIG_ATTR
_COUNT = ta.int_in(1, ta.MAX_MICROBATCHES)
_ENTRY = ta.Spec('a task name or a [microbatch, "name"] pair',
                lambda v: (isinstance(v, str) and bool(v)) or (
                    isinstance(v, list) and len(v) == 2 and ta.MICROBATCH_INDEX.check(v[0])
                    and isinstance(v[1], str) and bool(v[1])),
                'task names or [microbatch, "name"] pairs')
_ROWS = ta.list_of(ta.list_of(_ENTRY))
CONFIG_SPEC = ta.dict_of(schedule=ta.NAME, num_stages=_COUNT, interleave=_COUNT,
                        custom_schedule=_ROWS, unrolling=_COUNT)
"""``mm.schedule_config``: every key optional (docs/ir.md)."""
SPLIT_ATTR = c.SPLIT_ATTR
_SPLITS = ("activation", "weight")


def _schedule_doc() -> str:
    """The ``schedule`` option's description, from the schedule registry."""
    return (f"{schedule_names()} (or an alias); default: the module's "
            f"mm.schedule_config, else gpipe.\n{describe_schedules()}")


@dataclass(frozen=True)
class ScheduleFragmentsPass(ModulePass):
    """Decide the order of every (fragment call, microbatch) of the microbatch loop.

    Input is the loop form of ``mm-form-microbatch-loop``: ``@main`` calls
    ``@microbatch_loop`` once per microbatch through ``mm.microbatch_loop``. Each
    call of the body, for each of the ``mm.num_microbatches`` microbatches, is a unit
    of ``multimesh.schedules``: its callee's ``mm.task`` gives the task and the
    direction (``transpose_count``), ``mm.devices`` the submesh (submeshes are
    numbered by first use), ``mm.split = "activation" | "weight"`` marks the halves
    of a split backward, and SSA uses give the data dependencies (within a
    microbatch, and from the previous microbatch through a carried value that another
    call reads; a running sum that only its accumulating call reads orders nothing,
    as a sum is commutative and the runtime adds the microbatches in the schedule's
    order). Stages
    come from the forward calls: a run of consecutive forward tasks on one submesh
    is one stage, so several stages on one submesh mean interleaving.

    Schedules: every schedule of the registry (``multimesh.schedules``), listed with
    the ``schedule`` option below; ``custom`` takes its rows from
    ``custom-schedule-file`` (a JSON list of rows) or from ``custom_schedule`` in
    ``mm.schedule_config``.

    The result is recorded on the loop op as ``mm.schedule = {name = "1f1b", order =
    array<i64: k0, m0, k1, m1, ...>}``: the global dispatch order as (body call,
    microbatch) pairs, which merges the per-submesh orders (units sorted by start
    time in a unit-cost simulation). A schedule that cannot do anything (the loop
    runs on one submesh, or holds no task) or that falls back to 1F1B's order
    (``interleaved-1f1b`` with one stage per submesh, a zero-bubble schedule with no
    weight half) is recorded as asked but warned about.
    A module without a microbatch loop is left unchanged.

    Options not given on the command line are read from the module attribute
    ``mm.schedule_config = {schedule = "1f1b", num_stages = 4, interleave = 2,
    unrolling = 2, custom_schedule = [...]}`` (every key optional), so a saved
    module replays alone.
    """

    argument = "mm-schedule-fragments"
    summary = "Order a microbatch loop's fragment calls by a pipeline schedule (GPipe, 1F1B, ...)."
    consumes = ("mpmd",)

    schedule: str | None = field(default=None, metadata=generated_doc(_schedule_doc))
    """A registered schedule (its description comes from the registry, ``_schedule_doc``)."""
    num_stages: int | None = None
    """Pipeline depth for 1F1B's warm-up (default: the number of pipeline submeshes)."""
    interleave: int | None = None
    """If set, every pipeline submesh must run exactly this many stages."""
    unrolling: int | None = None
    """GPipe only: run the microbatches in groups of this many."""
    custom_schedule_file: str | None = None
    """JSON file with the custom schedule's rows (schedule=custom)."""

    def __post_init__(self):
        # Options given on the command line are checked before any module is read.
        if self.schedule is not None and str(self.schedule).strip().lower() != "custom":
            try:
                canonical_schedule_name(self.schedule)
            except ScheduleError as e:
                raise PipelineError(f"Pass '{self.argument}' option 'schedule': {e}.") from None
        for option in ("num_stages", "interleave", "unrolling"):
            value = getattr(self, option)
            if value is not None and not 1 <= value <= ta.MAX_MICROBATCHES:
                raise self.bad_option(option, f"an integer in 1..{ta.MAX_MICROBATCHES}")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            loc = module.operation.location
            try:
                name, custom, num_stages, interleave, unrolling, asked = self._config(module)
            except ScheduleError as e:
                raise DiagnosticError(str(e), loc) from None
            loop = find_loop(module)
            if loop is None:
                if asked:
                    c.warn_at(loc, f"schedule '{name}' does not apply: the module has no "
                                   f"microbatch loop")
                return
            info = read_loop(module, loop)
            units, devices = units_from_calls(loop_calls(info))
            try:
                sched = build_schedule(units, name, num_stages=num_stages,
                                       interleave=interleave, custom=custom, devices=devices,
                                       unrolling=unrolling)
            except ScheduleError as e:
                raise DiagnosticError(str(e), loop.location) from None
            if asked and name != "gpipe" and not _warn_if_idle(sched, name, loop.location,
                                                                info):
                _warn_if_not_applied(sched, name, loop.location)
            S = len(info.calls)
            pairs = []
            for u in sched.order:
                pairs += [u % S, u // S]
            loop.attributes[SCHEDULE_ATTR] = ir.DictAttr.get({
                "name": ir.StringAttr.get(sched.name),
                "order": ir.DenseI64ArrayAttr.get(pairs)})

    def _config(self, module: ir.Module):
        """``(schedule, custom rows, num_stages, interleave, unrolling, asked)``."""
        cfg = ta.read_attr(module.operation, CONFIG_ATTR, CONFIG_SPEC, f"'{CONFIG_ATTR}'",
                          default={})
        name = self.schedule if self.schedule is not None else cfg.get("schedule")
        asked = name is not None
        if self.custom_schedule_file:
            try:
                with open(self.custom_schedule_file, encoding="utf-8") as f:
                    custom = json.load(f)
            except (OSError, ValueError) as e:
                raise ScheduleError(
                    f"cannot read custom schedule file '{self.custom_schedule_file}': {e}"
                ) from None
            check_custom_rows(custom)  # the one check of rows a user wrote (as microbatch's)
        elif self.schedule is None or str(self.schedule).strip().lower() == "custom":
            custom = cfg.get("custom_schedule")
        else:
            custom = None
        asked = asked or custom is not None
        name = canonical_schedule_name(name, custom)
        if name == "custom" and custom is None:
            raise ScheduleError(
                "schedule 'custom' needs a custom schedule: pass custom-schedule-file=<json> "
                f"or set custom_schedule in the module attribute '{CONFIG_ATTR}'")
        num_stages = self.num_stages if self.num_stages is not None else cfg.get("num_stages")
        interleave = self.interleave if self.interleave is not None else cfg.get("interleave")
        unrolling = self.unrolling if self.unrolling is not None else cfg.get("unrolling")
        return name, custom, num_stages, interleave, unrolling, asked


def _warn_if_idle(sched: Schedule, name: str, loc, info) -> bool:
    """Warn (and say so) when no schedule can order anything: no task, or one stage."""
    tasks = {cl.task for cl in info.calls}
    if tasks <= {c.DEFAULT_TASK}:
        c.warn_at(loc, f"schedule '{name}' does not apply: the microbatch loop holds no task, "
                       f"so it runs on all devices as one pipeline stage; place the work in "
                       f"tasks (task(...) or register_task) on different submeshes to "
                       f"pipeline it")
        return True
    stages = {u.stage for u in sched.units if u.stage is not None}
    if len(stages) <= 1:
        c.warn_at(loc, f"schedule '{name}' does not apply: the microbatch loop has a single "
                       f"pipeline stage (all of its tasks run on one submesh), so every "
                       f"schedule runs the microbatches one after another")
        return True
    return False


def _warn_if_not_applied(sched: Schedule, name: str, loc) -> None:
    """Interleaving with one stage per submesh is 1F1B (GPipe), and a zero-bubble
    schedule (DualPipeV, ZB-V) with no weight half to defer runs without deferring any:
    say so rather than run it under another name."""
    units = [u for u in sched.units if not u.free]
    stages: dict[int, set] = {}
    for u in units:
        stages.setdefault(u.mesh, set()).add(u.stage)
    algo = get_schedule(name)
    if algo.without_interleaving and all(len(s) == 1 for s in stages.values()):
        title, other = algo.without_interleaving
        c.warn_at(loc, f"schedule '{name}' has nothing to interleave: each of the "
                       f"{len(stages)} submeshes runs one pipeline stage (contiguous stages), "
                       f"so it runs plain {title}; interleaving needs several stages per "
                       f"submesh, placed round-robin (stage k on submesh k % {len(stages)}), "
                       f"or use schedule='{other}'")
    order = algo.without_split
    if order and not any(u.kind == "bwd_w" for u in units):
        c.warn_at(loc, f"schedule '{name}' has no weight-gradient half to defer: no backward "
                       f"fragment of the loop splits into an activation-gradient and a "
                       f"weight-gradient part (its weights take no gradient, or every weight "
                       f"gradient is read by another stage's backward, as for stage weights "
                       f"sliced from one stacked array), so it runs {order}; give each stage "
                       f"its own weight arrays (a list or dict of per-stage parameters), or "
                       f"use schedule='1f1b'")


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class LoopInfo:
    op: ir.Operation
    body: ir.Operation
    num_microbatches: int
    calls: tuple[Call, ...]
    """The body's calls, microbatch None, linked by ``deps`` and ``carried``."""


def find_loop(module: ir.Module) -> ir.Operation | None:
    """The ``mm.microbatch_loop`` op of ``@main``, if any (at most one)."""
    main = c.main_func(module)
    loops = [o.operation for o in c.entry_block(main).operations
             if c.is_custom_call(o.operation, c.LOOP_TARGET)]
    if len(loops) > 1:
        raise DiagnosticError("only one microbatch loop per program is supported",
                              loops[1].location)
    return loops[0] if loops else None


def _callee(op: ir.Operation) -> str | None:
    if op.name == "func.call":
        return c.callee_of(op)
    if c.is_custom_call(op, c.FRAGMENT_CALL_TARGET):
        return ir.FlatSymbolRefAttr(op.attributes[c.FRAGMENT_ATTR]).value
    return None


def _fragment_attrs(module: ir.Module, name: str):
    """The op holding a fragment's attributes: its function, or its nested module."""
    for view in module.body.operations:
        op = view.operation
        if op.name in ("func.func", "builtin.module") and "sym_name" in op.attributes and \
                ir.StringAttr(op.attributes["sym_name"]).value == name:
            return op
    return None


def read_loop(module: ir.Module, loop: ir.Operation) -> LoopInfo:
    """The loop's body calls (before or after ``mm-extract-fragments``)."""
    funcs = {c.func_name(o.operation): o.operation for o in module.body.operations
             if o.operation.name == "func.func"}
    body, M = c.loop_body(loop, funcs)
    block = c.entry_block(body)
    ops = [o.operation for o in block.operations]
    ret = ops[-1]
    producer, calls_ops = _body_calls(ops[:-1])
    n_carry = len(ret.operands)  # arguments: the index, the running sums, the invariants
    tasks = c.read_tasks(module)
    carry_of_arg = {block.arguments[1 + j]: j for j in range(n_carry)}
    carry_producer = [producer.get(v) for v in ret.operands]
    accumulations = _accumulations(calls_ops, carry_of_arg, carry_producer)
    out = []
    for op, name in calls_ops:
        holder, task, split = _fragment_tag(module, op, name)
        deps: set[int] = set()
        carried: set[int] = set()
        for v in op.operands:
            src = _through_transfers(v)
            if src in producer:
                deps.add(producer[src])
            elif src in carry_of_arg and carry_of_arg[src] not in accumulations:
                carry = carry_producer[carry_of_arg[src]]
                if carry is not None:
                    carried.add(carry)
        info = tasks.get(task[0])
        out.append(Call(name, task[0], task[1], c.fragment_info(holder).devices, split=split,
                        deps=tuple(sorted(deps)), carried=tuple(sorted(carried)),
                        forward=info.forward if info is not None else None))
    return LoopInfo(loop, body, int(M), tuple(out))


def _accumulations(calls_ops, carry_of_arg, carry_producer) -> set[int]:
    """Running sums that only the call producing them reads: a fragment accumulating in
    place (``mm-form-microbatch-loop``). Their microbatches may run in any order (a sum
    is commutative; the runtime chains them in the schedule's order), so they add no
    dependency between microbatches."""
    readers: dict[int, set[int]] = {}
    for k, (op, _) in enumerate(calls_ops):
        for v in op.operands:
            src = _through_transfers(v)
            if src in carry_of_arg:
                readers.setdefault(carry_of_arg[src], set()).add(k)
    return {j for j, ks in readers.items() if carry_producer[j] is not None
            and ks == {carry_producer[j]}}


def _body_calls(ops: list[ir.Operation]) -> tuple[dict[ir.Value, int], list]:
    """The body's fragment calls ``(op, callee)`` in order, and which call (by position)
    makes each value, through transfers."""
    producer: dict[ir.Value, int] = {}
    calls_ops: list[tuple[ir.Operation, str]] = []
    for op in ops:
        name = _callee(op)
        if name is not None:
            for r in op.results:
                producer[r] = len(calls_ops)
            calls_ops.append((op, name))
        elif c.is_custom_call(op, c.TRANSFER_TARGET):
            src = op.operands[0]
            if src in producer:
                producer[op.results[0]] = producer[src]
        else:
            raise DiagnosticError(
                f"the microbatch loop body may hold only fragment calls and transfers, found "
                f"'{op.name}'", op.location)
    return producer, calls_ops


def _through_transfers(v: ir.Value) -> ir.Value:
    """The value a chain of transfers moves."""
    while not isinstance(v.owner, ir.Block) and \
            c.is_custom_call(v.owner.operation, c.TRANSFER_TARGET):
        v = v.owner.operation.operands[0]
    return v


def _fragment_tag(module: ir.Module, op: ir.Operation, name: str
                  ) -> tuple[ir.Operation, c.Tag, str | None]:
    """The op holding the fragment's attributes, its ``mm.task`` and its split, checked."""
    holder = _fragment_attrs(module, name)
    if holder is None:
        raise DiagnosticError(f"fragment call to unknown fragment @{name}", op.location)
    tag = c.tag_of(holder)
    if tag is None or c.DEVICES_ATTR not in holder.attributes:
        raise DiagnosticError(f"fragment @{name} needs 'mm.task' (name, transpose_count) "
                              f"and 'mm.devices'", op.location)
    split = None
    for h in (holder, op):
        split = ta.read_attr(h, SPLIT_ATTR, _SPLIT, f"fragment @{name} '{SPLIT_ATTR}'",
                             default=split)
    return holder, tag, split


_SPLIT = ta.one_of(*_SPLITS)


def loop_calls(info: LoopInfo) -> list[Call]:
    """The loop unrolled into schedule :class:`Call`\\ s, microbatch-major (unit
    ``m * S + k`` is body call ``k`` of microbatch ``m``)."""
    S = len(info.calls)
    out = []
    for m in range(info.num_microbatches):
        for cl in info.calls:
            deps = [m * S + d for d in cl.deps]
            if m > 0:
                deps += [(m - 1) * S + d for d in cl.carried]
            out.append(replace(cl, microbatch=m, deps=tuple(deps), carried=()))
    return out


def read_schedule(module: ir.Module) -> Schedule | None:
    """The schedule ``mm-schedule-fragments`` recorded on the module's loop, if any."""
    with module.context:
        if not any(op.operation.name == "func.func" for op in module.body.operations):
            return None
        loop = find_loop(module)
        if loop is None or SCHEDULE_ATTR not in loop.attributes:
            return None
        info = read_loop(module, loop)
        d = ir.DictAttr(loop.attributes[SCHEDULE_ATTR])
        name = ir.StringAttr(d["name"]).value
        pairs = list(ir.DenseI64ArrayAttr(d["order"]))
    units, devices = units_from_calls(loop_calls(info))
    S = len(info.calls)
    order = tuple(pairs[2 * j + 1] * S + pairs[2 * j] for j in range(len(pairs) // 2))
    return schedule_from_order(name, units, order, devices)


def schedule_from_order(name: str, units, order: Sequence[int], devices) -> Schedule:
    meshes = max((u.mesh for u in units), default=-1) + 1
    rows: list[list[int]] = [[] for _ in range(meshes)]
    for i in order:
        rows[units[i].mesh].append(i)
    return Schedule(name, tuple(units), tuple(tuple(r) for r in rows), tuple(order),
                    tuple(tuple(d) for d in devices))
