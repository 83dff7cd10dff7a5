"""Root pytest configuration: 8 simulated CPU devices, set before jax is imported."""

import os

_flags = os.environ.get("XLA_FLAGS", "")
# The suite checks values, placement and structure, not speed: XLA's CPU backend
# compiles at LLVM optimisation level 1, which takes a fifth off its compile time (most
# of the suite's time; docs/testing.md). Level 0 would take a third, but reorders
# float32 sums enough to move gradients by 2% against plain jax. Benchmarks (tools/)
# do not do this.
if "--xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=1"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's subprocesses (mm-opt, python -m multimesh.launch, child interpreters) run
# sys.executable, so they test the jax under test; this makes them import multimesh from
# this checkout as well, whichever environment runs pytest (tools/test_under.sh).
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")) if p)


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="Rewrite tests/goldens/*.mlir from the current pipeline output.",
    )
