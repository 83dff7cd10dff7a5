"""The steps of a dispatch program: one class per kind, each with its own ``run``.

A run's values live in a flat list indexed by value id (``env``). A step reads
its sources from it, writes its destinations, and clears the slots of values it
was the last to read (``drop``), so their buffers are freed as soon as the
devices are done with them. :func:`run_program` is the one dispatch loop;
:func:`traced` and ``memory.measure_step`` wrap each step's ``run`` and hand the
wrappers to the same loop. :func:`route` is the one place that decides how a value moves.

Each step also writes its ``run`` as lines of a generated function (``emit``,
:mod:`.codegen`): an ordinary call runs the whole program as one straight-line
function, values in its locals, without a method call or list per step.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src import jax_compat
from multimesh._src.layouts import Placement
from multimesh.runtime.codegen import Emitter
from multimesh.runtime.plan import Call, Transfer

__all__ = ["Step", "FragmentCall", "BatchedCopy", "Move", "FreshCopy", "CrossProcess",
           "Free", "route", "run_program", "traced", "layout_sharding", "move", "copy", "place",
           "PLAIN_COPY", "MOVE", "FRESH_COPY", "CROSS_PROCESS"]


@functools.lru_cache(maxsize=8192)
def layout_sharding(layout: Placement, devices: tuple) -> NamedSharding:
    """The ``NamedSharding`` of ``layout`` on ``devices`` (cached: a program asks for
    the same few thousands of times while its fragments load, 28 µs each to build)."""
    pos, names, sizes, dims = layout
    mesh = Mesh(np.array([devices[p] for p in pos], dtype=object).reshape(sizes), names)
    spec = PartitionSpec(*[None if not d else (d[0] if len(d) == 1 else d) for d in dims])
    return NamedSharding(mesh, spec)


jax_compat.register_cache(layout_sharding, "multimesh: fragment layouts' shardings")


_shard_args = jax_compat.shard_args
_REUSE = [jax_compat.REUSE_INPUT]
_COPY = [jax_compat.ALWAYS_COPY]
_NO_LAYOUT = [None]


def move(x, sharding):
    """``jax.device_put(x, sharding)`` for a jax.Array, minus its Python overhead.

    ``shard_args`` is what jit uses to place arguments: it copies a same-layout
    array to other devices in one batched call and reshards otherwise (~7 µs of
    Python here versus ~35 µs for ``device_put``).
    """
    return _shard_args([sharding], _NO_LAYOUT, _REUSE, [x])[0]


def copy(x, sharding):
    """:func:`move` into fresh buffers, for a source that is donated later in the step.

    A move onto devices the source also lives on reuses the source's buffers there
    (whatever the copy semantics), so the moved array is copied once more.
    """
    return _shard_args([sharding], _NO_LAYOUT, _COPY, [move(x, sharding)])[0]


def place(x, sharding):
    """An argument onto its input sharding: :func:`move` for a jax.Array, else
    ``jax.device_put`` (a NumPy array, a Python scalar)."""
    return move(x, sharding) if isinstance(x, jax.Array) else jax.device_put(x, sharding)


# --------------------------------------------------------------------------- routes

PLAIN_COPY, MOVE, FRESH_COPY, CROSS_PROCESS = "plain copy", "move", "fresh copy", "cross process"
"""How a value moves between submeshes (:func:`route`)."""


def route(src: Placement | None, dst: Placement, *, fresh: bool = False,
          local: bool = True) -> str:
    """How a transfer from layout ``src`` to ``dst`` runs: the one place that decides.

    ``local`` False: the move crosses processes (:data:`CROSS_PROCESS`). ``fresh``:
    the source is a donated input moving onto its own devices, so the copy needs
    its own buffers (:data:`FRESH_COPY`). A move that only copies each shard to
    another device (same mesh shape and per-dimension axes) is a
    :data:`PLAIN_COPY` and may share one batched copy call with others; anything
    else reshards (:data:`MOVE`).
    """
    if not local:
        return CROSS_PROCESS
    if fresh:
        return FRESH_COPY
    if src is not None and src[1:] == dst[1:] and len(src[0]) == len(dst[0]):
        return PLAIN_COPY
    return MOVE


# --------------------------------------------------------------------------- steps


class Step:
    """One dispatch step: reads ``srcs``, writes ``dsts``, then clears ``drop``.

    ``origin`` is the plan step it runs (a :class:`Call` or :class:`Transfer`; None
    for a step that stands for several or none), for traces and memory profiles.
    """

    __slots__ = ("srcs", "dsts", "drop", "origin")
    cat = "transfer"
    """The trace category of its span."""

    def __init__(self, srcs, dsts, drop=(), origin=None):
        self.srcs, self.dsts, self.drop, self.origin = tuple(srcs), tuple(dsts), tuple(drop), origin

    def run(self, env: list) -> None:
        raise NotImplementedError

    def emit(self, em: Emitter) -> None:
        """Write what ``run`` does as lines of a generated function (:mod:`.codegen`)."""
        raise NotImplementedError

    def label(self, devices: tuple, plan) -> tuple[str, str]:
        """(track, name) of this step in a trace."""
        t = self.origin
        ids = ",".join(str(devices[p].id) for p in t.layout[0])
        return f"submesh devices {ids}", f"transfer %{t.src}"


class FragmentCall(Step):
    """A call of one fragment's executable (``fn``: jax's dispatch function)."""

    __slots__ = ("fn",)
    cat = "fragment"

    def __init__(self, fn, srcs, dsts, drop=(), origin=None):
        super().__init__(srcs, dsts, drop, origin)
        self.fn = fn

    def run(self, env: list) -> None:
        for d, o in zip(self.dsts, self.fn(*[env[a] for a in self.srcs])):
            env[d] = o
        for d in self.drop:
            env[d] = None

    def emit(self, em: Emitter) -> None:
        em.assign(self.dsts, f"{em.const(self.fn, 'call')}({em.values(self.srcs)})")
        em.drop(self.drop)

    def label(self, devices: tuple, plan) -> tuple[str, str]:
        where = plan.call_devices(self.origin)
        return (f"submesh devices {','.join(str(devices[p].id) for p in where)}",
                self.origin.fragment)


class BatchedCopy(Step):
    """Plain copies (:data:`PLAIN_COPY`) of several arrays in one host call."""

    __slots__ = ("args",)

    def __init__(self, shardings, srcs, dsts, drop=(), origin=None):
        super().__init__(srcs, dsts, drop, origin)
        self.args = ([jax_compat.device_list(s) for s in shardings], list(shardings),
                     [jax_compat.REUSE_INPUT] * len(shardings))

    def run(self, env: list) -> None:
        outs = jax_compat.batched_copy(list(map(env.__getitem__, self.srcs)), *self.args)
        for d, o in zip(self.dsts, outs):
            env[d] = o
        for d in self.drop:
            env[d] = None

    def emit(self, em: Emitter) -> None:
        rest = ", ".join(em.const(a, "copy_arg") for a in self.args)
        em.assign(self.dsts, f"{em.const(jax_compat.batched_copy, 'batched_copy')}"
                             f"([{em.values(self.srcs)}], {rest})")
        em.drop(self.drop)

    def label(self, devices: tuple, plan) -> tuple[str, str]:
        return "transfers", "copy " + ",".join(f"%{s}" for s in self.srcs)


class Move(Step):
    """One array onto ``sharding`` (:data:`MOVE`: a reshard, or a copy of one)."""

    __slots__ = ("sharding",)

    def __init__(self, sharding, src: int, dst: int, drop=(), origin=None):
        super().__init__((src,), (dst,), drop, origin)
        self.sharding = sharding

    def run(self, env: list) -> None:
        env[self.dsts[0]] = move(env[self.srcs[0]], self.sharding)
        for d in self.drop:
            env[d] = None

    def emit(self, em: Emitter) -> None:
        self._emit(em, move)

    def _emit(self, em: Emitter, how) -> None:
        em.set(self.dsts[0], f"{em.const(how, how.__name__)}({em.value(self.srcs[0])}, "
                           f"{em.const(self.sharding, 'sharding')})")
        em.drop(self.drop)


class FreshCopy(Move):
    """:class:`Move` into fresh buffers (:data:`FRESH_COPY`)."""

    __slots__ = ()

    def run(self, env: list) -> None:
        env[self.dsts[0]] = copy(env[self.srcs[0]], self.sharding)
        for d in self.drop:
            env[d] = None

    def emit(self, em: Emitter) -> None:
        self._emit(em, copy)


class CrossProcess(Step):
    """A move that crosses processes (:data:`CROSS_PROCESS`): ``fn(x) -> y``, a
    collective that every process holding one of its devices runs."""

    __slots__ = ("fn",)

    def __init__(self, fn, src: int, dst: int, drop=(), origin=None):
        super().__init__((src,), (dst,), drop, origin)
        self.fn = fn

    def run(self, env: list) -> None:
        env[self.dsts[0]] = self.fn(env[self.srcs[0]])
        for d in self.drop:
            env[d] = None

    def emit(self, em: Emitter) -> None:
        em.set(self.dsts[0], f"{em.const(self.fn, 'cross')}({em.value(self.srcs[0])})")
        em.drop(self.drop)


class Free(Step):
    """Delete donated inputs whose call's executable could not reuse their buffers
    (the donation only some calls of a fragment could make), after that call."""

    __slots__ = ()
    cat = "free"

    def __init__(self, values, origin=None):
        super().__init__(values, (), values, origin)

    def run(self, env: list) -> None:
        for d in self.srcs:
            env[d].delete()
            env[d] = None

    def emit(self, em: Emitter) -> None:
        for d in self.srcs:
            em.line(f"{em.value(d)}.delete()")
        em.drop(self.srcs)

    def label(self, devices: tuple, plan) -> tuple[str, str]:
        return "host", "free " + ",".join(f"%{s}" for s in self.srcs)


def reads(plan_step: Call | Transfer) -> tuple[int, ...]:
    """The values one plan step reads."""
    return tuple(plan_step.args) if isinstance(plan_step, Call) else (plan_step.src,)


# --------------------------------------------------------------------------- loops


def run_program(runs: list, env: list) -> list:
    """The dispatch loop: ``runs`` are the steps' bound ``run`` methods, or wrappers
    of them (:func:`traced`, ``memory.measure_step``)."""
    for run in runs:
        run(env)
    return env


def traced(steps: list, recorder, devices: tuple, plan) -> list:
    """Each step's ``run``, blocking after the step and recording its span on
    ``recorder`` (:class:`~multimesh.runtime.trace.TraceRecorder`): for
    :func:`run_program`. A span's arguments name the plan step it ran
    (``plan_step``, its index in ``plan.steps``), a call's fragment and microbatch,
    a transfer's values."""
    index = {id(s): i for i, s in enumerate(plan.steps)}

    def wrap(step: Step):
        track, name = step.label(devices, plan)
        args = _trace_args(step, index)

        def run(env: list) -> None:
            with recorder.span(track, name, **args):
                step.run(env)
                jax.block_until_ready([env[d] for d in step.dsts])
        return run
    return [wrap(s) for s in steps]


def _trace_args(step: Step, index: dict[int, int]) -> dict:
    """What a traced span records besides its name: see :func:`traced`."""
    out: dict = {} if step.cat == "fragment" else {"cat": step.cat}
    o = step.origin
    if o is None or id(o) not in index:
        return out
    out["plan_step"] = index[id(o)]
    if isinstance(o, Call):
        out["fragment"] = o.fragment
        if o.microbatch is not None:
            out["microbatch"] = o.microbatch
    else:
        out["src"], out["dst"] = o.src, o.dst
    return out
