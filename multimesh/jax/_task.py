"""``Task``, ``TaskMesh``, ``task`` and logical ``with_sharding_constraint``."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import numpy as np
from jax.api_util import debug_info, flatten_fun, shaped_abstractify
from jax.core import Tracer
from jax.extend import linear_util as lu
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr
from jax.interpreters import partial_eval as pe
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from multimesh._src import jax_compat
from multimesh._src.errors import (
    MeshError,
    MultimeshError,
    MultimeshTypeError,
    MultimeshValueError,
    MultimeshWarning,
    user_stacklevel,
)
from multimesh.jax import _checks, _contexts
from multimesh.jax._global_mesh import slice_global_mesh
from multimesh.jax._primitives import (
    TaskInfo,
    bind_logical,
    bind_task,
    body_scope,
    linearize_task,
    warn_unplaced,
)
from multimesh.jax._trace_notes import TraceNotes

__all__ = ["TaskMesh", "Task", "task", "with_sharding_constraint", "logical_axes_of",
           "warn_renamed_tasks", "jax_constraint_hint"]

# Ops traced through multimesh's wrappers (tasks, logical constraints, microbatch
# loops) get the location of the *user's* call: jax skips excluded files when it
# picks the frame an op's location points at.
source_info_util.register_exclusion(os.path.dirname(os.path.dirname(__file__)) + os.sep)


# jax's own, captured at import: MultiMesh's plugin init installs the logical
# with_sharding_constraint as jax.lax.with_sharding_constraint, and programs written
# for it (e.g. the implicit Flax tutorial) may do the same here.
_jax_with_sharding_constraint = jax.lax.with_sharding_constraint


def _plain(x):
    """``x`` with numpy scalars turned into Python ones (for messages)."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _who(name: str | None) -> str:
    """How a message names a task: ``Task 't'``, or ```Task``` when it has no name."""
    return f"Task {name!r}" if name is not None else "`Task`"


def check_pairs(value, field: str, who: str) -> tuple[tuple[str, str], ...]:
    """``logical_axes``/``extra_axes``: a sequence of (logical_name, device_axis) pairs."""
    def is_pair(p):
        return (isinstance(p, (tuple, list)) and len(p) == 2
                and all(isinstance(s, str) for s in p))

    what = f"{who}: `{field}` must be a sequence of (logical_name, device_axis) pairs"
    if isinstance(value, (str, Mapping)) or not hasattr(value, "__iter__"):
        raise MultimeshTypeError(f"{what}, got {type(value).__name__} {value!r}.")
    value = tuple(value)
    if is_pair(value) and not any(isinstance(p, (tuple, list)) for p in value):
        raise MultimeshValueError(
            f"{what}, got {value!r}; write ({value!r},) for one pair.")
    for p in value:
        if not is_pair(p):
            raise MultimeshValueError(f"{what}, got {value!r}; {p!r} is not such a pair.")
    return tuple(tuple(p) for p in value)


def _check_split_backprop(value, who: str) -> tuple[str, str] | None:
    """``split_backprop``: None or two distinct, non-empty name suffixes."""
    if value is None or (isinstance(value, (tuple, list)) and not value):
        return None
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(s, str) and s for s in value) and value[0] != value[1]):
        return tuple(value)
    raise MultimeshValueError(
        f"{who}: `split_backprop` must be two distinct, non-empty name suffixes "
        f"(critical, non-critical), e.g. ('_activations', '_gradients'), got {value!r}.")


# jax.checkpoint_policies that make a policy when called (``save_only_these_names("x")``)
_POLICY_FACTORIES = ("save_only_these_names", "save_any_names_but_these",
                     "save_and_offload_only_these_names", "save_from_both_policies",
                     "offload_dot_with_no_batch_dims")


