"""``MpmdLowered``: the traced program before the passes; ``compile()`` runs them
(or takes the fast path) and builds the ``MpmdCompiled``."""

from __future__ import annotations

import time

from multimesh._src.errors import MultimeshValueError
from multimesh._src.ir_contract import (
    DEFAULT_TASK,
    NUM_DEVICES_ATTR,
    SCHEDULE_CONFIG_ATTR,
    TASKS_ATTR,
    MeshRecord,
)
from multimesh._src.mlir import ir, make_context, parse_module, print_module, py_to_attr
from multimesh.jax._stages import disk_cache as _disk_cache
from multimesh.jax._stages import fast_path as _fast_path
from multimesh.jax._stages.call_checks import check_unsupported
from multimesh.jax._stages.compiled import MpmdCompiled
from multimesh.jax._stages.pipeline_runner import run_pipeline
from multimesh.jax._stages.stage import (
    RECORD_FIELDS,
    LoweredProgram,
    ProgramStage,
    missing_attribute,
)

__all__ = ["MpmdLowered", "input_module", "input_text"]


class MpmdLowered(ProgramStage):
    """The traced program before our passes; ``compile()`` runs them.

    ``record`` (a ``LoweredProgram``) is all it knows; its fields read as attributes
    here too (``pipeline``, ``devices``, ``trace_seconds``, ...)."""

    def __init__(self, record: LoweredProgram, module: ir.Module | None = None):
        self.record = record
        # ``module``: the program, already parsed (the first compile() takes it instead
        # of parsing again).
        self._parsed = module
        self._text: str | None = None if record.fast is None else record.fast.text

    def as_text(self) -> str:
        """The program as the pass pipeline starts from it: jax's module with the compile
        options on it (``mm.schedule_config``, ``mm.num_devices``; docs/ir.md), so
        ``mm-opt in.mlir -p "<lowered.pipeline>"`` replays ``compile()``."""
        if self._text is None:  # printed once, on demand
            self._text = input_text(self.record)
        return self._text

    def compiler_ir(self, dialect: str | None = None) -> ir.Module:
        """The program as jax lowered it (StableHLO, before the pass pipeline)."""
        if dialect not in (None, "stablehlo"):
            raise MultimeshValueError(
                f"`MpmdLowered.compiler_ir` gives the StableHLO module that the pass "
                f"pipeline reads; dialect={dialect!r} is not offered (valid: 'stablehlo').")
        return parse_module(self.record.program, make_context())

    _jax_class = "jax.stages.Lowered"
    _not_offered = {
        "cost_analysis": "the fragments whose costs XLA estimates exist only after the pass "
                         "pipeline; use `compile().cost_analysis()`",
        "args_info": "see `in_avals` and `compile().input_shardings`",
        "out_info": "use `mjit(f).eval_shape(...)` or `mjit(f).trace(...).out_info`",
        "donate_argnums": "see the `mjit` function's `donate_argnums`",
    }

    def __getattr__(self, name):
        if name in RECORD_FIELDS:
            return getattr(self.record, name)
        raise missing_attribute(self, name)

    def compile(self, compiler_options=None) -> MpmdCompiled | _fast_path.FastCompiled:
        if compiler_options:
            check_unsupported(None, None, False, compiler_options)
        return self._compile()

    def _compile(self) -> MpmdCompiled | _fast_path.FastCompiled:
        rec = self.record
        if rec.fast is not None:
            return rec.fast.compile(rec)
        t0 = time.perf_counter()

        def run():
            module, self._parsed = self._parsed, None
            if module is None:
                module = input_module(rec)
            else:
                _annotate(module, rec.schedule_config, len(rec.devices), rec.default_mesh)
            timings = run_pipeline(module, rec.pipeline, source=lambda: input_module(rec),
                                   name=rec.name)
            return module, timings

        result, timings, cached, plan = _disk_cache.load_or_run(rec, run)  # issue 40
        compiled = MpmdCompiled(rec, result, {"trace_lower": rec.trace_seconds,
                                              "passes": time.perf_counter() - t0}, timings,
                                plan=plan, pipeline_cache=cached)
        if plan is None:
            _disk_cache.write_plan(rec, compiled.plan_data)
        return compiled


def input_module(rec: LoweredProgram) -> ir.Module:
    """What the pass pipeline starts from: the program plus its compile options."""
    module = parse_module(rec.program, make_context())
    _annotate(module, rec.schedule_config, len(rec.devices), rec.default_mesh)
    return module


def input_text(rec: LoweredProgram) -> str:
    """``input_module`` printed (``MpmdLowered.as_text``, the fast path's ``as_text``)."""
    return print_module(input_module(rec), debug_info=True)


def _annotate(module: ir.Module, schedule_config, num_devices: int,
              default_mesh=None) -> None:
    with module.context:
        if schedule_config:
            module.operation.attributes[SCHEDULE_CONFIG_ATTR] = py_to_attr(schedule_config)
        module.operation.attributes[NUM_DEVICES_ATTR] = _i64(module, num_devices)
        if default_mesh is not None:  # mm-assign-tasks keeps this mm.default entry
            names, sizes = default_mesh
            mesh = MeshRecord(tuple(range(num_devices)), tuple(names), tuple(sizes), ())
            module.operation.attributes[TASKS_ATTR] = py_to_attr({DEFAULT_TASK: mesh.to_dict()})


def _i64(module, n):
    with module.context:
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), n)
