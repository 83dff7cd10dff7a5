"""What a collective costs on simulated CPU devices, alone and between matmuls.

    python tools/bench_rendezvous.py [--reps 20]

On XLA:CPU a collective is a rendezvous of the devices' threads. With more device
threads than cores, it waits for every thread's compute before it, so its cost grows
with the work between collectives; ``DeviceModel.calibrate``'s latency probe (a chain
of bare all-gathers) measures it with no work between, its ``rendezvous`` (a chain of
small layers with and without an all-gather after each) the share of the compute
between that each collective waits for. For 4 and 8 devices and matmul widths
0 (none), 64 and 256, this times 16 chained steps of ``x = tanh(x @ w)`` (32 rows a
device) with and without an all-gather after each, and prints the difference per
all-gather and per ring step (docs/performance.md, issue 38).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

CHAIN = 16


def _timed(f, *args, reps: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _chain(mesh: Mesh, width: int, gather: bool):
    def body(x, w):
        for _ in range(CHAIN):
            if width:
                x = jnp.tanh(x @ w)
            if gather:
                x = jax.lax.all_gather(x, "d", tiled=True)[:x.shape[0]] * 0.5 + x
        return x
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}")
    for n in (4, 8):
        mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
        for width in (0, 64, 256):
            cols = max(width, 8)
            x, w = jnp.ones((n * 32, cols)), jnp.full((cols, cols), 0.01)
            bare = _timed(_chain(mesh, width, False), x, w, reps=args.reps)
            with_gathers = _timed(_chain(mesh, width, True), x, w, reps=args.reps)
            per = (with_gathers - bare) / CHAIN
            print(f"{n} devices, matmul width {width:3d}: {per * 1e6:7.1f} us an all-gather, "
                  f"{per / (n - 1) * 1e6:6.1f} us a ring step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
