"""``multimesh.jax.task`` on Flax modules runs them as ``multimesh.jax.flax.task`` does.

A plain function wrapper would hide an NNX layer's parameters from ``nnx.state`` (the
optimizer never updates them) and fail on a linen class deep inside flax; a function
task called with NNX objects would drop their updates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax import flax as mmf  # noqa: E402
from tests.models import nnx_train_step  # noqa: E402

X = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)


def _ids(a):
    return sorted(d.id for d in a.devices())


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.l(x))


class Two(nnx.Module):
    def __init__(self, rngs, tasks=True):
        a, b = Layer(rngs), Layer(rngs)
        if tasks:
            a = mm.task(a, "a", mesh=mm.TaskMesh(devices=range(4)))
            b = mm.task(b, "b", mesh=mm.TaskMesh(devices=range(4, 8)))
        self.ls = nnx.List([a, b])

    def __call__(self, x):
        for layer in self.ls:
            x = layer(x)
        return jnp.mean(x ** 2)


def test_core_task_of_an_nnx_module_keeps_its_parameters_trained():
    model = Two(nnx.Rngs(0))
    ref = Two(nnx.Rngs(0), tasks=False)
    paths = sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model)))
    want = sorted("/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(ref)))
    assert paths == want == ["ls/0/l/bias", "ls/0/l/kernel", "ls/1/l/bias", "ls/1/l/kernel"]
    assert isinstance(model.ls[0], Layer) and isinstance(model.ls[0], mmf.TaskModule)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    step = mm.mjit(nnx_train_step)
    losses = [float(step(model, opt, X)) for _ in range(2)]
    ref_losses = [float(nnx.jit(nnx_train_step)(ref, ref_opt, X)) for _ in range(2)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (_, got), (_, exp) in zip(nnx.to_flat_state(nnx.state(model)),
                                  nnx.to_flat_state(nnx.state(ref))):
        np.testing.assert_allclose(got.get_value(), exp.get_value(), rtol=1e-5, atol=1e-6)
    assert _ids(model.ls[0].l.kernel.get_value()) == [0, 1, 2, 3]
    assert _ids(model.ls[1].l.kernel.get_value()) == [4, 5, 6, 7]


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4)(x))


class LinenTwo(nn.Module):
    @nn.compact
    def __call__(self, x):
        a = mm.task(Dense, "a", mesh=mm.TaskMesh(devices=range(4)))
        b = mm.task(Dense, "b", mesh=mm.TaskMesh(devices=range(4, 8)))
        h = a()(x)
        return jnp.mean(b()(h) ** 2)


class LinenPlain(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = Dense()(x)
        return jnp.mean(Dense()(h) ** 2)


def test_core_task_of_a_linen_class_is_the_flax_task():
    wrapped = mm.task(Dense, "d", mesh=mm.TaskMesh(devices=range(4)))
    assert isinstance(wrapped, type) and issubclass(wrapped, nn.Module)
    model = LinenTwo()
    variables = model.init(jax.random.key(0), X)
    loss, grads = mm.mjit(jax.value_and_grad(model.apply))(variables, X)
    inner = [variables["params"][f"Task[Dense]_{i}"]["mod"]["params"] for i in range(2)]
    plain = {"params": {f"Dense_{i}": inner[i] for i in range(2)}}
    ref_loss, ref_grads = jax.value_and_grad(LinenPlain().apply)(plain, X)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for i in range(2):
        g = grads["params"][f"Task[Dense]_{i}"]["mod"]["params"]["Dense_0"]["kernel"]
        np.testing.assert_allclose(g, ref_grads["params"][f"Dense_{i}"]["Dense_0"]["kernel"],
                                   rtol=1e-5, atol=1e-6)
        assert _ids(g) == list(range(4 * i, 4 * i + 4))


class Counter(nnx.Module):
    def __init__(self):
        self.n = nnx.BatchStat(jnp.zeros(()))
        self.w = nnx.Param(jnp.ones((4,)))

    def __call__(self, x):
        self.n[...] = self.n[...] + 1
        return x * self.w[...]


def test_core_task_of_a_function_writes_nnx_updates_back():
    t = mm.task(lambda m, x: m(x), "t", mesh=mm.TaskMesh(devices=[1]))
    m = Counter()
    out = mm.mjit(lambda m, x: jnp.sum(t(m, x)))(m, X)
    np.testing.assert_allclose(float(out), float(jnp.sum(X)), rtol=1e-6)
    assert float(m.n[...]) == 1.0
    assert _ids(m.n[...]) == [1]


def test_core_task_of_an_nnx_class_names_the_fix():
    with pytest.raises(TypeError, match=r"task\(Layer\(\.\.\.\), \.\.\.\)"):
        mm.task(Layer, "x")


def test_core_task_leaves_plain_functions_plain():
    f = mm.task(lambda x: x + 1, "f", mesh=mm.TaskMesh(devices=[2]))
    y = mm.mjit(lambda x: f(x) * 2)(X)
    np.testing.assert_allclose(y, (X + 1) * 2)
    assert f.mm_task.name == "f"
    assert mmf.task is not mm.task  # the flax one stays the documented entry point
