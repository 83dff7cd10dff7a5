"""Determinism: the same program gives byte-identical IR after every pass, and the same
fragment names, fragment modules and plan, across runs and across processes
(different ``PYTHONHASHSEED``: no dict/set-order or ``id()``-based names).

The IR after every pass comes from ``MULTIMESH_DUMP_IR_TO`` (one file per pipeline
step). Programs: a handcrafted one whose task names sort differently from their
program order and sanitise to colliding symbols, with ``value_and_grad``; and fuzz
programs (tests/fuzz/programs.py) with many tasks, gradients and odd task names.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The handcrafted program: names out of sorted order, two names that sanitise to the
# same symbol ("a-b", "a_b"), one that looks like a generated mesh name, shared callees
# (identical bodies), nested and overlapping submeshes, logical constraints, grad.
HANDCRAFTED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    import multimesh.jax as mm
    from multimesh.jax import with_sharding_constraint as wsc

    def body(w, x):
        x = wsc(x, P("batch", None))
        return jnp.tanh(x @ w)

    def mesh(devs, names=("x",), sizes=None):
        return mm.TaskMesh(devices=devs, axis_names=names, axis_sizes=sizes or (len(devs),))

    names = ["zeta", "a-b", "a_b", "mesh_zeta", "Alpha"]
    meshes = [mesh((0, 1, 2, 3), ("x", "y"), (2, 2)), mesh((4, 5)), mesh((6, 7)),
              mesh((2, 3)), mesh((0, 1, 2, 3, 4, 5, 6, 7), ("y", "x"), (4, 2))]
    stages = [mm.task(body, name=n, mesh=m, logical_axes=(("batch", "x"),))
              for n, m in zip(names, meshes)]

    def loss(ws, x):
        for s, w in zip(stages, ws):
            x = s(w, x)
        return jnp.mean(x ** 2)

    program = jax.value_and_grad(loss)
    rng = np.random.RandomState(0)
    args = ([rng.uniform(-1, 1, (8, 8)).astype(np.float32) / 2 for _ in names],
            rng.uniform(-1, 1, (8, 8)).astype(np.float32))
    devices = jax.devices()
""")

FUZZ_PICKS = 3  # fuzz programs: first seeds with >= 5 tasks and grad, odd names, plain


def _fuzz_seeds() -> list[int]:
    from tests.fuzz.programs import ODD_TASK_NAMES, predict_error, random_program

    want = {"big-grad": None, "odd-names": None, "forward": None}
    for s in range(500):
        p = random_program(s)
        if predict_error(p) != "none":
            continue
        if want["big-grad"] is None and p.grad and len(p.tasks) >= 5:
            want["big-grad"] = s
        elif want["odd-names"] is None and any(t.name in ODD_TASK_NAMES for t in p.tasks):
            want["odd-names"] = s
        elif want["forward"] is None and not p.grad and len(p.tasks) >= 4:
            want["forward"] = s
        if all(v is not None for v in want.values()):
            break
    return [v for v in want.values() if v is not None]


# Runs in this process and in subprocesses: compile, dump the IR after every pass, and
# summarise everything that must not change.
_SNAPSHOT = textwrap.dedent(r"""
    import hashlib, json, os, sys
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, {root!r})

    def snapshot(source, dump_dir):
        import jax
        import multimesh.jax as mm
        ns = {{"__name__": "determinism_program"}}
        exec(compile(source, "<program>", "exec"), ns)
        os.environ["MULTIMESH_DUMP_IR_TO"] = dump_dir
        try:
            compiled = mm.mjit(ns["program"], devices=ns["devices"]).lower(*ns["args"]).compile()
        finally:
            del os.environ["MULTIMESH_DUMP_IR_TO"]
        dumps = {{}}
        for sub, _, files in sorted(os.walk(dump_dir)):  # one directory per program
            for f in sorted(files):
                if f.endswith(".mlir"):
                    rel = os.path.relpath(os.path.join(sub, f), dump_dir)
                    with open(os.path.join(sub, f), "rb") as fh:
                        dumps[rel] = hashlib.sha256(fh.read()).hexdigest()
        return {{
            "dumps": dumps,
            "final": hashlib.sha256(compiled.as_text().encode()).hexdigest(),
            "fragments": [(fr["name"], fr["task"], fr["direction"], fr["devices"],
                           hashlib.sha256(fr["module"].encode()).hexdigest())
                          for fr in compiled.fragments],
            "plan": compiled.plan(),
        }}

    def mm_opt_hashes():
        import contextlib, glob, io, re
        from multimesh.tools.mm_opt import main
        out = {{}}
        for path in sorted(glob.glob(os.path.join({root!r}, "tests", "filecheck", "*.mlir"))):
            m = re.search(r"-p\s+'([^']*)'", open(path).read())
            if not m:
                continue
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                main([path, "-p", m.group(1), "--split-input-file"])
            out[os.path.basename(path)] = hashlib.sha256(
                (o.getvalue() + e.getvalue()).encode()).hexdigest()
        return out
""")


def _programs() -> dict[str, str]:
    from tests.fuzz.programs import random_program, render

    progs = {"handcrafted": HANDCRAFTED}
    for s in _fuzz_seeds():
        progs[f"fuzz-seed{s}"] = render(random_program(s))
    return progs


