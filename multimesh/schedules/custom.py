"""Custom schedules: the rows a user writes, parsed once into a typed value
(:class:`CustomSchedule`), and their plans against a program."""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from .model import ScheduleError, ScheduleTypeError, unit_label
from .simulator import Program

__all__ = ["CustomSchedule", "check_custom_rows", "canonicalize_custom_schedule", "custom_plans"]


@dataclass(frozen=True)
class CustomSchedule:
    """A custom schedule parsed once: per submesh, its ``(microbatch, task name)`` entries.

    Only the form is checked here (:meth:`parse`); the names are checked against the
    program when it is scheduled (:func:`custom_plans`).
    """

    rows: tuple[tuple[tuple[int, str], ...], ...]
    num_microbatches: int

    @classmethod
    def parse(cls, rows: Sequence[Sequence] | CustomSchedule,
              num_microbatches: int) -> CustomSchedule:
        """The typed value of ``rows`` (:func:`canonicalize_custom_schedule`'s form)."""
        if isinstance(rows, CustomSchedule):
            if rows.num_microbatches == num_microbatches:
                return rows
            rows = rows.as_lists()
        canon = canonicalize_custom_schedule(rows, num_microbatches)
        return cls(tuple(tuple(r) for r in canon), num_microbatches)

    def as_lists(self) -> list[list[tuple[int, str]]]:
        return [list(r) for r in self.rows]


def check_custom_rows(rows) -> None:
    """The one check of a custom schedule's form, wherever it comes from (``microbatch``'s
    ``custom_schedule``, when ``microbatch`` is called; the pass's JSON file): a
    non-empty list of rows, one per submesh, each a list of entries, each a task name
    or a ``(microbatch, task name)`` pair. What needs the number of microbatches is
    :func:`canonicalize_custom_schedule`'s; what needs the program, :func:`custom_plans`'.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ScheduleTypeError(
            f"custom_schedule must be a list of rows, one per submesh, each a list of task "
            f"names or (microbatch, task name) pairs, got {type(rows).__name__} {rows!r}. "
            f"For example: [['s0', 's0_bwd'], ['s1', 's1_bwd']].")
    if len(rows) == 0:
        raise ScheduleError(
            "custom_schedule is empty; give one row per submesh, in the order the program "
            "first uses them, each listing that submesh's tasks once per microbatch. For "
            "example: [['s0', 's0', 's0_bwd', 's0_bwd'], ['s1', 's1_bwd', 's1', 's1_bwd']] "
            "for 2 microbatches.")
    for r, row in enumerate(rows):
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise ScheduleTypeError(
                f"custom_schedule row {r} must be a list of task names or (microbatch, task "
                f"name) pairs, got {type(row).__name__} {row!r}"
                + (f"; a string is not split into names: write {row.split()!r}."
                   if isinstance(row, str) else "."))
        for entry in row:
            if not _is_entry(entry):
                raise ScheduleTypeError(
                    f"custom_schedule row {r} has entry {entry!r}; entries are task names or "
                    f"(microbatch, task name) pairs.")


def _is_entry(entry) -> bool:
    """A task name, or a ``(microbatch, task name)`` pair (any integer but a bool)."""
    return isinstance(entry, str) or (
        isinstance(entry, Sequence) and not isinstance(entry, (str, bytes))
        and len(entry) == 2 and isinstance(entry[1], str)
        and isinstance(entry[0], numbers.Integral) and not isinstance(entry[0], bool))


def canonicalize_custom_schedule(rows: Sequence[Sequence], num_microbatches: int
                                 ) -> list[list[tuple[int, str]]]:
    """Rows of ``name`` or ``(microbatch, name)`` -> rows of ``(microbatch, name)``.

    A bare ``name`` is that name's next microbatch in the row (its 1st occurrence
    is microbatch 0, ...; the smallest one not yet listed). Checks the form
    (:func:`check_custom_rows`), then what needs ``num_microbatches`` (microbatch
    range, repeats): whether each name is a task of its row's submesh, and occurs once
    per microbatch, is checked against the program (:func:`build_schedule`), so a
    misspelt name is reported as such, not as a count.
    """
    check_custom_rows(rows)
    return [_canonical_row(r, row, num_microbatches) for r, row in enumerate(rows)]


def _canonical_row(r: int, row, num_microbatches: int) -> list[tuple[int, str]]:
    seen: dict[str, set[int]] = {}
    canon = []
    for e in row:
        mb, name = _canonical_entry(e, seen)
        if not 0 <= mb < num_microbatches:
            raise ScheduleError(
                f"custom_schedule row {r}: microbatch {mb} of task '{name}' is out of "
                f"range (there are {num_microbatches} microbatches).")
        if mb in seen.setdefault(name, set()):
            raise ScheduleError(
                f"task '{name}' appears twice for microbatch {mb} in custom_schedule row {r}.")
        seen[name].add(mb)
        canon.append((mb, name))
    return canon


def _canonical_entry(e, seen: dict[str, set[int]]) -> tuple[int, str]:
    """``name`` (its next microbatch in the row) or ``(microbatch, name)``."""
    if isinstance(e, str):
        mb = 0
        while mb in seen.get(e, ()):
            mb += 1
        return mb, e
    return int(e[0]), e[1]


def custom_plans(prog: Program, custom: Sequence[Sequence] | CustomSchedule
                 ) -> tuple[list[list[int]], dict[int, int]]:
    """Per submesh, the units of ``custom``'s rows in order; raises on a name that is
    not a task of its row's submesh or a task listed other than once per microbatch."""
    rows = CustomSchedule.parse(custom, prog.M).rows
    if len(rows) != prog.num_meshes:
        raise ScheduleError(
            f"custom_schedule has {len(rows)} rows for {prog.num_meshes} submeshes; give one "
            f"row per submesh, in the order the program first uses them")
    by_label: list[dict[str, dict[int, list[int]]]] = [{} for _ in range(prog.num_meshes)]
    for u in prog.units:
        if not u.free:
            by_label[u.mesh].setdefault(unit_label(u), {}).setdefault(
                prog.mb_rank[u.key[2]], []).append(u.index)
    for r, row in enumerate(rows):
        _check_custom_row(r, row, by_label, prog.M)
    plans: list[list[int]] = []
    for r, row in enumerate(rows):
        plan = []
        for mb, name in row:
            plan += by_label[r][name].get(mb, [])
        plans.append(plan)
    pos = {i: k for row in plans for k, i in enumerate(row)}
    return plans, pos


def _check_custom_row(r: int, row: Sequence[tuple[int, str]], by_label: list[dict],
                      M: int) -> None:
    """Row ``r`` names only tasks of submesh ``r`` (a misspelling is named, with its
    entry and the valid names), each once per microbatch."""
    labels = by_label[r]
    for k, (_, name) in enumerate(row):
        if name in labels:
            continue
        known = ", ".join(sorted(labels)) or "none"
        elsewhere = [m for m, other in enumerate(by_label) if name in other]
        close = difflib.get_close_matches(name, list(labels), n=1)
        hint = (f"; it runs on submesh {elsewhere[0]}" if elsewhere else
                f"; did you mean '{close[0]}'?" if close else "")
        raise ScheduleError(
            f"custom_schedule row {r} entry {k} names '{name}', which is not a task of "
            f"submesh {r} (its tasks: {known}){hint}")
    for name in sorted(labels):
        count = sum(1 for _, n in row if n == name)
        if count != M:
            raise ScheduleError(
                f"task '{name}' has {count} microbatches in custom_schedule row {r}, but "
                f"there are {M} microbatches (each task once per microbatch)")
