"""``parallelize``: the original library's entry point, compiled through ``mjit``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from multimesh._src.errors import MultimeshValueError
from multimesh.jax import _contexts
from multimesh.jax._results import ParallelizeResult
from multimesh.jax._stages.mjit import mjit
from multimesh.runtime import distributed

__all__ = ["parallelize"]


def parallelize(fun: Callable, *, init_params: Callable | None = None,
                get_input_batch: Callable | None = None, initial_batch=None,
                devices: Sequence | None = None):
    """Compiles an abstract ``fun(params, batch)`` into a sharded function.

    Returns a :class:`ParallelizeResult`: it unpacks as ``(sharded_fun,
    init_sharded_params, get_sharded_batch)`` when ``get_input_batch`` is given,
    else as ``(sharded_fun, init_sharded_params)``; all three are attributes in
    both forms.
    Parameters and the batch are placed where the task that first consumes them
    wants them.
    """
    if get_input_batch is None and initial_batch is None:
        raise MultimeshValueError(
            "multimesh.jax.parallelize requires either a get_input_batch function or an "
            "initial_batch argument.")
    if init_params is None:
        raise MultimeshValueError("multimesh.jax.parallelize requires init_params.")
    with _contexts.autoshard(True), _contexts.internal_trace():  # shapes only
        params = jax.eval_shape(init_params)
        if initial_batch is None:
            assert get_input_batch is not None  # one of the two was required above
            batch = jax.eval_shape(get_input_batch)
        else:
            batch = initial_batch
    program = mjit(fun, devices=devices, keep_unused=True)
    program.pin_committed = initial_batch is not None  # its shardings are kept (MultiMesh)
    compiled = program.lower(params, batch).compile()
    param_sh, batch_sh = compiled.input_shardings[0]

    def init_sharded_params():
        with _contexts.internal_trace():  # placed by param_sh, not by its tasks
            if jax.process_count() > 1:  # each parameter computed only by its owners
                return distributed.owner_init(init_params, param_sh)
            return jax.device_put(init_params(), param_sh)

    make_batch = get_input_batch if initial_batch is None else lambda: initial_batch
    assert make_batch is not None  # one of the two was required above

    def get_sharded_batch():
        with _contexts.internal_trace():
            return jax.device_put(make_batch(), batch_sh)

    # The original library's forms: 3 values with get_input_batch, 2 with initial_batch.
    return ParallelizeResult((compiled, init_sharded_params, get_sharded_batch),
                             length=3 if initial_batch is None else 2)
