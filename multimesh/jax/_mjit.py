"""``mjit`` and ``parallelize``: trace → our pass pipeline → per-fragment compile → run."""

from __future__ import annotations

import io
import os
import shlex
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multimesh._src.caches import LRUCache, ProgramCaches
from multimesh._src.errors import (
    DiagnosticError,
    MultimeshTypeError,
    MultimeshValueError,
    PassFailure,
    PipelineError,
)
from multimesh._src.log import compile_log_level, logger
from multimesh._src.mlir import file_line_col, ir, make_context, parse_module, print_module
from multimesh.jax import _checks, _contexts, _dump, _fast_path, _inputs, _multimesh
from multimesh.jax._module_names import module_names
from multimesh.jax._pipeline import build_pipeline
from multimesh.jax._results import ParallelizeResult
from multimesh.jax._task import warn_renamed_tasks, with_sharding_constraint
from multimesh.passes.pipeline import VERIFIER, Pipeline, PipelineHooks, parse_pipeline
from multimesh.passes.schedules import SPLIT_SCHEDULES
from multimesh.runtime import Executor, build_plan, distributed

__all__ = ["mjit", "parallelize", "default_pipeline", "MpmdLowered", "MpmdCompiled"]


def default_pipeline(num_devices: int) -> str:
    """The pass pipeline for a plain program (also printed in repro commands)."""
    return str(build_pipeline(num_devices))


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
        from multimesh.passes.schedule_fragments import read_schedule

        return read_schedule(self._module)

    def profile(self, *args, trace_path=None, **kwargs):
        """Run one step synchronously, timing every fragment and transfer.

        Returns the outputs; with ``trace_path`` also writes a Chrome/Perfetto trace
        (one track per submesh). Blocking after each step makes the timeline readable
        at the cost of overlap, so use it to inspect, not to benchmark.
        """
        from multimesh.runtime.trace import TraceRecorder

        flat, tree = jax.tree.flatten((args, kwargs))
        if self._lowered.in_avals is not None and tree == self._lowered.in_tree:
            _check_leaf_types(flat, self._lowered.in_avals, args, kwargs)
        rec = TraceRecorder()
        outs = self._exec.run_traced(rec, *[flat[i] for i in self._lowered.dyn_idx])
        if trace_path is not None:
            rec.write(trace_path)
        self.last_trace = rec
        return jax.tree.unflatten(self._lowered.out_tree, outs)

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

    def cost_analysis(self) -> dict:
        total: dict[str, float] = {}
        for name in self.plan_data.fragments:
            exe = self._exec.exes[name]
            ca = exe.cost_analysis()
            ca = ca[0] if isinstance(ca, (list, tuple)) else ca
            for k, v in (ca or {}).items():
                if isinstance(v, (int, float)):
                    total[k] = total.get(k, 0.0) + v
        return total


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

    def as_text(self) -> str:
        if isinstance(self._program, bytes):  # bytecode from jax: print it once, on demand
            self._program = print_module(parse_module(self._program, make_context()),
                                         debug_info=True)
        return self._program

    def compiler_ir(self) -> ir.Module:
        return parse_module(self._program, make_context())

    def _input_module(self) -> ir.Module:
        """What the pass pipeline starts from: the program plus its compile options."""
        module = self.compiler_ir()
        _annotate(module, self.schedule_config, len(self.devices), self.default_mesh)
        return module

    fast: _fast_path.FastPath | None = None
    """A FastPath when the program takes enable_fast_path's jax.jit route."""
    default_mesh: tuple[tuple[str, ...], tuple[int, ...]] | None = None
    """(axis names, sizes) of the implicit default task, if not x=N."""

    def compile(self) -> MpmdCompiled | _fast_path.FastCompiled:
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

            module.operation.attributes["mm.schedule_config"] = py_to_attr(schedule_config)
        module.operation.attributes["mm.num_devices"] = _i64(module, num_devices)
        if default_mesh is not None:  # mm-assign-tasks keeps this mm.default entry
            from multimesh._src.mlir import py_to_attr

            names, sizes = default_mesh
            module.operation.attributes["mm.tasks"] = py_to_attr({"mm.default": {
                "devices": list(range(num_devices)), "axis_names": list(names),
                "axis_sizes": list(sizes), "logical_axes": []}})


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
    path = _dump.repro_path(where)
    with open(path, "w") as f:
        f.write(_failed_input(pipe, getattr(e, "failed_index", None), source))
    where_loc = file_line_col(e.location)
    loc = f" (at {where_loc[0]}:{where_loc[1]}:{where_loc[2]})" if where_loc else ""
    element, note = _replay_element(pipe, e, path)
    repro = f"mm-opt {shlex.quote(path)} -p {shlex.quote('builtin.module(' + element + ')')}"
    return PassFailure(f"multimesh pass '{failed}' failed: {e.message}{loc}\n"
                       f"Reproduce with:\n  {repro}{note}", failed, repro, e)


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


