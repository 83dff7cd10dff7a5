"""A small Gemma-like decoder written for jax's explicit sharding mode, the way flax's
``examples/gemma`` writes its model (issue 37).

Parameters are NNX variables whose ``out_sharding`` metadata comes from a sharding
config shaped like flax's ``ShardingConfig.fsdp_tp_sharding()`` (axes named ``fsdp``
and ``tp``); created under ``jax.set_mesh`` of a mesh with ``AxisType.Explicit`` axes,
NNX shards them eagerly and their arrays carry the sharding in their types
(``float32[32@tp,16@fsdp]``). Activations are typed by ``out_sharding=`` on every
einsum and by ``jax.sharding.reshard``. The model: token embedding, decoder blocks
(RMSNorm, multi-head attention with separate ``q``/``kv`` einsums, gated MLP), a final
norm and an untied output projection. :class:`GemmaLike` groups them into two stages,
``stages/0`` (embedding and the first block) and ``stages/1`` (the second block and the
head), for registered tasks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, HEADS, HEAD_DIM, HIDDEN = 32, 16, 4, 4, 32


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The partition specs of parameters and activations (flax's gemma
    ``ShardingConfig``, the fields this model uses)."""

    emb_vd: P
    q_weight_ndh: P
    kv_weight_cndh: P
    o_weight_nhd: P
    ffw_weight_df: P
    ffw_weight_fd: P
    rms_norm_weight: P
    act_btd: P
    act_btf: P
    act_btnh: P

    @staticmethod
    def fsdp_tp(fsdp: str = "fsdp", tp: str = "tp") -> Sharding:
        """Parameters sharded over both axes, activations batch-over-``fsdp`` and
        features-over-``tp`` (``fsdp_tp_sharding()``'s layout)."""
        return Sharding(
            emb_vd=P(tp, fsdp), q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None), o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp), ffw_weight_fd=P(tp, fsdp), rms_norm_weight=P(tp),
            act_btd=P(fsdp, None, tp), act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None))


def _param(rngs: nnx.Rngs, shape, spec: P, scale: float = 0.3) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape), out_sharding=spec)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, shd: Sharding, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)), out_sharding=shd.rms_norm_weight)

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


class Attention(nnx.Module):
    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.shd = shd
        self.q = _param(rngs, (HEADS, EMBED, HEAD_DIM), shd.q_weight_ndh)
        self.kv = _param(rngs, (2, HEADS, EMBED, HEAD_DIM), shd.kv_weight_cndh)
        self.o = _param(rngs, (HEADS, HEAD_DIM, EMBED), shd.o_weight_nhd)

    def __call__(self, x):
        shd = self.shd
        q = jnp.einsum("BTD,NDH->BTNH", x, self.q[...], out_sharding=shd.act_btnh)
        k = jnp.einsum("BSD,NDH->BSNH", x, self.kv[0], out_sharding=shd.act_btnh)
        v = jnp.einsum("BSD,NDH->BSNH", x, self.kv[1], out_sharding=shd.act_btnh)
        logits = jnp.einsum("BTNH,BSNH->BTNS", q * HEAD_DIM ** -0.5, k)
        t = x.shape[1]
        causal = jnp.tril(jnp.ones((t, t), bool))[None, :, None, :]
        probs = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        enc = jnp.einsum("BTNS,BSNH->BTNH", probs, v, out_sharding=shd.act_btnh)
        return jnp.einsum("BTNH,NHD->BTD", enc, self.o[...], out_sharding=shd.act_btd)


class FeedForward(nnx.Module):
    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.shd = shd
        self.gate = _param(rngs, (EMBED, HIDDEN), shd.ffw_weight_df)
        self.up = _param(rngs, (EMBED, HIDDEN), shd.ffw_weight_df)
        self.down = _param(rngs, (HIDDEN, EMBED), shd.ffw_weight_fd)

    def __call__(self, x):
        shd = self.shd
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate[...], out_sharding=shd.act_btf)
        up = jnp.einsum("BTD,DF->BTF", x, self.up[...], out_sharding=shd.act_btf)
        return jnp.einsum("BTF,FD->BTD", jax.nn.gelu(gate) * up, self.down[...],
                          out_sharding=shd.act_btd)


class Block(nnx.Module):
    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(EMBED, shd, rngs=rngs)
        self.attn = Attention(shd, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(EMBED, shd, rngs=rngs)
        self.mlp = FeedForward(shd, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.pre_attention_norm(x))
        return x + self.mlp(self.pre_ffw_norm(x))


class First(nnx.Module):
    """Stage 0: the token embedding and the first block."""

    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.shd = shd
        self.embedding = _param(rngs, (VOCAB, EMBED), shd.emb_vd)
        self.block = Block(shd, rngs=rngs)

    def __call__(self, tokens):
        onehot = jax.nn.one_hot(tokens, VOCAB)
        x = jnp.einsum("BTV,VD->BTD", onehot, self.embedding[...],
                       out_sharding=self.shd.act_btd)
        return self.block(x * EMBED ** 0.5)


class Last(nnx.Module):
    """Stage 1: the second block, the final norm and the output projection."""

    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.shd = shd
        self.block = Block(shd, rngs=rngs)
        self.final_norm = RMSNorm(EMBED, shd, rngs=rngs)
        self.unembed = _param(rngs, (VOCAB, EMBED), shd.emb_vd)

    def __call__(self, x):
        x = jax.sharding.reshard(x, self.shd.act_btd)
        x = self.final_norm(self.block(x))
        return jnp.einsum("BTD,VD->BTV", x, self.unembed[...],
                          out_sharding=P(self.shd.act_btd[0], None, None))


class GemmaLike(nnx.Module):
    """Two stages, ``stages/0`` and ``stages/1``, run one after the other."""

    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.stages = nnx.List([First(shd, rngs=rngs), Last(shd, rngs=rngs)])

    def __call__(self, tokens):
        return self.stages[1](self.stages[0](tokens))


def loss(model: GemmaLike, tokens, targets):
    """Mean next-token cross entropy."""
    logits = model(tokens)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, VOCAB), axis=-1))


def train_step(model: GemmaLike, tokens, targets):
    """The loss and the gradients of every parameter."""
    return nnx.value_and_grad(loss)(model, tokens, targets)


def batch(seed: int = 0, size: int = 4, length: int = 8):
    """Random tokens and their targets (the tokens shifted by one)."""
    toks = jax.random.randint(jax.random.key(seed), (size, length + 1), 0, VOCAB)
    return toks[:, :-1], toks[:, 1:]


class Middle(nnx.Module):
    """A stage of one block between :class:`First` and :class:`Last`."""

    def __init__(self, shd: Sharding, *, rngs: nnx.Rngs):
        self.block = Block(shd, rngs=rngs)

    def __call__(self, x):
        return self.block(x)


def stage_modules(num_stages: int, shd: Sharding, seed: int = 0) -> list[nnx.Module]:
    """The model cut into ``num_stages`` stages: :class:`First`, ``num_stages - 2``
    :class:`Middle` blocks, :class:`Last` (the loss is the caller's)."""
    rngs = nnx.Rngs(seed)
    return ([First(shd, rngs=rngs)] + [Middle(shd, rngs=rngs) for _ in range(num_stages - 2)]
            + [Last(shd, rngs=rngs)])
