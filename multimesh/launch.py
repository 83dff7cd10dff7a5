"""Start N local processes of one jax program, for development and tests.

    python -m multimesh.launch -n 2 [--devices-per-process 4] script.py [args...]

Every process runs ``script.py`` with the same arguments; the script calls
``jax.distributed.initialize()`` with no arguments, exactly as it would under SLURM
or Kubernetes, and this launcher supplies the coordinator (a free loopback port), the
process count and each process's id. Output lines are forwarded with a ``[k]``
prefix. When one process fails, the others are killed (jax's processes ignore
SIGTERM, so SIGKILL) unless ``--no-fail-fast`` is given; the launcher's exit code is
that of the first process that failed (128 + signal number if a signal killed it),
0 when all succeed.

``--devices-per-process K`` gives each process K simulated CPU devices
(``--xla_force_host_platform_device_count``) and ``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["main", "free_port", "LocalCluster"]

ENV_PROCESS_ID = "MULTIMESH_LAUNCH_PROCESS_ID"
ENV_NUM_PROCESSES = "MULTIMESH_LAUNCH_NUM_PROCESSES"
ENV_COORDINATOR = "MULTIMESH_LAUNCH_COORDINATOR"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_env():
    """A jax ``ClusterEnv`` that reads this launcher's variables.

    jax detects ``ClusterEnv`` subclasses when they are defined, so plain
    ``jax.distributed.initialize()`` finds the launcher the way it finds SLURM. It
    is put first, so a launch inside a SLURM allocation still means the local run.
    """
    from multimesh._src.jax_compat import cluster_env_base

    base, types = cluster_env_base()

    class LocalCluster(base):  # type: ignore[valid-type, misc]  # jax's ClusterEnv, found at run time
        name = "multimesh-launch"

        @classmethod
        def is_env_present(cls) -> bool:
            return ENV_PROCESS_ID in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs, override_coordinator_port=None) -> str:
            return os.environ[ENV_COORDINATOR]

        @classmethod
        def get_process_count(cls) -> int:
            return int(os.environ[ENV_NUM_PROCESSES])

        @classmethod
        def get_process_id(cls) -> int:
            return int(os.environ[ENV_PROCESS_ID])

    types.remove(LocalCluster)
    types.insert(0, LocalCluster)
    return LocalCluster


LocalCluster = None  # defined in the child processes only (it imports jax)


def _child(argv: list[str]) -> None:
    """Run ``script args`` (or ``-m module args``) as ``__main__`` in a launched process."""
    import runpy

    global LocalCluster
    LocalCluster = _cluster_env()
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _device_flags(flags: str, count: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    return f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _forward(stream, out, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line.decode(errors="replace"))
            out.flush()
    stream.close()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m multimesh.launch",
        description="Run N local processes of a jax.distributed program (one coordinator on "
                    "a free loopback port).")
    p.add_argument("-n", "--num-processes", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                   help="simulated CPU devices per process (sets XLA_FLAGS and JAX_PLATFORMS=cpu)")
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="kill every process after this long; exit code 124")
    p.add_argument("--no-fail-fast", action="store_true",
                   help="let the other processes run on when one fails")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the program as a module (like python -m)")
    p.add_argument("program", help="the script (or, with -m, the module)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return 0
    opts = _parser().parse_args(argv)
    n = opts.num_processes
    if n < 1:
        raise SystemExit(f"multimesh.launch: -n must be at least 1, got {n}.")
    if opts.devices_per_process is not None and opts.devices_per_process < 1:
        raise SystemExit(f"multimesh.launch: --devices-per-process must be at least 1, got "
                         f"{opts.devices_per_process}.")
    if not opts.module and not os.path.exists(opts.program):
        raise SystemExit(f"multimesh.launch: no such script: {opts.program}")
    port = opts.port or free_port()
    program = ["-m", opts.program] if opts.module else [opts.program]
    lock = threading.Lock()
    procs, threads = [], []
    for k in range(n):
        env = dict(os.environ)
        env.update({ENV_PROCESS_ID: str(k), ENV_NUM_PROCESSES: str(n),
                    ENV_COORDINATOR: f"127.0.0.1:{port}",
                    "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
                    "PYTHONUNBUFFERED": "1"})
        if opts.devices_per_process is not None:
            env["XLA_FLAGS"] = _device_flags(env.get("XLA_FLAGS", ""), opts.devices_per_process)
            env["JAX_PLATFORMS"] = "cpu"
        p = subprocess.Popen([sys.executable, "-m", "multimesh.launch", "--child", *program,
                              *opts.args], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, f"[{k}] ", lock),
                                 daemon=True)
            t.start()
            threads.append(t)
    return _supervise(procs, threads, opts, lock)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the child's own session: it and its children
        except ProcessLookupError:
            pass


class _TimedOut(Exception):
    """The launcher's ``--timeout`` passed with processes still running."""


def _supervise(procs, threads, opts, lock) -> int:
    """Wait for every process and return the launcher's exit code: the first failure's
    (reported with every other non-zero exit), 124 on timeout, 130 on Ctrl-C."""
    killed: set[int] = set()
    try:
        first_failure = _watch(procs, opts, lock, killed)
    except KeyboardInterrupt:
        _stop(procs)
        return 130
    except _TimedOut:
        _stop(procs, threads)
        return 124
    for t in threads:
        t.join(timeout=5)
    if first_failure is None:
        first_failure = next((k for k, p in enumerate(procs)
                              if p.returncode != 0 and k not in killed), None)
    if first_failure is None:
        return 0
    with lock:
        for k, p in enumerate(procs):
            if p.returncode != 0:
                how = " (stopped by the launcher)" if k in killed else ""
                sys.stderr.write(f"multimesh.launch: process {k} exited with code "
                                 f"{_exit_code(p.returncode)}{how}\n")
    return _exit_code(procs[first_failure].returncode)


def _watch(procs, opts, lock, killed: set[int]) -> int | None:
    """Poll until every process has exited; the first that failed, or None.

    At the first failure the others are stopped (added to ``killed``) unless
    ``--no-fail-fast``; past ``--timeout`` raises :class:`_TimedOut`.
    """
    start = time.monotonic()
    first_failure: int | None = None
    while any(p.poll() is None for p in procs):
        if first_failure is None:
            first_failure = next((k for k, p in enumerate(procs)
                                  if p.poll() not in (None, 0)), None)
            if first_failure is not None and not opts.no_fail_fast:
                _stop_others(procs, first_failure, killed, lock)
        if opts.timeout is not None and time.monotonic() - start > opts.timeout:
            with lock:
                sys.stderr.write(f"multimesh.launch: timed out after {opts.timeout:g} s; "
                                 f"killing every process.\n")
            raise _TimedOut
        time.sleep(0.05)
    return first_failure


def _stop_others(procs, failed: int, killed: set[int], lock) -> None:
    """Fail fast: kill every process still running after process ``failed`` exited."""
    others = [j for j, q in enumerate(procs) if q.poll() is None]
    if others:
        with lock:
            sys.stderr.write(
                f"multimesh.launch: process {failed} exited with code "
                f"{_exit_code(procs[failed].returncode)}; stopping processes {others}.\n")
    for j in others:
        killed.add(j)
        _kill(procs[j])


def _stop(procs, threads=()) -> None:
    """Kill every process, wait for each, then let the output threads finish."""
    for p in procs:
        _kill(p)
    for p in procs:
        p.wait()
    for t in threads:
        t.join(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
