"""Small models written the way real ones are, with their own sharding annotations.

``Lm1b`` follows flax's ``examples/lm1b/models.py`` (a decoder-only transformer): an
embedding boxed ``("vocab", "embed")`` with a learned position embedding, pre-norm
blocks of self-attention (``q``/``k``/``v`` kernels ``("embed", "heads", "kv")``, the
output ``("heads", "kv", "embed")``) and an MLP (``("embed", "mlp")``, ``("mlp",
"embed")``), a final layer norm and a logits head ``("embed", "vocab")``, every
parameter declared with ``nn.with_logical_partitioning``. Like lm1b it never constrains
its activations: where the batch dimension lives is left to the input's sharding and
to propagation. ``RULES`` map the logical names as lm1b's and MaxText's do: the batch
over ``data``; the MLP, the heads and the vocabulary over ``model``.

The model is cut into stages (:func:`stage_modules`), each a linen module of its own, so
tests can make every stage a task and compare with the same stages composed in plain
jax. Dimensions are tiny: the tests compile many programs.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

RULES = (("batch", "data"), ("mlp", "model"), ("heads", "model"), ("vocab", "model"),
         ("embed", None), ("kv", None), ("length", None))
"""lm1b's/MaxText's mapping of the logical names onto a ``(data, model)`` mesh."""


@dataclasses.dataclass(frozen=True)
class LmConfig:
    vocab: int = 32
    embed: int = 16
    heads: int = 2
    kv: int = 8
    mlp: int = 32
    length: int = 8


def _param(module: nn.Module, name: str, names: tuple, shape: tuple, scale: float = 0.3):
    init = nn.with_logical_partitioning(nn.initializers.normal(scale), names)
    return module.param(name, init, shape)


def _norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(name=name,
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


class SelfAttention(nn.Module):
    """Causal multi-head self-attention (flax's ``MultiHeadDotProductAttention``, written out
    so that each kernel carries its three logical names)."""

    cfg: LmConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        qkv = [_param(self, n, ("embed", "heads", "kv"), (c.embed, c.heads, c.kv))
               for n in ("query", "key", "value")]
        q, k, v = (jnp.einsum("ble,ehd->blhd", x, w) for w in qkv)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(c.kv)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        w_out = _param(self, "out", ("heads", "kv", "embed"), (c.heads, c.kv, c.embed))
        return jnp.einsum("bqhd,hde->bqe", out, w_out)


class MlpBlock(nn.Module):
    cfg: LmConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        w1 = _param(self, "wi", ("embed", "mlp"), (c.embed, c.mlp))
        b1 = self.param("bi", nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
                        (c.mlp,))
        w2 = _param(self, "wo", ("mlp", "embed"), (c.mlp, c.embed))
        return nn.relu(x @ w1 + b1) @ w2


class DecoderBlock(nn.Module):
    """lm1b's ``EncoderDecoder1DBlock``: pre-norm attention and MLP, each residual."""

    cfg: LmConfig

    @nn.compact
    def __call__(self, x):
        x = x + SelfAttention(self.cfg, name="attention")(_norm("ln_attention")(x))
        return x + MlpBlock(self.cfg, name="mlp")(_norm("ln_mlp")(x))


class Embed(nn.Module):
    """Token embedding ``("vocab", "embed")`` plus a learned position embedding."""

    cfg: LmConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        table = _param(self, "embedding", ("vocab", "embed"), (c.vocab, c.embed), 1.0)
        pos = _param(self, "pos_embedding", ("length", "embed"), (c.length, c.embed), 0.1)
        return jnp.take(table, tokens, axis=0) + pos[:tokens.shape[1]]


