"""The old home of the schedule library, kept as a re-export of :mod:`multimesh.schedules`.

The library moved below the passes (it has no MLIR in it, and the front end uses it
too); ``multimesh.passes.schedules`` keeps working for the docs, tools and user code
that import it by that name.
"""

from __future__ import annotations

from multimesh.schedules import *  # noqa: F403
from multimesh.schedules import __all__ as __all__  # noqa: F401
