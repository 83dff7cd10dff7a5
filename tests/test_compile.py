"""Compiling fragments at scale: on a thread pool, and from jax's persistent cache.

Every test checks numbers against plain jax on the same program and where the
arrays live.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src import jax_compat
from multimesh.runtime import executor, parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A 4-stage pipeline on 2-device submeshes, 1F1B over 4 microbatches: 13 fragments.
PROGRAM = """
import jax, jax.numpy as jnp
import multimesh.jax as mm
from tests.models import tanh_chain

def make(stages=4):
    loss, ws, _ = tanh_chain(stages)  # stage k on devices 2k, 2k + 1
    x = jnp.linspace(0, 1, 32 * 16).reshape(32, 16)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    return loss, step, ws, x
"""
exec(PROGRAM)


def _check(got, want):
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def _reference(loss, ws, x):
    with mm.ignore_transforms():
        return jax.value_and_grad(loss)(ws, x)


def _compile(threads, monkeypatch):
    monkeypatch.setenv(parallel.THREADS_ENV, str(threads))
    executor._COMPILE_CACHE.clear()
    loss, step, ws, x = make()  # noqa: F821  (defined by exec(PROGRAM))
    return mm.mjit(step).lower(ws, x).compile(), loss, ws, x


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_threads_change_nothing_but_the_time(monkeypatch):
    """1 thread and 4 threads: the same fragments, calls, sources and values."""
    runs = {}
    for threads in (1, 4):
        compiled, loss, ws, x = _compile(threads, monkeypatch)
        got = compiled(ws, x)
        _check(got, _reference(loss, ws, x))
        assert [sorted(d.id for d in g.devices()) for g in got[1]] == [
            [2 * k, 2 * k + 1] for k in range(4)]
        runs[threads] = (compiled.fragments, compiled.calls, compiled.xla_sources,
                         compiled._exec.xla_compiles, [np.asarray(g) for g in got[1]])
    (f1, c1, s1, n1, g1), (f4, c4, s4, n4, g4) = runs[1], runs[4]
    assert f1 == f4 and c1 == c4 and s1 == s4
    assert len(f1) >= 8 and n1 == n4 == list(s1.values()).count("xla")
    assert set(s1.values()) == {"xla", "identical fragment"}
    for a, b in zip(g1, g4):
        np.testing.assert_array_equal(a, b)


def test_a_second_compile_is_served_from_memory(monkeypatch):
    compiled, loss, ws, x = _compile(4, monkeypatch)
    again = mm.mjit(make()[1]).lower(ws, x).compile()  # noqa: F821
    assert set(again.xla_sources.values()) == {"memory"}
    assert again._exec.xla_compiles == 0
    _check(again(ws, x), _reference(loss, ws, x))


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_fragments_that_differ_only_in_their_devices_compile_once(monkeypatch):
    """The middle stages run the same block on other submeshes: one of them compiles,
    the others load its executable onto their devices (no XLA compile), and every
    stage computes jax's numbers on its own devices."""
    compiled, loss, ws, x = _compile(1, monkeypatch)
    src = compiled.xla_sources
    assert src["s1_fwd"] == "xla" and src["s2_fwd"] == "identical fragment", src
    assert compiled._exec.xla_compiles == list(src.values()).count("xla") < len(src)
    for name in ("s1_fwd", "s2_fwd"):
        assert sorted(d.id for d in compiled._exec.exes[name].input_shardings[0][0].device_set) \
            == sorted({d for f in compiled.fragments if f["name"] == name
                       for d in f["devices"]})
    got = compiled(ws, x)
    _check(got, _reference(loss, ws, x))
    assert [sorted(d.id for d in g.devices()) for g in got[1]] == [
        [2 * k, 2 * k + 1] for k in range(4)]


def test_a_failing_fragment_raises_what_serial_compilation_raises(monkeypatch):
    """Two fragments fail: every thread count raises the first one's error (in the
    serial order), and nothing else."""
    real = jax_compat.compile_module
    failing = ("s2_bwd", "s0_fwd")

    def compile_module(name, *args):
        if name in failing:
            raise RuntimeError(f"XLA refused {name}")
        return real(name, *args)

    monkeypatch.setattr(jax_compat, "compile_module", compile_module)
    errors = {}
    for threads in (1, 4):
        with pytest.raises(RuntimeError, match="XLA refused") as e:
            _compile(threads, monkeypatch)
        errors[threads] = str(e.value)
    assert errors[1] == errors[4] == "XLA refused s0_fwd"


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_the_longest_compiles_start_first_and_followers_load_next(monkeypatch):
    """Serially (1 thread), fragments compile in the order of their work (backward
    before forward: more contractions), and a fragment identical up to its devices
    loads right after the one it loads from, not after every compile."""
    order = []
    real_compile, real_load = jax_compat.compile_module, jax_compat.load_on_devices

    def compile_module(name, *args):
        order.append(("xla", name))
        return real_compile(name, *args)

    def load_on_devices(compiled, name, *args):
        order.append(("load", name))
        return real_load(compiled, name, *args)

    monkeypatch.setattr(jax_compat, "compile_module", compile_module)
    monkeypatch.setattr(jax_compat, "load_on_devices", load_on_devices)
    compiled, loss, ws, x = _compile(1, monkeypatch)
    _check(compiled(ws, x), _reference(loss, ws, x))
    frags = {f.name: f for f in compiled._exec.plan.fragments.values()}
    xla = [n for kind, n in order if kind == "xla"]
    assert sorted(xla) == sorted(n for n, s in compiled.xla_sources.items() if s == "xla")
    assert [executor._work(frags[n]) for n in xla] == sorted(
        (executor._work(frags[n]) for n in xla), reverse=True)
    assert xla.index("s2_bwd") < xla.index("s1_fwd"), xla
    for leader, follower in (("s1_fwd", "s2_fwd"), ("s2_bwd", "s1_bwd")):
        assert compiled.xla_sources[follower] == "identical fragment"
        i = order.index(("load", follower))
        assert order[i - 1] == ("xla", leader), order


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_workers_compile_in_the_callers_jax_config(monkeypatch, caplog):
    """``with jax.log_compiles(True)`` is thread-local in jax; the pool's threads see it."""
    monkeypatch.delenv("MULTIMESH_LOG_COMPILES", raising=False)
    with caplog.at_level(logging.WARNING, logger="multimesh"), jax.log_compiles(True):
        compiled, *_ = _compile(4, monkeypatch)
    logged = [r.getMessage() for r in caplog.records if r.name == "multimesh"
              and re.search("XLA compiled|identical fragment's executable", r.getMessage())]
    assert len(logged) == len(compiled.fragments)


