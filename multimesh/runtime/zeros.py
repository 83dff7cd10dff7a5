"""The zeros a run starts from (a loop's running sums), made without a fragment.

The plan turns a fragment that only returns zeros into :attr:`Plan.zeros`. On the CPU a
``device_put`` of cached host zeros is a memcpy and compiles nothing. On an accelerator
it would copy every accumulator from the host each step, so there one jitted fill per
submesh (compiled on first use, a broadcast) writes them on the devices instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np


def _fill(avals: tuple[tuple[tuple[int, ...], np.dtype], ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in avals)


class Zeros:
    """Makes the zeros of one run, in the order of ``ids``."""

    def __init__(self, ids: Sequence[int], avals: Sequence[tuple[tuple[int, ...], np.dtype]],
                 shardings: Sequence[jax.sharding.Sharding], *, on_device: bool | None = None):
        self.ids = list(ids)
        if on_device is None:
            on_device = any(getattr(d, "platform", "cpu") != "cpu"
                            for s in shardings for d in s.device_set)
        self.on_device = on_device
        self._shardings = list(shardings)
        self._host = [] if on_device else [np.zeros(s, d) for s, d in avals]
        groups: dict[frozenset, list[int]] = {}
        for i, s in enumerate(shardings):
            groups.setdefault(frozenset(s.device_set), []).append(i)
        self._fills = [] if not on_device else [
            (idx, jax.jit(partial(_fill, tuple(avals[i] for i in idx)),
                          out_shardings=tuple(shardings[i] for i in idx)))
            for idx in groups.values()]

    def make(self) -> list[jax.Array]:
        """This run's zeros (fresh: the fragment that sums into them donates them)."""
        if not self.on_device:
            return list(jax.device_put(self._host, self._shardings))
        out: list = [None] * len(self.ids)
        for idx, fill in self._fills:
            for i, z in zip(idx, fill()):
                out[i] = z
        return out
