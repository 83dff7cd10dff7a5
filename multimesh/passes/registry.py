"""The pass registry: each ``mm-...`` argument and the module and class that implement it.

``get_all_passes()`` maps each argument to a factory that imports the pass module
lazily (as xDSL's registry does), so importing the registry stays cheap.
``docs/passes.md`` is generated from it. A module of its own (re-exported by the
package) so that the pipeline runner and the front end's door import it without
importing the package that re-exports them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .base import ModulePass

__all__ = ["get_all_passes", "pass_module_name", "register"]

# argument -> "module:Class". One module per pass; its golden test is
# tests/filecheck/<module>.mlir.
_PASSES: dict[str, str] = {
    "mm-import-gspmd": "import_gspmd:ImportGspmdPass",
    "mm-import-mpmd": "import_mpmd:ImportMpmdPass",
    "mm-verify": "verify:VerifyPass",
    "mm-match-tasks": "match_tasks:MatchTasksPass",
    "mm-inline-tasks": "inline_tasks:InlineTasksPass",
    "mm-assign-tasks": "assign_tasks:AssignTasksPass",
    "mm-resolve-logical-shardings": "resolve_logical_shardings:ResolveLogicalShardingsPass",
    "mm-outline-fragments": "outline_fragments:OutlineFragmentsPass",
    "mm-recompute-forward": "recompute_forward:RecomputeForwardPass",
    "mm-split-backward": "split_backward:SplitBackwardPass",
    "mm-recompute-transfers": "recompute_transfers:RecomputeTransfersPass",
    "mm-propagate-shardings": "propagate_shardings:PropagateShardingsPass",
    "mm-form-microbatch-loop": "form_microbatch_loop:FormMicrobatchLoopPass",
    "mm-merge-fragments": "merge_fragments:MergeFragmentsPass",
    "mm-insert-transfers": "insert_transfers:InsertTransfersPass",
    "mm-extract-fragments": "extract_fragments:ExtractFragmentsPass",
    "mm-schedule-fragments": "schedule_fragments:ScheduleFragmentsPass",
    "mm-strip-markers": "strip_markers:StripMarkersPass",
}


def _loader(spec: str) -> Callable[[], type[ModulePass]]:
    module, cls = spec.split(":")

    def load() -> type[ModulePass]:
        return getattr(importlib.import_module(f".{module}", __package__), cls)

    return load


def get_all_passes() -> dict[str, Callable[[], type[ModulePass]]]:
    """Every registered pass: ``{argument: factory returning the pass class}``."""
    return {arg: _loader(spec) for arg, spec in sorted(_PASSES.items())}


def pass_module_name(argument: str) -> str:
    """The module (and golden-test basename) that implements ``argument``."""
    return _PASSES[argument].split(":")[0]


def register(argument: str, spec: str) -> None:
    """Register an extra pass (for plugins and tests)."""
    _PASSES[argument] = spec
