"""The planner's units: a model's name-stack units in program order, and their costs.

The step ``value_and_grad(fun)`` is traced once to a jaxpr. Every equation carries
the name stack ``register_task`` matches (``jvp(LM)/layers_3/Dense_0`` forward,
``transpose(jvp(LM))/layers_3/...`` backward). Below the root the whole model shares
(``LM``), each distinct next name is a *unit* (``embed``, ``layers_0``, ..., ``head``);
a unit whose children are list items (NNX's ``blocks/0``, ``blocks/1``) is split into
them. Equations outside every unit (the glue between modules) count with the unit
before them in their direction. Each unit's forward and backward equations are
lowered on their own and costed by XLA's cost analysis (identical units, e.g. the
blocks of a stack, are costed once). A unit's backward splits, as the zero-bubble
schedules split it, into the equations the cotangent for the units before it needs
(input gradient) and the rest (weight gradient), each costed apart. With ``timer``, each part is also run and timed on one device
(the measured-cost source).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from multimesh._src.errors import MultimeshValueError
from multimesh.jax._module_names import module_names

__all__ = ["UnitCost", "Profile", "Timer", "measure_units", "unit_matcher"]

_WRAPPED = re.compile(r"^[\w.-]+\((.*)\)$")
_BACKWARD = "transpose("


@dataclasses.dataclass(frozen=True)
class UnitCost:
    """What one unit costs for the whole example batch (one step, no microbatching)."""

    name: str
    fwd_flops: float
    bwd_flops: float
    bytes_accessed: float
    param_bytes: int
    residual_bytes: int  # forward values the backward reads (held per microbatch)
    wgrad_flops: float = 0.0  # the part of bwd_flops no other unit's backward waits for
    times: tuple[float, float, float] | None = None  # measured fwd, bwd, wgrad seconds
    fwd_bytes: float = 0.0  # the forward's part of bytes_accessed
    work_bytes: int = 0  # the most its backward's own temporaries hold at once
    bwd_param_bytes: int = 0  # the parameter bytes its backward reads
    param_count: int = 0  # the parameter elements its forward reads
    param_leaves: int = 0  # the parameter arrays its forward reads (fsdp gathers each)
    bwd_param_leaves: int = 0  # the parameter arrays its backward reads


@dataclasses.dataclass(frozen=True)
class Profile:
    """The units of a step, in program order, and the bytes crossing each cut."""

    root: tuple[str, ...]
    units: tuple[UnitCost, ...]
    cut_bytes: tuple[int, ...]  # cut_bytes[i]: activations from units <= i read after
    source: str


def _parts(stack: str) -> tuple[tuple[str, ...], bool]:
    """A name stack's components with jax's transform wrappers removed, and whether
    it belongs to the backward pass."""
    out = []
    for comp in stack.split("/") if stack else ():
        while (m := _WRAPPED.match(comp)) is not None:
            comp = m.group(1)
        if comp:
            out.append(comp)
    return tuple(out), _BACKWARD in stack


def _root(paths: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """The longest prefix under which every named equation lives, with one child at
    most per level (the model's own scope: ``LM``; empty for a plain function)."""
    root: tuple[str, ...] = ()
    while True:
        below = [p for p in paths if len(p) > len(root)]
        kids = {p[len(root)] for p in below}
        if len(kids) != 1 or any(p[:len(root)] != root for p in below):
            return root
        if not any(len(p) > len(root) + 1 for p in below):
            return root
        root = (*root, kids.pop())


def _unit_names(paths: Sequence[tuple[str, ...]], root: tuple[str, ...]) -> list[str]:
    """Units below ``root`` in order of first appearance; list items split out."""
    names: list[str] = []
    for p in paths:
        if len(p) > len(root) and p[:len(root)] == root:
            head = p[len(root)]
            child = p[len(root) + 1] if len(p) > len(root) + 1 else None
            name = f"{head}/{child}" if child is not None and child.isdigit() else head
            if name not in names:
                names.append(name)
    return names


def _unit_of(path: tuple[str, ...], root: tuple[str, ...], index: dict[str, int]) -> int | None:
    """The unit whose name is the longest prefix of ``path`` below ``root``."""
    if len(path) <= len(root) or path[:len(root)] != root:
        return None
    below = path[len(root):]
    for k in range(len(below), 0, -1):
        hit = index.get("/".join(below[:k]))
        if hit is not None:
            return hit
    return None


def _refine(names: list[str], paths: Sequence[tuple[str, ...]], root: tuple[str, ...],
            want: int) -> list[str]:
    """Split the unit with the most forward equations into its children (in program
    order) until there are ``want`` units or none can be split."""
    names = list(names)
    while len(names) < want:
        kids: dict[str, list[str]] = {}
        weight: dict[str, int] = {}
        for p in paths:
            below = "/".join(p[len(root):])
            for n in names:
                if below == n or below.startswith(n + "/"):
                    weight[n] = weight.get(n, 0) + 1
                    rest = below[len(n) + 1:].split("/")[0] if below != n else ""
                    if rest and f"{n}/{rest}" not in kids.setdefault(n, []):
                        kids[n].append(f"{n}/{rest}")
        split = [n for n in names if len(kids.get(n, ())) > 1]
        if not split:
            return names
        big = max(split, key=lambda n: weight[n])
        at = names.index(big)
        names[at:at + 1] = kids[big]
    return names


def unit_matcher(root: Sequence[str], units: Sequence[str]) -> str:
    """The ``register_task`` regular expression that claims exactly ``units``: their
    names right below ``root`` in a name stack, forward and backward."""
    lead = "".join(re.escape(r) + r"\)*/" for r in root)
    # jax wraps the stack's first name in its transforms: jvp(enc)/layer0
    alts = "|".join(r"\)*/".join(re.escape(c) for c in u.split("/")) for u in units)
    return rf"(?:^|[/(]){lead}({alts})(?=[/)]|$)"


def _nbytes(aval) -> int:
    shape = getattr(aval, "shape", ())
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def _trace(fun, args, params_argnum: int):
    """``value_and_grad(fun)``'s jaxpr, NNX modules named as ``mjit`` names them."""
    roots = [a for a in jax.tree.leaves(args, is_leaf=_is_nnx) if _is_nnx(a)]
    with module_names(*roots):
        out = jax.eval_shape(fun, *args)
        if not (hasattr(out, "shape") and out.shape == () and hasattr(out, "dtype")
                and jax.numpy.issubdtype(out.dtype, jax.numpy.floating)):
            raise MultimeshValueError(
                f"`plan_pipeline` plans the training step of a loss: `fun` must return one "
                f"floating-point scalar (the loss it differentiates), got "
                f"{jax.tree.map(lambda x: f'{x.dtype}{list(x.shape)}', out)}.")
        return jax.make_jaxpr(jax.value_and_grad(fun, argnums=params_argnum))(*args)


def _is_nnx(x) -> bool:
    return type(x).__module__.startswith("flax.nnx") or any(
        c.__module__.startswith("flax.nnx") for c in type(x).__mro__[1:])


def _assign(eqns, root, index, n) -> list[tuple[int, bool]]:
    """Per equation: its unit and direction (glue goes with the unit before it)."""
    last = {False: 0, True: n - 1}
    out = []
    for e in eqns:
        path, bwd = _parts(str(e.source_info.name_stack))
        u = _unit_of(path, root, index)
        u = last[bwd] if u is None else u
        last[bwd] = u
        out.append((u, bwd))
    return out


def _closed(eqns, typed: bool = False):
    """``eqns`` as a closed jaxpr of their own, the avals of its inputs and, when
    ``typed`` and its values are typed over an explicit mesh, that mesh (the avals
    then keep their sharding types)."""
    defined = {v for e in eqns for v in e.outvars if not isinstance(v, jcore.DropVar)}
    ins: list = []
    for e in eqns:
        for v in e.invars:
            if isinstance(v, jcore.Var) and v not in defined and v not in ins:
                ins.append(v)
    outs = [v for e in eqns for v in e.outvars if not isinstance(v, jcore.DropVar)]
    dbg = jcore.DebugInfo("plan_pipeline", "a unit's equations",
                          tuple(f"in{k}" for k in range(len(ins))),
                          tuple(f"out{k}" for k in range(len(outs))))
    jaxpr = jcore.Jaxpr([], ins, outs, list(eqns), debug_info=dbg)
    mesh = _typed_mesh(v.aval for e in eqns for v in (*e.invars, *e.outvars)) \
        if typed else None
    avals = [_struct(v.aval, mesh) for v in ins]
    return jcore.ClosedJaxpr(jaxpr, []), avals, mesh


def _typed_mesh(avals):
    """The concrete mesh of the first aval typed over an explicit mesh (sharding in
    types), on the first devices; None when no aval is typed."""
    for aval in avals:
        am = getattr(getattr(aval, "sharding", None), "mesh", None)
        if am is not None and not am.empty and AxisType.Explicit in tuple(am.axis_types):
            n = int(np.prod(am.axis_sizes))
            devices = np.asarray(jax.devices()[:n], dtype=object).reshape(am.axis_sizes)
            return Mesh(devices, am.axis_names, axis_types=am.axis_types)
    return None


def _struct(aval, mesh) -> jax.ShapeDtypeStruct:
    """``aval`` as an argument type, its sharding type kept on ``mesh`` (explicit mode:
    the unit's operations are typed by it, so an untyped argument would not match)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if mesh is None or spec is None:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=NamedSharding(mesh, spec))


def _under(mesh):
    """The context to lower typed operations in: ``mesh``, unless the caller's mesh
    is already in context."""
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def _cost(eqns, cache: dict, what: str = "a unit") -> tuple[float, float]:
    """XLA's flops and bytes accessed for ``eqns`` lowered as one function."""
    if not eqns:
        return 0.0, 0.0
    closed, avals, _ = _closed(eqns)
    key = str(closed)
    if key not in cache:
        info = _lowered_cost(eqns, closed, avals, what)
        cache[key] = (float(info.get("flops", 0.0)), float(info.get("bytes accessed", 0.0)))
    return cache[key]


def _lowered_cost(eqns, closed, avals, what: str) -> dict:
    """XLA's cost analysis of ``closed`` lowered on ``avals``; where that fails and its
    values are typed over an explicit mesh, lowered again with the avals keeping their
    sharding types, under that mesh; a clear error naming ``what`` where neither does."""
    try:
        return jax.jit(jcore.jaxpr_as_fun(closed)).lower(*avals).cost_analysis() or {}
    except Exception as e:  # noqa: BLE001 - any failure: retry typed, or say which unit
        first = e
    closed, avals, mesh = _closed(eqns, typed=True)
    if mesh is None:
        raise _uncostable(what, eqns, first) from first
    try:
        with _under(mesh):
            return jax.jit(jcore.jaxpr_as_fun(closed)).lower(*avals).cost_analysis() or {}
    except Exception as e:  # noqa: BLE001
        raise _uncostable(what, eqns, e) from e


def _uncostable(what: str, eqns, e: Exception) -> MultimeshValueError:
    prims = sorted({str(x.primitive) for x in eqns})
    why = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
    return MultimeshValueError(
        f"`plan_pipeline` cannot cost {what}: its {len(eqns)} operation(s) "
        f"({', '.join(prims[:8])}{', ...' if len(prims) > 8 else ''}) did not lower on "
        f"their own for XLA's cost analysis ({why}). Run the step under `jax.jit` to see "
        f"whether it lowers at all; if it does, name the unit's parts differently "
        f"(`jax.named_scope`) so that this unit's operations stand alone, or pass "
        f"`num_stages` and write the stages' `register_task` rules yourself.")


@dataclasses.dataclass
class Timer:
    """Times ``eqns`` compiled on their own on ``device``: the best of ``repeat``
    runs after one warm-up, on zero inputs (identical equations timed once)."""

    device: object
    repeat: int = 3
    cache: dict = dataclasses.field(default_factory=dict)

    def __call__(self, eqns) -> float:
        if not eqns:
            return 0.0
        closed, avals, mesh = _closed(eqns, typed=True)
        key = str(closed)
        if key not in self.cache:
            fn = jax.jit(jcore.jaxpr_as_fun(closed))
            args = [jax.device_put(np.zeros(a.shape, a.dtype),
                                   self.device if a.sharding is None else a.sharding)
                    for a in avals]
            with _under(mesh):
                jax.block_until_ready(fn(*args))
                best = float("inf")
                for _ in range(self.repeat):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    best = min(best, time.perf_counter() - t0)
            self.cache[key] = best
        return self.cache[key]


def _param_bytes(eqns, where, params: set, n: int, size=None) -> list[int]:
    """Per unit, the bytes of the parameters its forward reads (a shared one counts
    in every unit that reads it: each stage holds its own copy); ``size``: another
    measure of each (its elements)."""
    size = _nbytes if size is None else size
    out = [0] * n
    seen: set = set()
    for e, (u, bwd) in zip(eqns, where):
        for v in e.invars:
            if not bwd and isinstance(v, jcore.Var) and v in params and (v, u) not in seen:
                seen.add((v, u))
                out[u] += size(v.aval)
    return out


def _count(aval) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _one(aval) -> int:
    return 1


def _bwd_param_bytes(eqns, where, params: set, n: int, size=None) -> list[int]:
    """Per unit, the bytes of the parameters its backward reads (what an fsdp stage's
    backward reads from its forward, sharded: each microbatch keeps its own);
    ``size``: another measure of each (:func:`_one`: the arrays)."""
    size = _nbytes if size is None else size
    out = [0] * n
    seen: set = set()
    for e, (u, bwd) in zip(eqns, where):
        for v in e.invars:
            if bwd and isinstance(v, jcore.Var) and v in params and (v, u) not in seen:
                seen.add((v, u))
                out[u] += size(v.aval)
    return out


def _working_set(eqns) -> int:
    """The most bytes that values made by ``eqns`` hold at once while they run in
    order, each from the operation that makes it to the last of them that reads it
    (a value read only outside them counts while it is made): the temporaries of a
    unit's backward, which the compiled fragment holds beside its inputs."""
    last: dict = {}
    for t, e in enumerate(eqns):
        for v in e.invars:
            if isinstance(v, jcore.Var):
                last[v] = t
    ends = [0] * (len(eqns) + 1)
    live = peak = 0
    for t, e in enumerate(eqns):
        for v in e.outvars:
            if not isinstance(v, jcore.DropVar):
                b = _nbytes(v.aval)
                live += b
                ends[max(last.get(v, t), t)] += b
        peak = max(peak, live)
        live -= ends[t]
    return peak


def _flows(eqns, where, n: int) -> tuple[list[int], tuple[int, ...]]:
    """Residual bytes per unit (forward values the backward reads) and the activation
    bytes over each cut (forward values read by a later unit's forward)."""
    made: dict = {}
    residual = [0] * n
    reach: dict = {}  # forward value -> the last unit whose forward reads it
    held: set = set()
    for e, (u, bwd) in zip(eqns, where):
        for v in e.invars:
            src = made.get(v) if isinstance(v, jcore.Var) else None
            if src is None:
                continue
            if bwd and v not in held:
                held.add(v)
                residual[src] += _nbytes(v.aval)
            elif not bwd and u > src:
                reach[v] = max(reach.get(v, u), u)
        if not bwd:
            made.update((v, u) for v in e.outvars)
    cuts = np.zeros(max(n - 1, 0), dtype=np.int64)
    for v, last in reach.items():
        cuts[made[v]:last] += _nbytes(v.aval)
    return residual, tuple(int(c) for c in cuts)


def _weight_part(eqns, where, k: int) -> list:
    """Unit ``k``'s backward equations that no equation outside it waits for: its
    weight-gradient part (what a split backward runs apart)."""
    mine = [e for e, (u, b) in zip(eqns, where) if u == k and b]
    ids = {id(e) for e in mine}
    needed = {v for e in eqns if id(e) not in ids for v in e.invars
              if isinstance(v, jcore.Var)}
    weight = []
    for e in reversed(mine):
        if any(v in needed for v in e.outvars if not isinstance(v, jcore.DropVar)):
            needed.update(v for v in e.invars if isinstance(v, jcore.Var))
        else:
            weight.append(e)
    return weight[::-1]


def measure_units(fun, args: Sequence, params_argnum: int = 0, min_units: int = 2,
                  timer: Timer | None = None) -> Profile:
    """Trace ``value_and_grad(fun)(*args)`` and cost its name-stack units (split
    finer, heaviest first, while there are fewer than ``min_units``); ``timer`` also
    times each unit's forward, backward and weight-gradient part."""
    closed = _trace(fun, tuple(args), params_argnum)
    eqns = closed.jaxpr.eqns
    fwd_paths = [p for p, bwd in (_parts(str(e.source_info.name_stack)) for e in eqns)
                 if p and not bwd]
    root = _root(fwd_paths)
    names = _refine(_unit_names(fwd_paths, root), fwd_paths, root, min_units)
    if len(names) < 2:
        raise MultimeshValueError(
            f"`plan_pipeline` found {len(names)} unit(s) ({names}) in the step's name "
            f"stack below {'/'.join(root) or 'the top level'}; a pipeline needs at least two. "
            f"Name the model's parts: Flax submodules, NNX attributes or "
            f"`jax.named_scope` blocks.")
    index = {name: k for k, name in enumerate(names)}
    where = _assign(eqns, root, index, len(names))
    leaves = jax.tree.leaves(args[params_argnum])
    n_before = sum(len(jax.tree.leaves(a)) for a in args[:params_argnum])
    params = set(closed.jaxpr.invars[n_before:n_before + len(leaves)])
    param_bytes = _param_bytes(eqns, where, params, len(names))
    param_count = _param_bytes(eqns, where, params, len(names), _count)
    bwd_params = _bwd_param_bytes(eqns, where, params, len(names))
    leaves_fwd = _param_bytes(eqns, where, params, len(names), _one)
    leaves_bwd = _bwd_param_bytes(eqns, where, params, len(names), _one)
    residual, cuts = _flows(eqns, where, len(names))
    cache: dict = {}
    units = []
    for k, name in enumerate(names):
        fwd = [e for e, (u, b) in zip(eqns, where) if u == k and not b]
        bwd = [e for e, (u, b) in zip(eqns, where) if u == k and b]
        wgrad = _weight_part(eqns, where, k)
        ff, fb = _cost(fwd, cache, f"unit {name!r}'s forward")
        bf, bb = _cost(bwd, cache, f"unit {name!r}'s backward")
        wf, _ = _cost(wgrad, cache, f"unit {name!r}'s weight gradient")
        times = None if timer is None else (timer(fwd), timer(bwd), min(timer(wgrad),
                                                                       timer(bwd)))
        units.append(UnitCost(name, ff, bf, fb + bb, param_bytes[k], residual[k],
                              min(wf, bf), times, fb, _working_set(bwd), bwd_params[k],
                              param_count[k], leaves_fwd[k], leaves_bwd[k]))
    source = "XLA cost analysis of each unit's equations"
    if timer is not None:
        source = (f"measured time of each unit's equations compiled alone on "
                  f"{timer.device} (best of {timer.repeat} runs after a warm-up, zero "
                  f"inputs); flops from XLA cost analysis")
    return Profile(root, tuple(units), cuts, source)


# --------------------------------------------------------------------------- tensor parallelism

MODEL = "model"
"""The mesh axis a model's tensor-parallel dimensions shard over (flax's rules map its
logical names onto it; NNX metadata and jax's constraints name it)."""

_HLO_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(?:-start)?\(")
_HLO_ARRAY = re.compile(r"\b(pred|[sufc]\d+|bf16|f8\w*)\[([\d,]*)\]")
_HLO_BYTES = {"pred": 1, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class TensorUnits:
    """Per unit, what one device runs with the model's ``model``-annotated dimensions
    sharded over a ``model`` axis of ``size`` devices (the whole example batch on
    that axis alone), from XLA's cost analysis of the unit compiled on such a mesh;
    and the collectives that compiled program runs, ``(op, bytes)`` per unit (their
    time split as the work between forward and backward)."""

    size: int
    fwd_flops: tuple[float, ...]
    bwd_flops: tuple[float, ...]
    wgrad_flops: tuple[float, ...]
    fwd_bytes: tuple[float, ...]
    bwd_bytes: tuple[float, ...]
    param_bytes: tuple[int, ...]  # per device: the sharded parameters divided
    bwd_param_bytes: tuple[int, ...]
    param_count: tuple[int, ...]  # per device, the parameter elements (so divided)
    collectives: tuple[tuple[tuple[str, float], ...], ...]  # forward and backward
    fwd_share: tuple[float, ...]  # the forward's part of each unit's work


def _hlo_bytes(text: str) -> float:
    total = 0.0
    for dtype, dims in _HLO_ARRAY.findall(text):
        width = _HLO_BYTES.get(dtype) or max(int(re.sub(r"\D", "", dtype) or 8) // 8, 1)
        total += width * float(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def hlo_collectives(hlo: str, size: int) -> tuple[tuple[str, float], ...]:
    """The collectives of a compiled module's text, as ``DeviceModel.collective_seconds``
    takes them: ``(op, bytes of the full array)`` (a reduce-scatter's result is one of
    ``size`` shards; an all-to-all or a permute moves about its result, priced as an
    all-gather of it)."""
    out = []
    for line in hlo.splitlines():
        # a long tuple's type carries index comments (``/*index=5*/``): not its '='
        m = _HLO_COLLECTIVE.search(re.sub(r"/\*.*?\*/", "", line) if "/*" in line else line)
        if m is None or "-done(" in line:
            continue
        op, nbytes = m.group(2), _hlo_bytes(m.group(1))
        if op == "reduce-scatter":
            nbytes *= size
        elif op not in ("all-reduce", "all-gather"):
            op = "all-gather"
        out.append((op, nbytes))
    return tuple(out)


def _names_model(sharding) -> bool:
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return False
    return any(MODEL in (e if isinstance(e, tuple) else (e,)) for e in spec)


def _sub_jaxprs(e):
    for v in e.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def names_model_axis(jaxpr) -> bool:
    """Whether a sharding constraint in ``jaxpr`` (or below) names the ``model`` axis."""
    for e in jaxpr.eqns:
        if str(e.primitive) == "sharding_constraint" and _names_model(e.params.get("sharding")):
            return True
        if any(names_model_axis(j) for j in _sub_jaxprs(e)):
            return True
    return False


def names_model(fun, args: Sequence, devices) -> bool:
    """Whether the step's shardings name the ``model`` axis: traced under a mesh that
    has one (flax's rules and NNX metadata then resolve onto it), or its parameters
    placed over one."""
    if any(_names_model(getattr(x, "sharding", None)) for x in jax.tree.leaves(args[0])):
        return True
    with jax.set_mesh(model_mesh(devices, 1)):
        return names_model_axis(_trace(fun, tuple(args), 0).jaxpr)


def model_mesh(devices, size: int) -> Mesh:
    """The mesh a unit is costed on: ``data`` of one device, ``model`` of ``size``."""
    grid = np.asarray(list(devices)[:size], dtype=object).reshape(1, size)
    return Mesh(grid, ("data", MODEL), axis_types=(AxisType.Auto,) * 2)


def _compiled_cost(eqns, mesh, size: int, cache: dict, what: str, placed: dict):
    """Per-device flops, bytes accessed and collectives of ``eqns`` compiled on
    ``mesh``, and the devices each of their values (in order) is split over;
    ``placed``: the specs of the inputs that arrive sharded (parameters placed over a
    ``model`` axis, NNX's metadata)."""
    if not eqns:
        return 0.0, 0.0, (), ()
    closed, avals, _ = _closed(eqns)
    specs = tuple(placed.get(v) for v in closed.jaxpr.invars)
    avals = [a if p is None else jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                      sharding=NamedSharding(mesh, p))
             for a, p in zip(avals, specs)]
    key = (size, str(closed), specs)
    if key not in cache:
        try:
            with jax.set_mesh(mesh):
                compiled = jax.jit(jcore.jaxpr_as_fun(closed)).lower(*avals).compile()
        except Exception as e:  # noqa: BLE001 - any failure: say which unit
            raise _uncostable(what, eqns, e) from e
        info = compiled.cost_analysis() or {}
        outs = [v.aval.shape for v in closed.jaxpr.outvars]
        cache[key] = (float(info.get("flops", 0.0)), float(info.get("bytes accessed", 0.0)),
                      hlo_collectives(compiled.as_text() or "", size),
                      tuple(_split(s, shape) for s, shape in zip(
                          jax.tree.leaves(compiled.output_shardings), outs)))
    return cache[key]


def _placed(invars, leaves) -> dict:
    """The parameters placed over a ``model`` axis (NNX's metadata, arrays placed by
    hand): their specs, kept to ``data`` and ``model``."""
    out = {}
    for v, x in zip(invars, leaves):
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        if spec is not None and _names_model(x.sharding):
            out[v] = PartitionSpec(*(_kept(e) for e in spec))
    return out


def _kept(entry):
    names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,))
                  if n in ("data", MODEL))
    return None if not names else names[0] if len(names) == 1 else names


def _split(sharding, shape) -> int:
    """The devices a value of ``shape`` placed by ``sharding`` is split over."""
    if not shape:
        return 1
    whole = int(np.prod(shape, dtype=np.int64))
    return max(whole // max(int(np.prod(sharding.shard_shape(shape), dtype=np.int64)), 1), 1)


def _less(ops: tuple, minus: tuple) -> tuple:
    """``ops`` without one of each of ``minus`` (a multiset difference, in order)."""
    left = list(minus)
    out = []
    for op in ops:
        if op in left:
            left.remove(op)
        else:
            out.append(op)
    return tuple(out)


def _sharded_bytes(eqns, where, params: dict, n: int, bwd: bool,
                   size=_nbytes) -> tuple[int, ...]:
    """Per unit, the bytes (``size``) per device of the parameters its forward (or
    backward) reads, each divided over the devices its gradient is split over."""
    out = [0] * n
    seen: set = set()
    for e, (u, b) in zip(eqns, where):
        for v in e.invars:
            if b == bwd and isinstance(v, jcore.Var) and v in params and (v, u) not in seen:
                seen.add((v, u))
                out[u] += size(v.aval) // params[v]
    return tuple(out)


def measure_tensor(fun, args: Sequence, profile: Profile, size: int, devices,
                   cache: dict | None = None) -> TensorUnits | None:
    """``profile``'s units costed with the model's ``model``-annotated dimensions
    sharded over ``size`` devices: the step traced under a ``(data=1, model=size)``
    mesh (flax's rules and NNX metadata then name ``model``), each unit's forward,
    forward and backward compiled together on it, its figures split between them as
    the unsharded unit's flops split. Each parameter is divided over the devices its
    gradient is split over there. None when no
    sharding in the step names ``model`` (nothing to shard)."""
    mesh = model_mesh(devices, size)
    with jax.set_mesh(mesh):
        closed = _trace(fun, tuple(args), 0)
    if not names_model_axis(closed.jaxpr) and not any(
            _names_model(getattr(x, "sharding", None)) for x in jax.tree.leaves(args[0])):
        return None
    eqns, names = closed.jaxpr.eqns, [u.name for u in profile.units]
    where = _assign(eqns, profile.root, {n: k for k, n in enumerate(names)}, len(names))
    cache = {} if cache is None else cache
    placed = _placed(closed.jaxpr.invars, jax.tree.leaves(args[0]))
    rows: list[tuple] = []
    split: dict = {}  # each value's devices, as a unit compiled with its backward puts it
    for k, name in enumerate(names):
        fwd = [e for e, (u, b) in zip(eqns, where) if u == k and not b]
        bwd = [e for e, (u, b) in zip(eqns, where) if u == k and b]
        # the unit compiled whole, forward and backward: the residuals its backward
        # reads keep the layout its forward's constraints give them (compiled apart,
        # they would come whole); split as the unsharded unit's flops split
        fb = _compiled_cost(fwd + bwd, mesh, size, cache, f"unit {name!r}", placed)
        split.update(zip(_closed(fwd + bwd)[0].jaxpr.outvars, fb[3]))
        one = profile.units[k]
        total = one.fwd_flops + one.bwd_flops
        share = one.fwd_flops / total if total else 0.5
        wshare = one.wgrad_flops / total if total else 0.0
        rows.append((fb[0] * share, fb[0] * (1 - share), fb[0] * wshare, fb[1] * share,
                     fb[1] * (1 - share), fb[2], share))
    n = len(jax.tree.leaves(args[0]))
    grads = closed.jaxpr.outvars[1:1 + n]  # value_and_grad: the loss, then the gradients
    params = {p: split.get(g, 1) if isinstance(g, jcore.Var) else 1
              for p, g in zip(closed.jaxpr.invars[:n], grads)}
    f, b, w, fb_, bb, ops, shares = (tuple(c) for c in zip(*rows))
    n_units = len(names)
    return TensorUnits(size, f, b, w, fb_, bb,
                       _sharded_bytes(eqns, where, params, n_units, False),
                       _sharded_bytes(eqns, where, params, n_units, True),
                       _sharded_bytes(eqns, where, params, n_units, False, _count), ops, shares)
