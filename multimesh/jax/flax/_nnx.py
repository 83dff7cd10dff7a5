"""NNX: modules as tasks, and ``mjit``'s detour for arguments holding NNX objects.

NNX objects are mutable Python graphs; jax transformations need pure
functions of arrays. Like Flax's own NNX transforms, every entry point here
splits the graph nodes found in the arguments into a static ``GraphDef`` and
their ``Variable`` values, runs a pure function that merges them back into
fresh objects, calls the user's code, splits again, and returns the values of
the Variables that changed. The caller's objects are then updated in place, so
state updates (parameters, optimizer state, batch statistics, RNG counters)
behave as they do under ``nnx.jit``.

Only Variables whose value the function actually replaced are returned and
written back; unchanged parameters are neither outputs of a task nor of the
program. Structural changes inside (new attributes, changed static fields) are
rejected with an error.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax import _contexts, _task
from multimesh.jax._stages.call_checks import is_key
from multimesh.jax._stages.call_convention import abstract_keys, decode_keys, encode_keys
from multimesh.jax._stages.handlers import MjitProgram
from multimesh.jax._stages.inputs import is_physical
from multimesh.jax._stages.stage import StageWrapper
from multimesh.jax._task import Task, TaskFunction, with_sharding_constraint
from multimesh.jax.flax._common import is_array, is_dynamic
from multimesh.jax.flax._nnx_names import module_names, same_names

__all__ = ["TaskModule", "graph_task", "StateSharding", "nnx_shard_axes", "is_nnx_module",
           "var_spec", "trace", "call"]

StateSharding = nnx.StateSharding


def is_nnx_module(x) -> bool:
    return isinstance(x, nnx.Module)


def is_nnx_module_class(cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, nnx.Module)


def _is_node(x) -> bool:
    return nnx.graph.is_graph_node(x)


def _is_spec(x) -> bool:
    """A sharding entry that applies to a whole (sub)tree."""
    return x is None or isinstance(x, (P, NamedSharding, nnx.StateSharding))


def nnx_shard_axes(*names: str | None, init: Callable | None = None) -> Callable:
    """NNX initializer (xavier-normal by default) with *logical* partitioning names.

    The names become the Variable's ``out_sharding`` metadata, read by tasks
    and :func:`parallelize_step` as logical names. Eager sharding is switched
    off for these Variables: the names are not axes of any global mesh.
    """
    for n in names:
        if n is not None and not isinstance(n, str):
            raise MultimeshTypeError(
                f"`nnx_shard_axes` takes logical axis names (str or None), got {n!r}.")
    return nnx.with_partitioning(init or nnx.initializers.xavier_normal(), tuple(names),
                                 eager_sharding=False)


def var_spec(v) -> P | None:
    """Logical names of a Variable from its partitioning metadata (None: no names)."""
    if not isinstance(v, nnx.Variable):
        return None
    meta = v.get_metadata()
    if meta.get("out_sharding"):
        return nnx.spmd.get_var_pspec(v)  # applies nnx logical-axis rules, if any are set
    for key in ("sharding_names", "sharding"):  # older flax spellings
        names = meta.get(key)
        if isinstance(names, (tuple, list)) and names:
            return P(*names)
    return None


def _spec_of(s) -> P | None:
    if isinstance(s, NamedSharding):
        return s.spec
    return s


# --------------------------------------------------------------------------- split / merge


def _aval_sig(x) -> tuple:
    """(shape, dtype, weak type) of an array leaf: what a compiled program is specialised to."""
    return (tuple(int(d) for d in np.shape(x)),
            str(jax.numpy.result_type(x)) if not is_key(x) else str(x.dtype),
            bool(getattr(x, "weak_type", False)))


def _describe_aval(sig: tuple) -> str:
    shape, dtype, weak = sig
    return f"shape {shape} and dtype {dtype}{' (weakly typed)' if weak else ''}"


def _arg_name(path, positions) -> str:
    """``args[1]``/``kwargs['x']`` (plus the rest of the path) for a path into
    (dyn_args, kwargs); ``positions``: each dynamic argument's original position."""
    if path[0].idx == 1:
        return "kwargs" + jax.tree_util.keystr(tuple(path[1:]))
    return f"args[{positions[path[1].idx]}]" + jax.tree_util.keystr(tuple(path[2:]))