def check_remat(value, who: str):
    """``remat``: None (inherit), a bool (``np.bool_`` too, returned as ``bool``), or a
    jax checkpoint policy (a callable)."""
    if isinstance(value, np.bool_):
        return bool(value)
    factory = next((n for n in _POLICY_FACTORIES
                    if getattr(jax.checkpoint_policies, n, None) is value), None)
    if factory is not None:
        raise MultimeshTypeError(
            f"{who}: `remat` got `jax.checkpoint_policies.{factory}` itself, which makes a "
            f"policy when called; call it with the names to save, e.g. "
            f"`remat=jax.checkpoint_policies.{factory}(\"name\")` (names given with "
            f"`jax.ad_checkpoint.checkpoint_name`).")
    if value is None or isinstance(value, bool) or callable(value):
        return value
    raise MultimeshTypeError(
        f"{who}: `remat` must be True (recompute the whole forward in the backward), False, "
        f"None (inherit the `microbatch`/`parallelize_step` default) or a jax checkpoint "
        f"policy such as `jax.checkpoint_policies.dots_saveable`, got "
        f"{type(value).__name__} {value!r}.")


def rematted(fun: Callable, remat) -> Callable:
    """``fun`` under ``jax.checkpoint`` when ``remat`` asks for it: the task's backward
    then recomputes its forward from the task's inputs, so only those stay live
    between the two (plus what a policy saves)."""
    if remat is None or remat is False:
        return fun
    return jax.checkpoint(fun, policy=None if remat is True else remat)


def _task_mesh_axes(axis_names, axis_sizes) -> tuple[tuple, tuple]:
    """``TaskMesh``'s axis names and sizes, checked: both given, one size per name,
    distinct string names, positive sizes."""
    if axis_names is None or axis_sizes is None:
        raise MeshError("`TaskMesh` needs both `axis_names` and `axis_sizes` (or `abstract`).")
    axis_names = _checks.axis_names(axis_names, "`TaskMesh`")
    axis_sizes = _checks.axis_sizes(axis_sizes, "`TaskMesh`")
    if len(axis_names) != len(axis_sizes):
        raise MeshError(
            f"`TaskMesh` got {len(axis_names)} axis names {axis_names} but "
            f"{len(axis_sizes)} axis sizes {axis_sizes}; give one size per name.")
    if not all(isinstance(n, str) for n in axis_names) or len(set(axis_names)) != len(axis_names):
        raise MeshError(f"`TaskMesh` axis names must be distinct strings, got {axis_names}.")
    if any(s < 1 for s in axis_sizes):
        raise MeshError(f"`TaskMesh` axis sizes must be positive, got {axis_sizes}.")
    return axis_names, axis_sizes


def _check_task_mesh_positions(positions: tuple[int, ...]) -> None:
    """``TaskMesh`` device positions are non-negative and distinct."""
    if any(p < 0 for p in positions):
        raise MeshError(f"`TaskMesh` device positions must be non-negative, got {positions}.")
    repeated = sorted(p for p, n in collections.Counter(positions).items() if n > 1)
    if repeated:
        which = ", ".join(str(p) for p in repeated)
        raise MeshError(
            f"`TaskMesh` device positions must be distinct, got {positions}; position"
            f"{'s' if len(repeated) > 1 else ''} {which} appear"
            f"{'' if len(repeated) > 1 else 's'} more than once.")


class TaskMesh:
    """A submesh for a task: device *positions* within the program plus named axes.

    ``devices`` are positions ``0..N-1`` in the program's device list (the
    ``devices`` given to :func:`mjit`/:func:`parallelize`, all devices by
    default), not :class:`jax.Device` objects.
    """

    def __init__(self, *, devices: Sequence[int], axis_sizes: Sequence[int] | None = None,
                 axis_names: Sequence[str] | None = None, abstract: AbstractMesh | None = None):
        listed = list(devices) if isinstance(devices, range) else devices
        flat = np.asarray(listed)
        if flat.size == 0:
            raise MeshError(
                f"`TaskMesh` needs at least one device position, got {_plain(listed)!r}.")
        if flat.dtype == object or not np.issubdtype(flat.dtype, np.integer):
            raise MultimeshTypeError(
                f"`TaskMesh` devices must be integer positions in the program's device list, "
                f"got {devices!r}. Use `task(..., mesh=jax.sharding.Mesh(...))` for real devices.")
        flat = flat.reshape(-1)
        positions = tuple(int(d) for d in flat)
        if abstract is not None:
            axis_names, axis_sizes = abstract.axis_names, abstract.axis_sizes
        if axis_names is None and axis_sizes is None:
            axis_names, axis_sizes = ("x",), (flat.size,)
        axis_names, axis_sizes = _task_mesh_axes(axis_names, axis_sizes)
        if math.prod(axis_sizes) != flat.size:
            raise MeshError(
                f"`TaskMesh` has {flat.size} devices {positions} but axis_sizes "
                f"{axis_sizes} describe {math.prod(axis_sizes)} devices; the product of the axis "
                f"sizes must equal the number of devices.")
        _check_task_mesh_positions(positions)
        self.devices = flat.astype(int).reshape(axis_sizes)
        self.mesh = AbstractMesh(axis_sizes, axis_names)

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return self.mesh

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self.mesh.axis_sizes)

    def place(self, devices: Sequence[int]) -> TaskMesh:
        """An equivalent task mesh (same axes and sizes) on other device positions."""
        return TaskMesh(devices=devices, abstract=self.mesh)

    def __eq__(self, other):
        return (isinstance(other, TaskMesh) and self.axis_names == other.axis_names
                and self.axis_sizes == other.axis_sizes
                and np.array_equal(self.devices, other.devices))

    def __hash__(self):
        return hash((self.axis_names, self.axis_sizes, tuple(self.devices.flat)))

    def __repr__(self):
        return (f"TaskMesh(devices={tuple(int(d) for d in self.devices.flat)}, "
                f"axis_names={self.axis_names}, axis_sizes={self.axis_sizes})")


