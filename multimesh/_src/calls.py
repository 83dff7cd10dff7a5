"""One fragment call, the record the schedule library and the runtime share.

A call runs one fragment (``fragment``, the task ``task`` in direction
``transpose_count``) on ``devices`` for microbatch ``microbatch``. What a layer adds is
how the call is tied to the others:

- the schedule library (``multimesh.schedules``, ``mm-schedule-fragments``) reads
  ``@main`` or a microbatch loop's body into calls in program order and links them by
  position: ``deps`` (the calls whose results it reads), ``carried`` (in a loop body:
  the calls of the previous microbatch it reads), ``split`` and ``forward``;
- the runtime's plan (``multimesh.runtime.plan``) links them by value: ``args`` and
  ``results`` are value ids, and ``devices`` is None when the call runs on its
  fragment's own devices (set only for a task that moves per microbatch).

The front end turns the one view into the other (``dataclasses.replace``) where it
draws or recovers a schedule from a plan. A record is not frozen: a schedule recovered
from an imported program numbers the plan's calls (``microbatch``) in place, after the
executor holds them; nothing else writes one after it is built. Nothing here imports jax or MLIR: the
schedule library imports this module alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Call"]


@dataclass
class Call:
    """One call of a fragment (see the module docstring for which layer fills what)."""

    fragment: str
    task: str = ""
    transpose_count: int = 0
    devices: tuple[int, ...] | None = None
    """Where it runs; in a runtime plan None: on the fragment's own devices."""
    microbatch: int | None = None
    split: str | None = None
    """None, or ``"activation"``/``"weight"``: which half of a split backward it is."""
    deps: tuple[int, ...] = ()
    """Schedules: the calls (by position) whose results it reads."""
    forward: str | None = None
    """A backward task's forward, when named apart from it."""
    carried: tuple[int, ...] = ()
    """A loop body's call: the body calls of the previous microbatch it reads (not its
    own running sums)."""
    args: Sequence[int] = ()
    """Runtime plans: the value ids it reads."""
    results: Sequence[int] = ()
    """Runtime plans: the value ids it writes."""
