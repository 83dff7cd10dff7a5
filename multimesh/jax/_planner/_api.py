"""``plan_pipeline``: trace the step once, cost its units, search, return a plan."""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from multimesh._src.caches import LRUCache
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._analysis.costs import DeviceModel
from multimesh.jax._implicit_tasks import _policy_name
from multimesh.jax._microbatch import check_reduction
from multimesh.jax._planner._plan import PipelinePlan, Stage
from multimesh.jax._planner._search import Choice, Costs, Limits, mesh_of, search
from multimesh.jax._planner._tensor import (
    TensorTables,
    _rules,
    check_axes,
    check_tensor,
    tensor_sizes,
    tensor_tables,
)
from multimesh.jax._planner._units import Profile, Timer, measure_units, unit_matcher
from multimesh.jax._task import check_pairs
from multimesh.schedules import ScheduleError, all_schedules, get_schedule

__all__ = ["plan_pipeline"]

SCHEDULES = tuple(sorted((a.name for a in all_schedules() if a.interleave == 1
                          and a.has_textbook and a.placement in (None, "contiguous")),
                         key=lambda n: get_schedule(n).splits_backward))
"""The schedules the planner chooses among (contiguous stages, one per submesh), the
simpler first: on a tie the earlier wins. Registry order, those that split the
backward last."""

INTERLEAVED = tuple(a.name for a in all_schedules() if a.interleave > 1)
"""Schedules with several stages per submesh, planned when named (round-robin: stage
k on submesh k % P; V-shape: down the submeshes and back up), not chosen by default."""

COST_SOURCES = ("xla", "profile")
"""Where unit costs come from: XLA's cost analysis, or a short profile of each unit."""

DEVICE_MODELS = ("default", "calibrate")
"""``device_model=`` by name: the documented defaults of ``DeviceModel.for_device``, or
``DeviceModel.calibrate`` (measured on the devices, cached per device kind)."""


def _positive(value, name: str, kind=numbers.Real):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, kind) or not 0 < value < math.inf:
        raise MultimeshValueError(
            f"`plan_pipeline`: `{name}` must be a positive "
            f"{'integer' if kind is numbers.Integral else 'number'} or None, got {value!r}.")
    return value


def _non_negative(value, name: str, unit: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not 0 <= float(value) < math.inf):
        raise MultimeshValueError(
            f"`plan_pipeline`: `{name}` must be a finite number >= 0 ({unit}), got {value!r}.")


def _devices(devices) -> list:
    """``devices`` (default ``jax.devices()``) checked: jax devices, each once."""
    if devices is None:
        return list(jax.devices())
    if isinstance(devices, (str, bytes)) or not isinstance(devices, Iterable):
        raise MultimeshTypeError(
            f"`plan_pipeline`: `devices` must be a list of jax devices, got "
            f"{type(devices).__name__}.")
    devices = list(devices)
    if not devices:
        raise MultimeshValueError(
            "`plan_pipeline` got devices=[]; a pipeline needs at least two devices (leave "
            "`devices` unset for all of `jax.devices()`).")
    bad = [d for d in devices if not isinstance(d, jax.Device)]
    if bad:
        raise MultimeshTypeError(
            f"`plan_pipeline`: `devices` must be jax devices (e.g. `jax.devices()[4:]`), got "
            f"{bad[0]!r} ({type(bad[0]).__name__}); the plan's rules give device positions "
            f"in this list themselves.")
    ids = [d.id for d in devices]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise MultimeshValueError(
            f"`plan_pipeline`: `devices` lists device(s) {twice} more than once; each stage "
            f"needs devices of its own, so list each device once.")
    return devices


def _unjitted(fun):
    """The function inside ``jax.jit(fun)``: the planner reads the name stack of the
    step's own operations, which a jitted loss hides in one call."""
    inner = getattr(fun, "__wrapped__", None)
    if callable(inner) and hasattr(fun, "lower") and hasattr(fun, "trace"):
        return _unjitted(inner)
    return fun


def _fsdp_choices(fsdp) -> tuple[bool, ...]:
    if fsdp is not None and not isinstance(fsdp, (bool, np.bool_)):
        raise MultimeshTypeError(
            f"`plan_pipeline`: `fsdp` must be True (shard each stage's parameters over its "
            f"devices), False or None (the planner chooses), got {type(fsdp).__name__} "
            f"{fsdp!r}.")
    return (False, True) if fsdp is None else (bool(fsdp),)


