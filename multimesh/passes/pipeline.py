"""Parse and run pass pipelines that mix multimesh passes with native MLIR ones.

A pipeline string looks like mlir-opt's:
``builtin.module(mm-a{opt=1},canonicalize,func.func(cse),sdy-propagation-pipeline)``.
``mm-*`` elements are our Python passes; every other element is handed verbatim
to jaxlib's ``PassManager`` (consecutive native elements share one run).
``PassManager.parse`` cannot find Python passes by name, hence this parser.

The module is verified once, after the last pass; ``MULTIMESH_VERIFY_EACH_PASS=1``
(``mm-opt --verify-each``) verifies after every pass instead. Nothing is printed
unless asked for: a caller that wants a failing pass's input replays the passes
before it (:meth:`Pipeline.input_of`).
"""

from __future__ import annotations

import difflib
import os
import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from multimesh._src.brackets import UnbalancedError, split_top
from multimesh._src.errors import DiagnosticError, PassStepError, PipelineError
from multimesh._src.mlir import ir, make_context, passmanager, print_module, unchanged_on_error

from .base import VERIFY_EACH_ENV, ModulePass, run_verifier, verify_each_pass
from .registry import get_all_passes

__all__ = ["Pipeline", "NativeStep", "parse_pipeline", "PipelineHooks", "verify_each_pass",
           "VERIFY_EACH_ENV"]

VERIFIER = "(verifier)"
"""The name of the final verification in :meth:`Pipeline.run`'s timings."""


@dataclass(frozen=True)
class NativeStep:
    """One or more native (C++) pass elements run through ``PassManager``."""

    text: str  # comma-separated elements, without the builtin.module(...) wrapper

    @property
    def argument(self) -> str:
        return self.text

    def pipeline_element(self) -> str:
        return self.text

    def replay_element(self, stem: str) -> str:
        del stem
        return self.text

    def run(self, module: ir.Module, *, verify: bool = True, snapshot: bool = True) -> None:
        """Run the passes; on failure the module is left as it was (as for ModulePass),
        unless ``snapshot=False`` (the caller rebuilds the input itself)."""
        del verify  # the PassManager verifies after each pass itself
        if not snapshot:
            self.apply(module)
            return
        with unchanged_on_error(module):
            self.apply(module)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            try:
                pm = passmanager.PassManager.parse(f"builtin.module({self.text})")
            except ValueError as e:
                raise PipelineError(_clean_native_error(str(e))) from None
            try:
                pm.run(module.operation)
            except ir.MLIRError as e:
                diags = e.error_diagnostics
                if diags:
                    d = diags[0]
                    raise DiagnosticError(
                        d.message, d.location, [n.message for n in d.notes]) from None
                raise DiagnosticError(str(e)) from None


def _clean_native_error(msg: str) -> str:
    first = msg.strip().splitlines()[0] if msg.strip() else msg
    return f"Invalid native pass pipeline: {first}"


Step = ModulePass | NativeStep


@dataclass
class PipelineHooks:
    """Callbacks around each step: IR printing, dumping, timing."""

    before: Callable[[Step, ir.Module], None] | None = None
    after: Callable[[Step, ir.Module, float], None] | None = None


