"""What the linen and NNX flavours of ``parallelize_step`` share: the example batch's
shapes and checks, the default mesh, the optimizer check, ``prepare_batch``; and which
leaves a compiled program takes as traced inputs."""

from __future__ import annotations

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh._src.jax_compat import is_committed
from multimesh.runtime import distributed

__all__ = ["is_array", "is_dynamic", "batch_avals_of", "lowering_batch", "check_batches",
           "default_mesh", "make_prepare_batch", "check_optimizer"]


def is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, Tracer))


def is_dynamic(x) -> bool:
    """Leaves a compiled program takes as traced inputs (like ``jax.jit``: arrays and
    Python numbers, but not bools); the rest are static."""
    if isinstance(x, bool):
        return False
    return is_array(x) or isinstance(x, (int, float, complex))


def batch_avals_of(global_batch, local_batch):
    if global_batch is not None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)),
                            global_batch)
    nproc = jax.process_count()

    def one(x):
        shape = np.shape(x)
        if shape:
            shape = (shape[0] * nproc,) + tuple(shape[1:])
        return jax.ShapeDtypeStruct(shape, jax.numpy.result_type(x))

    return jax.tree.map(one, local_batch)


def lowering_batch(global_batch, batch_avals, replicate_inputs: bool):
    """The batch the step is lowered with: with ``replicate_inputs=False``, each leaf of
    ``global_batch`` that the caller placed (a committed array, e.g.
    ``jax.device_put(x, NamedSharding(mesh, P("data")))``) as it is, so the step takes
    the batch with that layout, as ``jax.jit`` takes a committed argument; else (and for
    every other leaf) its shape."""
    if replicate_inputs or global_batch is None:
        return batch_avals
    return jax.tree.map(lambda x, aval: x if is_committed(x) else aval,
                        global_batch, batch_avals)


def check_batches(global_batch, local_batch):
    if global_batch is None and local_batch is None:
        raise MultimeshValueError(
            "parallelize_step needs an example batch: pass `global_batch=` (jax arrays of the "
            "whole batch) or `local_batch=` (this process's slice of the batch, host data).")
    if global_batch is not None and local_batch is not None:
        raise MultimeshValueError(
            "parallelize_step takes either `global_batch=` or `local_batch=`, not both.")


def default_mesh(mesh):
    if mesh is None:
        return Mesh(np.array(jax.devices()), ("x",))
    if not isinstance(mesh, Mesh):
        raise MultimeshTypeError(
            f"parallelize_step: `mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    return mesh


def make_prepare_batch(batch_shardings, batch_avals):
    """``prepare_batch(host_pytree)``: this process's slice → global arrays on the batch's submesh."""

    def prepare_batch(local):
        def one(x, sh, aval):
            if isinstance(x, jax.Array) and x.shape == aval.shape and x.sharding == sh:
                return x
            data = np.asarray(x)
            if data.dtype != aval.dtype:
                data = data.astype(aval.dtype)
            return distributed.from_process_local(data, sh, aval.shape)

        return jax.tree.map(one, local, batch_shardings, batch_avals)

    return prepare_batch


def check_optimizer(optimizer, allow_nnx: bool) -> None:
    """``optimizer`` must be an optax GradientTransformation (or, for NNX, an nnx.Optimizer)."""
    if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
        return
    kinds = ("an optax GradientTransformation or an nnx.Optimizer" if allow_nnx
             else "an optax GradientTransformation (e.g. optax.adam(1e-3))")
    raise MultimeshTypeError(
        f"parallelize_step: `optimizer` must be {kinds}, got {type(optimizer).__name__}.")
