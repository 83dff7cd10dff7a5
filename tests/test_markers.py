"""The ``mm_task`` call primitive and the ``mm_logical_sharding`` marker survive
JAX transformations (jit, grad, value_and_grad, vmap, scan, checkpoint).

For every transformation we check
  * the lowered StableHLO (``jax.jit(f).lower(...).as_text()`` inside
    ``autoshard()``) carries ``mm.task`` calls with the right ``transpose_count``
    and ``mm.logical_sharding`` custom calls with the right ``mm.axes``;
  * the numerics under ``mjit`` equal plain JAX (values and gradients);
  * the numerics when the task is run eagerly / under plain ``jax.jit`` equal
    plain JAX (the marker lowers to the identity outside mjit/autoshard).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm

LOGICAL = (("batch", "x"),)
TMESH = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
DEVICES4 = jax.devices()[:4]


def body(w, x):
    x = mm.with_sharding_constraint(x, P("batch", None))
    return jnp.tanh(x @ w)


t = mm.task(body, mesh=TMESH, logical_axes=LOGICAL)
t_ckpt = mm.task(jax.checkpoint(body), name="ck", mesh=TMESH, logical_axes=LOGICAL)

W = jnp.ones((4, 4), jnp.float32) * 0.1 + jnp.arange(16.0, dtype=jnp.float32).reshape(4, 4) / 50
X = jnp.arange(32.0, dtype=jnp.float32).reshape(8, 4) / 10
XS = jnp.stack([X, 2 * X, 3 * X])


def _scan(f):
    def g(w, xs):
        def step(c, x):
            y = f(w, x)
            return c + y.sum(), y

        return lax.scan(step, jnp.float32(0.0), xs)

    return g


# name -> (builder(task_fn) -> program, args, expected transpose counts, expected mm.axes)
CASES = {
    "jit": (lambda f: f, (W, X), {0}, ['[["batch"], []]']),
    "grad": (lambda f: jax.grad(lambda w, x: f(w, x).sum(), argnums=(0, 1)), (W, X), {0, 1},
             ['[["batch"], []]']),
    "value_and_grad": (
        lambda f: jax.value_and_grad(lambda w, x: (f(w, x) ** 2).sum(), argnums=(0, 1)),
        (W, X), {0, 1}, ['[["batch"], []]']),
    "vmap": (lambda f: jax.vmap(f, in_axes=(None, 0)), (W, XS), {0}, ['[[], ["batch"], []]']),
    "scan": (_scan, (W, XS), {0}, ['[["batch"], []]']),
    # checkpoint of the function *inside* the task, differentiated from outside
    "checkpoint_inside": (
        lambda f: jax.value_and_grad(
            lambda w, x: ((t_ckpt if f is t else jax.checkpoint(f))(w, x) ** 2).sum(),
            argnums=(0, 1)),
        (W, X), {0, 1}, ['[["batch"], []]']),
    # checkpoint of the task itself, outside grad
    "checkpoint_outside": (
        lambda f: jax.value_and_grad(lambda w, x: (jax.checkpoint(f)(w, x) ** 2).sum(),
                                     argnums=(0, 1)),
        (W, X), {0, 1}, ['[["batch"], []]']),
}

TASK_RE = re.compile(r"call @(mm_task_\w+)\(.*\{mm\.task = \{(.*?)\}\}")


def _lowered_text(prog, args):
    # mjit's lowered text is the traced program before any multimesh pass.
    return mm.mjit(prog).lower(*args).as_text()


def _reference(name):
    build, args, _, _ = CASES[name]
    with mm.ignore_transforms():
        return build(body)(*args)


def _assert_close(out, ref):
    out_l, ref_l = jax.tree.leaves(out), jax.tree.leaves(ref)
    assert len(out_l) == len(ref_l)
    for a, b in zip(out_l, ref_l):
        assert np.shape(a) == np.shape(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _check(name):
    build, args, counts, axes = CASES[name]
    prog = build(t)
    text = _lowered_text(prog, args)
    calls = TASK_RE.findall(text)
    assert calls, text
    seen = set()
    for _sym, attrs in calls:
        assert 'axis_names = ["x"]' in attrs and "axis_sizes = [4]" in attrs, attrs
        assert "devices = [0, 1, 2, 3]" in attrs, attrs
        assert 'logical_axes = [["batch", "x"]]' in attrs, attrs
        m = re.search(r"transpose_count = (\d+) : i64", attrs)
        assert m, attrs
        seen.add(int(m.group(1)))
    assert seen == counts, (seen, text)
    markers = re.findall(r"custom_call @mm\.logical_sharding\(.*?mm\.axes = (\[.*?\]\])\}", text)
    assert markers, text
    for a in axes:
        assert a in markers, (markers, text)
    # numerics under mjit equal plain JAX
    out = mm.mjit(prog, devices=DEVICES4)(*args)
    _assert_close(out, _reference(name))


def test_jit():
    _check("jit")


def test_grad():
    _check("grad")
    # the backward task's cotangent gets the logical marker too (transpose of the marker)
    text = _lowered_text(CASES["grad"][0](t), (W, X))
    assert text.count("transpose_count = 1 : i64") == 1


def test_value_and_grad():
    _check("value_and_grad")


def test_vmap():
    _check("vmap")
    text = _lowered_text(CASES["vmap"][0](t), (W, XS))
    assert "tensor<3x8x4xf32>" in text


def test_scan():
    _check("scan")
    text = _lowered_text(CASES["scan"][0](t), (W, XS))
    assert "stablehlo.while" in text


def test_scan_grad():
    prog = jax.grad(lambda w, xs: _scan(t)(w, xs)[0])
    text = _lowered_text(prog, (W, XS))
    counts = {int(c) for c in re.findall(r"transpose_count = (\d+) : i64", text)}
    assert counts == {0, 1}
    out = mm.mjit(prog, devices=DEVICES4)(W, XS)
    with mm.ignore_transforms():
        ref = jax.grad(lambda w, xs: _scan(body)(w, xs)[0])(W, XS)
    _assert_close(out, ref)


def test_checkpoint_inside_task():
    _check("checkpoint_inside")


def test_checkpoint_outside_grad():
    _check("checkpoint_outside")


def test_marker_outside_task():
    """A logical constraint outside any task lowers to the marker with all names kept."""
    text = _lowered_text(lambda x: mm.with_sharding_constraint(x, P(("batch", "model"), None)),
                         (X,))
    assert 'mm.axes = [["batch", "model"], []]' in text
    assert "mm.task" not in text


def test_markers_absent_without_autoshard_or_under_ignore():
    def f(x):
        return mm.with_sharding_constraint(x, P("batch", None)) * 2

    with mm.ignore_transforms():
        assert mm.task(f, mesh=TMESH) is f
        text = jax.jit(f).lower(X).as_text()
    assert "mm.logical_sharding" not in text and "mm.task" not in text


@pytest.mark.parametrize("mode", ["eager", "jax.jit"])
@pytest.mark.parametrize("name", list(CASES))
def test_numerics_outside_mjit(name, mode):
    build, args, _, _ = CASES[name]
    prog = build(t)
    if mode == "jax.jit":
        prog = jax.jit(prog)
    _assert_close(prog(*args), _reference(name))


def test_numerics_outside_mjit_without_marker():
    """Control for the xfail above: a task *without* logical markers runs eagerly / jitted."""
    t2 = mm.task(lambda w, x: jnp.tanh(x @ w), name="plain", mesh=TMESH)
    ref = jnp.tanh(X @ W)
    _assert_close(t2(W, X), ref)
    _assert_close(jax.jit(t2)(W, X), ref)
    g = jax.grad(lambda w, x: t2(w, x).sum())(W, X)
    _assert_close(g, jax.grad(lambda w, x: jnp.tanh(x @ w).sum())(W, X))
