"""multimesh: MPMD programs for stock JAX.

The public API lives in :mod:`multimesh.jax` (and :mod:`multimesh.jax.flax`).
This top-level package stays import-light so that the passes (:mod:`multimesh.passes`,
folder ``mlir_passes/``) and the runtime can use ``multimesh._src`` without pulling in
the front end.
"""

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"


class _CheckoutPasses(importlib.abc.MetaPathFinder):
    """``multimesh.passes`` from this source checkout's ``mlir_passes/`` folder.

    Installed, the folder *is* ``multimesh.passes`` (pyproject's ``package-dir``). A
    checkout imported through ``sys.path`` (``PYTHONPATH``, a benchmark of another tree)
    would otherwise get the passes of whichever checkout the environment installed, and
    run one tree's front end with another's passes without a word.
    """

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if name != "multimesh.passes":
            return None
        return importlib.util.spec_from_file_location(
            name, os.path.join(self.folder, "__init__.py"),
            submodule_search_locations=[self.folder])


_folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "mlir_passes")
if os.path.isfile(os.path.join(_folder, "__init__.py")):
    sys.meta_path.insert(0, _CheckoutPasses(_folder))


def clear_caches() -> None:
    """Empty every multimesh cache, and jax's (:func:`jax.clear_caches`).

    That is the compiled fragments shared by all programs and the programs each
    ``mjit`` function compiled; ``jax.clear_caches()`` empties them too. Programs
    you still hold keep working; the next call of an ``mjit`` function compiles again.
    """
    from multimesh._src.caches import clear_caches as _clear

    _clear()
