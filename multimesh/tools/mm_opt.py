"""``mm-opt``: run multimesh and native MLIR passes on a saved module, like ``mlir-opt``.

Flags are a subset of mlir-opt's with the same spellings, so golden tests read
like MLIR/Shardy ones. Differences from mlir-opt (also listed in ``--help``):
passes are module-level only, ``--mlir-print-ir-*`` dumps once per pipeline step
(consecutive native passes form one step), and diagnostics without a location
(or at the implicit top-level module's ``0:0``) are reported at ``file:1:1``
(``expected-error@unknown`` matches them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import stat
import sys
import tempfile
import time
import traceback
import types
import typing
import warnings
from collections.abc import Sequence

import jaxlib.version as jaxlib_version

import multimesh
from multimesh._src.errors import (
    DiagnosticError,
    DiagnosticWarning,
    MultimeshError,
    PipelineError,
)
from multimesh._src.ir_attrs import MAX_NESTING, SourceError, decode_source, is_bytecode
from multimesh._src.mlir import (
    file_line_col,
    ir,
    make_context,
    module_bytecode,
    print_module,
)
from multimesh._src.stack import STACK_BYTES, on_big_stack
from multimesh.passes import get_all_passes
from multimesh.passes.base import option_doc, option_fields
from multimesh.passes.pipeline import (
    COMMON_NATIVE,
    VERIFIER,
    PipelineHooks,
    did_you_mean,
    parse_pipeline,
)

__all__ = ["main"]

PROG = "mm-opt"
SPLIT_MARKER = "// -----"
_SPLIT_RE = re.compile(r"^[ \t]*// -----")
_DIRECTIVE_RE = re.compile(
    r"expected-(error|warning|note|remark)(-re)?"
    r"(?:@(above|below|unknown|[+-]\d+))?\s*\{\{(.*)\}\}\s*$")
_SEVERITY = {
    ir.DiagnosticSeverity.ERROR: "error",
    ir.DiagnosticSeverity.WARNING: "warning",
    ir.DiagnosticSeverity.NOTE: "note",
    ir.DiagnosticSeverity.REMARK: "remark",
}
# MLIR attaches the failing op to verifier errors; mlir-opt turns that off under
# --verify-diagnostics, we drop the note instead.
_OP_NOTE_PREFIX = "see current operation:"


class _Failure(Exception):
    """Aborts the run with exit code 1 after a message was printed."""


@dataclasses.dataclass
class Diag:
    """One diagnostic in printable form; ``line`` is None for unknown locations."""

    severity: str
    message: str
    file: str | None = None
    line: int | None = None
    col: int | None = None
    notes: list[Diag] = dataclasses.field(default_factory=list)

    def flatten(self) -> list[Diag]:
        out = [self]
        for n in self.notes:
            out.extend(n.flatten())
        return out


@dataclasses.dataclass
class Expected:
    severity: str
    text: str
    regex: bool
    line: int | None  # None: @unknown
    dir_line: int
    dir_col: int
    matched: bool = False

    def matches(self, message: str) -> bool:
        if not self.regex:
            return self.text in message
        parts = re.split(r"\{\{(.*?)\}\}", self.text)
        pattern = "".join(p if i % 2 else re.escape(p) for i, p in enumerate(parts))
        return re.search(pattern, message) is not None


@dataclasses.dataclass
class Chunk:
    text: str | bytes  # bytecode is one chunk; text is padded with newlines so that line numbers match the original file
    first_line: int  # 1-based line of the chunk's first line in the original file


# ----------------------------------------------------------------------------- CLI


class _CommandLineParser(argparse.ArgumentParser):
    """argparse, with the registered ``mm-*`` passes appended to ``--help`` and a
    suggestion for a misspelt flag."""

    def format_help(self) -> str:
        return super().format_help() + "\n" + _passes_help()

    def error(self, message: str):
        if message.startswith("unrecognized arguments:"):
            known = [o for o in self._option_string_actions if o.startswith("--")]
            known += [f"--{arg}" for arg, _cls, _summary in _load_passes()]
            for token in message.split(":", 1)[1].split():
                hint = did_you_mean(token.split("=", 1)[0], known)
                if hint:
                    message += f" ({token}:{hint})"
        super().error(message)


_SWITCHES = (
    ("--split-input-file",
     f"split the input on '{SPLIT_MARKER}' lines and process each chunk independently"),
    ("--verify-diagnostics",
     "check that emitted diagnostics match expected-* lines in the input"),
    ("--allow-unregistered-dialect", "allow operations of unregistered dialects"),
    ("--mlir-print-ir-before-all", "print the IR before every pipeline step (stderr)"),
    ("--mlir-print-ir-after-all", "print the IR after every pipeline step (stderr)"),
    ("--mlir-print-ir-after-failure", "print the IR after the step that failed (stderr)"),
    ("--mlir-print-debuginfo", "print locations in the output and IR dumps"),
    ("--emit-bytecode", "write the output as MLIR bytecode (the input may be text or "
                        "bytecode, told apart by bytecode's magic bytes)"),
    ("--mlir-print-op-generic", "print operations in generic form"),
    ("--mlir-timing", "print a per-pass wall-time report (stderr)"),
    ("--verify-each", "verify the IR after every pass (default: once, after the last "
                      "pass; also MULTIMESH_VERIFY_EACH_PASS=1)"),
    ("--dump-pass-pipeline", "print the parsed pipeline (stderr)"),
    ("--list-passes", "list the registered multimesh passes and exit"),
    ("--version", "print the multimesh and jaxlib versions and exit"),
)
"""mm-opt's on/off flags, in ``--help`` order."""


