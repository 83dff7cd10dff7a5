"""Long fuzzing profiles (docs/testing.md).

    python tools/fuzz.py --programs 500 --seed 0        # differential MPMD fuzzing
    python tools/fuzz.py --programs 200 --microbatch 1  # ... microbatched programs only
    python tools/fuzz.py --ir 5000 --seed 0             # mm-opt IR fuzzing
    python tools/fuzz.py --ir-attrs 20000 --seed 0      # attribute types and values
    python tools/fuzz.py --bytecode 5000 --seed 0       # mutated MLIR bytecode
    python tools/fuzz.py --programs 200 --ir 2000 --out /tmp/fuzz-out

Unlike the hypothesis tests in CI, the long profile keeps going after a failure:
programs come from ``random_program(seed + i)`` (``microbatch=FRACTION`` with
``--microbatch``: that fraction of programs runs under ``mm.microbatch`` with a random
schedule; 0, the default, draws the same programs as before) and every failing one is
written, as a
standalone repro, to ``OUT/programs/<kind>-seed<N>.py`` (``OUT`` is ``--out``, by
default ``$TMPDIR/multimesh-fuzz``); IR cases that misbehave go to
``OUT/ir/case<N>.mlir`` with the pipeline in a header comment. Failures explained by a
known bug (``KNOWN_BUGS`` in tests/fuzz/programs.py, ``KNOWN_IR_BUGS`` in
tests/test_fuzz_ir.py, each pinned by a strict xfail test) are counted separately and
do not fail the run. Programs run in batches in worker processes and IR cases in a
restartable worker, so a hard crash or a hang loses one case and is reported as such.
Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


def _program_worker(first: int, count: int, out: str, microbatch: float = 0.0) -> int:
    """Runs in a subprocess: one JSON line per program on stdout."""
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    from tests.fuzz.programs import FuzzFailure, check, random_program, render

    for seed in range(first, first + count):
        p = random_program(seed, microbatch=microbatch)
        rec = {"seed": seed, "tasks": len(p.tasks), "grad": p.grad}
        if p.microbatch:
            rec["microbatch"] = [p.microbatch.schedule, p.microbatch.num_microbatches]
        t0 = time.perf_counter()
        try:
            o = check(p)
            rec.update(status=o.status, known=list(o.known), fragments=o.n_fragments,
                       transfers=o.n_transfers)
        except FuzzFailure as e:
            rec.update(status="FAIL", kind=e.kind, detail=e.detail.splitlines()[0][:300])
            d = Path(out, "programs")
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{e.kind}-seed{seed}.py").write_text(
                f"# {e.kind}: {e.detail}\n".replace("\n", "\n# ").rstrip("# ") + "\n"
                + render(p))
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()
    return 0


def run_programs(n: int, seed: int, out: str, batch: int, microbatch: float = 0.0) -> dict:
    stats = collections.Counter()
    schedules = collections.Counter()
    known = collections.Counter()
    fails = []
    t0 = time.perf_counter()
    next_seed, end = seed, seed + n
    while next_seed < end:
        count = min(batch, end - next_seed)
        cmd = [sys.executable, __file__, "--_worker", str(next_seed), str(count), out,
               str(microbatch)]
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                text=True, env=dict(os.environ, **_ENV), cwd=str(ROOT))
        done = next_seed
        for line in proc.stdout:
            rec = json.loads(line)
            done = rec["seed"] + 1
            stats[rec["status"]] += 1
            if "microbatch" in rec:
                schedules["{} x {}".format(*rec["microbatch"])] += 1
            for k in rec.get("known", []):
                known[k] += 1
            if rec["status"] == "FAIL":
                fails.append(rec)
                print(f"  FAIL seed {rec['seed']}: [{rec['kind']}] {rec['detail']}", flush=True)
        proc.wait()
        if done < next_seed + count:  # the worker died on program `done`
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
            stats["CRASH"] += 1
            fails.append({"seed": done, "kind": "process-crash",
                          "detail": f"worker exit status {proc.returncode}: {' | '.join(tail)}"})
            print(f"  CRASH seed {done}: worker exit status {proc.returncode}: "
                  f"{' | '.join(tail)}", flush=True)
            done += 1
        err.close()
        next_seed = done
        print(f"  ... {next_seed - seed}/{n} programs, {time.perf_counter() - t0:.0f} s",
              flush=True)
    return {"programs": n, "seconds": round(time.perf_counter() - t0, 1),
            "outcomes": dict(stats), "known_bugs_touched": dict(known),
            "microbatched": sum(schedules.values()),
            "schedules": dict(sorted(schedules.items())), "failures": fails}


def run_ir(n: int, seed: int, out: str) -> dict:
    from tests.test_fuzz_ir import make_cases

    n_iso = max(1, n // 5)
    cases = make_cases(n - n_iso, seed, isolated=False) + \
        make_cases(n_iso, seed + 1, isolated=True)
    return _run_ir_cases(cases, out, "ir") | {"isolated": n_iso}


def run_ir_attrs(n: int, seed: int, out: str) -> dict:
    """``n`` inputs whose attributes have other types and values (3% to compile_mpmd)."""
    from tests.test_fuzz_ir import COMPILE_MPMD, make_attr_cases

    cases = make_attr_cases(n, seed)
    summary = _run_ir_cases(cases, out, "ir-attrs")
    summary["compile_mpmd"] = sum(c.pipeline == COMPILE_MPMD for c in cases)
    return summary


def run_bytecode(n: int, seed: int, out: str) -> dict:
    """``n`` mutated bytecode inputs (tests/test_fuzz_bytecode.py), in crash-isolated
    workers; each failing case is written to ``OUT/bytecode/case<N>.mlirbc``."""
    from tests.test_fuzz_bytecode import make_cases, result_problems, run_isolated

    t0 = time.perf_counter()
    cases = make_cases(n, seed)
    d = Path(out, "bytecode")
    d.mkdir(parents=True, exist_ok=True)
    results, deaths = run_isolated(cases, d)
    fails = [{"death": why} for why in deaths]
    stats = collections.Counter()
    for r in results:
        case = cases[r["id"]]
        found = result_problems(case, r)
        if found:
            fails.append({"case": r["id"], "seed": case["seed"], "mutations": case["mutations"],
                          "pipeline": case["pipeline"], "problems": found})
            (d / f"case{r['id']}.mlirbc").write_bytes(bytes.fromhex(case["data"]))
        stats["FAIL" if found else "diagnosed" if r["rc"] == 1 else "clean"] += 1
    for why in deaths:
        print(f"  FAIL {why}", flush=True)
    return {"bytecode_cases": n, "seconds": round(time.perf_counter() - t0, 1),
            "outcomes": dict(stats), "worker_deaths": len(deaths), "failures": fails}


def _run_ir_cases(cases: list, out: str, kind: str) -> dict:
    from tests.test_fuzz_ir import IsolatedRunner, describe, known_bug, problems

    t0 = time.perf_counter()
    stats = collections.Counter()
    by_mut = collections.Counter()
    fails = []
    runner = IsolatedRunner(timeout=30)
    for i, case in enumerate(cases):
        # every case in the worker: a hang or a hard crash costs one case and a restart
        r = runner.run(case)
        found = problems(case, r)
        known = known_bug(case, found) if found else None
        if known:
            stats[f"known:{known}"] += 1
        elif found:
            stats["FAIL"] += 1
            fails.append({"case": i, "seed": case.seed, "mutations": list(case.mutations),
                          "pipeline": case.pipeline, "problems": found})
            d = Path(out, kind)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"case{i}.mlir").write_text(
                f"// mm-opt THIS -p '{case.pipeline}'\n// " +
                describe(case, r, found).split("--- input ---")[0].replace("\n", "\n// ")
                + "\n" + case.text)
            print(f"  FAIL case {i}: {found}", flush=True)
        else:
            stats["diagnosed" if r.rc == 1 else "clean"] += 1
        for m in case.mutations:
            by_mut[m] += 1
        if (i + 1) % 500 == 0:
            print(f"  ... {i + 1}/{len(cases)} {kind} cases, {time.perf_counter() - t0:.0f} s",
                  flush=True)
    runner.close()
    return {"ir_cases": len(cases), "seconds": round(time.perf_counter() - t0, 1),
            "outcomes": dict(stats), "worker_restarts": runner.restarts,
            "mutations": dict(by_mut), "failures": fails}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=0, help="random MPMD programs to check")
    ap.add_argument("--ir", type=int, default=0, help="mutated mm-opt inputs to run")
    ap.add_argument("--ir-attrs", type=int, default=0, metavar="N",
                    help="inputs whose attributes have other types and values (mm-opt, "
                         "mm-import-mpmd, compile_mpmd)")
    ap.add_argument("--bytecode", type=int, default=0, metavar="N",
                    help="mutated MLIR bytecode inputs (mm-opt and compile_mpmd)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=50, help="programs per worker process")
    ap.add_argument("--microbatch", type=float, default=0.0, metavar="FRACTION",
                    help="fraction of programs run under mm.microbatch with a random "
                         "schedule (1: all; default 0: the programs of earlier runs)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "multimesh-fuzz"),
                    help="where repros and summary.json go (default: %(default)s)")
    ap.add_argument("--_worker", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        return _program_worker(int(a._worker[0]), int(a._worker[1]), a._worker[2],
                               float(a._worker[3]))
    if not a.programs and not a.ir and not a.ir_attrs and not a.bytecode:
        a.programs = 500
    summary = {}
    if a.programs:
        if not 0.0 <= a.microbatch <= 1.0:
            ap.error("--microbatch is a fraction between 0 and 1")
        mb = f", {a.microbatch:.0%} of them microbatched" if a.microbatch else ""
        print(f"differential fuzzing: {a.programs} programs from seed {a.seed}{mb}", flush=True)
        summary["programs"] = run_programs(a.programs, a.seed, a.out, a.batch, a.microbatch)
    if a.ir:
        print(f"IR fuzzing: {a.ir} mutated inputs from seed {a.seed}", flush=True)
        summary["ir"] = run_ir(a.ir, a.seed, a.out)
    if a.ir_attrs:
        print(f"IR attribute fuzzing: {a.ir_attrs} inputs from seed {a.seed}", flush=True)
        summary["ir_attrs"] = run_ir_attrs(a.ir_attrs, a.seed, a.out)
    if a.bytecode:
        print(f"bytecode fuzzing: {a.bytecode} mutated inputs from seed {a.seed}", flush=True)
        summary["bytecode"] = run_bytecode(a.bytecode, a.seed, a.out)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "summary.json").write_text(json.dumps(summary, indent=1))
    for k, s in summary.items():
        short = {x: y for x, y in s.items() if x not in ("failures", "mutations", "schedules")}
        print(f"{k}: {json.dumps(short)}  failures: {len(s['failures'])}")
    print(f"summary: {Path(a.out, 'summary.json')}")
    return 1 if any(s["failures"] for s in summary.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
