"""Bytecode fuzzing (issue 31): mutated MLIR *bytecode* never aborts ``mm-opt`` or
``compile_mpmd``, as mutated text never does (tests/test_fuzz_ir.py).

Every golden chunk that parses is written as bytecode, then its bytes are mutated
(a byte of a name made non-UTF-8, a byte of an attribute's text, a random byte flipped,
zeroed or inserted, a range deleted or spliced from another seed, the file truncated).
Each case runs in a crash-isolated worker process, through ``mm-opt`` on the seed's
passes (those that do not reach Shardy's native passes) or, for partitioned seeds,
through ``compile_mpmd``. Each run must end in a clean diagnostic or a clean success,
by :func:`tests.test_fuzz_ir.problems`: no abort, no traceback, no internal error.
A worker that dies names its case and is restarted for the next one.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_CASES = int(os.environ.get("MULTIMESH_FUZZ_BYTECODE", "160"))
COMPILE_SHARE = 0.12
HANG_S = 600.0
"""A case that runs this long is a hang (the worker dumps its threads and exits); no
case on a loaded machine comes near it."""
_MESHES = {"m1": range(4), "m2": range(4, 8), "m3": range(8)}
_BAD_BYTES = (0x80, 0xBF, 0xC0, 0xC3, 0xE2, 0xED, 0xF5, 0xFF)


# ----------------------------------------------------------------------------- cases


@functools.cache
def bytecode_seeds() -> list[tuple[str, bytes, tuple[str, ...], bool]]:
    """``(source, bytecode, pipelines, partitioned)`` for every golden chunk that parses."""
    from multimesh._src.mlir import make_context, module_bytecode, parse_module
    from tests.test_fuzz_ir import load_seeds, needs_isolation

    out = []
    for s in load_seeds():
        try:
            with make_context():
                data = module_bytecode(parse_module(s.text))
        except Exception:  # noqa: BLE001 - chunks that test parse errors
            continue
        pipes = tuple(p for p in s.pipelines if not needs_isolation(p)) + ("",)
        partitioned = "mpmd.fragment_call" in s.text or "mpmd.transfer" in s.text
        out.append((s.source, data, pipes, partitioned))
    return out


def _names(data: bytes) -> list[tuple[int, int]]:
    """``(offset, length)`` of the names and attribute texts in the bytecode."""
    from multimesh._src import bytecode as bc

    try:
        _, sections = bc._sections(data)
        pieces = bc._strings(sections.get(0, b"\0"))
        if 3 in sections:
            pieces += bc._textual_entries(sections.get(2, b""), sections[3])
    except bc.BytecodeFormatError:  # an earlier mutation broke the layout
        return []
    spans = []
    for p in pieces:
        at = data.find(p)
        if at >= 0 and len(p) > 1:
            spans.append((at, len(p) - 1))  # without the null terminator
    return spans


def mutate(data: bytes, rng: random.Random, other: bytes) -> tuple[bytes, str]:
    kind = rng.choice(("name", "name", "name", "rename", "rename", "rename", "flip", "flip",
                       "zero", "insert", "delete", "splice", "truncate"))
    spans = _names(data) if kind in ("name", "rename") else []
    if spans:  # a name made non-UTF-8, or another valid name
        at, n = rng.choice(spans)
        i = at + rng.randrange(n)
        new = rng.choice(_BAD_BYTES) if kind == "name" else rng.choice(b"abmxy019_.")
        return data[:i] + bytes([new]) + data[i + 1:], kind
    if len(data) <= 4:  # only the magic left (a second mutation after a truncation)
        return data + bytes([rng.randrange(256)]), "insert"
    i = rng.randrange(4, len(data))
    if kind in ("flip", "name", "rename"):
        return data[:i] + bytes([data[i] ^ rng.randrange(1, 256)]) + data[i + 1:], "flip"
    if kind == "zero":
        return data[:i] + b"\0" + data[i + 1:], kind
    if kind == "insert":
        return data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))) + \
            data[i:], kind
    if kind == "delete":
        return data[:i] + data[i + rng.randint(1, 8):], kind
    if kind == "splice":
        j = rng.randrange(4, max(5, len(other)))
        return data[:i] + other[j:j + rng.randint(1, 32)] + data[i + rng.randint(0, 32):], kind
    return data[:i], kind


def make_cases(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    seeds = bytecode_seeds()
    partitioned = [s for s in seeds if s[3]]
    cases: list[dict] = []
    while len(cases) < n:
        compile_it = partitioned and rng.random() < COMPILE_SHARE
        source, data, pipes, _ = rng.choice(partitioned if compile_it else seeds)
        muts = []
        for _ in range(rng.choice((1, 1, 2))):
            data, kind = mutate(data, rng, rng.choice(seeds)[1])
            muts.append(kind)
        pipeline = "compile_mpmd" if compile_it else rng.choice(pipes)
        cases.append({"id": len(cases), "seed": source, "mutations": muts,
                      "pipeline": pipeline, "data": data.hex()})
    return cases


# ----------------------------------------------------------------------------- worker


def _run_case(case: dict, workdir: str) -> dict:
    import contextlib
    import io
    import time
    import traceback

    data = bytes.fromhex(case["data"])
    t0 = time.perf_counter()
    if case["pipeline"] == "compile_mpmd":
        import multimesh.jax as mm
        from multimesh._src.errors import MultimeshError

        meshes = {k: v for k, v in _MESHES.items() if k != "m3" or b"m3" in data}
        try:
            mm.compile_mpmd(data, meshes)
            rc, err = 0, ""
        except MultimeshError as e:
            rc, err = 1, f"error: {e}"
        except Exception as e:  # noqa: BLE001 - what the fuzzer looks for
            rc, err = 1, "internal error: " + "".join(traceback.format_exception(e))
        return {"rc": rc, "stderr": err, "wrote": rc == 0, "seconds": time.perf_counter() - t0}
    from multimesh.tools.mm_opt import main

    inp = os.path.join(workdir, f"case{case['id']}.mlirbc")
    out = os.path.join(workdir, f"case{case['id']}.out.mlir")
    with open(inp, "wb") as f:
        f.write(data)
    args = [inp, "-o", out] + (["-p", case["pipeline"]] if case["pipeline"] else [])
    o, e = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
        try:
            rc = main(args)
        except BaseException as ex:  # noqa: BLE001 - a crash is what we look for
            e.write("Traceback (escaped main):\n" + "".join(traceback.format_exception(ex)))
            rc = -999
    return {"rc": rc, "stderr": e.getvalue(), "wrote": os.path.exists(out),
            "seconds": time.perf_counter() - t0}


def _worker_main(path: str, start: int, workdir: str) -> int:
    import faulthandler

    cases = json.loads(Path(path).read_text())
    for case in cases[start:]:
        print(f"start {case['id']}", flush=True)
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        result = _run_case(case, workdir)
        faulthandler.cancel_dump_traceback_later()
        print("done " + json.dumps({"id": case["id"], **result}), flush=True)
    return 0


def run_isolated(cases: list[dict], workdir: Path) -> tuple[list[dict], list[str]]:
    """Every case's result, and a line for each case that killed its worker."""
    path = workdir / "cases.json"
    path.write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    results: list[dict] = []
    deaths: list[str] = []
    start = 0
    while start < len(cases):
        proc = subprocess.run([sys.executable, __file__, "--worker", str(path), str(start),
                               str(workdir)], capture_output=True, text=True, cwd=ROOT, env=env)
        current = None
        for line in proc.stdout.splitlines():
            if line.startswith("start "):
                current = int(line.split()[1])
            elif line.startswith("done "):
                results.append(json.loads(line[5:]))
                current = None
        if proc.returncode == 0 and current is None:
            break
        if current is None:  # died between cases: not a case's fault
            raise AssertionError(f"the bytecode worker failed: {proc.stderr[-2000:]}")
        case = cases[current]
        deaths.append(f"case {current} from {case['seed']} after {case['mutations']} on "
                      f"{case['pipeline'] or 'parse and print'}: the worker died with "
                      f"exit code {proc.returncode}: {proc.stderr.strip()[-400:]}")
        start = current + 1
    return results, deaths


