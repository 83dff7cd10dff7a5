"""Root pytest configuration: 8 simulated CPU devices, set before jax is imported."""

import os

import pytest

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


# One XLA compile per distinct program in each pytest process: jax's persistent
# compilation cache, in a directory of this process's own (two xdist workers never read
# an entry the other is writing), holds every executable the suite compiles, and a
# program compiled again (a reference jitted twice, the same stage under two placement
# spellings) loads it. XLA's compiles are about 60% of the suite's time and a quarter of
# them repeat (docs/testing.md). multimesh's disk cache of the pass pipeline, which
# switches on with jax's cache, stays off for this directory, so every lowering still
# runs its passes; a test that turns jax's cache on elsewhere gets it as a user would.
# Tests that read how a program was compiled take the `fresh_xla_compiles` fixture.
# Subprocesses do not inherit the directory (it is jax's config, not the environment).
_XLA_CACHE: list[str] = []


def pytest_configure(config):
    import tempfile
    from pathlib import Path

    import jax

    from multimesh.jax._stages import disk_cache

    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _XLA_CACHE.append(tempfile.mkdtemp(prefix=f"multimesh-tests-xla-{worker}-"))
    jax.config.update("jax_compilation_cache_dir", _XLA_CACHE[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    passes_directory = disk_cache.directory

    def directory():
        found = passes_directory()
        return None if found is not None and found.parent == Path(_XLA_CACHE[0]) else found

    disk_cache.directory = directory


def pytest_unconfigure(config):
    import shutil

    for path in _XLA_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fresh_xla_compiles():
    """As in a fresh process, no persistent compilation cache: every program compiles."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", _XLA_CACHE[0])
        compilation_cache.reset_cache()


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="Rewrite tests/goldens/*.mlir from the current pipeline output.",
    )
