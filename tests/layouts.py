"""What the MPMD tests compare with ``jax.jit``: where a result lives and how it is
split (:func:`spec_of`), and per-device work (:func:`flops_of`)."""

from __future__ import annotations


def flops_of(compiled) -> float:
    """``cost_analysis()["flops"]``: per device; every fragment summed for mjit's."""
    return float(compiled.cost_analysis()["flops"])


def spec_of(sharding, ndim: int) -> tuple:
    """A sharding's spec over the axes with more than one device, padded to ``ndim``."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    sizes = dict(sharding.mesh.shape)

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        return tuple(n for n in names if n is not None and sizes.get(n, 1) > 1) or None
    return tuple(keep(e) for e in spec)
