"""The one datasheet: each known accelerator kind's published figures.

:meth:`multimesh.jax.DeviceModel.for_device` (a real device, by its ``device_kind``)
and :class:`multimesh.jax.Cluster` (a described one, by name) both read
:data:`DEVICE_KINDS`; docs/planning.md cites every figure (no jax here).
"""

from __future__ import annotations

import dataclasses

__all__ = ["DeviceSpec", "DEVICE_KINDS", "ALIASES", "kind_of_device", "NCCL_RING_LATENCY"]

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
    and says so); ``source``: where the figures come from; ``link_latency`` and
    ``network_latency``: seconds each step of a ring collective waits besides its
    bytes, inside a node and between nodes (the alpha of the alpha-beta model; the
    defaults are NCCL's own tuning model's ring figures for its Simple protocol,
    the one large messages use: :data:`NCCL_RING_LATENCY`).
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
    link_latency: float = 3.4e-6
    network_latency: float = 9.6e-6


NCCL_RING_LATENCY = (
    "3.4 us per ring step over NVLink and 9.6 us over the network: NCCL's tuning model "
    "(src/graph/tuning.cc, hwLat, Ring/Simple; a ring all-reduce's latency there is "
    "its base plus 2 (n - 1) such steps, an all-gather's n - 1)")


_H100_EFF = ("0.75: FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) reaches 740 "
             "TFLOP/s in FP16 on H100 SXM5, whose dense FP16 and BF16 peaks are both 989")
_A100_EFF = ("0.73: FlashAttention-2 (Dao 2023, arXiv:2307.08691) reaches up to 73% of the "
             "A100's 312 TFLOP/s")

DEVICE_KINDS: dict[str, DeviceSpec] = {s.kind: s for s in (
    DeviceSpec("h100", 989e12, 80 * GB, 3.35e12, 450 * GB, 50 * GB, 8, 0.75,
               "NVIDIA H100 SXM5 datasheet; NVLink 4 900 GB/s (450 each way); ConnectX-7 "
               f"400 Gb/s per GPU (DGX H100); efficiency {_H100_EFF}; latency "
               f"{NCCL_RING_LATENCY}"),
    DeviceSpec("h200", 989e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB, 8, 0.75,
               "NVIDIA H200 SXM datasheet; NVLink 4 900 GB/s; 400 Gb/s per GPU; "
               f"efficiency {_H100_EFF} (same Hopper SM); latency {NCCL_RING_LATENCY}"),
    DeviceSpec("a100-80gb", 312e12, 80 * GB, 2.039e12, 300 * GB, 25 * GB, 8, 0.73,
               "NVIDIA A100 SXM4 80 GB datasheet; NVLink 3 600 GB/s (300 each way); "
               f"HDR 200 Gb/s per GPU (DGX A100); efficiency {_A100_EFF}; latency "
               f"{NCCL_RING_LATENCY}"),
    DeviceSpec("a100-40gb", 312e12, 40 * GB, 1.555e12, 300 * GB, 25 * GB, 8, 0.73,
               "NVIDIA A100 SXM4 40 GB datasheet; NVLink 3 600 GB/s; HDR 200 Gb/s per GPU; "
               f"efficiency {_A100_EFF}; latency {NCCL_RING_LATENCY}"),
    DeviceSpec("tpu-v5p", 459e12, 95 * GB, 2.765e12, 600 * GB, 25 * GB, 8960, 1.0,
               "Google Cloud TPU v5p page: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s, ICI "
               "4,800 Gb/s per chip, pods of 8,960 chips; DCN per chip not published "
               "(25 GB/s assumed); no published kernel efficiency (1.0); no published ICI or "
               "DCN collective latency (NCCL's ring figures assumed)"),
    DeviceSpec("tpu-v5e", 197e12, 16 * GB, 819e9, 200 * GB, 25 * GB, 256, 1.0,
               "Google Cloud TPU v5e page: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI "
               "1,600 Gb/s per chip, pods of 256 chips; DCN per chip not published "
               "(25 GB/s assumed); no published kernel efficiency (1.0); no published ICI or "
               "DCN collective latency (NCCL's ring figures assumed)"),
    DeviceSpec("tpu-v4", 275e12, 32 * GB, 1.2e12, 300 * GB, 25 * GB, 4096, 1.0,
               "Google Cloud TPU v4 page: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s, ICI "
               "2,400 Gb/s per chip, pods of 4,096 chips; DCN per chip not published "
               "(25 GB/s assumed); no published kernel efficiency (1.0); no published ICI or "
               "DCN collective latency (NCCL's ring figures assumed)"),
)}

ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h100-80gb": "h100", "h200-sxm": "h200",
           "v5p": "tpu-v5p", "v5e": "tpu-v5e", "tpu-v5-lite": "tpu-v5e", "v4": "tpu-v4"}

# a real device's ``device_kind`` (lower case, spaces and dashes dropped) -> its kind,
# the first whose words all appear, in this order
_DEVICE_KIND_WORDS = ((("h200",), "h200"), (("h100",), "h100"), (("a100", "40gb"), "a100-40gb"),
                      (("a100",), "a100-80gb"), (("v5lite",), "tpu-v5e"), (("v5e",), "tpu-v5e"),
                      (("v5p",), "tpu-v5p"), (("tpuv5",), "tpu-v5p"), (("tpuv4",), "tpu-v4"))


def kind_of_device(device_kind: str) -> str | None:
    """The :data:`DEVICE_KINDS` key of a real device's ``device_kind`` string ("NVIDIA
    H100 80GB HBM3", "TPU v5 lite"), or None for a kind without a datasheet."""
    key = str(device_kind).lower().replace(" ", "").replace("-", "")
    for words, kind in _DEVICE_KIND_WORDS:
        if all(w in key for w in words):
            return kind
    return None