def result_problems(case: dict, r: dict) -> list[str]:
    """What is wrong with a worker's result ``r`` for ``case`` (``test_fuzz_ir.problems``
    on the worker's record; a hang is a case past ``HANG_S``)."""
    from tests.test_fuzz_ir import Case, Result, problems

    return problems(Case(r["id"], case["seed"], (), case["pipeline"], ""),
                    Result(r["rc"], "", r["stderr"], r["wrote"], None, r["seconds"]),
                    timeout=HANG_S)


# ----------------------------------------------------------------------------- tests


def test_bytecode_seeds_and_mutations():
    seeds = bytecode_seeds()
    assert len(seeds) >= 20 and any(s[3] for s in seeds)
    cases = make_cases(60, 0)
    assert {k for c in cases for k in c["mutations"]} >= {"name", "rename", "flip", "truncate"}
    assert make_cases(20, 1) == make_cases(20, 1)


def test_mutated_bytecode_never_aborts(tmp_path):
    cases = make_cases(N_CASES, 31)
    assert sum(c["pipeline"] == "compile_mpmd" for c in cases) >= 5
    results, deaths = run_isolated(cases, tmp_path)
    bad = list(deaths)
    outcome = {"clean": 0, "diagnosed": 0}
    for r in results:
        case = cases[r["id"]]
        found = result_problems(case, r)
        if found:
            bad.append(f"case {r['id']} from {case['seed']} after {case['mutations']} on "
                       f"{case['pipeline'] or 'parse and print'}: {found}\n"
                       f"  {r['stderr'].strip()[-600:]}")
        else:
            outcome["clean" if r["rc"] == 0 else "diagnosed"] += 1
    print(f"bytecode fuzzing: {len(cases)} inputs, {outcome}, worker deaths {len(deaths)}")
    assert not bad, f"{len(bad)} of {len(cases)} mutated bytecode inputs misbehaved:\n\n" + \
        "\n\n".join(bad[:6])
    assert outcome["diagnosed"] > len(cases) // 4, outcome


