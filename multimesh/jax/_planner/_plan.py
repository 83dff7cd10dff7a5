"""``PipelinePlan``: the planner's answer, as rules, code, a table and JSON."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax import _registrations
from multimesh.jax._microbatch import REDUCTIONS, microbatch
from multimesh.jax._registrations import Context
from multimesh.jax._task import Task, TaskMesh
from multimesh.jax._task import with_sharding_constraint as wsc
from multimesh.schedules import ScheduleError, get_schedule

__all__ = ["PipelinePlan", "Stage", "StageComparison"]

# The name the generated code imports multimesh.jax as (the docs' convention).
_ALIAS = "mm"
DATA = "data"  # each stage's mesh axis for the batch rows (and fsdp's shards)
MODEL = "model"  # each stage's tensor-parallel axis, where the model names one
BATCH = "batch"  # the logical name of the batch rows, mapped onto DATA
FSDP = "fsdp"  # the logical name of a parameter's sharded dimension, mapped onto DATA


def _rows_spec(dim: int) -> Callable:
    """Per leaf: the spec putting dimension ``dim`` (the rows) on ``batch``."""
    return lambda x: PartitionSpec(*([None] * dim), BATCH) if len(x.shape) > dim \
        else PartitionSpec()


def _fsdp_spec(ways: int) -> Callable:
    """Per leaf: the spec sharding its largest dimension that ``ways`` divides."""
    def spec(x):
        dims = [k for k, n in enumerate(x.shape) if n % ways == 0 and n >= ways]
        if ways < 2 or not dims:
            return PartitionSpec()
        k = max(dims, key=lambda k: (x.shape[k], -k))
        return PartitionSpec(*([None] * k), FSDP)

    return spec


def _shard_code(argnum: int, dim: int, rows: bool, fsdp: bool, ways: int) -> list[str]:
    """``as_code``'s ``sharded(grad_fn)``: what :meth:`PipelinePlan.shard` does."""
    out = ["from jax.sharding import PartitionSpec as P", ""]
    if fsdp:
        out += ["def fsdp_spec(x):  # the largest dimension the stage's devices divide",
                f"    dims = [k for k, n in enumerate(x.shape) if n % {ways} == 0]",
                "    k = max(dims, key=lambda k: (x.shape[k], -k), default=None)",
                f"    return P() if k is None else P(*[None] * k, {FSDP!r})", ""]
    out += ["def sharded(grad_fn):", "    def step(*args):", "        args = list(args)"]
    if rows:
        none = "None, " * dim
        out += [f"        rows = jax.tree.map(lambda x: P({none}{BATCH!r}) if x.ndim > {dim} "
                f"else P(), args[{argnum}])",
                f"        args[{argnum}] = {_ALIAS}.with_sharding_constraint(args[{argnum}], rows)"]
    if fsdp:
        out += [f"        args[0] = {_ALIAS}.with_sharding_constraint(args[0], "
                f"jax.tree.map(fsdp_spec, args[0]))",
                "        loss, grads = grad_fn(*args)",
                f"        return loss, {_ALIAS}.with_sharding_constraint(grads, "
                f"jax.tree.map(fsdp_spec, grads))"]
    else:
        out.append("        return grad_fn(*args)")
    out += ["    return step"]
    return out


PLAN_FORMAT_VERSION = 2
"""The version of :meth:`PipelinePlan.to_json`'s format (2: ``reduction`` is written;
plans without a version summed their microbatches)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its units, its submesh and what the planner predicts for it.

    ``devices`` are device ids, ``positions`` their places in the program's device
    list (what ``TaskMesh`` takes). ``predicted_time`` is the stage's busy time in one
    step (all microbatches, forward and backward, transfers included);
    ``memory_bytes`` its predicted peak per device.
    """

    index: int
    units: tuple[str, ...]
    devices: tuple[int, ...]
    positions: tuple[int, ...]
    matcher: str
    flops: float
    predicted_time: float
    param_bytes: int
    residual_bytes: int
    live_microbatches: int
    memory_bytes: float
    device_flops: float = 0.0
    """Flops one device of the stage runs in a step (``flops`` divided over the
    devices each microbatch's rows split over)."""

    @property
    def task_name(self) -> str:
        return f"stage{self.index}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _raw(pattern: str) -> str:
    """``pattern`` as a raw string literal (``repr`` would double its backslashes)."""
    return f'r"{pattern}"' if '"' not in pattern and not pattern.endswith("\\") else repr(pattern)