@dataclasses.dataclass
class Task:
    """All options of a named task: its submesh and its logical→device mapping.

    ``logical_axes`` are priority-ordered ``(logical_name, device_axis)`` pairs;
    ``None`` means the identity mapping over the mesh's axis names.
    ``extra_axes`` are appended after ``logical_axes`` (lower priority).
    """

    name: str | None = None
    mesh: TaskMesh | Mesh | None = None
    logical_axes: Sequence[tuple[str, str]] | None = None
    mesh_slice: Mapping[str, int] | None = None
    extra_axes: Sequence[tuple[str, str]] | None = None
    split_backprop: tuple[str, str] | None = None
    loop_dependent_mesh_slice: Callable[[int], Mapping[str, int]] | None = None
    remat: bool | Callable | None = None
    """Recompute the task's forward in its backward: True, or a jax checkpoint policy
    (``jax.checkpoint_policies.*``); None inherits ``microbatch(..., remat=)``."""

    def __post_init__(self):
        _checks.task_name(self.name, "`Task`")
        who = _who(self.name)
        if self.mesh is not None and self.mesh_slice is not None:
            raise MultimeshValueError(
                f"{who} cannot have both `mesh` and `mesh_slice`; give one of them.")
        if self.mesh is not None and not isinstance(self.mesh, (TaskMesh, Mesh)):
            raise MultimeshTypeError(
                f"{who}: `mesh` must be a `TaskMesh` or a `jax.sharding.Mesh`, "
                f"got {type(self.mesh).__name__}.")
        for field in ("logical_axes", "extra_axes"):
            pairs = getattr(self, field)
            if pairs is not None:
                setattr(self, field, check_pairs(pairs, field, who))
        self.split_backprop = _check_split_backprop(self.split_backprop, who)
        self.remat = check_remat(self.remat, who)


def _program_devices() -> tuple:
    return _contexts.state.program_devices or tuple(jax.devices())


def _positions_of(devices, name: str) -> np.ndarray:
    """Map jax.Device objects (or ints) to positions in the program's device list."""
    prog = _program_devices()
    arr = np.asarray(devices, dtype=object)
    out = np.empty(arr.shape, dtype=int)
    index = {d: i for i, d in enumerate(prog)}
    for idx, d in np.ndenumerate(arr):
        if isinstance(d, (int, np.integer)):
            pos = int(d)
        elif d in index:
            pos = index[d]
        else:
            raise MeshError(
                f"Task {name!r} uses device {d}, which is not among the program's devices "
                f"{[dev.id for dev in prog]}.")
        if not 0 <= pos < len(prog):
            raise MeshError(
                f"Task {name!r} uses device position {pos}, outside the program's "
                f"{len(prog)} devices (valid positions are 0..{len(prog) - 1})."
                + _checks.few_devices_hint(prog))
        out[idx] = pos
    return out


