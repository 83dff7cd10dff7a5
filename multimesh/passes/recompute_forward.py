"""``mm-recompute-forward``: backward fragments recompute their forward's residuals."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.mlir import ir

from . import _contract as c
from . import _recompute
from .base import ModulePass


@dataclass(frozen=True)
class RecomputeForwardPass(ModulePass):
    """Recompute, inside each backward fragment, the values its forward saved for it.

    A backward fragment (``transpose_count = 1``) reads *residuals*: results of a
    forward fragment (``transpose_count = 0``) on the same devices. For a task named
    in ``tasks`` (its forward's or its backward's name), every such residual is
    recomputed in the backward from the forward's own arguments (the stage input and
    the parameters): the ops computing it are cloned into the backward, which takes
    those arguments instead, and forward results nothing reads any more are dropped.
    Only stage inputs then stay live between a microbatch's forward and backward.
    This is ``remat=True`` for registered tasks (explicit tasks are rematerialised
    by ``jax.checkpoint`` while they are traced). Runs on the MPMD form right after
    ``mm-outline-fragments``, before ``mm-split-backward``, so a split backward
    recomputes once (in whichever half needs each value), not once per half.
    """

    argument = "mm-recompute-forward"
    summary = "Recompute forward residuals inside backward fragments of the named tasks."
    consumes = ("mpmd",)

    tasks: tuple[str, ...] = ()
    """Task names (forward or backward) whose residuals are recomputed."""

    inputs_of: tuple[str, ...] = ()
    """Task names whose residuals are re-read only where they are the forward's own
    arguments or views of them (slices, reshapes): tasks traced under
    ``jax.checkpoint``, whose backward already recomputes everything else."""

    def apply(self, module: ir.Module) -> None:
        if not self.tasks and not self.inputs_of:
            return
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            calls = c.fragment_calls(main)
            by_call = _plans(calls, funcs, set(self.tasks), set(self.inputs_of))
            for call, items in by_call.items():
                _recompute.rewrite(funcs[c.callee_of(call)], call, items)
            if by_call:
                _recompute.prune_unused_results(module, main, funcs)


def _plans(calls: list[ir.Operation], funcs: dict[str, ir.Operation], tasks: set[str],
           inputs_of: set[str]) -> dict:
    """Per backward call: ``(operand number, producer fn, producer call, slice)`` for each
    residual of a forward on the same devices, where either task is in ``tasks`` (or in
    ``inputs_of`` and the residual is a view of the forward's arguments)."""
    tag = {call: c.tag_of(funcs[c.callee_of(call)]) for call in calls}
    devices = {call: c.fragment_info(funcs[c.callee_of(call)]).devices for call in calls}
    uses: dict[str, int] = {}
    for call in calls:
        uses[c.callee_of(call)] = uses.get(c.callee_of(call), 0) + 1
    producer_of = _recompute.producers(calls)
    by_call: dict = {}
    for call in calls:
        t = tag[call]
        if t is None or t[1] != 1 or uses[c.callee_of(call)] != 1:
            continue
        for k, v in enumerate(call.operands):
            pcall, j = producer_of.get(v, (None, 0))
            pt = tag.get(pcall) if pcall is not None else None
            if pt is None or pt[1] != 0 or devices[pcall] != devices[call]:
                continue
            views = t[0] not in tasks and pt[0] not in tasks
            if views and t[0] not in inputs_of and pt[0] not in inputs_of:
                continue
            pfn = funcs[c.callee_of(pcall)]
            found = _slice(pfn, j, views)
            if found is not None:
                by_call.setdefault(call, []).append((k, pfn, pcall, found))
    return by_call


# Ops that only view their operand (or compute an index): a residual made of them
# is the forward's input, which the backward can read instead.
_VIEWS = {"stablehlo.constant", "stablehlo.slice", "stablehlo.dynamic_slice",
          "stablehlo.reshape", "stablehlo.convert", "sdy.sharding_constraint"}


def _is_view(op: ir.Operation) -> bool:
    if op.name in _VIEWS:
        return True
    return all(ir.RankedTensorType(r.type).rank == 0 for r in op.results)  # index arithmetic


def _slice(pfn: ir.Operation, j: int, views: bool = False) -> _recompute.Slice | None:
    """``(ops in order, root, argument indices)``: what computes result ``j`` of ``pfn``
    (None when ``views`` and it computes more than a view of the arguments)."""
    return _recompute.backward_slice(pfn, j, admit=_is_view if views else None)
