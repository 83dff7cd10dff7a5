"""``mjit``: options checked once, a program traced per argument types, cached.

The stages live beside it: ``traced`` (``MpmdTraced``, tracing to lowering),
``lowered`` (``MpmdLowered``, the passes), ``compiled`` (``MpmdCompiled``, the
runtime), ``stage`` (their ``LoweredProgram`` record and base); ``pipeline_runner``
runs the passes with repros, ``call_checks`` checks calls and options. Arguments a
wing's handler claims (NNX objects) go to it (``handlers``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import AxisType, Mesh, NamedSharding

from multimesh._src import jax_compat
from multimesh._src.caches import LRUCache, ProgramCaches
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError, MultimeshWarning
from multimesh.jax import _checks, _contexts, _global_mesh, _multimesh, _registrations
from multimesh.jax._registered_meshes import registered_task_meshes
from multimesh.jax._stages import handlers
from multimesh.jax._stages import inputs as _inputs
from multimesh.jax._stages.call_checks import (
    abstract_value,
    check_distinct_devices,
    check_unsupported,
    typed_specs,
)
from multimesh.jax._stages.options import ArgOptions, Bound, resolve_options
from multimesh.jax._stages.traced import MpmdTraced
from multimesh.jax._task import broadcast_prefix, jax_constraint_hint, with_sharding_constraint
from multimesh.jax._trace_notes import TraceNotes

__all__ = ["mjit"]


class _ClaimedOutput(Exception):  # noqa: N818 - a signal, caught in _MJit._trace
    """The function returned objects a handler claims (NNX objects): trace it again
    through that handler."""

    def __init__(self, handler: handlers.ArgumentHandler):
        super().__init__()
        self.handler = handler


@dataclasses.dataclass(frozen=True, slots=True)
class _Handled:
    """A cache entry: calls with these arguments go through ``handler`` (a function
    that returns NNX objects although it takes none: the handler compiles it)."""

    handler: handlers.ArgumentHandler


_TRANSFORMS = {"DynamicJaxprTracer": "jax.jit (or another trace: jax.eval_shape, lax.scan, "
                                     "a jax.checkpoint)",
               "JVPTracer": "jax.grad or jax.jvp", "LinearizeTracer": "jax.grad or jax.vjp",
               "BatchTracer": "jax.vmap"}


def _refuse_tracers(fun, args, kwargs) -> None:
    """``mjit`` runs compiled MPMD programs on concrete arrays; under a jax transform
    its arguments are tracers, which no MPMD program can take."""
    tracer = next((x for x in jax.tree.leaves((args, kwargs)) if isinstance(x, Tracer)), None)
    if tracer is None:
        return
    kind = type(tracer).__name__
    if _contexts.state.program_devices is not None:
        raise MultimeshTypeError(
            f"`mjit({getattr(fun, '__name__', 'fun')})` was called inside another `mjit` "
            f"program while it was traced; `mjit` functions do not nest. Call the inner "
            f"function plainly (its tasks are placed by the outer `mjit`).")
    raise MultimeshTypeError(
        f"`mjit({getattr(fun, '__name__', 'fun')})` was called under "
        f"{_TRANSFORMS.get(kind, 'a jax transformation')} (an argument is a {kind}): an "
        f"`mjit` program is compiled and run by multimesh on concrete arrays and cannot be "
        f"traced by jax. Put the transformation inside it (`mjit(jax.grad(f))`, "
        f"`mjit(jax.vmap(f))`) and call the `mjit` function outside `jax.jit`, or call "
        f"the plain function there.")


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
            check_distinct_devices(self.devices)
        self.options = options
        self.keep_unused = bool(keep_unused)
        self._cache = LRUCache("multimesh mjit programs")
        self._placed = LRUCache("multimesh mjit programs for committed inputs")
        self._seen: list = [None]  # the last call's leaf types (_leaf_types)
        # Pin committed inputs even where the program constrains them (parallelize's
        # initial_batch); see multimesh.jax._stages.inputs.
        self.pin_committed = False
        # the `with plan:` / `with Context():` blocks this was built in (see _left_blocks)
        self._built_in = [f.context for f in _registrations.entered_frames()[1:]
                          if f.live]
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
        global_mesh = _global_mesh.active_multimesh()  # inside `with MultiMesh(...)`
        return tuple(global_mesh.devices.flat) if global_mesh is not None \
            else tuple(jax.devices())

    def program_mesh(self, devices) -> Mesh | None:
        """The mesh the program's devices came from (``mjit(mesh=...)``, the MultiMesh):
        the implicit default task runs on it, named as the caller named it."""
        outer = _global_mesh.active_multimesh() if self.devices is None or \
            self.mesh is not None else None
        for mesh in (self.mesh, outer, _explicit_context_mesh()):
            if mesh is not None and tuple(mesh.devices.flat) == tuple(devices):
                return getattr(mesh, "global_mesh", mesh)
        return None

    def trace(self, *args, **kwargs):
        """Trace for these arguments (``jax.jit(f).trace``): ``jaxpr``, ``out_info``,
        ``lower()``. Arrays or ``jax.ShapeDtypeStruct``s; nothing is compiled."""
        return self._trace(self.options.bind(args, kwargs))

    def _trace(self, bound: Bound):
        handler = handlers.for_arguments((bound.dyn_args, bound.dyn_kwargs))
        if handler is not None:
            return handler.trace(self, bound)
        try:
            return self._trace_plain(bound)
        except _ClaimedOutput as e:
            return e.handler.trace(self, bound)

    def _trace_plain(self, bound: Bound) -> MpmdTraced:
        """The trace of arguments no handler claims; raises ``_ClaimedOutput`` when the
        function returns objects a handler claims."""
        fun, in_sh, out_sh = self.fun, self.in_shardings, self.out_shardings
        placements: dict[int, NamedSharding] = {}

        def wrapped(*dargs, **dkw):
            if in_sh is not None:
                dargs = _constrain_tree(tuple(dargs), in_sh)
            full, kw = bound.merge(dargs, dkw)
            with jax_constraint_hint("in an `mjit` program"):
                out = fun(*full, **kw)
            claimed = handlers.for_arguments(out)
            if claimed is not None:  # new NNX objects: returned as nnx.jit returns them
                raise _ClaimedOutput(claimed)
            return out if out_sh is None else _constrain_outputs(out, out_sh, placements)

        wrapped.__name__ = getattr(fun, "__name__", "fun")  # name stacks read jit(<fun>)
        return self.trace_flat(wrapped, bound.dyn_args, bound.dyn_kwargs,
                               bound.donated_flags(), in_sh, placements)

    def trace_flat(self, fun, dyn_args: tuple, kwargs: dict, donated: Sequence[bool],
                   in_shardings=None, out_placements=None) -> MpmdTraced:
        """Trace ``fun`` of dynamic arguments only (statics already bound), under the
        program's contexts; ``donated`` flags each leaf of ``(dyn_args, kwargs)``
        (``handlers.MjitProgram``: argument handlers trace through it).
        ``out_placements``: filled while ``fun`` is traced, output leaf -> the physical
        ``out_shardings`` entry it is moved onto after a run."""
        devices = self._devices()
        self._warn_left_blocks()
        t0 = time.perf_counter()
        abstract = jax.tree.map(abstract_value, (tuple(dyn_args), kwargs))
        notes = TraceNotes()
        with _contexts.program_devices(devices), _contexts.autoshard(True), \
                _contexts.notes(notes), handlers.module_names(), registered_task_meshes(), \
                jax_compat.many_meshes():
            traced = jax.jit(fun, keep_unused=True).trace(*abstract[0], **abstract[1])
        return MpmdTraced(self, traced, devices, notes, (tuple(dyn_args), kwargs),
                          abstract, [i for i, d in enumerate(donated) if d], in_shardings,
                          time.perf_counter() - t0, dict(out_placements or {}))

    def _warn_left_blocks(self) -> None:
        """Warn (once) when the ``with plan:``/``with Context():`` block this function
        was built in has exited: its task rules no longer apply to this trace."""
        entered = {id(f.context) for f in _registrations.entered_frames()}
        left = [c for c in self._built_in if id(c) not in entered]
        if not left:
            return
        self._built_in = []
        rules = [r.matcher for c in left for r in c.registered]
        warnings.warn(
            f"`mjit({getattr(self.fun, '__name__', 'fun')})` was built inside a `with "
            f"plan:` (or `with Context():`) block, but it is traced after the block "
            f"exited, so the block's {len(rules)} task rule(s) ({', '.join(map(repr, rules))}"
            f") do not apply: what they would place runs without them (for a plan: not "
            f"pipelined, on all the program's devices). Call it (or `.lower(...)`) inside "
            f"the block, or register the rules for good (`plan.apply()`).",
            MultimeshWarning, stacklevel=_registrations.user_level())

    def lower(self, *args, **kwargs):
        """Trace and lower for these arguments (``jax.jit(f).lower``)."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args, **kwargs):
        """The outputs' shapes and dtypes (``jax.ShapeDtypeStruct``s), from a trace
        alone: nothing is lowered or compiled, and NNX objects are left unchanged."""
        return self.trace(*args, **kwargs).out_info

    def __call__(self, *args, **kwargs):
        _refuse_tracers(self.fun, args, kwargs)
        bound = self.options.bind(args, kwargs)
        handler = handlers.for_arguments((bound.dyn_args, bound.dyn_kwargs))
        if handler is not None:
            return handler.call(self, bound)
        dyn, dkw = bound.dyn_args, bound.dyn_kwargs
        leaves, tree = jax.tree.flatten((dyn, dkw))
        signature = (tree, _leaf_types(leaves, self._seen),
                     typed_specs(leaves))  # explicit mode: the types' shardings too
        placed = _inputs.committed_key(leaves)
        if any(p is not None for p in placed):  # committed inputs are physical shardings
            key = (self._key(bound, signature), placed)
            compiled = self._placed.get(key)
            if compiled is None:
                base = self._cache.get(key[0])
                compiled = base if base is not None and _inputs.fits(base, leaves) \
                    else self._compile(bound)
                self._placed[key] = compiled
        else:
            compiled = self.compiled_for(bound, signature, lambda: self._compile(bound))
        if isinstance(compiled, _Handled):
            return compiled.handler.call(self, bound)
        return compiled(*dyn, **dkw)

    @staticmethod
    def _key(bound: Bound, signature) -> tuple:
        """The cache key of a program: the dynamic arguments' ``signature`` (structure
        and types, as the caller reads them), the static arguments, and what else
        changes the program (``compile_token``, the fast path)."""
        return (signature, bound.static_key(), _multimesh.compile_token(),
                _contexts.state.fast_path)

    def compiled_for(self, bound: Bound, signature, build):
        """The program for ``bound`` and ``signature`` from the cache, else ``build()``,
        cached (``handlers.MjitProgram``: the one cache of plain and handled calls)."""
        key = self._key(bound, signature)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = build()
        return compiled

    def _compile(self, bound: Bound):
        """The compiled program, or a ``_Handled`` for a function that returns objects a
        handler claims although it takes none (the handler compiles and caches it)."""
        try:
            traced = self._trace_plain(bound)
        except _ClaimedOutput as e:
            return _Handled(e.handler)
        return traced.lower().compile()

    def clear_cache(self) -> None:
        """Forget the programs compiled for this function (``jax.jit``'s ``clear_cache``)."""
        self._cache.cache_clear()
        self._placed.cache_clear()


