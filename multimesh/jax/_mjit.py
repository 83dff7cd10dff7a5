"""``mjit`` and ``parallelize``: trace → our pass pipeline → per-fragment compile → run."""

from __future__ import annotations

import functools
import io
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src import callbacks as _callbacks
from multimesh._src import jax_compat
from multimesh._src.caches import LRUCache, ProgramCaches
from multimesh._src.errors import (
    DiagnosticError,
    MultimeshAttributeError,
    MultimeshTypeError,
    MultimeshValueError,
    PassFailure,
    PipelineError,
)
from multimesh._src.ir_contract import (
    DEFAULT_TASK,
    NUM_DEVICES_ATTR,
    SCHEDULE_CONFIG_ATTR,
    TASKS_ATTR,
    TaskMesh,
)
from multimesh._src.log import compile_log_level, logger
from multimesh._src.mlir import file_line_col, ir, make_context, parse_module, print_module
from multimesh.jax import _checks, _contexts, _dump, _fast_path, _inputs, _multimesh
from multimesh.jax._jit_options import ArgOptions, Bound, resolve_options
from multimesh.jax._module_names import module_names
from multimesh.jax._pipeline import plain_pipeline, program_pipeline
from multimesh.jax._results import ParallelizeResult
from multimesh.jax._task import (
    jax_constraint_hint,
    warn_renamed_tasks,
    with_sharding_constraint,
)
from multimesh.jax._trace_notes import MicrobatchNote, TraceNotes
from multimesh.passes.api import VERIFIER, Pipeline, PipelineHooks, parse_pipeline
from multimesh.runtime import Executor, build_plan, distributed
from multimesh.schedules import Schedule

__all__ = ["mjit", "parallelize", "default_pipeline", "MpmdTraced", "MpmdLowered", "MpmdCompiled",
           "MemoryAnalysis"]


def default_pipeline(num_devices: int) -> str:
    """The pass pipeline for a plain program (also printed in repro commands)."""
    return str(plain_pipeline(num_devices))


def _donated_leaves(args: tuple, static, donate) -> list[int]:
    """Leaf indices (among the dynamic arguments' leaves) of the donated arguments."""
    donated: list[int] = []
    leaf = 0
    for i, a in enumerate(args):
        if i in static:
            continue
        n = len(jax.tree.leaves(a))
        if i in donate:
            donated.extend(range(leaf, leaf + n))
        leaf += n
    return donated


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _type_str(shape, dtype) -> str:
    """``float32[4,8]``: how jax prints an array type."""
    return f"{dtype}[{','.join(str(int(d)) for d in shape)}]"


def _leaf_type(x) -> tuple[tuple[int, ...], object]:
    """(shape, canonical dtype) of an argument leaf, as the compiled program sees it."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:  # a Python scalar
        dtype = jax.numpy.result_type(x)
    return tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def _leaf_name(path) -> str:
    """``args[0]['w']`` / ``kwargs['x']`` for a key path into ``(args, kwargs)``."""
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


def _check_leaf_types(flat, in_avals, args, kwargs) -> None:
    """Raise if an argument's shape or dtype differs from what the program was compiled for."""
    bad = []
    for i, (x, aval) in enumerate(zip(flat, in_avals)):
        shape, dtype = _leaf_type(x)
        if shape != tuple(aval.shape) or dtype != aval.dtype:
            bad.append((i, shape, dtype, aval))
    if not bad:
        return
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
    i, shape, dtype, aval = bad[0]
    more = (f" ({len(bad) - 1} more argument{'s' if len(bad) > 2 else ''} also "
            f"differ{'' if len(bad) > 2 else 's'})") if len(bad) > 1 else ""
    raise MultimeshTypeError(
        f"Compiled function called with {_leaf_name(paths[i])} of type "
        f"{_type_str(shape, dtype)}, but it was compiled for "
        f"{_type_str(aval.shape, aval.dtype)}{more}. Lower it again for the new types, or "
        f"call the `mjit` function, which compiles for each new set of types.")


def check_call(in_tree, in_avals, args, kwargs) -> list:
    """The leaves of a compiled program's arguments, checked against what it was
    compiled for (structure, shapes and dtypes)."""
    flat, tree = jax.tree.flatten((args, kwargs))
    if tree != in_tree:
        raise MultimeshValueError(
            f"Compiled function called with arguments of structure {tree}, but it was "
            f"compiled for {in_tree}.")
    if in_avals is not None:
        _check_leaf_types(flat, in_avals, args, kwargs)
    return flat


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                    weak_type=getattr(x, "weak_type", False))
    return x


