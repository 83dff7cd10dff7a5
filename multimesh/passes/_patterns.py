"""A small pattern walker for local one-for-one rewrites, in the spirit of xDSL's
``RewritePattern`` (jaxlib's bindings have no public rewrite API).

A pattern looks at one op: :meth:`RewritePattern.match` checks it (raising a
:class:`~multimesh._src.errors.DiagnosticError` at the op for what cannot apply) and
returns the rewrite to do, or None when the op is not its business. :func:`rewrite_ops`
matches every op first and rewrites after, so a pass that fails leaves the IR as it
found it and a rewrite never sees an op another one has already replaced. Outlining and
scheduling, which move whole regions, stay imperative.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from multimesh._src.mlir import ir

__all__ = ["RewritePattern", "Rewrite", "match_ops", "rewrite_ops", "ops_under"]

Rewrite = Callable[[], None]
"""One op's rewrite, run after every op was matched."""


class RewritePattern(Protocol):
    """One local rewrite: which ops it takes, and what it makes of them."""

    def match(self, op: ir.Operation) -> Rewrite | None:
        """Check ``op`` and return its rewrite (None: not this pattern's op)."""
        ...


def match_ops(ops: Iterable[ir.Operation],
              patterns: Sequence[RewritePattern]) -> list[Rewrite]:
    """Match each op of ``ops`` against ``patterns`` (the first that matches wins): the
    rewrites, in the ops' order, none run yet (every check is done)."""
    rewrites = []
    for op in ops:
        for pattern in patterns:
            rewrite = pattern.match(op)
            if rewrite is not None:
                rewrites.append(rewrite)
                break
    return rewrites


def rewrite_ops(ops: Iterable[ir.Operation], patterns: Sequence[RewritePattern]) -> int:
    """:func:`match_ops`, then run the rewrites; returns how many ops were rewritten."""
    rewrites = match_ops(ops, patterns)
    for rewrite in rewrites:
        rewrite()
    return len(rewrites)


def ops_under(root: ir.Operation) -> list[ir.Operation]:
    """Every op nested under ``root`` (``root`` included), in pre-order. Collected
    first: a pattern may raise, and the bindings turn an exception raised inside a
    ``walk`` callback into a ``RuntimeError``."""
    found: list[ir.Operation] = []

    def visit(op):
        found.append(op.operation)
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found