def test_compile_threads_default_and_env(monkeypatch):
    monkeypatch.delenv(parallel.THREADS_ENV, raising=False)
    assert parallel.compile_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv(parallel.THREADS_ENV, "3")
    assert parallel.compile_threads() == 3
    for bad in ("0", "-2", "many", "1.5"):
        monkeypatch.setenv(parallel.THREADS_ENV, bad)
        with pytest.raises(mm.errors.MultimeshValueError, match="MULTIMESH_COMPILE_THREADS"):
            parallel.compile_threads()


_CHILD = PROGRAM + textwrap.dedent("""
    import json, sys
    import numpy as np
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []
    jax.monitoring.register_event_listener(
        lambda ev, **kw: hits.append(ev) if ev.endswith("cache_hits") else None)
    loss, step, ws, x = make()
    hits.clear()  # the arrays' own small programs
    compiled = mm.mjit(step).lower(ws, x).compile()
    fragment_hits = len(hits)
    value, grads = compiled(ws, x)
    with mm.ignore_transforms():
        want_value, want_grads = jax.value_and_grad(loss)(ws, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    from multimesh.runtime import executor, fragment_store
    print(json.dumps({"sources": compiled.xla_sources, "hits": fragment_hits,
                      "xla": executor.xla_compiles, "reads": fragment_store.reads(),
                      "writes": fragment_store.writes(),
                      "devices": [sorted(d.id for d in g.devices()) for g in grads],
                      "grads": [np.asarray(g).tolist() for g in grads]}))
""")


def _child(script, cache_dir):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", MULTIMESH_COMPILE_THREADS="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(script), str(cache_dir)], capture_output=True,
                       text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_every_fragment_from_jax_persistent_cache(tmp_path):
    """With jax's cache on, identical fragments still compile once (issue 31): the first
    process compiles each distinct fragment and stores it once; the second reads one
    entry per distinct fragment and loads it onto every submesh, with the same values."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cache = tmp_path / "cache"
    first = _child(script, cache)
    entries = sorted(os.listdir(cache / "multimesh"))
    second = _child(script, cache)
    names = set(first["sources"])
    assert len(names) >= 8
    origins = list(first["sources"].values())
    distinct = origins.count("xla")
    assert set(origins) == {"xla", "identical fragment"} and distinct < len(names), \
        first["sources"]
    assert first["xla"] == distinct and first["hits"] == 0
    assert first["writes"] == distinct == len(entries)
    assert second["sources"] == dict.fromkeys(names, "persistent cache")
    assert second["xla"] == 0 and second["writes"] == 0
    assert second["reads"] == distinct and second["hits"] == 0  # not one per fragment
    assert sorted(os.listdir(cache / "multimesh")) == entries  # nothing new
    assert first["devices"] == second["devices"] == [[2 * k, 2 * k + 1] for k in range(4)]
    assert first["grads"] == second["grads"]


def test_fragments_with_host_callbacks_each_compile(monkeypatch):
    """A callback's address is compiled into its executable, so one that calls back is
    never loaded onto other devices (jax also gives every call site its own callback,
    so such fragments differ in text anyway); on the thread pool, every callback runs."""
    monkeypatch.setenv(parallel.THREADS_ENV, "2")
    executor._COMPILE_CACHE.clear()
    seen = []

    def record(s):
        seen.append(float(s))

    def mk(k):
        def body(w, x):
            jax.debug.callback(record, x.sum())
            return jnp.tanh(x @ w)
        mesh = mm.TaskMesh(devices=(2 * k, 2 * k + 1), axis_names=("x",), axis_sizes=(2,))
        return mm.task(body, name=f"s{k}", mesh=mesh)
    tasks = [mk(k) for k in range(4)]

    def f(ws, x):
        for t, w in zip(tasks, ws):
            x = t(w, x)
        return x

    ws = [jnp.eye(16) * 0.5 + 0.01 * k for k in range(4)]
    x = jnp.linspace(0, 1, 8 * 16).reshape(8, 16)
    compiled = mm.mjit(f).lower(ws, x).compile()
    assert set(compiled.xla_sources.values()) == {"xla"}
    exe = compiled._exec.exes["s1_fwd"]
    assert jax_compat.load_on_devices(exe, "s1_fwd", exe.input_shardings[0],
                                      exe.output_shardings, jax.devices()[4:6]) is None
    got = compiled(ws, x)
    jax.effects_barrier()
    with mm.ignore_transforms():
        want = f(ws, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert sorted(got.devices(), key=lambda d: d.id) == [jax.devices()[6], jax.devices()[7]]
    assert len(seen) == 8  # 4 stages, called at the check above (4) and by the plain f (4)