def _batch_rows(args, argnum: int, dim: int) -> int:
    if not -len(args) <= argnum < len(args):
        raise MultimeshValueError(
            f"`plan_pipeline`: `argnum={argnum}` names no example argument; it got "
            f"{len(args)} (the batch is usually argument 1, after the parameters).")
    shapes = [np.shape(x) for x in jax.tree.leaves(args[argnum])]
    rows = {int(sh[dim]) for sh in shapes if len(sh) > dim}
    if not rows or 0 in rows:
        raise MultimeshValueError(
            f"`plan_pipeline` cuts the batch (argument {argnum}) along dimension {dim}, but "
            f"it has {'no rows there' if rows else 'no array with that dimension'} "
            f"({jax.tree.map(lambda x: getattr(x, 'shape', x), args[argnum])}); give an "
            f"example batch of at least one row, and `argnum`/`dim` that name it.")
    if len(rows) != 1:
        raise MultimeshValueError(
            f"`plan_pipeline` cuts the batch (argument {argnum}) along dimension {dim}, but "
            f"its leaves have sizes {sorted(rows)} there; give `argnum`/`dim` of one batch.")
    return rows.pop()


def _stage_counts(num_stages, n_devices: int) -> list[int]:
    if num_stages is None:
        if n_devices < 2:
            raise MultimeshValueError(
                f"`plan_pipeline` got {n_devices} device; a pipeline needs at least two "
                f"(pass `devices=`, or run with more).")
        # one stage: data parallelism over every device
        return [s for s in range(1, n_devices + 1) if n_devices % s == 0]
    _positive(num_stages, "num_stages", numbers.Integral)
    if n_devices % num_stages:
        raise MultimeshValueError(
            f"`plan_pipeline`: num_stages={num_stages} does not divide the {n_devices} "
            f"devices; every stage gets the same number of devices, so choose one of "
            f"{[s for s in range(1, n_devices + 1) if n_devices % s == 0]}.")
    return [int(num_stages)]


def _fitting(stages: list[int], names: Sequence[str], asked) -> list[int]:
    """The stage counts that leave every stage at least one unit."""
    fit = [s for s in stages if s <= len(names)]
    if not fit:
        raise MultimeshValueError(
            f"`plan_pipeline`: {'num_stages=' + str(asked) if asked else 'the devices'} "
            f"ask for at least {min(stages) if stages else 2} stages, but the step has only "
            f"{len(names)} units ({', '.join(names)}) and a stage holds at least one. "
            f"Ask for fewer stages, or name the model's parts more finely.")
    return fit


def _microbatch_counts(num_microbatches, rows: int) -> list[int]:
    if num_microbatches is None:
        return [m for m in range(1, min(rows, 64) + 1) if rows % m == 0]
    _positive(num_microbatches, "num_microbatches", numbers.Integral)
    if rows % num_microbatches:
        raise MultimeshValueError(
            f"`plan_pipeline`: num_microbatches={num_microbatches} does not divide the "
            f"batch of {rows} rows.")
    return [int(num_microbatches)]


def _schedules(schedule) -> tuple[str, ...]:
    """The candidate schedules: all the planner models, or the one(s) the user names."""
    if schedule is None:
        return SCHEDULES
    if not isinstance(schedule, str) and not (
            isinstance(schedule, Sequence) and all(isinstance(n, str) for n in schedule)):
        raise MultimeshTypeError(
            f"`plan_pipeline`: schedule={schedule!r} is not a schedule's name; give one of "
            f"{list(SCHEDULES + INTERLEAVED)}, a sequence of them, or None (choose among "
            f"{list(SCHEDULES)}).")
    names = (schedule,) if isinstance(schedule, str) else tuple(schedule)
    out = []
    for name in names:
        try:
            algo = get_schedule(name)
        except ScheduleError as e:
            raise MultimeshValueError(f"`plan_pipeline`: {e}.") from None
        if algo.name not in SCHEDULES + INTERLEAVED:
            raise MultimeshValueError(
                f"`plan_pipeline`: schedule={name!r} is not one the planner can model: it "
                f"has no textbook order to model. Valid choices are "
                f"{list(SCHEDULES + INTERLEAVED)}, a sequence of them, or None (choose "
                f"among {list(SCHEDULES)}).")
        out.append(algo.name)
    if not out:
        raise MultimeshValueError(
            f"`plan_pipeline` got schedule={schedule!r}, an empty choice; name at least "
            f"one of {list(SCHEDULES)}, or None (choose).")
    return tuple(sorted(set(out), key=(SCHEDULES + INTERLEAVED).index))  # ties: simpler


