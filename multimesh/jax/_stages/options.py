"""``mjit``'s argument options, checked once and bound per call, as ``jax.jit`` does.

``static_argnums``/``static_argnames`` and ``donate_argnums``/``donate_argnames``
are validated against the function's signature when ``mjit`` is called, and the
missing half of each pair is inferred from it (as jax's ``resolve_argnums`` does):
a static or donated argument may then be passed by position or by keyword. Negative
positions count from the end of the call's positional arguments, as in jax's
dispatch. Unlike jax, duplicates are an error rather than ignored.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable

import jax
import numpy as np

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError

__all__ = ["ArgOptions", "Bound", "resolve_options"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _nums(kind: str, nums) -> tuple[int, ...] | None:
    """``static_argnums``/``donate_argnums`` as a tuple of plain ints (None: not given)."""
    if nums is None:
        return None
    flat = np.atleast_1d(np.asarray(nums, dtype=object)).reshape(-1).tolist()
    for i in flat:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise MultimeshTypeError(
                f"`mjit` {kind} must be an int or a sequence of ints, got {nums!r}.")
    return tuple(int(i) for i in flat)


def _names(kind: str, names) -> tuple[str, ...] | None:
    """``static_argnames``/``donate_argnames`` as a tuple of str (None: not given)."""
    if names is None:
        return None
    out = (names,) if isinstance(names, str) else \
        tuple(names) if isinstance(names, Iterable) else None
    if out is None or not all(isinstance(n, str) for n in out):
        raise MultimeshTypeError(
            f"`mjit` {kind} must be a str or a sequence of str, got {names!r}.")
    return out


def _no_duplicates(kind: str, values: tuple, n_pos: int | None) -> None:
    seen = [v % n_pos if isinstance(v, int) and n_pos else v for v in values]
    dup = next((v for i, v in enumerate(values) if seen[i] in seen[:i]), None)
    if dup is not None:
        raise MultimeshValueError(
            f"`mjit` {kind}={values} names the same argument twice ({dup!r}); list each "
            f"argument once.")


@dataclasses.dataclass(frozen=True)
class ArgOptions:
    """The resolved options: positions and names of the static and donated arguments."""

    static_argnums: tuple[int, ...]
    static_argnames: tuple[str, ...]
    donate_argnums: tuple[int, ...]
    donate_argnames: tuple[str, ...]
    signature: inspect.Signature | None

    def bind(self, args: tuple, kwargs: dict) -> Bound:
        """Split one call's arguments into static and dynamic ones (``Bound``)."""
        if not (self.static_argnums or self.static_argnames or self.donate_argnums
                or self.donate_argnames):  # the common case, on every call: nothing to do
            return Bound(args, kwargs, (), (), _NONE, _NONE)
        n = len(args)
        static = self._positions("static_argnums", self.static_argnums, n)
        donate = self._positions("donate_argnums", self.donate_argnums, n)
        both = set(static) & set(donate)
        if both:
            raise MultimeshValueError(
                f"`mjit` argument {min(both)} is both static (static_argnums="
                f"{self.static_argnums}) and donated (donate_argnums={self.donate_argnums}) "
                f"in this call of {n} positional arguments; an argument is one or the other.")
        static_kw = tuple(sorted(k for k in kwargs if k in self.static_argnames))
        for i, label in [*((i, str(i)) for i in static), *((k, repr(k)) for k in static_kw)]:
            _check_hashable(label, args[i] if isinstance(i, int) else kwargs[i])
        donate_kw = frozenset(k for k in kwargs if k in self.donate_argnames)
        return Bound(args, kwargs, tuple(sorted(static)), static_kw, frozenset(donate), donate_kw)

    def _positions(self, kind: str, nums: tuple[int, ...], n: int) -> list[int]:
        """``nums`` as positions among ``n`` positional arguments (those present)."""
        out = []
        for i in nums:
            if -n <= i < n:
                out.append(i % n)
            elif i >= n and self._has_positional(i):
                continue  # not passed positionally: its default, or given by keyword
            else:
                valid = f" (valid indices are 0..{n - 1})" if n else ""
                raise MultimeshValueError(
                    f"`mjit` {kind} names argument {i}, but the function was called with "
                    f"{n} positional argument{'' if n == 1 else 's'}{valid}.")
        _no_duplicates(kind, tuple(out), None)
        return out

    def _has_positional(self, i: int) -> bool:
        if self.signature is None:
            return False
        params = [p for p in self.signature.parameters.values() if p.kind in _POSITIONAL]
        return i < len(params)


