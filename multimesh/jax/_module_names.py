"""The hook that names NNX modules in the name stack while ``mjit`` traces.

The work is in the flax wing (``multimesh.jax.flax._nnx_names``), reached through the
argument handlers (``_stages/handlers.py``); this module keeps ``import multimesh.jax``
free of flax: a process that never imported ``flax.nnx`` holds no NNX module to name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

from multimesh.jax._stages import handlers

__all__ = ["module_names"]


def module_names(*roots) -> AbstractContextManager[None]:
    """NNX module calls enter scopes named by their graph paths inside the block."""
    return handlers.module_names(*roots)