def _schedule_config(notes: dict) -> dict | None:
    """The microbatch loop's schedule, stored on the module (so repros replay it).

    Only what the program asked for: the pass warns about a schedule that cannot
    apply, and a default GPipe was not asked for.
    """
    cfg = notes.get("microbatch")
    if cfg is None:
        return None
    out = {}
    if cfg.get("requested"):
        out["schedule"] = cfg["schedule"]
    for key in ("num_stages", "interleave", "unrolling"):
        if cfg.get(key):
            out[key] = int(cfg[key])
    if cfg.get("custom"):
        out["custom_schedule"] = [[[int(mb), name] for mb, name in row] for row in cfg["custom"]]
    return out


def _wants_split(notes: dict) -> str | None:
    """Options for mm-split-backward: all backwards (zero-bubble) or flagged tasks."""
    cfg = notes.get("microbatch")
    if cfg and cfg["schedule"] in SPLIT_SCHEDULES:
        return "all=true"
    return "" if notes.get("split_backprop") else None


def _schedule_options(notes: dict) -> str | None:
    # The options live in the module's mm.schedule_config; the pass reads them there.
    return "" if notes.get("microbatch") is not None else None


def _argnums(kind: str, nums) -> tuple[int, ...]:
    """``static_argnums``/``donate_argnums`` as a tuple of plain ints."""
    if nums is None:
        return ()
    flat = np.atleast_1d(np.asarray(nums, dtype=object)).reshape(-1).tolist()
    for i in flat:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise MultimeshTypeError(
                f"`mjit` {kind} must be an int or a sequence of ints, got {nums!r}.")
    return tuple(int(i) for i in flat)


def _resolve_argnums(kind: str, nums: tuple[int, ...], nargs: int) -> tuple[int, ...]:
    """``nums`` with negative indices counted from the end; each must name an argument."""
    out = []
    for i in nums:
        if not -nargs <= i < nargs:
            valid = f" (valid indices are 0..{nargs - 1})" if nargs else ""
            raise MultimeshValueError(
                f"`mjit` {kind} names argument {i}, but the function was called with "
                f"{nargs} positional argument{'' if nargs == 1 else 's'}{valid}.")
        out.append(i % nargs)
    return tuple(out)


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