def _make_parser() -> argparse.ArgumentParser:
    p = _CommandLineParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "multimesh modular optimizer driver (an mlir-opt work-alike).\n\n"
            "Differences from mlir-opt: passes run on the module only (native\n"
            "passes may nest, e.g. func.func(cse)); IR dumps happen once per\n"
            "pipeline step (consecutive native passes are one step); diagnostics\n"
            "without a location (or at the implicit module's 0:0) are reported at\n"
            "file:1:1 (expected-error@unknown)."),
    )
    p.add_argument("input", nargs="?", default="-",
                   help="input file ('-' or none: stdin)")
    p.add_argument("-o", dest="output", default="-", metavar="FILE",
                   help="output file ('-': stdout); written atomically, only on success")
    p.add_argument("-p", "--pass-pipeline", dest="pipeline", default=None,
                   metavar="PIPELINE",
                   help="textual pass pipeline, e.g. 'builtin.module(mm-verify,canonicalize)'; "
                        "or give passes as flags in order, as mlir-opt does: "
                        "--mm-verify --mm-assign-tasks=num-devices=8 --canonicalize")
    for flag, help_text in _SWITCHES:
        p.add_argument(flag, action="store_true", help=help_text)
    for when in ("before", "after"):
        p.add_argument(f"--mlir-print-ir-{when}", action="append", default=[],
                       metavar="PASS", help=f"print the IR {when} every step that runs PASS "
                       f"(stderr; repeat it or separate passes by commas)")
    return p


