"""Activation memory per submesh, measured in a real step, against each schedule's theory.

    python tools/bench_memory.py [--seq 32] [--reps 3] [--schedules gpipe,1f1b] [--json PATH]

An 8-block transformer (d=128, 4 heads, batch 256 of sequences of ``--seq`` tokens)
in 4 stages of 2 blocks, each stage a task on 2 devices (batch sharded over them),
trained with ``microbatch(value_and_grad(loss), schedule=..., remat=...)`` over M=8
microbatches; ``interleaved-1f1b`` places 8 one-block stages round-robin. For every
schedule, without and with ``remat=True``, it reports per submesh the measured peak
activation bytes (``MpmdCompiled.memory_profile``: the buffers the runtime holds
after every step of a real run), the schedule's theory (its peak live microbatches
times what one microbatch holds per stage there, awaiting its backward or its
weight half) and their ratio, the step time
(median of ``--reps`` runs, the two variants alternating), and the forward ops the backward fragments recompute
(``exponential``: one per block's softmax, counted over both halves of a split
backward).

Goals (issue 26): measured within 10% of theory; with remat the activations fall to
the stage inputs of in-flight microbatches, at a step time of at most 1.35x.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/ (its helpers)
from _bench_common import pipelined_transformer, write_json  # noqa: E402

D, HEADS, BLOCKS, SUBMESHES, BATCH, M = 128, 4, 8, 4, 256, 8
SCHEDULES = ["gpipe", "1f1b", "zero-bubble-h1", "zero-bubble-h2", "interleaved-1f1b"]
REAL_SCHEDULES = ["gpipe", "1f1b", "zero-bubble-h1", "dualpipe-v"]
V_SHAPED = ("dualpipe-v", "zero-bubble-v")


def _home(k: int, stages: int, v_shape: bool = False) -> int:
    """Stage ``k``'s submesh: k % 4, or in a V (dualpipe-v) k down and 2P - 1 - k up."""
    if v_shape and k >= SUBMESHES:
        return 2 * SUBMESHES - 1 - k
    return k % SUBMESHES


def _model(stages: int, v_shape: bool = False):
    """(loss, params) with ``stages`` stage tasks, stage k on submesh :func:`_home`."""
    per = 8 // SUBMESHES

    def devices(k):
        return range(per * _home(k, stages, v_shape), per * _home(k, stages, v_shape) + per)

    return pipelined_transformer(stages, BLOCKS // stages, D, HEADS, devices)


def _recomputed(compiled) -> int:
    """``exponential`` ops in the stages' backward fragments (softmax's, recomputed)."""
    return sum(len(re.findall(r"= stablehlo\.exponential\b", f["module"]))
               for f in compiled.fragments
               if f["direction"] == "bwd" and f["task"].startswith("stage"))


def _compile(schedule: str, remat: bool, seq: int):
    import jax
    import jax.numpy as jnp

    import multimesh.jax as mm

    v_shape = schedule in V_SHAPED
    stages = 2 * SUBMESHES if schedule == "interleaved-1f1b" or v_shape else SUBMESHES
    loss, params = _model(stages, v_shape)
    x = jax.random.normal(jax.random.key(1), (BATCH, seq, D), jnp.float32)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=BATCH // M, argnum=1,
                         schedule=schedule, remat=True if remat else None)
    compiled = mm.mjit(step).lower(params, x).compile()
    jax.block_until_ready(compiled(params, x))
    return compiled, params, x


def run(schedule: str, seq: int, reps: int) -> list[dict]:
    """Both variants of one schedule: compiled, then timed alternately (the machine is
    shared, so alternating keeps the two under the same load), then measured."""
    import jax

    variants = [(remat, *_compile(schedule, remat, seq)) for remat in (False, True)]
    times: list[list[float]] = [[], []]
    for _ in range(reps):
        for k, (_, compiled, params, x) in enumerate(variants):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, x))
            times[k].append(time.perf_counter() - t0)
    out = []
    for (remat, compiled, params, x), ts in zip(variants, times):
        prof = compiled.memory_profile(params, x)
        rows = []
        for s, theory, n in zip(prof.submeshes, prof.predicted_activations,
                                prof.predicted_microbatches):
            rows.append({"devices": list(s.devices), "measured": s.peak_activations,
                         "theory": theory,
                         "ratio": s.peak_activations / theory if theory else None,
                         "mbs": s.peak_microbatches, "predicted_mbs": n,
                         "per_microbatch": s.residual_bytes, "weight_half": s.weight_bytes,
                         "peak": s.peak, "temporaries": s.temporaries,
                         "transient": s.peak_transient, "stage_bytes": s.stage_bytes})
        out.append({"schedule": schedule, "remat": remat, "step_s": statistics.median(ts),
                    "recomputed_exp": _recomputed(compiled), "submeshes": rows})
    return out


def _print(r: dict) -> None:
    mib = 1 << 20
    label = f"{r['schedule']}{' remat' if r['remat'] else ''}"
    print(f"{label:<24} step {r['step_s'] * 1e3:7.1f} ms  recomputed exp ops "
          f"{r['recomputed_exp']}", flush=True)
    for s in r["submeshes"]:
        ratio = f"{s['ratio']:.2f}" if s["ratio"] is not None else "-"
        print(f"    submesh {s['devices']}: measured {s['measured'] / mib:7.2f} MiB "
              f"({s['mbs']} mb)  theory {s['theory'] / mib:7.2f} MiB "
              f"(<= {s['predicted_mbs']} mb; {s['per_microbatch'] / mib:.2f} + "
              f"{s['weight_half'] / mib:.2f} each)  ratio {ratio}  "
              f"peak {s['peak'] / mib:.2f} MiB (transient {s['transient'] / mib:.2f})",
              flush=True)


