"""Argument checks shared by the front end: bad values fail early, named, in full sentences.

Each helper raises a :class:`MultimeshError` subclass whose message names the
offending value and what would be valid, where the library used to raise a bare
``IndexError``/``AttributeError`` at compile time or silently reinterpret the value.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.extend.core import jaxprs_in_params
from jax.sharding import AxisType

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError

__all__ = ["is_int", "task_name", "program_devices", "axis_names", "axis_sizes", "argnum",
           "resolve_argnum", "custom_schedule", "no_explicit_sharding"]


def is_int(x) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _shown(x):
    return x.item() if isinstance(x, np.generic) else x


def task_name(name, who: str = "`task`"):
    """``name`` when it is None or a string."""
    if name is not None and not isinstance(name, str):
        raise MultimeshTypeError(
            f"{who} name must be a string, got {type(name).__name__} {name!r}.")
    return name


def program_devices(devices, who: str = "`mjit`") -> tuple:
    """The program's device list: a non-empty sequence of distinct ``jax.Device``\\ s."""
    flat = tuple(np.asarray(devices, dtype=object).flat)
    if not flat:
        raise MultimeshValueError(
            f"{who} devices is empty; give at least one jax.Device (e.g. "
            f"jax.devices()[:4]), or leave devices=None to use every device.")
    for i, d in enumerate(flat):
        if not isinstance(d, jax.Device):
            hint = (" Device positions (0, 1, ...) belong in `TaskMesh(devices=...)`; the "
                    "program's device list takes devices, e.g. jax.devices()[:4]."
                    if is_int(d) else "")
            raise MultimeshTypeError(
                f"{who} devices must be jax.Device objects, but entry {i} is "
                f"{type(d).__name__} {_shown(d)!r}.{hint}")
    return flat


def few_devices_hint(devices) -> str:
    """Advice for a position past the last of ``devices``: on a CPU with fewer devices
    than asked, how to simulate more; else nothing."""
    if all(getattr(d, "platform", "") == "cpu" for d in devices) and \
            jax.device_count() == len(devices):
        return (f" jax sees {len(devices)} CPU device(s); to simulate more, set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count=8 (or the number you "
                f"need) before jax is imported.")
    return ""


def axis_names(names, who: str) -> tuple:
    """Axis names as a tuple; a string is one name, as for ``jax.sharding.Mesh``."""
    if isinstance(names, str):
        return (names,)
    return tuple(names)


def axis_sizes(sizes, who: str) -> tuple[int, ...]:
    """Axis sizes as ints; a float (even 2.0) or bool is an error, not truncated."""
    sizes = (sizes,) if is_int(sizes) else tuple(sizes)
    for s in sizes:
        if not is_int(s):
            raise MultimeshTypeError(
                f"{who} axis sizes must be integers, got {_shown(s)!r} "
                f"({type(s).__name__}) in {tuple(_shown(x) for x in sizes)}.")
    return tuple(int(s) for s in sizes)


def argnum(value, who: str) -> int:
    """``argnum``-style option: an int (checked against the call's arguments later)."""
    if not is_int(value):
        raise MultimeshTypeError(
            f"{who} argnum must be an integer position of a positional argument, got "
            f"{type(value).__name__} {value!r}.")
    return int(value)


def resolve_argnum(value: int, nargs: int, who: str) -> int:
    """``value`` as a non-negative index into ``nargs`` arguments (negative: from the end)."""
    if not -nargs <= value < nargs:
        valid = f" (valid: {-nargs}..{nargs - 1})" if nargs else ""
        raise MultimeshValueError(
            f"{who} argnum={value} but the function got {nargs} positional "
            f"argument{'' if nargs == 1 else 's'}{valid}.")
    return value % nargs