def _check_hashable(label: str, value) -> None:
    try:
        hash(value)
    except TypeError:
        raise MultimeshTypeError(
            f"`mjit` static argument {label} must be hashable, got {type(value).__name__} "
            f"{value!r}. Pass a tuple instead of a list, or make the argument dynamic."
        ) from None


_NONE: frozenset = frozenset()


class Bound:
    """One call's arguments: the static ones taken out, the donated ones marked."""

    __slots__ = ("args", "kwargs", "static_pos", "static_kw", "donate_pos", "donate_kw")

    def __init__(self, args: tuple, kwargs: dict, static_pos: tuple[int, ...],
                 static_kw: tuple[str, ...], donate_pos: frozenset[int],
                 donate_kw: frozenset[str]):
        self.args, self.kwargs = tuple(args), kwargs
        self.static_pos, self.static_kw = static_pos, static_kw
        self.donate_pos, self.donate_kw = donate_pos, donate_kw

    @property
    def dyn_args(self) -> tuple:
        if not self.static_pos:
            return self.args
        return tuple(a for i, a in enumerate(self.args) if i not in self.static_pos)

    @property
    def dyn_kwargs(self) -> dict:
        if not self.static_kw:
            return self.kwargs
        return {k: v for k, v in self.kwargs.items() if k not in self.static_kw}

    @property
    def dyn_positions(self) -> list[int]:
        """The original position of each dynamic positional argument."""
        return [i for i in range(len(self.args)) if i not in self.static_pos]

    def static_key(self) -> tuple:
        """The static arguments as part of a cache key (hashable, checked in ``bind``)."""
        if not (self.static_pos or self.static_kw):
            return ()
        return (tuple((i, _Strict(self.args[i])) for i in self.static_pos),
                tuple((k, _Strict(self.kwargs[k])) for k in self.static_kw))

    def merge(self, dyn_args, dyn_kwargs) -> tuple[list, dict]:
        """The full ``(args, kwargs)`` for the user's function, statics put back."""
        it = iter(dyn_args)
        full = [self.args[i] if i in self.static_pos else next(it)
                for i in range(len(self.args))]
        return full, {**dyn_kwargs, **{k: self.kwargs[k] for k in self.static_kw}}

    def donated_flags(self) -> list[bool]:
        """Per leaf of ``(dyn_args, dyn_kwargs)``: whether it is donated."""
        pos = tuple(jax.tree.map(lambda _, d=i in self.donate_pos: d, a)
                    for i, a in zip(self.dyn_positions, self.dyn_args))
        kw = {k: jax.tree.map(lambda _, d=k in self.donate_kw: d, v)
              for k, v in self.dyn_kwargs.items()}
        return jax.tree.leaves((pos, kw))


class _Strict:
    """A static value in a cache key: equal only to a value of the same type (as jax)."""

    __slots__ = ("val",)

    def __init__(self, val):
        self.val = val

    def __hash__(self):
        return hash(self.val)

    def __eq__(self, other):
        return isinstance(other, _Strict) and type(self.val) is type(other.val) \
            and bool(self.val == other.val)


def _check_nums(fun_name: str, kind: str, nums: tuple[int, ...], sig) -> None:
    """Every position names a positional parameter (any, with ``*args``)."""
    params = list(sig.parameters.values()) if sig is not None else []
    if sig is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        _no_duplicates(kind, nums, None)
        return
    n = sum(p.kind in _POSITIONAL for p in params)
    bad = [i for i in nums if not -n <= i < n]
    if bad:
        raise MultimeshValueError(
            f"`mjit` {kind}={nums} names argument {bad[0]}, but {fun_name} takes {n} "
            f"positional argument{'' if n == 1 else 's'} (valid indices are "
            f"{-n}..{n - 1}).")
    _no_duplicates(kind, nums, n)


