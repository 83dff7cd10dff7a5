"""Pass base class: a frozen dataclass with a CLI argument, a summary and typed options.

Modelled on xDSL's ``ModulePass``: the options are the dataclass fields, spelled
in kebab-case on the command line (``mm-foo{max-iters=3}`` sets ``max_iters``).
A pass must leave verifiable IR or raise; :meth:`ModulePass.run` (what pipelines
and ``mm-opt`` call) also leaves the module exactly as it was when it raises.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from multimesh._src.errors import DiagnosticError, PipelineError
from multimesh._src.mlir import ir, unchanged_on_error

from ._stages import check_stage

__all__ = ["ModulePass", "DiagnosticError", "option_fields", "NOT_AN_OPTION", "verify_module",
           "verify_each_pass", "VERIFY_EACH_ENV"]

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
    consumes: ClassVar[tuple[str, ...] | None] = None
    """The forms of docs/ir.md the pass accepts (``multimesh.passes._stages.STAGES``); None: any."""
    requires: ClassVar[tuple[str, ...]] = ()
    """Passes that must have run before, besides those that reach ``consumes``."""
    mutates: ClassVar[bool] = True
    """False for passes that only read the module (no snapshot is taken for them)."""

    def apply(self, module: ir.Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, module: ir.Module, *, verify: bool = True, snapshot: bool = True) -> None:
        """Apply the pass and verify the result; on any error the module is unchanged.

        This is the pass contract (tests/test_pass_contract.py checks it for every
        registered pass): a failing pass, or one that leaves invalid IR, raises and
        leaves ``module`` exactly as it was, so a repro can be written from it. That
        takes a snapshot of the module first; a caller that can rebuild the pass's
        input another way (a pipeline replaying the passes before it) passes
        ``snapshot=False`` and verifies once at the end (``verify=False``).
        """
        if self.consumes is not None:
            check_stage(module, self.argument, self.consumes, self.requires)
        if not self.mutates:
            self.apply(module)
            return
        if not snapshot:
            self.apply(module)
            if verify:
                verify_module(module, self.argument)
            return
        with unchanged_on_error(module):
            self.apply(module)
            if verify:
                verify_module(module, self.argument)

    def bad_option(self, field: str, valid: str) -> PipelineError:
        """The error for option ``field``'s value: ``valid`` says what it may be."""
        return PipelineError(
            f"Pass '{self.argument}' option '{field.replace('_', '-')}' must be {valid}, got "
            f"{_format(getattr(self, field))}.")

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

    def replay_element(self, stem: str) -> str:
        """The pipeline element that replays this pass from the command line.

        Usually :meth:`pipeline_element`. A pass that holds state no option can spell
        (``mm-match-tasks``' in-memory rules) writes it to files whose paths start
        with ``stem`` and names them in the options it returns.
        """
        del stem
        return self.pipeline_element()


NOT_AN_OPTION = {"option": False}
"""Field metadata of a pass field that is state given in Python, not a CLI option."""


def generated_doc(make_doc) -> dict:
    """Field metadata of an option whose description is made when asked (``make_doc()``,
    from a registry), not written beside the field: ``mm-opt --list-passes`` prints it
    and docs/passes.md shows it in place of an attribute docstring."""
    return {"doc": make_doc}


def option_doc(f: dataclasses.Field) -> str | None:
    """The generated description of option ``f`` (:func:`generated_doc`), if it has one."""
    make = f.metadata.get("doc")
    return make() if make is not None else None


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields that are options: spelled in pipelines, listed in docs/passes.md."""
    return [f for f in dataclasses.fields(cls)
            if f.init and f.metadata.get("option", True)]


def _field_type(cls, name):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _format(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        text = ",".join(_format(v) for v in value)
        return "{" + text + "}" if len(value) > 1 else text  # braced: commas split options
    return str(value)


def _convert(argument: str, key: str, text: str, tp):
    """An option's text as a value of its field's type ``tp``: optional, tuple or scalar."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if text in ("none", "None", ""):
            return None
        return _convert(argument, key, text, next(a for a in args if a is not type(None)))
    if origin is tuple:
        elem = args[0] if args else str
        if text.startswith("{") and text.endswith("}"):  # several: {a,b} (see _format)
            text = text[1:-1]
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        return tuple(_convert(argument, key, t, elem) for t in items)
    convert = _SCALARS.get(tp)
    if convert is None:
        raise PipelineError(f"Pass '{argument}' option '{key}' has unsupported type {tp}.")
    try:
        return convert(text)
    except ValueError:
        raise PipelineError(
            f"Pass '{argument}' option '{key}' expects a value of type "
            f"{getattr(tp, '__name__', tp)}, got '{text}'.") from None


def _to_bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise ValueError(text)


_SCALARS: dict[type, Callable[[str], object]] = {
    bool: _to_bool, int: int, float: float, str: lambda t: t.strip().strip('"')}


def verify_module(module: ir.Module, argument: str) -> None:
    """MLIR's verifier after pass ``argument``: :class:`DiagnosticError` at the bad op."""
    run_verifier(module, f"'{argument}'")


def run_verifier(module: ir.Module, who: str) -> None:
    """MLIR's verifier; a failure is a :class:`DiagnosticError` at the bad op saying
    that ``who`` (the pass, or the pipeline) produced invalid IR."""
    try:
        ok = module.operation.verify()
    except ir.MLIRError as e:
        d = e.error_diagnostics[0] if e.error_diagnostics else None
        raise DiagnosticError(
            f"{who} produced invalid IR: {d.message if d else e}",
            d.location if d else None) from None
    if not ok:  # pragma: no cover - verify raises in these bindings
        raise DiagnosticError(f"{who} produced invalid IR.")
