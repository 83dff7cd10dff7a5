"""Argument checks shared by the front end: bad values fail early, named, in full sentences.

Each helper raises a :class:`MultimeshError` subclass whose message names the
offending value and what would be valid, where the library used to raise a bare
``IndexError``/``AttributeError`` at compile time or silently reinterpret the value.
"""

from __future__ import annotations

import jax
import numpy as np

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError

__all__ = ["is_int", "task_name", "program_devices", "axis_names", "axis_sizes", "argnum",
           "resolve_argnum"]


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