# ----------------------------------------------------------------------------- regressions
# Found by bytecode fuzzing (tools/fuzz.py --bytecode 400 --seed 7), fixed: bytecode is
# parsed first in a forked child (multimesh._src.mlir.probe_bytecode).


def _cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multimesh.tools.mm_opt", str(path), "-p",
                           "builtin.module(mm-verify)"], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_regression_bytecode_reader_segfault():
    """A deleted byte made MLIR's bytecode reader segfault (verify.mlir#11)."""
    p = _cli(ROOT / "tests" / "fuzz" / "bytecode_reader_segv.mlirbc")
    assert p.returncode in (0, 1) and "internal error" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0 or "error: " in p.stderr, p.stderr[-2000:]


def test_regression_bytecode_reader_value_error():
    """A zeroed byte made the reader raise LLVM's "SmallVector unable to grow" as a bare
    ValueError, which mm-opt reported as an internal error (verify.mlir#1)."""
    p = _cli(ROOT / "tests" / "fuzz" / "bytecode_reader_smallvector.mlirbc")
    assert p.returncode in (0, 1) and "internal error" not in p.stderr, p.stderr[-2000:]
    assert p.returncode == 0 or "error: " in p.stderr, p.stderr[-2000:]


if __name__ == "__main__":  # pragma: no cover
    if sys.argv[1:2] == ["--worker"]:
        sys.exit(_worker_main(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    print("usage: python tests/test_fuzz_bytecode.py --worker CASES START WORKDIR (internal)")
    sys.exit(2)