@dataclass
class Pipeline:
    steps: list[Step] = field(default_factory=list)

    def __str__(self) -> str:
        return "builtin.module(" + ",".join(s.pipeline_element() for s in self.steps) + ")"

    def run(self, module: ir.Module, hooks: PipelineHooks | None = None,
            verify: bool = True, verify_each: bool | None = None,
            replay: Callable[[], ir.Module] | None = None) -> list[tuple[str, float]]:
        """Run every step in order; returns ``[(argument, seconds)]``.

        With ``verify`` the module is verified once after the last step (its time is
        the :data:`VERIFIER` entry), or after every Python pass with ``verify_each``
        (default: :func:`verify_each_pass`). Native steps are verified by MLIR's own
        pass manager. When the final verification fails and ``replay`` (a function
        returning a fresh copy of the input module) is given, the steps are replayed
        with verification after each to name the pass that broke the IR.

        Raises :class:`PassStepError` (a :class:`DiagnosticError`) for a pass's
        failure: the pass's own error with the failing step's argument
        (``failed_pass``), its options (``failed_element``) and its position in
        :attr:`steps` (``failed_index``). Without ``replay`` the module
        is then exactly the failing step's input (each step snapshots it first and
        restores it on error); with ``replay`` no snapshots are taken, the module is
        left as the failure left it, and :meth:`input_of` rebuilds the failing step's
        input from ``replay``.
        """
        if verify_each is None:
            verify_each = verify_each_pass()
        late = verify and not verify_each  # verified once, at the end
        timings = [(step.argument, self._run_step(module, index, hooks, verify and verify_each,
                                                  late, replay))
                   for index, step in enumerate(self.steps)]
        if late and any(isinstance(s, ModulePass) for s in self.steps):
            timings.append((VERIFIER, self._verify_at_end(module, replay)))
        return timings

    def _run_step(self, module: ir.Module, index: int, hooks: PipelineHooks | None,
                  verify: bool, late: bool, replay: Callable[[], ir.Module] | None) -> float:
        """Run step ``index`` with its hooks; its seconds. A failure is blamed on it."""
        step = self.steps[index]
        if hooks and hooks.before:
            hooks.before(step, module)
        t0 = time.perf_counter()
        try:
            step.run(module, verify=verify, snapshot=replay is None)
        except PassStepError:
            raise  # a pipeline inside the step named its own failing step
        except DiagnosticError as e:
            raise _in_step(e, step, index) from e
        except Exception:
            # A pass that crashes may have been handed invalid IR by an earlier one
            # (verified only at the end): name that one if so.
            if replay is not None and late and index:
                self._find_breaker(replay, index)
            raise
        dt = time.perf_counter() - t0
        if hooks and hooks.after:
            hooks.after(step, module, dt)
        return dt

    def _verify_at_end(self, module: ir.Module,
                       replay: Callable[[], ir.Module] | None) -> float:
        """The one verification after the last step; its seconds. A failure is blamed
        on the pass that broke the IR (found by replaying) or else the last pass."""
        t0 = time.perf_counter()
        try:
            _verify(module, None)
        except DiagnosticError as e:
            if replay is not None:
                self._find_breaker(replay, len(self.steps))
            last = max(i for i, s in enumerate(self.steps) if isinstance(s, ModulePass))
            raise _in_step(e, self.steps[last], last) from e
        return time.perf_counter() - t0

    def _find_breaker(self, replay: Callable[[], ir.Module], end: int) -> None:
        """Replay the first ``end`` steps verifying after every pass; raises the first
        failure (the pass that produced invalid IR), else returns."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Pipeline(self.steps[:end]).run(replay(), verify_each=True)

    def input_of(self, index: int, replay: Callable[[], ir.Module]) -> ir.Module:
        """The module that step ``index`` received: the input with the steps before it
        run again (passes are deterministic), for a failing step's repro file."""
        module = replay()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Pipeline(self.steps[:index]).run(module, verify=False)
        return module


def _in_step(e: DiagnosticError, step: Step, index: int) -> PassStepError:
    """The failure ``e`` of step ``index`` (``step``) of a pipeline, as the pipeline
    raises it."""
    return PassStepError(e, step.argument, step.pipeline_element(), index)


def _verify(module: ir.Module, argument: str | None) -> None:
    """MLIR's verifier; ``argument`` names the pass just run (None: the whole pipeline)."""
    run_verifier(module, f"'{argument}'" if argument else "The pass pipeline")


def _split_top(text: str, what: str) -> list[str]:
    """Split on commas that are not inside (), {} or quotes."""
    try:
        return split_top(text, ",", _PIPELINE_BRACKETS)
    except UnbalancedError as e:
        if e.closing:
            raise PipelineError(f"Unbalanced ')' or '}}' in {what} '{text}'.") from None
        raise PipelineError(f"Unbalanced brackets or quotes in {what} '{text}'.") from None


_PIPELINE_BRACKETS = ("({", ")}")


def _parse_options(name: str, text: str) -> dict[str, str]:
    opts = {}
    for item in _split_top(text, f"options of '{name}'"):
        # options are space- or comma-separated in mlir-opt; accept both
        for piece in item.split():
            k, eq, v = piece.partition("=")
            opts[k.strip()] = v.strip() if eq else "true"
    return opts