def _describe_mismatch(old: _Split, new: _Split, positions) -> str:
    """Why ``new`` (the call's arguments) does not fit ``old`` (what was compiled)."""
    head = "Compiled function called with"
    tail = " Lower it again for these arguments, or call the `mjit` function directly."
    if old.treedef != new.treedef or old.kinds != new.kinds:
        return (f"{head} arguments of structure {new.treedef}, but it was compiled for "
                f"{old.treedef}.{tail}")
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(new._tree, is_leaf=_is_node)[0]]
    by_kind: dict[str, list] = {"node": [], "dyn": [], "static": []}
    for p, k in zip(paths, new.kinds):
        by_kind[k].append(p)
    why = _leaf_mismatch(old, new, by_kind, positions)
    if why is None and (old.graphdef != new.graphdef or old.node_paths() != new.node_paths()
                        or old.var_dynamic != new.var_dynamic):
        why = ("NNX objects whose structure (attributes, Variables or static "
               "fields) differs from the ones it was compiled for.")
    if why is None:
        why = _variable_mismatch(old, new, by_kind["node"], positions)
    if why is None:
        why = ("arguments whose structure, shapes or dtypes differ from those it was "
               "compiled for.")
    return f"{head} {why}{tail}"


def _leaf_mismatch(old: _Split, new: _Split, by_kind: dict[str, list],
                   positions) -> str | None:
    """The first array leaf of another shape or dtype, or static leaf of another value."""
    for p, a, b in zip(by_kind["dyn"], old.dyn, new.dyn):
        if _aval_sig(a) != _aval_sig(b):
            return (f"{_arg_name(p, positions)} of {_describe_aval(_aval_sig(b))}, "
                    f"but it was compiled for {_describe_aval(_aval_sig(a))}.")
    for p, a, b in zip(by_kind["static"], old.static, new.static):
        if _hashable(a) != _hashable(b):
            return (f"{_arg_name(p, positions)} = {b!r}, but it was compiled for "
                    f"{a!r} (a static, non-array value).")
    return None


def _variable_mismatch(old: _Split, new: _Split, node_paths: list,
                       positions) -> str | None:
    """The first Variable of the NNX objects whose value no longer fits."""
    for (path, _), dynamic, a, b in zip(new.flat, new.var_dynamic, old.values, new.values):
        node = path[0]
        assert isinstance(node, int)  # the nodes were split as a tuple: paths start at an index
        where = f"{_arg_name(node_paths[node], positions)}" + "".join(
            f".{k}" for k in path[1:])
        if dynamic and _aval_sig(a) != _aval_sig(b):
            return (f"the Variable {where} of {_describe_aval(_aval_sig(b))}, but it "
                    f"was compiled for {_describe_aval(_aval_sig(a))}.")
        if not dynamic and _hashable(a) != _hashable(b):
            return (f"the Variable {where} holding {b!r}, but it was compiled for "
                    f"{a!r} (a static, non-array value).")
    return None


