"""Start N local processes of one jax program, for development and tests.

    python -m multimesh.launch -n 2 [--devices-per-process 4] script.py [args...]

Every process runs ``script.py`` with the same arguments; the script calls
``jax.distributed.initialize()`` with no arguments, exactly as it would under SLURM
or Kubernetes, and this launcher supplies the coordinator (a loopback port), the
process count and each process's id. Output lines are forwarded with a ``[k]`` prefix.

It behaves like ``torchrun`` (docs/multiprocess.md, "The launcher's guarantees"):

- each process runs in its own process group, and a process's group is what the
  launcher signals, so a signal reaches the process's own children too;
- SIGTERM, SIGINT and SIGHUP sent to the launcher are forwarded to every process; those
  still running ``--grace-period`` seconds later are SIGKILLed; the launcher exits with
  128 + the signal number. If the launcher itself is SIGKILLed, the kernel kills its
  processes (Linux ``PR_SET_PDEATHSIG``);
- the first process to fail (an uncaught exception, reported by the process as it is
  raised, or a non-zero exit) is named as the cause, and the others are stopped the
  same way (SIGTERM, then SIGKILL after the grace period) unless ``--no-fail-fast``;
  the launcher's exit code is the cause's (128 + signal number if a signal killed it);
- a process that exits before it joins ``jax.distributed.initialize()`` while others
  wait there strands them: it is named and the others are stopped (exit code 1); any
  other process that exits with code 0 while its peers run on is named after
  ``EARLY_EXIT_NOTICE`` seconds;
- ``--timeout S`` stops everything after S seconds (exit code 124).

``--devices-per-process K`` gives each process K simulated CPU devices
(``--xla_force_host_platform_device_count``) and ``JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import re
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["main", "free_port", "LocalCluster"]

ENV_PROCESS_ID = "MULTIMESH_LAUNCH_PROCESS_ID"
ENV_NUM_PROCESSES = "MULTIMESH_LAUNCH_NUM_PROCESSES"
ENV_COORDINATOR = "MULTIMESH_LAUNCH_COORDINATOR"
ENV_STATUS_FD = "MULTIMESH_LAUNCH_STATUS_FD"  # the pipe a process reports to the launcher on
ENV_LAUNCHER_PID = "MULTIMESH_LAUNCH_PID"

MAX_PROCESSES = 256
"""Every process runs on this machine; more is a cluster's job (and its launcher's)."""
DEFAULT_GRACE = 3.0
"""Seconds between SIGTERM and SIGKILL when the launcher stops its processes."""
EARLY_EXIT_NOTICE = 5.0
"""Seconds after which a process that exited with code 0 while its peers run is named."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_TIMEOUT = 124
EXIT_STRANDED = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- in a process

_joined = False  # this process has entered jax.distributed.initialize()


def _report(message: str) -> None:
    """Tell the launcher ``message`` (one line) on the pipe it gave this process."""
    fd = os.environ.get(ENV_STATUS_FD)
    if fd is None:
        return
    try:
        os.write(int(fd), (message.replace("\n", " ")[:500] + "\n").encode(errors="replace"))
    except OSError:
        pass  # the launcher is gone; its death signal is on the way


def _cluster_env(base: type, types: list):
    """A jax ``ClusterEnv`` (a subclass of ``base``, put first in jax's list of detected
    ones, ``types``) that reads this launcher's variables.

    jax detects ``ClusterEnv`` subclasses when they are defined, so plain
    ``jax.distributed.initialize()`` finds the launcher the way it finds SLURM. It
    is put first, so a launch inside a SLURM allocation still means the local run.
    """
    class LocalCluster(base):  # jax's ClusterEnv, found at run time
        name = "multimesh-launch"

        @classmethod
        def is_env_present(cls) -> bool:
            return ENV_PROCESS_ID in os.environ

        @classmethod
        def get_coordinator_address(cls, timeout_secs, override_coordinator_port=None) -> str:
            global _joined
            if not _joined:  # jax asks at the start of initialize(): this process joins
                _joined = True
                _report("join")
                if os.environ[ENV_PROCESS_ID] == "0":
                    _check_coordinator_port(os.environ[ENV_COORDINATOR])
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