def _pass_flags(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` without its ``--<pass>[=options]`` flags, and those as pipeline elements
    (``--mm-assign-tasks=num-devices=8`` is ``mm-assign-tasks{num-devices=8}``)."""
    rest: list[str] = []
    elements: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return rest + argv[i:], elements
        name, eq, options = arg[2:].partition("=")
        if arg.startswith("--") and arg.split("=")[0] not in parser._option_string_actions \
                and _is_pass(name):
            elements.append(f"{name}{{{options}}}" if eq else name)
        else:
            rest.append(arg)
    return rest, elements


def _is_pass(name: str) -> bool:
    """Whether ``name`` is a registered multimesh pass or a native one jaxlib knows."""
    if not name or not re.fullmatch(r"[\w.-]+", name):
        return False
    if name.startswith("mm-"):
        return any(arg == name for arg, _cls, _summary in _load_passes())
    try:
        parse_pipeline(f"builtin.module({name})")
    except MultimeshError:
        return False
    return True


def _load_passes() -> list[tuple[str, type | None, str]]:
    """``[(argument, class or None, summary or load error)]``; never raises."""
    out: list[tuple[str, type | None, str]] = []
    for arg, factory in get_all_passes().items():
        try:
            cls = factory()
        except Exception as e:  # a pass module that does not exist yet or is broken
            out.append((arg, None, f"(not available: {type(e).__name__}: {e})"))
            continue
        out.append((arg, cls, getattr(cls, "summary", "")))
    return out


def _passes_help() -> str:
    lines = ["multimesh passes (use in -p, e.g. 'builtin.module(mm-verify)'):"]
    for arg, _cls, summary in _load_passes():
        lines.append(f"  {arg:<32} {summary}")
    lines.append("")
    lines.append("Any other pipeline element (canonicalize, cse, sdy-*, func.func(...)) is")
    lines.append("run by jaxlib's native PassManager.")
    return "\n".join(lines) + "\n"


def _list_passes(out) -> None:
    """Each pass, its summary and its options as ``name=<type> (default: value)``."""
    for arg, cls, summary in _load_passes():
        out.write(f"  {arg}\n    {summary}\n")
        if cls is None:
            continue
        hints = typing.get_type_hints(cls)
        for f in option_fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING
                else None)
            out.write(f"      {f.name.replace('_', '-')}=<{_type_name(hints[f.name])}> "
                      f"(default: {default!r})\n")
            doc = option_doc(f)  # made from a registry (the schedules)
            if doc:
                out.write("".join(f"        {line}\n" for line in doc.splitlines()))


def _type_name(tp) -> str:
    """An option's type as ``--list-passes`` shows it: ``int``, ``string``, ``int,...``,
    ``int or none``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        named = " or ".join(_type_name(a) for a in inner)
        return named + (" or none" if len(inner) < len(args) else "")
    if origin is tuple:
        return f"{_type_name(args[0])},..." if args else "list"
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    return {str: "string", bool: "bool", int: "int", float: "number"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _version() -> str:
    return f"multimesh {multimesh.__version__}\njaxlib {jaxlib_version.__version__}\n"


# ------------------------------------------------------------------------ driver


# MLIR's parser, verifier and printer recurse once per nesting level: mm-opt runs on
# a thread with a STACK_BYTES stack (multimesh/_src/stack.py) and refuses inputs
# nested deeper than MAX_NESTING (multimesh._src.ir_attrs.check_source).
__all__ += ["MAX_NESTING", "STACK_BYTES"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mm-opt`` console script; returns the exit code."""
    parser = _make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, elements = _pass_flags(parser, argv)
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help exits 0, usage errors exit 2
        return int(e.code or 0)
    if elements:
        if args.pipeline is not None:
            sys.stderr.write(f"{PROG}: error: give the passes either as -p PIPELINE or as "
                             f"--<pass> flags, not both (got -p and "
                             f"{', '.join('--' + e.split('{')[0] for e in elements)})\n")
            return 2
        args.pipeline = f"builtin.module({','.join(elements)})"
    try:
        return on_big_stack(lambda: _main(args), name=PROG)
    except KeyboardInterrupt:  # pragma: no cover
        return 130


def _main(args: argparse.Namespace) -> int:
    try:
        return _Driver(args).run()
    except _Failure:
        return 1
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    except Exception as e:  # a bug in mm-opt or a pass: no traceback for users
        _internal_error(e)
        return 1


def _internal_error(e: BaseException, where: str = "") -> None:
    where = f" in '{where}'" if where else ""
    sys.stderr.write(f"{PROG}: internal error{where}: {type(e).__name__}: {e}\n")
    if os.environ.get("MULTIMESH_TRACEBACK"):
        traceback.print_exception(e, file=sys.stderr)
    else:
        sys.stderr.write(f"{PROG}: note: set MULTIMESH_TRACEBACK=1 to see the traceback\n")


def _read_input(path: str | None, display: str, split: bool = False) -> str | bytes:
    """The input: text (checked UTF-8) or bytecode, after multimesh's source guard."""
    if path in ("-", None):
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read()
    else:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            sys.stderr.write(f"{PROG}: error: could not open input file "
                             f"'{path}': {e.strerror or e}\n")
            raise _Failure from None
    if split and is_bytecode(data):
        sys.stderr.write(f"{display}:1:1: error: --split-input-file needs text input, got "
                         f"MLIR bytecode\n")
        raise _Failure
    try:
        return decode_source(data)
    except SourceError as e:
        sys.stderr.write(f"{display}:{e.line or 1}:{e.col or 1}: error: {e.message}\n")
        raise _Failure from None


def _output_mode(path: str) -> int:
    """The mode of the file written: an existing file's own, else 0666 less the umask
    (as ``open`` and mlir-opt create it)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _write_output(path: str | None, text: str | bytes) -> None:
    """Write the result to stdout, or to ``path`` atomically (a temporary file, renamed)."""
    if path in ("-", None):
        if isinstance(text, bytes):
            stream = getattr(sys.stdout, "buffer", None)
            if stream is None:  # a text-only stream (tests): bytecode as latin-1
                sys.stdout.write(text.decode("latin-1"))
            else:
                sys.stdout.flush()
                stream.write(text)
                stream.flush()
            return
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".mm-opt-", suffix=".tmp", dir=directory)
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot write '{path}': {e.strerror or e}\n")
        raise _Failure from None
    try:
        os.fchmod(fd, _output_mode(path))  # mkstemp's 0600 would narrow it
        with os.fdopen(fd, "wb") as f:
            f.write(text if isinstance(text, bytes) else text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            sys.stderr.write(f"{PROG}: error: cannot write '{path}': {e.strerror or e}\n")
            raise _Failure from None
        raise


def _print_ir_names(values: list[str], when: str) -> set[str]:
    """The passes of ``--mlir-print-ir-<when>=a,b``; each must be a pass."""
    names = {n.strip() for v in values for n in v.split(",") if n.strip()}
    for name in sorted(names):
        if not _is_pass(name):
            known = [arg for arg, _cls, _summary in _load_passes()]
            sys.stderr.write(f"{PROG}: error: --mlir-print-ir-{when}: '{name}' is not a "
                             f"registered pass.{did_you_mean(name, known + list(COMMON_NATIVE))} "
                             f"Run `mm-opt --list-passes` to see the multimesh passes.\n")
            raise _Failure
    return names


def _step_names(step) -> set[str]:
    """The pass names a pipeline step runs (a native step may run several)."""
    text = getattr(step, "text", None)
    if text is None:
        return {step.argument}
    return {e.split("{")[0].split("(")[0].strip() for e in text.split(",")}


def _print_timing(timings: dict[str, float]) -> None:
    """``--mlir-timing``: the time of each step, as MLIR's execution time report."""
    total = timings.get("(total)", 0.0) or 1e-12
    bar = "===" + "-" * 73 + "==="
    w = sys.stderr.write
    w(f"{bar}\n{'... Execution time report ...':^79}".rstrip() + f"\n{bar}\n")
    w(f"  Total Execution Time: {total:.4f} seconds\n\n")
    w("  ----Wall Time----  ----Name----\n")
    for name, dt in timings.items():
        if name != "(total)":
            w(f"  {dt:10.4f} ({100 * dt / total:5.1f}%)  {name}\n")
    w(f"  {total:10.4f} (100.0%)  Total\n")


class _Driver:
    """One mm-opt invocation: read, split, parse, run, check, write."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.display = "<stdin>" if args.input in ("-", None) else args.input
        self.diag = _Diagnostics(self.display)
        self.timings: dict[str, float] = {}
        self.current_step: str | None = None
        self.print_before: set[str] = set()
        self.print_after: set[str] = set()

    def run(self) -> int:
        a = self.args
        if a.version:
            sys.stdout.write(_version())
            return 0
        if a.list_passes:
            _list_passes(sys.stdout)
            return 0
        pipeline = self._parse_pipeline()
        self.print_before = _print_ir_names(a.mlir_print_ir_before, "before")
        self.print_after = _print_ir_names(a.mlir_print_ir_after, "after")
        if pipeline is not None and a.dump_pass_pipeline:
            sys.stderr.write(f"Pass Manager with {len(pipeline.steps)} steps:\n{pipeline}\n")
        chunks = self._chunks(_read_input(a.input, self.display, a.split_input_file))

        ctx = make_context()
        if a.allow_unregistered_dialect:
            ctx.allow_unregistered_dialects = True
        emitted: list[Diag] = []

        def handler(d):
            emitted.append(self.diag.from_ir_diag(d))
            return True

        handle = ctx.attach_diagnostic_handler(handler)
        outputs: list = []
        ok = True
        try:
            for chunk in chunks:
                emitted.clear()
                t0 = time.perf_counter()
                out, diags = self._process(chunk, ctx, pipeline)
                ok &= self._report(chunk, emitted + diags)
                outputs.append(out if out is not None else "")
                self._time("(total)", time.perf_counter() - t0)
        finally:
            handle.detach()  # type: ignore[attr-defined]  # the stubs type the handle as object
        if a.mlir_timing:
            _print_timing(self.timings)
        if not ok and a.output not in ("-", None):
            return 1
        _write_output(a.output, _join(outputs, a.emit_bytecode))
        return 0 if ok else 1

    def _chunks(self, text: str | bytes) -> list[Chunk]:
        """The input's chunks (one unless --split-input-file splits text)."""
        a = self.args
        if isinstance(text, bytes) and a.split_input_file:
            sys.stderr.write(f"{self.display}:1:1: error: --split-input-file needs text "
                             f"input, got MLIR bytecode\n")
            raise _Failure
        if a.emit_bytecode and a.split_input_file:
            sys.stderr.write(f"{PROG}: error: --emit-bytecode writes one module; it does "
                             f"not combine with --split-input-file\n")
            raise _Failure
        if isinstance(text, bytes):
            return [Chunk(text, 1)]
        self.diag.source_lines = text.splitlines()
        return _split(text) if a.split_input_file else [Chunk(text, 1)]

    def _report(self, chunk: Chunk, diags: list[Diag]) -> bool:
        """Check (``--verify-diagnostics``) or print one chunk's diagnostics; whether
        the chunk passed."""
        if self.args.verify_diagnostics:
            return self.diag.verify(chunk, diags)
        for d in diags:
            self.diag.print_diag(d)
        return not any(d.severity == "error" for d in diags)

    # -- the pipeline

    def _parse_pipeline(self):
        if self.args.pipeline is None:
            return None
        try:
            return parse_pipeline(self.args.pipeline)
        except MultimeshError as e:
            sys.stderr.write(f"{PROG}: error: {e}\n")
            raise _Failure from None

    # -- one chunk

    def _process(self, chunk: Chunk, ctx: ir.Context,
                 pipeline) -> tuple[str | bytes | None, list[Diag]]:
        """Parse and transform one chunk; returns (printed IR or None, diagnostics)."""
        t0 = time.perf_counter()
        try:
            with ctx:
                module = ir.Module.parse(chunk.text)
        except ir.MLIRError as e:
            diags = [self.diag.from_ir_diag(d) for d in e.error_diagnostics]
            return None, diags or [Diag("error", str(e), None, None, None)]
        self._time("Parser", time.perf_counter() - t0)
        warned: list[Diag] = []
        if pipeline is not None:
            failure, warned = self._transform(chunk, ctx, pipeline, module)
            if failure is not None:
                return None, failure
        return self._output(module, ctx, warned)

    def _transform(self, chunk: Chunk, ctx: ir.Context, pipeline,
                   module: ir.Module) -> tuple[list[Diag] | None, list[Diag]]:
        """Run the pipeline on one chunk's module: (the failure's diagnostics, or None;
        the passes' warnings). A bad pipeline option or an internal error ends mm-opt."""
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", DiagnosticWarning)
                # The passes need no snapshots when a failure's input can be rebuilt
                # from the chunk (not for --mlir-print-ir-after-failure, which
                # prints the module as the failure left it).
                replay = None if self.args.mlir_print_ir_after_failure else \
                    (lambda: ir.Module.parse(chunk.text, ctx))
                self._run_pipeline(pipeline, module, replay)
            return None, self._warning_diags(caught)
        except DiagnosticError as e:
            self._dump_failure(module)
            return [self.diag.from_error(e, chunk)], []
        except ir.MLIRError as e:
            self._dump_failure(module)
            return [self.diag.from_ir_diag(d) for d in e.error_diagnostics] or [
                Diag("error", str(e))], []
        except PipelineError as e:
            sys.stderr.write(f"{PROG}: error: {e}\n")
            raise _Failure from None
        except MultimeshError as e:
            self._dump_failure(module)
            return [Diag("error", str(e))], []
        except Exception as e:
            _internal_error(e, self.current_step or "")
            raise _Failure from None

    def _warning_diags(self, caught: list[warnings.WarningMessage]) -> list[Diag]:
        """A pass's warnings are diagnostics, like MLIR's; other warnings pass through."""
        warned = []
        for w in caught:
            if isinstance(w.message, DiagnosticWarning):
                f, line, col = self.diag.from_loc(w.message.location)
                warned.append(Diag("warning", w.message.message, f, line, col))
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return warned

    def _output(self, module: ir.Module, ctx: ir.Context,
                warned: list[Diag]) -> tuple[str | bytes | None, list[Diag]]:
        """The printed module (bytecode with --emit-bytecode), unless it cannot be
        parsed again."""
        t0 = time.perf_counter()
        if self.args.emit_bytecode:
            data = module_bytecode(module)
            self._time("Output", time.perf_counter() - t0)
            return data, warned
        out = self._print(module)
        self._time("Output", time.perf_counter() - t0)
        if _EMPTY_SYMBOL in out:
            return None, [Diag(
                "error", f"the result cannot be parsed again: an empty symbol name prints as "
                f"@{_EMPTY_SYMBOL} (a symbol, callee or custom call target is \"\"); name it",
                None, None, None)]
        if "mpmd." in out and not _reparses(out, ctx):
            return None, [Diag(
                "error", "the result cannot be parsed again: jaxlib's mpmd dialect prints "
                "some attributes (an origin name with a '\"') in a form it cannot read back; "
                "rename them", None, None, None)]
        return out, warned

    def _run_pipeline(self, pipeline, module: ir.Module, replay=None) -> None:
        a = self.args

        def before(step, mod):
            self.current_step = step.argument
            if a.mlir_print_ir_before_all or _step_names(step) & self.print_before:
                self._dump(f"IR Dump Before {step.argument}", mod)

        def after(step, mod, dt):
            self._time(step.argument, dt)
            if a.mlir_print_ir_after_all or _step_names(step) & self.print_after:
                self._dump(f"IR Dump After {step.argument}", mod)

        self.current_step = None
        timings = pipeline.run(module, PipelineHooks(before=before, after=after),
                               verify_each=True if a.verify_each else None, replay=replay)
        for name, dt in timings:  # the final verification is no step: time it here
            if name == VERIFIER:
                self._time("Verifier", dt)

    # -- printing

    def _print(self, module) -> str:
        text = print_module(module, debug_info=self.args.mlir_print_debuginfo,
                            generic=self.args.mlir_print_op_generic)
        if self.args.mlir_print_debuginfo:  # the parser names every buffer "-"
            esc = self.display.replace("\\", "\\\\").replace('"', '\\"')
            text = _BUFFER_LOC.sub(lambda m: f'"{esc}":{m.group(1)}:{m.group(2)}', text)
        return text

    def _dump(self, title: str, module) -> None:
        sys.stderr.write(f"// -----// {title} //----- //\n{self._print(module)}\n")

    def _dump_failure(self, module) -> None:
        if self.args.mlir_print_ir_after_failure:
            self._dump(f"IR Dump After {self.current_step or 'parsing'} Failed", module)

    def _time(self, name: str, dt: float) -> None:
        self.timings[name] = self.timings.get(name, 0.0) + dt

class _Diagnostics:
    """How mm-opt reports diagnostics on one input: MLIR's format (file:line:col, the
    source line and a caret), or checked against ``--verify-diagnostics`` expectations."""

    def __init__(self, display: str):
        self.display = display  # how the input is named: its path, or <stdin>
        self.source_lines: list[str] = []  # the input's text, once read

    def _norm_file(self, f: str | None) -> str | None:
        return self.display if f == "-" else f

    def from_loc(self, loc) -> tuple[str | None, int | None, int | None]:
        flc = file_line_col(loc) if loc is not None else None
        if flc is None or flc[1] == 0:  # line 0: the implicit module op, not a position
            return None, None, None
        f, line, col = flc
        return self._norm_file(f), line, col

    def from_ir_diag(self, d) -> Diag:
        f, line, col = self.from_loc(d.location)
        notes = [self.from_ir_diag(n) for n in d.notes]
        return Diag(_SEVERITY.get(d.severity, "error"), d.message, f, line, col, notes)

    def from_error(self, e: DiagnosticError, chunk: Chunk) -> Diag:
        f, line, col = self.from_loc(e.location)
        diag = Diag("error", e.message, f, line, col)
        for n in e.notes:
            if isinstance(n, str):
                msg, loc = n, None
            elif isinstance(n, tuple) and len(n) == 2:
                msg, loc = n
            else:
                msg, loc = getattr(n, "message", str(n)), getattr(n, "location", None)
            nf, nl, nc = self.from_loc(loc)
            if nl is None:  # MLIR: a note without a location sits on its error's line
                nf, nl, nc = f, line, col
            diag.notes.append(Diag("note", str(msg), nf, nl, nc))
        return diag

    def print_diag(self, d: Diag) -> None:
        for x in d.flatten():
            self._print_one(x.severity, x.message, x.file, x.line, x.col)

    def _print_one(self, severity, message, f, line, col, show_source=True) -> None:
        if line is None:
            head = f"{self.display}:1:1: {severity}: "
            show_source = False
        else:
            head = f"{f}:{line}:{col}: {severity}: "
        sys.stderr.write(head + message + "\n")
        if show_source and f == self.display and 1 <= line <= len(self.source_lines):
            src = self.source_lines[line - 1]
            caret_col = max(col or 1, 1)
            sys.stderr.write(f"{src}\n{' ' * (caret_col - 1)}^\n")

    def verify(self, chunk: Chunk, diags: list[Diag]) -> bool:
        """MLIR's --verify-diagnostics on one chunk; prints mismatches, returns success."""
        expected = _parse_expectations(chunk)
        ok = True
        for d in (x for top in diags for x in top.flatten()):
            if d.severity == "note" and d.message.startswith(_OP_NOTE_PREFIX):
                continue
            in_file = d.line is not None and d.file == self.display
            want_line = d.line if in_file else None
            if d.line is not None and not in_file:
                want_line = -1  # some other file: never expected
            for exp in expected:
                if (not exp.matched and exp.severity == d.severity
                        and exp.line == want_line and exp.matches(d.message)):
                    exp.matched = True
                    break
            else:
                ok = False
                self._print_one("error", f"unexpected {d.severity}: {d.message}",
                                d.file, d.line, d.col)
        for exp in expected:
            if not exp.matched:
                ok = False
                self._print_one("error",
                                f'expected {exp.severity} "{exp.text}" was not produced',
                                self.display, exp.dir_line, exp.dir_col)
        return ok


def _reparses(text: str, ctx: ir.Context) -> bool:
    try:
        with ctx:
            ir.Module.parse(text)
    except ir.MLIRError:
        return False
    return True
_EMPTY_SYMBOL = "<<INVALID EMPTY SYMBOL>>"
"""How MLIR prints a symbol reference with an empty name (its parser rejects it)."""
_BUFFER_LOC = re.compile(r'"-":(\d+):(\d+)')
def _join(outputs: list, bytecode: bool) -> str | bytes:
    """The output file: the chunks' text joined by split markers, or the bytecode."""
    if bytecode:
        return outputs[0] if outputs and isinstance(outputs[0], bytes) else b""
    result = ("\n" + SPLIT_MARKER + "\n").join(o.rstrip("\n") for o in outputs)
    return result + "\n" if result.strip() else result


def _split(text: str) -> list[Chunk]:
    """Split on ``// -----`` lines, padding each chunk so its line numbers stay put."""
    lines = text.splitlines(keepends=True)
    chunks, start = [], 0
    for i, line in enumerate(lines + [None]):
        if line is None or _SPLIT_RE.match(line):
            body = "".join(lines[start:i])
            chunks.append(Chunk("\n" * start + body, start + 1))
            start = i + 1
    return chunks


def _parse_expectations(chunk: Chunk) -> list[Expected]:
    if isinstance(chunk.text, bytes):  # bytecode has no expected-* lines
        return []
    lines = chunk.text.splitlines()
    out: list[Expected] = []
    pending_below: list[Expected] = []
    last_plain: int | None = None
    for idx, line in enumerate(lines):
        lineno = idx + 1
        m = _DIRECTIVE_RE.search(line)
        if not m:  # as MLIR: any non-directive line, even a blank one
            for e in pending_below:
                e.line = lineno
            pending_below.clear()
            last_plain = lineno
            continue
        severity, is_re, where, body = m.groups()
        exp = Expected(severity, body, bool(is_re), lineno, lineno, m.start() + 1)
        if where is None:
            pass
        elif where == "unknown":
            exp.line = None
        elif where == "below":
            pending_below.append(exp)
        elif where == "above":
            exp.line = last_plain if last_plain is not None else lineno
        else:
            exp.line = lineno + int(where)
        out.append(exp)
    return out


if __name__ == "__main__":
    sys.exit(main())
