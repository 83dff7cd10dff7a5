"""``MpmdCompiled``: a compiled MPMD program (``jax.stages.Compiled`` for MPMD), what it
offers to inspect (fragments, calls, transfers, cost and memory estimates)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from multimesh._src.log import log_phase
from multimesh._src.mlir import ir, print_module
from multimesh.jax._stages.call_checks import check_call, leaf_name
from multimesh.jax._stages.stage import LoweredProgram, ProgramStage
from multimesh.runtime import Executor, build_plan
from multimesh.schedules import Schedule

__all__ = ["MpmdCompiled", "MemoryAnalysis", "place_outputs", "drop_unused", "explicit_placements",
           "retype_outputs"]


class MpmdCompiled(ProgramStage):
    """A compiled MPMD program: call it on pytrees; inspect fragments and transfers."""

    def __init__(self, record: LoweredProgram, module: ir.Module, times: dict | None = None,
                 pass_times: list | None = None, plan=None):
        self.record = lowered = record
        self.pass_times = list(pass_times or [])
        """``[(pass, seconds)]`` of the pass pipeline, in order (``"(verifier)"``: the
        final verification); ``compile_times["passes"]`` is their total plus parsing."""
        self._module = module
        self._text: str | None = None  # printed on demand: printing a big module costs as much as parsing
        t0 = time.perf_counter()
        # ``plan``: the plan of ``module`` read from the disk cache (issue 40)
        self.plan_data = plan if plan is not None else build_plan(module)
        t1 = time.perf_counter()
        log_phase(lowered.label, "built the runtime plan", t1 - t0,
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
        log_phase(lowered.label, "compiled the fragments with XLA", self.compile_times["xla"],
                   f"{self._exec.xla_compiles} XLA compilations")
        log_phase(lowered.label, "finished compiling", sum(self.compile_times.values()),
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
        self._retyped = explicit_placements(self._exec.output_shardings,
                                            lowered.explicit_outputs, lowered.out_placements)
        out_sh = [self._retyped.get(i, sh) for i, sh in enumerate(self._exec.output_shardings)]
        self.output_shardings = jax.tree.unflatten(lowered.out_tree, out_sh)

    fast_path = False  # see FastCompiled (multimesh.jax._stages.fast_path)
    pipeline_cache = "off"
    """Whether the pass pipeline's result came from the disk cache beside jax's persistent
    cache: ``"hit"``, ``"miss"``, ``"damaged"`` or ``"off"`` (``disk_cache``, issue 40)."""
    _recovered_schedule: Schedule | None = None  # set by compile_mpmd

    @property
    def out_placements(self) -> Mapping[int, NamedSharding]:
        """Output leaf -> the physical ``out_shardings`` entry it is moved onto."""
        return self.record.out_placements

    def _arg_name(self, i: int) -> str:
        """``args[0]['w']``: how errors name the executor's argument ``i``."""
        low = self.record
        leaves = jax.tree.unflatten(low.in_tree, list(range(low.in_tree.num_leaves)))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(leaves)[0]]
        return leaf_name(paths[low.dyn_idx[i]])

    def __call__(self, *args, **kwargs):
        low = self.record
        flat = check_call(low.in_tree, low.in_avals, args, kwargs)
        if not self._all_dynamic:
            flat = [flat[i] for i in low.dyn_idx]
        if low.key_inputs:  # typed PRNG keys travel as their raw uint32 data
            flat = [jax.random.key_data(x) if k else x for x, k in zip(flat, low.key_inputs)]
        outs = self._exec(*flat)
        if self.out_placements:
            outs = place_outputs(outs, self.out_placements)
        if self._retyped:
            outs = retype_outputs(outs, self._retyped)
        if low.key_outputs:
            outs = [jax.random.wrap_key_data(o, impl=impl) if impl is not None else o
                    for o, impl in zip(outs, low.key_outputs)]
        return jax.tree.unflatten(low.out_tree, outs)

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
        laid out as ``visualize_schedule``'s picture (``multimesh.jax._analysis.trace_view``);
        a pipelined program's durations per schedule unit are then ``last_profile``
        (a :class:`multimesh.jax.StepProfile`). Blocking after each step makes the
        timeline readable at the cost of overlap, so use it to inspect, not to benchmark.
        """
        from multimesh.jax._analysis.costs import profile_from_times
        from multimesh.runtime.timing import run_timed
        from multimesh.runtime.trace import TraceRecorder

        flat, tree = jax.tree.flatten((args, kwargs))
        low = self.record
        if low.in_avals is not None:
            flat = check_call(low.in_tree, low.in_avals, args, kwargs)
        rec = TraceRecorder()
        outs, times = run_timed(self._exec, rec, [flat[i] for i in low.dyn_idx])
        sched = self.schedule
        self.last_profile = None if sched is None else profile_from_times(sched, [times])
        outs = retype_outputs(place_outputs(outs, self.out_placements), self._retyped)
        if trace_path is not None:
            from multimesh.jax._analysis.trace_view import write_step_trace

            write_step_trace(rec.events, self.plan_data, self.schedule,
                             [d.id for d in low.devices], trace_path)
        self.last_trace = rec
        return jax.tree.unflatten(low.out_tree, outs)

    def step_profile(self, *args, steps: int = 3, **kwargs):
        """Run ``steps`` steps, timing every fragment call alone: a
        :class:`multimesh.jax.StepProfile` (costs for ``schedule.simulate``)."""
        from multimesh.jax._analysis.costs import step_profile

        return step_profile(self, args, kwargs, steps)

    def memory_profile(self, *args, **kwargs):
        """Run one step and measure, per submesh, the peak bytes the runtime holds
        (parameters, activations in flight, other values, XLA temporaries) beside
        the schedule's prediction: a :class:`multimesh.jax._analysis.memory.MemoryProfile`."""
        from multimesh.jax._analysis.memory import memory_profile

        return memory_profile(self, args, kwargs)

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


def place_outputs(outs: list, placements: Mapping) -> list:
    """Outputs with a physical ``out_shardings`` entry moved onto it."""
    return [jax.device_put(o, placements[i]) if i in placements else o
            for i, o in enumerate(outs)]


def explicit_placements(shardings: Sequence, explicit: Sequence[tuple[str, ...]],
                        placed: Mapping) -> dict[int, NamedSharding]:
    """Output leaf -> its sharding with the axes ``explicit`` names made ``Explicit``
    (jax's explicit sharding mode types an output over such a mesh, and a later call
    reads its type from there); leaves a physical ``out_shardings`` entry places are
    left to it."""
    out = {}
    for i, (sh, names) in enumerate(zip(shardings, explicit or ())):
        if not names or i in placed or not isinstance(sh, NamedSharding):
            continue
        mesh = sh.mesh
        types = tuple(AxisType.Explicit if n in names else AxisType.Auto
                      for n in mesh.axis_names)
        if types != tuple(mesh.axis_types):
            out[i] = NamedSharding(Mesh(mesh.devices, mesh.axis_names, axis_types=types),
                                   sh.spec, memory_kind=sh.memory_kind)
    return out


def retype_outputs(outs: list, retyped: Mapping[int, NamedSharding]) -> list:
    """Outputs given the shardings of :func:`explicit_placements`: the same buffers
    (the layout is the same), a mesh with ``Explicit`` axes."""
    if not retyped:
        return outs
    outs = list(outs)
    for i, sh in retyped.items():
        o = outs[i]
        outs[i] = jax.make_array_from_single_device_arrays(
            o.shape, sh, [s.data for s in o.addressable_shards])
    return outs


def drop_unused(compiled, unused: frozenset[int]) -> None:
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
