"""A decoder-only transformer described by its shapes, and its costs from jaxprs.

:class:`Transformer` is the configuration (layers, width, heads, KV heads, FFN,
vocabulary, sequence, global batch); :meth:`Transformer.llama3` gives Meta's three
Llama 3 sizes. :func:`llama_layer` is a small pure-jax Llama layer (RMSNorm, GQA with
RoPE, SwiGLU) and :func:`llama_head` the output head and loss. Costs are counted
from the jaxpr of ONE layer traced on ``jax.ShapeDtypeStruct`` s (nothing is
materialised or compiled): :func:`count` sums each ``dot_general``'s flops and
bytes and each elementwise op's written bytes; identical layers are costed once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from multimesh._src.errors import MultimeshValueError
from multimesh.jax._task import with_sharding_constraint

__all__ = ["Transformer", "llama_layer", "llama_head", "count", "Counts", "layer_costs"]

ATTENTION = "attention_core"
"""The name of the jitted attention core: counted as one fused (flash) kernel."""

_FREE = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
                   "convert_element_type", "slice", "concatenate", "iota", "copy", "copy_p",
                   "pjit", "jit", "stop_gradient", "select_n"})

_LLAMA3 = {  # Table 3 of "The Llama 3 Herd of Models" (Meta, 2024)
    "8b": dict(layers=32, d_model=4096, ffn=14336, heads=32, kv_heads=8),
    "70b": dict(layers=80, d_model=8192, ffn=28672, heads=64, kv_heads=8),
    "405b": dict(layers=126, d_model=16384, ffn=53248, heads=128, kv_heads=8),
}


@dataclasses.dataclass(frozen=True)
class Transformer:
    """A Llama-style decoder: ``layers`` identical blocks of width ``d_model`` with
    ``heads`` query heads and ``kv_heads`` key/value heads, a SwiGLU MLP of width
    ``ffn``, a ``vocab``-sized (untied) embedding and head; trained on ``seq``-token
    sequences, ``global_batch`` sequences a step."""

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    global_batch: int
    name: str = "transformer"

    def __post_init__(self):
        for f in ("layers", "d_model", "heads", "kv_heads", "ffn", "vocab", "seq",
                  "global_batch"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise MultimeshValueError(
                    f"`Transformer`: `{f}` must be a positive integer, got {v!r}.")
        if self.d_model % self.heads or self.heads % self.kv_heads:
            raise MultimeshValueError(
                f"`Transformer`: d_model={self.d_model} must be a multiple of heads="
                f"{self.heads}, and heads a multiple of kv_heads={self.kv_heads}.")

    @classmethod
    def llama3(cls, size: str, *, seq: int = 8192, global_batch: int = 2048,
               vocab: int = 128256) -> Transformer:
        """Llama 3 ``"8b"``, ``"70b"`` or ``"405b"`` (Table 3 of Meta's paper; the
        released tokenizer's 128,256 entries)."""
        key = str(size).lower()
        if key not in _LLAMA3:
            raise MultimeshValueError(
                f"`Transformer.llama3`: unknown size {size!r}; known: {sorted(_LLAMA3)}.")
        return cls(**_LLAMA3[key], vocab=vocab, seq=seq, global_batch=global_batch,
                   name=f"llama3-{key}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    def layer_shapes(self, dtype=jnp.bfloat16) -> dict:
        """One layer's parameters as ``jax.ShapeDtypeStruct`` s."""
        h, d, q, kv = self.d_model, self.head_dim, self.heads, self.kv_heads
        sd = jax.ShapeDtypeStruct
        return {"attn_norm": sd((h,), dtype), "wq": sd((h, q * d), dtype),
                "wk": sd((h, kv * d), dtype), "wv": sd((h, kv * d), dtype),
                "wo": sd((q * d, h), dtype), "mlp_norm": sd((h,), dtype),
                "w1": sd((h, self.ffn), dtype), "w3": sd((h, self.ffn), dtype),
                "w2": sd((self.ffn, h), dtype)}

    def head_shapes(self, dtype=jnp.bfloat16) -> dict:
        sd = jax.ShapeDtypeStruct
        return {"norm": sd((self.d_model,), dtype), "out": sd((self.d_model, self.vocab), dtype)}

    def params_shapes(self, dtype=jnp.bfloat16) -> dict:
        """The whole model's parameters as ``jax.ShapeDtypeStruct`` s: ``embed``, a list
        of ``layers`` (one dict each, so each lives with its pipeline stage) and
        ``head``."""
        return {"embed": jax.ShapeDtypeStruct((self.vocab, self.d_model), dtype),
                "layers": [self.layer_shapes(dtype) for _ in range(self.layers)],
                "head": self.head_shapes(dtype)}

    def batch_shapes(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.global_batch, self.seq), jnp.int32)

    @functools.cached_property
    def layer_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.layer_shapes()))

    @functools.cached_property
    def embed_params(self) -> int:
        return self.vocab * self.d_model

    @functools.cached_property
    def head_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(self.head_shapes()))

    @functools.cached_property
    def num_params(self) -> int:
        return self.layers * self.layer_params + self.embed_params + self.head_params

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _rope(x):
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (500000.0 ** (jnp.arange(0, d // 2, dtype=jnp.float32) / (d // 2)))
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    a, b = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1).astype(x.dtype)


@jax.jit
def attention_core(q, k, v):
    """Causal attention of ``q`` [b, s, H, d] over ``k``, ``v`` [b, s, K, d] (GQA)."""
    b, s, H, d = q.shape
    g = H // k.shape[2]
    q = q.reshape(b, s, k.shape[2], g, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / math.sqrt(d)
    mask = jnp.tril(jnp.ones((s, s), bool))
    p = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqs,bskd->bqkgd", p, v).reshape(b, s, H, d)


def llama_layer(p: dict, x, heads: int, kv_heads: int):
    """One Llama block on ``x`` [batch, seq, d_model]."""
    b, s, h = x.shape
    d = h // heads
    y = _rms(x, p["attn_norm"])
    q = _rope((y @ p["wq"]).reshape(b, s, heads, d))
    k = _rope((y @ p["wk"]).reshape(b, s, kv_heads, d))
    v = (y @ p["wv"]).reshape(b, s, kv_heads, d)
    x = x + attention_core(q, k, v).reshape(b, s, h) @ p["wo"]
    y = _rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(y @ p["w1"]) * (y @ p["w3"])) @ p["w2"]


def llama_head(p: dict, x, labels):
    """The final norm, logits (float32) and mean cross-entropy."""
    logits = (_rms(x, p["norm"]) @ p["out"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


@dataclasses.dataclass(frozen=True)
class Counts:
    """What a jaxpr does, counted: matmul flops (``attention_flops`` of them in the
    fused attention core), the bytes matmuls and the attention core read and write,
    the bytes elementwise ops write, and the kernels launched (matmuls and attention
    cores)."""

    flops: float = 0.0
    attention_flops: float = 0.0
    matmul_bytes: float = 0.0
    elementwise_bytes: float = 0.0
    kernels: int = 0

    def __add__(self, o: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))

    def __sub__(self, o: Counts) -> Counts:
        return Counts(*(a - b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))

    def scale(self, k: float) -> Counts:
        return Counts(self.flops * k, self.attention_flops * k, self.matmul_bytes * k,
                      self.elementwise_bytes * k, round(self.kernels * k))


def _nbytes(v) -> float:
    aval = v.aval
    return float(math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize) \
        if hasattr(aval, "shape") else 0.0


def _dot_flops(e) -> float:
    (lc, _), _ = e.params["dimension_numbers"]
    lhs = e.invars[0].aval.shape
    return 2.0 * math.prod(e.outvars[0].aval.shape) * math.prod(lhs[i] for i in lc)


def count(jaxpr, in_attention: bool = False) -> Counts:
    """:class:`Counts` of a (closed) jaxpr, inner jaxprs included (a ``scan`` body
    ``length`` times)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = Counts()
    roots = _fusion_roots(jaxpr)
    for e in jaxpr.eqns:
        name = e.primitive.name
        inner = [v for v in e.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
        if name == "cond":  # the dearest branch
            inner = [max(e.params["branches"], key=lambda j: count(j, in_attention).flops)]
        if name == "dot_general":
            f = _dot_flops(e)
            io = sum(map(_nbytes, e.invars)) + sum(map(_nbytes, e.outvars))
            total += Counts(f, f if in_attention else 0.0, 0.0 if in_attention else io, 0.0,
                            0 if in_attention else 1)
        elif inner:
            attn = e.params.get("name") == ATTENTION
            times = e.params.get("length", 1) if name == "scan" else 1
            sub = sum((count(j, in_attention or attn) for j in inner), Counts()).scale(times)
            if attn and not in_attention:
                io = sum(map(_nbytes, e.invars)) + sum(map(_nbytes, e.outvars))
                sub = dataclasses.replace(sub, matmul_bytes=sub.matmul_bytes + io,
                                          elementwise_bytes=0.0, kernels=sub.kernels + 1)
            total += sub
        elif name not in _FREE and not in_attention:
            total += Counts(elementwise_bytes=sum(_nbytes(v) for v in e.outvars
                                                  if id(v) in roots))
    return total


def _fusion_roots(jaxpr) -> set[int]:
    """Values a fused elementwise kernel writes to memory: those a matmul, an inner
    jaxpr or the jaxpr's outputs read (elementwise chains between them fuse)."""
    out = {id(v) for v in jaxpr.outvars}
    for e in jaxpr.eqns:
        if e.primitive.name == "dot_general" or any(
                hasattr(v, "eqns") or hasattr(v, "jaxpr") for v in e.params.values()):
            out.update(id(v) for v in e.invars)
    for e in reversed(jaxpr.eqns):  # through reshapes and casts to what they read
        if e.primitive.name in _FREE and any(id(v) in out for v in e.outvars):
            out.update(id(v) for v in e.invars)
    return out


def _trace(fun: Callable, *shapes) -> Counts:
    return count(jax.make_jaxpr(fun)(*shapes))


@dataclasses.dataclass(frozen=True)
class LayerCosts:
    """Per sequence (``b = 1``): one layer's forward and backward counts, and the
    head's (final norm, logits, loss)."""

    layer_fwd: Counts
    layer_bwd: Counts
    head_fwd: Counts
    head_bwd: Counts


def layer_costs(model: Transformer, layer: Callable | None = None) -> LayerCosts:
    """Count one layer (``layer(params, x)``, default :func:`llama_layer`) and the
    head from their jaxprs on ``ShapeDtypeStruct`` s, forward and backward."""
    sd = jax.ShapeDtypeStruct
    x = sd((1, model.seq, model.d_model), jnp.bfloat16)
    if layer is None:
        def layer(p, x):
            return llama_layer(p, x, model.heads, model.kv_heads)
    p = model.layer_shapes()

    def fwd_bwd(p, x):
        out, back = jax.vjp(layer, p, x)
        return back(out)

    lf = _trace(layer, p, x)
    lb = _trace(fwd_bwd, p, x) - lf
    labels = sd((1, model.seq), jnp.int32)
    hp = model.head_shapes()
    hf = _trace(llama_head, hp, x, labels)
    hb = _trace(jax.grad(llama_head, argnums=(0, 1)), hp, x, labels) - hf
    return LayerCosts(lf, lb, hf, hb)


_LOGICAL = {"wq": ("embed", "heads"), "wk": ("embed", "heads"), "wv": ("embed", "heads"),
            "wo": ("heads", "embed"), "w1": ("embed", "mlp"), "w3": ("embed", "mlp"),
            "w2": ("mlp", "embed")}
"""Each layer weight's logical axes: ``heads`` and ``mlp`` go to the tensor axis,
``embed`` to the fsdp axis (the generated program's ``logical_axes``)."""


def _constrain_layer(p: dict) -> dict:
    return {k: with_sharding_constraint(v, PartitionSpec(*_LOGICAL[k])) if k in _LOGICAL else v
            for k, v in p.items()}


def transformer_loss(model: Transformer, stage_layers: tuple[int, ...] | None = None,
                     layer: Callable | None = None) -> Callable:
    """``loss(params, tokens)`` of ``model`` (params as :meth:`Transformer.params_shapes`
    lays them out, tokens ``[batch, seq]`` int32, next-token targets), each virtual
    stage's layers under ``jax.named_scope(f"stage{i}")`` (``stage_layers``: layers per
    stage, default one stage), the embedding in the first and the head in the last.
    Activations' rows carry the logical name ``batch``; layer weights ``heads``,
    ``mlp`` and ``embed`` (multimesh's logical ``with_sharding_constraint``: a task's
    ``logical_axes`` place them; run it as plain JAX under ``mm.ignore_transforms()``)."""
    split = tuple(stage_layers or (model.layers,))
    if sum(split) != model.layers or any(n < 0 for n in split):
        raise MultimeshValueError(
            f"`transformer_loss`: stage_layers={split} must be non-negative and sum to the "
            f"model's {model.layers} layers.")
    block = layer or (lambda p, x: llama_layer(p, x, model.heads, model.kv_heads))
    rows = PartitionSpec("batch")

    def loss(params, tokens):
        labels = jnp.roll(tokens, -1, axis=1)
        x, i = None, 0
        for k, n in enumerate(split):
            with jax.named_scope(f"stage{k}"):
                if k == 0:
                    x = params["embed"][with_sharding_constraint(tokens, rows)]
                for _ in range(n):
                    p = _constrain_layer(params["layers"][i])
                    x = with_sharding_constraint(block(p, x), rows)
                    i += 1
                if k == len(split) - 1:
                    return llama_head(params["head"], x, labels)
        raise AssertionError("unreachable")

    return loss
