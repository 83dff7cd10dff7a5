"""NNX modules named in jax's name stack while multimesh traces a program.

A linen module enters a ``jax.named_scope`` for every call, so its ops carry
``Model/blocks_0/Dense_0/dot_general`` and ``register_task``/``MultiMesh`` rules
find them. An NNX module enters none. While :func:`module_names` is active (in
this thread), a call of an NNX module's ``__call__`` or of another public method
(``encode``, ``decode``, flax's ``Embed.attend``) enters a scope named after the
module's *graph path*: the path
``nnx.iter_modules`` gives, joined by ``/``, under the class name of the root
module, e.g. ``Model/blocks/3/attn`` for ``model.blocks[3].attn`` (an
``nnx.List`` item) and ``Model/block_3/attn`` for a numbered attribute. A
scope holds only the part of the path below the module whose call encloses
it, so nested calls spell the full path once, as linen's scopes do. A method
other than ``__call__`` of a module below the enclosing call is named as linen
names it, the method after the last component: a tied head's
``self.wte.attend(x)`` runs in ``Model/wte.attend``, a unit of its own that a rule
(or a plan) places apart from the embedding's lookup in ``Model/wte``.

Which module is where: the NNX objects passed as roots (the arguments of the
traced function) are named from their class. A module first called without a
known path is looked up among the children of the module whose call encloses
it (set since that one was named); failing that it is an object rebuilt inside
the trace (``nnx.value_and_grad``, ``nnx.merge`` and ``microbatch`` rebuild
their arguments; ``nnx.remat`` and ``nnx.scan`` inside a call copy them) and
becomes a root of its own, named by its class, or a child named by its class
under the enclosing module.

The methods are wrapped by patching the module classes while any thread
traces (a reference count; the originals are back when the last trace ends);
a wrapped method called in a thread that is not tracing runs as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator

import jax
from flax import nnx

__all__ = ["module_names", "same_names"]

class _Naming:
    """One thread's naming while it traces: module paths and the calls under way."""

    def __init__(self) -> None:
        self.paths: dict[int, tuple[object, tuple[str, ...]]] = {}  # id -> (module, path)
        self.calls: list[tuple[object, tuple[str, ...]]] = []  # (module, path) under way

    def add_root(self, node, prefix: tuple[str, ...]) -> None:
        """Name every module in ``node``'s graph ``prefix/<graph path>`` (first name wins)."""
        for path, sub in nnx.graph.iter_graph(node):
            if isinstance(sub, nnx.Module) and id(sub) not in self.paths:
                # the module is kept: its id cannot be reused while this naming lives
                self.paths[id(sub)] = (sub, prefix + tuple(str(p) for p in path))

    def path_of(self, module) -> tuple[str, ...]:
        entry = self.paths.get(id(module))
        if entry is None and self.calls:  # a child set since its parent was named?
            self.add_root(*self.calls[-1])
            entry = self.paths.get(id(module))
        if entry is None:  # an object made inside the trace
            outer = self.calls[-1][1] if self.calls else ()
            self.add_root(module, (*outer, type(module).__name__))
            entry = self.paths[id(module)]
        return entry[1]

    def alias(self, copies, originals) -> None:
        """Name the modules of each of ``copies`` (rebuilt from ``originals``, e.g. by a
        task's split and merge) by the path of the original at the same graph path."""
        for copy, orig in zip(copies, originals):
            entry = self.paths.get(id(orig)) if isinstance(orig, nnx.Module) else None
            if entry is None:
                continue
            for path, sub in nnx.graph.iter_graph(copy):
                if isinstance(sub, nnx.Module) and id(sub) not in self.paths:
                    self.paths[id(sub)] = (sub, entry[1] + tuple(str(p) for p in path))

    def scope(self, module, method: str = "__call__") -> str:
        """The scope a call of ``module``'s ``method`` enters: its path below the
        enclosing call's; another method than ``__call__`` of a module below that call
        appends its name to the last component, as linen names it (``embed.attend``)."""
        path = self.path_of(module)
        outer = self.calls[-1][1] if self.calls else ()
        self.calls.append((module, path))
        if path[:len(outer)] == outer:
            path = path[len(outer):]
        if method != "__call__" and path and self.calls[:-1]:
            path = (*path[:-1], f"{path[-1]}.{method}")
        return "/".join(path)


_local = threading.local()
_lock = threading.Lock()
_users = 0
_patched: dict[type, dict[str, object]] = {}  # class -> {method name: original}


def _wrap(fun, method: str):
    @functools.wraps(fun)
    def named(self, *args, **kwargs):
        naming: _Naming | None = getattr(_local, "naming", None)
        if naming is None:
            return fun(self, *args, **kwargs)
        scope = naming.scope(self, method)
        try:
            if not scope:  # a method of the module whose call encloses this one
                return fun(self, *args, **kwargs)
            with jax.named_scope(scope):
                return fun(self, *args, **kwargs)
        finally:
            naming.calls.pop()

    return named


def _methods(cls: type) -> dict[str, object]:
    """The methods of ``cls`` (its own, not inherited) that a call names: ``__call__``
    and the public methods, of a model's own classes and of flax's layers
    (``flax.nnx.nn``) alike: a tied head's ``embed.attend``. Flax's other modules
    (the linen bridge, ``nnx.List``) keep their methods unnamed."""
    mod = cls.__module__
    public = not mod.startswith("flax.") or mod.startswith("flax.nnx.nn.")
    out: dict[str, object] = {}
    for name, fun in vars(cls).items():
        if name != "__call__" and (name.startswith("_") or not public):
            continue
        if inspect.isfunction(fun) and not (inspect.isgeneratorfunction(fun)
                                            or inspect.iscoroutinefunction(fun)):
            out[name] = fun
    return out


def _module_classes() -> Iterator[type]:
    """Every subclass of ``nnx.Module`` (whose own methods, ``sow``, ``train``, ... stay)."""
    todo, seen = [nnx.Module], set()
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


def _patch() -> None:
    """Wrap the methods of every module class not wrapped yet (under ``_lock``)."""
    for cls in _module_classes():
        if cls in _patched:
            continue
        methods = _methods(cls)
        _patched[cls] = methods
        for name, fun in methods.items():
            setattr(cls, name, _wrap(fun, name))


def _unpatch() -> None:
    for cls, methods in _patched.items():
        for name, fun in methods.items():
            setattr(cls, name, fun)
    _patched.clear()


def same_names(copies, originals) -> None:
    """While this thread names modules: each of ``copies``, rebuilt from the matching
    one of ``originals``, is named (with its modules) by the original's path."""
    naming: _Naming | None = getattr(_local, "naming", None)
    if naming is not None:
        naming.alias(copies, originals)


@contextlib.contextmanager
def module_names(*roots) -> Iterator[None]:
    """NNX module calls enter named scopes (their graph paths) inside the block.

    ``roots`` are NNX objects whose modules are named from them (a root
    ``Model`` names ``model.blocks[0]`` ``Model/blocks/0``). Nested uses add
    their roots to the naming under way.
    """
    global _users
    naming: _Naming | None = getattr(_local, "naming", None)
    if naming is not None:  # already naming in this thread
        for root in roots:
            naming.add_root(root, (type(root).__name__,))
        yield
        return
    naming = _Naming()
    for root in roots:
        naming.add_root(root, (type(root).__name__,))
    with _lock:
        _users += 1
    try:
        with _lock:
            _patch()
        _local.naming = naming
        yield
    finally:
        _local.naming = None
        with _lock:
            _users -= 1
            if _users == 0:
                _unpatch()
