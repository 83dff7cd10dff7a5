"""Linen: ``task`` (module class → ``Task[<Model>]``), ``shard_axes``, ``parallelize_step``."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax.training.train_state import TrainState
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax import _contexts, _microbatch, _task
from multimesh.jax._planner._api import plan_step
from multimesh.jax._results import ParallelizeStepResult
from multimesh.jax._stages.mjit import mjit
from multimesh.jax._task import Task, check_remat, with_sharding_constraint
from multimesh.jax.flax import _nnx, _nnx_step, _resume
from multimesh.jax.flax._boxes import StepFn, name_meshes
from multimesh.jax.flax._common import (
    batch_avals_of,
    check_batches,
    check_optimizer,
    default_mesh,
    is_array,
    lowering_batch,
    make_prepare_batch,
)
from multimesh.runtime import distributed

__all__ = ["task", "shard_axes", "parallelize_step"]

_AUTO_NAME = "__multimesh_flax_auto_name__"


# --------------------------------------------------------------------------- helpers


def shard_axes(*names: str | None) -> Callable:
    """Xavier-normal initializer whose parameter carries logical partitioning names.

    ``Dense(features=16, kernel_init=shard_axes("batch", "model"))`` gives a
    kernel boxed as ``nn.Partitioned(names=("batch", "model"))`` (shown as
    ``P(batch, model)`` by ``tabulate``). Inside a task the names are *logical*:
    the task's ``logical_axes`` map them to its device axes.
    """
    for n in names:
        if n is not None and not isinstance(n, str):
            raise MultimeshTypeError(
                f"`shard_axes` takes logical axis names (str or None), got {n!r}.")
    return nn.with_partitioning(nn.initializers.xavier_normal(), tuple(names))


def task_spec(name: str | None, task: Task | None, kwargs: dict) -> tuple[Task, str | None]:
    """Validate the task options once, eagerly, with the core ``task``.

    Returns the :class:`~multimesh.jax.Task` and the explicit task name (or
    None when the name is left to the caller's default).
    """

    def placeholder():  # only its options matter
        return None

    placeholder.__name__ = _AUTO_NAME
    with _contexts.ignore_transforms(False):
        spec = _task.task(placeholder, name, task=task, **kwargs).mm_task
    explicit = name or (spec.name if spec.name not in (None, _AUTO_NAME) else None)
    return spec, explicit


def split_static(tree):
    """``tree`` → (array leaves, rebuild(array leaves) -> tree).

    At a task boundary only arrays travel as traced values: every other leaf
    (Python numbers and bools included) is already a constant of the trace that
    calls the task, so it stays a Python value inside the task too — as it would
    be in a plain call of the module.
    """
    leaves, treedef = jax.tree.flatten(tree)
    mask = [is_array(x) for x in leaves]
    dyn = [x for x, m in zip(leaves, mask) if m]
    static = [None if m else x for x, m in zip(leaves, mask)]

    def rebuild(dyn_leaves):
        it = iter(dyn_leaves)
        return jax.tree.unflatten(treedef, [next(it) if m else s for m, s in zip(mask, static)])

    return dyn, rebuild


def _is_box(x) -> bool:
    return isinstance(x, nn.meta.AxisMetadata)


def _values(tree):
    """``tree`` with each flax partitioning box replaced by its value, unconstrained."""
    return jax.tree.map(lambda x: x.unbox(apply_constraint=False)
                        if isinstance(x, nn.Partitioned) else x, tree,
                        is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _box_spec(box) -> P | None:
    names = getattr(box, "names", None)
    return None if names is None else P(*names)


def logical_specs(boxed) -> list[P | None]:
    """Flat list, aligned with ``jax.tree.leaves(nn.meta.unbox(boxed))``."""
    return [_box_spec(b) if _is_box(b) else None
            for b in jax.tree.leaves(boxed, is_leaf=_is_box)]


def _constrain_flat(tree, specs):
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(specs):
        return tree
    out = [x if s is None else with_sharding_constraint(x, s) for x, s in zip(leaves, specs)]
    return jax.tree.unflatten(treedef, out)


# --------------------------------------------------------------------------- task


def task(model, name: str | None = None, *, task: Task | None = None, **kwargs):
    """Wraps a Flax module in an auto-sharding task context.

    * A linen module **class** gives a module class named ``Task[<Model>]``
      with the same constructor fields. Its single parameter ``mod`` holds the
      inner module's ``params`` (``{'params': {...}}``); other collections of the
      inner module (``batch_stats``, ...) live under ``mod`` in their own
      collection. Calling it runs the inner module as a task. ``name`` names the
      *task* only, as in MultiMesh: an instance without a linen ``name`` is
      auto-named by Flax from the class, ``Task[<Model>]_0``, ``Task[<Model>]_1``,
      ... (which fixes the parameter paths and so Flax's initial values).
    * An ``nnx.Module`` **instance** becomes a :class:`TaskModule` and is returned:
      still an instance of its class, with its own attributes and state paths
      (``nnx.state`` reads as it does without the task); calling it runs the module
      as a task and writes its state updates back.
    * Any other callable becomes a task whose arguments may hold NNX objects.

    Options as for :func:`multimesh.jax.task`: ``mesh`` (a ``TaskMesh`` or a
    ``jax.sharding.Mesh``), ``devices``/``device_axes``, ``logical_axes``, or a
    whole ``task=Task(...)``.
    """
    spec, explicit = task_spec(name, task, kwargs)
    if isinstance(model, type) and issubclass(model, nn.Module):
        return _linen_task_class(model, explicit, spec)
    if isinstance(model, nn.Module):
        cls = _linen_task_class(type(model), explicit, spec)
        values = {f.name: getattr(model, f.name) for f in _model_fields(type(model))}
        return cls(**values)
    if _nnx.is_nnx_module(model):
        return _nnx.make_task_module(model, explicit, spec)
    if isinstance(model, type) and _nnx.is_nnx_module_class(model):
        raise MultimeshTypeError(
            f"`task` takes an NNX module *instance* (NNX modules are built eagerly): write "
            f"task({model.__name__}(...), ...) instead of task({model.__name__}, ...).")
    if callable(model):
        return _nnx.graph_task(model, explicit, spec)
    raise MultimeshTypeError(
        f"`multimesh.jax.flax.task` expects a linen Module class, an nnx.Module instance or a "
        f"callable, got {type(model).__name__}.")


def _model_fields(model: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(model) if f.init and f.name not in ("parent", "name")]


def _linen_task_class(model: type, explicit_name: str | None, spec: Task) -> type:
    fields = _model_fields(model)
    annotations: dict[str, Any] = {}
    namespace: dict[str, Any] = {"__module__": model.__module__,
                                 "__qualname__": f"Task[{model.__qualname__}]",
                                 "__doc__": f"``{model.__name__}`` run as a multimesh task."}
    for f in fields:
        annotations[f.name] = f.type
        kw: dict[str, Any] = ({"kw_only": f.kw_only}
                              if f.kw_only is not dataclasses.MISSING else {})
        if f.default is not dataclasses.MISSING:
            namespace[f.name] = dataclasses.field(default=f.default, **kw)
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f.name] = dataclasses.field(default_factory=f.default_factory, **kw)
        elif kw.get("kw_only"):
            namespace[f.name] = dataclasses.field(**kw)
    namespace["__annotations__"] = annotations

    @nn.compact
    def __call__(self, *args, **kw):
        return _call_linen_task(self, model, fields, explicit_name, spec, args, kw)

    namespace["__call__"] = __call__
    cls: type[Any] = type(f"Task[{model.__name__}]", (nn.Module,), namespace)
    cls.mm_task = spec
    cls.wrapped_model = model
    return cls


def _call_linen_task(self, model, fields, explicit_name, spec, args, kwargs):
    inner = model(**{f.name: getattr(self, f.name) for f in fields}, parent=None)
    rng_streams = sorted(k for k in getattr(self.scope, "rngs", {}) if k != "params")
    stash: dict[str, Any] = {}

    def init_mod(rng):
        rngs = {"params": rng, **{k: self.make_rng(k) for k in rng_streams}}
        with _contexts.ignore_transforms():  # the inner init is plain flax, nothing to place
            variables = dict(inner.init(rngs, *args, **kwargs))
        stash.update(variables)
        return {"params": variables.get("params", {})}

    mod = self.param("mod", init_mod)  # unboxed
    others = _task_collections(self, stash)
    mutable = [c for c in others if self.is_mutable_collection(c)]
    rngs = {k: self.make_rng(k) for k in rng_streams}
    other_vals = {c: nn.meta.unbox(v.value) for c, v in others.items()}

    def apply(params, others_in, rngs_in, *a, **k):
        return inner.apply({"params": params, **others_in}, *a, rngs=rngs_in or None,
                           mutable=mutable or False, **k)

    if _contexts.state.ignore_transforms:
        out = apply(mod["params"], other_vals, rngs, *args, **kwargs)
    else:
        specs = _inner_param_specs(self, inner, stash, args, kwargs)
        dyn, rebuild = split_static((args, kwargs))
        task_name = explicit_name or ("/".join(self.path) if self.path else model.__name__)

        def body(params, others_in, rngs_in, dyn_leaves):
            a, k = rebuild(dyn_leaves)
            return apply(_constrain_flat(params, specs), others_in, rngs_in, *a, **k)

        # Flax's init runs the model once for its variables: nothing to place there.
        quiet = _contexts.internal_trace() if self.is_initializing() else nullcontext()
        with quiet:
            out = _task.task(body, task_name, task=spec)(mod["params"], other_vals, rngs, dyn)
    if mutable:
        out, updates = out
        _write_back(self, others, updates)
    return out


def _task_collections(self, stash: dict) -> dict:
    """The task's non-param collections (batch stats, ...) as variables of the wrapper,
    made from the inner init's values (``stash``) the first time."""
    collections = (set(stash) | set(self.variables)) - {"params"}
    others = {}
    for col in sorted(collections):
        if col in stash or self.has_variable(col, "mod"):
            others[col] = self.variable(col, "mod", lambda c=col: stash[c])
    return others


def _write_back(self, others: dict, updates) -> None:
    """Store the inner apply's mutated collections in the wrapper's variables."""
    for col, val in dict(updates).items():
        if col in others:
            others[col].value = val
        elif self.is_mutable_collection(col):
            self.put_variable(col, "mod", val)


def _inner_param_specs(self, inner, stash, args, kwargs) -> list[P | None]:
    """Logical partitioning names of the inner params, aligned with their leaves."""
    raw = stash.get("params")
    if raw is None:
        stored = self.get_variable("params", "mod")
        raw = stored.get("params") if isinstance(stored, dict) else None
        if raw is None or not any(_is_box(x) for x in jax.tree.leaves(raw, is_leaf=_is_box)):
            dyn, rebuild = split_static((args, kwargs))

            def init_shapes(d):
                a, k = rebuild(d)
                with _contexts.ignore_transforms():
                    return inner.init(jax.random.key(0), *a, **k).get("params", {})

            try:
                abstract = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in dyn]
                raw = jax.eval_shape(init_shapes, abstract)
            except Exception:  # e.g. an init that needs more rng streams: no constraints
                return []
    return logical_specs(raw)


# --------------------------------------------------------------------------- parallelize_step


def logical_pairs(rules) -> tuple[tuple[str, str], ...]:
    """flax's ``nn.logical_axis_rules``, converted once into a task's rule table:
    priority-ordered ``(logical, device axis)`` pairs. A rule onto several axes gives one
    pair per axis; a rule onto ``None`` (replicated) gives none, and, as in flax's
    ``logical_to_mesh_axes``, hides the name's later rules."""
    pairs: list[tuple[str, str]] = []
    replicated: set[str] = set()
    for logical, axes in rules:
        if logical in replicated:
            continue
        if axes is None:
            replicated.add(logical)
            continue
        for axis in (axes,) if isinstance(axes, str) else tuple(axes):
            if (logical, axis) not in pairs:
                pairs.append((logical, axis))
    return tuple(pairs)


def constrain_linen_state(state):
    """Logical constraint on every variable leaf: its partitioning names, else ``P()``.

    The names are flax's logical ones and go to the IR as they are: each task resolves
    them through its own rule table, to which :func:`parallelize_step` appends flax's
    ``nn.logical_axis_rules`` (:func:`logical_pairs`, converted once), so a parameter is
    sharded on its stage as ``jax.jit`` with the same rules shards it.
    """
    def one(x):
        if _is_box(x):
            spec = _box_spec(x)
            return x.replace_boxed(with_sharding_constraint(x.unbox(apply_constraint=False),
                                                               spec if spec is not None else P()))
        if hasattr(x, "shape"):
            return with_sharding_constraint(x, P())
        return x

    return jax.tree.map(one, state, is_leaf=_is_box)


@dataclasses.dataclass(frozen=True)
class MicrobatchOptions:
    """How ``parallelize_step`` pipelines the gradient over microbatches (see
    :func:`multimesh.jax.microbatch`); ``reduction`` turns the per-microbatch sum into
    the mean (the full batch's loss for a loss that averages over its batch)."""

    num_microbatches: int | None = None
    microbatch_size: int | None = None
    schedule: str | None = None
    interleave: int | None = None
    num_stages: int | str | None = None  # "auto": plan_pipeline chooses
    unrolling: int | None = None
    custom_schedule: Sequence[Sequence[Any]] | None = None
    reduction: str = "mean"
    remat: Any = None  # True or a jax checkpoint policy: every stage recomputes its forward
    shard: Any = None  # the planner's batch/parameter sharding of the gradient function

    @property
    def active(self) -> bool:
        return self.num_microbatches is not None or self.microbatch_size is not None

    def check(self) -> None:
        if self.num_microbatches is not None and self.microbatch_size is not None:
            raise MultimeshValueError(
                "parallelize_step takes `num_microbatches` or `microbatch_size`, not both.")
        for name in ("num_microbatches", "microbatch_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise MultimeshValueError(
                    f"parallelize_step `{name}` must be a positive integer, got {v!r}.")
        if self.reduction not in ("mean", "sum"):
            raise MultimeshValueError(
                f"parallelize_step `microbatch_reduction` must be 'mean' or 'sum', got "
                f"{self.reduction!r}.")
        check_remat(self.remat, "parallelize_step")
        pipelining = ("schedule", "interleave", "num_stages", "unrolling", "custom_schedule",
                      "remat")
        ns = self.num_stages
        if ns is not None and ns != "auto" and (
                isinstance(ns, (bool, str)) or not isinstance(ns, (int, np.integer)) or ns < 1):
            raise MultimeshValueError(
                f"parallelize_step `num_stages` must be a positive integer, 'auto' (the "
                f"planner chooses, see `multimesh.jax.plan_pipeline`) or None, got "
                f"{self.num_stages!r}.")
        given = [n for n in pipelining if getattr(self, n) is not None]
        if self.num_stages == "auto":  # the planner chooses the microbatches
            return
        if given and not self.active:
            raise MultimeshValueError(
                f"parallelize_step got {', '.join(f'`{n}`' for n in given)} but no "
                f"`num_microbatches` or `microbatch_size`: a pipeline schedule orders "
                f"microbatches, so say how to cut the batch.")

    def size(self, batch_avals) -> int:
        """Rows per microbatch, from the batch's leading dimension."""
        rows = {int(np.shape(x)[0]) for x in jax.tree.leaves(batch_avals) if np.shape(x)}
        if len(rows) != 1:
            raise MultimeshValueError(
                f"parallelize_step microbatches the batch along its leading dimension, but "
                f"the batch's leaves have leading sizes {sorted(rows)}.")
        total = rows.pop()
        if self.microbatch_size is not None:
            return self.microbatch_size
        assert self.num_microbatches is not None  # active: one of the two is set
        if total % self.num_microbatches:
            raise MultimeshValueError(
                f"parallelize_step num_microbatches={self.num_microbatches} does not divide "
                f"the batch of {total} rows.")
        return total // self.num_microbatches

    def wrap(self, grad_fn, batch_avals):
        """``grad_fn(params, batch) -> (loss, grads)`` over microbatches, reduced."""
        if self.shard is not None:  # the planner's layout
            grad_fn = self.shard(grad_fn)
            if self.num_microbatches == 1:  # one microbatch: nothing to order
                return grad_fn
        return _microbatch.microbatch(grad_fn, dim=0, size=self.size(batch_avals), argnum=1,
                                      schedule=self.schedule, interleave=self.interleave,
                                      num_stages=None if isinstance(self.num_stages, str)
                                      else self.num_stages, unrolling=self.unrolling,
                                      custom_schedule=self.custom_schedule,
                                      reduction=self.reduction, remat=self.remat)


def _resumed(init_fn, key, batch_avals, init_state, model, optimizer):
    """``(init_state, state_avals)``: the state to resume from, checked against a fresh
    one (None: start afresh), and the avals of the step's state."""
    if init_state is not None:
        fresh = _state_avals(init_fn, key, batch_avals, None)
        init_state = _resume.initial_state(init_state, fresh, model, optimizer)
    return init_state, _state_avals(init_fn, key, batch_avals, init_state)


def parallelize_step(model, optimizer, mesh: Mesh | None = None, global_batch=None,
                     local_batch=None, replicate_inputs: bool = True, *,
                     num_microbatches: int | None = None, microbatch_size: int | None = None,
                     schedule: str | None = None, interleave: int | None = None,
                     num_stages: int | str | None = None, unrolling: int | None = None,
                     custom_schedule=None, microbatch_reduction: str = "mean",
                     init_state=None, rng=None, remat=None):
    """Compiles one training step of ``model`` with ``optimizer`` as an MPMD program.

    ``model(batch)`` must return the scalar loss. For a linen module the state
    is a ``flax.training.train_state.TrainState`` initialised with ``rng``
    (default ``jax.random.key(42)``), laid out as flax lays it out: ``state.params``
    is ``variables["params"]``. ``init_state`` resumes instead: a ``TrainState``
    (its ``tx`` must be ``optimizer`` or built the same way, e.g. another
    ``optax.adam(1e-2)``), the dict orbax (or ``flax.serialization.to_state_dict``)
    gives for one, a variables dict ``{"params": ...}`` or the params alone (the
    optimizer then starts afresh). For an NNX module see
    :func:`multimesh.jax.flax._nnx_step.parallelize_step`. Every variable is
    constrained to its partitioning names (``P()`` if it has none) as *logical*
    names, so it is placed on the submesh of the task that uses it, sharded by
    that task's ``logical_axes``.

    ``num_microbatches`` or ``microbatch_size`` pipelines the gradient: the batch
    is cut along its leading dimension and the step is
    ``microbatch(value_and_grad(loss), ..., schedule=schedule, interleave=...,
    num_stages=..., unrolling=..., custom_schedule=...)``; the loss and gradients
    are the mean over microbatches (``microbatch_reduction="mean"``, the same as
    the whole batch for a loss that averages over it) or their sum (``"sum"``).
    ``remat=True`` (or a jax checkpoint policy) makes every stage's backward
    recompute its forward (``microbatch(..., remat=)``). ``num_stages="auto"``
    lets :func:`multimesh.jax.plan_pipeline` choose the stages, their submeshes,
    the microbatches (unless given) and the schedule; ``result.plan`` is its plan.
    ``replicate_inputs=False`` takes a placed ``global_batch`` (committed arrays) in its
    layout, as ``jax.jit`` takes a committed argument (and so does each microbatch).

    Returns a :class:`~multimesh.jax.flax.ParallelizeStepResult` that unpacks as
    ``(step_fn, state, mesh)`` for ``global_batch`` (jax arrays) or
    ``(step_fn, state, mesh, prepare_batch)`` for ``local_batch`` (this
    process's part of the batch; ``prepare_batch`` turns such host data into
    the global batch arrays); all four are attributes in both forms.
    ``loss, state = step_fn(state, batch)``.
    """
    mb = MicrobatchOptions(num_microbatches, microbatch_size, schedule, interleave, num_stages,
                           unrolling, custom_schedule, microbatch_reduction, remat)
    mb.check()
    if _nnx.is_nnx_module(model):
        if init_state is not None or rng is not None:
            raise MultimeshValueError(
                "parallelize_step: an NNX module carries its own values; to start from a "
                "checkpoint, load it into the module (and the optimizer) before the call "
                "instead of passing `init_state`/`rng`.")
        return _nnx_step.parallelize_step(model, optimizer, mesh=mesh,
                                          global_batch=global_batch, local_batch=local_batch,
                                          replicate_inputs=replicate_inputs, microbatching=mb)
    _check_linen_model(model)
    check_optimizer(optimizer, allow_nnx=False)
    check_batches(global_batch, local_batch)
    mesh = default_mesh(mesh)
    init_fn = functools.partial(_linen_init_state, model, optimizer)
    batch_avals = batch_avals_of(global_batch, local_batch)
    key = jax.random.key(42) if rng is None else rng
    init_state, state_avals = _resumed(init_fn, key, batch_avals, init_state, model, optimizer)
    mb, plan = _auto_stages(mb, _loss_of(model), state_avals.params, batch_avals, mesh)
    step_fn = _linen_step_fn(model, mb, batch_avals, replicate_inputs)
    compiled = _compile(step_fn, mesh, plan, state_avals,
                        lowering_batch(global_batch, batch_avals, replicate_inputs))
    state_sh, batch_sh = compiled.input_shardings[0]
    prepare_batch = make_prepare_batch(batch_sh, batch_avals)
    init_batch = global_batch if global_batch is not None else local_batch
    # flax's boxes name the mesh each value lives on (its stage's), in this state and
    # in each step's: nn.unbox works on them under the global mesh
    state = name_meshes(_placed_state(init_fn, init_state, state_sh, key, init_batch))
    # The original library's forms: 3 values with global_batch, 4 with local_batch.
    result = ParallelizeStepResult((StepFn(compiled, state_avals), state, mesh, prepare_batch),
                                   length=3 if global_batch is not None else 4)
    result.plan = plan
    return result


def _compile(step_fn, mesh, plan, state, batch):
    """``step_fn`` compiled for ``(state, batch)``, under the plan's rules if there is one."""
    rules = _contexts.logical_rules(logical_pairs(nn.get_logical_axis_rules()))
    with plan if plan is not None else nullcontext(), rules:
        return mjit(step_fn, mesh=mesh).lower(state, batch).compile()


def _auto_stages(mb: MicrobatchOptions, loss, params, batch_avals, mesh):
    """``num_stages="auto"``: the planner's microbatch options and plan, else ``(mb, None)``."""
    if mb.num_stages != "auto":
        return mb, None
    return plan_step(mb, loss, params, batch_avals, mesh)


def _check_linen_model(model) -> None:
    """``model`` must be a linen module instance (NNX ones were handled before)."""
    if isinstance(model, nn.Module):
        return
    if isinstance(model, type) and (issubclass(model, nn.Module)
                                    or _nnx.is_nnx_module_class(model)):
        raise MultimeshTypeError(
            f"parallelize_step expects a linen or NNX module instance, got the class "
            f"{model.__name__}; pass an instance, e.g. {model.__name__}(...).")
    raise MultimeshTypeError(
        f"parallelize_step expects a linen or NNX module instance, got "
        f"{type(model).__name__}.")


def _linen_init_state(model, optimizer, key, batch):
    """A fresh ``TrainState`` as flax builds one: ``params`` is ``model``'s
    ``variables["params"]``, and the optimizer's state is for them."""
    variables = model.init(key, batch)
    _check_collections(variables)
    return TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optimizer)


