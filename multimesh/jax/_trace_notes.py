"""What the front end learns while ``mjit`` traces a program, typed.

Tasks, ``microbatch`` and the registered-task matcher note facts here as jax traces the
program (``_contexts.notes`` makes one :class:`TraceNotes` current), and ``mjit`` reads
them when it lowers: which names are logical, which tasks recompute or split their
backward, the microbatch loop's schedule. Fields are slots, so a misspelt name is an
``AttributeError`` rather than a silent ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["MicrobatchNote", "TraceNotes"]


@dataclass(frozen=True, slots=True)
class MicrobatchNote:
    """The program's microbatch loop, as ``microbatch`` was called (one per program)."""

    schedule: str
    """The schedule's name (``"gpipe"`` when none was asked for)."""
    num_microbatches: int
    num_stages: int | None
    interleave: int | None
    unrolling: int | None
    custom: list | None
    """A custom schedule's rows of ``(microbatch, task name)``."""
    requested: bool
    """Whether the schedule was asked for (a default GPipe was not)."""


@dataclass(slots=True)
class TraceNotes:
    """Facts about one program, filled while ``mjit`` traces it."""

    logical_names: set[str] = field(default_factory=set)
    """Logical axis names the program's tasks map (the rest of a sharding is physical)."""
    split_backprop: bool = False
    """A task asked for ``split_backprop``."""
    remat: object = None
    """``microbatch(..., remat=)``: the default of registered tasks matched later."""
    remat_tasks: set[str] = field(default_factory=set)
    """Registered tasks whose backward recomputes its forward."""
    remat_inputs_of: set[str] = field(default_factory=set)
    """Explicit tasks traced under ``jax.checkpoint``."""
    microbatch: MicrobatchNote | None = None
    explicit_task_names: dict[str, list[tuple]] = field(default_factory=dict)
    stage_meshes: bool = False
    """A registered task's body was traced under its own mesh (``registered_task_meshes``):
    the program lowers with no concrete mesh in context, so a ``shard_map`` traced there
    lowers on that mesh (jax would take the devices of the concrete mesh in context)."""
    registered_tasks: dict[tuple, tuple] = field(default_factory=dict)
    """``(id(registration), matched name, backprop)``: the registration and its task
    (a callback is asked once per program, while tracing or lowering)."""
    """Each user-chosen task name: the (devices, axes, sizes, mapping, split) it came with."""