def _check_placeable(names, stages, n_devices: int, n_units: int) -> None:
    """Named schedules with several stages per submesh need stage counts that give
    them at least two submeshes; say so when none of the candidates does."""
    need = {n: get_schedule(n).interleave for n in names}
    if any(V == 1 or any(S % V == 0 and S // V >= 2 and n_devices % (S // V) == 0
                         for S in stages) for V in need.values()):
        return
    name, V = next(iter(need.items()))
    raise MultimeshValueError(
        f"`plan_pipeline` plans schedule {name!r} with {V} stages per submesh "
        f"({get_schedule(name).placement}), so it needs a multiple of {V} stages on at "
        f"least two submeshes ({2 * V} stages or more), but the candidates are "
        f"{list(stages)} stage(s) ({n_units} units, {n_devices} devices). The planner "
        f"does not plan it with one stage per submesh (where circular-reversed-backward "
        f"is GPipe with the backwards in descending order, and the interleaved "
        f"schedules plain GPipe or 1F1B): name the model's parts more finely, allow more "
        f"stages, plan with another schedule, or write the rules and "
        f"`microbatch(..., schedule={name!r})` yourself.")


def _nnx_fun(fun, args):
    """An NNX model (argument 0) becomes its parameter state, merged back inside ``fun``."""
    if "flax.nnx" not in sys.modules or not args:
        return fun, args
    from flax import nnx  # local: flax is optional (an NNX model means it is loaded)

    if not isinstance(args[0], nnx.Module):
        return fun, args
    graphdef, params, rest = nnx.split(args[0], nnx.Param, ...)  # type: ignore[misc]

    def merged(p, *others):
        return fun(nnx.merge(graphdef, p, rest), *others)

    return merged, (params, *args[1:])


def _device_model(device_model, devices) -> DeviceModel:
    if device_model is None or device_model == "default":
        return DeviceModel.for_device(devices[0])
    if device_model == "calibrate":
        return DeviceModel.calibrate(devices)
    if not isinstance(device_model, DeviceModel):
        raise MultimeshValueError(
            f"`plan_pipeline`: device_model={device_model!r} is not a hardware model; "
            f"valid choices are a `DeviceModel`, {list(DEVICE_MODELS)} or None (the "
            f"default for the device's kind).")
    return device_model


def _machine(devices, memory_limit, optimizer_state_factor, device_flops, link_bandwidth,
             fragment_overhead, device_model=None, rows=None) -> tuple[Limits, dict]:
    """The plan's limits, holding the one hardware model (``device_flops``,
    ``link_bandwidth`` and ``fragment_overhead``, where given, replace its figures:
    given flop/s are what the work reaches, so at an efficiency of 1)."""
    model = _device_model(device_model, devices)
    figures: dict = {}
    if device_flops is not None:
        figures.update(peak_flops=float(device_flops), compute_efficiency=1.0)
    if link_bandwidth is not None:
        figures.update(link_bandwidth=float(link_bandwidth))
    if fragment_overhead is not None:
        figures.update(overhead=float(fragment_overhead))
    dm = dataclasses.replace(model, **figures) if figures else model
    m = Limits(dm, num_devices=len(devices),
               memory_limit=None if memory_limit is None else float(memory_limit),
               optimizer_state_factor=float(optimizer_state_factor), batch_rows=rows)
    given = [n for n, v in (("device_flops", device_flops), ("link_bandwidth", link_bandwidth),
                            ("fragment_overhead", fragment_overhead)) if v is not None]
    notes = {
        "cost source": "",
        "device model": model.describe()
                        + (f" ({', '.join(given)} given)" if given else "")
                        + ("" if model.name.startswith("calibrated") else
                           " (device_model='calibrate' measures the devices)"),
        "device flops": f"{dm.peak_flops * dm.compute_efficiency:.3g} flop/s per "
                        f"{devices[0].platform} device; "
                        f"a fragment takes overhead + max(flops / flop/s, bytes / "
                        f"memory bandwidth)",
        "work in a stage": "each microbatch's rows split over the stage's `data` axis "
                           "(a constraint on the batch; rows that do not divide stay "
                           "whole and every device runs all the work); the gradients "
                           "all-reduced over it, or with parameters sharded over it "
                           "(fsdp) all-gathered in each call and reduce-scattered",
        "link bandwidth": f"{dm.link_bandwidth:.3g} B/s between devices; transfers do not "
                          f"overlap compute",
        "fragment overhead": f"{m.fragment_overhead:.3g} s per fragment call",
        "memory": "per device: parameters x (2 + optimizer_state_factor) per stage "
                  "(divided over its devices when sharded), plus what each microbatch's "
                  "forward keeps for its backward (residuals, their rows split over the "
                  "`data` axis, or over all the stage's devices with fsdp, which also "
                  "keeps its shards of the parameters the backward reads) x the schedule's peak live microbatches (simulated; a split "
                  "backward holds them until its weight-gradient part ran), plus the "
                  "backward's temporaries (its largest unit's for one microbatch, or the "
                  "microbatch's gradients, twice where they are reduced and accumulated, "
                  "whichever is more)"
                  + ("" if memory_limit is None else f"; limit {m.memory_limit:,.0f} B"),
        "microbatch cost": "the batch's cost divided by the number of microbatches",
        "weight gradient": "",
    }
    return m, notes