# ------------------------------------------------------------- the real peak (issue 33)


def _status(field: str) -> int:
    """``/proc/self/status``'s ``field`` (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Start the RSS high-water mark (VmHWM) afresh from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_of(run) -> int:
    """The RSS high-water mark while ``run()`` runs, above the RSS before it."""
    import gc

    gc.collect()
    base = _status("VmRSS")
    _reset_peak()
    out = run()
    peak = _status("VmHWM") - base
    del out
    gc.collect()
    return peak


def _child(cfg: dict) -> dict:
    """One (schedule, remat) in this fresh process: the real peak of two ordinary calls
    per run-ahead bound, the peak dispatched step by step, the theory, step times."""
    import jax

    compiled, params, x = _compile(cfg["schedule"], cfg["remat"], cfg["seq"])
    prof = compiled.memory_profile(params, x)
    # theory above the compiled state: per device, the most it holds beyond the inputs
    theory = sum((s.peak - s.inputs) * len(s.devices) for s in prof.submeshes)
    two = lambda: jax.block_until_ready([compiled(params, x), compiled(params, x)])  # noqa: E731
    stepwise = _peak_of(lambda: compiled.profile(params, x))
    out = {"schedule": cfg["schedule"], "remat": cfg["remat"], "theory": theory,
           "stepwise": stepwise, "real": {}, "step_s": {}}
    bounds = [None if b == "none" else int(b) for b in cfg["bounds"]]
    for b in bounds:
        compiled.run_ahead = b
        two()  # warm this program
        out["real"][str(b)] = _peak_of(two)
    times: dict[str, list[float]] = {str(b): [] for b in bounds}
    for _ in range(cfg["reps"]):
        for b in bounds:  # alternating, so the variants share the machine's load
            compiled.run_ahead = b
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, x))
            times[str(b)].append(time.perf_counter() - t0)
    out["step_s"] = {k: statistics.median(v) for k, v in times.items()}
    return out


def real_peaks(schedules: list[str], seq: int, reps: int, bounds: list[str]) -> list[dict]:
    """:func:`_child` for each schedule, without and with remat, each in a fresh process
    (glibc returns every buffer of 64 KiB or more to the system at once:
    ``MALLOC_MMAP_THRESHOLD_``, so RSS follows the live buffers)."""
    import subprocess

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    env.pop("MULTIMESH_RUN_AHEAD", None)
    out = []
    for schedule in schedules:
        for remat in (False, True):
            cfg = {"schedule": schedule, "remat": remat, "seq": seq, "reps": reps,
                   "bounds": bounds}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                   json.dumps(cfg)], env=env, capture_output=True,
                                  text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            _print_real(r)
            out.append(r)
    return out


def _print_real(r: dict) -> None:
    mib = 1 << 20
    label = f"{r['schedule']}{' remat' if r['remat'] else ''}"
    parts = [f"theory {r['theory'] / mib:7.1f} MiB",
             f"step by step {r['stepwise'] / mib:7.1f} ({r['stepwise'] / r['theory']:.2f}x)"]
    for b, v in r["real"].items():
        name = "unbounded" if b == "None" else f"run_ahead={b}"
        parts.append(f"{name} {v / mib:7.1f} ({v / r['theory']:.2f}x, "
                     f"{r['step_s'][b] * 1e3:.0f} ms)")
    print(f"{label:<20} " + "  ".join(parts), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per config")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--real", action="store_true",
                    help="the real peak (RSS of two ordinary calls in a fresh process) "
                         f"against theory, for {','.join(REAL_SCHEDULES)} unless "
                         "--schedules says otherwise, per --run-ahead bound")
    ap.add_argument("--run-ahead", default="none,2,1",
                    help="run-ahead bounds to compare with --real ('none': no bound)")
    ap.add_argument("--issue-size", action="store_true",
                    help="issue 33's size: sequences of 128 tokens (activations dominate)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(json.loads(args.child))), flush=True)
        return 0
    if args.issue_size:
        args.seq = 128
    if args.real:
        schedules = (args.schedules.split(",") if "--schedules" in (argv or sys.argv)
                     else REAL_SCHEDULES)
        print(f"transformer: {BLOCKS} blocks, d={D}, batch {BATCH} x {args.seq} tokens, "
              f"{SUBMESHES} submeshes x 2 devices, M={M}; RSS above the compiled state, "
              "all 8 devices", flush=True)
        results = real_peaks(schedules, args.seq, args.reps, args.run_ahead.split(","))
        write_json(args.json, results, indent=1)
        return 0
    print(f"transformer: {BLOCKS} blocks, d={D}, batch {BATCH} x {args.seq} tokens, "
          f"{SUBMESHES} submeshes x 2 devices, M={M}", flush=True)
    results = []
    for schedule in args.schedules.split(","):
        for r in run(schedule, args.seq, args.reps):
            _print(r)
            results.append(r)
        plain, rem = results[-2], results[-1]
        print(f"    remat step time {rem['step_s'] / plain['step_s']:.2f}x", flush=True)
    write_json(args.json, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
