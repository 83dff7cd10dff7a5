"""``microbatch(..., reduction=)`` and what each output dtype becomes (issue 20).

``"sum"`` (the default, MultiMesh's semantics) adds the microbatches' outputs;
``"mean"`` must give exactly plain jax's full-batch mean loss and gradients, placed
like the sum's, with the same fragments. Bools are or-ed, integers summed in their
own dtype (never averaged), other dtypes keep theirs.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from tests.models import DenseBlocks


def _mesh(k: int) -> mm.TaskMesh:
    return mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))


def _explicit():
    """Two explicit tasks; a mean loss. Returns ``(loss, params, stage of each param)``."""
    def body(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

    tasks = [mm.task(body, name=f"s{k}", mesh=_mesh(k), logical_axes=(("batch", "x"),))
             for k in range(2)]

    def loss(ws, x):
        for t, w in zip(tasks, ws):
            x = t(w, x)
        return jnp.mean(x ** 2)

    ws = [jnp.eye(16) * 0.5 + 0.01 * jnp.arange(16.0), jnp.eye(16) * 0.7]
    return loss, ws, [0, 1]


def _registered_callback(name, backprop):
    k = int(name.split("_")[1])
    return mm.Task(name=f"{name}_{'bwd' if backprop else 'fwd'}", mesh=_mesh(k))


def _batch():
    return jnp.sin(jnp.arange(32 * 16.0)).reshape(32, 16)


def _close(got, want):
    """1e-6 relative: per value, against the size of the array it belongs to."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * float(np.abs(w).max()))


def _stage_of_block(path) -> int:
    return int(jax.tree_util.keystr(path).split("block_")[1][0])


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_mean_is_the_full_batch_mean_with_explicit_tasks(schedule):
    loss, ws, stage = _explicit()
    x = _batch()
    with mm.ignore_transforms():
        want = jax.jit(jax.value_and_grad(loss))(ws, x)
    compiled = {}
    for reduction in ("sum", "mean"):
        f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1,
                          schedule=schedule, reduction=reduction)
        compiled[reduction] = mm.mjit(f).lower(ws, x).compile()
    value, grads = compiled["mean"](ws, x)
    _close((value, grads), want)
    for k, g in enumerate(grads):
        assert sorted(d.id for d in g.devices()) == list(range(4 * stage[k], 4 * stage[k] + 4))
    # the sum is M times the mean (MultiMesh's semantics)
    np.testing.assert_allclose(compiled["sum"](ws, x)[0], 4 * want[0], rtol=1e-5)
    # dividing inside the loop adds no fragment
    names = {r: sorted(fr["name"] for fr in c.fragments) for r, c in compiled.items()}
    assert names["mean"] == names["sum"]


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble-h2"])
def test_mean_is_the_full_batch_mean_with_registered_tasks(schedule):
    model = DenseBlocks()
    x = _batch()
    params = model.init(jax.random.key(0), x[:8])
    step = mm.microbatch(jax.value_and_grad(model.apply), dim=0, size=8, argnum=1,
                         schedule=schedule, reduction="mean")
    with mm.Context() as ctx:
        ctx.register_task(r"(block_\d+)", callback=_registered_callback)
        value, grads = mm.mjit(step)(params, x)
    _close((value, grads), jax.jit(jax.value_and_grad(model.apply))(params, x))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        k = _stage_of_block(path)
        assert sorted(d.id for d in g.devices()) == list(range(4 * k, 4 * k + 4))


def test_mean_under_plain_jax_and_with_one_microbatch():
    loss, ws, _ = _explicit()
    x = _batch()
    with mm.ignore_transforms():
        want = jax.value_and_grad(loss)(ws, x)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, reduction="mean")
    _close(jax.jit(f)(ws, x), want)  # the loop as an ordinary fori_loop
    one = mm.microbatch(jax.value_and_grad(loss), dim=0, size=32, argnum=1, reduction="mean")
    _close(mm.mjit(one)(ws, x), want)


def _mixed(x):
    """Per microbatch outputs of every kind; the microbatches disagree on the bools."""
    a = mm.task(lambda x: x * 2, name="a", mesh=_mesh(0))
    b = mm.task(lambda x: x > 0, name="b", mesh=_mesh(1))
    pos = b(a(x))
    return {"rows": pos, "any": jnp.any(pos), "all": jnp.all(pos), "const": True,
            "count": jnp.sum(pos), "i8": jnp.sum(pos, dtype=jnp.int8) * jnp.int8(50),
            "c64": jnp.sum(x).astype(jnp.complex64) * (1 + 2j),
            "bf16": jnp.sum(x).astype(jnp.bfloat16), "three": 3}


