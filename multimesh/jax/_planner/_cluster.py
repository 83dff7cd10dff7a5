"""A cluster described, not attached: device kind, count, nodes and links.

:data:`DEVICE_KINDS` carries each known kind's published figures (docs/planning.md
cites every one); :class:`Cluster` names a kind and a count and may override any
figure. :meth:`Cluster.device_model` prices work through the one hardware model,
:class:`~multimesh.jax.DeviceModel`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._analysis.costs import DeviceModel

__all__ = ["Cluster", "DeviceSpec", "DEVICE_KINDS"]

GB = 1e9


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator kind's published figures.

    ``peak_flops``: dense bf16 flop/s; ``hbm_bytes`` and ``hbm_bandwidth``: its
    memory; ``link_bandwidth``: bytes/s one device sends inside a node (NVLink, ICI),
    one direction; ``network_bandwidth``: bytes/s per device between nodes;
    ``devices_per_node``: devices a node (an NVLink domain, a TPU slice's ICI)
    joins; ``compute_efficiency``: the fraction of peak a published matmul-bound
    kernel reaches on it (1.0 where none is published: then the plan is optimistic
    and says so); ``source``: where the figures come from.
    """

    kind: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    link_bandwidth: float
    network_bandwidth: float
    devices_per_node: int
    compute_efficiency: float
    source: str


_H100_EFF = ("0.75: FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) reaches 740 "
             "TFLOP/s in FP16 on H100 SXM5, whose dense FP16 and BF16 peaks are both 989")
_A100_EFF = ("0.73: FlashAttention-2 (Dao 2023, arXiv:2307.08691) reaches up to 73% of the "
             "A100's 312 TFLOP/s")

DEVICE_KINDS: dict[str, DeviceSpec] = {s.kind: s for s in (
    DeviceSpec("h100", 989e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 8, 0.75,
               "NVIDIA H100 SXM5 datasheet; NVLink 4 900 GB/s (450 each way); ConnectX-7 "
               f"400 Gb/s per GPU (DGX H100); efficiency {_H100_EFF}"),
    DeviceSpec("h200", 989e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 8, 0.75,
               "NVIDIA H200 SXM datasheet; NVLink 4 900 GB/s; 400 Gb/s per GPU; "
               f"efficiency {_H100_EFF} (same Hopper SM)"),
    DeviceSpec("a100-80gb", 312e12, 80 * GB, 2.039e12, 300 * GB, 25 * GB, 8, 0.73,
               "NVIDIA A100 SXM4 80 GB datasheet; NVLink 3 600 GB/s (300 each way); "
               f"HDR 200 Gb/s per GPU (DGX A100); efficiency {_A100_EFF}"),
    DeviceSpec("a100-40gb", 312e12, 40 * GB, 1.555e12, 300 * GB, 25 * GB, 8, 0.73,
               "NVIDIA A100 SXM4 40 GB datasheet; NVLink 3 600 GB/s; HDR 200 Gb/s per GPU; "
               f"efficiency {_A100_EFF}"),
    DeviceSpec("tpu-v5p", 459e12, 95 * GB, 2.765e12, 600 * GB, 25 * GB, 8960, 1.0,
               "Google Cloud TPU v5p page: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s, ICI "
               "4,800 Gb/s per chip, pods of 8,960 chips; DCN per chip not published "
               "(25 GB/s assumed); no published kernel efficiency (1.0)"),
    DeviceSpec("tpu-v5e", 197e12, 16 * GB, 819e9, 200 * GB, 25 * GB, 256, 1.0,
               "Google Cloud TPU v5e page: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI "
               "1,600 Gb/s per chip, pods of 256 chips; DCN per chip not published "
               "(25 GB/s assumed); no published kernel efficiency (1.0)"),
)}

_ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h100-80gb": "h100", "h200-sxm": "h200",
            "v5p": "tpu-v5p", "v5e": "tpu-v5e", "tpu-v5-lite": "tpu-v5e"}


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


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The machines a plan is for, described: ``Cluster("h100", devices=256)``.

    ``kind``: a known device kind (:data:`DEVICE_KINDS`: its published figures) or
    ``"custom"`` (then give every figure). ``devices``: how many. Any figure may be
    overridden: ``devices_per_node``, ``link_bandwidth`` (bytes/s per device inside
    a node, one way), ``network_bandwidth`` (bytes/s per device between nodes),
    ``hbm_bytes``, ``hbm_bandwidth``, ``peak_flops``, ``compute_efficiency``.
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

    def __post_init__(self):
        _positive(self.devices, "devices", integer=True)
        if self.devices_per_node is not None:
            _positive(self.devices_per_node, "devices_per_node", integer=True)
        for name in _FIGURES:
            v = getattr(self, name)
            if v is not None:
                _positive(v, name)
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
        given = {n: getattr(self, n) for n in (*_FIGURES, "devices_per_node")
                 if getattr(self, n) is not None}
        if given and base.kind != "custom":
            given["source"] = base.source + f"; overridden: {sorted(given)}"
        return dataclasses.replace(base, **given)

    @property
    def nodes(self) -> int:
        return max(1, self.devices // self.spec.devices_per_node)

    def device_model(self) -> DeviceModel:
        """The :class:`DeviceModel` that prices this cluster's work."""
        s = self.spec
        return DeviceModel(peak_flops=s.peak_flops, memory_bandwidth=s.hbm_bandwidth,
                           overhead=1e-5, name=s.kind, link_bandwidth=s.link_bandwidth,
                           compute_efficiency=s.compute_efficiency,
                           network_bandwidth=s.network_bandwidth,
                           devices_per_node=s.devices_per_node)

    def describe(self) -> str:
        s = self.spec
        return (f"{self.devices} x {s.kind} ({self.nodes} node(s) of {s.devices_per_node}): "
                f"{s.peak_flops / 1e12:.0f} TFLOP/s bf16 at {s.compute_efficiency:.0%}, "
                f"{s.hbm_bytes / GB:.0f} GB HBM at {s.hbm_bandwidth / 1e12:.2f} TB/s, "
                f"{s.link_bandwidth / GB:.0f} GB/s inside a node, "
                f"{s.network_bandwidth / GB:.0f} GB/s between nodes per device")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