class Head(nn.Module):
    """The final norm, the logits ``("embed", "vocab")`` and the mean cross-entropy."""

    cfg: LmConfig

    @nn.compact
    def __call__(self, x, targets):
        x = _norm("final_norm")(x)
        logits = x @ _param(self, "logits", ("embed", "vocab"), (self.cfg.embed, self.cfg.vocab))
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, ``layers`` blocks, the head (and the
    loss) on the last. Called as ``(h_or_tokens, targets)``; returns the activations, or
    the loss on the last stage."""

    cfg: LmConfig
    layers: int = 1
    first: bool = False
    last: bool = False
    constrain_batch: bool = False
    """Constrain the stage's inputs' rows to the logical ``batch`` (lm1b does not)."""

    @nn.compact
    def __call__(self, x, targets):
        if self.constrain_batch:
            x = nn.with_logical_constraint(x, ("batch",) + (None,) * (x.ndim - 1))
            targets = nn.with_logical_constraint(targets, ("batch", None))
        if self.first:
            x = Embed(self.cfg, name="embed")(x)
        for i in range(self.layers):
            x = DecoderBlock(self.cfg, name=f"block_{i}")(x)
        return Head(self.cfg, name="head")(x, targets) if self.last else x


def stage_modules(num_stages: int, cfg: LmConfig = LmConfig(), *,
                  constrain_batch: bool = False) -> list[Stage]:
    """The model cut into ``num_stages`` stages of one decoder block each."""
    return [Stage(cfg, first=k == 0, last=k == num_stages - 1, constrain_batch=constrain_batch)
            for k in range(num_stages)]


def init_stages(stages: list[Stage], batch: dict, seed: int = 0) -> list:
    """Each stage's parameters, unboxed, initialised on the batch's shapes."""
    params, x = [], batch["inputs"]
    for k, s in enumerate(stages):
        p = nn.unbox(s.init(jax.random.key(seed + k), x, batch["targets"]))
        params.append(p)
        out = jax.eval_shape(s.apply, p, x, batch["targets"])
        x = jnp.zeros(out.shape, out.dtype)
    return params


def stage_specs(stages: list[Stage], batch: dict) -> list:
    """Each stage's parameters' logical partition specs (``nn.get_partition_spec``)."""
    out, x = [], batch["inputs"]
    for s in stages:
        boxed = jax.eval_shape(s.init, jax.random.key(0), x, batch["targets"])
        out.append(nn.get_partition_spec(boxed))
        x = jax.eval_shape(s.apply, nn.unbox(boxed), x, batch["targets"])
    return out


def loss_of(fns):
    """Stages composed: ``fns[k](params[k], x, targets)`` applied in turn to a
    ``{"inputs", "targets"}`` batch (the last returns the loss)."""
    def loss(params, batch):
        x = batch["inputs"]
        for f, p in zip(fns, params, strict=True):
            x = f(p, x, batch["targets"])
        return x
    return loss


def token_batch(size: int, cfg: LmConfig = LmConfig(), seed: int = 7) -> dict:
    """``size`` sequences of random tokens, the targets the inputs shifted by one."""
    tokens = jax.random.randint(jax.random.key(seed), (size, cfg.length + 1), 0, cfg.vocab)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


class Lm1b(nn.Module):
    """The whole model on a ``{"inputs", "targets"}`` batch, returning the mean loss: its
    stages are submodules ``stage_0``, ``stage_1``, ... (the names registered tasks
    match)."""

    cfg: LmConfig = LmConfig()
    num_stages: int = 2
    constrain_batch: bool = False

    @nn.compact
    def __call__(self, batch):
        x = batch["inputs"]
        for k in range(self.num_stages):
            x = Stage(self.cfg, first=k == 0, last=k == self.num_stages - 1,
                      constrain_batch=self.constrain_batch, name=f"stage_{k}")(
                x, batch["targets"])
        return x


# --------------------------------------------------------------------------- NNX


def _nnx_init(names: tuple, scale: float = 0.3):
    """A normal initialiser carrying NNX partition metadata (``nnx.with_partitioning``)
    over the mesh axes ``names`` (``RULES`` applied by hand: ``model`` for the MLP, the
    heads and the vocabulary)."""
    from flax import nnx
    return nnx.with_partitioning(nnx.initializers.normal(scale), names)


def _nnx_classes():
    from flax import nnx

    class Attention(nnx.Module):
        def __init__(self, c: LmConfig, rngs):
            self.qkv = nnx.List([nnx.Einsum("ble,ehd->blhd", (c.embed, c.heads, c.kv), rngs=rngs,
                                            kernel_init=_nnx_init((None, "model", None)))
                                 for _ in range(3)])
            self.out = nnx.Einsum("blhd,hde->ble", (c.heads, c.kv, c.embed), rngs=rngs,
                                  kernel_init=_nnx_init(("model", None, None)))
            self.kv = c.kv

        def __call__(self, x):
            q, k, v = (f(x) for f in self.qkv)
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(self.kv)
            causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
            return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v))

    class Block(nnx.Module):
        def __init__(self, c: LmConfig, rngs):
            self.ln_attention = nnx.LayerNorm(c.embed, rngs=rngs)
            self.attention = Attention(c, rngs)
            self.ln_mlp = nnx.LayerNorm(c.embed, rngs=rngs)
            self.wi = nnx.Linear(c.embed, c.mlp, kernel_init=_nnx_init((None, "model")),
                                 rngs=rngs)
            self.wo = nnx.Linear(c.mlp, c.embed, kernel_init=_nnx_init(("model", None)),
                                 rngs=rngs)

        def __call__(self, x):
            x = x + self.attention(self.ln_attention(x))
            return x + self.wo(nnx.relu(self.wi(self.ln_mlp(x))))

    class Stage(nnx.Module):
        def __init__(self, c: LmConfig, first: bool, last: bool, rngs):
            if first:
                self.embed = nnx.Embed(c.vocab, c.embed, rngs=rngs,
                                       embedding_init=_nnx_init(("model", None), 1.0))
                self.pos = nnx.Param(0.1 * jax.random.normal(rngs.params(), (c.length, c.embed)))
            self.block = Block(c, rngs)
            if last:
                self.final_norm = nnx.LayerNorm(c.embed, rngs=rngs)
                self.logits = nnx.Linear(c.embed, c.vocab, kernel_init=_nnx_init((None, "model")),
                                         use_bias=False, rngs=rngs)
            self.first, self.last = first, last

        def __call__(self, x, targets):
            if self.first:
                x = self.embed(x) + self.pos[...][:x.shape[1]]
            x = self.block(x)
            if not self.last:
                return x
            logp = jax.nn.log_softmax(self.logits(self.final_norm(x)))
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return Stage


def nnx_stage_modules(num_stages: int, cfg: LmConfig = LmConfig(), seed: int = 0) -> list:
    """lm1b's stages written in NNX, ``num_stages`` of one decoder block each, their
    parameters sharded by partition metadata (``nnx.with_partitioning``) as flax's NNX
    guides write them: the embedding ``("model", None)``, the ``q``/``k``/``v`` kernels
    ``(None, "model", None)``, the output ``("model", None, None)``, the MLP ``(None,
    "model")``/``("model", None)``, the logits ``(None, "model")``. Each is called as
    ``(h_or_tokens, targets)`` like :class:`Stage`."""
    from flax import nnx
    stage = _nnx_classes()
    return [stage(cfg, k == 0, k == num_stages - 1, nnx.Rngs(seed + k)) for k in range(num_stages)]
