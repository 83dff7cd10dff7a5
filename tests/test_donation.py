"""Donated and deleted inputs: errors instead of crashes, and donation never eats a live value.

XLA segfaults on a multi-device execution given a deleted buffer, or one buffer both
donated and read (plain ``jax.jit`` does too), so the risky calls run in a child
process: a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.errors import DonationError, MultimeshError
from tests.tools import run_child

_PRELUDE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
import multimesh.jax as mm
from multimesh._src.errors import DonationError

m0 = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
t0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="t0", mesh=m0)
t1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="t1", mesh=m0.place(range(4, 8)))

def loss(ws, x):
    return (t1(ws[1], t0(ws[0], x)) ** 2).sum()

def plain_loss(ws, x):
    return (jnp.tanh(jnp.tanh(x @ ws[0]) @ ws[1]) ** 2).sum()

def sgd(loss):
    def step(ws, x):
        v, g = jax.value_and_grad(loss)(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], v
    return step

def fresh():
    k = jax.random.split(jax.random.key(0), 3)
    return ([jax.random.normal(k[0], (16, 16)) / 4, jax.random.normal(k[1], (16, 16)) / 4],
            jax.random.normal(k[2], (8, 16)))

def expect(exc, fn, *needles):
    try:
        fn()
    except exc as e:
        for n in needles:
            assert n in str(e), (n, str(e))
        return str(e)
    raise AssertionError(f"{fn} did not raise {exc.__name__}")
"""


def _run_child(body: str) -> str:
    return run_child(_PRELUDE + textwrap.dedent(body))


def test_calling_again_with_a_donated_input_raises_in_a_child():
    """Item 1: a stale, donated input gets a clear error, warm or cold, traced or not."""
    _run_child("""
    step = mm.mjit(sgd(loss), donate_argnums=0)
    ref_step = jax.jit(sgd(plain_loss))
    ws, x = fresh()
    ref_ws, _ = fresh()
    for i in range(3):  # warm every fragment (jax's C++ dispatch path)
        old = ws
        ws, v = step(ws, x)
        ref_ws, ref_v = ref_step(ref_ws, x)
        np.testing.assert_allclose(v, ref_v, rtol=1e-5)
        if i:  # from the second step on, the parameters already sit where they are donated
            assert all(w.is_deleted() for w in old)
    for w, r in zip(ws, ref_ws):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)
    assert sorted(d.id for d in ws[0].devices()) == [0, 1, 2, 3]
    assert sorted(d.id for d in ws[1].devices()) == [4, 5, 6, 7]
    msg = expect(DonationError, lambda: step(old, x), "args[0][0]", "float32[16,16]",
                 "has been deleted", "donate_argnums")
    assert isinstance(DonationError(msg), ValueError)
    compiled = step.lower(ws, x).compile()
    expect(DonationError, lambda: compiled(old, x), "args[0][0]")
    expect(DonationError, lambda: compiled.profile(old, x), "args[0][0]")
    # a deleted array that is not donated is caught too
    dead = jnp.ones((8, 16)); dead.delete()
    expect(DonationError, lambda: step(ws, dead), "args[1]")
    # nothing was dispatched: the live parameters still work and match plain jax
    ws, v = step(ws, x)
    ref_ws, ref_v = ref_step(ref_ws, x)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    """)


def test_one_array_donated_and_read_raises_in_a_child():
    """Item 2: the same array as a donated and a non-donated argument (or donated twice)."""
    _run_child("""
    add = mm.task(lambda a, b: a * 2 + b, name="add", mesh=m0)
    inc = mm.task(lambda a: a + 1, name="inc", mesh=m0.place(range(4, 8)))
    f = mm.mjit(lambda a, b: inc(add(a, b)), donate_argnums=(0,))
    w = jnp.arange(8.0)
    expect(DonationError, lambda: f(w, w), "args[0] and args[1]", "args[1] is not donated")
    assert not w.is_deleted()
    f2 = mm.mjit(lambda a, b: inc(add(a, b)), donate_argnums=(0, 1))
    expect(DonationError, lambda: f2(w, w), "donated as well")
    # placed exactly where the program wants it (no move at entry): still caught
    sh = f.lower(w, w).compile().input_shardings[0]
    p = jax.device_put(w, sh[0])
    expect(DonationError, lambda: f(p, p), "args[0] and args[1]")
    out = f(w, jnp.ones(8))  # distinct arrays are fine, and match plain jax
    np.testing.assert_allclose(out, np.arange(8.0) * 2 + 2)
    assert sorted(d.id for d in out.devices()) == [4, 5, 6, 7]
    assert w.is_deleted()
    """)


def _two_stage():
    m0 = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
    mall = mm.TaskMesh(devices=range(8), axis_names=("x",), axis_sizes=(8,))
    t0 = mm.task(lambda a, b: a * 2 + b, name="t0", mesh=m0)
    tall = mm.task(lambda a: a + 1, name="tall", mesh=mall)
    return t0, tall


def test_donated_input_that_is_also_an_output_survives():
    """A donated input the program returns unchanged is the output, so it is not donated."""
    t0, _ = _two_stage()
    f = mm.mjit(lambda w, x: (w, t0(w, x)), donate_argnums=0)
    w, x = jnp.arange(8.0), jnp.ones(8)
    for _ in range(2):
        same, y = f(w, x)
        np.testing.assert_array_equal(same, np.arange(8.0))
        np.testing.assert_array_equal(y, np.arange(8.0) * 2 + 1)
        w = same


def test_donated_input_moved_onto_overlapping_devices_is_copied():
    """A transfer of a donated input onto devices it lives on must not share its buffers.

    `w` lives on devices 0-3 for `t0` (which donates it at its last use) and is moved onto
    0-7 for `tall` first; a reused buffer would be deleted under `tall`.
    """
    t0, tall = _two_stage()

    def fn(w, x):
        return t0(w, x), tall(w)

    f = mm.mjit(fn, donate_argnums=0)
    compiled = f.lower(jnp.ones(8), jnp.ones(8)).compile()
    assert compiled.transfers and compiled.transfers[0].src == 0
    ref = jax.jit(lambda w, x: (w * 2 + x, w + 1))
    for i in range(3):
        w = jax.device_put(jnp.arange(8.0) + i, compiled.input_shardings[0][0])
        a, b = f(w, jnp.ones(8))
        ra, rb = ref(jnp.arange(8.0) + i, jnp.ones(8))
        np.testing.assert_array_equal(a, ra)
        np.testing.assert_array_equal(b, rb)
        assert sorted(d.id for d in a.devices()) == [0, 1, 2, 3]
        assert sorted(d.id for d in b.devices()) == list(range(8))
        assert w.is_deleted()


def test_donation_error_is_a_multimesh_value_error():
    assert issubclass(DonationError, MultimeshError)
    assert issubclass(DonationError, ValueError)


@pytest.mark.parametrize("n_leaves", [1, 64])
def test_entry_checks_do_not_reject_live_arguments(n_leaves):
    f = mm.mjit(lambda xs: [x + 1 for x in xs], donate_argnums=0)
    xs = [jnp.full(4, float(i)) for i in range(n_leaves)]
    out = f(xs)
    assert [float(o[0]) for o in out] == [i + 1.0 for i in range(n_leaves)]
    assert jax.tree.leaves(out)[0].shape == (4,)
