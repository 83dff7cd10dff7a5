"""``MpmdLowered``: the traced program before the passes; ``compile()`` runs them
(or takes the fast path) and builds the ``MpmdCompiled``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding

from multimesh._src.errors import MultimeshValueError
from multimesh._src.ir_contract import (
    DEFAULT_TASK,
    NUM_DEVICES_ATTR,
    SCHEDULE_CONFIG_ATTR,
    TASKS_ATTR,
    MeshRecord,
)
from multimesh._src.mlir import ir, make_context, parse_module, print_module
from multimesh.jax._stages import fast_path as _fast_path
from multimesh.jax._stages.call_checks import check_unsupported
from multimesh.jax._stages.compiled import MpmdCompiled, drop_unused, missing_attribute
from multimesh.jax._stages.pipeline_runner import run_pipeline
from multimesh.passes.api import Pipeline

__all__ = ["MpmdLowered"]


class MpmdLowered:
    """The traced program before our passes; ``compile()`` runs them."""

    trace_seconds = 0.0
    """How long tracing and lowering took (the first phase of ``compile_times``)."""

    def __init__(self, text: str | bytes, devices, in_tree, out_tree, dyn_idx,
                 pipeline: Pipeline,
                 donated_leaves=(), schedule_config=None, key_inputs=(), key_outputs=(),
                 in_avals=None, module: ir.Module | None = None, name: str | None = None):
        # ``text``: the program as MLIR text or bytecode; ``module``: it, already parsed
        # (the first compile() takes it instead of parsing again).
        self._program = text
        self._parsed = module
        self.name = name  # the compiled function's name: logs and MULTIMESH_DUMP_IR_TO
        self.in_avals = tuple(in_avals) if in_avals is not None else None
        self.key_inputs = tuple(key_inputs)
        self.key_outputs = tuple(key_outputs)
        self.schedule_config = schedule_config
        self.donated_leaves = tuple(donated_leaves)
        self.devices = tuple(devices)
        self.in_tree = in_tree
        self.out_tree = out_tree
        self.dyn_idx = dyn_idx
        self.pipeline = pipeline

    @property
    def label(self) -> str:
        """How logs name the program: ``mjit(<function name>)``."""
        return f"mjit({self.name})" if self.name else "mjit"

    _text: str | None = None

    def as_text(self) -> str:
        """The program as the pass pipeline starts from it: jax's module with the compile
        options on it (``mm.schedule_config``, ``mm.num_devices``; docs/ir.md), so
        ``mm-opt in.mlir -p "<lowered.pipeline>"`` replays ``compile()``."""
        if self._text is None:  # printed once, on demand
            self._text = print_module(self._input_module(), debug_info=True)
        return self._text

    def compiler_ir(self, dialect: str | None = None) -> ir.Module:
        """The program as jax lowered it (StableHLO, before the pass pipeline)."""
        if dialect not in (None, "stablehlo"):
            raise MultimeshValueError(
                f"`MpmdLowered.compiler_ir` gives the StableHLO module that the pass "
                f"pipeline reads; dialect={dialect!r} is not offered (valid: 'stablehlo').")
        return parse_module(self._program, make_context())

    out_placements: dict[int, NamedSharding] = {}  # noqa: RUF012 - replaced, never mutated
    """Output leaf -> the physical ``out_shardings`` entry it is moved onto after a run."""

    unused_leaves: frozenset[int] = frozenset()
    """Argument leaves the program never reads; ``keep_unused=False`` reports None as
    their input sharding (as ``jax.jit``), and no fragment receives them."""

    _jax_class = "jax.stages.Lowered"
    _not_offered = {
        "cost_analysis": "the fragments whose costs XLA estimates exist only after the pass "
                         "pipeline; use `compile().cost_analysis()`",
        "args_info": "see `in_avals` and `compile().input_shardings`",
        "out_info": "use `mjit(f).eval_shape(...)` or `mjit(f).trace(...).out_info`",
        "donate_argnums": "see the `mjit` function's `donate_argnums`",
    }

    def __getattr__(self, name):
        raise missing_attribute(self, name)

    def _input_module(self) -> ir.Module:
        """What the pass pipeline starts from: the program plus its compile options."""
        module = self.compiler_ir()
        _annotate(module, self.schedule_config, len(self.devices), self.default_mesh)
        return module

    host_callbacks: Sequence[Callable] = ()
    """The Python callbacks the program calls (jax.debug.print, ...), kept alive here
    while it may compile (``multimesh._src.callbacks``)."""
    fast: _fast_path.FastPath | None = None
    """A FastPath when the program takes enable_fast_path's jax.jit route."""
    default_mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    """(axis names, sizes) of the implicit default task, if not x=N."""

    def compile(self, compiler_options=None) -> MpmdCompiled | _fast_path.FastCompiled:
        if compiler_options:
            check_unsupported(None, None, False, compiler_options)
        compiled = self._compile()
        if self.unused_leaves:
            drop_unused(compiled, self.unused_leaves)
        if self.out_placements:
            compiled.out_placements = self.out_placements
            leaves = jax.tree.leaves(compiled.output_shardings)
            compiled.output_shardings = jax.tree.unflatten(
                self.out_tree, [self.out_placements.get(i, sh) for i, sh in enumerate(leaves)])
        return compiled

    def _compile(self) -> MpmdCompiled | _fast_path.FastCompiled:
        if self.fast is not None:
            return self.fast.compile()
        t0 = time.perf_counter()
        module, self._parsed = self._parsed, None
        if module is None:
            module = self._input_module()
        else:
            _annotate(module, self.schedule_config, len(self.devices), self.default_mesh)
        timings = run_pipeline(module, self.pipeline, source=self._input_module, name=self.name)
        return MpmdCompiled(self, module, {"trace_lower": self.trace_seconds,
                                           "passes": time.perf_counter() - t0}, timings)


def _annotate(module: ir.Module, schedule_config, num_devices: int,
              default_mesh=None) -> None:
    with module.context:
        if schedule_config:
            from multimesh._src.mlir import py_to_attr

            module.operation.attributes[SCHEDULE_CONFIG_ATTR] = py_to_attr(schedule_config)
        module.operation.attributes[NUM_DEVICES_ATTR] = _i64(module, num_devices)
        if default_mesh is not None:  # mm-assign-tasks keeps this mm.default entry
            from multimesh._src.mlir import py_to_attr

            names, sizes = default_mesh
            mesh = MeshRecord(tuple(range(num_devices)), tuple(names), tuple(sizes), ())
            module.operation.attributes[TASKS_ATTR] = py_to_attr({DEFAULT_TASK: mesh.to_dict()})


def _i64(module, n):
    with module.context:
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), n)
