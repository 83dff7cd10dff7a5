"""Multi-process runs under jax.distributed, launched from pytest (issue 14).

Each test starts its program in N local processes with ``python -m multimesh.launch``
(2 x 4 or 4 x 2 simulated CPU devices). The programs in ``tests/multiprocess/`` check,
in every process, the shards that process can address against plain JAX computed in
that one process, and where every array lives by position in ``jax.devices()``; each
ends by printing ``OK process k``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "multiprocess"
ROOT = HERE.parent.parent


def launch(script, n: int, k: int, *flags: str, env=None, timeout: float = 600, cwd=ROOT):
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
    _expect_ok(launch(HERE / "four_stage_1f1b.py", 4, 2, timeout=600), 4)


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
    watchdog notices the missing heartbeats (15 s here, as a loaded machine delays them;
    20 s by default) and names it.
    Victim 0 hosts jax's coordination service: jax aborts the survivor at once.
    """
    proc = launch(HERE / "kill_peer.py", 2, 4, "--no-fail-fast",
                  env={"VICTIM": str(victim), "MULTIMESH_PEER_TIMEOUT": "15"}, timeout=600)
    out = _log(proc)
    m = re.search(r"victim: SIGKILL at ([\d.]+)", proc.stdout)
    assert m, out
    survivor = 1 - victim
    assert proc.returncode != 0, out
    codes = dict(re.findall(r"process (\d) exited with code (\d+)", proc.stderr))
    assert codes.get(str(survivor), "0") != "0", out
    assert proc.end - float(m.group(1)) < 120, (proc.end - float(m.group(1)), out)
    if victim == 1:
        assert codes[str(survivor)] == "75", codes
        assert re.search(r"\[0\] multimesh: process 0 is stopping because process 1 of 2 sent "
                         r"no heartbeat for \d+ s \(it has died or hangs\) \(its devices: "
                         r"\[2048, 2049, 2050, 2051\]\)", proc.stderr), out
    else:
        assert "coordination service" in proc.stderr, out


# --------------------------------------------------------------------------- the launcher
# The guarantees docs/multiprocess.md states ("The launcher's guarantees"). Worker scripts
# without jax where jax is not what is tested; fails_early.py runs jax.distributed.


def _run_launcher(tmp_path, code: str, *flags: str, timeout: float = 600):
    script = tmp_path / "prog.py"
    script.write_text(code)
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "multimesh.launch", *flags, str(script)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    proc.elapsed, proc.end = time.time() - start, time.time()
    return proc


def _pids(text: str) -> list[int]:
    pids = [int(p) for line in re.findall(r"^\[\d+\] pids? ([\d ]+)$", text, re.M)
            for p in line.split()]
    assert pids, text
    return pids