class _Split:
    """``(args, kwargs)`` cut into graph nodes, dynamic leaves and static leaves.

    ``values`` holds one entry per Variable (or raw array attribute) of the
    graph nodes, in the order of ``nnx.to_flat_state``; shared Variables appear
    once. ``dyn`` holds the array leaves of the non-node part of the tree.
    """

    def __init__(self, tree, *, allow_abstract: bool = False, scalars_dynamic: bool = True):
        self._tree = tree  # for naming leaves in errors
        self.treedef: Any  # a PyTreeDef: jax's alias for it is opaque to mypy
        leaves, self.treedef = jax.tree.flatten(tree, is_leaf=_is_node)
        self.kinds: list[str] = []
        nodes, dyn, static = [], [], []
        for x in leaves:
            if _is_node(x):
                self.kinds.append("node")
                nodes.append(x)
            elif (is_dynamic(x) if scalars_dynamic else is_array(x)) or (
                    allow_abstract and isinstance(x, jax.ShapeDtypeStruct)):
                self.kinds.append("dyn")
                dyn.append(x)
            else:
                self.kinds.append("static")
                static.append(x)
        self.nodes = tuple(nodes)
        self.dyn = dyn
        self.static = static
        self.graphdef: nnx.GraphDef | None = None
        self.flat: list = []
        if nodes:
            self.graphdef, state = nnx.split(self.nodes)
            self.flat = list(nnx.to_flat_state(state))
        self.values, self.var_dynamic = [], []
        for _, leaf in self.flat:
            val = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            self.var_dynamic.append(is_dynamic(val) or (allow_abstract and
                                                        isinstance(val, jax.ShapeDtypeStruct)))
            self.values.append(val)

    # -- what the traced function needs (hashable, cache key)
    def signature(self):
        aval = _aval_sig
        static = tuple(_hashable(s) for s in self.static)
        var_static = tuple(_hashable(v) for v, d in zip(self.values, self.var_dynamic) if not d)
        return (self.treedef, tuple(self.kinds), self.graphdef, static, var_static,
                tuple(p for p, _ in self.flat), tuple(self.var_dynamic),
                tuple(aval(v) for v, d in zip(self.values, self.var_dynamic) if d),
                tuple(aval(x) for x in self.dyn))

    def dynamic_values(self) -> list:
        return [v for v, d in zip(self.values, self.var_dynamic) if d]

    def node_paths(self) -> list[tuple]:
        return [p for p, _ in self.flat]

    # -- inside the traced function
    def rebuild(self, var_vals: Sequence, dyn: Sequence):
        """Fresh objects holding ``var_vals``; returns ((args, kwargs), inner nodes)."""
        it = iter(var_vals)
        entries = []
        for (path, leaf), d, val in zip(self.flat, self.var_dynamic, self.values):
            v = next(it) if d else val
            entries.append((path, leaf.replace(value=v) if isinstance(leaf, nnx.Variable) else v))
        nodes = (nnx.merge(self.graphdef, nnx.from_flat_state(entries))
                 if self.graphdef is not None else ())  # None: no graph nodes
        node_it, dyn_it, static_it = iter(nodes), iter(dyn), iter(self.static)
        leaves = [next(node_it) if k == "node" else next(dyn_it) if k == "dyn" else next(static_it)
                  for k in self.kinds]
        return jax.tree.unflatten(self.treedef, leaves), nodes

    def collect(self, nodes, where: str) -> list:
        """The Variable values of ``nodes`` after the call, aligned with ``values``."""
        if not self.nodes:
            return []
        graphdef, state = nnx.split(nodes)
        flat = list(nnx.to_flat_state(state))
        if graphdef != self.graphdef or [p for p, _ in flat] != [p for p, _ in self.flat]:
            raise MultimeshValueError(
                f"{where}: an NNX object changed its structure (new or removed attributes, "
                f"Variables or static fields) inside the call; only Variable values may "
                f"change. Create the state before the call.")
        values = [leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf for _, leaf in flat]
        for (path, _), old, new, dynamic in zip(self.flat, self.values, values,
                                                self.var_dynamic):
            if not dynamic and new is not old:
                raise MultimeshValueError(
                    f"{where}: the Variable at {'/'.join(map(str, path))} holds a non-array "
                    f"value ({type(old).__name__}) that was replaced inside the call; only "
                    f"array values can be updated there.")
        return values

    # -- outside, after the call
    def write_back(self, indices: Sequence[int], values: Sequence) -> None:
        """Set the Variables at flat ``indices`` of the caller's objects to ``values``."""
        if not indices:
            return
        entries = []
        for i, v in zip(indices, values):
            path, leaf = self.flat[i]
            entries.append((path, leaf.replace(value=v) if isinstance(leaf, nnx.Variable) else v))
        nnx.update(self.nodes, nnx.from_flat_state(entries))


def _hashable(x):
    try:
        hash(x)
        return x
    except TypeError:
        return ("<unhashable>", id(x))


def _check_no_nodes(out, where: str):
    if any(_is_node(x) for x in jax.tree.leaves(out, is_leaf=_is_node)):
        raise MultimeshValueError(
            f"{where}: returning NNX objects from a task is not supported; return arrays and "
            f"update the objects passed in instead (their changes are written back).")


# --------------------------------------------------------------------------- tasks


def graph_task(fun: Callable, name: str | None, spec: Task) -> Callable:
    """``fun`` as a task whose arguments may hold NNX objects (updates written back)."""
    default = name or getattr(fun, "__name__", None) or "task"

    def wrapped(*args, **kwargs):
        return _call_graph_task(fun, default, spec, args, kwargs)

    wrapped.__name__ = default
    functools.update_wrapper(wrapped, fun, assigned=(), updated=())  # __wrapped__ only
    out = cast(TaskFunction, wrapped)
    out.mm_task = spec
    return out


def _call_graph_task(fun, name, spec, args, kwargs):
    if _contexts.state.ignore_transforms:
        return fun(*args, **kwargs)
    split = _Split((args, kwargs), scalars_dynamic=False)
    specs = [var_spec(leaf) for (_, leaf), d in zip(split.flat, split.var_dynamic) if d]
    dyn_idx = [i for i, d in enumerate(split.var_dynamic) if d]
    cell: dict[str, Any] = {}
    where = f"task {name!r}"

    def body(var_vals, dyn):
        var_vals = [v if s is None else with_sharding_constraint(v, s)
                    for v, s in zip(var_vals, specs)]
        (a, k), nodes = split.rebuild(var_vals, dyn)
        same_names(nodes, split.nodes)  # the copies keep the originals' module paths
        out = fun(*a, **k)
        _check_no_nodes(out, where)
        collected = split.collect(nodes, where)
        after = [collected[i] for i in dyn_idx]
        changed = [j for j, (new, old) in enumerate(zip(after, var_vals)) if new is not old]
        cell["changed"] = changed
        return out, [after[j] for j in changed]

    out, updates = _task.task(body, name, task=spec)(split.dynamic_values(), split.dyn)
    split.write_back([dyn_idx[j] for j in cell["changed"]], updates)
    return out