def _stages(profile: Profile, choice: Choice, devices, m: Limits,
            tables: TensorTables | None = None, reduction: str = "mean") -> tuple[Stage, ...]:
    """The plan's stages; ``tables``: per ``model`` axis size, each unit's flops and
    parameter elements per device (data parallelism aside)."""
    P = choice.num_stages // choice.interleave
    d = m.num_devices // P
    out = []
    for k, (i, j) in enumerate(choice.bounds):
        names = tuple(u.name for u in profile.units[i:j])
        r = mesh_of(k, choice.num_stages, P, choice.v_shape)
        pos = tuple(range(r * d, r * d + d))
        flops = sum(u.fwd_flops + u.bwd_flops for u in profile.units[i:j])
        t = choice.model
        per_device = flops if t == 1 else sum(tables.flops[t][i:j])  # type: ignore[union-attr]
        count = (sum(u.param_count for u in profile.units[i:j]) if t == 1
                 else sum(tables.counts[t][i:j]))  # type: ignore[union-attr]
        out.append(Stage(
            index=k, units=names, devices=tuple(int(devices[p].id) for p in pos), positions=pos,
            matcher=unit_matcher(profile.root, names),
            flops=flops,
            predicted_time=choice.num_microbatches * (choice.fwd_time[k] + choice.bwd_time[k]),
            param_bytes=sum(u.param_bytes for u in profile.units[i:j]),
            residual_bytes=_held_bytes(profile.units[i:j], choice, d),
            live_microbatches=choice.live[k], memory_bytes=choice.memory[k],
            device_flops=per_device / choice.data + _accumulation(
                choice, count // (d if choice.fsdp else 1), reduction)))
    return tuple(out)


def _accumulation(choice: Choice, count: int, reduction: str) -> float:
    """Flops per device of combining the microbatches' gradients (``count`` elements
    per device): each microbatch's added into the sum (from zeros), and with
    ``mean`` divided by the number of microbatches first; none for one microbatch (no loop)."""
    M = choice.num_microbatches
    if M == 1:
        return 0.0
    return float(count * M * (2 if reduction == "mean" else 1))


def _held_bytes(units, choice: Choice, d: int) -> int:
    """What one microbatch keeps per device from its forward for its backward."""
    spread = d if choice.fsdp else choice.data
    rows = sum(u.residual_bytes for u in units) // choice.num_microbatches // spread
    return rows + (sum(u.bwd_param_bytes for u in units) // d if choice.fsdp else 0)


# Unit costs of a step by its function and argument types: planning the same step
# again with other options (stages, fsdp, a memory limit) reuses them, as jax.jit
# reuses a trace. XLA's costs depend on nothing else; measured times are not reused.
_PROFILES = LRUCache("multimesh planner unit costs", max_size=32)


def _signature(args) -> tuple | None:
    """The argument types a profile depends on, or None when a leaf is not an array
    or a hashable constant (then nothing is reused)."""
    leaves, tree = jax.tree.flatten(args)
    sig: list[tuple] = []
    for x in leaves:
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            sig.append((tuple(x.shape), str(x.dtype)))
        elif isinstance(x, bool | int | float | complex | str | None):
            sig.append((type(x), x))
        else:
            return None
    return tree, tuple(sig)


def _profile_key(fun, args, min_units: int) -> tuple | None:
    """What XLA's costs of ``fun`` on ``args`` depend on, or None (then not reused)."""
    sig = _signature(args)
    try:
        key = None if sig is None else (fun, sig, min_units)
        hash(key)
    except TypeError:
        key = None
    return key


def _measured(fun, args, min_units: int, timer: Timer | None) -> Profile:
    key = None if timer is not None else _profile_key(fun, args, min_units)
    profile = None if key is None else _PROFILES.get(key)
    if profile is None:
        profile = measure_units(fun, args, 0, min_units=min_units, timer=timer)
        if key is not None:
            _PROFILES[key] = profile
    return profile


def _fsdp_options(fsdp, explicit, notes: dict) -> tuple:
    """The fsdp choices to search: the user's, or for an explicit-mode model (its
    parameters typed over ``explicit``'s mesh) only what that mesh allows, noted."""
    choices = _fsdp_choices(fsdp)  # checks its type either way
    if explicit is None:
        return choices
    notes["work in a stage"] = (
        f"the model's own shardings (typed over an explicit mesh "
        f"{dict(zip(*explicit))}), on each stage's share of that mesh; priced as each "
        f"microbatch's rows split over the stage's devices")
    return _explicit_fsdp(fsdp, explicit)


def plan_pipeline(fun, *example_args, devices: Sequence | None = None,
                  num_stages: int | None = None, memory_limit: float | None = None,
                  num_microbatches: int | None = None,
                  schedule: str | Sequence[str] | None = None,
                  argnum: int = 1, dim: int = 0, optimizer_state_factor: float = 0.0,
                  device_flops: float | None = None, link_bandwidth: float | None = None,
                  fragment_overhead: float | None = None,
                  logical_axes: Sequence[tuple[str, str]] = (),
                  costs: str = "xla", device_model=None,
                  fsdp: bool | None = None, reduction: str = "mean",
                  tensor: int | None = None) -> PipelinePlan:
    """Choose pipeline stages, submeshes, microbatches and schedule for ``fun``.

    ``fun(params, batch, ...)`` returns the scalar loss (``params`` may be an NNX
    module); ``example_args`` may be arrays or ``jax.ShapeDtypeStruct`` s, and the
    batch is argument ``argnum``, cut along ``dim``. The step ``value_and_grad(fun)``
    is traced once; its name-stack units (Flax submodules, NNX graph paths,
    ``jax.named_scope`` blocks) are costed by XLA's cost analysis, then cut into
    contiguous stages on ``devices`` (default ``jax.devices()``, split evenly; the
    rules' ``TaskMesh`` positions index this list, so compile with
    ``mjit(..., devices=devices)`` when it is not the default). With
    ``num_stages``/``num_microbatches``/``schedule`` unset, the planner chooses them
    (``schedule`` may also name several to choose among; :data:`SCHEDULES` lists
    those it models).
    ``memory_limit`` is in bytes per device; ``optimizer_state_factor`` is the
    optimizer's state per parameter byte (2 for Adam). ``logical_axes``, pairs
    ``(logical name, "x")``, map the model's logical axes onto each stage's submesh
    (one axis ``x``), e.g. ``(("batch", "x"),)`` to shard the batch inside a stage.
    ``costs="profile"`` times each unit's forward, backward and weight-gradient part
    on the first device instead of pricing XLA's flops at ``device_flops``.
    ``reduction`` is how ``plan.microbatch`` combines the microbatches' loss and
    gradients: ``"mean"`` (the default, as ``parallelize_step``: the full batch's, for
    a loss that averages over its batch) or ``"sum"`` (gradient accumulation).

    Each stage's submesh has one axis, ``data``: every microbatch's rows are split
    over it (``plan.microbatch`` pins them there), so an unmodified model runs data
    parallel inside each stage; one stage is pure data parallelism. ``fsdp`` shards
    the parameters over it too (ZeRO-3): True, False, or None (chosen, where the
    memory limit needs it or it is predicted faster). ``device_model``: the one
    hardware model (a :class:`~multimesh.jax.DeviceModel`, ``"calibrate"`` to
    measure these devices, or None for the documented default of their kind);
    ``device_flops``/``link_bandwidth``/``fragment_overhead`` override its figures.

    Where the model's shardings name a ``model`` axis (flax's logical rules in context,
    NNX metadata, jax constraints), each submesh is ``(data, model)``: ``model`` over
    ``tensor`` neighbouring devices (inside a node), chosen where None.
    """
    _check_inputs(fun, memory_limit, device_flops, link_bandwidth, fragment_overhead,
                  optimizer_state_factor, reduction, logical_axes)
    devices = _devices(devices)
    fun = _unjitted(fun)
    rows = _batch_rows(example_args, argnum, dim)
    stages = _stage_counts(num_stages, len(devices))
    mbs = _microbatch_counts(num_microbatches, rows)
    check_tensor(tensor, len(devices), len(devices) // min(stages))
    machine, notes = _machine(devices, memory_limit, optimizer_state_factor, device_flops,
                              link_bandwidth, fragment_overhead, device_model, rows)
    fun, args = _nnx_fun(fun, example_args)
    timer = _timer(costs, devices)
    profile = _measured(fun, args, num_stages or 2, timer)
    table, machine = _costs(profile, machine, notes)
    fit, names = _fitting(stages, table.names, num_stages), _schedules(schedule)
    _check_placeable(names, fit, len(devices), len(table.names))
    explicit, fsdps, tables = _options(fun, args, profile, table, devices, machine.model,
                                       fit, tensor, fsdp, logical_axes, notes)
    choice = search(table, machine, fit, mbs, names, fsdps,
                    None if tables is None else tables.costs)
    if choice.num_microbatches == 1:
        notes["microbatches"] = _why_one(table, machine, fit, mbs, names, choice, rows, fsdps,
                                         tables)
    return PipelinePlan(
        stages=_stages(profile, choice, devices, machine, tables, reduction),
        num_microbatches=choice.num_microbatches, schedule=choice.schedule,
        predicted_step_time=choice.step_time, batch=(argnum, dim, rows),
        units=_unit_rows(profile), cut_bytes=profile.cut_bytes, assumptions=notes,
        logical_axes=tuple((str(a), str(b)) for a, b in logical_axes),
        interleave=choice.interleave, reduction=reduction,
        batch_sharded=choice.data > 1 and explicit is None, fsdp=choice.fsdp,
        mesh_axes=_explicit_axes(explicit, len(devices), choice),
        tensor=None if tables is None else choice.model)


def _explicit_axes(explicit, n_devices: int, choice: Choice) -> tuple:
    """Each stage's axes of the explicit mesh the parameters are typed over (or none)."""
    if explicit is None:
        return ()
    return _stage_axes(explicit, n_devices * choice.interleave // choice.num_stages)


def _unit_rows(profile: Profile) -> tuple[dict, ...]:
    return tuple({"name": x.name, "fwd_flops": x.fwd_flops, "bwd_flops": x.bwd_flops,
                  "wgrad_flops": x.wgrad_flops, "bytes_accessed": x.bytes_accessed,
                  "param_bytes": x.param_bytes, "residual_bytes": x.residual_bytes}
                 for x in profile.units)


def _options(fun, args, profile, table, devices, model, stages, tensor, fsdp,
             logical_axes, notes) -> tuple:
    """The layouts inside a stage to search: the explicit mesh the parameters are typed
    over (or None), the fsdp choices, and the tensor-parallel tables (or None)."""
    explicit = _explicit_mesh(args)
    fsdps = _fsdp_options(fsdp, explicit, notes)
    tables = _tensor_options(fun, args, profile, table, devices, model, stages,
                             tensor, notes, explicit)
    check_axes(logical_axes, tables, explicit)
    return explicit, fsdps, tables


def _tensor_options(fun, args, profile, table, devices, model: DeviceModel, stages, tensor,
                    notes, explicit) -> TensorTables | None:
    """Per ``model`` axis size, the units' costs (None: the model names no ``model``
    axis, or is typed over an explicit mesh, whose own axes the plan keeps)."""
    if explicit is not None:
        if tensor is not None:
            raise MultimeshValueError(
                f"`plan_pipeline` got tensor={tensor}, but the parameters are typed over an "
                f"explicit mesh {dict(zip(*explicit))}: the plan keeps the model's own "
                f"axes on each stage's share of that mesh. Leave `tensor` unset.")
        return None
    sizes = tensor_sizes(tensor, len(devices), len(devices) // min(stages), model)
    key = _profile_key(fun, args, 0)
    return tensor_tables(fun, args, profile, table, devices, model, sizes, tensor, notes,
                         None if key is None else (*key, _rules_key()))


def _rules_key():
    return _rules()


def _explicit_mesh(args) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The explicit mesh (axis names, sizes) the parameters (argument 0) are typed
    over (jax's sharding in types), or None."""
    for leaf in jax.tree.leaves(args[0]):
        try:
            mesh = jax.typeof(leaf).sharding.mesh
        except (AttributeError, TypeError):
            continue
        if not mesh.empty and jax.sharding.AxisType.Explicit in tuple(mesh.axis_types):
            return tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    return None


def _explicit_fsdp(fsdp, explicit) -> tuple[bool, ...]:
    if fsdp:
        raise MultimeshValueError(
            f"`plan_pipeline` got fsdp=True, but the parameters are typed over an explicit "
            f"mesh {dict(zip(*explicit))}: their shardings are the model's own, which the "
            f"plan keeps on each stage's share of that mesh. Leave `fsdp` unset (or "
            f"False), and shard the parameters with the model's sharding metadata.")
    return (False,)


def _stage_axes(explicit, d: int) -> tuple[tuple[str, int], ...]:
    """The explicit mesh's axes over a stage's ``d`` devices: the mesh divided by the
    number of submeshes, the leading (outer) axes first."""
    names, sizes = explicit
    left, out = math.prod(sizes) // d, []
    for name, size in zip(names, sizes):
        g = math.gcd(size, left)
        out.append((name, size // g))
        left //= g
    if left != 1 or math.prod(k for _, k in out) != d:
        raise MultimeshValueError(
            f"`plan_pipeline`: the parameters are typed over an explicit mesh "
            f"{dict(zip(names, sizes))} ({math.prod(sizes)} devices), which does not "
            f"divide into stages of {d} device(s) each; plan on the mesh's devices, with a "
            f"number of stages that divides its axes.")
    return tuple(out)


def _check_inputs(fun, memory_limit, device_flops, link_bandwidth, fragment_overhead,
                  optimizer_state_factor, reduction, logical_axes) -> None:
    """``plan_pipeline``'s arguments that need no trace, checked before any work."""
    if not callable(fun):
        raise MultimeshTypeError(
            f"`plan_pipeline` expects the loss function first, got {type(fun).__name__}.")
    for name, value in (("memory_limit", memory_limit), ("device_flops", device_flops),
                        ("link_bandwidth", link_bandwidth)):
        _positive(value, name)
    _non_negative(fragment_overhead, "fragment_overhead", "seconds per fragment call")
    _non_negative(optimizer_state_factor, "optimizer_state_factor",
                  "optimizer state bytes per parameter byte; 2 for Adam")
    check_reduction(reduction, "`plan_pipeline`")
    check_pairs(logical_axes, "logical_axes", "`plan_pipeline`")


def _why_one(table: Costs, m: Limits, stages, mbs, schedules, choice: Choice,
             rows: int, fsdps: tuple[bool, ...], tables: TensorTables | None = None) -> str:
    """Why the plan runs the batch as one microbatch (no pipelining)."""
    if mbs == [1]:
        return ("one, as asked (num_microbatches=1)" if rows > 1
                else "one: the example batch has one row")
    try:
        other = search(table, m, stages, [k for k in mbs if k > 1], schedules, fsdps,
                       None if tables is None else tables.costs)
    except MultimeshValueError:
        return ("one: no plan with more microbatches fits (memory limit or schedule); "
                "the stages run one after the other, without a pipeline")
    return (f"one: the best plan with more ({other.num_microbatches}, "
            f"{other.schedule!r}) is predicted at {other.step_time * 1e3:.3f} ms against "
            f"{choice.step_time * 1e3:.3f} ms, since each microbatch adds a fragment call "
            f"per stage ({m.fragment_overhead:.3g} s) and transfers that cost more than the "
            f"pipeline bubble it fills; the stages run one after the other (pass "
            f"num_microbatches= to pipeline anyway)")


def _timer(costs: str, devices) -> Timer | None:
    if costs not in COST_SOURCES:
        raise MultimeshValueError(
            f"`plan_pipeline`: costs={costs!r} is not a cost source; valid choices are "
            f"{list(COST_SOURCES)} ('xla': XLA's cost analysis, 'profile': each unit "
            f"run and timed once on the first device).")
    return Timer(devices[0]) if costs == "profile" else None


def _costs(profile: Profile, m: Limits, notes: dict) -> tuple[Costs, Limits]:
    """The search's per-unit figures: XLA flops at the nominal rate, or measured
    seconds (then the rate is one "flop" per second)."""
    u = profile.units
    notes["cost source"] = (f"{profile.source}, traced once on the example batch; "
                            f"{len(u)} units")
    split = any(x.wgrad_flops for x in u)
    notes["weight gradient"] = (
        "each unit's backward split by XLA cost analysis into the input-gradient part "
        "(what the unit before it waits for) and the weight-gradient part"
        if split else "no unit's backward splits apart by its equations; assumed half "
        "of each unit's backward (zero-bubble schedules)")
    fwd = [x.fwd_flops for x in u]
    bwd = [x.bwd_flops for x in u]
    wgrad = [x.wgrad_flops for x in u]
    timed = [x.times for x in u if x.times is not None]
    if len(timed) == len(u):
        fwd, bwd, wgrad = ([t[k] for t in timed] for k in range(3))
        # measured seconds as "flops" at one per second (no bytes: they are timed in)
        m = dataclasses.replace(m, model=dataclasses.replace(
            m.model, peak_flops=1.0, compute_efficiency=1.0))
        notes["device flops"] = ("unused: unit costs are measured seconds on one device, "
                                 "divided over a stage's devices")
        if split:
            notes["weight gradient"] = (
                "each unit's backward split by its equations into the input-gradient "
                "part (what the unit before it waits for) and the weight-gradient part, "
                "each part timed")
    priced = len(timed) != len(u)  # measured seconds already hold the memory traffic
    costs = Costs(tuple(x.name for x in u), tuple(fwd), tuple(bwd),
                  tuple(x.param_bytes for x in u), tuple(x.residual_bytes for x in u),
                  profile.cut_bytes, tuple(wgrad) if split else None,
                  tuple(x.fwd_bytes for x in u) if priced else None,
                  tuple(x.bytes_accessed - x.fwd_bytes for x in u) if priced else None,
                  tuple(x.work_bytes for x in u), tuple(x.bwd_param_bytes for x in u),
                  leaves=tuple(x.param_leaves for x in u),
                  bwd_leaves=tuple(x.bwd_param_leaves for x in u))
    return costs, m


def plan_step(mb, loss, params, batch_avals, mesh):
    """``parallelize_step(..., num_stages="auto")``: plan ``loss(params, batch)`` on the
    mesh's devices; returns the microbatch options to use and the plan."""
    fixed = [n for n in ("interleave", "custom_schedule", "unrolling")
             if getattr(mb, n) is not None]
    if fixed:
        raise MultimeshValueError(
            f"parallelize_step got num_stages='auto' and {', '.join(f'`{n}`' for n in fixed)}"
            f"; the planner places one contiguous stage per submesh and chooses a "
            f"schedule for that placement, so it cannot honour them. Drop them, or plan with `plan_pipeline` and "
            f"write the schedule yourself.")
    if mb.remat is not None and not isinstance(mb.remat, bool):
        raise MultimeshValueError(
            f"parallelize_step got num_stages='auto' and the checkpoint policy "
            f"remat={_policy_name(mb.remat)}: the planner's stages are `register_task` "
            f"rules, and a registered stage is recomputed whole or not at all. Pass "
            f"remat=True or False, or plan with `plan_pipeline`, write each stage as "
            f"`task(..., remat=policy)` and compile the step yourself.")
    rows = _batch_rows((params, batch_avals), 1, 0)
    given = mb.num_microbatches
    if given is None and mb.microbatch_size is not None:
        if rows % mb.microbatch_size:
            raise MultimeshValueError(
                f"parallelize_step microbatch_size={mb.microbatch_size} does not divide the "
                f"batch of {rows} rows; give a size that divides it (or `num_microbatches=`).")
        given = rows // mb.microbatch_size
    plan = plan_pipeline(loss, params, batch_avals, devices=list(mesh.devices.flat),
                         num_microbatches=given, schedule=mb.schedule,
                         reduction=mb.reduction)
    return dataclasses.replace(mb, num_stages=None, microbatch_size=None,
                               num_microbatches=plan.num_microbatches,
                               schedule=plan.schedule if plan.num_microbatches > 1 else None,
                               shard=plan.shard,
                               interleave=plan._interleave_option()), plan
