"""Error classes shared by every layer.

Every user-facing error inherits :class:`MultimeshError` *and* the matching
builtin, so ``except ValueError`` keeps working for callers that do not know
about multimesh.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types


class MultimeshError(Exception):
    """Base class of every error raised by multimesh."""


class MultimeshValueError(MultimeshError, ValueError):
    """A value given to a multimesh API is invalid."""


class MultimeshTypeError(MultimeshError, TypeError):
    """An argument given to a multimesh API has the wrong type."""


class MultimeshAttributeError(MultimeshError, AttributeError):
    """A ``jax.jit`` stage attribute that a multimesh stage does not offer, and why."""


class MeshError(MultimeshValueError):
    """A task mesh is malformed or does not fit the program's devices."""


class LogicalShardingError(MultimeshValueError):
    """A logical sharding cannot be resolved onto a task's device axes."""


class PipelineError(MultimeshValueError):
    """A pass pipeline string is malformed or names an unknown pass."""


class DiagnosticError(MultimeshValueError):
    """A pass rejected the IR; carries the MLIR location of the offending op.

    ``location`` is an ``ir.Location`` (or None) so that ``mm-opt`` can print
    ``file:line:col: error: ...`` and ``--verify-diagnostics`` can match it.
    """

    def __init__(self, message: str, location=None, notes=()):
        super().__init__(message)
        self.message = message
        self.location = location
        self.notes = tuple(notes)


class IRContractError(DiagnosticError):
    """A module given to the runtime does not follow the IR contract (docs/ir.md): an
    ``mm.*`` attribute it needs is missing or of the wrong type."""


class SourceError(DiagnosticError):
    """A program that is not handed to MLIR's parser; ``line``/``col`` (1-based) say
    where, or are None for bytecode, which has no lines."""

    def __init__(self, message: str, line: int | None = None, col: int | None = None):
        super().__init__(message)
        self.line, self.col = line, col


class PassStepError(DiagnosticError):
    """A step of a pass pipeline failed: the pass's own :class:`DiagnosticError`
    (``error``, also the ``__cause__``; the message, location and notes are its) raised
    again by the pipeline, which knows the step: the pass's argument (``failed_pass``),
    its pipeline element with its options (``failed_element``, what a repro replays)
    and its position in the pipeline (``failed_index``)."""

    def __init__(self, error: DiagnosticError, failed_pass: str, failed_element: str,
                 failed_index: int):
        super().__init__(error.message, error.location, error.notes)
        self.error = error
        self.failed_pass = failed_pass
        self.failed_element = failed_element
        self.failed_index = failed_index


class PassFailure(MultimeshValueError):
    """A pass failed while compiling a program; names the pass and a repro."""

    def __init__(self, message: str, pass_argument: str, repro: str | None = None,
                 cause: BaseException | None = None):
        super().__init__(message)
        self.pass_argument = pass_argument
        self.repro = repro
        self.cause = cause


class MultimeshWarning(UserWarning):
    """Something multimesh did differently from what was asked, an option, rule or
    schedule that had no effect, or a rule that matched nothing; the program still
    compiles."""


class DiagnosticWarning(MultimeshWarning):
    """A pass's warning about the IR; carries the MLIR location it concerns (see
    :class:`DiagnosticError`), so ``mm-opt`` prints ``file:line:col: warning: ...``.

    Shown as a Python warning (a program compiled by ``mjit``), its text ends with
    ``(at file:line:col)``, the user's source line, which Python's own warning
    location (inside the pass) cannot give."""

    def __init__(self, message: str, location=None):
        super().__init__(message + _at(location))
        self.message = message
        self.location = location


def _at(location) -> str:
    """`` (at file:line:col)`` for an MLIR location that has one, else ``""``."""
    if location is None:
        return ""
    # local: the bottom layer; MLIR only when a location is given
    from multimesh._src.mlir import file_line_col

    flc = file_line_col(location)
    return f" (at {flc[0]}:{flc[1]}:{flc[2]})" if flc else ""


class DonationError(MultimeshValueError):
    """A compiled program got an argument whose buffer is gone (donated or deleted), or
    the same array both donated and passed as another argument."""


def _library_roots() -> tuple[str, ...]:
    """Where multimesh (its passes included), jax and flax live (and contextlib, which ``with``
    blocks and decorators pass through): frames a warning should not point at."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # multimesh/
    roots = [here + os.sep, os.path.abspath(contextlib.__file__)]
    for name in ("jax", "jaxlib", "flax"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            roots.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(roots)


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for a warning issued by the function that calls
    this: the first frame outside multimesh, its passes, jax and flax, i.e. the user's
    line (1, the issuing line, when every frame is the library's)."""
    roots = _library_roots()
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(roots):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1
