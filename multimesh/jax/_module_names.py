"""The hook that names NNX modules in the name stack while ``mjit`` traces.

The work is in :mod:`multimesh.jax.flax._nnx_names`; this module keeps
``import multimesh.jax`` free of flax: a process that never imported
``flax.nnx`` holds no NNX module to name.
"""

from __future__ import annotations

import contextlib
import sys
from contextlib import AbstractContextManager

__all__ = ["module_names"]


def module_names(*roots) -> AbstractContextManager[None]:
    """NNX module calls enter scopes named by their graph paths inside the block."""
    if "flax.nnx" not in sys.modules:
        return contextlib.nullcontext()
    from multimesh.jax.flax._nnx_names import module_names as names

    return names(*roots)