def test_dtypes_under_sum():
    x = jnp.array([[1.0], [2.0], [-1.0], [3.0], [-2.0], [-3.0], [4.0], [-5.0]])
    out = mm.mjit(mm.microbatch(_mixed, dim=0, size=2))(x)
    with mm.ignore_transforms():
        parts = [_mixed(x[2 * m:2 * m + 2]) for m in range(4)]
    for key in ("rows", "any", "all"):  # bools: or, as jnp.add does
        assert out[key].dtype == jnp.bool_
        np.testing.assert_array_equal(out[key], functools.reduce(operator.or_,
                                                                 [p[key] for p in parts]))
    assert out["const"].dtype == jnp.bool_ and bool(out["const"])  # not a count of 4
    assert out["count"].dtype == jnp.int32 and int(out["count"]) == 4
    # int8 summed in int8: 4 microbatches x 50 x (2, 1, 0, 1) wraps like jnp's int8 sum
    assert out["i8"].dtype == jnp.int8
    assert int(out["i8"]) == int(sum((p["i8"] for p in parts), jnp.int8(0)))
    assert int(out["three"]) == 12
    np.testing.assert_allclose(out["c64"], sum(p["c64"] for p in parts), rtol=1e-6)
    assert out["c64"].dtype == jnp.complex64 and out["bf16"].dtype == jnp.bfloat16
    assert sorted(d.id for d in out["rows"].devices()) == [4, 5, 6, 7]


def test_dtypes_under_mean_and_integers_refused():
    x = jnp.array([[1.0], [2.0], [-1.0], [3.0], [-2.0], [-3.0], [4.0], [-5.0]])

    def floats(x):
        return {k: v for k, v in _mixed(x).items() if k not in ("count", "i8", "three")}

    out = mm.mjit(mm.microbatch(floats, dim=0, size=2, reduction="mean"))(x)
    with mm.ignore_transforms():
        parts = [floats(x[2 * m:2 * m + 2]) for m in range(4)]
    np.testing.assert_array_equal(out["rows"], functools.reduce(operator.or_,
                                                                [p["rows"] for p in parts]))
    assert out["const"].dtype == jnp.bool_ and bool(out["const"])
    np.testing.assert_allclose(out["c64"], jnp.sum(x) * (1 + 2j) / 4, rtol=1e-6)
    assert out["c64"].dtype == jnp.complex64 and out["bf16"].dtype == jnp.bfloat16
    np.testing.assert_allclose(float(out["bf16"]), float(jnp.sum(x)) / 4, rtol=1e-2)
    for size in (2, 8):  # the loop, and one microbatch (a plain call): the same rule
        with pytest.raises(MultimeshTypeError, match=r"cannot average the integer output "
                                                     r"\['count'\] \(dtype int32\)"):
            mm.mjit(mm.microbatch(_mixed, dim=0, size=size, reduction="mean"))(x)


def test_reduction_is_checked_when_microbatch_is_called():
    for bad in ("avg", "Mean", None, 1):
        with pytest.raises(MultimeshValueError, match=r"`microbatch` reduction must be one "
                                                      r"of 'sum', 'mean', got"):
            mm.microbatch(jnp.sum, dim=0, size=2, reduction=bad)


def test_an_empty_batch_and_a_cut_of_the_parameters_name_microbatch():
    loss, ws, _ = _explicit()
    g = jax.value_and_grad(loss)
    with pytest.raises(MultimeshValueError, match=r"`microbatch` got an empty batch: argument 1 "
                                                  r"has size 0 along dim 0"):
        mm.mjit(mm.microbatch(g, dim=0, size=8, argnum=1))(ws, jnp.ones((0, 16)))
    # argnum=0 cuts the weights: they divide, but the function then fails on a piece
    with pytest.raises(MultimeshValueError, match=r"(?s)runs on the whole of argument 0 but "
                                                  r"fails on one microbatch of it.*"
                                                  r"dot_general.*Is argument 0 the batch\?"):
        mm.mjit(mm.microbatch(g, dim=0, size=8, argnum=0))(ws, _batch())
    with pytest.raises(MultimeshValueError, match=r"same size along dim 0, got sizes \[16, 1\]"
                                                  r"\. Is argument 0 the batch\?"):
        mm.mjit(mm.microbatch(lambda p, x: x.sum(), dim=0, size=8, argnum=0))(
            [ws[0], jnp.ones((1, 16))], _batch())
    # a genuine error of the function (it fails on the whole batch too) is jax's own
    with pytest.raises(TypeError, match="dot_general"):
        mm.mjit(mm.microbatch(lambda w, x: (x @ w[:3]).sum(), dim=0, size=8, argnum=1))(
            ws[0], _batch())
