"""The anchor's E1/E2 programs (``spmd-autosharding``, ``mpmd-autosharding``) and small
programs several test files run, shared by the tests that run them. ``examples/demo.py`` keeps its own copy so that it reads on its
own, and tests/test_anchor_tutorials.py keeps the anchor's text verbatim (parity)."""

from __future__ import annotations

import contextlib

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

    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        x = nn.with_logical_constraint(x, ("batch", "embed"))
        init = nn.initializers.normal(0.3)
        h = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
        out = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(h)
        return x + out


def nnx_sharded(make):
    """The NNX model ``make(nnx.Rngs(0))`` built as flax's guide builds it: inside
    ``nnx.jit``, its state constrained to its partition metadata (call under
    ``jax.set_mesh``)."""
    from flax import nnx

    @nnx.jit
    def create():
        model = make(nnx.Rngs(0))
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    return create()


def nnx_mlp(l0_axes, l1_axes, *, constrain_input: bool = False, returns_loss: bool = True):
    """An NNX MLP 16 -> 64 -> 16 (``l0``, ``l1``) whose kernels carry the partition
    metadata ``l0_axes`` and ``l1_axes``, built by :func:`nnx_sharded` (call under
    ``jax.set_mesh``). Its call returns the mean square of its output (its loss) or,
    with ``returns_loss=False``, the output; ``constrain_input`` shards its input
    ``P("data", None)`` first."""
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.normal(0.3)
            self.l0 = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, l0_axes),
                                 rngs=rngs)
            self.l1 = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, l1_axes),
                                 rngs=rngs)

        def __call__(self, x):
            if constrain_input:
                x = jax.lax.with_sharding_constraint(x, P("data", None))
            y = self.l1(jnp.tanh(self.l0(x)))
            return jnp.mean(y ** 2) if returns_loss else y

    return nnx_sharded(MLP)


class AttentionBlock(nn.Module):
    """A pre-norm transformer block of width ``d``: 2-head self-attention, then an MLP
    ``mlp`` wide."""

    d: int = 32
    mlp: int = 128

    @nn.compact
    def __call__(self, x):
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=self.d)(nn.LayerNorm()(x))
        x = x + h
        return x + nn.Dense(self.d)(nn.relu(nn.Dense(self.mlp)(nn.LayerNorm()(x))))


class TinyLM(nn.Module):
    """An unmodified transformer LM (no logical axis, no sharding annotation): an
    embedding ``embed``, ``n`` :class:`AttentionBlock` s ``layers_i`` and a ``vocab``-wide
    head ``head``; its call returns the mean cross-entropy of ``tok`` against itself."""

    vocab: int
    n: int = 4
    d: int = 32
    mlp: int = 128

    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(self.vocab, self.d, name="embed")(tok)
        for i in range(self.n):
            x = AttentionBlock(self.d, self.mlp, name=f"layers_{i}")(x)
        logits = nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[..., None], -1))


def lm_tokens(rows: int, tokens: int, vocab: int) -> jax.Array:
    """A ``rows`` x ``tokens`` batch of token ids below ``vocab``."""
    return (jnp.arange(rows * tokens).reshape(rows, tokens) * 7 + 3) % vocab


@contextlib.contextmanager
def sliced_stages(prefix: str = "l", *, rules=None):
    """``{prefix}0``/``{prefix}1`` registered as the stages 0/1 of
    :func:`tests.layouts.global_mesh` (mesh slices), under that mesh (and flax's logical
    ``rules`` when given); the registrations are cleared after."""
    from tests.layouts import global_mesh

    mm.clear_tasks()
    try:
        for k in range(2):
            mm.register_task(f"{prefix}{k}", task=mm.Task(mesh_slice={"stage": k}))
        with jax.set_mesh(global_mesh()), contextlib.ExitStack() as stack:
            if rules is not None:
                stack.enter_context(nn.logical_axis_rules(rules))
            yield
    finally:
        mm.clear_tasks()


def jit_reference(loss, params, x, rules=LOGICAL_RULES):
    """Plain ``jax.jit`` of ``value_and_grad(loss)`` with flax's logical ``rules`` on one
    stage-shaped 2x2 mesh (devices 0-3): ``(value, grads, flops)``."""
    from tests.layouts import flops_of, stage_mesh

    with nn.logical_axis_rules(rules), jax.set_mesh(stage_mesh(0)):
        ref = jax.jit(jax.value_and_grad(loss))
        value, grads = ref(params, x)
        return value, grads, flops_of(ref.lower(params, x).compile())


class SlicedBlocks(nn.Module):
    """Two :class:`LogicalBlock` s as tasks ``s0``/``s1`` on the stage slices 0/1 of the
    global mesh (``multimesh.jax.flax.task``); its call returns the mean square."""

    @nn.compact
    def __call__(self, x):
        from multimesh.jax.flax import task

        x = task(LogicalBlock, name="s0", mesh_slice={"stage": 0})()(x)
        x = task(LogicalBlock, name="s1", mesh_slice={"stage": 1})()(x)
        return jnp.mean(x ** 2)