_ArrayImpl = jax_compat.array_impl_type()


def _leaf_types(leaves, seen: list) -> tuple:
    """Per leaf, (shape, dtype name, weak type): the types in ``mjit``'s cache key.

    ``seen`` remembers the last call's: leaves that are arrays with avals equal to
    the last call's (the very objects, step after step, when they are the outputs of
    the same executables) have its types, without reading each leaf again; any other
    leaf (a NumPy array, a scalar) never matches."""
    avals = [x.aval if type(x) is _ArrayImpl else object() for x in leaves]
    last = seen[0]
    if last is not None and last[0] == avals:
        return last[1]
    types = tuple((np.shape(x), str(getattr(x, "dtype", type(x))),
                   bool(getattr(x, "weak_type", False))) for x in leaves)
    seen[0] = (avals, types)
    return types


def _explicit_context_mesh() -> Mesh | None:
    """``jax.set_mesh``'s mesh when it has ``Explicit`` axes: explicit mode types the
    values outside every task over it too, so the implicit default task runs on it
    under its axis names (None otherwise)."""
    mesh = _global_mesh.current_global_mesh()
    if mesh is None or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return mesh


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
    try:
        return broadcast_prefix(shardings, tree)
    except ValueError as e:
        raise MultimeshValueError(
            f"`in_shardings`/`out_shardings` must be a prefix of the arguments/outputs "
            f"(as for jax.jit): {e}") from None


def _constrain_leaf(x, s):
    if isinstance(s, NamedSharding):
        s = s.spec
    return x if s is None else with_sharding_constraint(x, s)


def _constrain_tree(tree, shardings):
    """Apply ``shardings`` (a prefix of ``tree``, as jit's in_shardings) as logical constraints."""
    leaves, treedef = jax.tree.flatten(tree)
    entries = _leaf_entries(shardings, tree)
    return jax.tree.unflatten(treedef, [_constrain_leaf(x, s) for x, s in zip(leaves, entries)])


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
    check_unsupported(device, backend, inline, compiler_options)
    options = resolve_options(fun, static_argnums, static_argnames, donate_argnums,
                              donate_argnames)
    return _MJit(fun, devices, mesh, in_shardings, out_shardings, options, keep_unused)


