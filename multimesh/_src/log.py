"""Where compile time goes: the ``multimesh`` logger, in the voice of ``jax_log_compiles``.

Every compile logs its phases (trace and lower, each pass, the runtime plan, XLA per
fragment) on the ``multimesh`` logger. They are DEBUG records unless compile logging
is on, through jax's own flag (``jax.config.update("jax_log_compiles", True)``) or
``MULTIMESH_LOG_COMPILES=1``; then they are WARNING records and show without any
logging set-up, exactly like jax's "Finished XLA compilation of ..." lines.
"""

from __future__ import annotations

import logging
import os

import jax

__all__ = ["logger", "log_compiles", "compile_log_level", "log_phase"]

logger = logging.getLogger("multimesh")

ENV = "MULTIMESH_LOG_COMPILES"


def log_compiles() -> bool:
    """Whether compile phases are logged at WARNING (else DEBUG)."""
    if os.environ.get(ENV, "") not in ("", "0", "false", "False"):
        return True
    try:
        return bool(jax.config.jax_log_compiles)  # type: ignore[attr-defined]  # jax sets its flags as dynamic attributes
    except AttributeError:  # pragma: no cover - a jax without the flag
        return False


def compile_log_level() -> int:
    return logging.WARNING if log_compiles() else logging.DEBUG


def log_phase(label: str, what: str, seconds: float, detail: str = "") -> None:
    """One compile phase of the program ``label`` (``mjit(f)``): what, how long, details."""
    level = compile_log_level()
    if logger.isEnabledFor(level):
        logger.log(level, "%s: %s in %.3f s%s", label, what, seconds,
                   f" ({detail})" if detail else "")
