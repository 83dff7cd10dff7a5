"""Multi-process runs under jax.distributed, launched from pytest (issue 14).

Each test starts its program in N local processes with ``python -m multimesh.launch``
(2 x 4 or 4 x 2 simulated CPU devices). The programs in ``tests/multiprocess/`` check,
in every process, the shards that process can address against plain JAX computed in
that one process, and where every array lives by position in ``jax.devices()``; each
ends by printing ``OK process k``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "multiprocess"
ROOT = HERE.parent.parent


def launch(script, n: int, k: int, *flags: str, env=None, timeout: float = 240, cwd=ROOT):
    cmd = [sys.executable, "-m", "multimesh.launch", "-n", str(n), "--devices-per-process",
           str(k), "--timeout", str(timeout), *flags, str(script)]
    full_env = dict(os.environ, **(env or {}))
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=cwd,
                          timeout=timeout + 60)
    proc.elapsed, proc.end = time.time() - start, time.time()
    return proc


def _log(proc) -> str:
    """The run's output without gloo's connection chatter, for assertion messages."""
    lines = (proc.stdout + proc.stderr).splitlines()
    return "\n".join(line for line in lines if "[Gloo]" not in line)[-6000:]


def _expect_ok(proc, n: int) -> None:
    out = _log(proc)
    assert proc.returncode == 0, out
    for k in range(n):
        assert re.search(rf"^\[{k}\] OK process {k}: \d+ arrays checked", proc.stdout, re.M), \
            out


def test_readme_two_stage_two_processes():
    proc = launch(HERE / "readme_two_stage.py", 2, 4)
    _expect_ok(proc, 2)
    assert re.search(r"^\[1\] loss 1: ", proc.stdout, re.M)  # the loss lives on process 1


def test_four_stages_1f1b_four_processes():
    # 8 microbatches, 3 steps: with several cross-process moves in flight this deadlocked
    _expect_ok(launch(HERE / "four_stage_1f1b.py", 4, 2, timeout=150), 4)


def test_stage_spanning_two_processes():
    _expect_ok(launch(HERE / "spanning_stage.py", 2, 4), 2)


def test_flax_parallelize_step_two_processes():
    pytest.importorskip("optax")
    _expect_ok(launch(HERE / "flax_parallelize_step.py", 2, 4), 2)


def test_nnx_parallelize_step_two_processes():
    pytest.importorskip("optax")
    _expect_ok(launch(HERE / "nnx_parallelize_step.py", 2, 4), 2)


def test_cross_process_moves():
    _expect_ok(launch(HERE / "transfers.py", 2, 4), 2)


def test_orbax_checkpoint_of_per_stage_parameters():
    pytest.importorskip("orbax.checkpoint")
    _expect_ok(launch(HERE / "orbax_checkpoint.py", 2, 4), 2)


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_peer_stops_the_survivor(victim):
    """The victim SIGKILLs itself mid-step; the survivor stops by itself within 60 s.

    ``--no-fail-fast``: the launcher must not do the survivor's job. Victim 1: our
    watchdog notices the missing heartbeats (5 s here, 20 s by default) and names it.
    Victim 0 hosts jax's coordination service: jax aborts the survivor at once.
    """
    proc = launch(HERE / "kill_peer.py", 2, 4, "--no-fail-fast",
                  env={"VICTIM": str(victim), "MULTIMESH_PEER_TIMEOUT": "5"}, timeout=120)
    out = _log(proc)
    m = re.search(r"victim: SIGKILL at ([\d.]+)", proc.stdout)
    assert m, out
    survivor = 1 - victim
    assert proc.returncode != 0, out
    codes = dict(re.findall(r"process (\d) exited with code (\d+)", proc.stderr))
    assert codes.get(str(survivor), "0") != "0", out
    assert proc.end - float(m.group(1)) < 60, (proc.end - float(m.group(1)), out)
    if victim == 1:
        assert codes[str(survivor)] == "75", codes
        assert re.search(r"\[0\] multimesh: process 0 is stopping because process 1 of 2 sent "
                         r"no heartbeat for \d+ s \(it has died or hangs\) \(its devices: "
                         r"\[2048, 2049, 2050, 2051\]\)", proc.stderr), out
    else:
        assert "coordination service" in proc.stderr, out


# --------------------------------------------------------------------------- the launcher


def _run_launcher(tmp_path, code: str, *flags: str, timeout: float = 60):
    script = tmp_path / "prog.py"
    script.write_text(code)
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "multimesh.launch", *flags, str(script)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    proc.elapsed = time.time() - start
    return proc


def test_launcher_environment_and_prefixes(tmp_path):
    code = ("import os, sys\n"
            "print(os.environ['MULTIMESH_LAUNCH_PROCESS_ID'], "
            "os.environ['MULTIMESH_LAUNCH_NUM_PROCESSES'], os.environ['XLA_FLAGS'], "
            "os.environ['JAX_PLATFORMS'], sys.argv[1:])\n"
            "print('to stderr', file=sys.stderr)\n")
    proc = _run_launcher(tmp_path, code, "-n", "3", "--devices-per-process", "2")
    assert proc.returncode == 0, proc.stderr
    for k in range(3):
        assert f"[{k}] {k} 3 --xla_force_host_platform_device_count=2 cpu []" in proc.stdout
        assert f"[{k}] to stderr" in proc.stderr


def test_launcher_fails_fast_with_the_first_failure_code(tmp_path):
    code = ("import os, sys, time\n"
            "if os.environ['MULTIMESH_LAUNCH_PROCESS_ID'] == '1':\n"
            "    sys.exit(3)\n"
            "time.sleep(120)\n")
    proc = _run_launcher(tmp_path, code, "-n", "2")
    assert proc.returncode == 3
    assert proc.elapsed < 30
    assert "process 1 exited with code 3; stopping processes [0]" in proc.stderr
    assert "process 0 exited with code 137 (stopped by the launcher)" in proc.stderr


def test_launcher_timeout(tmp_path):
    proc = _run_launcher(tmp_path, "import time\ntime.sleep(120)\n", "-n", "2", "--timeout", "1")
    assert proc.returncode == 124 and "timed out after 1 s" in proc.stderr


def test_launcher_rejects_bad_arguments(tmp_path):
    proc = _run_launcher(tmp_path, "pass\n", "-n", "0")
    assert proc.returncode != 0 and "-n must be at least 1, got 0" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "multimesh.launch", "-n", "2", "missing.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0 and "no such script: missing.py" in proc.stderr


# --------------------------------------------------------------------------- the docs page


def test_docs_page_runs_under_the_launcher(tmp_path):
    """docs/multiprocess.md is one program (opted out of the in-process docs harness):
    its python blocks run in 2 processes, and every ``[k] ...`` line of its text blocks
    is in the output."""
    page = (ROOT / "docs" / "multiprocess.md").read_text()
    assert page.startswith("<!-- no-exec -->")
    code = "\n".join(re.findall(r"```python\n(.*?)```", page, re.S))
    script = tmp_path / "train.py"
    script.write_text(code)
    proc = launch(script, 2, 4, cwd=tmp_path)  # the page writes checkpoints/ there
    assert proc.returncode == 0, _log(proc)
    assert (tmp_path / "checkpoints" / "step_2").is_dir()
    expected = [line for block in re.findall(r"```text\n(.*?)```", page, re.S)
                for line in block.splitlines() if re.match(r"\[\d\] ", line)]
    assert len(expected) >= 10
    got = set(proc.stdout.splitlines())
    missing = [line for line in expected if line not in got]
    assert not missing, (missing, _log(proc))