def _check_reused_axis_names(name: str, mapping, axis_names) -> None:
    """A logical name that is also one of the task's mesh axes must map onto that
    axis: inside a task the mesh is the task's mesh, so jax's own constraints read it
    as the axis, and multimesh's logical ones would read it as another."""
    for logical, device in mapping:
        if logical in axis_names and device in axis_names and device != logical:
            raise MeshError(
                f"Task {name!r} maps the logical name {logical!r} onto the mesh axis "
                f"{device!r}, but {logical!r} is also an axis of the task's mesh "
                f"{tuple(axis_names)}: a sharding over {logical!r} would mean that axis to "
                f"jax's constraints and {device!r} to multimesh's logical ones. Give the "
                f"logical name another name (for example ({logical + '_logical'!r}, "
                f"{device!r})), or map it onto itself.")


def resolve_task_info(spec: Task, name: str) -> TaskInfo:
    """Turn a :class:`Task` into the IR-level :class:`TaskInfo` for this program."""
    mesh = spec.mesh
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    if spec.mesh_slice is not None:
        mesh = slice_global_mesh(name, spec.mesh_slice)
    if mesh is None:
        n = len(_program_devices())
        positions, names, sizes = np.arange(n), ("x",), (n,)
        mapping = (("x", "x"),) if spec.logical_axes is None else tuple(spec.logical_axes)
    else:
        if isinstance(mesh, Mesh):
            positions = _positions_of(mesh.devices, name)
            names, sizes = tuple(mesh.axis_names), tuple(mesh.devices.shape)
        else:
            positions = _positions_of(mesh.devices, name)
            names, sizes = mesh.axis_names, mesh.axis_sizes
        mapping = (tuple((a, a) for a in names) if spec.logical_axes is None
                   else tuple(spec.logical_axes))
    # A pair naming a device axis this mesh lacks is fine until a constraint in the
    # task uses its logical name (one map shared by submeshes of different shapes):
    # mm-resolve-logical-shardings reports it there.
    mapping = mapping + tuple(spec.extra_axes or ())
    mapping = mapping + tuple(p for p in _contexts.state.logical_rules
                              if p[1] in names and p not in mapping)
    _check_reused_axis_names(name, mapping, names)
    if _contexts.state.trace_notes is not None:  # which in_shardings names are logical
        _contexts.state.trace_notes.logical_names.update(logical for logical, _ in mapping)
    # Checked again here: a Task's fields may have been reassigned after construction.
    split = _check_split_backprop(spec.split_backprop, _who(name))
    if split is not None and _contexts.state.trace_notes is not None:
        _contexts.state.trace_notes.split_backprop = True
    return TaskInfo(name=name, devices=tuple(int(p) for p in positions.flat),
                    axis_names=tuple(names), axis_sizes=tuple(int(s) for s in sizes),
                    logical_axes=mapping, split_backprop=split)


def _loop_dependent(spec: Task, name: str, info: TaskInfo, n: int) -> TaskInfo:
    """``info`` with the task's device positions in each of the loop's ``n`` microbatches."""
    placements = []
    slicer = spec.loop_dependent_mesh_slice
    assert slicer is not None  # only tasks placed per microbatch get here
    for mb in range(n):
        where = slicer(mb)
        moved = resolve_task_info(dataclasses.replace(spec, mesh=None, mesh_slice=where), name)
        if len(moved.devices) != len(info.devices):
            raise MeshError(
                f"loop dependent submesh ({len(moved.devices)} devices) must have the same "
                f"number of devices as the default task mesh ({len(info.devices)} devices) for "
                f"task {name!r}; loop_dependent_mesh_slice({mb}) returned {dict(where)!r}.")
        if (moved.axis_names, moved.axis_sizes) != (info.axis_names, info.axis_sizes):
            raise MeshError(
                f"Task {name!r}: loop_dependent_mesh_slice({mb}) returned {dict(where)!r}, a "
                f"submesh with axes {dict(zip(moved.axis_names, moved.axis_sizes))}, but the "
                f"task's mesh has axes {dict(zip(info.axis_names, info.axis_sizes))}; every "
                f"microbatch's submesh must have the same shape.")
        placements.append(moved.devices)
    return dataclasses.replace(info, loop_devices=tuple(placements))