class _MJit(ProgramCaches):
    _program_caches = ("_cache", "_placed")

    def __init__(self, fun, devices, mesh, in_shardings, out_shardings, donate_argnums,
                 static_argnums):
        self.fun = fun
        self.mesh = mesh
        if devices is None and mesh is not None:
            devices = list(mesh.devices.flat)
        self.devices = _checks.program_devices(devices) if devices is not None else None
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        if self.devices is not None:
            _check_distinct_devices(self.devices)
        self.donate_argnums = _argnums("donate_argnums", donate_argnums)
        self.static_argnums = _argnums("static_argnums", static_argnums)
        self._cache = LRUCache("multimesh mjit programs")
        self._placed = LRUCache("multimesh mjit programs for committed inputs")
        # Pin committed inputs even where the program constrains them (parallelize's
        # initial_batch); see multimesh.jax._inputs.
        self.pin_committed = False

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

    def lower(self, *args, **kwargs) -> MpmdLowered:
        devices = self._devices()
        static = _resolve_argnums("static_argnums", self.static_argnums, len(args))
        donate = _resolve_argnums("donate_argnums", self.donate_argnums, len(args))
        dyn_args = [a for i, a in enumerate(args) if i not in static]
        fun, in_sh, out_sh = self.fun, self.in_shardings, self.out_shardings

        def wrapped(*dargs, **kw):
            full, it = [], iter(dargs)
            for i in range(len(args)):
                full.append(args[i] if i in static else next(it))
            if in_sh is not None:
                full = list(_constrain_tree(tuple(full), in_sh))
            out = fun(*full, **kw)
            if out_sh is not None:
                out = _constrain_tree(out, out_sh)
            return out

        t0 = time.perf_counter()
        abstract = jax.tree.map(_abstract, (tuple(dyn_args), kwargs))
        notes: dict = {}
        with _contexts.program_devices(devices), _contexts.autoshard(True), \
                _contexts.notes(notes), module_names():
            traced = jax.jit(wrapped, keep_unused=True).trace(*abstract[0], **abstract[1])
            lowered = traced.lower()
            # jax's module moves into our context as bytecode (no text printed or parsed)
            # and is parsed once: the registered-task scan and compile() share it.
            program = _bytecode(lowered.compiler_ir("stablehlo"))
            module = parse_module(program, make_context())
            implicit = _multimesh.implicit_tasks_pass(module)  # registered tasks, in memory
            _checks.no_explicit_sharding(traced.jaxpr, implicit is not None)
        trace_seconds = time.perf_counter() - t0
        warn_renamed_tasks(notes)
        flat_all, in_tree = jax.tree.flatten((tuple(args), kwargs))
        # positions of dynamic leaves among all leaves (static args carry no leaves)
        dyn_flat, _ = jax.tree.flatten((tuple(dyn_args), kwargs))
        changed, pins = _pin_inputs(module, self.in_shardings, args, static, dyn_args, kwargs,
                                    dyn_flat, notes, devices, self.pin_committed)
        if changed:  # the program the repro replays is the pinned one
            program = _bytecode(module)
        in_tree_dyn = jax.tree.structure((tuple(dyn_args), kwargs))
        donated = _donated_leaves(args, static, donate)
        key_in = [_is_key(x) for x in dyn_flat]
        key_out = [x.dtype._impl if _is_key(x) else None
                   for x in jax.tree.leaves(traced.out_info)]
        low = MpmdLowered(program, devices, in_tree_dyn, lowered.out_tree,
                          list(range(len(dyn_flat))), donated_leaves=donated,
                          in_avals=traced.jaxpr.in_avals,
                          key_inputs=key_in if any(key_in) else (),
                          key_outputs=key_out if any(k is not None for k in key_out) else (),
                          schedule_config=_schedule_config(notes),
                          pipeline=build_pipeline(len(devices), schedule=_schedule_options(notes),
                                                  implicit_tasks=implicit,
                                                  split_backward=_wants_split(notes),
                                                  recompute=_contexts.state.recomputation),
                          module=module, name=getattr(self.fun, "__name__", None))
        mesh = self._program_mesh(devices)
        if mesh is not None:
            low.default_mesh = (tuple(mesh.axis_names), tuple(mesh.devices.shape))
        if _fast_path.eligible(module, implicit, notes, pins, len(devices)):
            low.fast = _fast_path.FastPath(traced.jaxpr, in_tree_dyn, lowered.out_tree,
                                           jax.tree.leaves(abstract), pins, devices, donated,
                                           low.as_text(), low.default_mesh)
        low.trace_seconds = trace_seconds
        _log_phase(low, "traced and lowered", trace_seconds)
        return low

    def __call__(self, *args, **kwargs):
        static_idx = _resolve_argnums("static_argnums", self.static_argnums, len(args)) \
            if self.static_argnums else ()
        static = tuple(args[i] for i in static_idx)
        for i, a in zip(static_idx, static):
            try:
                hash(a)
            except TypeError:
                raise MultimeshTypeError(
                    f"`mjit` static argument {i} must be hashable, got {type(a).__name__} "
                    f"{a!r}. Pass a tuple instead of a list, or make the argument dynamic."
                ) from None
        dyn = [a for i, a in enumerate(args) if i not in static_idx]
        leaves, tree = jax.tree.flatten((tuple(dyn), kwargs))
        key = (tree, static, tuple((np.shape(x), str(getattr(x, "dtype", type(x))),
                                    bool(getattr(x, "weak_type", False))) for x in leaves),
               _multimesh.compile_token(), _contexts.state.fast_path)
        placed = _inputs.committed_key(leaves)
        if any(p is not None for p in placed):  # committed inputs are physical shardings
            compiled = self._placed.get((key, placed))
            if compiled is None:
                base = self._cache.get(key)
                compiled = base if base is not None and _inputs.fits(base, leaves) \
                    else self.lower(*args, **kwargs).compile()
                self._placed[(key, placed)] = compiled
            return compiled(*dyn, **kwargs)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self.lower(*args, **kwargs).compile()
            self._cache[key] = compiled
        return compiled(*dyn, **kwargs)