class _TaskOptions:
    """Static (hashable by identity) holder of a task's options on a TaskModule."""

    def __init__(self, name: str | None, spec: Task):
        self.name = name
        self.spec = spec

    def __repr__(self):
        return f"TaskOptions(name={self.name!r}, mesh={self.spec.mesh!r})"


def _default_name(mod, spec: Task) -> str:
    """``<Class>`` or, with a mesh, ``<Class>_<first>_<last>`` (a task name has one submesh).

    NNX modules do not know their attribute path, so two stages built from the same
    class get distinct names from their submeshes instead.
    """
    base = _module_class(type(mod)).__name__
    mesh = spec.mesh
    if mesh is None:
        return base
    if isinstance(mesh, Mesh):
        ids = [d.id for d in mesh.devices.flat]
    else:
        ids = [int(d) for d in mesh.devices.flat]
    return f"{base}_{ids[0]}_{ids[-1]}" if len(ids) > 1 else f"{base}_{ids[0]}"


class TaskModule(nnx.Module):
    """An NNX module run as a multimesh task.

    :func:`multimesh.jax.flax.task` turns a module instance into one: the instance
    becomes a ``Task[<Class>]``, a subclass of both its own class and this one, and is
    returned. Its attributes, Variables and state paths stay the module's own (as
    ``nnx.state`` and ``nnx.jit`` see them, with no level added), and it is still an
    instance of its class. Calling it runs the class's ``__call__`` as a task:
    Variables with partitioning metadata are constrained to their logical names inside
    the task, and Variables the call changes (batch statistics, RNG counters, ...) are
    written back.
    """

    _mm_task_options: _TaskOptions

    def __call__(self, *args, **kwargs):
        opts = self._mm_task_options
        name = opts.name or _default_name(self, opts.spec)
        return _call_graph_task(_call_module, name, opts.spec, (self, *args), kwargs)


def _call_module(mod, *args, **kwargs):
    """The wrapped class's own ``__call__`` (the next after ``TaskModule``)."""
    return super(TaskModule, mod).__call__(*args, **kwargs)


def _module_class(cls: type) -> type:
    """The user's module class of a ``Task[<Class>]`` (``cls`` itself otherwise)."""
    return getattr(cls, "_mm_module_class", cls)


_task_classes: dict[type, type] = {}


def make_task_module(mod: nnx.Module, name: str | None, spec: Task) -> nnx.Module:
    """``mod`` turned into a :class:`TaskModule` with these options (and returned)."""
    base = _module_class(type(mod))
    cls = _task_classes.get(base)
    if cls is None:
        cls = type(f"Task[{base.__name__}]", (TaskModule, base),
                   {"__module__": base.__module__,
                    "__qualname__": f"Task[{base.__qualname__}]",
                    "__doc__": f"``{base.__name__}`` run as a multimesh task.",
                    "_mm_module_class": base},
                   pytree=getattr(base, "_pytree__is_pytree", False))
        _task_classes[base] = cls
    mod.__class__ = cls
    mod._mm_task_options = _TaskOptions(name, spec)  # type: ignore[attr-defined]
    return mod


# --------------------------------------------------------------------------- mjit


def _is_stand_in_leaf(tree) -> bool:
    treedef: Any = jax.tree.structure(tree)  # a PyTreeDef: jax's alias is opaque to mypy
    return bool(treedef == jax.tree.structure(0))


def _broadcast(prefix, tree, where: str) -> list:
    """One prefix entry per leaf of ``tree`` (a stand-in: graph nodes already leaves)."""
    if _is_stand_in_leaf(tree):
        return [prefix]
    if _is_spec(prefix):
        return [prefix] * len(jax.tree.leaves(tree))
    p_def: Any  # a PyTreeDef: jax's alias is opaque to mypy
    p_children, p_def = jax.tree.flatten(prefix, is_leaf=lambda x: x is not prefix)
    t_children, t_def = jax.tree.flatten(tree, is_leaf=lambda x: x is not tree)
    if p_def != t_def:
        raise MultimeshValueError(
            f"{where}: sharding prefix {prefix!r} does not match the argument structure "
            f"{jax.tree.structure(tree)}.")
    out = []
    for pc, tc in zip(p_children, t_children):
        out.extend(_broadcast(pc, tc, where))
    return out


def _match_state(spec_state, rel_path):
    node = spec_state
    for k in rel_path:
        try:
            node = node[k]
        except (KeyError, IndexError, TypeError):
            return None
    if isinstance(node, nnx.Variable):
        node = node.get_value()
    return node if isinstance(node, (P, NamedSharding)) or node is None else None