def _check_names(fun_name: str, kind: str, names: tuple[str, ...], sig) -> None:
    """Every name is a parameter that can be passed by keyword (any, with ``**kwargs``)."""
    _no_duplicates(kind, names, None)
    if sig is None:
        return
    params = sig.parameters
    for name in names:
        p = params.get(name)
        if p is not None and p.kind in _KEYWORD:
            continue
        if p is None and any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values()):
            continue
        why = "is positional-only" if p is not None else "is not one of its parameters"
        valid = [k for k, q in params.items() if q.kind in _KEYWORD]
        raise MultimeshValueError(
            f"`mjit` {kind} names {name!r}, which {why} of {fun_name}; names that can be "
            f"given are {valid}.")


def _infer(sig, nums, names) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """jax's ``infer_argnums_and_argnames``: the missing half of a nums/names pair."""
    if nums is None and names is None:
        return (), ()
    if nums is not None and names is not None:
        return nums, names
    params = list(sig.parameters.items())
    either = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if nums is None:
        return tuple(i for i, (k, p) in enumerate(params)
                     if p.kind == either and k in names), names
    return nums, tuple(k for i, (k, p) in enumerate(params) if p.kind == either and i in nums)


def resolve_options(fun: Callable, static_argnums=None, static_argnames=None,
                    donate_argnums=None, donate_argnames=None) -> ArgOptions:
    """Check the four options against ``fun``'s signature and complete them (as jax)."""
    s_nums, d_nums = _nums("static_argnums", static_argnums), _nums("donate_argnums",
                                                                    donate_argnums)
    s_names, d_names = _names("static_argnames", static_argnames), _names("donate_argnames",
                                                                          donate_argnames)
    try:
        sig: inspect.Signature | None = inspect.signature(fun)
    except (TypeError, ValueError):
        sig = None
    name = f"`{getattr(fun, '__name__', type(fun).__name__)}`"
    if sig is None:
        if d_names:
            raise MultimeshValueError(
                f"`mjit` cannot read the signature of {name}, so donate_argnames="
                f"{d_names} cannot be resolved; pass donate_argnums instead.")
        s: tuple[tuple[int, ...], tuple[str, ...]] = (s_nums or (), s_names or ())
        d: tuple[tuple[int, ...], tuple[str, ...]] = (d_nums or (), ())
    else:
        s = _infer(sig, s_nums, s_names)
        d = _infer(sig, d_nums, d_names)
    for kind, nums in (("static_argnums", s[0]), ("donate_argnums", d[0])):
        _check_nums(name, kind, nums, sig)
    for kind, names in (("static_argnames", s[1]), ("donate_argnames", d[1])):
        _check_names(name, kind, names, sig)
    _check_disjoint(s, d, sig)
    return ArgOptions(s[0], s[1], d[0], d[1], sig)


def _check_disjoint(static, donate, sig) -> None:
    names = sorted(set(static[1]) & set(donate[1]))
    n = None if sig is None else sum(
        p.kind in _POSITIONAL for p in sig.parameters.values())
    if n is not None and any(p.kind is inspect.Parameter.VAR_POSITIONAL
                             for p in sig.parameters.values()):
        n = None
    nums = sorted({i % n if n else i for i in static[0]} & {i % n if n else i for i in donate[0]})
    if names or nums:
        what = f"argument {nums[0]}" if nums else f"argument {names[0]!r}"
        raise MultimeshValueError(
            f"`mjit` {what} is both static and donated (static_argnums={static[0]}, "
            f"static_argnames={static[1]}, donate_argnums={donate[0]}, donate_argnames="
            f"{donate[1]}); a static argument is not an array and cannot be donated.")