def loop_placement(spec: Task, name: str, info: TaskInfo, n: int | None = None) -> TaskInfo:
    """Apply ``spec.loop_dependent_mesh_slice`` inside a microbatch loop of ``n``
    microbatches (default: the loop being traced); warn outside one."""
    n = n if n is not None else _contexts.state.microbatch_loop
    if n is None:
        warnings.warn(
            f"Task {name!r} has a loop_dependent_mesh_slice, but it is not called inside a "
            f"`microbatch` function, so it runs on its default submesh "
            f"{list(info.devices)}.", MultimeshWarning, stacklevel=user_stacklevel())
        return info
    return _loop_dependent(spec, name, info, n)


def _legacy_task(name: str, kwargs: dict) -> Task:
    """The v0.1 spelling ``task(f, devices=..., device_axes=..., logical_axes=...)``."""
    devices = kwargs.pop("devices", None)
    device_axes = kwargs.pop("device_axes", None)
    mesh = kwargs.get("mesh")
    if mesh is not None and (devices is not None or device_axes is not None):
        raise MultimeshValueError(
            f"Task {name!r}: cannot give both `mesh` and `devices`/`device_axes`.")
    if devices is None:
        if device_axes is not None:
            raise MultimeshValueError(f"Task {name!r}: `device_axes` needs `devices`.")
        return Task(name=name, **kwargs)
    arr = np.asarray(devices, dtype=object)
    if device_axes is None:
        if kwargs.get("logical_axes"):
            raise MultimeshValueError(
                f"Task {name!r} given logical_axes but no device_axes; name the device axes "
                f"with `device_axes=` or pass a `mesh`.")
        # No axes: every logical constraint in the task resolves to replicated.
        device_axes, arr = ("x",), arr.reshape(-1)
        kwargs["logical_axes"] = ()
    device_axes = _checks.axis_names(device_axes, f"Task {name!r} `device_axes`")
    if arr.ndim != len(device_axes):
        raise MeshError(
            f"Task {name!r}: devices array has {arr.ndim} dims (shape {arr.shape}) but "
            f"device_axes {device_axes} names {len(device_axes)}.")
    if all(isinstance(d, (int, np.integer)) for d in arr.flat):
        mesh = TaskMesh(devices=[int(d) for d in arr.flat], axis_names=device_axes,
                        axis_sizes=arr.shape)
    else:
        mesh = Mesh(arr, device_axes)
    return Task(name=name, mesh=mesh, **kwargs)


def task(fun: Callable, name: str | None = None, *, task: Task | None = None, **kwargs):
    """Wraps a function in an auto-sharding task context.

    The task runs on its own submesh (``mesh=`` a :class:`TaskMesh` or a
    :class:`jax.sharding.Mesh`, or ``devices=``/``device_axes=``), and logical
    sharding constraints inside it resolve through ``logical_axes``.
    """
    _checks.task_name(name)
    if _contexts.state.ignore_transforms:
        return fun
    if not callable(fun):
        raise MultimeshTypeError(f"`task` expects a callable, got {type(fun).__name__}.")
    default_name = name or getattr(fun, "__name__", None) or "task"
    spec = _task_spec(default_name, task, kwargs)
    task_name = name or spec.name or default_name
    explicit = bool(name) or (task is not None and bool(task.name))  # not fun.__name__

    warned: list[bool] = []  # placement-ignored warning, once per task function (eager)

    def wrapped(*args, **kw):
        if _contexts.state.ignore_transforms:
            return fun(*args, **kw)
        info = resolve_task_info(spec, task_name)
        if _contexts.state.program_devices is None:
            info = _outside_mjit(info, warned)
        if explicit:
            _note_explicit_name(info)
        if spec.loop_dependent_mesh_slice is not None:
            info = loop_placement(spec, task_name, info)
        args_flat, in_tree = jax.tree.flatten((args, kw))
        in_avals = tuple(shaped_abstractify(x) for x in args_flat)
        dbg = debug_info("multimesh.task", fun, args, kw)
        remat = check_remat(spec.remat, _who(task_name))
        remat = _contexts.state.remat if remat is None else remat
        if remat is True and _contexts.state.trace_notes is not None:
            # jax keeps the task's inputs as residuals; the pass reads them in place
            _contexts.state.trace_notes.remat_inputs_of.add(task_name)
        info, tmesh = _with_body_mesh(spec, info)
        with _contexts.autoshard(True), jax_constraint_hint(
                f"inside task {task_name!r}", info.logical_axes, tmesh), \
                body_scope({"info": info}):
            outs, out_tree = _bind_body(info, rematted(fun, remat), args_flat, in_avals,
                                        in_tree, dbg)
        return jax.tree.unflatten(out_tree, outs)

    wrapped.__name__ = task_name
    functools.update_wrapper(wrapped, fun, assigned=(), updated=())  # __wrapped__ only
    out = cast(TaskFunction, wrapped)
    out.mm_task = spec
    return out


