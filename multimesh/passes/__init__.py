"""multimesh's MLIR passes and their registry.

``get_all_passes()`` maps each ``mm-...`` argument to a factory that imports
the pass module lazily (as xDSL's registry does, ``registry.py``), so importing this
package stays cheap. ``docs/passes.md`` is generated from this registry.
"""

from __future__ import annotations

from .registry import get_all_passes as get_all_passes
from .registry import pass_module_name as pass_module_name
from .registry import register as register

_DOOR = ("PipelineOptions", "SplitBackward", "build_pipeline")


def __getattr__(name: str):
    """The front end's door (``multimesh.passes.api``), loaded on first use so that
    importing the registry stays cheap."""
    if name in _DOOR:
        # local: importing the registry stays cheap; the door loads on first use
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
