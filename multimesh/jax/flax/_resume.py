"""Resuming a linen ``parallelize_step`` from ``init_state=``: what a user restores.

A checkpoint comes back in one of several forms: the ``TrainState`` itself; the raw
dict orbax restores without a target (tuples as lists, optax's named tuples as dicts,
empty states as None) or ``flax.serialization.to_state_dict`` writes; a variables dict
``{"params": ...}``; or the params alone. Each is read against the state a fresh
``model.init`` would build (``fresh``, shapes only), so a form that does not fit is an
error naming where, not a failure deep inside jax. An optimizer is compared by how it
was built (its functions' code and the values they closed over), since two calls of
``optax.adam(1e-2)`` are two objects that do the same thing.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax.training.train_state import TrainState

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError

__all__ = ["initial_state", "same_optimizer"]

_KINDS = ("a flax TrainState, the dict orbax restores for one ({'step', 'params', "
          "'opt_state'}), a variables dict {'params': ...} or the params dict alone")


def initial_state(given, fresh: TrainState, model, optimizer) -> TrainState:
    """``init_state`` as a ``TrainState`` of ``fresh``'s layout (flax's: ``params`` is
    ``variables["params"]``), with ``optimizer`` as its ``tx``."""
    if isinstance(given, TrainState):
        if not same_optimizer(given.tx, optimizer):
            raise MultimeshValueError(
                "parallelize_step got `init_state`, a TrainState with its own optimizer "
                "(`init_state.tx`), and a different `optimizer`; one of them would be "
                "ignored silently. Pass the state's own (`optimizer=init_state.tx`) or one "
                "built the same way, or restart the optimizer: `init_state.replace("
                "tx=optimizer, opt_state=optimizer.init(init_state.params))`.")
        _check_fits(given.params, fresh.params, "init_state.params")
        _check_fits(given.opt_state, fresh.opt_state, "init_state.opt_state")
        return given.replace(tx=optimizer)
    if not isinstance(given, Mapping):
        raise MultimeshTypeError(
            f"parallelize_step `init_state` must be {_KINDS}, got {type(given).__name__}.")
    if "opt_state" in given and "params" in given:  # a TrainState's state dict
        step = given.get("step", 0)
        params = _like(fresh.params, given["params"], "init_state['params']")
        opt_state = _like(fresh.opt_state, given["opt_state"], "init_state['opt_state']")
        return TrainState(step=step, apply_fn=model.apply, params=params, tx=optimizer,
                          opt_state=opt_state)
    params = given["params"] if set(given) == {"params"} else given
    where = "init_state['params']" if params is not given else "init_state"
    return TrainState.create(apply_fn=model.apply, params=_like(fresh.params, params, where),
                             tx=optimizer)


def _like(target, raw, where: str):
    """``raw`` (a checkpoint's nested dicts and lists) in ``target``'s structure: each
    leaf of ``target`` looked up in ``raw`` by its path."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = []
    for path, want in paths:
        got = raw
        for key in path:
            got = _step_into(got, key, where, path)
        if np.shape(got) != np.shape(want):
            raise MultimeshValueError(
                f"parallelize_step `init_state` does not fit the model: "
                f"{where}{jax.tree_util.keystr(path)} has shape {np.shape(got)}, but the "
                f"model's state has {np.shape(want)} there.")
        leaves.append(got)
    return jax.tree.unflatten(treedef, leaves)


def _step_into(node, key, where: str, path):
    """One step of a target path into a raw checkpoint tree."""
    name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
    if isinstance(key, jax.tree_util.GetAttrKey) and not isinstance(node, Mapping):
        if hasattr(node, key.name):  # a named tuple or dataclass, as the target has it
            return getattr(node, key.name)
        if hasattr(node, "shape"):
            return node  # a boxed leaf (nn.Partitioned's value) saved unboxed
    if isinstance(node, Mapping):
        for k in (name, str(name)):
            if k in node:
                return node[k]
    elif isinstance(node, (list, tuple)) and isinstance(name, int) and name < len(node):
        return node[name]
    raise MultimeshValueError(
        f"parallelize_step `init_state` does not fit the model: it has nothing at "
        f"{where}{jax.tree_util.keystr(path)}, where the model's state has a value. Pass "
        f"{_KINDS}, of this model.")


def _check_fits(given, want, where: str) -> None:
    """``given`` has ``want``'s structure and shapes (boxes aside)."""
    g, w = nn.meta.unbox(given), nn.meta.unbox(want)
    g_def: Any = jax.tree.structure(g)  # a PyTreeDef: jax's alias is opaque to mypy
    if g_def != jax.tree.structure(w):
        raise MultimeshValueError(
            f"parallelize_step `init_state` does not fit the model: {where} has structure "
            f"{jax.tree.structure(g)}, but the model's state has {jax.tree.structure(w)}.")
    _like(w, g, where)  # shapes


def same_optimizer(a, b) -> bool:
    """Whether two optax transformations were built the same way."""
    return _same(a, b, 0)


def _same(a, b, depth: int) -> bool:
    if a is b:
        return True
    if depth > 32 or type(a) is not type(b):
        return False
    if isinstance(a, functools.partial):
        return _same((a.func, a.args, a.keywords), (b.func, b.args, b.keywords), depth + 1)
    if hasattr(a, "__code__") and hasattr(a, "__closure__"):  # a function
        return a.__code__ == b.__code__ and _same(
            (a.__defaults__, a.__kwdefaults__, _cells(a)),
            (b.__defaults__, b.__kwdefaults__, _cells(b)), depth + 1)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (np.ndarray, jax.Array)):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object that cannot say: not the same
        return False


def _cells(f) -> tuple:
    out = []
    for cell in f.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            out.append(None)
    return tuple(out)
