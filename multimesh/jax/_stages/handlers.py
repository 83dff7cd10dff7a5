"""Argument handlers: how ``mjit`` and ``task`` take objects that the front end does not
know (NNX graph objects, Flax modules), from a wing that ``multimesh.jax`` never imports.

A wing offers one ``ArgumentHandler``. It is registered (``register``) with a loader
and the modules whose import makes it needed: a handler for arguments is looked for
only once one of its ``arguments`` modules is in ``sys.modules`` (an NNX object exists
only once the program imported ``flax.nnx`` itself), one for tasks only for a function
that is one of its ``tasks`` classes (or an instance of one) whose module is imported
(a linen program whose tasks are ``module.apply`` never loads the wing, nor
``flax.nnx`` with it); it is loaded at the first question asked then. So ``import
multimesh.jax`` imports no wing, and a wing needs no import by the user: the
composition root, ``multimesh/jax/__init__.py``, registers the flax wing's handler.

A handler sees an ``mjit`` function only through ``MjitProgram``, the part of it made for
handlers (the flax wing reads nothing private of it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["MjitProgram", "ArgumentHandler", "register", "for_arguments", "for_task",
           "may_claim_arguments", "module_names"]


class MjitProgram(Protocol):
    """What a handler may use of an ``mjit`` function."""

    fun: Callable
    in_shardings: Any
    out_shardings: Any
    options: Any  # the ArgOptions, whose ``bind`` gives a ``Bound``

    def trace_flat(self, fun: Callable, dyn_args: tuple, kwargs: dict, donated,
                   in_shardings=None, out_placements=None) -> Any:
        """Trace ``fun`` of dynamic arguments only (an ``MpmdTraced``), under the
        program's contexts; ``donated`` flags each leaf of ``(dyn_args, kwargs)``."""

    def compiled_for(self, bound: Any, signature: Any, build: Callable[[], Any]) -> Any:
        """The program compiled for ``bound``'s static arguments and ``signature`` (the
        dynamic arguments' structure and types), from the function's cache, else
        ``build()``, cached."""


class ArgumentHandler(Protocol):
    """What a wing offers ``mjit`` and ``task`` for the objects it knows."""

    def claims(self, tree) -> bool:
        """Whether ``tree`` (arguments, or a function's outputs) holds its objects."""

    def trace(self, program: MjitProgram, bound: Any) -> Any:
        """``program.trace(...)`` for arguments it claims: a stage like ``MpmdTraced``."""

    def call(self, program: MjitProgram, bound: Any) -> Any:
        """Call ``program`` on arguments it claims (compiled via ``compiled_for``)."""

    def wraps_task(self, fun) -> bool:
        """Whether ``task(fun)`` must be its task (a Flax module, class or instance)."""

    def task(self, fun: Callable, name: str | None, task: Any, kwargs: dict) -> Callable:
        """``task(fun, name, task=task, **kwargs)`` for its objects."""

    def module_names(self, *roots) -> AbstractContextManager[None]:
        """A block in which its modules' calls enter named scopes while jax traces."""


@dataclasses.dataclass(frozen=True)
class _Registration:
    load: Callable[[], ArgumentHandler]
    arguments: tuple[str, ...]
    tasks: tuple[str, ...]  # dotted class paths, ``flax.linen.Module``


_REGISTERED: list[_Registration] = []
_LOADED: dict[int, ArgumentHandler] = {}  # registration index -> its handler


def register(load: Callable[[], ArgumentHandler], *, arguments: tuple[str, ...] = (),
             tasks: tuple[str, ...] = ()) -> None:
    """Register the handler ``load()`` returns: asked about arguments once a module of
    ``arguments`` is imported, about a task's function when it is one of the classes
    ``tasks`` names (``"flax.linen.Module"``), or an instance of one."""
    _REGISTERED.append(_Registration(load, tuple(arguments), tuple(tasks)))


def _argument_handlers() -> Iterator[ArgumentHandler]:
    """The handlers one of whose ``arguments`` modules is imported."""
    for i, reg in enumerate(_REGISTERED):
        if any(m in sys.modules for m in reg.arguments):
            yield _loaded(i, reg)


def _loaded(i: int, reg: _Registration) -> ArgumentHandler:
    handler = _LOADED.get(i)
    if handler is None:
        handler = _LOADED[i] = reg.load()
    return handler


def _is_one_of(fun, paths: tuple[str, ...]) -> bool:
    """Whether ``fun`` is one of the classes ``paths`` names, or an instance of one,
    looking only in modules already imported (a class not imported has no instances)."""
    for path in paths:
        module, _, name = path.rpartition(".")
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and (isinstance(fun, cls) or (
                isinstance(fun, type) and issubclass(fun, cls))):
            return True
    return False


def may_claim_arguments() -> bool:
    """Whether any handler may claim arguments (its modules are imported)."""
    return any(m in sys.modules for reg in _REGISTERED for m in reg.arguments)


def for_arguments(tree) -> ArgumentHandler | None:
    """The handler that claims ``tree``, if any."""
    if not may_claim_arguments():
        return None
    return next((h for h in _argument_handlers() if h.claims(tree)), None)


def for_task(fun) -> ArgumentHandler | None:
    """The handler whose task ``task(fun)`` must be, if any."""
    return next((h for i, reg in enumerate(_REGISTERED) if _is_one_of(fun, reg.tasks)
                 for h in (_loaded(i, reg),) if h.wraps_task(fun)), None)


def module_names(*roots) -> AbstractContextManager[None]:
    """Every active handler's ``module_names(*roots)`` block, entered together."""
    if not may_claim_arguments():
        return contextlib.nullcontext()
    blocks = [h.module_names(*roots) for h in _argument_handlers()]
    return blocks[0] if len(blocks) == 1 else _together(blocks)


@contextlib.contextmanager
def _together(blocks) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for block in blocks:
            stack.enter_context(block)
        yield
