"""The generated dispatch function (issue 40, item 3: per-call host cost).

An ordinary call runs the dispatch program as one straight-line Python function
(``multimesh.runtime.codegen``); traces, timings and memory profiles run the same steps
one by one. Both give plain jax's values and gradients, in the same places, on a
pipelined program with every kind of step (batched copies, reshards, fresh copies of
donated inputs, frees), with and without the run-ahead bound; and a call with a wrong
argument still raises what it raised before, warm or cold.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._stages.call_checks import check_call
from multimesh.runtime import steps

D, M, ROWS = 8, 4, 8


def _stages():
    """Three one-task stages on 2-device submeshes: a (batch-sharded) reshards into b
    (model-sharded), b copies plainly into c (the same layout on other devices)."""
    def by_batch(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

    def by_model(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P(None, "model")) @ w)

    def mesh(devices, axis):
        return mm.TaskMesh(devices=devices, axis_names=(axis,), axis_sizes=(2,))
    return [mm.task(by_batch, name="a", mesh=mesh((0, 1), "x"), logical_axes=(("batch", "x"),)),
            mm.task(by_model, name="b", mesh=mesh((2, 3), "y"), logical_axes=(("model", "y"),)),
            mm.task(by_model, name="c", mesh=mesh((4, 5), "y"), logical_axes=(("model", "y"),))]


def _loss(stages):
    def loss(ws, x):
        for t, w in zip(stages, ws):
            x = t(w, x)
        return (x ** 2).sum()
    return loss


def _sgd(value_and_grad):
    def step(ws, x):
        v, g = value_and_grad(ws, x)
        return [w - 0.1 * gw for w, gw in zip(ws, g)], v, g
    return step


def _inputs(seed=0):
    ws = [jnp.eye(D) * 0.5 + 0.01 * (k + seed) for k in range(3)]
    return ws, jnp.linspace(-1, 1, M * ROWS * D).reshape(M * ROWS, D) + seed


def _interpreted(compiled, *args):
    """One call through the steps' ``run`` (the loop traces and profiles use)."""
    conv, exe = compiled.convention, compiled._exec
    flat = conv.inputs(args, {})
    return conv.results(exe.finish(steps.run_program(exe._runs, exe.start(flat))))


@pytest.mark.parametrize("run_ahead", [2, None])
def test_generated_and_interpreted_runs_equal_plain_jax(run_ahead):
    """1F1B SGD step over reshards, batched copies and donated inputs (one freed after
    its last reader, since not every call of its fragment can donate it)."""
    step = _sgd(mm.microbatch(jax.value_and_grad(_loss(_stages())), dim=0, size=ROWS,
                              argnum=1, schedule="1f1b"))
    compiled = mm.mjit(step, donate_argnums=(0, 1)).lower(*_inputs()).compile()
    compiled.run_ahead = run_ahead
    kinds = {type(s) for s in compiled._exec.program}
    assert {steps.FragmentCall, steps.BatchedCopy, steps.Move, steps.Free} <= kinds, kinds
    source = compiled._exec.dispatch_function().source
    assert ("_wait" in source) == (run_ahead is not None)
    plain = jax.jit(_sgd(jax.value_and_grad(_loss([lambda w, x: jnp.tanh(x @ w)] * 3))))
    for seed in range(2):  # the second call runs warm (C++ dispatch, remembered types)
        want = jax.tree.leaves(plain(*_inputs(seed)))
        generated = jax.tree.leaves(compiled(*_inputs(seed)))
        interpreted = jax.tree.leaves(_interpreted(compiled, *_inputs(seed)))
        for got in (generated, interpreted):
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
            for g, sh in zip(got, jax.tree.leaves(compiled.output_shardings), strict=True):
                assert g.sharding == sh
        assert [a.sharding for a in generated] == [a.sharding for a in interpreted]
        new_ws, grads = generated[:3], generated[4:]
        for k, (w, g) in enumerate(zip(new_ws, grads)):  # stage k's devices
            assert sorted(d.id for d in w.devices()) == [2 * k, 2 * k + 1]
            assert sorted(d.id for d in g.devices()) == [2 * k, 2 * k + 1]


