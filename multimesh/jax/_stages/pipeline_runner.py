"""``run_pipeline``: the pass pipeline as ``mjit`` runs it, with logs, IR dumps
(``MULTIMESH_DUMP_IR_TO``) and, when a pass fails, a repro file and its ``mm-opt`` line."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable

from multimesh._src.errors import PassFailure, PassStepError, PipelineError
from multimesh._src.log import compile_log_level, logger
from multimesh._src.mlir import file_line_col, ir, module_bytecode, parse_module, print_module
from multimesh.jax._stages import dump as _dump
from multimesh.passes.api import VERIFIER, Pipeline, PipelineHooks, parse_pipeline

__all__ = ["run_pipeline"]


def run_pipeline(module: ir.Module, pipeline: str | Pipeline, name: str | None = None,
                 source: Callable[[], ir.Module] | None = None) -> list[tuple[str, float]]:
    """Run ``pipeline``; on failure raise :class:`PassFailure` with an mm-opt repro line.

    Nothing is printed while the passes succeed, and no pass snapshots the module: when
    one fails, the module it received is rebuilt (``source()``, a fresh copy of the
    input, with the passes before it run again) and written to the repro file.
    Without ``source`` a bytecode snapshot of the input is kept (a fraction of the cost
    of printing it). With ``MULTIMESH_DUMP_IR_TO`` set, the input and the module after
    every pass go to a directory of this program's own (``_dump.program_dir``; ``name``
    names it), with the state of passes that hold some in memory (``mm-match-tasks``'
    rules, ``<pass>.rules.json``); a failing pass's repro gets that state next to it,
    named in the printed ``mm-opt`` line. Each pass's time is logged
    (:mod:`multimesh._src.log`). Returns ``[(pass, seconds)]``.
    """
    root = _dump.dump_root()
    where = _dump.program_dir(root, name) if root else None
    if source is None:
        source = _snapshot(module)
    watch = _PassWatch(f"mjit({name})" if name else "multimesh", where)
    pipe = parse_pipeline(pipeline)
    if where:
        watch.write("input", module)
        for step in pipe.steps:  # what a replay of the dumps needs besides the files
            step.replay_element(os.path.join(where, step.argument))
    try:
        timings = pipe.run(module, PipelineHooks(after=watch.after if watch.active else None),
                           replay=source)
    except PassStepError as e:
        raise _pass_failure(pipe, e, where, source) from None
    watch.log_verifier(timings)
    return timings


class _PassWatch:
    """What ``run_pipeline`` does after each pass: log its time, dump the module."""

    def __init__(self, label: str, where: str | None):
        self.label, self.where, self.counter = label, where, 0
        self.level = compile_log_level()
        self.log = logger.isEnabledFor(self.level)
        self.active = self.log or bool(where)

    def write(self, step_name: str, mod: ir.Module) -> None:
        assert self.where is not None  # only called when dumping
        safe = step_name.replace("/", "_")[:60]
        with open(os.path.join(self.where, f"{self.counter:02d}-{safe}.mlir"), "w") as f:
            f.write(print_module(mod, debug_info=True))
        self.counter += 1

    def after(self, step, mod: ir.Module, dt: float) -> None:
        if self.log:
            logger.log(self.level, "%s: pass %s took %.4f s", self.label, step.argument, dt)
        if self.where:
            self.write(step.argument, mod)

    def log_verifier(self, timings: list[tuple[str, float]]) -> None:
        verify = dict(timings).get(VERIFIER)
        if self.log and verify is not None:
            logger.log(self.level, "%s: verified the module in %.4f s", self.label, verify)


def _pass_failure(pipe: Pipeline, e: PassStepError, where: str | None,
                  source: Callable[[], ir.Module]) -> PassFailure:
    """The error for a failed pass: its input written as a repro, and the mm-opt line."""
    failed = e.failed_pass
    where_loc = file_line_col(e.location)
    loc = f" (at {where_loc[0]}:{where_loc[1]}:{where_loc[2]})" if where_loc else ""
    headline = f"multimesh pass '{failed}' failed: {e.message}{loc}\n"
    try:
        path = _write_repro(pipe, e, where, source)
    except _dump.NoRepro as why:
        return PassFailure(f"{headline}No repro file was written: {why}.", failed, None,
                           e.error)
    element, note = _replay_element(pipe, e, path)
    if where is None:
        note += (f"\n(repros go to {os.path.dirname(path)}, which keeps the newest "
                 f"{_dump.repro_keep()}; {_dump.REPRO_DIR_ENV} and {_dump.REPRO_KEEP_ENV} "
                 f"change that, {_dump.REPRO_KEEP_ENV}=0 turns them off)")
    repro = f"mm-opt {shlex.quote(path)} -p {shlex.quote('builtin.module(' + element + ')')}"
    return PassFailure(f"{headline}Reproduce with:\n  {repro}{note}", failed, repro, e.error)


def _write_repro(pipe: Pipeline, e: PassStepError, where: str | None,
                 source: Callable[[], ir.Module]) -> str:
    """Write the failing pass's input; its path. Outside a dump directory, the repro
    directory keeps only the newest repros (``_dump.prune_repros``)."""
    path = _dump.repro_path(where)
    try:
        with open(path, "w") as f:
            f.write(_failed_input(pipe, e.failed_index, source))
    except OSError as err:
        raise _dump.NoRepro(f"cannot write {path!r} ({err.strerror or err})") from None
    if where is None:
        _dump.prune_repros(os.path.dirname(path), _dump.repro_keep())
    return path


def _replay_element(pipe: Pipeline, e: PassStepError, path: str) -> tuple[str, str]:
    """The failing step as ``mm-opt`` replays it on the repro ``path``, and a note.

    Its in-memory state (``mm-match-tasks``' rules) is written next to the repro and
    named. If that cannot be done, the pass's failure is still what is raised: the
    note says why the repro line lacks the state.
    """
    element = e.failed_element
    try:
        return pipe.steps[e.failed_index].replay_element(path.removesuffix(".mlir")), ""
    except (PipelineError, OSError) as err:
        return element, f"\n(the repro lacks this pass's in-memory state: {err})"


def _snapshot(module: ir.Module) -> Callable[[], ir.Module]:
    """A function returning a fresh copy of ``module`` as it is now (MLIR bytecode)."""
    data, ctx = module_bytecode(module), module.context
    return lambda: parse_module(data, ctx)


def _failed_input(pipe, index: int | None, source: Callable[[], ir.Module]) -> str:
    """The failing pass's input, with locations: the steps before it, replayed."""
    if index is not None:
        try:
            return print_module(pipe.input_of(index, source), debug_info=True)
        except Exception:  # noqa: BLE001 - a replay that fails differently: fall back
            pass
    return print_module(source(), debug_info=True)