class MpmdCompiled:
    """A compiled MPMD program: call it on pytrees; inspect fragments and transfers."""

    def __init__(self, lowered: MpmdLowered, module: ir.Module, times: dict | None = None,
                 pass_times: list | None = None):
        self._lowered = lowered
        self.pass_times = list(pass_times or [])
        """``[(pass, seconds)]`` of the pass pipeline, in order (``"(verifier)"``: the
        final verification); ``compile_times["passes"]`` is their total plus parsing."""
        self._module = module
        self._text: str | None = None  # printed on demand: printing a big module costs as much as parsing
        t0 = time.perf_counter()
        self.plan_data = build_plan(module)
        t1 = time.perf_counter()
        _log_phase(lowered, "built the runtime plan", t1 - t0,
                   f"{len(self.plan_data.fragments)} fragments, "
                   f"{len(self.plan_data.calls())} calls, "
                   f"{len(self.plan_data.steps) - len(self.plan_data.calls())} transfers")
        self._exec = Executor(self.plan_data, lowered.devices,
                              frozenset(lowered.donated_leaves), leaf_name=self._arg_name)
        self.compile_times = {**(times or {}), "plan": t1 - t0,
                              "xla": time.perf_counter() - t1}
        """Seconds per phase: ``trace_lower``, ``passes``, ``plan``, ``xla``."""
        self.xla_times = dict(self._exec.xla_seconds)
        """Fragment name -> seconds XLA took to compile it (about 0 when cached); they
        overlap, since fragments compile concurrently (``MULTIMESH_COMPILE_THREADS``)."""
        self.xla_sources = dict(self._exec.xla_sources)
        """Fragment name -> where its executable came from: ``"xla"`` (compiled now),
        ``"persistent cache"`` (jax's ``jax_compilation_cache_dir``), ``"identical
        fragment"`` (loaded from a fragment that differs only in its devices) or
        ``"memory"`` (compiled earlier in this process)."""
        _log_phase(lowered, "compiled the fragments with XLA", self.compile_times["xla"],
                   f"{self._exec.xla_compiles} XLA compilations")
        _log_phase(lowered, "finished compiling", sum(self.compile_times.values()),
                   ", ".join(f"{k} {v:.3f} s" for k, v in self.compile_times.items()))
        n_leaves = lowered.in_tree.num_leaves
        self._all_dynamic = list(lowered.dyn_idx) == list(range(n_leaves))
        in_sh: Sequence[NamedSharding | None] = self._exec.input_shardings
        if not self._all_dynamic:  # leaves the program does not take have no sharding
            placed: list[NamedSharding | None] = [None] * n_leaves
            for i, sh in zip(lowered.dyn_idx, self._exec.input_shardings):
                placed[i] = sh
            in_sh = placed
        self.input_shardings = jax.tree.unflatten(lowered.in_tree, in_sh)
        self.output_shardings = jax.tree.unflatten(lowered.out_tree, self._exec.output_shardings)

    fast_path = False  # see FastCompiled (multimesh.jax._fast_path)
    _recovered_schedule: Schedule | None = None  # set by compile_mpmd
    out_placements: dict[int, NamedSharding] = {}  # noqa: RUF012 - see MpmdLowered

    def _arg_name(self, i: int) -> str:
        """``args[0]['w']``: how errors name the executor's argument ``i``."""
        low = self._lowered
        leaves = jax.tree.unflatten(low.in_tree, list(range(low.in_tree.num_leaves)))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(leaves)[0]]
        return _leaf_name(paths[low.dyn_idx[i]])

    def __call__(self, *args, **kwargs):
        low = self._lowered
        flat = check_call(low.in_tree, low.in_avals, args, kwargs)
        if not self._all_dynamic:
            flat = [flat[i] for i in low.dyn_idx]
        if low.key_inputs:  # typed PRNG keys travel as their raw uint32 data
            flat = [jax.random.key_data(x) if k else x for x, k in zip(flat, low.key_inputs)]
        outs = self._exec(*flat)
        if self.out_placements:
            outs = _place_outputs(outs, self.out_placements)
        if low.key_outputs:
            outs = [jax.random.wrap_key_data(o, impl=impl) if impl is not None else o
                    for o, impl in zip(outs, low.key_outputs)]
        return jax.tree.unflatten(low.out_tree, outs)

    def as_text(self) -> str:
        """The program after the full pass pipeline (MPMD form)."""
        if self._text is None:
            self._text = print_module(self._module)
        return self._text

    @property
    def schedule(self):
        """The pipeline schedule (per-submesh fragment order), or None if not microbatched."""
        from multimesh.passes.api import read_schedule

        if self._recovered_schedule is not None:  # imported: see _imported_schedule
            return self._recovered_schedule
        return read_schedule(self._module)

    def profile(self, *args, trace_path=None, **kwargs):
        """Run one step synchronously, timing every fragment and transfer.

        Returns the outputs; with ``trace_path`` also writes a Chrome/Perfetto trace
        laid out as ``visualize_schedule``'s picture (``multimesh.jax._trace_view``);
        a pipelined program's durations per schedule unit are then ``last_profile``
        (a :class:`multimesh.jax.StepProfile`). Blocking after each step makes the
        timeline readable at the cost of overlap, so use it to inspect, not to benchmark.
        """
        from multimesh.jax._costs import profile_from_times
        from multimesh.runtime.timing import run_timed
        from multimesh.runtime.trace import TraceRecorder

        flat, tree = jax.tree.flatten((args, kwargs))
        if self._lowered.in_avals is not None and tree == self._lowered.in_tree:
            _check_leaf_types(flat, self._lowered.in_avals, args, kwargs)
        rec = TraceRecorder()
        outs, times = run_timed(self._exec, rec, [flat[i] for i in self._lowered.dyn_idx])
        sched = self.schedule
        self.last_profile = None if sched is None else profile_from_times(sched, [times])
        outs = _place_outputs(outs, self.out_placements)
        if trace_path is not None:
            from multimesh.jax._trace_view import write_step_trace

            write_step_trace(rec.events, self.plan_data, self.schedule,
                             [d.id for d in self._lowered.devices], trace_path)
        self.last_trace = rec
        return jax.tree.unflatten(self._lowered.out_tree, outs)

    def step_profile(self, *args, steps: int = 3, **kwargs):
        """Run ``steps`` steps, timing every fragment call alone: a
        :class:`multimesh.jax.StepProfile` (costs for ``schedule.simulate``)."""
        from multimesh.jax._costs import step_profile

        return step_profile(self, args, kwargs, steps)

    def memory_profile(self, *args, **kwargs):
        """Run one step and measure, per submesh, the peak bytes the runtime holds
        (parameters, activations in flight, other values, XLA temporaries) beside
        the schedule's prediction: a :class:`multimesh.jax._memory.MemoryProfile`."""
        from multimesh.jax._memory import memory_profile

        return memory_profile(self, args, kwargs)

    @property
    def fragments(self) -> list[dict]:
        out = []
        for f in self.plan_data.fragments.values():
            out.append({"name": f.name, "task": f.task,
                        "direction": "fwd" if f.transpose_count == 0 else "bwd",
                        "devices": [self._lowered.devices[p].id for p in f.devices],
                        "module": f.text})
        return out

    @property
    def calls(self) -> list[dict]:
        """Every fragment call of one run, in dispatch order: ``fragment``, ``task``,
        ``direction``, ``microbatch`` (None outside the loop) and ``devices`` (ids)."""
        out = []
        for s in self.plan_data.calls():
            f = self.plan_data.fragments[s.fragment]
            out.append({"fragment": s.fragment, "task": f.task,
                        "direction": "fwd" if f.transpose_count == 0 else "bwd",
                        "microbatch": s.microbatch,
                        "devices": [self._lowered.devices[p].id
                                    for p in self.plan_data.call_devices(s)]})
        return out

    def calls_per_submesh(self) -> dict[tuple[int, ...], list[str]]:
        """Per submesh (its device ids), the fragment calls it runs, in dispatch order,
        as ``name`` or ``name@microbatch`` inside the microbatch loop."""
        out: dict[tuple[int, ...], list[str]] = {}
        for c in self.calls:
            label = c["fragment"] if c["microbatch"] is None else \
                f"{c['fragment']}@{c['microbatch']}"
            out.setdefault(tuple(c["devices"]), []).append(label)
        return out

    @property
    def transfers(self) -> list:
        from multimesh.runtime.plan import Transfer

        return [s for s in self.plan_data.steps if isinstance(s, Transfer)]

    def plan(self) -> str:
        return self.plan_data.describe()

    def process_plan(self) -> str | None:
        """Under ``jax.distributed``, the plan as this process runs it: the calls it
        runs or skips, the transfers it sends, receives or joins; None in one process."""
        pp = self._exec.process_plan
        return None if pp is None else pp.describe()

    def cost_analysis(self, *, by_fragment: bool = False) -> dict:
        """XLA's cost estimates (``flops``, ``bytes accessed``, ...) summed over the
        fragments, each counted once (not once per call); with ``by_fragment=True``,
        fragment name -> that fragment's own dict."""
        per = {name: _cost_dict(self._exec.exes[name]) for name in self.plan_data.fragments}
        return per if by_fragment else _sum_numeric(per.values())

    def memory_analysis(self, *, by_fragment: bool = False):
        """XLA's memory estimates, summed over the fragments (each counted once, over
        all the devices of its submesh's executable): a ``MemoryAnalysis`` with the
        numeric fields of jax's ``CompiledMemoryStats``. With ``by_fragment=True``,
        fragment name -> jax's own stats object for that fragment."""
        per = {name: self._exec.exes[name].memory_analysis()
               for name in self.plan_data.fragments}
        return per if by_fragment else MemoryAnalysis.total(per.values())

    @property
    def in_tree(self):
        """The tree of the dynamic arguments, ``(args, kwargs)``, that calls take."""
        return self._lowered.in_tree

    @property
    def out_tree(self):
        return self._lowered.out_tree

    @property
    def in_avals(self):
        return self._lowered.in_avals

    _jax_class = "jax.stages.Compiled"
    _not_offered = {
        "donate_argnums": "see the `mjit` function's `donate_argnums`",
        "runtime_executable": "an MPMD program is one XLA executable per fragment; see "
                              "`fragments`, `xla_times` and `cost_analysis(by_fragment=True)`",
        "input_formats": "fragments choose their layouts separately; see `input_shardings`",
        "output_formats": "fragments choose their layouts separately; see "
                          "`output_shardings`",
        "args_info": "see `input_shardings` and the lowered program's `in_avals`",
        "call": "call the compiled object itself",
    }

    def __getattr__(self, name):
        raise _missing_attribute(self, name)


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
        raise _missing_attribute(self, name)

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
            _check_unsupported(None, None, False, compiler_options)
        compiled = self._compile()
        if self.unused_leaves:
            _drop_unused(compiled, self.unused_leaves)
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


