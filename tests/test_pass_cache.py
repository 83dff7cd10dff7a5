"""The pass pipeline's result on disk, beside jax's persistent cache (issue 40, item 1).

A second process with jax's persistent cache on reads the pass pipeline's result from
multimesh's own entry (no pass runs) and loads every fragment from jax's cache (no XLA
compile), with the first process's values, gradients, fragments and placement; a
damaged entry is ignored with a warning and the program recompiled; a changed option
is another entry. Every process checks its numbers against plain jax.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src import jax_compat
from multimesh.jax._stages import disk_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = textwrap.dedent("""
    import json, sys, warnings
    import jax, jax.numpy as jnp
    import numpy as np
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import multimesh.jax as mm
    from multimesh.jax._stages import disk_cache
    from multimesh.runtime import executor
    from tests.models import tanh_chain

    loss, ws, _ = tanh_chain(2)  # stage k on devices 4k..4k+3
    x = jnp.linspace(0, 1, 16 * 16).reshape(16, 16)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                         schedule=sys.argv[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = mm.mjit(step).lower(ws, x).compile()
    value, grads = compiled(ws, x)
    with mm.ignore_transforms():
        want_value, want_grads = jax.value_and_grad(loss)(ws, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    print(json.dumps({
        "status": compiled.pipeline_cache, "counts": disk_cache.counts(),
        "xla": executor.xla_compiles, "fragments": [f["name"] for f in compiled.fragments],
        "calls": [c["fragment"] for c in compiled.calls],
        "devices": [sorted(d.id for d in g.devices()) for g in grads],
        "specs": [str(g.sharding.spec) for g in grads],
        "inputs": [str(s.spec) for s in jax.tree.leaves(compiled.input_shardings)],
        "value": float(value), "grads": [np.asarray(g).tolist() for g in grads],
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, mm.errors.MultimeshWarning)]}))
""")


def _child(script, cache_dir, schedule="1f1b") -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", MULTIMESH_COMPILE_THREADS="2",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop(disk_cache.ENV, None)
    p = subprocess.run([sys.executable, str(script), str(cache_dir), schedule],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_SAME = ("fragments", "calls", "devices", "specs", "inputs", "value", "grads")


def test_a_second_process_skips_the_passes_damaged_entries_warn_changed_options_miss(
        tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cache = tmp_path / "cache"
    first = _child(script, cache)
    assert first["status"] == disk_cache.MISS and first["counts"]["pipeline_runs"] == 1
    assert first["counts"]["lowering_skipped"] == 0
    assert first["counts"]["writes"] == 3 and first["xla"] > 0 and not first["warnings"]
    # the lowered program by its trace; the passes' result by the program, its plan
    entries = sorted((cache / "multimesh-passes").iterdir(), key=lambda p: p.name)
    assert len(entries) == 3 and entries[1].name == entries[0].name + ".plan"
    assert entries[2].name.startswith("trace-")
    second = _child(script, cache)
    assert second["status"] == disk_cache.HIT and second["counts"]["lowering_skipped"] == 1
    assert second["counts"]["pipeline_runs"] == 0 and second["counts"]["writes"] == 0
    assert second["counts"]["plans_read"] == 1 and first["counts"]["plans_read"] == 0
    assert second["xla"] == 0  # every fragment from jax's persistent cache
    for k in _SAME:
        assert second[k] == first[k], k
    assert first["devices"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # damaged entries: warned, ignored, the program lowered and its passes run again,
    # the entries rewritten
    data = [e.read_bytes() for e in entries]
    for e, d in zip(entries, data):
        e.write_bytes(d[:len(d) // 2])
    damaged = _child(script, cache)
    assert damaged["status"] == disk_cache.DAMAGED
    assert damaged["counts"]["pipeline_runs"] == 1 and damaged["counts"]["writes"] == 3
    assert damaged["counts"]["lowering_skipped"] == 0
    assert len(damaged["warnings"]) == 2, damaged["warnings"]
    for w, what in zip(damaged["warnings"], ("lowered programs", "pass pipeline's")):
        assert f"{what} results" in w or what in w, w  # the lowering's first
        assert "damaged entry for mjit(" in w, w
        assert f") in {cache / 'multimesh-passes'}:" in w, w
        assert "truncated or changed" in w
    for k in _SAME:
        assert damaged[k] == first[k], k
    assert [e.read_bytes() for e in entries] == data  # as the first process wrote them
    # another schedule: another program for the passes (a miss, a second entry)
    other = _child(script, cache, "gpipe")
    assert other["status"] == disk_cache.MISS and other["counts"]["pipeline_runs"] == 1
    assert len(list((cache / "multimesh-passes").iterdir())) == 6
    assert other["calls"] != first["calls"]
    for a, b in zip(other["grads"], first["grads"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def _lowered(schedule="1f1b", size=8, stages=2):
    from tests.models import tanh_chain

    loss, ws, _ = tanh_chain(stages)
    x = jnp.linspace(0, 1, 16 * 16).reshape(16, 16)
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=size, argnum=1,
                         schedule=schedule)
    return loss, ws, x, mm.mjit(step).lower(ws, x)


def test_the_key_changes_with_the_program_and_every_option():
    # a second trace of the program (from the same source line: locations are keyed)
    twice = {disk_cache.entry_key(_lowered()[3].record) for _ in range(2)}
    assert len(twice) == 1
    keys = set(twice)
    for variant in (_lowered("gpipe"), _lowered(size=4), _lowered(stages=4)):
        keys.add(disk_cache.entry_key(variant[3].record))
    assert len(keys) == 4


@pytest.fixture
def persistent_cache(tmp_path, monkeypatch):
    """jax's persistent cache on, in ``tmp_path`` (restored after)."""
    monkeypatch.delenv(disk_cache.ENV, raising=False)
    before = jax_compat.persistent_cache_settings()[0] or None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        yield tmp_path
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()