def _check_coordinator_port(address: str) -> None:
    """In process 0, just before jax's coordination service binds ``address``: if
    another program took the port since the launcher checked it, say so and exit (jax's
    service would crash on it with SIGSEGV, naming nothing)."""
    host, _, port = address.rpartition(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            s.bind((host, int(port)))
        except OSError as e:
            why = (f"the coordinator port {port} on {host} was taken by another program "
                   f"after the launcher chose it ({e.strerror or e})")
            _report(f"failed 1 {why}")
            sys.stderr.write(f"multimesh.launch: {why}; run again, or pick a port with "
                             f"--port N.\n")
            sys.stderr.flush()
            os._exit(1)


def _die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this process when the launcher dies (Linux only), so
    not even a SIGKILLed launcher leaves orphans."""
    fd = os.environ.get(ENV_STATUS_FD)
    if fd is not None:
        os.set_inheritable(int(fd), False)  # not for this process's own children
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.environ.get(ENV_LAUNCHER_PID) not in (None, str(os.getppid())):
        os._exit(1)  # the launcher died before the request took effect


def _leave(status: int, e: SystemExit | None, backends_initialized: Callable[[], bool]) -> None:
    """The program ended (``sys.exit`` or its last line) with ``status``. Under
    ``jax.distributed``, Python's exit would wait in jax's shutdown barrier for peers
    that may be waiting for this process; so a failure is reported and the process
    exits at once with its own code, and a process that leaves before its devices were
    set up (which exchanges every process's topology) tells the launcher its peers are
    stranded, then exits at once too."""
    if status != 0 and e is not None:
        _report(f"failed {status} sys.exit({e.code!r})")
    if not _joined:
        return
    if status == 0 and (backends_initialized() or os.environ.get(ENV_NUM_PROCESSES) == "1"):
        return  # a normal end: jax's shutdown barrier meets the peers there
    if status == 0:
        _report("left-before-topology")
    elif e is not None and e.code is not None and not isinstance(e.code, int):
        print(e.code, file=sys.stderr)  # as Python prints sys.exit("message")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _exit_status(e: SystemExit) -> int:
    return 0 if e.code is None else e.code if isinstance(e.code, int) else 1


def _child(argv: list[str]) -> None:
    """Run ``script args`` (or ``-m module args``) as ``__main__`` in a launched process.

    An uncaught exception is reported to the launcher as it is raised, before jax's
    exit handlers run: those wait in ``jax.distributed``'s shutdown barrier for peers
    that wait for this process, so its exit would name it only after a minute or so.
    """
    # local: only a launched process imports jax; the launcher itself stays light
    from multimesh._src import jax_compat

    global LocalCluster
    _die_with_launcher()
    LocalCluster = _cluster_env(*jax_compat.cluster_env_base())
    set_up = jax_compat.backends_initialized
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        _leave(_exit_status(e), e, set_up)
        raise
    except BaseException as e:
        _report(f"failed 1 {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        if not _joined:
            raise
        sys.excepthook(type(e), e, e.__traceback__)  # multimesh's hook may exit here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # not into jax's shutdown barrier (see above)
    else:
        _leave(0, None, set_up)


# --------------------------------------------------------------------------- arguments


def _count(most: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < 1 or (most is not None and value > most):
            bound = f"between 1 and {most}" if most is not None else "at least 1"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    return parse


def _seconds(allow_zero: bool):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            kind = "a number of seconds, 0 or more" if allow_zero else "a positive number of seconds"
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}")
        return value
    return parse


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be a TCP port number from 1 to 65535 (or 0 for a free one), got "
            f"{text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m multimesh.launch",
        description="Run N local processes of a jax.distributed program (one coordinator on "
                    "a loopback port).")
    p.add_argument("-n", "--num-processes", type=_count(MAX_PROCESSES), required=True,
                   help=f"number of processes (1 to {MAX_PROCESSES})")
    p.add_argument("--devices-per-process", type=_count(), default=None,
                   metavar="K",
                   help="simulated CPU devices per process (sets XLA_FLAGS and JAX_PLATFORMS=cpu)")
    p.add_argument("--port", type=_port, default=0,
                   help="coordinator port on 127.0.0.1 (default 0: a free one)")
    p.add_argument("--timeout", type=_seconds(False), default=None,
                   metavar="SECONDS", help="stop every process after this long; exit code 124")
    p.add_argument("--grace-period", type=_seconds(True), default=DEFAULT_GRACE,
                   metavar="SECONDS",
                   help=f"how long stopped processes get between SIGTERM and SIGKILL "
                        f"(default {DEFAULT_GRACE:g})")
    p.add_argument("--no-fail-fast", action="store_true",
                   help="let the other processes run on when one fails")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the program as a module (like python -m)")
    p.add_argument("program", help="the script (or, with -m, the module)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the program")
    return p


def _check_port(parser: argparse.ArgumentParser, port: int) -> int:
    """``port``, or a free one for 0; a port this machine will not give jax's coordinator
    is an error now (jax's coordination service crashes on it, SIGSEGV)."""
    if port == 0:
        return free_port()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            parser.error(f"the coordinator port {port} on 127.0.0.1 cannot be used "
                         f"({e.strerror or e}); another program (or an earlier run) holds it. "
                         f"Pick another with --port N, or leave --port out (or --port 0) for a "
                         f"free one.")
    return port


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
    opts = parser.parse_args(argv)
    if not opts.module and not os.path.exists(opts.program):
        parser.error(f"no such script: {opts.program}")
    opts.port = _check_port(parser, opts.port)
    return opts


# --------------------------------------------------------------------------- the launcher


def _device_flags(flags: str, count: int) -> str:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    return " ".join([*flags.split(), f"--xla_force_host_platform_device_count={count}"])


def _forward(stream, out, prefix: str, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            try:
                out.write(prefix + line.decode(errors="replace"))
                out.flush()
            except (OSError, ValueError):  # the launcher's own output is gone: keep draining
                pass
    stream.close()


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


@dataclass
class _Worker:
    k: int
    proc: subprocess.Popen
    status: int  # read end of the process's report pipe (-1 once closed)
    joined: bool = False
    failed: tuple[int, str] | None = None  # (exit code, why), as the process reported it
    exited_at: float | None = None
    noticed: bool = False  # its early exit has been named


@dataclass
class _Stop:
    """Why the launcher is stopping its processes, and the exit code that follows."""
    code: int
    cause: int | None  # the process blamed, if any
    signum: int  # what the others get first
    kill_at: float  # when the survivors get SIGKILL
    killed: bool = False


class _Processes:
    """The launched processes: starting each one, and stopping them all (signals, then
    SIGKILL after the grace period); and the launcher's own output, one line at a time."""

    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.lock = threading.Lock()  # one writer at a time: the launcher or a forwarder
        self.workers: list[_Worker] = []
        self.threads: list[threading.Thread] = []
        self.selector = selectors.DefaultSelector()
        self.stop: _Stop | None = None

    def say(self, message: str) -> None:
        with self.lock:
            sys.stderr.write(f"multimesh.launch: {message}\n")
            sys.stderr.flush()

    def running(self) -> list[_Worker]:
        return [w for w in self.workers if w.exited_at is None]

    def spawn(self, k: int) -> None:
        opts, n = self.opts, self.opts.num_processes
        env = dict(os.environ)
        read, write = os.pipe()
        env.update({ENV_PROCESS_ID: str(k), ENV_NUM_PROCESSES: str(n),
                    ENV_COORDINATOR: f"127.0.0.1:{opts.port}",
                    "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{opts.port}",
                    ENV_STATUS_FD: str(write), ENV_LAUNCHER_PID: str(os.getpid()),
                    "PYTHONUNBUFFERED": "1"})
        if opts.devices_per_process is not None:
            env["XLA_FLAGS"] = _device_flags(env.get("XLA_FLAGS", ""), opts.devices_per_process)
            env["JAX_PLATFORMS"] = "cpu"
        program = ["-m", opts.program] if opts.module else [opts.program]
        try:
            p = subprocess.Popen([sys.executable, "-m", "multimesh.launch", "--child", *program,
                                  *opts.args], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, pass_fds=(write,),
                                 start_new_session=True)  # its own group: signals reach its children
        finally:
            os.close(write)
        os.set_blocking(read, False)
        w = _Worker(k, p, read)
        self.workers.append(w)
        self.selector.register(read, selectors.EVENT_READ, w)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_forward, args=(stream, out, f"[{k}] ", self.lock),
                                 daemon=True)
            t.start()
            self.threads.append(t)

    def begin_stop(self, code: int, cause: int | None, signum: int) -> None:
        """Send ``signum`` to every process group but ``cause``'s (it is exiting by
        itself); whatever still runs after the grace period gets SIGKILL. The groups of
        processes that have exited already may still hold their children: signalled too
        (a group's id is not reused while it has members)."""
        self.stop = _Stop(code, cause, signum, time.monotonic() + self.opts.grace_period)
        for w in self.workers:
            if w.k != cause:
                _signal(w, signum)

    def enforce_grace(self) -> None:
        if self.stop is None or time.monotonic() < self.stop.kill_at:
            return
        late = [w for w in self.running() if w.proc.poll() is None]
        if late and not self.stop.killed:
            self.say(f"processes {[w.k for w in late]} still run "
                     f"{self.opts.grace_period:g} s after "
                     f"{signal.Signals(self.stop.signum).name}; killing them (SIGKILL).")
        self.stop.killed = True
        for w in late:
            _signal(w, signal.SIGKILL)

    def finish(self) -> None:
        """After the last exit: a stopped run leaves nothing behind, children included;
        the last output lines are forwarded (for up to 2 s)."""
        if self.stop is not None:
            for w in self.workers:
                _signal(w, signal.SIGKILL)
        deadline = time.monotonic() + 2
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))


class _Watch:
    """What the processes report and how they end: the first failure is the cause, and
    the others are stopped (unless ``--no-fail-fast``); a process gone while its peers
    wait for it strands them."""

    def __init__(self, procs: _Processes):
        self.procs = procs
        self.first_failure: tuple[int, int] | None = None  # (process, exit code)

    def read_reports(self, timeout: float) -> None:
        """Wait up to ``timeout`` for reports; exits are looked at first (a peer's death
        makes the survivors' collectives raise: the death is the cause)."""
        ready = [key.data for key, _ in self.procs.selector.select(timeout)]
        self.reap()
        for w in ready:
            self.drain(w)

    def drain(self, w: _Worker) -> None:
        """Read what process ``w`` reported since the last look."""
        while w.status >= 0:
            try:
                data = os.read(w.status, 65536)
            except BlockingIOError:
                return
            if not data:
                self.procs.selector.unregister(w.status)
                os.close(w.status)
                w.status = -1
                return
            for line in data.decode(errors="replace").splitlines():
                self.on_report(w, line)

    def on_report(self, w: _Worker, line: str) -> None:
        if line == "join":
            w.joined = True
        elif line == "left-before-topology" and self.procs.stop is None:
            waiting = [o.k for o in self.procs.running() if o is not w]
            if waiting:
                self.strand(w, f"process {w.k} exited with code 0 after joining "
                               f"jax.distributed.initialize() but before setting up its "
                               f"devices, which exchanges every process's topology: processes "
                               f"{waiting} wait for its topology; stopping them.",
                            "it left before setting up its devices under jax.distributed")
        elif line.startswith("failed ") and w.failed is None:
            code, _, why = line[len("failed "):].partition(" ")
            w.failed = (int(code) if code.lstrip("-").isdigit() else 1, why)
            self.failure(w, f"failed ({why})", w.failed[0])

    def strand(self, w: _Worker, message: str, why: str) -> None:
        """Process ``w`` left while its peers wait for it: it is the cause; stop them."""
        self.procs.say(message)
        w.failed = (EXIT_STRANDED, why)
        self.first_failure = (w.k, EXIT_STRANDED)
        self.procs.begin_stop(EXIT_STRANDED, w.k, signal.SIGTERM)

    def reap(self) -> None:
        for w in self.procs.running():
            rc = w.proc.poll()
            if rc is None:
                continue
            w.exited_at = time.monotonic()
            self.drain(w)  # its last words come before its exit code
            if rc != 0 and w.failed is None:
                self.failure(w, f"exited with code {_exit_code(rc)}", _exit_code(rc))

    def failure(self, w: _Worker, what: str, code: int) -> None:
        """Process ``w`` failed: the first failure is the cause; the others stop."""
        if self.first_failure is not None or self.procs.stop is not None:
            return
        self.first_failure = (w.k, code)
        others = [o.k for o in self.procs.running() if o is not w]
        if self.procs.opts.no_fail_fast:
            self.procs.say(f"process {w.k} {what}; the others run on (--no-fail-fast).")
            return
        how = f"; stopping processes {others}" if others else ""
        self.procs.say(f"process {w.k} {what}{how}.")
        self.procs.begin_stop(code, w.k, signal.SIGTERM)

    def check_early_exits(self) -> None:
        """A process gone while its peers run: named; stopped if they wait for it."""
        running = self.procs.running()
        if self.procs.stop is not None or not running:
            return
        now = time.monotonic()
        waiting = [o.k for o in running if o.joined]
        for w in self.procs.workers:
            if w.exited_at is None or w.proc.returncode != 0:
                continue
            if not w.joined and waiting:
                self.strand(w, f"process {w.k} exited with code 0 without joining "
                               f"jax.distributed.initialize(), which processes {waiting} wait "
                               f"in for it; stopping them.",
                            "it left before joining jax.distributed.initialize()")
                return
            if not w.noticed and now - w.exited_at >= EARLY_EXIT_NOTICE:
                w.noticed = True
                self.procs.say(
                    f"process {w.k} exited with code 0 {now - w.exited_at:.0f} s ago; "
                    f"processes {[o.k for o in running]} still run. If they wait for it "
                    f"(jax.distributed, a collective), they wait until jax's own timeouts; "
                    f"--timeout bounds the run.")


class _Launch:
    """One launch: start the processes (:class:`_Processes`), watch them
    (:class:`_Watch`), act on the launcher's own signals and ``--timeout``, and sum up."""

    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.procs = _Processes(opts)
        self.watch = _Watch(self.procs)
        self.signals: list[int] = []  # received by the launcher, in order
        self.handled = 0  # how many of them have been acted on
        self.signalled = False
        self.start = time.monotonic()

    def on_signal(self, signum, frame) -> None:
        self.signals.append(signum)

    def check_signals(self) -> None:
        """Forward the first signal the launcher got; a second one kills at once."""
        new, self.handled = self.signals[self.handled:], len(self.signals)
        if not new:
            return
        procs = self.procs
        if self.signalled and procs.stop is not None:
            procs.stop.kill_at = time.monotonic()
            return
        self.signalled = True
        name = signal.Signals(new[0]).name
        procs.say(f"got {name}; forwarding it to processes {[w.k for w in procs.running()]}.")
        procs.begin_stop(128 + new[0], None, new[0])
        if len(new) > 1:
            procs.stop.kill_at = time.monotonic()  # type: ignore[union-attr]  # just set

    def check_timeout(self) -> None:
        timeout = self.opts.timeout
        if timeout is not None and self.procs.stop is None and \
                time.monotonic() - self.start > timeout:
            self.procs.say(f"timed out after {timeout:g} s; stopping every process.")
            self.procs.begin_stop(EXIT_TIMEOUT, None, signal.SIGTERM)

    def tick(self, timeout: float) -> None:
        self.watch.read_reports(timeout)
        self.check_signals()
        self.check_timeout()
        self.watch.check_early_exits()
        self.procs.enforce_grace()

    def run(self) -> int:
        for k in range(self.opts.num_processes):
            self.tick(0)
            if self.procs.stop is not None:
                break
            self.procs.spawn(k)
        while self.procs.running():
            self.tick(0.05)
        self.watch.reap()
        self.procs.finish()
        return self.summary()

    def summary(self) -> int:
        """Each non-zero exit, the cause last; then the launcher's exit code."""
        procs = self.procs
        cause = None if procs.stop is None else procs.stop.cause
        for w in procs.workers:
            rc = w.proc.returncode
            if rc != 0 and w.k != cause:
                how = " (stopped by the launcher)" if procs.stop is not None else ""
                procs.say(f"process {w.k} exited with code {_exit_code(rc)}{how}")
        if procs.stop is not None and cause is None:
            return procs.stop.code  # a signal or the timeout
        if self.watch.first_failure is None:
            return 0
        k, code = self.watch.first_failure
        w = procs.workers[k]
        why = f" ({w.failed[1]})" if w.failed else ""
        procs.say(f"the cause: process {k}{why}, which exited with code "
                  f"{_exit_code(w.proc.returncode)}; exit code {code}.")
        return code


def _signal(w: _Worker, signum: int) -> None:
    try:
        os.killpg(w.proc.pid, signum)  # the process's own group: it and its children
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1:])
        return 0
    launch = _Launch(_parse(argv))
    if threading.current_thread() is not threading.main_thread():
        return launch.run()
    previous = {s: signal.signal(s, launch.on_signal) for s in FORWARDED}
    try:
        return launch.run()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