def test_a_donated_input_moved_onto_its_own_devices_gets_fresh_buffers():
    """The fresh copy (a donated input also moved onto devices it lives on) in the
    generated function: the donation never eats the moved value."""
    m0 = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
    t0 = mm.task(lambda a, b: a * 2 + b, name="t0", mesh=m0)
    tall = mm.task(lambda a: a + 1, name="tall",
                   mesh=mm.TaskMesh(devices=range(8), axis_names=("x",), axis_sizes=(8,)))
    f = mm.mjit(lambda w, x: (t0(w, x), tall(w)), donate_argnums=0)
    compiled = f.lower(jnp.ones(8), jnp.ones(8)).compile()
    assert steps.FreshCopy in {type(s) for s in compiled._exec.program}
    for i in range(3):
        w = jax.device_put(jnp.arange(8.0) + i, compiled.input_shardings[0][0])
        a, b = compiled(w, jnp.ones(8))
        np.testing.assert_array_equal(a, (np.arange(8.0) + i) * 2 + 1)
        np.testing.assert_array_equal(b, np.arange(8.0) + i + 1)
        assert sorted(d.id for d in a.devices()) == [0, 1, 2, 3]
        assert sorted(d.id for d in b.devices()) == list(range(8))
        assert w.is_deleted()


def _message(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


def test_wrong_arguments_raise_the_same_errors_warm_or_cold():
    """A compiled program that has run (its types remembered) raises the same errors as
    a fresh one: wrong shape, wrong dtype, a NumPy array, a deleted array, one array
    donated twice."""
    loss = _loss(_stages())
    ws, x = _inputs()

    def build():
        return mm.mjit(jax.value_and_grad(loss), donate_argnums=(0,)).lower(ws, x).compile()
    warm, cold = build(), build()
    for _ in range(2):
        warm([w.copy() for w in ws], x)
    dead = x.copy()
    dead.delete()
    bad = {
        "shape": lambda f: f([w.copy() for w in ws], x[:8]),
        "dtype": lambda f: f([w.copy() for w in ws], x.astype(jnp.int32)),
        "numpy": lambda f: f([w.copy() for w in ws], np.zeros((3, D), np.float32)),
        "leaf": lambda f: f([w.copy() for w in ws[:2]] + [ws[2][:4]], x),
        "deleted": lambda f: f([w.copy() for w in ws], dead),
        "twice": lambda f: f([ws[0]] * 3, x),
    }
    for what, call in bad.items():
        assert _message(partial(call, warm)) == _message(partial(call, cold)), what
    assert re.match(r"MultimeshTypeError: Compiled function called with args\[1\] of type "
                    r"float32\[8,8\], but it was compiled for float32\[32,8\]",
                    _message(lambda: bad["shape"](warm)))
    assert _message(lambda: bad["deleted"](warm)).startswith(
        "DonationError: Compiled function called with args[1] of type float32[32,8], "
        "an array that has been deleted")
    assert "is donated (`donate_argnums`) and args[0][1] is donated as well" in \
        _message(lambda: bad["twice"](warm))
    # nothing was dispatched: the arguments the errors named are live
    assert not ws[0].is_deleted() and not x.is_deleted()
    value, _ = warm([w.copy() for w in ws], x)
    np.testing.assert_allclose(value, cold([w.copy() for w in ws], x)[0], rtol=1e-6)


def test_check_call_remembers_only_what_passed():
    """``seen`` holds the types of the last call that passed; a failing call, or one
    with a leaf that is not a jax.Array, is checked in full every time."""
    x = jnp.ones((2, 3))
    tree = jax.tree.structure(((x,), {}))
    avals = (jax.core.ShapedArray((2, 3), jnp.float32),)
    seen: list = [None]
    assert check_call(tree, avals, (x,), {}, seen)[0] is x
    assert seen[0] == (jax.config.read("jax_enable_x64"), x.aval)
    remembered = seen[0]
    y = jnp.ones((3, 2))
    with pytest.raises(MultimeshTypeError, match=r"args\[0\] of type float32\[3,2\]"):
        check_call(tree, avals, (y,), {}, seen)
    assert seen[0] is remembered
    with pytest.raises(MultimeshTypeError, match=r"args\[0\] of type int32\[2,3\]"):
        check_call(tree, avals, (np.ones((2, 3), np.int32),), {}, seen)
    check_call(tree, avals, (np.ones((2, 3), np.float32),), {}, seen)  # passes, in full
    assert seen[0] != (jax.config.read("jax_enable_x64"), x.aval)
    with pytest.raises(MultimeshValueError, match="arguments of structure"):
        check_call(tree, avals, (x, x), {}, seen)


def test_the_generated_function_runs_each_step_once_in_order():
    """Each step writes its lines in program order: one call per fragment call, one
    batched copy per batch, and a ``del`` for each value a step drops."""
    step = mm.microbatch(jax.value_and_grad(_loss(_stages())), dim=0, size=ROWS, argnum=1,
                         schedule="1f1b")
    compiled = mm.mjit(step).lower(*_inputs()).compile()
    compiled.run_ahead = None
    exe = compiled._exec
    source = exe.dispatch_function().source
    program = exe.program
    calls = [s for s in program if isinstance(s, steps.FragmentCall)]
    lines = source.splitlines()
    call_lines = [ln for ln in lines if re.search(r"= _call\d+\(", ln)]
    assert len(call_lines) == len(calls)
    assert sum(ln.count("_batched_copy") for ln in lines) == sum(
        isinstance(s, steps.BatchedCopy) for s in program)
    dropped = [v for ln in lines if ln.strip().startswith("del ")
               for v in re.findall(r"\bv(\d+)\b", ln)]
    assert sorted(map(int, dropped)) == sorted(v for s in program for v in s.drop)


def test_a_training_loop_passes_its_outputs_back_without_moving_them(monkeypatch):
    """A step's outputs carry the input shardings of the next step (the same objects
    since the fragments' layout shardings are cached): they are where the program wants
    them, so no input is moved for them (a move that changes nothing costs ~10 µs of
    host time per array). Values match plain jax's SGD loop; the batch, a host array,
    is placed every step."""
    moved: list = []
    real = steps.place

    def place(x, sharding):
        moved.append(x)
        return real(x, sharding)
    monkeypatch.setattr(steps, "place", place)
    step = _sgd(mm.microbatch(jax.value_and_grad(_loss(_stages())), dim=0, size=ROWS,
                              argnum=1, schedule="1f1b"))
    compiled = mm.mjit(step, donate_argnums=(0,)).lower(*_inputs()).compile()
    plain = jax.jit(_sgd(jax.value_and_grad(_loss([lambda w, x: jnp.tanh(x @ w)] * 3))))
    ws, x = _inputs()
    want_ws = _inputs()[0]  # ws are donated
    counts = []
    for _ in range(3):
        moved.clear()
        ws, value, _ = compiled(ws, x)
        counts.append(len(moved))
        want_ws, want_value, _ = plain(want_ws, x)
        np.testing.assert_allclose(value, want_value, rtol=1e-5)
        for w, r, sh in zip(ws, want_ws, compiled.input_shardings[0][0]):
            np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)
            assert w.sharding == sh
    assert counts == [4, 1, 1]
    # equal shardings of the caller's own (not the program's objects) move nothing either
    own = [jax.device_put(np.asarray(w), NamedSharding(
               Mesh(sh.mesh.devices, sh.mesh.axis_names), sh.spec))
           for w, sh in zip(ws, compiled.input_shardings[0][0])]
    assert all(w.sharding == sh and w.sharding is not sh
               for w, sh in zip(own, compiled.input_shardings[0][0]))
    moved.clear()
    compiled(own, x)
    assert len(moved) == 1


