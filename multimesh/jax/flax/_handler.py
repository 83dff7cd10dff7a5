"""The flax wing's argument handler (``multimesh.jax._stages.handlers``): NNX objects
as ``mjit`` arguments and outputs, Flax modules and NNX objects given to ``task``.

``multimesh/jax/__init__.py`` registers it, to be loaded once ``flax.nnx`` (for
arguments) or ``flax.linen`` (for tasks) is imported, so ``mjit`` takes NNX objects
even where the program never imported ``multimesh.jax.flax``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import jax
from flax import linen as nn
from flax import nnx

from multimesh.jax.flax import _linen, _nnx, _nnx_names

__all__ = ["FlaxHandler", "HANDLER"]


class FlaxHandler:
    """``ArgumentHandler`` for Flax: NNX graph objects and linen/NNX modules."""

    def claims(self, tree) -> bool:
        is_node = nnx.graph.is_graph_node
        return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))

    def trace(self, program, bound):
        return _nnx.trace(program, bound)

    def call(self, program, bound):
        return _nnx.call(program, bound)

    def wraps_task(self, fun) -> bool:
        """A linen module class or instance, or an NNX module class or instance."""
        bases = (nn.Module, nnx.Module)
        return isinstance(fun, bases) or (isinstance(fun, type) and issubclass(fun, bases))

    def task(self, fun: Callable, name: str | None, task: Any, kwargs: dict) -> Callable:
        return _linen.task(fun, name, task=task, **kwargs)

    def module_names(self, *roots) -> AbstractContextManager[None]:
        return _nnx_names.module_names(*roots)


HANDLER = FlaxHandler()