def _assert_gone(pids: list[int], within: float = 30.0) -> None:
    """No pid survives: ``os.kill(pid, 0)`` raises ProcessLookupError. A zombie (dead,
    waiting for a reaper: the workers' children belong to init once their parent is
    killed, and a container's init may never reap them) counts as gone."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive:
        still = []
        for pid in alive:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                still.append(pid)
        alive = still
        if alive and time.monotonic() > deadline:
            raise AssertionError(f"processes {alive} survived the launcher")
        time.sleep(0.05)


# a worker that starts a child of its own, prints both pids, and sleeps
SLEEPER = ("import os, subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
           "print('pids', os.getpid(), child.pid, flush=True)\n"
           "time.sleep(120)\n")


def _start_launcher(tmp_path, code: str, *flags: str, n: int = 3):
    """A launcher subprocess running ``code`` in ``n`` processes, once all have printed
    their pids; the pids."""
    script = tmp_path / "prog.py"
    script.write_text(code)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "multimesh.launch", "-n", str(n), *flags,
                                 str(script)], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 600
    while len(re.findall(r"^\[\d+\] pids ", out.read_text(), re.M)) < n:
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
        time.sleep(0.05)
    return proc, out, _pids(out.read_text())


def _signal_launcher(proc, out, *signals) -> tuple[int, float, str]:
    """Send the launcher ``signals`` (half a second apart) and wait for it: its exit
    code, the seconds from the first signal to its exit, and what it printed."""
    start = time.monotonic()
    for k, sig in enumerate(signals):
        if k:
            time.sleep(0.5)
        proc.send_signal(sig)
    rc = proc.wait(timeout=300)
    return rc, time.monotonic() - start, out.read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP],
                         ids=lambda s: s.name)
def test_launcher_forwards_signals_and_reaps_every_process(tmp_path, sig):
    proc, out, pids = _start_launcher(tmp_path, SLEEPER)
    assert len(pids) == 6
    rc, elapsed, text = _signal_launcher(proc, out, sig)
    assert rc == 128 + sig, text
    assert f"got {sig.name}; forwarding it to processes [0, 1, 2]" in text
    assert "SIGKILL" not in text, text  # these workers die of the signal itself
    for k in range(3):  # SIGINT too: Python ends a KeyboardInterrupt by SIGINT
        assert f"process {k} exited with code {128 + sig} (stopped by the launcher)" in text, \
            text
    assert elapsed < 30, (elapsed, text)  # no SIGKILL after the 3 s grace period (above)
    _assert_gone(pids)


def test_launcher_kills_what_ignores_the_signal_after_the_grace_period(tmp_path):
    code = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEPER
    proc, out, pids = _start_launcher(tmp_path, code, "--grace-period", "1", n=2)
    rc, elapsed, text = _signal_launcher(proc, out, signal.SIGTERM)
    assert rc == 143, text
    assert "processes [0, 1] still run 1 s after SIGTERM; killing them (SIGKILL)" in text
    assert "process 0 exited with code 137 (stopped by the launcher)" in text
    assert 1 <= elapsed < 30, (elapsed, text)
    _assert_gone(pids)


def test_a_second_signal_kills_at_once(tmp_path):
    code = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SLEEPER
    proc, out, pids = _start_launcher(tmp_path, code, "--grace-period", "60", n=2)
    rc, elapsed, text = _signal_launcher(proc, out, signal.SIGTERM, signal.SIGINT)
    assert rc == 143, text  # the first signal's code
    assert elapsed < 45, text
    _assert_gone(pids)


def test_a_killed_launcher_takes_its_processes_along(tmp_path):
    proc, out, pids = _start_launcher(tmp_path, SLEEPER, n=2)
    proc.kill()  # no chance to forward anything: the kernel's parent-death signal does it
    proc.wait(timeout=300)
    try:
        _assert_gone(pids[0::2])  # the workers; their own children outlive them (documented)
    finally:
        for pid in pids[1::2]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_launcher_environment_and_prefixes(tmp_path):
    code = ("import os, sys\n"
            "print(os.environ['MULTIMESH_LAUNCH_PROCESS_ID'], "
            "os.environ['MULTIMESH_LAUNCH_NUM_PROCESSES'], os.environ['XLA_FLAGS'], "
            "os.environ['JAX_PLATFORMS'], sys.argv[1:])\n"
            "print('to stderr', file=sys.stderr)\n")
    proc = _run_launcher(tmp_path, code, "-n", "3", "--devices-per-process", "2")
    assert proc.returncode == 0, proc.stderr
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags = " ".join([*kept, "--xla_force_host_platform_device_count=2"])  # the caller's stay
    for k in range(3):
        assert f"[{k}] {k} 3 {flags} cpu []" in proc.stdout, proc.stdout
        assert f"[{k}] to stderr" in proc.stderr


def test_launcher_fails_fast_with_the_first_failure_code(tmp_path):
    # every process has a child of its own; the one that fails leaves its child behind
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('pids', os.getpid(), child.pid, flush=True)\n"
            "if os.environ['MULTIMESH_LAUNCH_PROCESS_ID'] == '1':\n"
            "    time.sleep(0.5)\n"
            "    sys.exit(3)\n"
            "time.sleep(120)\n")
    proc = _run_launcher(tmp_path, code, "-n", "2")
    assert proc.returncode == 3, proc.stderr
    assert proc.elapsed < 60  # not the 120 s the others sleep
    assert "process 1 failed (sys.exit(3)); stopping processes [0]." in proc.stderr
    assert "process 0 exited with code 143 (stopped by the launcher)" in proc.stderr
    assert proc.stderr.rstrip().endswith(
        "the cause: process 1 (sys.exit(3)), which exited with code 3; exit code 3."), proc.stderr
    _assert_gone(_pids(proc.stdout))


def _failure_time(proc) -> float:
    """When process 1 failed: its ``fails at`` line, or jax's fatal log line
    (``F1125 17:03:32.240709 ...``, UTC) when jax aborts it."""
    m = re.search(r"^\[1\] fails at ([\d.]+)", proc.stdout, re.M)
    if m:
        return float(m.group(1))
    m = re.search(r"^\[1\] F\d{4} (\d\d):(\d\d):([\d.]+) ", proc.stderr, re.M)
    assert m, _log(proc)
    day = time.time() // 86400 * 86400
    return day + int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3))


@pytest.mark.parametrize("when", ["before-init", "during-init", "after-init",
                                  "exit0-before-init", "exit1-after-init", "exit0-after-init"])
def test_first_failure_is_named_and_the_rest_stop_within_5_s(when):
    """jax.distributed: process 1 fails (or exits 0 unjoined) while process 0 waits for it
    in ``initialize`` or a barrier, where it ignores SIGTERM and used to wait 40-120 s."""
    proc = launch(HERE / "fails_early.py", 2, 1, env={"CULPRIT": "1", "WHEN": when},
                  timeout=600)
    out = _log(proc)
    failed_at = _failure_time(proc)
    assert proc.end - failed_at < 30, (proc.end - failed_at, out)
    assert "the peer never got here" not in proc.stdout
    if when == "exit0-before-init":
        assert proc.returncode == 1, out
        assert ("process 1 exited with code 0 without joining jax.distributed.initialize(), "
                "which processes [0] wait in for it; stopping them.") in proc.stderr, out
        assert proc.stderr.rstrip().endswith(
            "the cause: process 1 (it left before joining jax.distributed.initialize()), which "
            "exited with code 0; exit code 1."), out
    else:
        assert proc.returncode != 0, out
        assert re.search(r"^multimesh\.launch: process 1 (failed|exited)", proc.stderr, re.M), out
        assert re.search(r"^multimesh\.launch: the cause: process 1\b", proc.stderr, re.M), out
        assert not re.search(r"^multimesh\.launch: process 0 (failed|exited with code \d+;)",
                             proc.stderr, re.M), out
    if when == "after-init":
        assert "process 1 failed (ValueError: process 1 fails after-init)" in proc.stderr, out
        assert proc.returncode == 1
    if when == "exit1-after-init":  # its own code at once, not 137 after a SIGKILL
        assert "process 1 failed (sys.exit(1)); stopping processes [0]." in proc.stderr, out
        assert proc.stderr.rstrip().endswith(
            "the cause: process 1 (sys.exit(1)), which exited with code 1; exit code 1."), out
        assert "process 1 exited with code 137" not in proc.stderr and proc.returncode == 1, out
    if when == "exit0-after-init":
        assert ("process 1 exited with code 0 after joining jax.distributed.initialize() but "
                "before setting up its devices, which exchanges every process's topology: "
                "processes [0] wait for its topology; stopping them.") in proc.stderr, out
        assert proc.returncode == 1, out
    _assert_gone(_pids(proc.stdout))


def test_an_early_exit_with_code_0_is_named_within_10_s(tmp_path):
    code = ("import os, time\n"
            "if os.environ['MULTIMESH_LAUNCH_PROCESS_ID'] == '0':\n"
            "    time.sleep(8)\n")
    proc = _run_launcher(tmp_path, code, "-n", "2")
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"process 1 exited with code 0 (\d+) s ago; processes \[0\] still run",
                  proc.stderr)
    assert m and int(m.group(1)) <= 30, proc.stderr  # said within 10 s; 30 on a loaded machine


def test_launcher_timeout(tmp_path):
    # The timeout must fire once both processes have printed their pids (2 workers and
    # their children), so that the test sees it reap all four. The sleepers import no
    # jax: 3 s is enough on an idle machine; a loaded one that starts them later gets
    # the run again with twice the timeout (up to 24 s, more than the fixed 20 s this
    # test used to wait).
    for timeout in (3, 6, 12, 24):
        proc = _run_launcher(tmp_path, SLEEPER, "-n", "2", "--timeout", str(timeout))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 124 and f"timed out after {timeout} s" in proc.stderr, out
        assert proc.elapsed < timeout + 60, out  # not the 120 s SLEEPER sleeps
        pids = [int(p) for line in re.findall(r"^\[\d+\] pids ([\d ]+)$", proc.stdout, re.M)
                for p in line.split()]
        _assert_gone(pids)
        if len(pids) == 4:
            break
    else:
        pytest.fail(f"the sleepers did not print their pids within 24 s:\n{out}")


def test_launcher_port_in_use_is_named(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _run_launcher(tmp_path, "pass\n", "-n", "2", "--port", str(port))
    assert proc.returncode == 2, proc.stderr
    assert (f"the coordinator port {port} on 127.0.0.1 cannot be used (Address already in use)"
            in proc.stderr)
    assert "Pick another with --port N, or leave --port out (or --port 0) for a free one." \
        in proc.stderr
    assert _run_launcher(tmp_path, "pass\n", "-n", "2", "--port", "0").returncode == 0


def test_port_taken_after_the_check_is_named(tmp_path):
    """Another program takes the coordinator port between the launcher's check and jax's
    bind (here process 0 itself, just before initialize): jax's coordination service
    would die of SIGSEGV naming nothing; process 0 names the port and exits with 1."""
    code = ("import os, socket\n"
            "if os.environ['MULTIMESH_LAUNCH_PROCESS_ID'] == '0':\n"
            "    host, port = os.environ['MULTIMESH_LAUNCH_COORDINATOR'].rsplit(':', 1)\n"
            "    thief = socket.socket()\n"
            "    thief.bind((host, int(port)))\n"
            "    thief.listen()\n"
            "print('pid', os.getpid(), flush=True)\n"
            "import jax\n"
            "jax.distributed.initialize()\n"
            "print('the peer never got here', flush=True)\n")
    proc = _run_launcher(tmp_path, code, "-n", "2", "--devices-per-process", "1")
    port = re.search(r"was taken by another program", proc.stderr)
    assert port, proc.stderr[-3000:]
    assert re.search(r"process 0 failed \(the coordinator port \d+ on 127\.0\.0\.1 was taken "
                     r"by another program after the launcher chose it \(Address already in "
                     r"use\)\); stopping processes \[1\]\.", proc.stderr), proc.stderr[-3000:]
    assert proc.returncode == 1 and "exited with code 139" not in proc.stderr, proc.stderr[-3000:]
    assert "the peer never got here" not in proc.stdout
    _assert_gone(_pids(proc.stdout))


@pytest.mark.parametrize("flags, message", [
    (["-n", "0"], "argument -n/--num-processes: must be between 1 and 256, got 0"),
    (["-n", "100000"], "argument -n/--num-processes: must be between 1 and 256, got 100000"),
    (["-n", "two"], "argument -n/--num-processes: must be a whole number, got 'two'"),
    (["-n", "2", "--devices-per-process", "0"],
     "argument --devices-per-process: must be at least 1, got 0"),
    (["-n", "2", "--port", "99999"],
     "argument --port: must be a TCP port number from 1 to 65535 (or 0 for a free one), got "
     "'99999'"),
    (["-n", "2", "--port", "-1"], "argument --port: must be a TCP port number"),
    (["-n", "2", "--timeout", "-1"],
     "argument --timeout: must be a positive number of seconds, got '-1'"),
    (["-n", "2", "--timeout", "0"], "argument --timeout: must be a positive number of seconds"),
    (["-n", "2", "--timeout", "nan"], "argument --timeout: must be a positive number of seconds"),
    (["-n", "2", "--grace-period", "-1"],
     "argument --grace-period: must be a number of seconds, 0 or more, got '-1'"),
    (["-n", "2", "--grace-period", "inf"], "argument --grace-period: must be a number of seconds"),
])
def test_launcher_rejects_bad_arguments(tmp_path, flags, message):
    proc = _run_launcher(tmp_path, "pass\n", *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "usage: python -m multimesh.launch" in proc.stderr


def test_launcher_rejects_a_missing_script(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "multimesh.launch", "-n", "2", "missing.py"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and "no such script: missing.py" in proc.stderr


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


def test_skipped_donations_are_freed_in_every_process():
    """A donated weight that only its last call could donate is deleted after its last
    use in the process that holds it, as in one process."""
    _expect_ok(launch(HERE / "donated_weights.py", 2, 4), 2)


def test_stages_sharded_by_flax_rules_one_process_each():
    """Each process holds one stage, sharded over its own 2x2 devices by the model's
    flax rules (issue 30): values, placement and the kernels' split."""
    _expect_ok(launch(HERE / "stage_sharding.py", 2, 4), 2)