def test_in_one_process_a_hit_equals_plain_jax_and_the_env_turns_it_off(
        persistent_cache, monkeypatch):
    # two lowerings of one program (from one source line: locations are keyed)
    first, again = (_lowered()[3].compile() for _ in range(2))
    loss, ws, x, _ = _lowered()
    assert (first.pipeline_cache, again.pipeline_cache) == (disk_cache.MISS, disk_cache.HIT)
    assert again.as_text() == first.as_text()
    with mm.ignore_transforms():
        want_value, want_grads = jax.value_and_grad(loss)(ws, x)
    value, grads = again(ws, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for g, w, f in zip(grads, want_grads, first(ws, x)[1]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert g.sharding == f.sharding
    monkeypatch.setenv(disk_cache.ENV, "0")
    assert _lowered()[3].compile().pipeline_cache == disk_cache.OFF
    assert disk_cache.directory() is None


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_off_without_jax_persistent_cache():
    assert not jax_compat.persistent_cache_on()
    assert disk_cache.directory() is None
    assert _lowered()[3].compile().pipeline_cache == disk_cache.OFF


def test_a_damaged_entry_warns_in_process(persistent_cache):
    """Three compiles of one program (from one source line: locations are keyed): a
    miss, a damaged entry (warned, the passes run, the entry rewritten), a hit."""
    statuses, messages = [], []
    for damage in (True, False, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            statuses.append(_lowered()[3].compile().pipeline_cache)
        messages.append([str(w.message) for w in caught
                         if issubclass(w.category, mm.errors.MultimeshWarning)])
        if damage:
            (entry,) = [e for e in (persistent_cache / "multimesh-passes").iterdir()
                        if not e.name.startswith("trace-") and e.suffix != ".plan"]
            entry.write_bytes(b"MMPASSES1\n" + b"\0" * 40)
    assert statuses == [disk_cache.MISS, disk_cache.DAMAGED, disk_cache.HIT]
    assert disk_cache.counts()["lowering_skipped"] >= 2  # the trace's entry was sound
    assert messages[0] == messages[2] == []
    assert len(messages[1]) == 1 and "damaged entry" in messages[1][0]
    assert "do not match their hash" in messages[1][0]


def test_the_trace_key_reads_constants_shardings_and_donations(persistent_cache):
    """A program that closes over other constant values, takes its input committed
    elsewhere or donates it is another lowered program: another trace key."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    t = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0",
                mesh=mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,)))

    def key(const, x, **kw):
        f = mm.mjit(lambda w, x: t(w, x) + const, **kw)
        return disk_cache.trace_key(f.trace(jnp.eye(8), x))

    x = jnp.ones((8, 8))
    placed = jax.device_put(x, NamedSharding(jax.make_mesh((8,), ("d",)), P("d")))
    keys = [key(np.ones(8, np.float32), x) for _ in range(2)]
    assert keys[0] is not None and keys[0] == keys[1]
    others = [key(np.full(8, 2.0, np.float32), x), key(np.ones(8, np.float32), placed),
              key(np.ones(8, np.float32), x, donate_argnums=1)]
    assert len({keys[0], *others}) == 4
