"""multimesh: MPMD programs for stock JAX.

The public API lives in :mod:`multimesh.jax` (and :mod:`multimesh.jax.flax`).
This top-level package stays import-light so that the passes (:mod:`multimesh.passes`)
and the runtime can use ``multimesh._src`` without pulling in the front end.
"""

__version__ = "0.1.0"


def clear_caches() -> None:
    """Empty every multimesh cache, and jax's (:func:`jax.clear_caches`).

    That is the compiled fragments shared by all programs and the programs each
    ``mjit`` function compiled; ``jax.clear_caches()`` empties them too. Programs
    you still hold keep working; the next call of an ``mjit`` function compiles again.
    """
    # local: keeps `import multimesh` light
    from multimesh._src.caches import clear_caches as _clear

    _clear()