def custom_schedule(rows) -> None:
    """``custom_schedule``: a sequence of rows (one per submesh), each a sequence of entries."""
    if isinstance(rows, str) or not isinstance(rows, Sequence):
        raise MultimeshTypeError(
            f"`microbatch` custom_schedule must be a list of rows, one per submesh, each a "
            f"list of task names or (microbatch, task name) pairs, got "
            f"{type(rows).__name__} {rows!r}. For example: [['s0', 's0_bwd'], ['s1', "
            f"'s1_bwd']].")
    if len(rows) == 0:
        raise MultimeshValueError(
            "`microbatch` custom_schedule is empty; give one row per submesh, in the order "
            "the program first uses them, each listing that submesh's tasks once per "
            "microbatch. For example: [['s0', 's0', 's0_bwd', 's0_bwd'], ['s1', 's1_bwd', "
            "'s1', 's1_bwd']] for 2 microbatches.")
    for r, row in enumerate(rows):
        if isinstance(row, str) or not isinstance(row, Sequence):
            raise MultimeshTypeError(
                f"`microbatch` custom_schedule row {r} must be a list of task names or "
                f"(microbatch, task name) pairs, got {type(row).__name__} {row!r}"
                + (f"; a string is not split into names: write {row.split()!r}."
                   if isinstance(row, str) else "."))
        for entry in row:
            if not _schedule_entry(entry):
                raise MultimeshTypeError(
                    f"custom_schedule row {r} has entry {entry!r}; entries are task names or "
                    f"(microbatch, task name) pairs.")


def _schedule_entry(entry) -> bool:
    """A task name, or a ``(microbatch, task name)`` pair."""
    return isinstance(entry, str) or (
        isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], str)
        and isinstance(entry[0], (int, np.integer)) and not isinstance(entry[0], bool))


def _explicit_axes(aval) -> tuple[str, ...]:
    """The mesh axes of type ``Explicit`` that ``aval``'s sharding-in-types shards over."""
    sharding = getattr(aval, "sharding", None)
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or AxisType.Explicit not in tuple(mesh.axis_types):
        return ()
    explicit = {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit}
    used = [a for entry in spec if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)]
    return tuple(a for a in used if a in explicit)


def _first_explicit(jaxpr) -> tuple | None:
    """((eqn, aval, axes), holds a task) for the first op that gives a value typed with
    an explicit sharding (preferring ops without a body of their own, where the type is
    made), in one walk over ``jaxpr`` and the jaxprs inside; None if there is none."""
    todo, seen, tasks = [jaxpr], set(), False
    found: dict[bool, tuple] = {}  # has a body -> first hit
    while todo:
        jx = todo.pop(0)
        if id(jx) in seen:
            continue
        seen.add(id(jx))
        for eqn in jx.eqns:
            tasks = tasks or eqn.primitive.name == "mm_task"
            inner = list(jaxprs_in_params(eqn.params))
            todo.extend(inner)
            if bool(inner) in found:
                continue
            for v in eqn.outvars:
                axes = _explicit_axes(v.aval)
                if axes:
                    found[bool(inner)] = (eqn, v.aval, axes)
                    break
    first = found.get(False, found.get(True))
    return (first, tasks) if first is not None else None


def no_explicit_sharding(closed_jaxpr, has_registered_tasks: bool) -> None:
    """Raise, before any pass runs, if a program with tasks uses explicit-sharding mode.

    Under a mesh whose axes are ``AxisType.Explicit`` jax types values with
    shardings over the *whole* mesh (``float32[8@fsdp,16@tp]``); a task runs on a
    submesh with axes of its own, where those types name axes that do not exist,
    and XLA or Shardy fail late (or abort). Only checked under such a mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ()) or ()):
        return
    found = _first_explicit(closed_jaxpr.jaxpr)
    if found is None or not (found[1] or has_registered_tasks):
        return
    (eqn, aval, axes), _ = found
    where = str(eqn.source_info.name_stack)
    raise MultimeshValueError(
        f"This program uses jax's explicit-sharding mode, which multimesh does not support "
        f"in programs with tasks yet: `{eqn.primitive.name}`"
        f"{f' (in {where!r})' if where else ''} gives a value of type "
        f"{aval.str_short()}, sharded over the mesh axes {axes} of type "
        f"AxisType.Explicit. A task runs on a submesh with axes of its own, where a type "
        f"that names the whole mesh's axes cannot live. Make the mesh's axes Auto "
        f"(`jax.make_mesh(..., axis_types=(AxisType.Auto, ...))`, entered with "
        f"`jax.set_mesh`), drop explicit resharding (`jax.sharding.reshard`, "
        f"`out_sharding=`), and name shardings with logical axis names instead: "
        f"`multimesh.jax.with_sharding_constraint(x, P('batch', ...))` and, for "
        f"parameters, `nnx_shard_axes`/`shard_axes`; each task maps them onto its own axes.")
