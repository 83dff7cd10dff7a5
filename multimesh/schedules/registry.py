"""The schedule registry: one :class:`ScheduleAlgorithm` per schedule, found by name or alias.

A schedule is one module under ``multimesh/schedules/algorithms/`` holding one
subclass decorated with :func:`register_schedule`; everything that lists, checks or
builds schedules (the front end, ``mm-schedule-fragments``, the docs) asks this
registry (docs/architecture.md, "Where to change what").
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import ClassVar, TypeVar

from .custom import CustomSchedule
from .model import ScheduleError, Unit, default_cost, pipeline_units, v_shape_units
from .placement import RULES, check_rule
from .plans import Slot
from .simulator import Program, Sim, run_plans, unit_plans

__all__ = ["ScheduleAlgorithm", "register_schedule", "get_schedule", "all_schedules",
           "canonical_schedule_name", "alias_list", "aliases", "schedule_names",
           "describe_schedules"]


class ScheduleAlgorithm:
    """One pipeline schedule: its names, what it needs of the program, its plan, its theory.

    Subclasses set the class attributes and :meth:`slot_plans` (or :meth:`simulate`
    when the plan needs the simulator's help, as the zero-bubble schedules do), and
    give their textbook :meth:`bubble` and :meth:`peak_live` where there is a closed
    form (docs/schedules.md derives each).
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    """Other spellings (the peers' names), matched case-insensitively."""
    splits_backward: ClassVar[bool] = False
    """Runs weight gradients apart (``mm-split-backward{all=true}`` runs first)."""
    placement: ClassVar[str | None] = None
    """The stage placement it needs (:data:`placement.RULES`), None for any."""
    interleave: ClassVar[int] = 1
    """Stages per submesh of its textbook pipeline (:meth:`textbook_units`)."""
    has_textbook: ClassVar[bool] = True
    """Has a textbook pipeline to measure (P6, the registry tests); not ``custom``."""
    takes_unrolling: ClassVar[bool] = False
    """Accepts ``unrolling`` (fill and drain in groups of microbatches)."""
    without_interleaving: ClassVar[tuple[str, str] | None] = None
    """``(title, name)`` of the schedule it becomes with one stage per submesh, if any."""
    without_split: ClassVar[str | None] = None
    """The order it becomes when no backward splits off a weight-gradient half, if any."""

    def summary(self) -> str:
        """What it does, in a sentence or two: the first paragraph of its class's
        docstring (else of its module's). The pass's ``schedule`` option, ``microbatch``'s
        docstring and docs/schedules.md show it."""
        doc = type(self).__doc__ or sys.modules[type(self).__module__].__doc__ or ""
        return " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())

    def options(self) -> tuple[str, ...]:
        """The ``microbatch`` options it takes beyond every schedule's (``interleave``,
        ``num_stages``)."""
        return ("unrolling",) if self.takes_unrolling else ()

    def traits(self) -> list[str]:
        """Its aliases, placement rule, split backward and options, as words."""
        out = [f"alias{'es' if len(self.aliases) > 1 else ''} {', '.join(self.aliases)}"
               ] if self.aliases else []
        if self.placement:
            out.append(f"{self.placement} placement")
        if self.splits_backward:
            out.append("splits backward")
        out += [f"takes {o}" for o in self.options()]
        return out

    def describe(self) -> str:
        """``name (traits): summary``, one line of a listing."""
        traits = "; ".join(self.traits())
        return f"{self.name}{f' ({traits})' if traits else ''}: {self.summary()}"

    def textbook_units(self, P: int, M: int) -> list[Unit]:
        """The units of the pipeline it is designed for: ``P`` submeshes, ``M``
        microbatches, its placement and :attr:`interleave`, split backwards if it
        splits them."""
        if self.placement == "v-shape":
            return v_shape_units(P, M, split_backward=self.splits_backward)
        return pipeline_units(P, M, interleave=self.interleave,
                              split_backward=self.splits_backward)

    def check(self, prog: Program) -> None:
        """Raise :class:`ScheduleError` when ``prog`` does not suit this schedule: its
        placement rule, then :meth:`unfit`."""
        if self.placement is not None:
            check_rule(prog, self.name, self.placement)
        why = self.unfit(prog)
        if why:
            raise ScheduleError(why)

    def unfit(self, prog: Program) -> str | None:
        """Why ``prog`` (its submeshes ``P``, microbatches ``M``) does not suit this
        schedule beyond its placement, as the error says it; None when it does."""
        del prog
        return None

    def slot_plans(self, prog: Program, num_stages: int | None,
                   unrolling: int | None) -> list[list[Slot]]:
        """Per submesh, the textbook slot order."""
        raise NotImplementedError(f"schedule '{self.name}' defines no slot plans")

    def simulate(self, prog: Program, *, num_stages: int | None = None,
                 unrolling: int | None = None,
                 custom: Sequence | CustomSchedule | None = None) -> Sim:
        """Run the plans through the simulator (repairing what the program forbids)."""
        return self.run(prog, *unit_plans(prog, self.slot_plans(prog, num_stages, unrolling)))

    def run(self, prog: Program, plans: list[list[int]], pos: dict[int, int]) -> Sim:
        """Simulate unit plans with unit costs, repairing what the program forbids."""
        return run_plans(prog, plans, pos, strict=False, cost=default_cost, name=self.name)

    def bubble(self, P: int, M: int, V: int) -> float | None:
        """Textbook bubble fraction with unit costs, None without a closed form."""
        return None

    def peak_live(self, P: int, M: int, V: int) -> int | None:
        """Textbook peak live activations on one submesh, None without a closed form."""
        return None


_REGISTRY: dict[str, ScheduleAlgorithm] = {}
_ALIASES: dict[str, str] = {}  # lower-cased alias or name -> name
A = TypeVar("A", bound=type[ScheduleAlgorithm])


def register_schedule(cls: A) -> A:
    """Class decorator: register one instance of ``cls`` under its name and aliases."""
    name = cls.name
    if not name or name != name.strip().lower():
        raise ValueError(f"schedule class {cls.__name__} needs a lower-case name, got {name!r}")
    if cls.placement is not None and cls.placement not in RULES:
        raise ValueError(f"schedule '{name}' has placement {cls.placement!r}; "
                         f"valid placements: {', '.join(RULES)}")
    for spelling in (name, *cls.aliases):
        taken = _ALIASES.get(spelling.lower())
        if taken is not None and taken != name:
            raise ValueError(f"schedule '{name}': the name {spelling!r} already means "
                             f"schedule '{taken}'")
    _REGISTRY[name] = cls()
    for spelling in (name, *cls.aliases):
        _ALIASES[spelling.lower()] = name
    return cls


def all_schedules() -> tuple[ScheduleAlgorithm, ...]:
    """Every registered schedule, in registration order."""
    return tuple(_REGISTRY.values())


def aliases() -> dict[str, str]:
    """``{alias: schedule}`` over every registered schedule, as each spells its aliases."""
    return {a: s.name for s in _REGISTRY.values() for a in s.aliases}


def alias_list() -> str:
    """``alias = schedule, ...`` in alphabetical order, for error messages."""
    return ", ".join(f"{a} = {t}" for a, t in sorted(aliases().items(),
                                                      key=lambda kv: kv[0].lower()))


def schedule_names() -> str:
    """``gpipe, 1f1b, ... or custom``: every registered name, in registration order."""
    names = [s.name for s in _REGISTRY.values()]
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)


def describe_schedules(indent: str = "") -> str:
    """One line per registered schedule (:meth:`ScheduleAlgorithm.describe`), for the
    pass's ``schedule`` option and ``microbatch``'s docstring."""
    return "\n".join(indent + s.describe() for s in _REGISTRY.values())


def get_schedule(name: str) -> ScheduleAlgorithm:
    """The schedule called ``name`` or one of its aliases, in any case."""
    key = _ALIASES.get(str(name).strip().lower())
    if key is None:
        raise ScheduleError(
            f"unknown schedule '{name}'; valid schedules: {', '.join(sorted(_REGISTRY))} "
            f"(aliases: {alias_list()})")
    return _REGISTRY[key]


def canonical_schedule_name(name: str | None, custom=None) -> str:
    """The canonical schedule for a user's ``schedule``/``custom_schedule`` pair."""
    if custom is not None and name not in (None, "custom"):
        raise ScheduleError(
            f"When custom_schedule is provided, schedule must be 'custom' or None, "
            f"but got '{name}'.")
    if name is None:
        return "custom" if custom is not None else "gpipe"
    return get_schedule(name).name
