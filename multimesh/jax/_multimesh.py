"""Implicit tasks and MultiMesh contexts: ``register_task``, ``Context``, ``MultiMesh``.

A registered task is a *matcher* (a name or a regular expression searched in each
op's JAX name stack) plus either a fixed :class:`Task` or a callback
``callback(matched_name, backprop) -> Task``. Registrations live in contexts: the
module-level default context and any entered :class:`Context`/:class:`MultiMesh`.
When :func:`multimesh.jax.mjit` compiles a program it asks this module for the
active rules (:func:`implicit_tasks_pass`): the lowered module is scanned for
matches, callbacks are called once per distinct ``(matched name, backprop)``,
each task is resolved to concrete device positions, and the resolved rules are
handed to the ``mm-match-tasks`` pass in memory (:func:`implicit_tasks_pass`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import threading
import warnings
from collections.abc import Callable, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from multimesh._src import jax_compat
from multimesh._src.errors import (
    MeshError,
    MultimeshTypeError,
    MultimeshValueError,
    MultimeshWarning,
)
from multimesh.jax import _checks, _contexts

__all__ = ["Context", "MultiMesh", "register_task", "clear_tasks", "tasks",
           "slice_global_mesh", "current_global_mesh", "active_multimesh", "implicit_task_rules", "compile_token"]


# --------------------------------------------------------------------------- registrations


@dataclasses.dataclass(frozen=True, eq=False)
class _Registration:
    matcher: str  # as the user gave it
    regex: re.Pattern  # with its capture group
    callback: Callable | None
    task: object | None  # a Task

    def __repr__(self):
        what = f"callback={self.callback!r}" if self.callback is not None else f"task={self.task!r}"
        return f"register_task({self.matcher!r}, {what})"

    def task_for(self, name: str, backprop: bool):
        from multimesh.jax._task import Task

        if self.callback is None:
            return self.task
        result = self.callback(name, backprop)
        if not isinstance(result, Task):
            raise MultimeshTypeError(
                f"The callback registered for task matcher {self.matcher!r} must return a "
                f"multimesh.jax.Task, but for ({name!r}, backprop={backprop}) it returned "
                f"{type(result).__name__} {result!r}.")
        if result.mesh is None and result.mesh_slice is None:
            raise MultimeshValueError(
                f"The callback registered for task matcher {self.matcher!r} returned a Task "
                f"for ({name!r}, backprop={backprop}) with neither `mesh` nor `mesh_slice`; "
                f"give one of them so the matched ops have a submesh.")
        return result


def _make_registration(matcher, callback, task) -> _Registration:
    from multimesh.jax._task import Task
    from multimesh.passes.api import compile_matcher

    if not isinstance(matcher, str):
        raise MultimeshTypeError(
            f"A task matcher must be a string (a name or a regular expression), got "
            f"{type(matcher).__name__} {matcher!r}.")
    if callback is None and task is None:
        raise MultimeshValueError(
            f"register_task({matcher!r}) needs either `callback=` (called as "
            f"callback(matched_name, backprop) -> Task) or `task=` (a Task); it got neither.")
    if callback is not None and task is not None:
        raise MultimeshValueError(
            f"register_task({matcher!r}) got both `callback=` and `task=`; give only one.")
    if callback is not None and not callable(callback):
        raise MultimeshTypeError(
            f"register_task({matcher!r}): `callback` must be callable, got "
            f"{type(callback).__name__}.")
    if task is not None:
        if not isinstance(task, Task):
            raise MultimeshTypeError(
                f"register_task({matcher!r}): `task` must be a multimesh.jax.Task, got "
                f"{type(task).__name__} {task!r}.")
        if task.mesh is None and task.mesh_slice is None:
            raise MultimeshValueError(
                f"register_task({matcher!r}): the Task has neither `mesh` nor `mesh_slice`; "
                f"give one of them so the matched ops have a submesh.")
    regex = compile_matcher(matcher)
    return _Registration(matcher, regex, callback, task)


@dataclasses.dataclass(eq=False)
class _Frame:
    context: Context
    live: list  # the registrations in effect while this frame is entered


class Context(contextlib.ContextDecorator):
    """A scope for registered tasks: they take effect only while it is entered.

    Contexts nest; when an op matches tasks of several contexts the innermost
    context wins, and within one context the earliest registration wins.
    """

    def __init__(self):
        self._registrations: list[_Registration] = []
        self._frames: list[_Frame] = []  # where this context is entered, in any thread

    def register_task(self, matcher: str, *, callback: Callable | None = None,
                      task=None) -> None:
        """Register a task for ops whose name stack matches ``matcher``.

        ``matcher`` is a name or a regular expression, searched anywhere in each op's
        name stack (``re.search``); without a capture group it is wrapped in one, and
        the first capture group is the *matched name*. Give ``task`` (a
        :class:`Task`) or ``callback(matched_name, backprop) -> Task``; ``backprop``
        is true for ops of the backward pass. A task without a ``name`` is named
        after the matched name. Registering a matcher this context already has
        replaces its rule (with a :class:`MultimeshWarning`, unless the rule is the
        same). A compiled program in which a matcher claims no op warns too.
        """
        reg = _make_registration(matcher, callback, task)
        with _LOCK:
            self._register(matcher, reg)

    def _register(self, matcher: str, reg: _Registration) -> None:
        old = next((r for r in self._registrations if r.matcher == matcher), None)
        if old is not None:
            frames = list(self._frames)
            in_effect = not frames or any(old in f.live for f in frames)  # not cleared
            if in_effect and old.callback is reg.callback and old.task == reg.task:
                return  # the same rule again: nothing changes
            if in_effect:
                warnings.warn(
                    f"register_task({matcher!r}): this matcher is already registered in this "
                    f"context; the new {_what(reg)} replaces the earlier {_what(old)} "
                    f"(keeping its priority). Register a different matcher to keep both.",
                    MultimeshWarning, stacklevel=_user_level())
            self._registrations[self._registrations.index(old)] = reg
            for frame in frames:
                if frame.live is self._registrations:
                    continue
                if old in frame.live:
                    frame.live[frame.live.index(old)] = reg
                else:
                    frame.live.append(reg)
            return
        self._registrations.append(reg)
        for frame in self._frames:
            if frame.live is not self._registrations:
                frame.live.append(reg)

    @property
    def registered(self) -> tuple[_Registration, ...]:
        return tuple(self._registrations)

    def __enter__(self):
        with _LOCK:
            frame = _Frame(self, list(self._registrations))
            self._frames.append(frame)
        _local.frames.append(frame)
        return self

    def __exit__(self, *exc):
        frames = _local.frames
        for i in range(len(frames) - 1, 0, -1):
            if frames[i].context is self:
                with _LOCK:
                    self._frames.remove(frames[i])
                del frames[i]
                return False
        raise MultimeshValueError(
            f"{type(self).__name__}.__exit__ was called without a matching __enter__ in "
            f"this thread; use the context in a `with` statement (or as a decorator) so "
            f"that every exit has its enter.")


_LOCK = threading.RLock()
_default = Context()
_default_frame = _Frame(_default, _default._registrations)


class _Stacks(threading.local):
    """Entered contexts and MultiMeshes are per thread; the default context is shared."""

    def __init__(self):
        self.frames: list[_Frame] = [_default_frame]
        self.meshes: list[tuple[MultiMesh, object]] = []  # (mesh, autoshard token)


_local = _Stacks()


def register_task(matcher: str, *, callback: Callable | None = None, task=None) -> None:
    """Register a task in the innermost entered :class:`Context` (or globally).

    See :meth:`Context.register_task`. Outside every context the registration is
    global and lasts until :func:`clear_tasks`.
    """
    _local.frames[-1].context.register_task(matcher, callback=callback, task=task)


def clear_tasks() -> None:
    """Remove every registered task that is in effect (global and entered contexts).

    A context's own registrations come back the next time it is entered.
    """
    with _LOCK:
        for frame in _local.frames:
            frame.live.clear()


@contextlib.contextmanager
def tasks(configurable: Callable | None = None):
    """Scope a set of registrations: clear, run ``configurable``, clear on exit.

    ``configurable()`` is called (and its result too, if callable) to register
    tasks; with ``None`` this context does nothing.
    """
    if configurable is None:
        yield
        return
    clear_tasks()
    try:
        obj = configurable()
        if callable(obj):
            obj()
        yield
    finally:
        clear_tasks()


def active_registrations() -> list[_Registration]:
    """Registrations in priority order: innermost context first, then registration order."""
    out: list[_Registration] = []
    for frame in reversed(_local.frames):
        out.extend(frame.live)
    return out


def compile_token() -> tuple:
    """What a compiled program depends on in this thread (for ``mjit``'s cache key):
    the registered tasks, the active MultiMesh and the context switches."""
    return (tuple(active_registrations()), active_multimesh(), _contexts.compile_state())


# --------------------------------------------------------------------------- MultiMesh


class MultiMesh(Context, Mesh):
    """A global mesh that tasks carve submeshes out of, and a task context.

    ``MultiMesh(global_mesh=mesh)`` wraps a :class:`jax.sharding.Mesh`;
    ``MultiMesh(axis_sizes=..., axis_names=..., devices=None)`` builds one (from
    ``jax.devices()`` by default). It *is* a :class:`jax.sharding.Mesh` (the
    devices and axes of the wrapped one, and equal to it), so
    ``NamedSharding(multi_mesh, spec)``, ``shard_map(..., mesh=multi_mesh)`` and
    ``jax.set_mesh(multi_mesh)`` work as with the wrapped mesh. Entering it
    (``with`` or as a decorator) turns on :func:`autoshard`, makes it the active
    global mesh — a task with ``mesh_slice={"stage": 0}`` then runs on
    ``self.slice(stage=0)`` — and makes its registered tasks take effect. Programs
    compiled inside use its devices as their device list unless given others.
    """

    # jax's Mesh is interned and immutable; a MultiMesh is neither (it holds task
    # registrations), so it is built here and keeps attributes of its own.
    __setattr__ = object.__setattr__
    __delattr__ = object.__delattr__
    global_mesh: Mesh  # the wrapped mesh (set in __new__)

    def __new__(cls, *, axis_sizes=None, axis_names=None, devices=None,
                global_mesh: Mesh | None = None):
        mesh = _global_mesh_of(axis_sizes, axis_names, devices, global_mesh)
        obj = object.__new__(cls)
        # Every field jax's Mesh.__new__ sets: devices, axis_names, axis_types, size, and
        # on jax >= 0.11 the cached device list that shardings read.
        for field, value in vars(mesh).items():
            object.__setattr__(obj, field, value)
        object.__setattr__(obj, "global_mesh", mesh)
        return obj

    def __init__(self, *, axis_sizes=None, axis_names=None, devices=None,
                 global_mesh: Mesh | None = None):
        del axis_sizes, axis_names, devices, global_mesh  # read by __new__
        Context.__init__(self)

    @property
    def mesh(self) -> Mesh:
        """The wrapped :class:`jax.sharding.Mesh`."""
        return self.global_mesh

    # Equal to (and hashed like) the mesh it wraps: a sharding on either is the same.
    def __eq__(self, other):
        if isinstance(other, MultiMesh):
            other = other.global_mesh
        return other is self.global_mesh

    def __hash__(self):
        return hash(self.global_mesh)

    def __reduce__(self):  # pickles as the plain mesh: registrations are not data
        return (_identity, (self.global_mesh,))

    def __repr__(self):
        return f"MultiMesh({self.global_mesh!r})"

    def _slice_devices(self, kw: Mapping[str, int], who: str = "MultiMesh.slice") -> np.ndarray:
        return _slice_devices(self.global_mesh, kw, who)

    def slice(self, **to_slice: int) -> Mesh:
        """The submesh at ``{axis: index}``; sliced axes stay, with size 1."""
        devs = self._slice_devices(to_slice)
        return Mesh(devs, self.global_mesh.axis_names,
                    axis_types=self.global_mesh.axis_types)

    def single_slice_devices(self, **to_slice: int) -> list:
        """The devices of :meth:`slice`, flattened in mesh order."""
        return list(self._slice_devices(to_slice).flat)

    def single_slice_ids(self, **to_slice: int) -> list[int]:
        """The device ids of :meth:`slice`, flattened in mesh order."""
        return [d.id for d in self._slice_devices(to_slice).flat]

    def __enter__(self):
        token = _contexts.push("autoshard", True)
        Context.__enter__(self)
        _local.meshes.append((self, token))
        return self

    def __exit__(self, *exc):
        # Exits may come in any order (two MultiMeshes closed out of order): each one
        # undoes only its own entries, and autoshard comes back once all are closed.
        meshes = _local.meshes
        for i in range(len(meshes) - 1, -1, -1):
            if meshes[i][0] is self:
                _, token = meshes.pop(i)
                break
        else:
            raise MultimeshValueError(
                "MultiMesh.__exit__ was called without a matching __enter__ in this "
                "thread; use the MultiMesh in a `with` statement (or as a decorator) so "
                "that every exit has its enter.")
        try:
            Context.__exit__(self, *exc)
        finally:
            _contexts.pop(token)
        return False


def _identity(x):
    return x


def _global_mesh_of(axis_sizes, axis_names, devices, global_mesh) -> Mesh:
    """The jax Mesh a ``MultiMesh(...)`` call describes."""
    if global_mesh is not None:
        if axis_sizes is not None or axis_names is not None or devices is not None:
            raise MultimeshValueError(
                "MultiMesh takes either `global_mesh` or `axis_sizes`/`axis_names`/"
                "`devices`, not both.")
        if isinstance(global_mesh, MultiMesh):
            return global_mesh.global_mesh
        if not isinstance(global_mesh, Mesh):
            raise MultimeshTypeError(
                f"MultiMesh `global_mesh` must be a jax.sharding.Mesh, got "
                f"{type(global_mesh).__name__}.")
        return global_mesh
    if axis_names is None:
        raise MultimeshValueError(
            "MultiMesh needs `axis_names` (with `axis_sizes` and/or `devices`) or a "
            "`global_mesh`.")
    axis_names = _checks.axis_names(axis_names, "MultiMesh")
    devs = np.asarray(jax.devices() if devices is None else devices, dtype=object)
    if axis_sizes is not None:
        axis_sizes = _checks.axis_sizes(axis_sizes, "MultiMesh")
        if len(axis_sizes) != len(axis_names):
            raise MeshError(
                f"MultiMesh got {len(axis_names)} axis names {axis_names} but "
                f"{len(axis_sizes)} axis sizes {axis_sizes}.")
        if int(np.prod(axis_sizes)) != devs.size:
            raise MeshError(
                f"MultiMesh axis_sizes {axis_sizes} describe {int(np.prod(axis_sizes))}"
                f" devices but {devs.size} devices were given.")
        devs = devs.reshape(axis_sizes)
    elif devs.ndim != len(axis_names):
        raise MeshError(
            f"MultiMesh devices have shape {devs.shape} but axis_names {axis_names} "
            f"name {len(axis_names)} axes; give axis_sizes to reshape them.")
    return Mesh(devs, axis_names)


def _slice_devices(mesh: Mesh, kw: Mapping[str, int], who: str) -> np.ndarray:
    """The devices of ``mesh`` at ``{axis: index}`` (sliced axes kept with size 1)."""
    names = tuple(mesh.axis_names)
    shape = mesh.devices.shape
    unknown = sorted(set(kw) - set(names))
    if unknown:
        raise MeshError(
            f"{who}: unknown axis name(s) {unknown}; the global mesh has axes {names}.")
    idx = []
    for name, size in zip(names, shape, strict=True):
        if name not in kw:
            idx.append(slice(None))
            continue
        i = kw[name]
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise MeshError(
                f"{who}: the index for axis {name!r} must be an integer, got {i!r}.")
        if not 0 <= int(i) < size:
            raise MeshError(
                f"{who}: index {int(i)} is out of range for axis {name!r} of size {size} "
                f"(valid indices are 0..{size - 1}).")
        idx.append(slice(int(i), int(i) + 1))
    return mesh.devices[tuple(idx)]


def active_multimesh() -> MultiMesh | None:
    """The innermost :class:`MultiMesh` entered in this thread, if any."""
    meshes = _local.meshes
    return meshes[-1][0] if meshes else None


def current_global_mesh() -> Mesh | None:
    """The global mesh a ``mesh_slice`` cuts: the innermost entered :class:`MultiMesh`,
    else jax's current mesh (``jax.set_mesh(mesh)``, then ``with mesh:``), else None."""
    mm = active_multimesh()
    if mm is not None:
        return mm.global_mesh
    mesh = jax_compat.concrete_mesh()
    return mesh.global_mesh if isinstance(mesh, MultiMesh) else mesh


def slice_global_mesh(name: str, mesh_slice: Mapping[str, int]) -> Mesh:
    """The submesh a task's ``mesh_slice`` selects in the current global mesh."""
    mesh = current_global_mesh()
    if mesh is None:
        raise MeshError(
            f"Task {name!r} has mesh_slice={dict(mesh_slice)!r}, but there is no global mesh "
            f"to slice. A mesh_slice selects part of the global mesh: compile inside "
            f"`with MultiMesh(...):` or `with jax.set_mesh(mesh):` (or decorate the function "
            f"with the MultiMesh), or give the task a `mesh` instead.")
    if not isinstance(mesh_slice, Mapping):
        raise MultimeshTypeError(
            f"Task {name!r}: `mesh_slice` must be a mapping {{axis_name: index}}, got "
            f"{type(mesh_slice).__name__} {mesh_slice!r}.")
    devs = _slice_devices(mesh, dict(mesh_slice), who=f"Task {name!r} mesh_slice")
    return Mesh(devs, mesh.axis_names, axis_types=mesh.axis_types)


# --------------------------------------------------------------------------- compile hook


def _what(reg: _Registration) -> str:
    return "callback" if reg.callback is not None else "task"


def _user_level() -> int:
    """``stacklevel`` of the first frame outside multimesh (for warnings)."""
    import sys
    import types

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def _warn_unmatched(regs: list[_Registration], hits, stacks: set[str]) -> None:
    """A registered matcher that claims no op of a compiled program is almost always a
    typo (or a rule for another program): say so, with the names it might have meant.

    A rule that an inner context overrides (the ops it matches go to the inner
    context's rule) is meant to be quiet there and is not reported.
    """
    claimed = {h.matcher_index for h in hits}
    owner = [id(frame) for frame in reversed(_local.frames) for _ in frame.live]
    for i, reg in enumerate(regs):
        if i in claimed:
            continue
        matching = [st for st in stacks if reg.regex.search(st)]
        if matching:
            winners = {next(j for j, r in enumerate(regs) if r.regex.search(st))
                       for st in matching}
            if all(owner[j] != owner[i] for j in winners):
                continue  # overridden by an inner context, on purpose
            why = ("every op it matches is claimed by a rule registered before it in the "
                   "same context")
            hint = ""
        else:
            why = "no op's name stack contains a match"
            hint = _near_names(reg, stacks)
        warnings.warn(
            f"Task matcher {reg.matcher!r} claimed no op of this program: {why}, so it "
            f"places nothing.{hint}", MultimeshWarning, stacklevel=_user_level())


def _scope_names(stacks: set[str], paths: bool) -> list[str]:
    """The scopes of the name stacks; with ``paths`` also each two consecutive scopes
    (``blocks/3``), the names a matcher with a ``/`` (an NNX graph path) means."""
    out: set[str] = set()
    for st in stacks:
        parts = [p for p in st.split("/")[:-1]
                 if p and not p.startswith(("jit(", "pjit(", "transpose(", "jvp("))]
        out.update(parts)
        if paths:
            out.update(f"{a}/{b}" for a, b in zip(parts, parts[1:]))
    return sorted(out)


def _near_names(reg: _Registration, stacks: set[str]) -> str:
    scopes = _scope_names(stacks, "/" in reg.matcher)
    if not scopes:
        return ""
    folded = [m for m in scopes if re.search(reg.regex.pattern, m, re.IGNORECASE)]
    if folded:
        return f" Ignoring case it would match {', '.join(map(repr, folded[:3]))}."
    text = re.sub(r"\\[dDwWsS][+*?]?|[()\[\]^$+*?|{}]", "", reg.matcher).lower()
    near = difflib.get_close_matches(text, [m.lower() for m in scopes], n=3, cutoff=0.6)
    by_lower = {m.lower(): m for m in scopes}
    if near:
        return f" Did you mean {', '.join(repr(by_lower[n]) for n in near)}?"
    return ""


def _direction(backprop: bool) -> str:
    return "backward" if backprop else "forward"


def implicit_task_rules(program):
    """The rules of ``mm-match-tasks`` for the lowered program (in memory), or None.

    ``program`` is the parsed module (``mjit.lower`` parses once and shares it) or
    its text. Must run while the program's device list is set (``mjit.lower``): task
    meshes are resolved to positions in it.
    """
    regs = active_registrations()
    if not regs or _contexts.state.ignore_transforms:
        return None
    from multimesh._src.mlir import make_context, parse_module
    from multimesh.jax._task import loop_placement, resolve_task_info
    from multimesh.passes.api import Rule, RuleTask, find_matches

    module = parse_module(program, make_context()) if isinstance(program, str) else program
    stacks: set[str] = set()
    hits = find_matches(module, [r.regex for r in regs], stacks)
    _warn_unmatched(regs, hits, stacks)
    if not hits:
        return None
    entries: dict[int, list] = {}
    seen: dict[str, tuple] = {}  # task name -> (TaskInfo, description)
    for hit in hits:
        reg = regs[hit.matcher_index]
        spec = reg.task_for(hit.name, hit.backprop)
        name = spec.name or hit.name
        info = resolve_task_info(spec, name)
        _note_remat(spec, name, reg, hit)
        if spec.loop_dependent_mesh_slice is not None:
            info = loop_placement(spec, name, info, _num_microbatches())
        what = (f"match {hit.name!r} ({_direction(hit.backprop)}) of task matcher "
                f"{reg.matcher!r}")
        old = seen.get(name)
        if old is not None:
            prev, prev_what = old
            if (prev.devices, prev.axis_names, prev.axis_sizes) != (
                    info.devices, info.axis_names, info.axis_sizes):
                raise MultimeshValueError(
                    f"Task name {name!r} was given two different device sets: {prev_what} "
                    f"puts it on device positions {list(prev.devices)} "
                    f"({_axes(prev)}), {what} on {list(info.devices)} ({_axes(info)}). One "
                    f"task name has one submesh: return a different Task name for each "
                    f"submesh (e.g. f\"{{name}}_fwd\" / f\"{{name}}_bwd\").")
            if prev.logical_axes != info.logical_axes:
                raise MultimeshValueError(
                    f"Task name {name!r} was given two different logical mappings: {prev_what}"
                    f" maps {[list(p) for p in prev.logical_axes]}, {what} maps "
                    f"{[list(p) for p in info.logical_axes]}. Give each mapping its own "
                    f"task name.")
        else:
            seen[name] = (info, what)
        mesh = info.mesh()
        entries.setdefault(hit.matcher_index, []).append(
            ((hit.name, hit.backprop), RuleTask(name, mesh)))
    return tuple(Rule(regs[i].regex.pattern, regs[i].regex, None, tuple(entries[i]))
                 for i in sorted(entries))


def _note_remat(spec, name: str, reg: _Registration, hit) -> None:
    """Record a registered task whose backward recomputes its forward (``Task.remat``,
    else ``microbatch(..., remat=)``) for ``mm-recompute-forward``."""
    notes = _contexts.state.trace_notes
    if notes is None:
        return
    remat = spec.remat if spec.remat is not None else notes.remat
    if remat is None or remat is False:
        return
    if remat is not True:
        raise MultimeshValueError(
            f"Task {name!r} (match {hit.name!r} of task matcher {reg.matcher!r}) is a "
            f"registered task, whose forward multimesh finds in the traced program, so it "
            f"can only be recomputed whole: `remat` must be True or False for it, got the "
            f"checkpoint policy {_policy_name(remat)}. Wrap the stage in `task(..., remat=policy)` to "
            f"recompute it under a jax checkpoint policy.")
    notes.remat_tasks.add(name)


def _policy_name(policy) -> str:
    """A checkpoint policy by its public name (``jax.checkpoint_policies.dots_saveable``):
    its repr differs by jax version (a function on 0.10, a class instance on 0.12)."""
    for attr in dir(jax.checkpoint_policies):
        try:
            same = getattr(jax.checkpoint_policies, attr) is policy
        except Exception:  # noqa: BLE001 - an attribute that cannot be read is not it
            same = False
        if same:
            return f"`jax.checkpoint_policies.{attr}`"
    return f"`{getattr(policy, '__name__', type(policy).__name__)}`"


def _num_microbatches() -> int | None:
    """The program's microbatch count, once its microbatch loop has been traced."""
    notes = _contexts.state.trace_notes
    cfg = notes.microbatch if notes is not None else None
    return cfg.num_microbatches if cfg else None


def _axes(info) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(info.axis_names, info.axis_sizes, strict=True))
