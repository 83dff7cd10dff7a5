"""The NNX ``parallelize_step``: a model and an optimizer as one ``NnxTrainState``,
compiled once by ``mjit``; ``step_fn`` updates them in place."""

from __future__ import annotations

import contextlib
import warnings

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from multimesh._src.errors import MultimeshWarning, user_stacklevel
from multimesh.jax._planner._api import plan_step
from multimesh.jax._results import ParallelizeStepResult
from multimesh.jax._stages.mjit import mjit
from multimesh.jax._task import with_sharding_constraint
from multimesh.jax.flax._common import (
    batch_avals_of,
    check_batches,
    check_optimizer,
    default_mesh,
    lowering_batch,
    make_prepare_batch,
)
from multimesh.jax.flax._nnx import var_spec

__all__ = ["NnxTrainState", "parallelize_step"]


class NnxTrainState(nnx.Module):
    """The state of an NNX :func:`parallelize_step`: ``model`` and ``optimizer``."""

    def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer):
        self.model = model
        self.optimizer = optimizer


def _state_specs(node) -> nnx.State:
    """Every Variable's logical names (``P()`` when it has none), as an nnx.State."""
    _, state = nnx.split(node)
    flat = [(p, (var_spec(v) or P()) if isinstance(v, nnx.Variable) else P())
            for p, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def _warn_unstepped(model) -> None:
    others = nnx.state(model, nnx.Not(nnx.Param))
    if jax.tree.leaves(others):
        warnings.warn(
            "parallelize_step with microbatches: the module has variables that are not "
            "nnx.Param (batch statistics, RNG streams, ...); every microbatch reads them, but "
            "the step does not update them.", MultimeshWarning,
            stacklevel=user_stacklevel())


def _split_params(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """``model`` as (graph, its ``nnx.Param`` values, every other value)."""
    graphdef, *states = nnx.split(model, nnx.Param, ...)
    params, rest = states
    return graphdef, params, rest


class _NnxStep:
    """``step_fn(state, batch) -> (loss, state)``: the compiled step, which updates the
    NNX objects in ``state`` in place; ``compiled`` and ``input_shardings`` are its."""

    def __init__(self, compiled) -> None:
        self.compiled = compiled
        self.input_shardings = compiled.input_shardings

    def __call__(self, state, batch):
        return self.compiled(state, batch), state


def parallelize_step(model: nnx.Module, optimizer, mesh: Mesh | None = None, global_batch=None,
                     local_batch=None, replicate_inputs: bool = True, microbatching=None):
    """NNX flavour of :func:`multimesh.jax.flax.parallelize_step`.

    ``model(batch)`` returns the scalar loss. ``optimizer`` is an optax
    ``GradientTransformation`` (wrapped as ``nnx.Optimizer(model, tx,
    wrt=nnx.Param)``) or an ``nnx.Optimizer`` already built for ``model``. The
    state is an :class:`NnxTrainState` holding ``model`` and the optimizer; its
    Variables are moved in place onto the submeshes of the tasks that use them,
    constrained to their partitioning metadata (``P()`` when they have none)
    as logical names. ``loss, state = step_fn(state, batch)`` updates the state
    in place (and returns it).

    Returns a :class:`~multimesh.jax.flax.ParallelizeStepResult`: ``(step_fn, state,
    mesh)`` for ``global_batch`` or ``(step_fn, state, mesh, prepare_batch)`` for
    ``local_batch``.
    """
    check_batches(global_batch, local_batch)
    mesh = default_mesh(mesh)
    if isinstance(optimizer, nnx.Optimizer):
        opt = optimizer
    else:
        check_optimizer(optimizer, allow_nnx=True)
        opt = nnx.Optimizer(model, optimizer, wrt=nnx.Param)
    state = NnxTrainState(model, opt)

    batch_avals = batch_avals_of(global_batch, local_batch)
    plan = None
    if microbatching is not None and microbatching.num_stages == "auto":
        microbatching, plan = plan_step(microbatching, lambda m, b: m(b), model, batch_avals,
                                        mesh)
    piped = microbatching is not None and microbatching.active
    if piped:
        _warn_unstepped(model)

    def train_step(state: NnxTrainState, batch):
        if replicate_inputs:
            batch = jax.tree.map(lambda x: with_sharding_constraint(x, P()), batch)
        if not piped:
            def loss_fn(m):
                return m(batch)

            loss, grads = nnx.value_and_grad(loss_fn)(state.model)
        else:
            graphdef, params, rest = _split_params(state.model)

            def loss_of(p, b):
                return nnx.merge(graphdef, p, rest)(b)

            loss, grads = microbatching.wrap(jax.value_and_grad(loss_of), batch_avals)(
                params, batch)
        state.optimizer.update(state.model, grads)
        return loss

    jitted = mjit(train_step, mesh=mesh,
                  in_shardings=(_state_specs(state), None))
    with plan if plan is not None else contextlib.nullcontext():
        compiled = jitted.lower(
            state, lowering_batch(global_batch, batch_avals, replicate_inputs)).compile()
    compiled.place(state, batch_avals)
    batch_sh = compiled.input_shardings[0][1]
    prepare_batch = make_prepare_batch(batch_sh, batch_avals)

    step_fn = _NnxStep(compiled)
    result = ParallelizeStepResult((step_fn, state, mesh, prepare_batch),
                                   length=3 if global_batch is not None else 4)
    result.plan = plan
    return result
