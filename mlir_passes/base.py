"""Pass base class: a frozen dataclass with a CLI argument, a summary and typed options.

Modelled on xDSL's ``ModulePass``: the options are the dataclass fields, spelled
in kebab-case on the command line (``mm-foo{max-iters=3}`` sets ``max_iters``).
A pass must leave verifiable IR or raise; it never half-rewrites silently.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import ClassVar

from multimesh._src.errors import DiagnosticError, PipelineError
from multimesh._src.mlir import ir

__all__ = ["ModulePass", "DiagnosticError", "option_fields", "verify_each_pass",
           "VERIFY_EACH_ENV"]

VERIFY_EACH_ENV = "MULTIMESH_VERIFY_EACH_PASS"


def verify_each_pass() -> bool:
    """``MULTIMESH_VERIFY_EACH_PASS=1``: verify the module after every pass (debugging);
    passes that run MLIR pass managers of their own verify inside them too."""
    return os.environ.get(VERIFY_EACH_ENV, "") not in ("", "0", "false", "False")


@dataclass(frozen=True)
class ModulePass:
    """Base of every multimesh pass.

    Subclasses set ``argument`` (``mm-...``) and ``summary`` (one sentence) and
    implement :meth:`apply`. The class docstring is the long description shown
    in ``docs/passes.md``.
    """

    argument: ClassVar[str]
    summary: ClassVar[str]

    def apply(self, module: ir.Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @classmethod
    def from_options(cls, options: dict[str, str]) -> ModulePass:
        """Build the pass from ``{kebab-name: text}`` options, checking names and types."""
        fields = {f.name: f for f in option_fields(cls)}
        kwargs = {}
        for key, text in options.items():
            name = key.replace("-", "_")
            if name not in fields:
                valid = ", ".join(f.name.replace("_", "-") for f in fields.values()) or "none"
                raise PipelineError(
                    f"Pass '{cls.argument}' has no option '{key}'. Valid options: {valid}.")
            kwargs[name] = _convert(cls.argument, key, text, _field_type(cls, name))
        return cls(**kwargs)

    def options_string(self) -> str:
        """The ``{k=v,...}`` suffix that rebuilds this pass (empty when all defaults)."""
        parts = []
        for f in option_fields(type(self)):
            value = getattr(self, f.name)
            if value != f.default:
                parts.append(f"{f.name.replace('_', '-')}={_format(value)}")
        return "{" + ",".join(parts) + "}" if parts else ""

    def pipeline_element(self) -> str:
        return self.argument + self.options_string()


def option_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _field_type(cls, name):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(_format(v) for v in value)
    return str(value)


def _convert(argument: str, key: str, text: str, tp):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if text in ("none", "None", ""):
            return None
        return _convert(argument, key, text, non_none[0])
    if origin is tuple:
        elem = args[0] if args else str
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        return tuple(_convert(argument, key, t, elem) for t in items)
    try:
        if tp is bool:
            if text.lower() in ("true", "1", "yes", "on"):
                return True
            if text.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError(text)
        if tp is int:
            return int(text)
        if tp is float:
            return float(text)
        if tp is str:
            return text.strip().strip('"')
    except ValueError:
        pass
    else:
        if tp not in (bool, int, float, str):
            raise PipelineError(f"Pass '{argument}' option '{key}' has unsupported type {tp}.")
    raise PipelineError(
        f"Pass '{argument}' option '{key}' expects a value of type "
        f"{getattr(tp, '__name__', tp)}, got '{text}'.")
