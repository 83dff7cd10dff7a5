"""What every stage of ``mjit`` shares: the record of a lowered program and the small
base that speaks jax's stage protocol (``jax.stages.Traced``/``Lowered``/``Compiled``).

``LoweredProgram`` is built once, by ``MpmdTraced.lower`` (or ``compile_mpmd``), and
never changes: ``MpmdLowered``, ``MpmdCompiled`` and the fast path's ``FastCompiled``
hold it. ``StageBase`` gives every stage (``MpmdTraced`` too) one error for what jax's
stage has but an MPMD program does not offer (the class's ``_not_offered`` table);
``ProgramStage`` adds ``in_tree``/``out_tree``/``in_avals`` from the record; ``StageWrapper`` is the base of a
stage that wraps another (the NNX ones), answering what it does not define itself from
the stage inside.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from multimesh._src.errors import MultimeshAttributeError
from multimesh.passes.api import Pipeline

__all__ = ["LoweredProgram", "RECORD_FIELDS", "ProgramStage", "StageBase", "StageWrapper", "forward", "missing_attribute"]


@dataclasses.dataclass(frozen=True, slots=True)
class LoweredProgram:
    """A lowered program, as ``compile()`` reads it."""

    program: str | bytes
    """The program as MLIR text or bytecode (jax's lowering, inputs pinned)."""
    devices: tuple
    """The program's devices; ``TaskMesh`` positions refer to them."""
    in_tree: Any
    """The tree of the arguments, ``(args, kwargs)``, that calls take."""
    out_tree: Any
    dyn_idx: tuple[int, ...]
    """The leaves of ``in_tree`` the program takes, in order."""
    pipeline: Pipeline
    """The pass pipeline ``compile()`` runs (``mm-opt -p`` replays it)."""
    donated_leaves: tuple[int, ...] = ()
    schedule_config: Mapping | None = None
    """``mm.schedule_config``: the microbatch loop's options, if any."""
    key_inputs: tuple[bool, ...] = ()
    """Per argument leaf, whether it is a typed PRNG key (they cross the runtime as
    their raw data); () when none is."""
    key_outputs: tuple = ()
    """Per output leaf, the PRNG key implementation of a typed key, else None; () when
    no output is a key."""
    in_avals: tuple | None = None
    name: str | None = None
    """The compiled function's name: logs and ``MULTIMESH_DUMP_IR_TO``."""
    out_placements: Mapping[int, Any] = dataclasses.field(default_factory=dict)
    """Output leaf -> the physical ``out_shardings`` entry it is moved onto after a run."""
    explicit_outputs: tuple[tuple[str, ...], ...] = ()
    """Per output leaf, the mesh axes its type names as explicit (jax's explicit
    sharding mode: the output comes back on a mesh with those axes ``Explicit``, as
    from ``jax.jit``); () when no output is typed so."""
    unused_leaves: frozenset[int] = frozenset()
    """Argument leaves the program never reads; ``keep_unused=False`` reports None as
    their input sharding (as ``jax.jit``), and no fragment receives them."""
    default_mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    """(axis names, sizes) of the implicit default task, if not x=N."""
    fast: Any = None
    """A ``FastPath`` when the program takes ``enable_fast_path``'s ``jax.jit`` route."""
    trace_seconds: float = 0.0
    """How long tracing and lowering took (the first phase of ``compile_times``)."""
    call_counters: tuple | None = None
    """A program ``compile_mpmd`` imported: per fragment call, the ``call_counter``
    the partitioner left on it (or None); its schedule is recovered from the call
    order (``multimesh.jax._imported_schedule``), not read from the module."""
    host_callbacks: Sequence[Callable] = ()
    """The Python callbacks the program calls (jax.debug.print, ...), kept alive here
    while it may compile (``multimesh._src.callbacks``)."""

    @property
    def label(self) -> str:
        """How logs name the program: ``mjit(<function name>)``."""
        return f"mjit({self.name})" if self.name else "mjit"


RECORD_FIELDS = frozenset(f.name for f in dataclasses.fields(LoweredProgram)) | {"label"}
"""The record's names, which ``MpmdLowered`` answers as its own attributes."""


def forward(holder: str, name: str, doc: str | None = None) -> Any:
    """A read-only property: ``self.<holder>.<name>``."""
    return property(lambda self: getattr(getattr(self, holder), name), doc=doc)


class StageBase:
    """jax's stage protocol: what jax's stage (``_jax_class``) has and this one does not
    offer raises an error saying why (``_not_offered``)."""

    _jax_class: ClassVar[str]
    _not_offered: ClassVar[dict[str, str]] = {}

    def __getattr__(self, name):
        raise missing_attribute(self, name)


class ProgramStage(StageBase):
    """A stage of a lowered program: its ``record``, and the trees and types of calls."""

    record: LoweredProgram

    in_tree = forward("record", "in_tree",
                      "The tree of the dynamic arguments, ``(args, kwargs)``, that calls take.")
    out_tree = forward("record", "out_tree", "The tree of the outputs.")
    in_avals = forward("record", "in_avals", "The dynamic argument leaves' types.")


class StageWrapper:
    """A stage around another (``inner``): what it does not define is the inner one's."""

    inner: Any

    def __getattr__(self, name):
        if name.startswith("_") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def missing_attribute(stage: StageBase, name: str) -> AttributeError:
    """The error for a missing attribute: why, for one that jax's stage has (the
    ``_not_offered`` table of the stage's class)."""
    cls = type(stage).__name__
    why = stage._not_offered.get(name)
    if why is None or name.startswith("__"):
        return AttributeError(f"{cls!r} object has no attribute {name!r}")
    return MultimeshAttributeError(
        f"`{cls}.{name}` is not offered, although `{stage._jax_class}` has it: {why}.")
