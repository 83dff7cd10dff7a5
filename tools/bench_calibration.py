"""How much ``DeviceModel.calibrate`` agrees with itself (issue 38 item 4).

    python tools/bench_calibration.py [--runs 5] [--devices 8]

Calibrates ``--runs`` times in a row (``refresh=True``: each measures afresh, each
its own rounds of interleaved probes and medians), prints each run's figures, and
per figure the spread (max / min over the runs; the issue asks for within 20%,
i.e. a spread of at most 1.2 around the middle: max/min <= 1.2 / 0.8 = 1.5 at the
extremes, and each run within 20% of the median). The load average before and after
is printed: on a shared machine, compare only runs at a low load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tools.doc_check import use_cpu_devices  # noqa: E402


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "n/a"


FIGURES = (("peak_flops", "flop/s"), ("memory_bandwidth", "B/s memory"),
           ("link_bandwidth", "B/s link"), ("overhead", "s per call"),
           ("collective_latency", "s per collective step"),
           ("rendezvous", "of a call's compute waited in its collectives"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--devices", type=int, default=8)
    args = ap.parse_args(argv)
    use_cpu_devices(args.devices)
    import jax

    import multimesh.jax as mm

    print(f"load average before: {_load()} ({os.cpu_count()} cores)")
    runs = []
    for k in range(args.runs):
        t0 = time.perf_counter()
        dm = mm.DeviceModel.calibrate(refresh=True)
        took = time.perf_counter() - t0
        runs.append(dm)
        print(f"run {k + 1}: " + ", ".join(f"{getattr(dm, f):.3g} {u}" for f, u in FIGURES)
              + f"  ({took:.2f} s)")
    print(f"load average after: {_load()}; {len(jax.devices())} "
          f"{jax.devices()[0].platform} devices")
    print(f"{'figure':<19}{'median':>11}{'min':>11}{'max':>11}{'max/min':>9}"
          f"{'worst vs median':>17}")
    worst_all = 0.0
    for f, _ in FIGURES:
        v = [getattr(dm, f) for dm in runs]
        med = statistics.median(v)
        worst = max(abs(x / med - 1) for x in v) if med else float(max(v) > 0)
        worst_all = max(worst_all, worst)
        ratio = max(v) / min(v) if min(v) else float("inf")
        print(f"{f:<19}{med:>11.3g}{min(v):>11.3g}{max(v):>11.3g}{ratio:>9.2f}"
              f"{worst:>16.0%}")
    print(f"every run within {worst_all:.0%} of the median "
          f"({'within' if worst_all <= 0.2 else 'NOT within'} the issue's 20%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