def _bytecode(module: ir.Module) -> bytes:
    buf = io.BytesIO()
    module.operation.write_bytecode(buf)
    return buf.getvalue()


def _pin_inputs(module, in_shardings, args, static, dyn_args, kwargs, dyn_flat, notes,
                devices, force: bool) -> tuple[bool, dict]:
    """Pin physical input shardings (``_inputs``) on the lowered program's arguments, in
    place; returns (whether the module changed, the pins)."""
    specs = _inputs.leaf_in_shardings(in_shardings, args, static,
                                      len(jax.tree.leaves(kwargs)))
    paths = [_leaf_name(p) for p, _ in
             jax.tree_util.tree_flatten_with_path((tuple(dyn_args), kwargs))[0]]
    pins, drop, committed = _inputs.plan_pins(
        dyn_flat, specs, notes.get("logical_names", set()), tuple(devices), paths)
    changed = bool(pins or drop)
    _, pins = _inputs.pin_module(module, pins, drop, set() if force else committed)
    return changed, pins


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


def mjit(fun: Callable, *, mesh: Mesh | None = None, devices: Sequence | None = None,
         in_shardings=None, out_shardings=None, donate_argnums=(), static_argnums=()):
    """Compiles ``fun`` as an MPMD program: each task on its submesh.

    ``devices`` (or ``mesh``) is the program's device list; ``TaskMesh``
    positions refer to it. ``in_shardings``/``out_shardings`` given as
    ``NamedSharding``s become logical constraints on the inputs/outputs, so
    their axis names are interpreted by the task that consumes/produces them.
    """
    if not callable(fun):
        raise MultimeshTypeError(f"`mjit` expects a callable, got {type(fun).__name__}.")
    return _MJit(fun, devices, mesh, in_shardings, out_shardings, donate_argnums, static_argnums)


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
    with _contexts.autoshard(True):
        params = jax.eval_shape(init_params)
        if initial_batch is None:
            assert get_input_batch is not None  # one of the two was required above
            batch = jax.eval_shape(get_input_batch)
        else:
            batch = initial_batch
    program = mjit(fun, devices=devices)
    program.pin_committed = initial_batch is not None  # its shardings are kept (MultiMesh)
    compiled = program.lower(params, batch).compile()
    param_sh, batch_sh = compiled.input_shardings[0]

    def init_sharded_params():
        if jax.process_count() > 1:  # each parameter computed only by its owners
            return distributed.owner_init(init_params, param_sh)
        return jax.device_put(init_params(), param_sh)

    make_batch = get_input_batch if initial_batch is None else lambda: initial_batch
    assert make_batch is not None  # one of the two was required above

    def get_sharded_batch():
        return jax.device_put(make_batch(), batch_sh)

    # The original library's forms: 3 values with get_input_batch, 2 with initial_batch.
    return ParallelizeResult((compiled, init_sharded_params, get_sharded_batch),
                             length=3 if initial_batch is None else 2)
