"""A cluster described, not attached: device kind, count, nodes and links.

:data:`DEVICE_KINDS` (the one datasheet, :mod:`multimesh.jax._analysis.devices`,
which ``DeviceModel.for_device`` reads too) carries each known kind's published
figures (docs/planning.md cites every one); :class:`Cluster` names a kind and a count and may override any
figure. :meth:`Cluster.device_model` prices work through the one hardware model,
:class:`~multimesh.jax.DeviceModel`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._analysis.costs import DeviceModel
from multimesh.jax._analysis.devices import ALIASES, DEVICE_KINDS, DeviceSpec

__all__ = ["Cluster", "DeviceSpec", "DEVICE_KINDS"]

GB = 1e9
_ALIASES = ALIASES


def device_spec(kind: str) -> DeviceSpec:
    """The published figures of ``kind`` (case-insensitive; aliases such as ``a100``)."""
    if not isinstance(kind, str):
        raise MultimeshTypeError(
            f"`Cluster`: `kind` must be a device kind's name (one of "
            f"{sorted(DEVICE_KINDS)}), got {type(kind).__name__} {kind!r}.")
    key = kind.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DEVICE_KINDS:
        raise MultimeshValueError(
            f"`Cluster`: unknown device kind {kind!r}; known kinds: {sorted(DEVICE_KINDS)} "
            f"(aliases {sorted(_ALIASES)}). For another device give `peak_flops`, "
            f"`hbm_bytes`, `hbm_bandwidth` and the bandwidths with kind='custom'.")
    return DEVICE_KINDS[key]


def _positive(value, name: str, integer: bool = False):
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind) or not 0 < float(value) < math.inf:
        raise MultimeshValueError(
            f"`Cluster`: `{name}` must be a positive {'integer' if integer else 'number'}, "
            f"got {value!r}.")
    return value


_FIGURES = ("peak_flops", "hbm_bytes", "hbm_bandwidth", "link_bandwidth", "network_bandwidth",
            "compute_efficiency")
_LATENCIES = ("link_latency", "network_latency")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The machines a plan is for, described: ``Cluster("h100", devices=256)``.

    ``kind``: a known device kind (:data:`DEVICE_KINDS`: its published figures) or
    ``"custom"`` (then give every figure). ``devices``: how many. Any figure may be
    overridden: ``devices_per_node``, ``link_bandwidth`` (bytes/s per device inside
    a node, one way), ``network_bandwidth`` (bytes/s per device between nodes),
    ``hbm_bytes``, ``hbm_bandwidth``, ``peak_flops``, ``compute_efficiency``,
    ``link_latency`` and ``network_latency`` (seconds per ring step of a collective
    inside a node and between nodes; 0 prices bandwidth only).
    """

    kind: str
    devices: int
    devices_per_node: int | None = None
    link_bandwidth: float | None = None
    network_bandwidth: float | None = None
    hbm_bytes: float | None = None
    hbm_bandwidth: float | None = None
    peak_flops: float | None = None
    compute_efficiency: float | None = None
    link_latency: float | None = None
    network_latency: float | None = None

    def __post_init__(self):
        _positive(self.devices, "devices", integer=True)
        if self.devices_per_node is not None:
            _positive(self.devices_per_node, "devices_per_node", integer=True)
        for name in _FIGURES:
            v = getattr(self, name)
            if v is not None:
                _positive(v, name)
        for name in _LATENCIES:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                                  or not 0 <= float(v) < math.inf):
                raise MultimeshValueError(
                    f"`Cluster`: `{name}` must be a number of seconds >= 0 (per ring step "
                    f"of a collective), got {v!r}.")
        if self.compute_efficiency is not None and self.compute_efficiency > 1:
            raise MultimeshValueError(
                f"`Cluster`: `compute_efficiency` is the fraction of peak that matmuls "
                f"reach, in (0, 1]; got {self.compute_efficiency!r}.")
        if str(self.kind).lower() == "custom":
            missing = [n for n in _FIGURES[:5] if getattr(self, n) is None]
            if missing:
                raise MultimeshValueError(
                    f"`Cluster`: kind='custom' has no published figures, so give them: "
                    f"{missing} are missing.")
        else:
            device_spec(self.kind)
        node = self.spec.devices_per_node
        if self.devices > node and self.devices % node:
            raise MultimeshValueError(
                f"`Cluster`: {self.devices} devices do not fill whole nodes of {node}; give a "
                f"multiple of devices_per_node={node} (or set devices_per_node).")

    @property
    def spec(self) -> DeviceSpec:
        """The figures the plan uses: the kind's, with this cluster's overrides."""
        if str(self.kind).lower() == "custom":
            base = DeviceSpec("custom", 1.0, 1.0, 1.0, 1.0, 1.0, self.devices, 1.0,
                              "given by the user")
        else:
            base = device_spec(self.kind)
        given = {n: getattr(self, n) for n in (*_FIGURES, *_LATENCIES, "devices_per_node")
                 if getattr(self, n) is not None}
        if given and base.kind != "custom":
            given["source"] = base.source + f"; overridden: {sorted(given)}"
        return dataclasses.replace(base, **given)

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.spec.devices_per_node)

    def device_model(self) -> DeviceModel:
        """The :class:`DeviceModel` that prices this cluster's work."""
        return DeviceModel.from_spec(self.spec)

    def describe(self) -> str:
        s = self.spec
        return (f"{self.devices} x {s.kind} ({self.nodes} node(s) of {s.devices_per_node}): "
                f"{s.peak_flops / 1e12:.0f} TFLOP/s bf16 at {s.compute_efficiency:.0%}, "
                f"{s.hbm_bytes / GB:.0f} GB HBM at {s.hbm_bandwidth / 1e12:.2f} TB/s, "
                f"{s.link_bandwidth / GB:.0f} GB/s inside a node, "
                f"{s.network_bandwidth / GB:.0f} GB/s between nodes per device")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