def _drop_unused(compiled, unused: frozenset[int]) -> None:
    """``input_shardings`` with None for the leaves the program never reads."""
    leaves, tree = jax.tree.flatten(compiled.input_shardings, is_leaf=lambda x: x is None)
    compiled.input_shardings = jax.tree.unflatten(
        tree, [None if i in unused else sh for i, sh in enumerate(leaves)])


def _cost_dict(exe) -> dict:
    ca = exe.cost_analysis()
    return dict((ca[0] if isinstance(ca, (list, tuple)) else ca) or {})


def _sum_numeric(dicts) -> dict:
    """Per key, the sum of the numeric values of ``dicts`` (others are skipped)."""
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                total[k] = total.get(k, 0) + v
    return total


class MemoryAnalysis:
    """The numeric fields of jax's ``CompiledMemoryStats`` summed over fragments
    (``temp_size_in_bytes``, ``argument_size_in_bytes``, ...), as attributes."""

    def __init__(self, fields: dict[str, int]):
        self.fields = dict(fields)
        for k, v in fields.items():
            setattr(self, k, v)

    @classmethod
    def total(cls, stats) -> MemoryAnalysis:
        dicts = []
        for st in stats:
            names = [n for n in dir(st) if not n.startswith("_")]
            dicts.append({n: getattr(st, n) for n in names
                          if isinstance(getattr(st, n), int)})
        return cls(_sum_numeric(dicts))

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v}" for k, v in self.fields.items())
        return f"MemoryAnalysis({body})"