def _node_var_spec(prefix, rel_path, leaf, where: str = "mjit"):
    if isinstance(prefix, nnx.StateSharding):
        for flt, sh in zip(prefix.filters, prefix.shardings):
            if nnx.filterlib.to_predicate(flt)(rel_path, leaf):
                return _spec_of(sh)
        return None
    if isinstance(prefix, Mapping):  # nnx.State or dict of specs, by path
        return _spec_of(_match_state(prefix, rel_path))
    if prefix is None or isinstance(prefix, (P, NamedSharding)):
        return _spec_of(prefix)
    raise MultimeshValueError(
        f"{where}: the sharding for an NNX object must be a PartitionSpec, NamedSharding, "
        f"nnx.StateSharding or a (nnx.State or dict) of specs by path, got {prefix!r}.")


def _leaf_spec(prefix, where: str):
    if prefix is None or isinstance(prefix, (P, NamedSharding)):
        return _spec_of(prefix)
    raise MultimeshValueError(
        f"{where}: the sharding for an array must be a PartitionSpec, NamedSharding or None, "
        f"got {prefix!r}.")


def _states_by_node(paths_and_values, n_nodes: int) -> list:
    """Per node: an nnx.State by relative path (a lone Variable node: the value itself)."""
    by_node: dict[int, list] = {}
    for path, v in paths_and_values:
        by_node.setdefault(path[0], []).append((path[1:], v))
    out = []
    for i in range(n_nodes):
        entries = by_node.get(i, [])
        if len(entries) == 1 and entries[0][0] == ():
            out.append(entries[0][1])
        else:
            out.append(nnx.from_flat_state(entries))
    return out


def _arg_specs(split: _Split, shardings, where: str):
    """Per-Variable and per-dynamic-leaf logical specs from an ``in_shardings`` prefix.

    The prefix covers the positional arguments (keyword arguments stay
    unconstrained), as for ``jax.jit``.
    """
    var_specs: list = [None] * len(split.flat)
    dyn_specs: list = [None] * len(split.dyn)
    if shardings is None:
        return var_specs, dyn_specs
    stand_in = jax.tree.unflatten(split.treedef, list(range(split.treedef.num_leaves)))[0]
    if isinstance(shardings, (tuple, list)):
        prefix = tuple(shardings)
    else:  # one entry for every positional argument
        prefix = (shardings,) * len(stand_in)
    entries = _broadcast(prefix, stand_in, where)
    node_specs, dyn_i = [], 0
    for kind, e in zip(split.kinds[:len(entries)], entries):
        if kind == "node":
            node_specs.append(e)
        elif kind == "dyn":
            dyn_specs[dyn_i] = _leaf_spec(e, where)
            dyn_i += 1
    for j, (path, leaf) in enumerate(split.flat):
        node = path[0]
        assert isinstance(node, int)  # the nodes were split as a tuple: paths start at an index
        if node < len(node_specs):
            var_specs[j] = _node_var_spec(node_specs[node], path[1:], leaf, where)
    return var_specs, dyn_specs


def _arg_owners(split: _Split, bound) -> tuple[list, list]:
    """For each graph node and each dynamic leaf of ``split``, the argument it came
    from: an original position (int) or a keyword (str)."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(split._tree, is_leaf=_is_node)[0]]
    positions = bound.dyn_positions
    nodes, dyn = [], []
    for p, kind in zip(paths, split.kinds):
        arg = positions[p[1].idx] if p[0].idx == 0 else p[1].key
        if kind == "node":
            nodes.append(arg)
        elif kind == "dyn":
            dyn.append(arg)
    return nodes, dyn


def _donation(split: _Split, bound) -> tuple[list[bool], list[bool]]:
    """Per dynamic Variable and per dynamic leaf: whether its argument is donated."""
    def donated(arg) -> bool:
        return arg in bound.donate_kw if isinstance(arg, str) else arg in bound.donate_pos

    node_args, dyn_args = _arg_owners(split, bound)
    var_flags = [donated(node_args[path[0]]) for (path, _), d in
                 zip(split.flat, split.var_dynamic) if d]
    return var_flags, [donated(a) for a in dyn_args]


def trace(owner: MjitProgram, bound) -> NnxTraced:
    """``mjit(f).trace(...)`` when the arguments hold NNX objects (``multimesh.jax``
    calls this): trace the pure function of their Variables, as ``nnx.jit`` does."""
    return _trace(owner, bound, _Split((bound.dyn_args, bound.dyn_kwargs),
                                       allow_abstract=True))


def call(owner: MjitProgram, bound):
    """Call ``mjit(f)`` on arguments holding NNX objects: compile once per structure
    and types, run, and write the changed Variables back into the caller's objects."""
    split = _Split((bound.dyn_args, bound.dyn_kwargs))
    compiled = owner.compiled_for(bound, ("nnx", split.signature()),
                                  lambda: _trace(owner, bound, split).lower().compile())
    return compiled._run(split, compiled.inner)