def test_mjit_keys_each_call_by_its_own_types():
    """The `mjit` function remembers its last call's leaf types (by the leaves' avals):
    calls that alternate shapes, dtypes and kinds of leaves each run the program
    compiled for their own types, with plain jax's values."""
    mesh = mm.TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,))
    t = mm.task(lambda a, b: a * 2 + b, name="t", mesh=mesh)
    f = mm.mjit(lambda a, b: t(a, b) + 1)
    calls = [(jnp.arange(4.0), jnp.ones(4)), (jnp.arange(8.0), jnp.ones(8)),
             (jnp.arange(4.0), jnp.ones(4)), (np.arange(8.0, dtype=np.float32), jnp.ones(8)),
             (jnp.arange(4), jnp.ones(4, jnp.int32)), (jnp.arange(4.0), 1.0)]
    for a, b in calls * 2:
        out = f(a, b)
        want = np.asarray(a) * 2 + np.asarray(b) + 1
        np.testing.assert_array_equal(out, want)
        assert out.dtype == jnp.result_type(a, b) and sorted(d.id for d in out.devices()) == [0]
    fed = jnp.arange(4.0)
    for _ in range(3):  # outputs passed back: the same avals, step after step
        fed = f(fed, jnp.ones(4))
    np.testing.assert_array_equal(fed, ((np.arange(4.0) * 2 + 2) * 2 + 2) * 2 + 2)
