"""Each distinct block compiles once across stages (issue 40, CSCALE;
``multimesh.runtime.shared_blocks``).

A 4-stage pipeline whose stages run the same two blocks, stage 0 after an
embedding-like prefix and stage 3 before a head: stage 0's and stage 3's fragments
hold stage 1's program, so they run as pieces around it and load its executable
instead of compiling the blocks again. Values and gradients stay plain jax's, arrays
stay where they are without the split, and XLA compiles fewer contractions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import MultimeshValueError
from multimesh.runtime import executor, shared_blocks
from tests.layouts import spec_of

W, STAGES = 16, 4


def _block(p, x):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(var + 1e-6) * p["g"]
    return x + jnp.tanh(h @ p["w1"]) @ p["w2"]


def _stage_fn(k: int):
    def body(p, x):
        if "emb" in p:  # an embedding-like prefix
            x = jnp.tanh(x @ p["emb"])
        x = mm.with_sharding_constraint(x, P("batch", None))
        for b in p["blocks"]:
            x = _block(b, x)
        if "head" in p:  # a head suffix
            x = x @ p["head"]
        return x

    mesh = mm.TaskMesh(devices=(2 * k, 2 * k + 1), axis_names=("x",), axis_sizes=(2,))
    return mm.task(body, name=f"s{k}", mesh=mesh, logical_axes=(("batch", "x"),))


def _params(widths=(W,) * STAGES, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def mat(a, b):
        return jax.random.normal(next(keys), (a, b)) / np.sqrt(a)

    out = []
    for k, w in enumerate(widths):
        p = {"blocks": [{"g": jnp.ones(w), "w1": mat(w, 2 * w), "w2": mat(2 * w, w)}
                        for _ in range(2)]}
        if k == 0:
            p["emb"] = mat(W, w)
        if k == len(widths) - 1:
            p["head"] = mat(w, 8)
        out.append(p)
    return out


def _loss():
    tasks = [_stage_fn(k) for k in range(STAGES)]

    def loss(params, x):
        for t, p in zip(tasks, params):
            x = t(p, x)
        return (x ** 2).mean()
    return loss


def _x(rows=32):
    return jnp.linspace(-1, 1, rows * W).reshape(rows, W)


def _grad_fn(loss):
    return mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b",
                          reduction="mean")


def _compile(fn, args, monkeypatch, share: str, donate=()):
    monkeypatch.setenv(shared_blocks.SHARE_ENV, share)
    executor._COMPILE_CACHE.clear()
    before = executor.xla_compiles
    compiled = mm.mjit(fn, donate_argnums=donate).lower(*args).compile()
    return compiled, executor.xla_compiles - before


def _same(out, ref):
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _placed_alike(out, ref):
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        assert {d.id for d in got.devices()} == {d.id for d in want.devices()}
        assert spec_of(got.sharding, got.ndim) == spec_of(want.sharding, want.ndim)


def _xla_contractions(compiled) -> int:
    """The contractions (``dot_general``) in the programs XLA compiled."""
    ex = compiled._exec
    n = 0
    for name, frag in compiled.plan_data.fragments.items():
        exe = ex.exes[name]
        if isinstance(exe, shared_blocks.SplitExecutable):
            n += sum(job[0].text.count("stablehlo.dot_general")
                     for job, (_, origin, _) in zip(exe.split.jobs, exe.pieces)
                     if origin == "xla")
        elif ex.xla_sources[name] == "xla":
            n += frag.text.count("stablehlo.dot_general")
    return n


def _shared_once(compiled):
    """Each shared program compiled once: among the fragment it is and the pieces
    that run it, one came from XLA, the others loaded its executable."""
    ex = compiled._exec
    for name, pieces in ex.split_pieces.items():
        shares = ex.exes[name].split.shares
        mids = [o for n, o, _ in pieces if n == f"{name}.{shares}"]
        assert len(mids) == 1
        group = [ex.xla_sources[shares]] + [
            o for other, ps in ex.split_pieces.items()
            if ex.exes[other].split.shares == shares
            for n, o, _ in ps if n == f"{other}.{shares}"]
        assert group.count("xla") == 1, (shares, group)


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_forward_and_backward_share_the_blocks(monkeypatch):
    loss, params, x = _loss(), _params(), _x()
    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(params, x)
    f = _grad_fn(loss)
    off, off_n = _compile(f, (params, x), monkeypatch, "off")
    on, on_n = _compile(f, (params, x), monkeypatch, "on")
    assert off._exec.split_pieces == {}
    # the first and last stages' forward and backward hold stage 1's (or 2's) blocks
    assert set(on._exec.split_pieces) == {"s0_fwd", "s3_fwd", "s0_bwd", "s3_bwd"}
    assert set(on.xla_times) == set(on.xla_sources) == {fr["name"] for fr in on.fragments}
    out, base = on(params, x), off(params, x)
    _same(out, ref)
    _same(out, base)
    _placed_alike(out, base)
    for k, g in enumerate(out[1]):
        assert {d.id for leaf in jax.tree.leaves(g) for d in leaf.devices()} == {2 * k,
                                                                                 2 * k + 1}
    _shared_once(on)
    # XLA compiles the blocks' contractions once, not once per distinct stage, in no
    # more compiles; each device does the same work
    assert _xla_contractions(on) < _xla_contractions(off)
    assert on_n <= off_n + 2
    flops_on, flops_off = on.cost_analysis()["flops"], off.cost_analysis()["flops"]
    assert flops_on == pytest.approx(flops_off, rel=0.05)
    assert on.memory_analysis().temp_size_in_bytes > 0
    # the plan does not change: the same calls, in the same order
    assert on.calls == off.calls


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_optimizer_updates_share_on_a_superset_of_parameters(monkeypatch):
    loss, params, x = _loss(), _params(), _x()
    opt = optax.adam(1e-2)
    grad = _grad_fn(loss)

    def step(params, state, x):
        value, grads = grad(params, x)
        updates, state = opt.update(grads, state, params)
        return value, optax.apply_updates(params, updates), state

    state = opt.init(params)
    with mm.ignore_transforms():
        ref = jax.jit(step)(params, state, x)
    off, _ = _compile(step, (params, state, x), monkeypatch, "off")
    # parameters and optimizer state donated: each piece donates what only it reads
    on, _ = _compile(step, (params, state, x), monkeypatch, "on", donate=(0, 1))
    updates = [n for n, fr in on.plan_data.fragments.items()
               if "dot_general" not in fr.text and n in on._exec.split_pieces]
    assert updates, sorted(on._exec.split_pieces)  # an elementwise update was split
    assert any(on._exec.exes[n].donated for n in updates)
    base = off(params, state, x)
    placed = jax.device_put((params, state, x), on.input_shardings[0])
    out = on(*placed)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(placed[:2]))
    _same(out, ref)
    _same(out, base)
    _placed_alike(out, base)
    _shared_once(on)
    assert _xla_contractions(on) < _xla_contractions(off)


def test_stages_that_differ_are_not_split(monkeypatch):
    widths = (W, W + 8)
    tasks = [_stage_fn(k) for k in range(len(widths))]

    def loss(params, x):  # the two stages' blocks differ in width
        for t, p, w in zip(tasks, params, widths):
            x = t(p, jnp.pad(x, ((0, 0), (0, w - x.shape[1]))))[:, :W]
        return (x ** 2).mean()

    params, x = _params(widths), _x()
    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(params, x)
    compiled, _ = _compile(_grad_fn(loss), (params, x), monkeypatch, "on")
    assert compiled._exec.split_pieces == {}
    _same(compiled(params, x), ref)


def test_share_blocks_env_is_checked(monkeypatch):
    monkeypatch.setenv(shared_blocks.SHARE_ENV, "yes")
    with pytest.raises(MultimeshValueError, match="MULTIMESH_SHARE_BLOCKS must be on or off"):
        shared_blocks.share_blocks()
    monkeypatch.setenv(shared_blocks.SHARE_ENV, " OFF ")
    assert not shared_blocks.share_blocks()
    monkeypatch.delenv(shared_blocks.SHARE_ENV)
    assert shared_blocks.share_blocks()


@pytest.mark.usefixtures("fresh_xla_compiles")
def test_a_restarted_process_reads_the_split_plan(monkeypatch, tmp_path):
    """With jax's persistent cache on, the split plan is stored beside the fragments'
    executables: the next compile of the program reads it instead of matching the
    fragments again, and a damaged entry is planned again."""
    import zlib

    from multimesh.runtime import fragment_store

    monkeypatch.setattr(fragment_store, "directory",
                        lambda folder=fragment_store.EXECUTABLES: tmp_path / folder)
    prev = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        loss, params, x = _loss(), _params(), _x()
        with mm.ignore_transforms():
            ref = jax.value_and_grad(loss)(params, x)
        f = _grad_fn(loss)
        first, _ = _compile(f, (params, x), monkeypatch, "on")
        stored = list((tmp_path / fragment_store.SPLIT_PLANS).iterdir())
        assert len(stored) == 1
        assert not (tmp_path / fragment_store.EXECUTABLES).exists()  # (jax's cache is off)
        planned: list[int] = []
        real = shared_blocks._plan_splits
        monkeypatch.setattr(shared_blocks, "_plan_splits",
                            lambda *a: planned.append(1) or real(*a))
        second, _ = _compile(f, (params, x), monkeypatch, "on")
        assert planned == []
        assert set(second._exec.split_pieces) == set(first._exec.split_pieces) == {
            "s0_fwd", "s3_fwd", "s0_bwd", "s3_bwd"}
        out = second(params, x)
        _same(out, ref)
        _placed_alike(out, first(params, x))
        stored[0].write_bytes(zlib.compress(b"not a plan"))
        third, _ = _compile(f, (params, x), monkeypatch, "on")
        assert planned == [1]
        assert set(third._exec.split_pieces) == set(first._exec.split_pieces)
        _same(third(params, x), ref)
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", prev)