def _units_text(units: Sequence[str]) -> str:
    return units[0] if len(units) == 1 else f"{units[0]} .. {units[-1]} ({len(units)})"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Stage cuts, submeshes, microbatches and schedule chosen from a model's costs.

    ``with plan:`` (or ``plan.apply()``) registers one ``register_task`` rule per
    stage, exactly what :meth:`as_code` prints; ``plan.microbatch(grad_fn)`` wraps a
    gradient function with the plan's microbatches and schedule.
    """

    stages: tuple[Stage, ...]
    num_microbatches: int
    schedule: str
    predicted_step_time: float
    batch: tuple[int, int, int]  # (argnum, dim, rows) of the example batch
    units: tuple[dict, ...]  # per unit: name, fwd_flops, bwd_flops, bytes, params, residuals
    cut_bytes: tuple[int, ...]
    assumptions: Mapping[str, Any]
    logical_axes: tuple[tuple[str, str], ...] = ()
    """Each stage's ``(logical name, "x")`` pairs: how logical axes map onto the one
    axis ``x`` of its submesh (empty: identity, so unnamed work is replicated)."""
    interleave: int = 1
    """Stages per submesh (round-robin, or a V for a V-shape schedule; each stage's
    ``devices`` say where it runs)."""
    reduction: str = "mean"
    """How :meth:`microbatch` combines the microbatches' loss and gradients: ``"mean"``
    (the full batch's, for a loss that averages over its batch, as
    ``parallelize_step``) or ``"sum"`` (gradient accumulation)."""
    batch_sharded: bool = False
    """Each microbatch's rows split over every stage's ``data`` axis (its devices)."""
    fsdp: bool = False
    """Parameters (and their gradients) sharded over every stage's ``data`` axis."""
    mesh_axes: tuple[tuple[str, int], ...] = ()
    """Each stage's mesh axes, ``(name, size)``, for a model typed over an explicit
    mesh (jax's sharding in types): its own axes, over fewer devices; empty: the one
    axis ``data`` over the stage's devices."""
    tensor: int | None = None
    """Each stage's ``model`` axis size (tensor parallelism), beside ``data`` over the
    rest; None: the model's shardings name no ``model`` axis, so the stages have none."""
    _contexts: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        _check_layout(self)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def microbatch_size(self) -> int:
        return self.batch[2] // self.num_microbatches

    # ------------------------------------------------------------------ rules

    def _logical(self) -> tuple[tuple[str, str], ...]:
        """Each stage's logical axes: the plan's own (``batch`` and ``fsdp`` onto the
        stage's ``data`` axis) and the user's."""
        own = tuple((n, DATA) for n, on in ((BATCH, self.batch_sharded), (FSDP, self.fsdp)) if on)
        return own + tuple(p for p in self.logical_axes if p not in own)

    def _axes(self, st: Stage) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """A stage's mesh axes: the explicit model's, or ``data`` over its devices
        (and ``model`` over ``tensor`` of them, the minor axis: neighbours)."""
        if self.mesh_axes:
            return tuple(n for n, _ in self.mesh_axes), tuple(k for _, k in self.mesh_axes)
        if self.tensor is not None:
            return (DATA, MODEL), (len(st.positions) // self.tensor, self.tensor)
        return (DATA,), (len(st.positions),)

    def _data_ways(self) -> int:  # a stage's ``data`` axis: its rows' and fsdp's split
        return len(self.stages[0].devices) // (self.tensor or 1)

    def _rules(self):
        logical = self._logical() or None
        for st in self.stages:
            names, sizes = self._axes(st)
            mesh = TaskMesh(devices=st.positions, axis_names=names, axis_sizes=sizes)
            yield st.matcher, Task(name=st.task_name, mesh=mesh, logical_axes=logical)

    def register(self, context=None) -> None:
        """Register the plan's rules in ``context`` (default: the module-level one)."""
        for matcher, task in self._rules():
            if context is None:
                _registrations.register_task(matcher, task=task)
            else:
                context.register_task(matcher, task=task)

    def apply(self) -> None:
        """Register the plan's tasks for every program compiled from now on, as
        ``register_task`` calls at the top level would (``clear_tasks()`` undoes it)."""
        self.register()

    def __enter__(self) -> PipelinePlan:
        ctx = Context()
        self.register(ctx)
        ctx.__enter__()
        self._contexts.append(ctx)
        return self

    def __exit__(self, *exc) -> bool:
        if not self._contexts:
            raise MultimeshValueError(
                "PipelinePlan.__exit__ was called without a matching __enter__; use the "
                "plan in a `with` statement.")
        return bool(self._contexts.pop().__exit__(*exc))

    def shard(self, fun: Callable) -> Callable:
        """``fun`` (``grad_fn(params, ..., batch, ...)``) with its batch rows pinned to
        each stage's ``data`` axis and, for an fsdp plan, its parameters and returned
        gradients sharded over it (multimesh's logical ``with_sharding_constraint``)."""
        _check_step_function(fun, "shard")
        argnum, dim, _ = self.batch
        if not (self.batch_sharded or self.fsdp):
            return fun
        rows, spread = _rows_spec(dim), _fsdp_spec(self._data_ways())

        @functools.wraps(fun)  # messages name the user's function, not this wrapper
        def sharded(*args):
            given = list(args)
            if self.batch_sharded:
                given[argnum] = wsc(given[argnum], jax.tree.map(rows, given[argnum]))
            if self.fsdp:
                given[0] = wsc(given[0], jax.tree.map(spread, given[0]))
            out = fun(*given)
            if self.fsdp and isinstance(out, tuple) and len(out) == 2:
                out = (out[0], wsc(out[1], jax.tree.map(spread, out[1])))
            return out

        return sharded

    def microbatch(self, fun: Callable) -> Callable:
        """``fun`` (a gradient function) over the plan's microbatches and schedule, its
        batch (and parameters) sharded as :meth:`shard` says and its outputs combined by
        the plan's ``reduction``."""
        _check_step_function(fun, "microbatch")
        argnum, dim, _ = self.batch
        if self.num_microbatches == 1:  # nothing to order or combine: one call of the step
            return self.shard(fun)
        return microbatch(self.shard(fun), dim=dim, size=self.microbatch_size, argnum=argnum,
                          schedule=self.schedule, interleave=self._interleave_option(),
                          reduction=self.reduction)

    def _interleave_option(self) -> int | None:
        """``microbatch``'s ``interleave``: round-robin plans only (a V-shape schedule
        knows its two stages per submesh)."""
        v_shape = get_schedule(self.schedule).placement == "v-shape"
        return self.interleave if self.interleave > 1 and not v_shape else None

    def as_code(self) -> str:
        """The rules and the microbatch call a user would write by hand, each rule
        under a comment naming its units and devices."""
        return _plan_code(self)

    # ------------------------------------------------------------------ reporting

    def __str__(self) -> str:
        M = self.num_microbatches
        head = (f"PipelinePlan: {self.num_stages} stages, {M} "
                f"{'microbatches' if M > 1 else 'microbatch (no pipeline: see microbatches)'}"
                f", schedule {self.schedule!r}"
                f"{f' ({self.interleave} stages per submesh)' if self.interleave > 1 else ''}"
                f", predicted step "
                f"{self.predicted_step_time * 1e3:.3f} ms")
        rows = [("stage", "units", "devices", "layout", "GFLOP", "time (ms)", "params",
                 "memory")]
        for st in self.stages:
            rows.append((str(st.index), _units_text(st.units),
                         ",".join(str(d) for d in st.devices), self.layout(),
                         f"{st.flops / 1e9:.4f}",
                         f"{st.predicted_time * 1e3:.3f}", _fmt_bytes(st.param_bytes),
                         _fmt_bytes(st.memory_bytes)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        notes = [f"  {k}: {v}" for k, v in self.assumptions.items()]
        return "\n".join([head, *table, "assumptions:", *notes])

    def layout(self) -> str:
        """Each stage's layout in words: ``data=4`` (rows over 4 devices), ``+fsdp``
        (parameters too), ``replicated`` (one device, or rows that do not divide),
        ``model=2`` (tensor parallelism over 2 devices, beside the rest)."""
        return _layout_text(self)

    def __repr__(self) -> str:
        return (f"PipelinePlan(stages={[list(s.units) for s in self.stages]}, "
                f"num_microbatches={self.num_microbatches}, schedule={self.schedule!r})")

    def to_json(self) -> str:
        """The whole plan as JSON; :meth:`from_json` reads it back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if not f.name.startswith("_")}
        d["stages"] = [dataclasses.asdict(s) for s in self.stages]
        d["assumptions"] = dict(self.assumptions)
        d["format_version"] = PLAN_FORMAT_VERSION
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> PipelinePlan:
        """The plan :meth:`to_json` wrote; every field is checked, and the format
        version must be this multimesh's (:data:`PLAN_FORMAT_VERSION`)."""
        return cls(**_plan_fields(text))

    def compare(self, profile) -> StageComparison:
        """Predicted against measured busy time per stage.

        ``profile``: a compiled program after ``compiled.profile(...)``, a
        :class:`~multimesh.jax.StepProfile` (``compiled.step_profile(...)``: the mean
        of several steps), a ``TraceRecorder``, or the Perfetto trace JSON that
        ``compiled.profile(..., trace_path=)`` wrote (a path or the loaded dict).
        Measured time is the stage's submesh's busy time in the microbatch loop (from a
        trace: the sum of its fragment slices); each call is timed alone, so it
        includes dispatch. An interleaved plan has one row per submesh, named by its
        first stage, predicting the sum of its stages.
        """
        steps = getattr(profile, "last_profile", None) or profile
        if hasattr(steps, "busy") and hasattr(steps, "schedule"):
            busy = _busy_per_mesh(steps, self.stages)
        else:
            busy = _busy_per_submesh(_events(profile))
        rows: dict[tuple[int, ...], list] = {}  # per submesh: first stage, predicted
        for st in self.stages:
            key = tuple(sorted(st.devices))
            got = busy.get(key)
            if got is None:
                raise MultimeshValueError(
                    f"The profile has no track for stage {st.index}'s submesh (devices "
                    f"{list(st.devices)}); tracks seen: {sorted(busy)}. Profile the program "
                    f"compiled under this plan.")
            row = rows.setdefault(key, [st.index, 0.0, got])
            row[1] += st.predicted_time  # an interleaved submesh runs several stages
        return StageComparison(tuple((int(i), float(p), float(m)) for i, p, m in rows.values()))


def _layout_text(plan: PipelinePlan) -> str:
    """:meth:`PipelinePlan.layout`'s text."""
    ways = plan._data_ways()
    if plan.mesh_axes:  # the model's own shardings, on each stage's share of its mesh
        return "explicit " + ",".join(f"{n}={k}" for n, k in plan.mesh_axes)
    if not plan.batch_sharded:
        out = "replicated" if not plan.fsdp else f"fsdp={ways}"
    else:
        out = f"data={ways}" + ("+fsdp" if plan.fsdp else "")
    if plan.tensor is None:
        return out
    return f"model={plan.tensor}" if out == "replicated" else f"{out},model={plan.tensor}"


def _plan_code(plan: PipelinePlan) -> str:
    """:meth:`PipelinePlan.as_code`'s text."""
    lines = ["import jax", f"import multimesh.jax as {_ALIAS}", ""]
    if plan.tensor is not None:
        lines += [f"# each stage's {MODEL!r} axis splits what the model's own shardings put "
                  f"on it: compile", "# under the same flax rules (or NNX metadata) "
                  "it was planned with", ""]
    logical = plan._logical()
    for st in plan.stages:
        lines += [f"# stage {st.index}: {', '.join(st.units)} on devices "
                  f"{', '.join(map(str, st.devices))} (positions {st.positions[0]}.."
                  f"{st.positions[-1]})",
                  f"{_ALIAS}.register_task(",
                  f"    {_raw(st.matcher)},",
                  f"    task={_ALIAS}.Task(",
                  f"        name={st.task_name!r},",
                  f"        mesh={_ALIAS}.TaskMesh(devices={st.positions!r}, "
                  f"axis_names={plan._axes(st)[0]!r}, axis_sizes={plan._axes(st)[1]!r}),"]
        if logical:
            lines.append(f"        logical_axes={logical!r},")
        lines[-1] = lines[-1].rstrip(",") + "))"
    argnum, dim, _ = plan.batch
    grad = "jax.value_and_grad(loss)"
    if plan.batch_sharded or plan.fsdp:
        lines += ["", *_shard_code(argnum, dim, plan.batch_sharded, plan.fsdp,
                                   plan._data_ways())]
        grad = f"sharded({grad})"
    piped = plan.num_microbatches > 1
    lines += ["", f"# {plan.num_microbatches} microbatch(es) of {plan.microbatch_size} "
                  f"rows, {'schedule ' + repr(plan.schedule) if piped else 'no pipeline'}"
                  f", the microbatches' {plan.reduction}",
              f"step = {_ALIAS}.microbatch({grad}, dim={dim}, "
              f"size={plan.microbatch_size}, argnum={argnum}, "
              + (f"schedule={plan.schedule!r}, " if piped else "")
              + (f"interleave={plan._interleave_option()}, "
                 if piped and plan._interleave_option() else "")
              + f"reduction={plan.reduction!r})"]
    return "\n".join(lines) + "\n"


def _check_step_function(fun, method: str) -> None:
    if not callable(fun):
        raise MultimeshTypeError(
            f"`PipelinePlan.{method}` takes the step's gradient function (such as "
            f"`jax.value_and_grad(loss)`), got {type(fun).__name__} {fun!r}.")


def _json_error(what: str, want: str, got) -> MultimeshValueError:
    return MultimeshValueError(
        f"`PipelinePlan.from_json`: {what} must be {want}, got {got!r}. Load the JSON "
        f"that `plan.to_json()` wrote, unedited, or plan again.")


def _count(v, what: str, low: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _json_error(what, "a positive integer" if low else "a non-negative integer", v)
    return v


def _number(v, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise _json_error(what, "a finite non-negative number", v)
    return float(v)


def _ints(v, what: str, empty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or (not v and not empty):
        raise _json_error(what, "a list of non-negative integers", v)
    return tuple(_count(x, f"each of {what}") for x in v)


def _stage_fields(k: int, d) -> Stage:
    names = [f.name for f in dataclasses.fields(Stage)]
    if not isinstance(d, dict) or sorted(d) != sorted(names):
        raise _json_error(f"stage {k}", f"an object with the keys {names}",
                          sorted(d) if isinstance(d, dict) else d)
    if d["index"] != k:
        raise _json_error(f"stage {k}'s `index`", str(k), d["index"])
    units = d["units"]
    if not isinstance(units, list) or not units or not all(isinstance(u, str) for u in units):
        raise _json_error(f"stage {k}'s `units`", "a non-empty list of unit names", units)
    devices, positions = (_ints(d[n], f"stage {k}'s `{n}`") for n in ("devices", "positions"))
    if len(devices) != len(positions):
        raise _json_error(f"stage {k}'s `positions`", f"{len(devices)} positions, one per "
                          f"device of {list(devices)}", list(positions))
    if not isinstance(d["matcher"], str):
        raise _json_error(f"stage {k}'s `matcher`", "a regular expression (a string)",
                          d["matcher"])
    return Stage(index=k, units=tuple(units), devices=devices, positions=positions,
                 matcher=d["matcher"], flops=_number(d["flops"], f"stage {k}'s `flops`"),
                 predicted_time=_number(d["predicted_time"], f"stage {k}'s `predicted_time`"),
                 memory_bytes=_number(d["memory_bytes"], f"stage {k}'s `memory_bytes`"),
                 device_flops=_number(d["device_flops"], f"stage {k}'s `device_flops`"),
                 **{n: _count(d[n], f"stage {k}'s `{n}`")
                    for n in ("param_bytes", "residual_bytes", "live_microbatches")})


def _plan_document(text) -> dict:
    if not isinstance(text, (str, bytes, bytearray)):
        raise MultimeshTypeError(
            f"`PipelinePlan.from_json` takes the JSON text `plan.to_json()` wrote, got "
            f"{type(text).__name__}.")
    try:
        d = json.loads(text)
    except ValueError as e:
        raise MultimeshValueError(f"`PipelinePlan.from_json`: the text is not JSON ({e}).") \
            from None
    if not isinstance(d, dict):
        raise _json_error("the document", "a JSON object (what `plan.to_json()` writes)",
                          type(d).__name__)
    version = d.pop("format_version", None)
    if version != PLAN_FORMAT_VERSION:
        raise MultimeshValueError(
            f"`PipelinePlan.from_json`: the plan's format_version is {version!r}, but this "
            f"multimesh reads version {PLAN_FORMAT_VERSION}"
            f"{' (a plan written before versions, whose microbatches summed)' if version is None else ''}"
            f". Plan again with `plan_pipeline` and save `plan.to_json()`.")
    names = {f.name for f in dataclasses.fields(PipelinePlan) if not f.name.startswith("_")}
    d.setdefault("mesh_axes", [])  # a plan written before explicit-mode stages
    d.setdefault("tensor", None)  # a plan written before tensor parallelism
    if set(d) != names:
        raise _json_error("the plan's keys", f"{sorted(names)} and 'format_version'",
                          sorted(d))
    return d


def _plan_fields(text) -> dict[str, Any]:
    """``PipelinePlan``'s constructor arguments from its JSON, every field checked."""
    d = _plan_document(text)
    if not isinstance(d["stages"], list) or not d["stages"]:
        raise _json_error("`stages`", "a non-empty list", d["stages"])
    stages = tuple(_stage_fields(k, s) for k, s in enumerate(d["stages"]))
    batch, M = d["batch"], _count(d["num_microbatches"], "`num_microbatches`", 1)
    if not (isinstance(batch, list) and len(batch) == 3
            and all(isinstance(b, int) and not isinstance(b, bool) for b in batch)
            and batch[1] >= 0 and batch[2] >= 1) or batch[2] % M:
        raise _json_error("`batch`", f"[argnum, dim, rows] with rows divisible by "
                          f"num_microbatches={M}", d["batch"])
    try:
        schedule = get_schedule(d["schedule"]).name if isinstance(d["schedule"], str) else None
    except ScheduleError:
        schedule = None
    if schedule is None:
        raise _json_error("`schedule`", "a registered schedule's name", d["schedule"])
    interleave = _count(d["interleave"], "`interleave`", 1)
    if len(stages) % interleave:
        raise _json_error("`interleave`", f"a divisor of the {len(stages)} stages", interleave)
    _check_submeshes(stages, interleave)
    _equal_stages(stages, "`PipelinePlan.from_json`")
    _check_devices_here(stages)
    if d["reduction"] not in REDUCTIONS:
        raise _json_error("`reduction`", f"one of {list(REDUCTIONS)}", d["reduction"])
    axes = d["logical_axes"]
    if not isinstance(axes, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(a, str) for a in p)
            for p in axes):
        raise _json_error("`logical_axes`", "a list of [logical name, axis] pairs", axes)
    if not isinstance(d["units"], list) or not all(isinstance(u, dict) for u in d["units"]):
        raise _json_error("`units`", "a list of objects", d["units"])
    if not isinstance(d["assumptions"], dict):
        raise _json_error("`assumptions`", "an object", d["assumptions"])
    return dict(stages=stages, num_microbatches=M, schedule=schedule,
                predicted_step_time=_number(d["predicted_step_time"], "`predicted_step_time`"),
                batch=(batch[0], batch[1], batch[2]), units=tuple(d["units"]),
                cut_bytes=_ints(d["cut_bytes"], "`cut_bytes`", empty=True),
                assumptions=d["assumptions"], logical_axes=tuple(tuple(p) for p in axes),
                interleave=interleave, reduction=d["reduction"],
                batch_sharded=_flag(d["batch_sharded"], "`batch_sharded`"),
                fsdp=_flag(d["fsdp"], "`fsdp`"), mesh_axes=_mesh_axes(d["mesh_axes"], stages),
                tensor=_tensor(d["tensor"], stages))


def _tensor(v, stages) -> int | None:
    """The ``model`` axis size: null, or a positive integer dividing a stage's devices."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1
                          or len(stages[0].devices) % v):
        raise _json_error("`tensor`", f"null (no `model` axis) or a divisor of the "
                          f"{len(stages[0].devices)} devices of a stage", v)
    return v


def _equal_stages(stages, who: str) -> None:
    """Every stage has as many devices: the plan's submeshes share their axes."""
    sizes = [len(st.devices) for st in stages]
    if len(set(sizes)) > 1:
        raise MultimeshValueError(
            f"{who}: the stages have {', '.join(map(str, sizes[:-1]))} and {sizes[-1]} "
            f"devices; every stage of a plan has the same number, over the same mesh axes "
            f"(a plan edited by hand, e.g. in its JSON, must keep them equal). Plan again "
            f"with `plan_pipeline`.")


def _check_layout(plan: PipelinePlan) -> None:
    """Every stage has as many devices (its submesh's axes are the plan's), and every
    logical axis the plan maps names one of those axes."""
    if not plan.stages:
        return
    _equal_stages(plan.stages, "PipelinePlan")
    sizes = [len(st.devices) for st in plan.stages]
    names, axes = plan._axes(plan.stages[0])
    if plan.tensor is not None and not plan.mesh_axes and sizes[0] % plan.tensor:
        raise MultimeshValueError(
            f"PipelinePlan: tensor={plan.tensor} does not divide the {sizes[0]} devices of a "
            f"stage; the `model` axis must divide them.")
    bad = [(n, a) for n, a in plan.logical_axes if a not in names]
    if bad:
        n, a = bad[0]
        why = ("the planner gives stages a `model` axis only where the model's own "
               "shardings name it (flax's logical rules, NNX partition metadata, jax "
               "sharding constraints)" if a == MODEL and plan.tensor is None and not plan.mesh_axes
               else "a logical axis maps onto one of the stage's mesh axes")
        raise MultimeshValueError(
            f"PipelinePlan: logical_axes maps {n!r} onto the mesh axis {a!r}, but the plan's "
            f"stages have only the axes {names} (sizes {axes}); {why}. Map it onto one of "
            f"{list(names)}, or drop the pair.")


def _mesh_axes(v, stages) -> tuple[tuple[str, int], ...]:
    """The explicit model's stage axes: ``[name, size]`` pairs whose sizes multiply to
    each stage's devices."""
    ok = isinstance(v, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
        and isinstance(p[1], int) and not isinstance(p[1], bool) and p[1] >= 1 for p in v)
    if not ok or (v and math.prod(p[1] for p in v) != len(stages[0].devices)):
        raise _json_error("`mesh_axes`", f"a list of [axis name, size] pairs whose sizes "
                          f"multiply to the {len(stages[0].devices)} devices of a stage, or "
                          f"[]", v)
    return tuple((p[0], p[1]) for p in v)


def _check_submeshes(stages: tuple[Stage, ...], interleave: int) -> None:
    """Stages share a submesh only as the plan's interleave says: the stages' device
    sets (and position sets) are equal or disjoint, ``len(stages) / interleave`` of them."""
    want = len(stages) // interleave
    for field in ("devices", "positions"):
        sets = list(dict.fromkeys(frozenset(getattr(st, field)) for st in stages))
        clash = next(((a, b) for i, a in enumerate(sets) for b in sets[i + 1:] if a & b), None)
        if clash is not None or len(sets) != want:
            got = [sorted(getattr(st, field)) for st in stages]
            raise _json_error(f"the stages' `{field}`", f"{want} disjoint submesh(es) for "
                              f"{len(stages)} stage(s) at interleave={interleave}", got)


def _check_devices_here(stages: tuple[Stage, ...]) -> None:
    """A plan runs on the devices it names: each must be one of this process's, and each
    position a place in a device list this long."""
    here = sorted(d.id for d in jax.devices())
    named = sorted({i for st in stages for i in st.devices})
    missing = [i for i in named if i not in here]
    far = max(p for st in stages for p in st.positions)
    if missing or far >= len(here):
        what = (f"devices {missing}, which this process does not have" if missing
                else f"device position {far}, past the {len(here)} devices here")
        raise MultimeshValueError(
            f"`PipelinePlan.from_json`: the plan places its stages on {what} (its devices "
            f"are {here}). A plan is made for the devices it runs on: load it where they "
            f"are, or plan again here with `plan_pipeline`.")


def _flag(v, what: str) -> bool:
    if not isinstance(v, bool):
        raise _json_error(what, "true or false", v)
    return v


@dataclasses.dataclass(frozen=True)
class StageComparison:
    """Per stage: (index, predicted seconds, measured seconds)."""

    rows: tuple[tuple[int, float, float], ...]

    @property
    def ratios(self) -> tuple[float, ...]:
        """measured / predicted per stage."""
        return tuple(m / p if p else float("inf") for _, p, m in self.rows)

    def __str__(self) -> str:
        lines = ["stage  predicted (ms)  measured (ms)  measured/predicted"]
        for (i, p, m), r in zip(self.rows, self.ratios):
            lines.append(f"{i:<5}  {p * 1e3:>14.3f}  {m * 1e3:>13.3f}  {r:>18.2f}")
        return "\n".join(lines)


_TRACK = re.compile(r"devices ([\d,\s]+)")


def _events(profile) -> list[tuple[str, str, float, float, str]]:
    """(track, name, start, end, category) of every slice in ``profile``."""
    rec = getattr(profile, "last_trace", profile)
    if hasattr(rec, "events") and isinstance(rec.events, list):
        return [(str(e[0]), str(e[1]), float(e[2]), float(e[3]),
                 str((e[4] if len(e) == 5 else {}).get("cat", "fragment"))) for e in rec.events]
    if isinstance(rec, (str, os.PathLike)):
        try:
            with open(rec, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError) as e:
            raise MultimeshValueError(
                f"`PipelinePlan.compare` cannot read the trace {os.fspath(rec)!r} "
                f"({getattr(e, 'strerror', None) or e}): give the path of the Perfetto JSON "
                f"that `compiled.profile(..., trace_path=)` wrote, the loaded dict, or a "
                f"profiled program or StepProfile.") from None
    if isinstance(rec, Mapping) and "traceEvents" in rec:
        names = {e["tid"]: e["args"]["name"] for e in rec["traceEvents"]
                 if e.get("name") == "thread_name"}
        return [(names.get(e["tid"], ""), e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6,
                 e.get("cat", "fragment")) for e in rec["traceEvents"] if e.get("ph") == "X"]
    raise MultimeshTypeError(
        f"`PipelinePlan.compare` takes a compiled program after `compiled.profile(...)`, "
        f"a TraceRecorder or a Perfetto trace (path or dict), got {type(profile).__name__}.")


def _busy_per_mesh(steps, stages) -> dict[tuple[int, ...], float]:
    """A ``StepProfile``'s busy seconds per submesh, keyed by the stages' device ids
    (its schedule names submeshes by device positions)."""
    ids = {tuple(sorted(st.positions)): tuple(sorted(st.devices)) for st in stages}
    out = {}
    for m, where in enumerate(steps.schedule.devices):
        key = tuple(sorted(int(p) for p in where))
        out[ids.get(key, key)] = float(steps.busy(m))
    return out


def _busy_per_submesh(events) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    for track, name, start, end, cat in events:
        m = _TRACK.search(track)
        if m is None or cat != "fragment" or name.startswith("transfer"):
            continue
        key = tuple(sorted(int(x) for x in re.findall(r"\d+", m.group(1))))
        out[key] = out.get(key, 0.0) + (end - start)
    return out