def _trace(owner: MjitProgram, bound, split: _Split) -> NnxTraced:
    fun = owner.fun
    where = f"mjit({getattr(fun, '__name__', 'fun')})"
    var_specs, dyn_specs = _arg_specs(split, owner.in_shardings, where)
    dyn_idx = [i for i, d in enumerate(split.var_dynamic) if d]
    var_specs_dyn = [var_specs[i] for i in dyn_idx]
    var_donated, dyn_donated = _donation(split, bound)
    var_vals0, var_impls = encode_keys(split.dynamic_values())
    dyn0, dyn_impls = encode_keys(split.dyn)
    cell: dict[str, Any] = {}
    out_shardings = owner.out_shardings

    def pure(var_vals, dyn):
        var_vals = _constrain(decode_keys(var_vals, var_impls), var_specs_dyn)
        dyn = _constrain(decode_keys(dyn, dyn_impls), dyn_specs)
        (a, k), nodes = split.rebuild(var_vals, dyn)
        full, kw = bound.merge(a, k)
        with module_names(*nodes):  # modules named from the arguments they sit in
            out = fun(*full, **kw)
        _check_logical(owner, where)
        collected = split.collect(nodes, where)
        after = [collected[i] for i in dyn_idx]
        # Changed Variables come back; so do all of a donated argument's (its buffers go).
        changed = [j for j, (new, old) in enumerate(zip(after, var_vals))
                   if new is not old or var_donated[j]]
        upd = _constrain([after[j] for j in changed], [var_specs_dyn[j] for j in changed])
        out_split = _OutSplit(out, nodes, where)
        out_vars, out_dyn = out_split.values()
        if out_shardings is not None:
            ov_specs, od_specs = out_split.specs(out_shardings, where)
            out_vars, out_dyn = _constrain(out_vars, ov_specs), _constrain(out_dyn, od_specs)
        out_vars, ov_impls = encode_keys(out_vars)
        out_dyn, od_impls = encode_keys(out_dyn)
        upd, upd_impls = encode_keys(upd)
        cell.update(changed=[dyn_idx[j] for j in changed], out=out_split,
                    impls=(ov_impls, od_impls, upd_impls))
        return (out_vars, out_dyn), upd

    pure.__name__ = getattr(fun, "__name__", "fun")
    traced = owner.trace_flat(pure, (var_vals0, dyn0), {}, [*var_donated, *dyn_donated])
    return NnxTraced(traced, _NnxProgram(owner, bound, split, cell))


def _check_logical(owner: MjitProgram, where: str) -> None:
    """For NNX objects, shardings are logical names; a ``NamedSharding`` none of whose
    names a task of the program maps (tasks are traced by now) would silently do
    nothing, so it is an error."""
    notes = _contexts.state.trace_notes
    mapped = notes.logical_names if notes is not None else set()
    for kind in ("in_shardings", "out_shardings"):
        for s in _named_shardings(getattr(owner, kind)):
            if is_physical(s, mapped):
                raise MultimeshValueError(
                    f"{where}: {kind} entry {s} names mesh axes {sorted(_axis_names(s))} "
                    f"that no task of the program maps. With NNX objects among the "
                    f"arguments, shardings are logical (read by the task that uses each "
                    f"value): use a PartitionSpec of logical names, or `jax.device_put` "
                    f"the arrays themselves.")


def _named_shardings(tree) -> list:
    def leaf(x):
        return isinstance(x, (NamedSharding, P, nnx.StateSharding))

    out: list = []
    for x in jax.tree.leaves(tree, is_leaf=leaf):
        out.extend(x.shardings if isinstance(x, nnx.StateSharding) else [x])
    return [x for x in out if isinstance(x, NamedSharding)]


def _axis_names(s: NamedSharding) -> set[str]:
    names: set[str] = set()
    for e in s.spec:
        names.update([e] if isinstance(e, str) else [n for n in (e or ()) if isinstance(n, str)])
    return names


def _constrain(vals: list, specs: list) -> list:
    """Each value under its logical spec (None: unconstrained)."""
    return [v if s is None else with_sharding_constraint(v, s) for v, s in zip(vals, specs)]


@dataclasses.dataclass(frozen=True, slots=True)
class _NnxProgram:
    """What the NNX stages share beside the MPMD stage they wrap: the ``mjit``
    function, the arguments it was traced for, their split and what the trace found
    (``cell``: the changed Variables, the output's split, the key implementations)."""

    owner: MjitProgram
    bound: Any
    split: _Split
    cell: dict


class _NnxStage(StageWrapper):
    """An NNX stage: the MPMD stage it wraps (``inner``) and the NNX program's state."""

    def __init__(self, inner, program: _NnxProgram):
        self.inner = inner
        self.nnx = program


