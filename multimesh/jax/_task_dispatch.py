"""``multimesh.jax.task``: the core ``task``, which hands Flax modules to the Flax one.

A linen module (class or instance) or an NNX module instance given to the core
``task`` would become a plain function: a linen class fails inside flax, and an NNX
layer's parameters drop out of ``nnx.state``, so an optimizer never updates them.
They are wrapped by :func:`multimesh.jax.flax.task` instead, as ``mjit`` takes its
NNX detour; a function task called with NNX objects among its arguments runs as the
Flax one does too, so the objects' updates are written back. Flax is never imported
here: a Flax object exists only once the program imported flax itself.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import cast

from multimesh.jax import _task
from multimesh.jax._stages.mjit import _holds_nnx
from multimesh.jax._task import Task, TaskFunction

__all__ = ["task"]


def _is_flax_module(fun) -> bool:
    """A linen module class or instance, or an NNX module class or instance."""
    for name, attr in (("flax.linen", "Module"), ("flax.nnx", "Module")):
        mod = sys.modules.get(name)
        base = getattr(mod, attr, None) if mod is not None else None
        if base is not None and (isinstance(fun, base) or
                                 (isinstance(fun, type) and issubclass(fun, base))):
            return True
    return False


def _flax_task(fun, name, task, kwargs):
    from multimesh.jax.flax import _linen

    return _linen.task(fun, name, task=task, **kwargs)


def task(fun: Callable, name: str | None = None, *, task: Task | None = None, **kwargs):
    """Wraps a function in an auto-sharding task context.

    The task runs on its own submesh (``mesh=`` a :class:`TaskMesh` or a
    :class:`jax.sharding.Mesh`, or ``devices=``/``device_axes=``), and logical
    sharding constraints inside it resolve through ``logical_axes``. A Flax module
    (a linen module class or instance, an NNX module instance) is wrapped as
    :func:`multimesh.jax.flax.task` wraps it, and a function called with NNX objects
    among its arguments writes their updates back, as under ``nnx.jit``.
    """
    if _is_flax_module(fun):
        return _flax_task(fun, name, task, kwargs)
    core = _task.task(fun, name, task=task, **kwargs)
    if core is fun or "flax.nnx" not in sys.modules:
        return core  # ignore_transforms, or no NNX object can reach it
    graph: list[Callable] = []  # the NNX flavour, built at the first call that needs it

    def wrapped(*args, **kw):
        if not _holds_nnx((args, kw)):
            return core(*args, **kw)
        if not graph:
            graph.append(_flax_task(fun, name, task, kwargs))
        return graph[0](*args, **kw)

    wrapped.__name__ = core.__name__
    functools.update_wrapper(wrapped, fun, assigned=(), updated=())  # __wrapped__ only
    out = cast(TaskFunction, wrapped)
    out.mm_task = core.mm_task
    return out