def _snapshot_fn():
    ns: dict = {}
    exec(_SNAPSHOT.format(root=str(ROOT)), ns)
    return ns["snapshot"]


@pytest.fixture(scope="module")
def programs():
    return _programs()


def test_fuzz_picks_found(programs):
    assert len(programs) == 1 + FUZZ_PICKS, sorted(programs)


def test_same_process_byte_identical_ir(programs, tmp_path):
    """Twice in one process: the IR after every pass, the fragments and the plan agree."""
    snapshot = _snapshot_fn()
    for name, src in programs.items():
        # one call site: jax records the Python call stack in locations
        a, b = [snapshot(src, str(tmp_path / f"{name}-{k}")) for k in (1, 2)]
        assert a["dumps"], f"{name}: MULTIMESH_DUMP_IR_TO wrote nothing"
        for f in a["dumps"]:
            if a["dumps"][f] != b["dumps"].get(f):
                t1 = (tmp_path / f"{name}-1" / f).read_text()
                t2 = (tmp_path / f"{name}-2" / f).read_text()
                diff = _first_diff(t1, t2)
                pytest.fail(f"{name}: IR after step {f} differs between two runs: {diff}")
        assert a == b, name


def test_fragment_names_are_stable_and_readable(programs, tmp_path):
    snapshot = _snapshot_fn()
    src = programs["handcrafted"]
    s = snapshot(src, str(tmp_path / "h"))
    names = [f[0] for f in s["fragments"]]
    assert len(set(names)) == len(names), names
    for n in names:  # derived from task names, never from id() or hash()
        assert re.fullmatch(r"[A-Za-z0-9_]+_(fwd|bwd\d*)(_mb\d+)?(_\d+)?", n), n
        assert not re.search(r"\d{5,}", n), n
    tasks = {f[1] for f in s["fragments"]}
    assert {"zeta", "a-b", "a_b", "mesh_zeta", "Alpha"} <= tasks, tasks


def _run_in_subprocess(programs: dict[str, str], hashseed: str, out_dir: Path) -> dict:
    # one script path for every run: jax records the Python call stack in locations
    script = out_dir.parent / "snap.py"
    script.write_text(_SNAPSHOT.format(root=str(ROOT)) + textwrap.dedent("""
        progs = json.load(open(sys.argv[1]))
        out = {name: snapshot(src, os.path.join(sys.argv[2], name)) for name, src in progs.items()}
        out["mm-opt goldens"] = mm_opt_hashes()
        print(json.dumps(out))
    """))
    (out_dir / "progs.json").write_text(json.dumps(programs))
    env = dict(os.environ, PYTHONHASHSEED=hashseed,
               XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env.pop("MULTIMESH_DUMP_IR_TO", None)
    p = subprocess.run([sys.executable, str(script), str(out_dir / "progs.json"),
                        str(out_dir / "dumps")], capture_output=True, text=True, env=env,
                       timeout=600, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_across_processes_with_different_hash_seeds(programs, tmp_path):
    """Two processes with PYTHONHASHSEED=1 and =2 produce identical IR, names and plans
    (and identical ``mm-opt`` output on every golden)."""
    runs = {}
    for seed in ("1", "2"):
        d = tmp_path / f"seed{seed}"
        d.mkdir()
        runs[seed] = _run_in_subprocess(programs, seed, d)
    a, b = runs["1"], runs["2"]
    assert a.pop("mm-opt goldens") == b.pop("mm-opt goldens")
    assert sorted(a) == sorted(b) == sorted(programs)
    for name in programs:
        for f, h in a[name]["dumps"].items():
            if b[name]["dumps"].get(f) != h:
                t1 = (tmp_path / "seed1" / "dumps" / name / f).read_text()
                t2 = (tmp_path / "seed2" / "dumps" / name / f).read_text()
                pytest.fail(f"{name}: IR after step {f} differs across processes: "
                            f"{_first_diff(t1, t2)}")
        assert a[name]["fragments"] == b[name]["fragments"], name
        assert a[name]["plan"] == b[name]["plan"], name
        assert a[name]["final"] == b[name]["final"], name


def test_mm_opt_output_is_deterministic(tmp_path):
    """``mm-opt`` on every golden, in-process twice: byte-identical output."""
    import contextlib
    import io

    from multimesh.tools.mm_opt import main

    files = sorted((ROOT / "tests" / "filecheck").glob("*.mlir"))
    assert files
    for path in files:
        m = re.search(r"-p\s+'([^']*)'", path.read_text())
        if not m:
            continue
        outs = []
        for _ in range(2):
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                main([str(path), "-p", m.group(1), "--split-input-file"])
            outs.append((o.getvalue(), e.getvalue()))
        assert outs[0] == outs[1], path.name


def _first_diff(a: str, b: str) -> str:
    for i, (x, y) in enumerate(zip(a.splitlines(), b.splitlines())):
        if x != y:
            return f"line {i + 1}:\n  {x[:300]}\n  {y[:300]}"
    return f"lengths {len(a)} vs {len(b)}"


def _sha(text: str) -> str:  # pragma: no cover - debugging helper
    return hashlib.sha256(text.encode()).hexdigest()
