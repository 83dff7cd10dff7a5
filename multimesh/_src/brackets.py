"""Scanning bracketed text outside string literals.

Pass pipelines (``builtin.module(mm-a{x=1},cse)``), MLIR locations
(``loc(fused["a", "b"(...)])``) and whole modules are read with the same few
rules: a ``"`` opens a string literal in which ``\\`` escapes the next character,
and brackets only count outside literals. They live here once, so that the
pipeline parser, ``mm-match-tasks`` and ``mm-opt`` cannot drift apart.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["UnbalancedError", "read_string", "skip_string", "skip_balanced",
           "skip_element", "split_top", "deepest_nesting", "line_col", "ALL_BRACKETS"]

ALL_BRACKETS = ("([{<", ")]}>")
"""Every bracket pair MLIR text uses (attributes, types, locations)."""

_HEX2 = re.compile(r"[0-9a-fA-F]{2}")


class UnbalancedError(ValueError):
    """Brackets or quotes that do not pair up; ``closing`` is True for a stray closer."""

    def __init__(self, text: str, closing: bool):
        super().__init__(f"unbalanced {'closing bracket' if closing else 'brackets or quotes'}"
                         f" in {text!r}")
        self.closing = closing


def read_string(s: str, i: int) -> tuple[str, int]:
    """Decode the MLIR string literal starting at ``s[i] == '"'``: ``(text, end)``.

    Handles ``\\"``, ``\\\\``, ``\\n`` and two-digit hex escapes (``\\22``), as
    MLIR prints them; ``end`` is the index after the closing quote.
    """
    out, j, n = [], i + 1, len(s)
    while j < n and s[j] != '"':
        ch = s[j]
        if ch == "\\" and j + 1 < n:
            text, j = _escape(s, j)
            out.append(text)
            continue
        out.append(ch)
        j += 1
    return "".join(out), j + 1


def _escape(s: str, j: int) -> tuple[str, int]:
    """The escape sequence at ``s[j] == '\\'``: ``(decoded text, index after it)``."""
    nxt = s[j + 1]
    if nxt in '"\\':
        return nxt, j + 2
    if nxt == "n":
        return "\n", j + 2
    if _HEX2.fullmatch(s, j + 1, j + 3):
        return chr(int(s[j + 1:j + 3], 16)), j + 3
    return "\\", j + 1


def skip_string(s: str, i: int) -> int:
    """The index after the string literal that starts at ``s[i] == '"'``."""
    j, n = i + 1, len(s)
    while j < n:
        ch = s[j]
        if ch == "\\":
            j += 2
        elif ch == '"':
            return j + 1
        else:
            j += 1
    return n


def skip_balanced(s: str, i: int, brackets: tuple[str, str] = ALL_BRACKETS) -> int:
    """The index after the bracketed group that opens at ``s[i]`` (or ``len(s)``)."""
    end = skip_element(s, i + 1, "", brackets)  # "" is no separator: up to the closer
    return min(end + 1, len(s))


def skip_element(s: str, i: int, sep: str = ",",
                 brackets: tuple[str, str] = ALL_BRACKETS) -> int:
    """The index of the ``sep`` or closing bracket that ends the list element at ``s[i]``."""
    opening, closing = brackets
    depth, n = 0, len(s)
    while i < n:
        ch = s[i]
        if ch == '"':
            i = skip_string(s, i)
            continue
        if ch in opening:
            depth += 1
        elif ch in closing:
            if depth == 0:
                return i
            depth -= 1
        elif ch == sep and depth == 0:
            return i
        i += 1
    return i


def split_top(text: str, sep: str = ",",
              brackets: tuple[str, str] = ALL_BRACKETS) -> list[str]:
    """Split ``text`` on ``sep`` outside brackets and string literals; parts are stripped.

    A stray closing bracket or an unclosed bracket or literal is an
    :class:`UnbalancedError`. A blank ``text`` gives ``[]``.
    """
    if not text.strip():
        return []
    parts, start, i, n = [], 0, 0, len(text)
    while i < n:
        end = skip_element(text, i, sep, brackets)
        if end < n and text[end] != sep:  # a closing bracket at depth 0
            raise UnbalancedError(text, closing=True)
        parts.append(text[start:end].strip())
        start = i = end + 1
        if end < n and start >= n:  # a trailing separator: one more, empty part
            parts.append("")
    if start < n:
        parts.append(text[start:].strip())
    if not _balanced(text, brackets):
        raise UnbalancedError(text, closing=False)
    return parts


def _balanced(text: str, brackets: tuple[str, str]) -> bool:
    """Whether every bracket and literal of ``text`` is closed."""
    opening, closing = brackets
    depth, i, n = 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == '"':
            if text.find('"', i + 1) < 0:
                return False
            i = skip_string(text, i)
            continue
        depth += (ch in opening) - (ch in closing)
        i += 1
    return depth == 0


_NOT_BRACKETS = re.compile(r'"(?:[^"\\\n]|\\.)*"|//[^\n]*')


def deepest_nesting(text: str, limit: int) -> tuple[int, int]:
    """``(depth, offset)``: how deep ``text`` nests ``{[(`` outside strings and ``//``
    comments, and where it first goes deeper than ``limit``; ``(0, 0)`` when it
    cannot exceed ``limit`` at all (vectorised: modules can be hundreds of MB)."""
    if sum(text.count(b) for b in "{[(") <= limit:
        return 0, 0
    clean = _NOT_BRACKETS.sub(lambda m: " " * len(m.group(0)), text)  # offsets kept
    b = np.frombuffer(clean.encode("utf-32-le"), dtype=np.uint32)
    step = (np.isin(b, (ord("{"), ord("["), ord("("))).astype(np.int32)
            - np.isin(b, (ord("}"), ord("]"), ord(")"))).astype(np.int32))
    depth = np.cumsum(step)
    deepest = int(depth.max(initial=0))
    if deepest <= limit:
        return deepest, 0
    return deepest, int(np.argmax(depth > limit))


def line_col(text: str, offset: int) -> tuple[int, int]:
    """1-based line and column of ``offset`` in ``text``, as MLIR diagnostics count them."""
    return text.count("\n", 0, offset) + 1, offset - (text.rfind("\n", 0, offset) + 1) + 1
