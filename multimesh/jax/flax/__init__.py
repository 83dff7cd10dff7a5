"""Flax integration: linen and NNX modules as multimesh tasks.

``flax`` (and ``optax`` for :func:`parallelize_step`) are optional extras:
``import multimesh.jax`` never imports them; importing this package does.

* :func:`task` wraps a linen module class (returns ``Task[<Model>]``), an NNX
  module instance, or a function whose arguments may hold NNX objects.
* :func:`shard_axes` / :func:`nnx_shard_axes`: initializers that attach
  *logical* partitioning names; each task resolves them through its
  ``logical_axes``.
* :func:`parallelize_step`: a whole train step (linen ``TrainState`` or NNX
  model + ``nnx.Optimizer``) compiled as one MPMD program, with every variable
  placed on the submesh of the task that uses it.
* :func:`mjit` (and ``nnx_mjit``): the one :func:`multimesh.jax.mjit`, re-exported;
  it takes NNX modules and optimizers as arguments and writes their state updates
  back, like ``nnx.jit``.
"""

from __future__ import annotations

try:
    import flax  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "multimesh.jax.flax needs flax; install the extra with `pip install multimesh[flax]`."
    ) from e

from multimesh.jax._results import ParallelizeStepResult as ParallelizeStepResult
from multimesh.jax._stages.mjit import mjit as mjit
from multimesh.jax._stages.mjit import mjit as nnx_mjit
from multimesh.jax._task import with_sharding_constraint as with_sharding_constraint
from multimesh.jax.flax._linen import parallelize_step as parallelize_step
from multimesh.jax.flax._linen import shard_axes as shard_axes
from multimesh.jax.flax._linen import task as task
from multimesh.jax.flax._nnx import StateSharding as StateSharding
from multimesh.jax.flax._nnx import TaskModule as TaskModule
from multimesh.jax.flax._nnx import nnx_shard_axes as nnx_shard_axes
from multimesh.jax.flax._nnx_step import NnxTrainState as NnxTrainState

__all__ = ["task", "shard_axes", "nnx_shard_axes", "with_sharding_constraint",
           "parallelize_step", "ParallelizeStepResult", "mjit", "nnx_mjit", "StateSharding", "TaskModule", "NnxTrainState"]
