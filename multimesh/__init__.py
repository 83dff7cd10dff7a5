"""multimesh: MPMD programs for stock JAX.

The public API lives in :mod:`multimesh.jax` (and :mod:`multimesh.jax.flax`).
This top-level package stays import-light so that :mod:`mlir_passes` and the
runtime can use ``multimesh._src`` without pulling in the front end.
"""

__version__ = "0.1.0"
