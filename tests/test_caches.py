"""No leak across recompiles, and ``multimesh.clear_caches()`` gives the memory back."""

from __future__ import annotations

import ctypes
import gc
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh
import multimesh.jax as mm
from multimesh.passes import _contract
from multimesh.runtime import executor
from tests.tools import run_child


def _rss_mb() -> float:
    """Resident memory after a GC and a ``malloc_trim`` (so freed memory shows)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _two_stage_grad():
    m0 = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
    t0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=m0)
    t1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=m0.place(range(4, 8)))

    def loss(ws, x):
        return (t1(ws[1], t0(ws[0], x)) ** 2).sum()

    def plain(ws, x):
        return (jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) ** 2).sum()

    return jax.value_and_grad(loss), jax.value_and_grad(plain)


def _args(d: int):
    k0, k1, k2 = jax.random.split(jax.random.key(d), 3)
    return [jax.random.normal(k0, (d, d)) / d, jax.random.normal(k1, (d, d)) / d], \
        jax.random.normal(k2, (8, d))


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"),
                                reason="needs /proc to read the resident set size")


def test_300_recompiles_of_one_program_grow_rss_by_less_than_60mb():
    """Each compile used to keep its MLIR context alive through the task-tag cache
    (+1.2 MB a compile); now a compiled program's memory goes with it."""
    m0 = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
    t0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=m0)
    t1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=m0.place(range(4, 8)))

    def model(ws, x):
        return t1(ws[1], t0(ws[0], x))

    ws, x = _args(16)
    ref = jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1])
    for _ in range(10):  # warm jax's and our caches
        mm.mjit(model).lower(ws, x).compile()(ws, x)
    before = _rss_mb()
    for _ in range(300):
        y = mm.mjit(model).lower(ws, x).compile()(ws, x)
    grown = _rss_mb() - before
    assert grown < 60, f"300 recompiles grew RSS by {grown:.1f} MB"
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    assert sorted(d.id for d in y.devices()) == [4, 5, 6, 7]


def test_a_dropped_program_frees_its_mlir_context():
    grad, _ = _two_stage_grad()
    ws, x = _args(16)
    compiled = mm.mjit(grad).lower(ws, x).compile()
    compiled(ws, x)
    ctx = weakref.ref(compiled._module.context)
    assert _contract._tag_cache(ctx()), "the passes looked up task tags in this context"
    del compiled
    gc.collect()
    assert ctx() is None, "something still holds the compiled program's MLIR context"


def test_clear_caches_empties_every_cache_and_returns_the_memory():
    """Programs of 5 shapes held by one mjit function: clearing frees them all.

    Measured in a fresh interpreter: in a process that ran other test files first (an
    xdist worker), the heap's free memory absorbs the programs' growth, and the RSS
    before and after says little (16.6 MB grown, 20.9 MB freed, in one such run)."""
    run_child('import os\n'
              'os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"\n'
              'from tests.test_caches import clear_caches_returns_the_memory\n'
              'clear_caches_returns_the_memory()\n')


def clear_caches_returns_the_memory():
    """The body of the test above, run in a fresh interpreter."""
    multimesh.clear_caches()
    grad, plain = _two_stage_grad()
    f = mm.mjit(grad)
    f(*_args(8))
    before = _rss_mb()
    for i in range(5):
        ws, x = _args(16 + 8 * i)
        v, g = f(ws, x)
    np.testing.assert_allclose(v, jax.jit(plain)(ws, x)[0], rtol=1e-5)
    grown = _rss_mb() - before
    assert len(f._cache) == 6 and len(executor._COMPILE_CACHE) >= 6 * 4
    exes = [weakref.ref(e) for e in executor._COMPILE_CACHE.values()]
    programs = [weakref.ref(p) for p in f._cache.values()]
    multimesh.clear_caches()
    assert len(f._cache) == 0 and len(executor._COMPILE_CACHE) == 0
    freed = grown - (_rss_mb() - before)
    assert not any(r() for r in programs) and not any(r() for r in exes)
    assert grown > 20 and freed > 0.7 * grown, (grown, freed)
    # the function still works after the clear, and compiles again
    ws, x = _args(16)
    v, g = f(ws, x)
    ref_v, ref_g = jax.jit(plain)(ws, x)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    for a, b in zip(g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(f._cache) == 1
    assert sorted(d.id for d in g[0].devices()) == [0, 1, 2, 3]


def test_jax_clear_caches_empties_ours_too():
    f = mm.mjit(lambda x: x * 2)
    np.testing.assert_array_equal(f(jnp.arange(4.0)), [0, 2, 4, 6])
    assert len(f._cache) == 1 and len(executor._COMPILE_CACHE) >= 1
    jax.clear_caches()
    assert len(f._cache) == 0 and len(executor._COMPILE_CACHE) == 0
    np.testing.assert_array_equal(f(jnp.arange(4.0)), [0, 2, 4, 6])


def test_the_fragment_cache_is_bounded():
    cache = executor._COMPILE_CACHE
    assert cache.max_size is not None
    lru = type(cache)("test cache", max_size=3)
    for i in range(5):
        lru[i] = i
    assert lru.get(0) is None and lru.get(4) == 4 and len(lru) == 3
    lru.get(2)
    lru[5] = 5  # 3 was the least recently used
    assert lru.get(3) is None and lru.get(2) == 2
