"""``multimesh.jax.task``: the core ``task``, which hands Flax modules to the Flax one.

A linen module (class or instance) or an NNX module instance given to the core
``task`` would become a plain function: a linen class fails inside flax, and an NNX
layer's parameters drop out of ``nnx.state``, so an optimizer never updates them.
They are wrapped by :func:`multimesh.jax.flax.task` instead, as ``mjit`` takes its
NNX detour; a function task called with NNX objects among its arguments runs as the
Flax one does too, so the objects' updates are written back. Both go through the
argument handlers (``_stages/handlers.py``): flax is never imported here, and a Flax
object exists only once the program imported flax itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

from multimesh.jax import _task
from multimesh.jax._stages import handlers
from multimesh.jax._task import Task, TaskFunction

__all__ = ["task"]


def task(fun: Callable, name: str | None = None, *, task: Task | None = None, **kwargs):
    """Wraps a function in an auto-sharding task context.

    The task runs on its own submesh (``mesh=`` a :class:`TaskMesh` or a
    :class:`jax.sharding.Mesh`, or ``devices=``/``device_axes=``), and logical
    sharding constraints inside it resolve through ``logical_axes``. A Flax module
    (a linen module class or instance, an NNX module instance) is wrapped as
    :func:`multimesh.jax.flax.task` wraps it, and a function called with NNX objects
    among its arguments writes their updates back, as under ``nnx.jit``.
    """
    wing = handlers.for_task(fun)
    if wing is not None:
        return wing.task(fun, name, task, kwargs)
    core = _task.task(fun, name, task=task, **kwargs)
    if core is fun or not handlers.may_claim_arguments():
        return core  # ignore_transforms, or no NNX object can reach it
    graph: list[Callable] = []  # the NNX flavour, built at the first call that needs it

    def wrapped(*args, **kw):
        handler = handlers.for_arguments((args, kw))
        if handler is None:
            return core(*args, **kw)
        if not graph:
            graph.append(handler.task(fun, name, task, kwargs))
        return graph[0](*args, **kw)

    wrapped.__name__ = core.__name__
    functools.update_wrapper(wrapped, fun, assigned=(), updated=())  # __wrapped__ only
    out = cast(TaskFunction, wrapped)
    out.mm_task = core.mm_task
    return out
