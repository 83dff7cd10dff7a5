"""How far the host may dispatch ahead of the devices: the run-ahead bound (issue 33).

The executor dispatches a step without waiting for its devices (jax's async dispatch),
and drops its references to a value right after its last reader is dispatched. The
buffer returns to the allocator only once that reader has run, and a call's output
buffers are taken when the call is dispatched. A host that runs far ahead therefore
holds at once what the schedule frees in between: the whole step's outputs, in the
worst case. The bound keeps at most ``limit`` fragment calls of one submesh in
flight: before dispatching the next, the host waits for the oldest to finish (on one
of its outputs). Then what the schedule frees is free by the time the calls it
makes room for allocate, give or take ``limit`` calls.

``$MULTIMESH_RUN_AHEAD`` sets the default for every program (a positive integer, or
``none`` for no bound); without it the default depends on the backend
(:data:`DEFAULTS`); ``MpmdCompiled.run_ahead`` sets one program's.

The generated dispatch function (:mod:`.codegen`) waits at the same points: the
windows' contents at each call are known when the function is written, so a wait is
one line (``wait(v12)``) on an output the function holds until then, as the
window would.
"""

from __future__ import annotations

import os
from collections import deque

from multimesh._src import jax_compat
from multimesh._src.errors import MultimeshValueError
from multimesh.runtime import steps as st
from multimesh.runtime.codegen import Emitter
from multimesh.runtime.plan import Plan

__all__ = ["RUN_AHEAD_ENV", "DEFAULTS", "default_run_ahead", "check_run_ahead", "bounded",
           "wait"]

RUN_AHEAD_ENV = "MULTIMESH_RUN_AHEAD"
DEFAULTS: dict[str, int | None] = {"cpu": 2}
"""The bound per backend (jax's platform name) when ``$MULTIMESH_RUN_AHEAD`` is unset;
``None`` (any backend not named: GPU, TPU) is no bound. GPUs free a buffer in stream
order, at its last reader's place in the device's queue, so running ahead costs them
no memory (``tools/gpu_smoke.py`` measures it)."""


def check_run_ahead(value, what: str = "run_ahead") -> int | None:
    """``value`` as a bound: a positive int, or None for no bound."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise MultimeshValueError(
        f"`{what}` must be a positive integer (the fragment calls of one submesh that "
        f"may be in flight at once) or None (no bound), got {value!r}.")


def default_run_ahead(platform: str) -> int | None:
    """The bound for a program on ``platform``: ``$MULTIMESH_RUN_AHEAD`` or
    :data:`DEFAULTS`."""
    env = os.environ.get(RUN_AHEAD_ENV, "").strip().lower()
    if not env:
        return DEFAULTS.get(platform)
    if env in ("none", "off"):
        return None
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise MultimeshValueError(
            f"{RUN_AHEAD_ENV} must be a positive whole number of fragment calls, or none "
            f"for no bound, got {os.environ[RUN_AHEAD_ENV]!r}; for example "
            f"{RUN_AHEAD_ENV}=2, or {RUN_AHEAD_ENV}=none to dispatch without waiting.")
    return n


wait = jax_compat.array_impl_type().block_until_ready
"""How the host waits for a call in flight: ``wait(output)`` blocks until the array is
ready (``jax.Array.block_until_ready``, unbound: the same C++ call)."""


class _Window:
    """The calls of one submesh in flight: an output of each, oldest first."""

    __slots__ = ("pending", "limit")

    def __init__(self, limit: int) -> None:
        self.pending: deque = deque()
        self.limit = limit


class BoundedCall(st.FragmentCall):
    """A :class:`~.steps.FragmentCall` that then waits for its submesh's oldest call in
    flight when more than the window's ``limit`` are (``watch``: which output of this
    call to wait on later; None: none can be, it is donated on)."""

    __slots__ = ("window", "watch")

    def __init__(self, call: st.FragmentCall, window: _Window, watch: int | None):
        super().__init__(call.fn, call.srcs, call.dsts, call.drop, call.origin)
        self.window, self.watch = window, watch

    def run(self, env: list) -> None:
        outs = self.fn(*[env[a] for a in self.srcs])
        for d, o in zip(self.dsts, outs):
            env[d] = o
        for d in self.drop:
            env[d] = None
        w = self.window
        if self.watch is not None:
            w.pending.append(outs[self.watch])
        while len(w.pending) > w.limit:
            wait(w.pending.popleft())

    def emit(self, em: Emitter) -> None:
        super().emit(em)
        pending = em.state.setdefault(id(self.window), [])
        if self.watch is not None:  # held as the window holds it: until waited on
            pending.append(self.dsts[self.watch])
            em.hold(pending[-1])
        while len(pending) > self.window.limit:
            vid = pending.pop(0)
            em.line(f"{em.const(wait, 'wait')}({em.value(vid)})")
            em.release(vid)


class Drain(st.Step):
    """The end of a run: let go of the outputs the windows still watch."""

    __slots__ = ("windows",)
    cat = "free"

    def __init__(self, windows: list[_Window]):
        super().__init__((), ())
        self.windows = windows

    def run(self, env: list) -> None:
        for w in self.windows:
            w.pending.clear()

    def emit(self, em: Emitter) -> None:
        for w in self.windows:
            for vid in em.state.pop(id(w), []):
                em.release(vid)

    def label(self, devices: tuple, plan) -> tuple[str, str]:
        return "host", "drain"


def bounded(program: list[st.Step], plan: Plan, limit: int | None,
            consumed: dict[int, set[int]]) -> list[st.Step]:
    """``program`` with each fragment call bounded to ``limit`` calls in flight on its
    submesh (unchanged when ``limit`` is None). ``consumed``: values that calls donate;
    a call waits on its smallest output that nothing donates."""
    if limit is None:
        return program
    gone = set().union(*consumed.values()) if consumed else set()
    windows: dict[tuple[int, ...], _Window] = {}
    out: list[st.Step] = []
    for s in program:
        if not isinstance(s, st.FragmentCall) or s.origin is None:
            out.append(s)
            continue
        where = plan.call_devices(s.origin)
        window = windows.setdefault(where, _Window(limit))
        types = plan.fragments[s.origin.fragment].out_types
        kept = [k for k, v in enumerate(s.dsts) if v not in gone]
        watch = min(kept, key=lambda k: _size(types[k]), default=None)
        out.append(BoundedCall(s, window, watch))
    out.append(Drain(list(windows.values())))
    return out


def _size(t) -> int:
    n = 1
    for d in t[0]:
        n *= d
    return n
