"""``MpmdCompiled``: a compiled MPMD program (``jax.stages.Compiled`` for MPMD), what it
offers to inspect (fragments, calls, transfers, cost and memory estimates)."""

from __future__ import annotations

import functools
import time

from multimesh._src.log import log_phase
from multimesh._src.mlir import ir, print_module
from multimesh.jax._analysis.costs import StepProfile, check_step_profile, profile_from_times
from multimesh.jax._analysis.memory import memory_profile
from multimesh.jax._analysis.trace_view import write_step_trace
from multimesh.jax._imported_schedule import recover_schedule
from multimesh.jax._stages.call_convention import CallConvention
from multimesh.jax._stages.stage import LoweredProgram, ProgramStage, forward
from multimesh.passes.api import read_schedule
from multimesh.runtime import Executor, build_plan
from multimesh.runtime.plan import Transfer
from multimesh.runtime.steps import layout_sharding
from multimesh.runtime.trace import TraceRecorder
from multimesh.schedules import Schedule

__all__ = ["MpmdCompiled", "MemoryAnalysis"]


class MpmdCompiled(ProgramStage):
    """A compiled MPMD program: call it on pytrees; inspect fragments and transfers.

    Every field is set here, from the lowered ``record`` and the module after the
    passes: the plan, the executor, the calling convention (``convention``) and the
    shardings it gives the arguments and results."""

    fast_path = False  # see FastCompiled (multimesh.jax._stages.fast_path)

    def __init__(self, record: LoweredProgram, module: ir.Module, times: dict | None = None,
                 pass_times: list | None = None, plan=None, pipeline_cache: str = "off"):
        self.record = lowered = record
        self.pipeline_cache = pipeline_cache
        """Whether the pass pipeline's result came from the disk cache beside jax's
        persistent cache: ``"hit"``, ``"miss"``, ``"damaged"`` or ``"off"``
        (``disk_cache``, issue 40)."""
        self.pass_times = list(pass_times or [])
        """``[(pass, seconds)]`` of the pass pipeline, in order (``"(verifier)"``: the
        final verification); ``compile_times["passes"]`` is their total plus parsing."""
        self._module = module
        self._text: str | None = None  # printed on demand: printing a big module costs as much as parsing
        t0 = time.perf_counter()
        # ``plan``: the plan of ``module`` read from the disk cache (issue 40)
        self.plan_data = plan = plan if plan is not None else build_plan(module)
        t1 = time.perf_counter()
        log_phase(lowered.label, "built the runtime plan", t1 - t0,
                   f"{len(plan.fragments)} fragments, {len(plan.calls())} calls, "
                   f"{len(plan.steps) - len(plan.calls())} transfers")
        self.convention = CallConvention.for_runtime(
            lowered, [layout_sharding(lay, lowered.devices) for lay in plan.out_layouts])
        """How a call's arguments become the executor's inputs, and its outputs results."""
        self._exec = Executor(plan, lowered.devices, self.convention.donated,
                              leaf_name=self.convention.arg_name)
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
        ``"memory"`` (compiled earlier in this process). For a split fragment
        (:attr:`split_fragments`), the first of these any of its pieces came from."""
        self.split_fragments = {
            name: (self._exec.exes[name].split.shares, list(pieces))
            for name, pieces in self._exec.split_pieces.items()}
        """Fragment name -> ``(the fragment whose program it shares, [(piece, where its
        executable came from, seconds)])`` for each fragment that holds another
        distinct fragment's program and runs as pieces around that program's
        executable (``MULTIMESH_SHARE_BLOCKS``, docs/performance.md "Cold compile of the
        lm1b step"); ``xla_times`` gives such a fragment its pieces' seconds summed."""
        log_phase(lowered.label, "compiled the fragments with XLA", self.compile_times["xla"],
                   f"{self._exec.xla_compiles} XLA compilations")
        log_phase(lowered.label, "finished compiling", sum(self.compile_times.values()),
                   ", ".join(f"{k} {v:.3f} s" for k, v in self.compile_times.items()))
        self.input_shardings = self.convention.input_shardings(self._exec.input_shardings)
        self.output_shardings = self.convention.output_shardings(self._exec.output_shardings)
        # an imported program's schedule is recovered from its call order (numbering
        # the plan's calls); mjit's is read from the module when first asked for
        self._recovered = None if lowered.call_counters is None else \
            recover_schedule(plan, lowered.call_counters)
        self.last_trace: TraceRecorder | None = None
        """The trace of the last ``profile`` (None before one)."""
        self.last_profile: StepProfile | None = None
        """The last ``profile``'s durations per schedule unit (a ``StepProfile``; None
        before one, or for a program without a schedule)."""

    out_placements = forward("record", "out_placements",
                             "Output leaf -> the physical ``out_shardings`` entry it is moved onto.")

    @functools.cached_property
    def schedule(self) -> Schedule | None:
        """The pipeline schedule (per-submesh fragment order), or None if not microbatched."""
        return self._recovered if self._recovered is not None else read_schedule(self._module)

    def __call__(self, *args, **kwargs):
        conv = self.convention
        return conv.results(self._exec(*conv.inputs(args, kwargs)))

    @property
    def run_ahead(self) -> int | None:
        """How far the host may dispatch ahead of the devices: at most this many fragment
        calls of one submesh in flight (None: no bound). Defaults to
        ``$MULTIMESH_RUN_AHEAD``, else 2 on CPU and no bound elsewhere; see
        docs/performance.md, "The real peak". Settable."""
        return self._exec.run_ahead

    @run_ahead.setter
    def run_ahead(self, limit: int | None) -> None:
        self._exec.set_run_ahead(limit)

    def as_text(self, fragment: str | None = None) -> str:
        """The program after the full pass pipeline (MPMD form); with ``fragment``, that
        fragment's program as XLA compiled it (optimized HLO: the collectives it runs)."""
        if fragment is not None:
            return self._exec.exes[fragment].as_text() or ""
        if self._text is None:
            self._text = print_module(self._module)
        return self._text

    def profile(self, *args, trace_path=None, **kwargs):
        """Run one step synchronously, timing every fragment and transfer.

        Returns the outputs; with ``trace_path`` also writes a Chrome/Perfetto trace
        laid out as ``visualize_schedule``'s picture (``multimesh.jax._analysis.trace_view``);
        a pipelined program's durations per schedule unit are then ``last_profile``
        (a :class:`multimesh.jax.StepProfile`). Blocking after each step makes the
        timeline readable at the cost of overlap, so use it to inspect, not to benchmark.
        """
        conv, rec = self.convention, TraceRecorder()
        outs, times = self._exec.run_timed(rec, conv.inputs(args, kwargs))
        sched = self.schedule
        self.last_profile = None if sched is None else profile_from_times(sched, [times])
        if trace_path is not None:
            write_step_trace(rec.events, self.plan_data, sched,
                             [d.id for d in self.record.devices], trace_path)
        self.last_trace = rec
        return conv.results(outs)

    def step_profile(self, *args, steps: int = 3, **kwargs):
        """Run ``steps`` steps, timing every fragment call alone: a
        :class:`multimesh.jax.StepProfile` (costs for ``schedule.simulate``)."""
        sched = check_step_profile(self.schedule, steps, bool(self.record.donated_leaves))
        flat = self.convention.inputs(args, kwargs)
        return profile_from_times(
            sched, [self._exec.run_timed(TraceRecorder(), flat)[1] for _ in range(steps)])

    def memory_profile(self, *args, **kwargs):
        """Run one step and measure, per submesh, the peak bytes the runtime holds
        (parameters, activations in flight, other values, XLA temporaries) beside
        the schedule's prediction: a :class:`multimesh.jax._analysis.memory.MemoryProfile`."""
        return memory_profile(self, self._exec.measure(self.convention.inputs(args, kwargs)))

    @property
    def fragments(self) -> list[dict]:
        out = []
        for f in self.plan_data.fragments.values():
            out.append({"name": f.name, "task": f.task,
                        "direction": "fwd" if f.transpose_count == 0 else "bwd",
                        "devices": [self.record.devices[p].id for p in f.devices],
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
                        "devices": [self.record.devices[p].id
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