def _missing_attribute(stage, name: str, like: type | None = None) -> AttributeError:
    """The error for a missing attribute: why, for one that jax's stage has (the
    ``_not_offered`` table of ``like``, by default the stage's own class)."""
    cls = type(stage).__name__
    table = like or type(stage)
    why = table._not_offered.get(name)  # type: ignore[attr-defined]
    if why is None or name.startswith("__"):
        return AttributeError(f"{cls!r} object has no attribute {name!r}")
    return MultimeshAttributeError(
        f"`{cls}.{name}` is not offered, although `{table._jax_class}` has it: "  # type: ignore[attr-defined]
        f"{why}.")


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
            mesh = TaskMesh(tuple(range(num_devices)), tuple(names), tuple(sizes), ())
            module.operation.attributes[TASKS_ATTR] = py_to_attr({DEFAULT_TASK: mesh.to_dict()})


def _i64(module, n):
    with module.context:
        return ir.IntegerAttr.get(ir.IntegerType.get_signless(64), n)


def _log_phase(lowered, what: str, seconds: float, detail: str = "") -> None:
    level = compile_log_level()
    if logger.isEnabledFor(level):
        logger.log(level, "%s: %s in %.3f s%s", lowered.label, what, seconds,
                   f" ({detail})" if detail else "")


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
    except DiagnosticError as e:
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


def _pass_failure(pipe: Pipeline, e: DiagnosticError, where: str | None,
                  source: Callable[[], ir.Module]) -> PassFailure:
    """The error for a failed pass: its input written as a repro, and the mm-opt line."""
    failed = getattr(e, "failed_pass", "?")
    where_loc = file_line_col(e.location)
    loc = f" (at {where_loc[0]}:{where_loc[1]}:{where_loc[2]})" if where_loc else ""
    headline = f"multimesh pass '{failed}' failed: {e.message}{loc}\n"
    try:
        path = _write_repro(pipe, e, where, source)
    except _dump.NoRepro as why:
        return PassFailure(f"{headline}No repro file was written: {why}.", failed, None, e)
    element, note = _replay_element(pipe, e, path)
    if where is None:
        note += (f"\n(repros go to {os.path.dirname(path)}, which keeps the newest "
                 f"{_dump.repro_keep()}; {_dump.REPRO_DIR_ENV} and {_dump.REPRO_KEEP_ENV} "
                 f"change that, {_dump.REPRO_KEEP_ENV}=0 turns them off)")
    repro = f"mm-opt {shlex.quote(path)} -p {shlex.quote('builtin.module(' + element + ')')}"
    return PassFailure(f"{headline}Reproduce with:\n  {repro}{note}", failed, repro, e)


def _write_repro(pipe: Pipeline, e: DiagnosticError, where: str | None,
                 source: Callable[[], ir.Module]) -> str:
    """Write the failing pass's input; its path. Outside a dump directory, the repro
    directory keeps only the newest repros (``_dump.prune_repros``)."""
    path = _dump.repro_path(where)
    try:
        with open(path, "w") as f:
            f.write(_failed_input(pipe, getattr(e, "failed_index", None), source))
    except OSError as err:
        raise _dump.NoRepro(f"cannot write {path!r} ({err.strerror or err})") from None
    if where is None:
        _dump.prune_repros(os.path.dirname(path), _dump.repro_keep())
    return path


def _replay_element(pipe: Pipeline, e: DiagnosticError, path: str) -> tuple[str, str]:
    """The failing step as ``mm-opt`` replays it on the repro ``path``, and a note.

    Its in-memory state (``mm-match-tasks``' rules) is written next to the repro and
    named. If that cannot be done, the pass's failure is still what is raised: the
    note says why the repro line lacks the state.
    """
    element = getattr(e, "failed_element", getattr(e, "failed_pass", "?"))
    index = getattr(e, "failed_index", None)
    if index is None:
        return element, ""
    try:
        return pipe.steps[index].replay_element(path.removesuffix(".mlir")), ""
    except (PipelineError, OSError) as err:
        return element, f"\n(the repro lacks this pass's in-memory state: {err})"


def _snapshot(module: ir.Module) -> Callable[[], ir.Module]:
    """A function returning a fresh copy of ``module`` as it is now (MLIR bytecode)."""
    data, ctx = _bytecode(module), module.context
    return lambda: parse_module(data, ctx)


def _failed_input(pipe, index: int | None, source: Callable[[], ir.Module]) -> str:
    """The failing pass's input, with locations: the steps before it, replayed."""
    if index is not None:
        try:
            return print_module(pipe.input_of(index, source), debug_info=True)
        except Exception:  # noqa: BLE001 - a replay that fails differently: fall back
            pass
    return print_module(source(), debug_info=True)


def _schedule_config(notes: TraceNotes) -> dict | None:
    """The microbatch loop's schedule, stored on the module (so repros replay it).

    Only what the program asked for: the pass warns about a schedule that cannot
    apply, and a default GPipe was not asked for.
    """
    cfg: MicrobatchNote | None = notes.microbatch
    if cfg is None:
        return None
    out: dict = {}
    if cfg.requested:
        out["schedule"] = cfg.schedule
    for key in ("num_stages", "interleave", "unrolling"):
        if getattr(cfg, key):
            out[key] = int(getattr(cfg, key))
    if cfg.custom:
        out["custom_schedule"] = [[[int(mb), name] for mb, name in row] for row in cfg.custom]
    return out