def _check_collections(variables) -> None:
    """A linen model whose variables are more than ``params`` does not fit a TrainState."""
    others = sorted(set(variables) - {"params"})
    if others:
        raise MultimeshValueError(
            f"parallelize_step trains a linen model's `params`, as a flax TrainState holds "
            f"them; `model.init` also made the collections {others}, which a TrainState "
            f"does not hold. Compile your own step with `multimesh.jax.mjit` (apply with "
            f"`mutable=` and keep those collections beside the state), or use an NNX model.")


def _loss_of(model):
    """``loss(params, batch)``: ``model`` applied to ``{"params": params}``.

    The boxes' values go in unboxed: ``constrain_linen_state`` constrained each to its
    names already, as logical names each task maps. flax's own unboxing would constrain
    them again with the names as axes of the mesh in context, which inside a registered
    task is the task's mesh, where a name its ``logical_axes`` maps is no axis."""
    def loss(params, batch):
        return model.apply({"params": _values(params)}, batch)

    return loss


def _linen_step_fn(model, mb: MicrobatchOptions, batch_avals, replicate_inputs: bool):
    """The training step that ``mjit`` compiles: (state, inputs) -> (loss, new state)."""
    def plain_grad(params, inputs):
        return jax.value_and_grad(_loss_of(model))(params, inputs)

    grad_fn = mb.wrap(plain_grad, batch_avals) if mb.active else plain_grad

    def step_fn(state, inputs):
        state = constrain_linen_state(state)
        if replicate_inputs:
            inputs = jax.tree.map(lambda x: with_sharding_constraint(x, P()), inputs)
        loss, grads = grad_fn(state.params, inputs)
        # Same logical names on the way out: the new state comes back laid out
        # like the old one, so it feeds the next step without resharding.
        return loss, constrain_linen_state(state.apply_gradients(grads=grads))

    return step_fn


def _state_avals(init_fn, key, batch_avals, init_state):
    """The state's shapes: traced from ``init_fn`` or read off ``init_state``."""
    if init_state is None:
        # Constraints in the model are logical, also outside tasks; shapes only, so the
        # model's tasks are traced outside mjit on purpose.
        with _contexts.autoshard(True), _contexts.internal_trace():
            return jax.eval_shape(init_fn, key, batch_avals)
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x,
        init_state)


def _placed_state(init_fn, init_state, state_sh, key, init_batch):
    """The first state on the step's input shardings (under jax.distributed each
    variable is computed only by the processes that own it)."""
    if init_state is not None:
        return place(init_state, state_sh)
    with _contexts.ignore_transforms():
        if jax.process_count() > 1:
            return distributed.owner_init(init_fn, state_sh, key, init_batch)
        return place(jax.jit(init_fn)(key, init_batch), state_sh)


def place(tree, shardings):
    """``jax.device_put`` each leaf onto its sharding (leaves may use different submeshes)."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s), tree, shardings)

