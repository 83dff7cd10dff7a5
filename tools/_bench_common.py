"""What several benchmark tools share: the pipelined transformer of ``bench_memory`` and
``bench_microbatch``, and writing a tool's results as JSON (``--json PATH``).

A tool imports it as ``_bench_common`` after putting its own folder on ``sys.path`` (not as
``tools._common``: under pytest the name ``tools`` is ``tests/tools.py``), so it runs as
``python tools/X.py``, as ``PYTHONPATH=. python tools/X.py`` and loaded by ``tests/tools.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

PARAM_SHAPES = ("wq", "wk", "wv", "wo", "w1", "w2")


def transformer_block(p: dict, x, heads: int):
    """One pre-norm transformer block on ``x`` of shape (batch, seq, d): ``heads``-head
    self-attention and a 4d GELU MLP, parameters ``p[name]`` for ``PARAM_SHAPES``."""
    import jax
    import jax.numpy as jnp

    def norm(h):
        mu = h.mean(-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-6)

    d = x.shape[-1]
    h = norm(x)
    q, k, v = (jnp.einsum("bsd,de->bse", h, p[n]).reshape(*h.shape[:2], heads, -1)
               for n in ("wq", "wk", "wv"))
    att = jax.nn.softmax(jnp.einsum("bqhe,bkhe->bhqk", q, k) / (d // heads) ** 0.5, -1)
    o = jnp.einsum("bhqk,bkhe->bqhe", att, v).reshape(x.shape)
    x = x + o @ p["wo"]
    return x + jax.nn.gelu(norm(x) @ p["w1"]) @ p["w2"]


def pipelined_transformer(stages: int, blocks: int, d: int, heads: int,
                          devices: Callable[[int], Sequence[int]]):
    """``(loss, params)``: ``stages`` stage tasks of ``blocks`` transformer blocks each
    (width ``d``), stage ``k`` a task on ``devices(k)`` with its batch sharded over
    them; the loss is the mean square of the last stage's output."""
    import jax
    from jax.sharding import PartitionSpec as P

    import multimesh.jax as mm

    def stage(ps, x):
        x = mm.with_sharding_constraint(x, P("batch", None, None))
        for p in ps:
            x = transformer_block(p, x, heads)
        return x

    tasks = [mm.task(stage, name=f"stage{k}", mesh=mm.TaskMesh(devices=devices(k)),
                     logical_axes=(("batch", "x"),)) for k in range(stages)]

    def loss(params, x):
        for t, ps in zip(tasks, params):
            x = t(ps, x)
        return (x ** 2).mean()

    key = jax.random.key(0)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d),
              "w2": (4 * d, d)}
    params = [[{n: jax.random.normal(jax.random.fold_in(key, 100 * s + 10 * i + j), sh) / d
                for j, (n, sh) in enumerate(shapes.items())} for i in range(blocks)]
              for s in range(stages)]
    return loss, params


def write_json(path: str | None, results: Any, indent: int = 2) -> None:
    """``results`` as JSON to ``path`` (a tool's ``--json PATH``); nothing when ``None``."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=indent)