def _check_distinct_devices(devices) -> None:
    seen: dict = {}
    for d in devices:
        seen[d] = seen.get(d, 0) + 1
    for d, count in seen.items():
        if count > 1:
            times = "twice" if count == 2 else f"{count} times"
            ids = [getattr(x, "id", x) for x in devices]
            raise MultimeshValueError(
                f"`mjit` devices must be distinct, but device {getattr(d, 'id', d)} appears "
                f"{times} in {ids}.")


class _NnxOutput(Exception):  # noqa: N818 - a signal, caught in _MJit.trace
    """The function returned NNX objects: trace it again the NNX way."""


def _holds_nnx(tree) -> bool:
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:
        return False
    is_node = nnx.graph.is_graph_node
    return any(is_node(x) for x in jax.tree.leaves(tree, is_leaf=is_node))


def _nnx_bridge(bound: Bound):
    """The NNX side of ``mjit`` when ``bound``'s dynamic arguments hold NNX graph
    objects (modules, optimizers, Variables), else None. Flax is never imported here:
    an NNX object exists only once the program imported ``flax.nnx`` itself."""
    if not _holds_nnx((bound.dyn_args, bound.dyn_kwargs)):
        return None
    from multimesh.jax.flax import _nnx

    return _nnx


class _MJit(ProgramCaches):
    """``mjit(fun, ...)``: options checked once; one program per argument types."""

    _program_caches = ("_cache", "_placed")

    def __init__(self, fun, devices, mesh, in_shardings, out_shardings, options: ArgOptions,
                 keep_unused: bool):
        self.fun = fun
        self.mesh = mesh
        if devices is None and mesh is not None:
            devices = list(mesh.devices.flat)
        self.devices = _checks.program_devices(devices) if devices is not None else None
        self.in_shardings = tuple(in_shardings) if isinstance(in_shardings, list) \
            else in_shardings
        self.out_shardings = out_shardings
        if self.devices is not None:
            _check_distinct_devices(self.devices)
        self.options = options
        self.keep_unused = bool(keep_unused)
        self._cache = LRUCache("multimesh mjit programs")
        self._placed = LRUCache("multimesh mjit programs for committed inputs")
        # Pin committed inputs even where the program constrains them (parallelize's
        # initial_batch); see multimesh.jax._inputs.
        self.pin_committed = False
        functools.update_wrapper(self, fun, updated=())

    @property
    def static_argnums(self) -> tuple[int, ...]:
        return self.options.static_argnums

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return self.options.donate_argnums

    def _devices(self):
        if self.devices:
            return self.devices
        global_mesh = _multimesh.active_multimesh()  # inside `with MultiMesh(...)`
        return tuple(global_mesh.devices.flat) if global_mesh is not None \
            else tuple(jax.devices())

    def _program_mesh(self, devices) -> Mesh | None:
        """The mesh the program's devices came from (``mjit(mesh=...)``, the MultiMesh):
        the implicit default task runs on it, named as the caller named it."""
        outer = _multimesh.active_multimesh() if self.devices is None or \
            self.mesh is not None else None
        for mesh in (self.mesh, outer):
            if mesh is not None and tuple(mesh.devices.flat) == tuple(devices):
                return getattr(mesh, "global_mesh", mesh)
        return None

    def trace(self, *args, **kwargs):
        """Trace for these arguments (``jax.jit(f).trace``): ``jaxpr``, ``out_info``,
        ``lower()``. Arrays or ``jax.ShapeDtypeStruct``s; nothing is compiled."""
        return self._trace(self.options.bind(args, kwargs))

    def _trace(self, bound: Bound):
        nnx = _nnx_bridge(bound)
        if nnx is not None:
            return nnx.trace(self, bound)
        fun, in_sh, out_sh = self.fun, self.in_shardings, self.out_shardings
        placements: dict[int, NamedSharding] = {}

        def wrapped(*dargs, **dkw):
            if in_sh is not None:
                dargs = _constrain_tree(tuple(dargs), in_sh)
            full, kw = bound.merge(dargs, dkw)
            with jax_constraint_hint("in an `mjit` program"):
                out = fun(*full, **kw)
            if _holds_nnx(out):  # new NNX objects: returned as nnx.jit returns them
                raise _NnxOutput
            return out if out_sh is None else _constrain_outputs(out, out_sh, placements)

        wrapped.__name__ = getattr(fun, "__name__", "fun")  # name stacks read jit(<fun>)
        try:
            traced = self.trace_flat(wrapped, bound.dyn_args, bound.dyn_kwargs,
                                     bound.donated_flags(), in_sh)
            traced.out_placements = placements
            return traced
        except _NnxOutput:
            from multimesh.jax.flax import _nnx

            return _nnx.trace(self, bound)

    def trace_flat(self, fun, dyn_args: tuple, kwargs: dict, donated: Sequence[bool],
                   in_shardings=None) -> MpmdTraced:
        """Trace ``fun`` of dynamic arguments only (statics already bound), under the
        program's contexts; ``donated`` flags each leaf of ``(dyn_args, kwargs)``."""
        devices = self._devices()
        t0 = time.perf_counter()
        abstract = jax.tree.map(_abstract, (tuple(dyn_args), kwargs))
        notes = TraceNotes()
        with _contexts.program_devices(devices), _contexts.autoshard(True), \
                _contexts.notes(notes), module_names():
            traced = jax.jit(fun, keep_unused=True).trace(*abstract[0], **abstract[1])
        return MpmdTraced(self, traced, devices, notes, (tuple(dyn_args), kwargs),
                          abstract, [i for i, d in enumerate(donated) if d], in_shardings,
                          time.perf_counter() - t0)

    def lower(self, *args, **kwargs):
        """Trace and lower for these arguments (``jax.jit(f).lower``)."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args, **kwargs):
        """The outputs' shapes and dtypes (``jax.ShapeDtypeStruct``s), from a trace
        alone: nothing is lowered or compiled, and NNX objects are left unchanged."""
        return self.trace(*args, **kwargs).out_info

    def __call__(self, *args, **kwargs):
        bound = self.options.bind(args, kwargs)
        nnx = _nnx_bridge(bound)
        if nnx is not None:
            return nnx.call(self, bound)
        dyn, dkw = bound.dyn_args, bound.dyn_kwargs
        leaves, tree = jax.tree.flatten((dyn, dkw))
        key = (tree, bound.static_key(),
               tuple((np.shape(x), str(getattr(x, "dtype", type(x))),
                      bool(getattr(x, "weak_type", False))) for x in leaves),
               _multimesh.compile_token(), _contexts.state.fast_path)
        placed = _inputs.committed_key(leaves)
        if any(p is not None for p in placed):  # committed inputs are physical shardings
            compiled = self._placed.get((key, placed))
            if compiled is None:
                base = self._cache.get(key)
                compiled = base if base is not None and _inputs.fits(base, leaves) \
                    else self._compile(bound)
                self._placed[(key, placed)] = compiled
        else:
            compiled = self._cache.get(key)
            if compiled is None:
                compiled = self._cache[key] = self._compile(bound)
        if compiled is _RETURNS_NNX:
            from multimesh.jax.flax import _nnx

            return _nnx.call(self, bound)
        return compiled(*dyn, **dkw)

    def _compile(self, bound: Bound):
        """The compiled program, or ``_RETURNS_NNX`` for a function that returns NNX
        objects although it takes none (the NNX side compiles and caches it)."""
        traced = self._trace(bound)
        return traced.lower().compile() if isinstance(traced, MpmdTraced) else _RETURNS_NNX

    def clear_cache(self) -> None:
        """Forget the programs compiled for this function (``jax.jit``'s ``clear_cache``)."""
        self._cache.cache_clear()
        self._placed.cache_clear()


_RETURNS_NNX = object()


class MpmdTraced:
    """``mjit(f).trace(*args)``: the program as a jaxpr, before lowering.

    ``jaxpr`` is over the leaves of the dynamic arguments (static ones are folded in);
    ``out_info`` gives the outputs' ``jax.ShapeDtypeStruct``s; ``lower()`` lowers it
    for the pass pipeline (``MpmdLowered``).
    """

    def __init__(self, owner: _MJit, traced, devices, notes: TraceNotes, dyn: tuple, abstract,
                 donated: list[int], in_shardings, seconds: float):
        self._owner = owner
        self._traced = traced
        self._devices = tuple(devices)
        self._notes = notes
        self._dyn = dyn
        self._abstract = abstract
        self._donated = donated
        self._in_shardings = in_shardings
        self.trace_seconds = seconds
        self.out_placements: dict[int, NamedSharding] = {}  # physical out_shardings

    @property
    def jaxpr(self):
        return self._traced.jaxpr

    @property
    def out_info(self):
        return self._traced.out_info

    @property
    def in_avals(self) -> tuple:
        return tuple(self._traced.jaxpr.in_avals)

    @property
    def out_avals(self):
        return self._traced.out_avals

    @property
    def fun_name(self) -> str:
        return getattr(self._owner.fun, "__name__", "fun")

    _jax_class = "jax.stages.Traced"
    _not_offered = {
        "args_info": "see `in_avals` (the dynamic arguments' leaves) and `compile()`'s "
                     "`input_shardings`",
        "in_tree": "see `lower().in_tree`",
        "out_tree": "see `lower().out_tree`",
        "donate_argnums": "see the `mjit` function's `donate_argnums`",
    }

    def __getattr__(self, name):
        raise _missing_attribute(self, name)

    def lower(self) -> MpmdLowered:
        owner, traced, devices, notes = self._owner, self._traced, self._devices, self._notes
        t0 = time.perf_counter()
        with _contexts.program_devices(devices), _contexts.autoshard(True), \
                _contexts.notes(notes):
            lowered = traced.lower()
            # jax's module moves into our context as bytecode (no text printed or parsed)
            # and is parsed once: the registered-task scan and compile() share it.
            program = _bytecode(lowered.compiler_ir("stablehlo"))
            module = parse_module(program, make_context())
            host_callbacks, ordered = jax_compat.lowered_callbacks(lowered)
            held = _callbacks.adopt(module, host_callbacks)
            if held:  # the callbacks' numbers are in the program now
                program = _bytecode(module)
            implicit = _multimesh.implicit_task_rules(module)  # registered tasks, in memory
            _checks.no_explicit_sharding(traced.jaxpr, implicit is not None)
        trace_seconds = self.trace_seconds + time.perf_counter() - t0
        warn_renamed_tasks(notes)
        dyn_args, kwargs = self._dyn
        dyn_flat, in_tree = jax.tree.flatten((dyn_args, kwargs))
        changed, pins = _pin_inputs(module, self._in_shardings, dyn_args, kwargs, dyn_flat,
                                    notes, devices, owner.pin_committed)
        if changed:  # the program the repro replays is the pinned one
            program = _bytecode(module)
        low = MpmdLowered(program, devices, in_tree, lowered.out_tree,
                          list(range(len(dyn_flat))), donated_leaves=self._donated,
                          in_avals=traced.jaxpr.in_avals,
                          schedule_config=_schedule_config(notes),
                          pipeline=program_pipeline(len(devices), notes, implicit,
                                                    _contexts.state.recomputation),
                          module=module, name=getattr(owner.fun, "__name__", None))
        _mark_keys(low, dyn_flat, traced.out_info)
        low.out_placements = dict(self.out_placements)
        if not owner.keep_unused:
            low.unused_leaves = frozenset(jax_compat.unused_inputs(traced.jaxpr))
        mesh = owner._program_mesh(devices)
        if mesh is not None:
            low.default_mesh = (tuple(mesh.axis_names), tuple(mesh.devices.shape))
        # (ordered callbacks: jax.jit runs ordered debug prints on one device only)
        if not ordered and _fast_path.eligible(module, implicit, notes, pins, len(devices)):
            low.fast = _fast_path.FastPath(traced.jaxpr, in_tree, lowered.out_tree,
                                           jax.tree.leaves(self._abstract), pins, devices,
                                           self._donated, low.as_text(), low.default_mesh)
        low.trace_seconds = trace_seconds
        low.host_callbacks = held  # alive while the program may compile
        _log_phase(low, "traced and lowered", trace_seconds)
        return low


def _mark_keys(low: MpmdLowered, dyn_flat, out_info) -> None:
    """Typed PRNG keys cross the runtime as their raw data: which leaves are keys."""
    key_in = [_is_key(x) for x in dyn_flat]
    key_out = [x.dtype._impl if _is_key(x) else None for x in jax.tree.leaves(out_info)]
    low.key_inputs = tuple(key_in) if any(key_in) else ()
    low.key_outputs = tuple(key_out) if any(k is not None for k in key_out) else ()


def _bytecode(module: ir.Module) -> bytes:
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


def _pin_inputs(module, in_shardings, dyn_args, kwargs, dyn_flat, notes, devices,
                force: bool) -> tuple[bool, dict]:
    """Pin physical input shardings (``_inputs``) on the lowered program's arguments, in
    place; returns (whether the module changed, the pins). ``in_shardings`` is a prefix
    of the dynamic positional arguments, as for ``jax.jit``."""
    specs = _inputs.leaf_in_shardings(in_shardings, dyn_args, (),
                                      len(jax.tree.leaves(kwargs)))
    paths = [_leaf_name(p) for p, _ in
             jax.tree_util.tree_flatten_with_path((tuple(dyn_args), kwargs))[0]]
    pins, drop, committed = _inputs.plan_pins(
        dyn_flat, specs, notes.logical_names, tuple(devices), paths)
    changed = bool(pins or drop)
    _, pins = _inputs.pin_module(module, pins, drop, set() if force else committed)
    return changed, pins


def _constrain_outputs(out, shardings, placements: dict):
    """``out`` under ``out_shardings``: logical ones become constraints; a physical
    ``NamedSharding`` (no task maps its names) is where that output is put after the
    program runs, as ``jax.jit`` returns it (recorded in ``placements``, by leaf)."""
    notes = _contexts.state.trace_notes  # the tasks traced map these names
    mapped = notes.logical_names if notes is not None else set()
    leaves, tree = jax.tree.flatten(out)
    entries = _leaf_entries(shardings, out)
    for i, s in enumerate(entries):
        if _inputs.is_physical(s, mapped):
            placements[i] = s
    logical = [None if i in placements else s for i, s in enumerate(entries)]
    return jax.tree.unflatten(tree, [_constrain_leaf(x, s) for x, s in zip(leaves, logical)])


def _leaf_entries(shardings, tree) -> list:
    """One entry of ``shardings`` (a prefix of ``tree``, as for jax.jit) per leaf."""
    def is_spec(s):
        return s is None or isinstance(s, (NamedSharding, PartitionSpec))

    if is_spec(shardings):
        return [shardings] * len(jax.tree.leaves(tree))
    try:
        groups = jax.tree.map(lambda s, sub: [s] * len(jax.tree.leaves(sub)), shardings, tree,
                              is_leaf=is_spec)
    except ValueError as e:
        raise MultimeshValueError(
            f"`in_shardings`/`out_shardings` must be a prefix of the arguments/outputs "
            f"(as for jax.jit): {e}") from None
    return [s for g in jax.tree.leaves(groups, is_leaf=lambda x: isinstance(x, list)) for s in g]


def _constrain_leaf(x, s):
    if isinstance(s, NamedSharding):
        s = s.spec
    return x if s is None else with_sharding_constraint(x, s)


def _place_outputs(outs: list, placements: dict) -> list:
    """Outputs with a physical ``out_shardings`` entry moved onto it."""
    return [jax.device_put(o, placements[i]) if i in placements else o
            for i, o in enumerate(outs)]


def _constrain_tree(tree, shardings):
    """Apply ``shardings`` (a prefix of ``tree``, as jit's in_shardings) as logical constraints."""
    def one(x, s):
        if isinstance(s, NamedSharding):
            s = s.spec
        if s is None:
            return x
        return with_sharding_constraint(x, s)

    def is_spec(s):
        return s is None or isinstance(s, (NamedSharding, PartitionSpec))

    if is_spec(shardings):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    try:
        return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: one(x, s), sub),
                            shardings, tree, is_leaf=is_spec)
    except ValueError as e:
        raise MultimeshValueError(
            f"`in_shardings`/`out_shardings` must be a prefix of the arguments/outputs "
            f"(as for jax.jit): {e}") from None