def task_abstract_mesh(spec: Task, info: TaskInfo) -> AbstractMesh | None:
    """The mesh a task's body sees: its own axes, a ``mesh_slice``'s sliced axes dropped,
    with the axis types of the mesh in context (None: the task has no mesh of its own).

    Inside a task the mesh is the task's mesh, so sharding code written for one mesh
    (``jax.lax.with_sharding_constraint`` with a ``PartitionSpec``, flax's logical rules,
    ``shard_map``) applies on the task's submesh.
    """
    if (spec.mesh is None and spec.mesh_slice is None) or info.unplaced_ok \
            or _contexts.state.program_devices is None:
        return None  # outside mjit a task is an ordinary call on the program's mesh
    sliced = set(spec.mesh_slice or ())
    outer = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit in tuple(outer.axis_types or ()):
        # Explicit mode types values over the program's mesh, and those types cross the
        # task's boundary: the body keeps that mesh, and mm-resolve-logical-shardings
        # moves its shardings onto the task's mesh by axis name.
        return None
    types = dict(zip(outer.axis_names, outer.axis_types, strict=True)) if outer.axis_names else {}
    keep = [(n, s) for n, s in zip(info.axis_names, info.axis_sizes, strict=True)
            if n not in sliced]
    if not keep:
        return None
    return AbstractMesh(tuple(s for _, s in keep), tuple(n for n, _ in keep),
                        axis_types=tuple(types.get(n, AxisType.Auto) for n, _ in keep))


def _with_body_mesh(spec: Task, info: TaskInfo) -> tuple[TaskInfo, AbstractMesh | None]:
    """``info`` carrying the concrete mesh its body is traced under, and that mesh's
    abstract form (None: the body sees the program's mesh)."""
    mesh = task_abstract_mesh(spec, info)
    body = task_body_mesh(mesh, info)
    return (info if body is None else dataclasses.replace(info, body_mesh=body)), mesh


def task_body_mesh(mesh: AbstractMesh | None, info: TaskInfo) -> Mesh | None:
    """The concrete mesh of :func:`task_abstract_mesh`: the task's devices."""
    if mesh is None:
        return None
    prog = _program_devices()
    devices = np.asarray([prog[p] for p in info.devices], dtype=object).reshape(mesh.axis_sizes)
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def _outside_mjit(info: TaskInfo, warned: list[bool]) -> TaskInfo:
    """A task bound outside ``mjit``: quiet (and marked so for the lowering rule) in
    multimesh's own traces. Called eagerly (``jax.grad``/``jax.vmap`` too) it runs now:
    warned once per task function (``warned``). Staged out, the lowering rule warns when
    jax is about to run it (:func:`warn_unplaced`, once per program), so a trace that
    never runs (``jax.eval_shape``) is quiet."""
    if _contexts.state.internal_trace:
        return dataclasses.replace(info, unplaced_ok=True)
    if jax_compat.staging():
        return info
    if not warned:
        warned.append(True)
        warn_unplaced(info, "eager")
    return dataclasses.replace(info, unplaced_ok=True)  # said here, once


class TaskFunction(Protocol):
    """What :func:`task` returns: the function, carrying its :class:`Task` (the flax
    wrappers read ``mm_task`` to build their own tasks)."""

    mm_task: Task

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def _task_spec(default_name: str, task: Task | None, kwargs: dict) -> Task:
    """The :class:`Task` that ``task(fun, ...)`` runs with: ``task=``, or one built
    from the keyword options (never both)."""
    if task is not None:
        if kwargs:
            raise MultimeshValueError(
                f"Task {default_name!r}: give either `task=` or keyword options, not both "
                f"(got {sorted(kwargs)}).")
        return task
    valid = {f.name for f in dataclasses.fields(Task)} | {"devices", "device_axes"}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise MultimeshTypeError(
            f"`task` got unexpected keyword argument(s) {unknown}; valid options are "
            f"{sorted(valid - {'name'})}.")
    return _legacy_task(default_name, dict(kwargs))


