"""Compare pipeline time and dispatch overhead between source trees, side by side.

    git archive <commit> | tar -x -C /tmp/base
    python tools/bench_compare.py /tmp/base . --ops 60000 --rounds 3

Each round runs every tree in its own process, in turn (the machine is shared, so
rounds interleave). Per tree and round it prints: ``Pipeline.run`` of the default
pipeline on a generated module (``tools/bench.py``'s P4 module) and the same through
``run_pipeline`` (what ``mjit`` calls, with its repro bookkeeping), best of 2; and
P2/P2_transfer from ``tools/bench.py``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

_CHILD = r"""
import os, sys, time
root = sys.argv[1]
sys.path.insert(0, root); sys.path.insert(0, os.path.join(root, "tools"))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import multimesh, bench
assert os.path.realpath(multimesh.__file__).startswith(os.path.realpath(root))
from multimesh.passes.pipeline import parse_pipeline
from multimesh._src.mlir import make_context, parse_module
try:
    from multimesh.jax._stages.pipeline import default_pipeline
    from multimesh.jax._stages.pipeline_runner import run_pipeline
except ImportError:  # a tree from before _mjit.py was split by concern
    from multimesh.jax._stages.mjit import default_pipeline, run_pipeline
text = bench.generate_module(int(sys.argv[2]))
out = {}
for label, fn in (("Pipeline.run", lambda m: parse_pipeline(default_pipeline(8)).run(m)),
                  ("run_pipeline", lambda m: run_pipeline(m, default_pipeline(8)))):
    best = None
    for _ in range(2):
        m = parse_module(text, make_context())
        t0 = time.perf_counter(); fn(m); dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    out[label + "_s"] = best
out["P2"], out["P2_transfer"] = bench._p2(int(sys.argv[3]))
print("  ".join(f"{k} {v:.3f}" for k, v in out.items()))
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("roots", nargs="+", help="source trees (repository roots)")
    ap.add_argument("--ops", type=int, default=60_000)
    ap.add_argument("--reps", type=int, default=2000, help="P2 repetitions")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    for r in range(args.rounds):
        for root in args.roots:
            p = subprocess.run([sys.executable, "-c", _CHILD, os.path.abspath(root),
                                str(args.ops), str(args.reps)], capture_output=True, text=True)
            line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 else \
                f"failed: {p.stderr.strip().splitlines()[-1:]}"
            print(f"round {r} {root}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