def mjit(fun: Callable | None = None, /, *, in_shardings=None, out_shardings=None,
         static_argnums=None, static_argnames=None, donate_argnums=None,
         donate_argnames=None, keep_unused: bool = False, device=None, backend=None,
         inline: bool = False, compiler_options=None, mesh: Mesh | None = None,
         devices: Sequence | None = None):
    """Compiles ``fun`` as an MPMD program: each task on its submesh (``jax.jit`` for MPMD).

    ``devices`` (or ``mesh``) is the program's device list; ``TaskMesh``
    positions refer to it. ``in_shardings`` (a prefix of the dynamic positional
    arguments) and ``out_shardings`` whose axis names a task maps become logical
    constraints, resolved by the task that consumes/produces the value; a
    ``NamedSharding`` on real devices that no task maps is kept as given.
    ``static_argnums``/``static_argnames``/``donate_argnums``/``donate_argnames``
    and ``keep_unused`` mean what they mean for ``jax.jit``, and are checked here,
    against ``fun``'s signature. NNX modules, optimizers and Variables may be
    arguments: their state updates are written back, as ``nnx.jit`` does.
    Without ``fun``, returns a decorator. docs/mpmd-runtime.md lists every
    ``jax.jit`` option and method with multimesh's answer.
    """
    kw = dict(in_shardings=in_shardings, out_shardings=out_shardings,
              static_argnums=static_argnums, static_argnames=static_argnames,
              donate_argnums=donate_argnums, donate_argnames=donate_argnames,
              keep_unused=keep_unused, device=device, backend=backend, inline=inline,
              compiler_options=compiler_options, mesh=mesh, devices=devices)
    if fun is None:
        return functools.partial(mjit, **kw)
    if not callable(fun):
        raise MultimeshTypeError(f"`mjit` expects a callable, got {type(fun).__name__}.")
    _check_unsupported(device, backend, inline, compiler_options)
    options = resolve_options(fun, static_argnums, static_argnames, donate_argnums,
                              donate_argnames)
    return _MJit(fun, devices, mesh, in_shardings, out_shardings, options, keep_unused)


