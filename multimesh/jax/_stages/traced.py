"""``MpmdTraced``: ``mjit(f).trace(*args)``; ``lower()`` lowers it, runs the
registered-task scan, pins physical input shardings and picks the pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
from jax.sharding import AxisType, NamedSharding

from multimesh._src import callbacks as _callbacks
from multimesh._src import jax_compat
from multimesh._src.log import log_phase
from multimesh._src.mlir import make_context, module_bytecode, parse_module
from multimesh.jax import _contexts
from multimesh.jax._implicit_tasks import implicit_task_rules
from multimesh.jax._stages import disk_cache as _disk_cache
from multimesh.jax._stages import fast_path as _fast_path
from multimesh.jax._stages import inputs as _inputs
from multimesh.jax._stages.call_checks import is_key, leaf_name
from multimesh.jax._stages.call_convention import traced_key_impls
from multimesh.jax._stages.lowered import MpmdLowered, input_text
from multimesh.jax._stages.pipeline import program_pipeline, schedule_config_of
from multimesh.jax._stages.stage import LoweredProgram, StageBase, forward
from multimesh.jax._task import warn_renamed_tasks
from multimesh.jax._trace_notes import TraceNotes

__all__ = ["MpmdTraced"]


class MpmdTraced(StageBase):
    """``mjit(f).trace(*args)``: the program as a jaxpr, before lowering.

    ``jaxpr`` is over the leaves of the dynamic arguments (static ones are folded in);
    ``out_info`` gives the outputs' ``jax.ShapeDtypeStruct``s; ``lower()`` lowers it
    for the pass pipeline (``MpmdLowered``).
    """

    def __init__(self, owner, traced, devices, notes: TraceNotes, dyn: tuple, abstract,
                 donated: list[int], in_shardings, seconds: float,
                 out_placements: dict[int, NamedSharding] | None = None):
        self._owner = owner
        self._traced = traced
        self._devices = tuple(devices)
        self._notes = notes
        self._dyn = dyn
        self._abstract = abstract
        self._donated = donated
        self._in_shardings = in_shardings
        self.trace_seconds = seconds
        self.out_placements: dict[int, NamedSharding] = dict(out_placements or {})
        """Output leaf -> the physical ``out_shardings`` entry it is moved onto."""

    jaxpr = forward("_traced", "jaxpr")
    out_info = forward("_traced", "out_info")
    out_avals = forward("_traced", "out_avals")

    @property
    def in_avals(self) -> tuple:
        return tuple(self._traced.jaxpr.in_avals)

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

    def lower(self) -> MpmdLowered:
        owner, traced, devices, notes = self._owner, self._traced, self._devices, self._notes
        t0 = time.perf_counter()
        dyn_args, kwargs = self._dyn
        dyn_flat, in_tree = jax.tree.flatten((dyn_args, kwargs))
        # a restarted process: the lowered program from multimesh's disk cache (issue 40)
        key = _disk_cache.trace_key(self)
        program = _disk_cache.read_program(key, f"mjit({self.fun_name})")
        module, implicit, held, ordered = None, None, (), False
        pins: dict = {}
        if program is None:
            with _contexts.program_devices(devices), _contexts.autoshard(True), \
                    _contexts.notes(notes):
                program, module, implicit, held, ordered = self._lower_module()
            changed, pins = _pin_inputs(module, self._in_shardings, dyn_args, kwargs,
                                        dyn_flat, notes, devices, owner.pin_committed)
            if changed:  # the program the repro replays is the pinned one
                program = module_bytecode(module)
        trace_seconds = self.trace_seconds + time.perf_counter() - t0
        warn_renamed_tasks(notes)
        mesh = owner.program_mesh(devices)
        key_in = [is_key(x) for x in dyn_flat]  # typed PRNG keys cross as their raw data
        key_out = traced_key_impls(jax.tree.leaves(traced.out_info))
        record = LoweredProgram(
            program, tuple(devices), in_tree, traced.out_tree, tuple(range(len(dyn_flat))),
            program_pipeline(len(devices), notes, implicit, _contexts.state.recomputation),
            donated_leaves=tuple(self._donated), schedule_config=schedule_config_of(notes),
            key_inputs=tuple(key_in) if any(key_in) else (),
            key_outputs=tuple(key_out) if any(k is not None for k in key_out) else (),
            in_avals=tuple(traced.jaxpr.in_avals), name=getattr(owner.fun, "__name__", None),
            out_placements=dict(self.out_placements),
            explicit_outputs=explicit_axes(traced.out_avals),
            unused_leaves=frozenset() if owner.keep_unused else
            frozenset(jax_compat.unused_inputs(traced.jaxpr)),
            default_mesh=None if mesh is None else (tuple(mesh.axis_names),
                                                    tuple(mesh.devices.shape)),
            trace_seconds=trace_seconds,
            host_callbacks=held)  # alive while the program may compile
        # (ordered callbacks: jax.jit runs ordered debug prints on one device only)
        if module is not None and not ordered and _fast_path.eligible(
                module, implicit, notes, pins, len(devices)):
            record = dataclasses.replace(record, fast=_fast_path.FastPath(
                traced.jaxpr, jax.tree.leaves(self._abstract), pins, input_text(record)))
        elif module is not None and not held:
            _disk_cache.write_program(key, program)
        log_phase(record.label, "traced and lowered" if module is not None else
                  "traced (the lowered program read from the disk cache)", trace_seconds)
        return MpmdLowered(record, module)

    def _lower_module(self):
        """jax's lowering, in our context: ``(program bytecode, module, registered-task
        rules, host callbacks held, whether they are ordered)``."""
        with _lowering_scope(self._notes):
            lowered = self._traced.lower()
        # jax's module moves into our context as bytecode (no text printed or parsed)
        # and is parsed once: the registered-task scan and compile() share it.
        program = module_bytecode(lowered.compiler_ir("stablehlo"))
        module = parse_module(program, make_context())
        host_callbacks, ordered = jax_compat.lowered_callbacks(lowered)
        held = _callbacks.adopt(module, host_callbacks)
        if held:  # the callbacks' numbers are in the program now
            program = module_bytecode(module)
        implicit = implicit_task_rules(module)  # registered tasks, in memory
        return program, module, implicit, held, ordered


def explicit_axes(avals) -> tuple[tuple[str, ...], ...]:
    """Per aval, the axes of its type's mesh that are ``Explicit`` (jax's explicit
    sharding mode); () when none has any."""
    out = []
    for aval in jax.tree.leaves(avals):
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        if mesh is None or not getattr(mesh, "axis_types", None):
            out.append(())
            continue
        out.append(tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                         if t == AxisType.Explicit))
    return tuple(out) if any(out) else ()


def _pin_inputs(module, in_shardings, dyn_args, kwargs, dyn_flat, notes, devices,
                force: bool) -> tuple[bool, dict]:
    """Pin physical input shardings (``_inputs``) on the lowered program's arguments, in
    place; returns (whether the module changed, the pins). ``in_shardings`` is a prefix
    of the dynamic positional arguments, as for ``jax.jit``."""
    specs = _inputs.leaf_in_shardings(in_shardings, dyn_args, (),
                                      len(jax.tree.leaves(kwargs)))
    paths = [leaf_name(p) for p, _ in
             jax.tree_util.tree_flatten_with_path((tuple(dyn_args), kwargs))[0]]
    pins, drop, committed = _inputs.plan_pins(
        dyn_flat, specs, notes.logical_names, tuple(devices), paths)
    changed = bool(pins or drop)
    _, pins = _inputs.pin_module(module, pins, drop, set() if force else committed)
    return changed, pins



def _lowering_scope(notes):
    """No concrete mesh in context while jax lowers a program whose registered tasks were
    traced under their own meshes (:attr:`TraceNotes.stage_meshes`): jax lowers a
    ``shard_map`` traced on an abstract mesh on the concrete mesh in context when there
    is one, so a stage's ``shard_map`` would be partly manual over the program's mesh
    (its collectives' groups repeated over every device, ``axis_index`` recursing);
    without one it lowers on the stage's mesh, as an explicit task's does."""
    if notes is None or not notes.stage_meshes:
        return contextlib.nullcontext()
    return jax_compat.mesh_scope(jax.sharding.get_abstract_mesh(), None)