Element = str | ModulePass | NativeStep
"""A pipeline element: text (``mm-a{x=1}``, ``canonicalize``, or several of them
separated by commas) or a pass instance (one that holds state no option can spell,
such as ``mm-match-tasks``' in-memory rules)."""


def parse_pipeline(text: str | Sequence[Element] | Pipeline) -> Pipeline:
    """Parse ``builtin.module(...)`` (or a bare comma list) into a :class:`Pipeline`.

    A sequence may mix text with pass instances, which join the pipeline as they
    are; a :class:`Pipeline` is returned unchanged. Native elements are checked
    here, so an unknown name is reported before anything runs.
    """
    if isinstance(text, Pipeline):
        return text
    items = [text] if isinstance(text, str) else list(text)
    steps: list[Step] = []
    for item in items:
        steps += _parse_text(item) if isinstance(item, str) else [item]
    steps = _join_native(steps)
    for s in steps:
        if isinstance(s, NativeStep):
            _check_native(s)
    return Pipeline(steps)


def _parse_text(text: str) -> list[Step]:
    """The steps of one pipeline text, each native element a step of its own."""
    body = text.strip()
    if body.startswith("builtin.module(") and body.endswith(")"):
        body = body[len("builtin.module("):-1]
    elif body.startswith("builtin.module"):
        raise PipelineError(f"Malformed pass pipeline '{text}': expected 'builtin.module(...)'.")
    steps: list[Step] = []
    for elem in _split_top(body, "pass pipeline"):
        if not elem:
            raise PipelineError(f"Empty element in pass pipeline '{text}'.")
        name, brace, rest = elem.partition("{")
        if brace and not rest.endswith("}"):
            raise PipelineError(f"Malformed options in pass pipeline element '{elem}'.")
        name = name.strip()
        if name.startswith("mm-"):
            steps.append(_load_pass(name).from_options(_parse_options(name, rest[:-1])))
        else:
            steps.append(NativeStep(elem))
    return steps


def _load_pass(name: str) -> type[ModulePass]:
    """The registered pass class named ``name`` (:class:`PipelineError` if none)."""
    passes = get_all_passes()
    if name not in passes:
        raise PipelineError(
            f"'{name}' does not refer to a registered multimesh pass. "
            f"Registered passes: {', '.join(passes)}.{did_you_mean(name, passes)}")
    try:
        return passes[name]()
    except (ImportError, AttributeError) as e:
        raise PipelineError(
            f"Pass '{name}' is registered but could not be loaded: "
            f"{type(e).__name__}: {e}") from None


def _join_native(steps: list[Step]) -> list[Step]:
    """Consecutive native elements share one ``PassManager`` run (one step)."""
    out: list[Step] = []
    for s in steps:
        if isinstance(s, NativeStep) and out and isinstance(out[-1], NativeStep):
            out[-1] = NativeStep(f"{out[-1].text},{s.text}")
        else:
            out.append(s)
    return out


def _check_native(step: NativeStep) -> None:
    with make_context():
        try:
            passmanager.PassManager.parse(f"builtin.module({step.text})")
        except ValueError as e:
            raise PipelineError(_native_unknown(step.text, str(e))) from None


def _native_unknown(text: str, msg: str) -> str:
    m = re.search(r"'([^']+)' does not refer to a registered pass", msg)
    if m:
        return (f"'{m.group(1)}' does not refer to a registered pass or pass pipeline. "
                f"Run `mm-opt --list-passes` to see the available passes."
                f"{did_you_mean(m.group(1), [*get_all_passes(), *COMMON_NATIVE])}")
    return _clean_native_error(msg)


COMMON_NATIVE = ("canonicalize", "cse", "symbol-dce", "inline", "sdy-propagation-pipeline")
"""Native passes a misspelling is compared with (jaxlib lists no names of its own)."""


def did_you_mean(name: str, choices) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices`` (difflib), else ``""``."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.75)
    return f" Did you mean '{close[0]}'?" if close else ""


def dump_dir() -> str | None:
    """``MULTIMESH_DUMP_IR_TO``: where the compile hook writes IR after each pass."""
    return os.environ.get("MULTIMESH_DUMP_IR_TO") or None


def print_ir(module: ir.Module, debug_info: bool = False) -> str:
    return print_module(module, debug_info=debug_info)