class NnxTraced(_NnxStage):
    """``mjit(f).trace(...)`` of a function taking NNX objects: ``jaxpr`` (of the pure
    function over the Variables' values), ``out_info``, ``lower()``; the rest is the
    ``MpmdTraced``'s (``inner``: ``in_avals``, ``out_avals``, ``fun_name``, ...)."""

    traced = property(lambda self: self.inner)

    @property
    def out_info(self):
        """The outputs as ``jax.ShapeDtypeStruct``s (NNX objects returned: abstract)."""
        (ov, od), _ = self.inner.out_info
        cell = self.nnx.cell
        ov_impls, od_impls, _ = cell["impls"]
        return cell["out"].assemble(abstract_keys(ov, ov_impls),
                                    abstract_keys(od, od_impls), self.nnx.split.nodes)

    def lower(self) -> NnxLowered:
        return NnxLowered(self.inner.lower(), self.nnx)


class _OutSplit:
    """The output of the traced function: graph nodes split into Variable values."""

    def __init__(self, out, inner_in_nodes, where):
        leaves, self.treedef = jax.tree.flatten(out, is_leaf=_is_node)
        self.num_leaves = len(leaves)
        self.graphdef: Any = None  # nnx's GraphDef of the output's nodes, if any
        self.kinds, nodes, self.dyn, self.static = [], [], [], []
        self.input_refs = []
        for x in leaves:
            if _is_node(x):
                same = [i for i, n in enumerate(inner_in_nodes) if n is x]
                if same:
                    self.kinds.append("input")
                    self.input_refs.append(same[0])
                else:
                    self.kinds.append("node")
                    nodes.append(x)
            elif is_dynamic(x):
                self.kinds.append("dyn")
                self.dyn.append(x)
            else:
                self.kinds.append("static")
                self.static.append(x)
        self.has_nodes = bool(nodes)
        if nodes:
            self.graphdef, state = nnx.split(tuple(nodes))
            self.flat = list(nnx.to_flat_state(state))
        else:
            self.graphdef, self.flat = None, []

    def values(self):
        vals = [leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
                for _, leaf in self.flat]
        return vals, list(self.dyn)

    def specs(self, shardings, where):
        n_nodes = sum(k == "node" for k in self.kinds)
        stand_in = jax.tree.unflatten(self.treedef, list(range(self.num_leaves)))
        entries = _broadcast(shardings, stand_in, where)
        node_specs, dyn_specs = [], []
        for kind, e in zip(self.kinds, entries):
            if kind == "node":
                node_specs.append(e)
            elif kind == "dyn":
                dyn_specs.append(_leaf_spec(e, where))
        var_specs = []
        for path, leaf in self.flat:
            idx = path[0]  # the node's position in the tuple that nnx.split was given
            assert isinstance(idx, int)
            var_specs.append(_node_var_spec(node_specs[idx], path[1:], leaf, where)
                             if idx < n_nodes else None)
        return var_specs, dyn_specs

    def assemble(self, var_vals, dyn_vals, outer_in_nodes):
        nodes = ()
        if self.has_nodes:
            entries = [(p, leaf.replace(value=v) if isinstance(leaf, nnx.Variable) else v)
                       for (p, leaf), v in zip(self.flat, var_vals)]
            nodes = nnx.merge(self.graphdef, nnx.from_flat_state(entries))
        node_it, dyn_it, st_it, ref_it = (iter(nodes), iter(dyn_vals), iter(self.static),
                                          iter(self.input_refs))
        leaves: list[Any] = []
        for k in self.kinds:
            if k == "node":
                leaves.append(next(node_it))
            elif k == "input":
                leaves.append(outer_in_nodes[next(ref_it)])
            elif k == "dyn":
                leaves.append(next(dyn_it))
            else:
                leaves.append(next(st_it))
        return jax.tree.unflatten(self.treedef, leaves)


class NnxLowered(_NnxStage):
    """``mjit(...).lower(...)`` of a function taking NNX objects; the rest is the
    ``MpmdLowered``'s (``inner``: ``as_text()``, ``compiler_ir()``, ``in_avals``, ...)."""

    lowered = property(lambda self: self.inner)

    def compile(self, compiler_options=None) -> NnxCompiled:
        return NnxCompiled(self, self.inner.compile(compiler_options))


