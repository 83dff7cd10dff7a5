"""What the MPMD tests compare with ``jax.jit``: where a result lives and how it is
split (:func:`spec_of`), and per-device work (:func:`flops_of`); and the meshes they
compare on (:func:`global_mesh`, :func:`stage_mesh`)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType


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


def global_mesh(reverse: bool = False) -> jax.sharding.Mesh:
    """The 8 devices as ``("stage", "data", "model")`` = 2x2x2 (auto axes); ``reverse``:
    devices 7..0."""
    devs = jax.devices()[::-1] if reverse else jax.devices()
    return jax.sharding.Mesh(np.asarray(devs).reshape(2, 2, 2), ("stage", "data", "model"),
                             axis_types=(AxisType.Auto,) * 3)


def stage_mesh(first: int = 0) -> jax.sharding.Mesh:
    """One stage's 2x2 ``("data", "model")`` mesh (auto axes) on devices first..first+3."""
    devs = np.asarray(jax.devices()[first:first + 4]).reshape(2, 2)
    return jax.sharding.Mesh(devs, ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def work_per_device(compiled) -> dict[int, float]:
    """Per device position: the flops it runs in one step of an mjit-compiled program
    (each call of each fragment)."""
    per = compiled.cost_analysis(by_fragment=True)
    pd = compiled.plan_data
    out: dict[int, float] = {}
    for call in pd.calls():
        for dev in pd.call_devices(call):
            out[dev] = out.get(dev, 0.0) + float(per[call.fragment].get("flops", 0.0))
    return out