def _check_unsupported(device, backend, inline, compiler_options) -> None:
    """``jax.jit`` options that have no meaning for an MPMD program: an error each."""
    why = None
    if device is not None or backend is not None:
        name = "device" if device is not None else "backend"
        why = (f"`mjit` does not take {name}= (deprecated in `jax.jit` too): an MPMD "
               f"program runs on a list of devices. Pass `devices=` or `mesh=` instead.")
    elif inline:
        why = ("`mjit` does not take inline=True: an MPMD program runs in multimesh's "
               "runtime, one XLA executable per fragment, and cannot be inlined into an "
               "enclosing jax trace. Call the function itself (without `mjit`) there.")
    elif compiler_options:
        why = (f"`mjit` does not take compiler_options= ({sorted(compiler_options)}): each "
               f"fragment is compiled separately with XLA's defaults; set XLA flags through "
               f"the XLA_FLAGS environment variable instead.")
    if why is not None:
        raise MultimeshValueError(why)


def parallelize(fun: Callable, *, init_params: Callable | None = None,
                get_input_batch: Callable | None = None, initial_batch=None,
                devices: Sequence | None = None):
    """Compiles an abstract ``fun(params, batch)`` into a sharded function.

    Returns a :class:`ParallelizeResult`: it unpacks as ``(sharded_fun,
    init_sharded_params, get_sharded_batch)`` when ``get_input_batch`` is given,
    else as ``(sharded_fun, init_sharded_params)``; all three are attributes in
    both forms.
    Parameters and the batch are placed where the task that first consumes them
    wants them.
    """
    if get_input_batch is None and initial_batch is None:
        raise MultimeshValueError(
            "multimesh.jax.parallelize requires either a get_input_batch function or an "
            "initial_batch argument.")
    if init_params is None:
        raise MultimeshValueError("multimesh.jax.parallelize requires init_params.")
    with _contexts.autoshard(True), _contexts.internal_trace():  # shapes only
        params = jax.eval_shape(init_params)
        if initial_batch is None:
            assert get_input_batch is not None  # one of the two was required above
            batch = jax.eval_shape(get_input_batch)
        else:
            batch = initial_batch
    program = mjit(fun, devices=devices, keep_unused=True)
    program.pin_committed = initial_batch is not None  # its shardings are kept (MultiMesh)
    compiled = program.lower(params, batch).compile()
    param_sh, batch_sh = compiled.input_shardings[0]

    def init_sharded_params():
        with _contexts.internal_trace():  # placed by param_sh, not by its tasks
            if jax.process_count() > 1:  # each parameter computed only by its owners
                return distributed.owner_init(init_params, param_sh)
            return jax.device_put(init_params(), param_sh)

    make_batch = get_input_batch if initial_batch is None else lambda: initial_batch
    assert make_batch is not None  # one of the two was required above

    def get_sharded_batch():
        with _contexts.internal_trace():
            return jax.device_put(make_batch(), batch_sh)

    # The original library's forms: 3 values with get_input_batch, 2 with initial_batch.
    return ParallelizeResult((compiled, init_sharded_params, get_sharded_batch),
                             length=3 if initial_batch is None else 2)