class NnxCompiled(_NnxStage):
    """A compiled MPMD program over NNX objects; call it like the original function.

    ``input_shardings`` mirrors ``(args, kwargs)``: each NNX object is replaced
    by an ``nnx.State`` of the shardings of its Variables, each array by its
    sharding (static arguments and static leaves by None). ``fragments``,
    ``transfers``, ``plan()`` and ``as_text()`` are those of the MPMD program.
    """

    compiled = property(lambda self: self.inner)

    def __init__(self, lowered: NnxLowered, compiled):
        super().__init__(compiled, lowered.nnx)
        program = self.nnx
        (var_sh, dyn_sh), _ = compiled.input_shardings
        self.variable_shardings = self._full_var_list(var_sh)
        self.input_shardings = self._as_user_tree(program.split, self.variable_shardings,
                                                  dyn_sh)
        (ov_sh, od_sh), _upd = compiled.output_shardings
        self.output_shardings = program.cell["out"].treedef.unflatten(
            _out_stand_in(program.cell["out"], ov_sh, od_sh))

    def _full_var_list(self, var_sh):
        split = self.nnx.split
        it = iter(var_sh)
        return [next(it) if d else None for d in split.var_dynamic]

    @staticmethod
    def _as_user_tree(split: _Split, var_sh, dyn_sh):
        node_states = _states_by_node(
            [(p, sh) for (p, _), sh in zip(split.flat, var_sh)], len(split.nodes))
        node_it, dyn_it = iter(node_states), iter(dyn_sh)
        leaves = [next(node_it) if k == "node" else next(dyn_it) if k == "dyn" else None
                  for k in split.kinds]
        return jax.tree.unflatten(split.treedef, leaves)

    def _bind(self, args, kwargs) -> tuple[Any, _Split]:
        """The call's arguments: the dynamic ones only (as ``jax.jit``'s compiled
        functions take them; the static ones are those it was lowered for), or all."""
        old = self.nnx.bound
        if len(args) == len(old.dyn_args) and set(kwargs) == set(old.dyn_kwargs):
            full, kw = old.merge(args, kwargs)
            args, kwargs = tuple(full), kw
        bound = self.nnx.owner.options.bind(args, kwargs)
        return bound, _Split((bound.dyn_args, bound.dyn_kwargs))

    def __call__(self, *args, **kwargs):
        return self._run(self._split(args, kwargs), self.inner)

    def profile(self, *args, trace_path=None, **kwargs):
        """``MpmdCompiled.profile`` of a call on NNX objects (their updates written
        back, as a call writes them)."""
        return self._run(self._split(args, kwargs),
                         functools.partial(self.inner.profile, trace_path=trace_path))

    def step_profile(self, *args, steps: int = 3, **kwargs):
        """``MpmdCompiled.step_profile`` on NNX objects (steps on the same values:
        nothing is written back)."""
        return self.inner.step_profile(*self._inputs(self._split(args, kwargs)), steps=steps)

    def memory_profile(self, *args, **kwargs):
        """``MpmdCompiled.memory_profile`` on NNX objects (nothing is written back)."""
        return self.inner.memory_profile(*self._inputs(self._split(args, kwargs)))

    def _split(self, args, kwargs) -> _Split:
        """The call's NNX objects and arrays, checked against those it was compiled for."""
        bound, split = self._bind(args, kwargs)
        old = self.nnx.bound
        if bound.static_key() != old.static_key():
            raise MultimeshValueError(
                f"Compiled function called with static arguments "
                f"{_static_values(bound)}, but it was compiled for {_static_values(old)}. "
                f"Lower it again, or call the `mjit` function directly.")
        if split.signature() != self.nnx.split.signature():
            raise MultimeshValueError(
                _describe_mismatch(self.nnx.split, split, bound.dyn_positions))
        return split

    @staticmethod
    def _inputs(split: _Split) -> tuple[list, list]:
        """The arguments of the MPMD program inside: Variable values and arrays."""
        return encode_keys(split.dynamic_values())[0], encode_keys(split.dyn)[0]

    def _run(self, split: _Split, run: Callable):
        """``run`` (the MPMD program, or its ``profile``) on ``split``'s values; the
        changed Variables written back, the outputs assembled."""
        cell = self.nnx.cell
        (out_vars, out_dyn), upd = run(*self._inputs(split))
        ov_impls, od_impls, upd_impls = cell["impls"]
        split.write_back(cell["changed"], decode_keys(upd, upd_impls))
        return cell["out"].assemble(decode_keys(out_vars, ov_impls),
                                    decode_keys(out_dyn, od_impls), split.nodes)

    def place(self, *args, **kwargs) -> None:
        """Move the Variables of the NNX objects in ``args`` onto their input shardings."""
        _, split = self._bind(args, kwargs)
        idx = [i for i, d in enumerate(split.var_dynamic)
               if d and self.variable_shardings[i] is not None]  # None: never read
        vals = [jax.device_put(split.values[i], self.variable_shardings[i]) for i in idx]
        split.write_back(idx, vals)


def _out_stand_in(out: _OutSplit, ov_sh, od_sh):
    node_states = _states_by_node([(p, sh) for (p, _), sh in zip(out.flat, ov_sh)],
                                  sum(k == "node" for k in out.kinds))
    node_it, dyn_it = iter(node_states), iter(od_sh)
    return [next(node_it) if k == "node" else next(dyn_it) if k == "dyn" else None
            for k in out.kinds]


def _static_values(bound) -> dict:
    return {**{i: bound.args[i] for i in bound.static_pos},
            **{k: bound.kwargs[k] for k in bound.static_kw}}
