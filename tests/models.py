"""The anchor's E1/E2 programs (``spmd-autosharding``, ``mpmd-autosharding``) and small
programs several test files run, shared by the tests that run them. ``examples/demo.py`` keeps its own copy so that it reads on its
own, and tests/test_anchor_tutorials.py keeps the anchor's text verbatim (parity)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax import with_sharding_constraint as wsc

LOGICAL = (("batch", "x"), ("model", "x"))


def f(param, x):
    return jnp.einsum("bm,mh->bh", x, param)


def get_input_batch():
    return jnp.arange(64).reshape(8, 8)


def init_params():
    return (jnp.arange(64).reshape(8, 8), jnp.arange(64).reshape(8, 8))


def _two_layers(layer1, layer2, params, x):
    """E1/E2's body: the inputs, weights and output constrained by logical names."""
    p1, p2 = params
    x = wsc(x, P("batch", None))
    p1 = wsc(p1, P("model", None))
    p2 = wsc(p2, P(None, "model"))
    return wsc(layer2(p2, layer1(p1, x)), P("batch", None))


def e1_model(params, x):
    """E1's body: both layers in one function (a task over all devices, or none)."""
    return _two_layers(f, f, params, x)


def e2_model():
    """E2: ``layer1`` on devices 0-3 and ``layer2`` on 4-7, one logical->physical map."""
    task_mesh = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    layer1 = mm.task(f, name="layer1", mesh=task_mesh, logical_axes=LOGICAL)
    layer2 = mm.task(f, name="layer2", mesh=task_mesh.place((4, 5, 6, 7)), logical_axes=LOGICAL)

    def model(params, x):
        return _two_layers(layer1, layer2, params, x)

    return model


def tanh_chain(stages: int, meshes: int | None = None):
    """``stages`` tanh-matmul tasks over a 16-wide batch, stage ``k`` on submesh
    ``k % meshes`` (8 devices split evenly; ``meshes`` defaults to ``stages``).
    Returns ``(loss, ws, devices per submesh)``."""
    meshes = meshes or stages
    per = 8 // meshes

    def mk(k):
        def body(w, x):
            return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

        m = k % meshes
        mesh = mm.TaskMesh(devices=range(per * m, per * m + per), axis_names=("x",),
                           axis_sizes=(per,))
        return mm.task(body, name=f"s{k}", mesh=mesh, logical_axes=(("batch", "x"),))

    tasks = [mk(k) for k in range(stages)]

    def loss(ws, x):
        for t, w in zip(tasks, ws):
            x = t(w, x)
        return (x ** 2).sum()

    ws = [jnp.eye(16) * 0.5 + 0.01 * k for k in range(stages)]
    return loss, ws, per


def recomputable_program():
    """Two tasks on submeshes 0-3 and 4-7 where the second reads a cheap value rooted at
    a program input (``enable_recomputation`` recomputes it rather than moving it).
    Returns ``(f, w, x, plain jax's f(w, w, x))``."""
    def mesh(k):
        return mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))

    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="r0", mesh=mesh(0))
    s1 = mm.task(lambda w, y, m, x: jnp.tanh((y * m + x) @ w), name="r1", mesh=mesh(1))

    def f(w0, w1, x):
        m = jnp.tanh(x) * 2.0 + 1.0  # cheap and rooted at a program input
        return s1(w1, s0(w0, m), m, x)

    w, x = jnp.eye(16) * 0.5, jnp.linspace(0, 1, 128).reshape(8, 16)
    with mm.ignore_transforms():
        want = f(w, w, x)
    return f, w, x, want


def layer_stack(w, x):
    """``w[0]``, ``w[1]``, ...: one tanh-matmul layer each (a stage of several layers)."""
    for i in range(w.shape[0]):
        x = jnp.tanh(x @ w[i])
    return x


def mean_square_loss(stages):
    """The loss of ``stages`` (functions of ``(w, x)``) run in order on ``ws[k]``."""
    def loss(ws, x):
        for k, stage in enumerate(stages):
            x = stage(ws[k], x)
        return (x ** 2).mean()
    return loss


class DenseBlocks(nn.Module):
    """``layers`` tanh(Dense(width)) blocks named ``block_0``, ``block_1``, ... (the names
    registered tasks match), then the mean square: a linen model to pipeline."""

    layers: int = 2
    width: int = 16

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = jnp.tanh(nn.Dense(self.width, name=f"block_{i}")(x))
        return (x ** 2).mean()


def block_per_submesh(name: str, backprop: bool) -> mm.Task:
    """A ``register_task`` callback: ``block_i`` runs on devices 4i..4i+3, its forward
    and backward named ``block_i_fwd`` and ``block_i_bwd``."""
    i = int(name.split("_")[1])
    return mm.Task(name=f"{name}_{'bwd' if backprop else 'fwd'}",
                   mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + 4)))


def named_tanh_layers(ws, x):
    """``tanh(x @ ws[0])`` under the named scope ``layer0``, then ``ws[1]`` under
    ``layer1``: the scopes registered tasks and the planner match."""
    with jax.named_scope("layer0"):
        x = jnp.tanh(x @ ws[0])
    with jax.named_scope("layer1"):
        x = jnp.tanh(x @ ws[1])
    return x


def nnx_train_step(model, optimizer, x):
    """One optimizer step of an NNX model whose call returns its loss (in place, as NNX
    does); returns the loss."""
    from flax import nnx

    loss, grads = nnx.value_and_grad(lambda m: m(x))(model)
    optimizer.update(model, grads)
    return loss


LOGICAL_RULES = (("batch", "data"), ("mlp", "model"), ("embed", None))
"""flax's logical rules for :class:`LogicalBlock` on a ``("data", "model")`` mesh."""


class LogicalBlock(nn.Module):
    """An MLP block sharded the flax way: logical partitioning and constraints."""

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        init = nn.initializers.normal(0.3)
        h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
        out = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)
        return x + out
