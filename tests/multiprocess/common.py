"""Shared checks for the multi-process test programs (run under ``multimesh.launch``).

Every process compares the shards it can address with plain JAX computed in this one
process, and checks where each array lives by *position* in ``jax.devices()``: under
``jax.distributed`` the second process's CPU devices have ids 2048, 2049, ...
"""

from __future__ import annotations

import jax
import numpy as np

_checked = []


def init() -> int:
    jax.distributed.initialize()
    return jax.process_index()


def positions(x) -> list[int]:
    index = {d: k for k, d in enumerate(jax.devices())}
    return sorted(index[d] for d in x.sharding.device_set)


def check(name: str, x, ref, where, rtol=1e-5, atol=1e-6) -> None:
    """``x`` lives on device positions ``where`` and its local shards equal ``ref``."""
    assert isinstance(x, jax.Array), (name, type(x))
    got = positions(x)
    assert got == sorted(where), f"{name}: on positions {got}, expected {sorted(where)}"
    me = jax.process_index()
    mine = [d for d in x.sharding.device_set if d.process_index == me]
    assert len(x.addressable_shards) == len(mine), (name, len(x.addressable_shards), mine)
    assert x.is_fully_addressable == (len(mine) == len(where)), name
    ref = np.asarray(ref)
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    for s in x.addressable_shards:
        np.testing.assert_allclose(np.asarray(s.data), ref[s.index], rtol=rtol, atol=atol,
                                   err_msg=f"{name} shard on device {s.device.id}")
    _checked.append((name, len(x.addressable_shards)))


def check_tree(name, tree, ref_tree, where_tree, **kw) -> None:
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    refs = jax.tree.leaves(ref_tree)
    wheres = jax.tree.leaves(where_tree, is_leaf=lambda w: isinstance(w, (list, tuple, range))
                             and all(isinstance(i, int) for i in w))
    assert len(paths) == len(refs) == len(wheres), (name, len(paths), len(refs), len(wheres))
    for (path, x), r, w in zip(paths, refs, wheres):
        check(name + jax.tree_util.keystr(path), x, r, list(w), **kw)


def done() -> None:
    shards = sum(n for _, n in _checked)
    print(f"OK process {jax.process_index()}: {len(_checked)} arrays checked, "
          f"{shards} local shards compared", flush=True)