def _note_explicit_name(info: TaskInfo) -> None:
    """Remember the submesh a user-chosen task name was bound with (see
    :func:`warn_renamed_tasks`)."""
    notes = _contexts.state.trace_notes
    if notes is not None:
        seen = notes.explicit_task_names
        key = (info.devices, info.axis_names, info.axis_sizes, info.logical_axes,
               info.split_backprop)
        if key not in seen.setdefault(info.name, []):
            seen[info.name].append(key)


def warn_renamed_tasks(notes: TraceNotes) -> None:
    """Warn when one explicit task name came with several submeshes or mappings.

    ``mm-inline-tasks`` keeps such tasks apart (``name``, ``name.1``, ...; MultiMesh
    uniquifies colours the same way), so the program still runs, but the user's
    name no longer names one task.
    """
    for name, keys in notes.explicit_task_names.items():
        if len(keys) < 2:
            continue
        where = "; ".join(
            f"{name if i == 0 else f'{name}.{i}'!r} on device positions {list(k[0])} ("
            + ", ".join(f"{a}={s}" for a, s in zip(k[1], k[2])) + ")"
            for i, k in enumerate(keys))
        warnings.warn(
            f"Task name {name!r} was given {len(keys)} different submeshes or logical "
            f"mappings, so multimesh runs them as {len(keys)} tasks: {where} (suffixes in "
            f"program order). Give each task its own name to choose the names yourself.",
            MultimeshWarning, stacklevel=user_stacklevel())


_JAX_NEEDS_MESH = "with_sharding_constraint requires a non-empty mesh"
_JAX_NO_AXIS = re.compile(r"Resource axis: (\S+) of (.*) is not found in mesh: (\(.*\))")


