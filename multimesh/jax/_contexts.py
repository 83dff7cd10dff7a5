"""Thread-local switches: autoshard, ignore_transforms, fast path, recomputation.

Each is a context manager that also works with ``None`` (no change), so
``context(...)`` can forward all of them. State lives in one thread-local so
nested contexts restore the previous value on exit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from multimesh._src import jax_compat

if TYPE_CHECKING:
    from multimesh.jax._trace_notes import TraceNotes

__all__ = ["autoshard", "ignore_transforms", "enable_fast_path", "enable_recomputation",
           "context", "state", "program_devices", "push", "pop", "compile_state",
           "internal_trace", "traced_by_multimesh", "logical_rules"]


class _State(threading.local):
    def __init__(self):
        self.autoshard = False
        self.ignore_transforms = False
        self.fast_path = True
        self.recomputation = False
        self.program_devices = None  # tuple of jax.Device while mjit traces
        self.remat = None  # microbatch(..., remat=): tasks' default while its body is traced
        self.microbatch_loop = None  # number of microbatches while a loop body is traced
        self.trace_notes: TraceNotes | None = None  # filled while mjit traces
        self.internal_trace = False  # multimesh traces tasks outside mjit on purpose
        self.logical_rules: tuple[tuple[str, str], ...] = ()  # appended to every task's table
        self.overrides: list[list] = []  # [token, name, value to restore], oldest first


state = _State()


def push(name: str, value) -> object:
    """Set ``state.<name>`` until :func:`pop` of the returned token (see :func:`pop`)."""
    token = object()
    state.overrides.append([token, name, getattr(state, name)])
    setattr(state, name, value)
    return token


def pop(token) -> None:
    """Undo :func:`push`; tokens may be popped in any order.

    Popping the latest override of a name restores the value before it; popping an
    older one hands its saved value to the next override of that name, so once
    every override is popped the original value is back whatever the order
    (``MultiMesh`` contexts exited out of order).
    """
    ov = state.overrides
    i = next((i for i, e in enumerate(ov) if e[0] is token), None)
    if i is None:
        return
    _, name, old = ov.pop(i)
    later = next((e for e in ov[i:] if e[1] == name), None)
    if later is None:
        setattr(state, name, old)
    else:
        later[2] = old


@contextlib.contextmanager
def _set(name: str, value) -> Iterator[None]:
    if value is None:
        yield
        return
    token = push(name, value)
    try:
        yield
    finally:
        pop(token)


def compile_state() -> tuple:
    """This thread's switches that change what ``mjit`` compiles (part of its cache key).

    jax's own trace context (``jax_enable_x64``, the active mesh, ...) is included, as
    ``jax.jit`` includes it in its cache key.
    """
    st = state
    return (st.ignore_transforms, st.recomputation, st.fast_path, st.autoshard,
            st.program_devices, st.microbatch_loop, st.logical_rules, jax_compat.trace_context())


def autoshard(autoshard: bool | None = True):
    """Opens a context where sharding constraints become logical shardings.

    Inside it, :func:`multimesh.jax.with_sharding_constraint` records *logical*
    axis names that each task resolves through its ``logical_axes`` mapping.
    """
    return _set("autoshard", None if autoshard is None else bool(autoshard))


def logical_rules(pairs: tuple[tuple[str, str], ...]):
    """Opens a context where every task bound (or resolved while lowering) appends
    ``pairs``, priority-ordered ``(logical, device axis)`` pairs, to its own
    ``logical_axes``: one rule table per task, whatever wrote the rules (flax's
    ``nn.logical_axis_rules``, converted once by ``multimesh.jax.flax``). A pair naming
    a device axis the task's mesh lacks maps nothing in that task."""
    return _set("logical_rules", tuple(pairs))


def ignore_transforms(ignore: bool | None = True):
    """Debug context where every multimesh transformation is a no-op.

    ``task`` and ``microbatch`` return their function unchanged and
    ``with_sharding_constraint`` forwards to :func:`jax.lax.with_sharding_constraint`.
    """
    return _set("ignore_transforms", None if ignore is None else bool(ignore))


def enable_fast_path(enable: bool | None = True, context_value=None):
    """(En|dis)ables the native JAX fallthrough for single-task programs.

    When on (the default), a program that partitions into one fragment on all of
    its devices is compiled as one ordinary jax executable with no runtime
    dispatch of its own.
    """
    del context_value
    return _set("fast_path", None if enable is None else bool(enable))


def enable_recomputation(enable: bool | None = True, context_value=None):
    """(Dis|en)ables comm-avoiding recompute of inter-task intermediates.

    When on, a value that crosses submeshes and is cheap to recompute from data
    the consumer already has is recomputed in the consuming fragment instead of
    being transferred.
    """
    del context_value
    return _set("recomputation", None if enable is None else bool(enable))


@contextlib.contextmanager
def context(autoshard: bool | None = None, enable_recomputation: bool | None = None,
            enable_fast_path: bool | None = None, ignore_transforms: bool | None = None):
    """Configures several multimesh contexts in a single ``with`` statement."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_set("autoshard", autoshard))
        stack.enter_context(_set("recomputation", enable_recomputation))
        stack.enter_context(_set("fast_path", enable_fast_path))
        stack.enter_context(_set("ignore_transforms", ignore_transforms))
        yield


def program_devices(devices):
    """Set while tracing a program: the device list task positions refer to."""
    return _set("program_devices", None if devices is None else tuple(devices))


def internal_trace():
    """Set while multimesh itself traces tasks outside ``mjit`` (the shapes of an init
    function, a Flax init): their placement does not matter there, so no warning."""
    return _set("internal_trace", True)


def traced_by_multimesh() -> bool:
    """Whether a task bound now is traced by multimesh (``mjit``'s trace, or one of
    multimesh's own shape traces), so its placement is honoured or irrelevant."""
    return state.program_devices is not None or state.internal_trace


def notes(d: TraceNotes):
    """Collects facts the front end learns while tracing (e.g. the microbatch schedule)."""
    return _set("trace_notes", d)
