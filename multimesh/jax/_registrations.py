"""Registered tasks and the contexts that scope them: ``register_task``, ``Context``.

A registered task is a *matcher* (a name or a regular expression searched in each
op's JAX name stack) plus either a fixed :class:`Task` or a callback
``callback(matched_name, backprop) -> Task``. Registrations live in contexts: the
module-level default context and any entered :class:`Context` (a ``MultiMesh`` is
one too). ``_implicit_tasks`` turns the active ones into the ``mm-match-tasks`` pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import warnings
from collections.abc import Callable

from multimesh._src.errors import (
    MultimeshTypeError,
    MultimeshValueError,
    MultimeshWarning,
    user_stacklevel,
)
from multimesh.jax._task import Task
from multimesh.passes.api import compile_matcher

__all__ = ["Context", "Registration", "register_task", "clear_tasks", "tasks",
           "active_registrations", "entered_frames", "user_level"]


@dataclasses.dataclass(frozen=True, eq=False)
class Registration:
    matcher: str  # as the user gave it
    regex: re.Pattern  # with its capture group
    callback: Callable | None
    task: object | None  # a Task

    def __repr__(self):
        what = f"callback={self.callback!r}" if self.callback is not None else f"task={self.task!r}"
        return f"register_task({self.matcher!r}, {what})"

    def task_for(self, name: str, backprop: bool):
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


def _make_registration(matcher, callback, task) -> Registration:
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
    return Registration(matcher, regex, callback, task)


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
        self._registrations: list[Registration] = []
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

    def _register(self, matcher: str, reg: Registration) -> None:
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
                    MultimeshWarning, stacklevel=user_level())
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
    def registered(self) -> tuple[Registration, ...]:
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
    """Entered contexts are per thread; the default context is shared."""

    def __init__(self):
        self.frames: list[_Frame] = [_default_frame]


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


def active_registrations() -> list[Registration]:
    """Registrations in priority order: innermost context first, then registration order."""
    out: list[Registration] = []
    for frame in reversed(_local.frames):
        out.extend(frame.live)
    return out


def _what(reg: Registration) -> str:
    return "callback" if reg.callback is not None else "task"


def user_level() -> int:
    """``stacklevel`` of the first frame outside multimesh, jax and flax (for warnings
    issued by this function's caller)."""
    return max(1, user_stacklevel() - 1)


def entered_frames() -> list[_Frame]:
    """This thread's entered contexts, outermost (the default context) first."""
    return _local.frames