@contextlib.contextmanager
def jax_constraint_hint(where: str, mapping=(), mesh: AbstractMesh | None = None
                        ) -> Iterator[None]:
    """Turn jax's errors for a ``PartitionSpec`` that cannot apply (``where``: inside a
    task, an ``mjit`` program) into errors that say what the mesh is there: no mesh
    (a program or task without one), or the task's own mesh (``mesh``) lacking an
    axis, with the logical ``multimesh.jax.with_sharding_constraint`` as the way to
    use a logical name."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if isinstance(e, MultimeshError):
            raise
        maps = (" (" + ", ".join(f"{a!r} -> {b!r}" for a, b in mapping) + ")"
                if mapping else "")
        missing = _JAX_NO_AXIS.search(str(e))
        if missing is not None and mesh is not None:
            axis = missing.group(1)
            logical = any(a == axis for a, _ in mapping)
            hint = (f" {axis!r} is a logical name that the task maps{maps}: name it with "
                    f"`multimesh.jax.with_sharding_constraint(x, spec)`, which resolves "
                    f"logical names on each task's mesh." if logical else
                    f" Shard over the task's axes, or give the task a mesh with an axis "
                    f"{axis!r}.")
            raise MeshError(
                f"A sharding {where} names the mesh axis {axis!r} ({missing.group(2)}), "
                f"which the task's mesh lacks: inside a task the mesh is the task's mesh, "
                f"with the axes {tuple(mesh.axis_names)} (sizes "
                f"{tuple(mesh.axis_sizes)}).{hint}") from e
        if _JAX_NEEDS_MESH not in str(e):
            raise
        raise MultimeshValueError(
            f"`jax.lax.with_sharding_constraint` with a `PartitionSpec` {where} needs a jax "
            f"mesh in context, and multimesh sets none: in an MPMD program, axis names are "
            f"logical names that each task maps to its own mesh axes{maps}. Use "
            f"`multimesh.jax.with_sharding_constraint(x, spec)` instead, or enter a mesh "
            f"(`jax.set_mesh`) or give the task a `mesh` whose axes the spec names.") from e


def _bind_body(info: TaskInfo, body, args_flat, in_avals, in_tree, dbg):
    """``(outputs, their tree)`` of the task ``info`` binding ``body`` on ``args_flat``.

    Under ``grad`` the body is traced once, straight into its forward and tangent
    jaxprs (:func:`linearize_task`); elsewhere it is traced to a jaxpr, and the
    tracers it closed over become leading arguments."""
    f, out_tree_of = flatten_fun(lu.wrap_init(body, debug_info=dbg), in_tree)
    outs = linearize_task(info, f, in_avals, args_flat)
    if outs is not None:
        return outs, out_tree_of()
    jaxpr, out_tree = _trace(body, in_avals, in_tree, dbg)
    consts: list = []
    if any(isinstance(c, Tracer) for c in jaxpr.consts):
        jaxpr, consts = jax_compat.separate_consts(jaxpr)
    return bind_task(info, jaxpr, consts, args_flat), out_tree


def _trace(fun, in_avals, in_tree, dbg):
    f = lu.wrap_init(fun, debug_info=dbg)
    f, out_tree = flatten_fun(f, in_tree)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(f, in_avals)
    return ClosedJaxpr(jaxpr, consts), out_tree()


def logical_axes_of(spec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """PartitionSpec-like → one tuple of logical names per dimension."""
    if isinstance(spec, NamedSharding):
        spec = spec.spec
    if spec is None:
        spec = PartitionSpec()
    if not isinstance(spec, (PartitionSpec, tuple, list)):
        raise MultimeshTypeError(
            f"Logical sharding must be a PartitionSpec or NamedSharding, got {spec!r}.")
    entries = list(spec)
    if len(entries) > ndim:
        raise MultimeshValueError(
            f"Sharding {spec} has {len(entries)} entries but the value has rank {ndim}.")
    out: list[tuple[str, ...]] = []
    for e in entries + [None] * (ndim - len(entries)):
        if e is None or e is PartitionSpec.UNCONSTRAINED:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e))
    return tuple(out)


def with_sharding_constraint(x, axis_resources):
    """Applies logical sharding annotations to the input(s).

    Inside :func:`autoshard` (entered by ``mjit``, ``parallelize``, tasks and
    ``MultiMesh``) the names are *logical*: each task maps them to its own device
    axes. Elsewhere this is :func:`jax.lax.with_sharding_constraint`.
    """
    st = _contexts.state
    if st.ignore_transforms and not isinstance(axis_resources, NamedSharding):
        # Logical names mean nothing without tasks: a debugging run is plain JAX.
        return x
    if st.ignore_transforms or not st.autoshard:
        return _jax_with_sharding_constraint(x, axis_resources)
    leaves, treedef = jax.tree.flatten(x)
    specs = _broadcast_prefix(axis_resources, x, len(leaves))
    out = [_constrain(leaf, s) for leaf, s in zip(leaves, specs)]
    return jax.tree.unflatten(treedef, out)


def is_spec(s) -> bool:
    """A leaf of a sharding prefix: a ``PartitionSpec``, a ``NamedSharding`` or None."""
    return s is None or isinstance(s, (PartitionSpec, NamedSharding))


def broadcast_prefix(prefix, tree) -> list:
    """One entry of ``prefix`` per leaf of ``tree``: ``prefix`` is a pytree prefix of
    ``tree`` whose leaves are specs (:func:`is_spec`), as ``jax.jit``'s shardings are.
    Raises jax's ``ValueError`` when it is not a prefix; callers say whose argument it was."""
    if is_spec(prefix):
        return [prefix] * len(jax.tree.leaves(tree))
    groups = jax.tree.map(lambda s, sub: [s] * len(jax.tree.leaves(sub)), prefix, tree,
                          is_leaf=is_spec)
    return [s for g in jax.tree.leaves(groups, is_leaf=lambda x: isinstance(x, list)) for s in g]


def _broadcast_prefix(prefix, tree, n):
    try:
        flat = broadcast_prefix(prefix, tree)
    except ValueError as e:
        raise MultimeshValueError(
            f"axis_resources structure does not match the value's structure: {e}") from None
    if len(flat) != n:
        raise MultimeshValueError(
            f"axis_resources of length {len(flat)} does not match args of length {n}.")
    return flat


def _constrain(leaf, spec):
    ndim = np.ndim(leaf)
    axes = logical_axes_of(spec, ndim)
    if not isinstance(leaf, Tracer):
        return leaf  # eager values carry no logical sharding; the marker is a no-op
    return bind_logical(leaf, axes)

