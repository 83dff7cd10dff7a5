"""The passes' readers and writers of the IR contract (docs/ir.md).

The names and the task-mesh record (:class:`MeshRecord`) are ``multimesh._src.ir_contract``'s, shared
with the front end and the runtime; here are the helpers only passes need, each
checking what it reads and raising a :class:`DiagnosticError` at the op.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from math import prod

from multimesh._src import ir_attrs as ta
from multimesh._src.caches import WeakKeyCache
from multimesh._src.errors import DiagnosticError, DiagnosticWarning, user_stacklevel
from multimesh._src.ir_contract import (  # noqa: F401  (re-exported for the passes)
    AXES_ATTR,
    BODY_ATTR,
    DEFAULT_TASK,
    DEVICE_COUNT,
    DEVICES_ATTR,
    DONOR_ATTR,
    FRAGMENT_ATTR,
    FRAGMENT_CALL_TARGET,
    INDEX_TARGET,
    LOGICAL_TARGET,
    LOOP_ATTR,
    LOOP_DEVICES_ATTR,
    LOOP_TARGET,
    MAX_ID,
    MESH_ATTR,
    MESH_KEYS,
    MESHES_ATTR,
    MICROBATCH_ATTR,
    NUM_DEVICES_ATTR,
    NUM_MICROBATCHES_ATTR,
    PREFIX,
    SCHEDULE_ATTR,
    SCHEDULE_CONFIG_ATTR,
    SHARDING_ATTR,
    SPLIT_ATTR,
    SUM_TARGET,
    TAG_KEYS,
    TASK_ATTR,
    TASK_CALL_KEYS,
    TASK_ENTRY_KEYS,
    TASKS_ATTR,
    TRANSFER_TARGET,
    TRANSPOSE_COUNT,
    MeshRecord,
    Tag,
    check_keys,
    check_mesh,
    read_num_devices,
)
from multimesh._src.ir_contract import check_dict as _check_dict
from multimesh._src.ir_contract import duplicate as _duplicate
from multimesh._src.ir_contract import fmt as _fmt
from multimesh._src.ir_contract import int_list as _int_list
from multimesh._src.ir_contract import str_list as _str_list
from multimesh._src.ir_contract import tag_from_dict as _tag_from_dict
from multimesh._src.ir_util import custom_call_target
from multimesh._src.mlir import attr_to_py, dict_attr, ir, py_to_attr, sdy


def main_func(module: ir.Module) -> ir.Operation:
    for view in module.body.operations:
        op = view.operation
        if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise DiagnosticError("module has no 'main' function", module.operation.location)


def func_by_name(module: ir.Module) -> dict[str, ir.Operation]:
    out: dict[str, ir.Operation] = {}
    for view in module.body.operations:
        op = view.operation
        if op.name == "func.func":
            out[ir.StringAttr(op.attributes["sym_name"]).value] = op
    return out


def func_name(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


def callee_of(call: ir.Operation) -> str:
    return ir.FlatSymbolRefAttr(call.attributes["callee"]).value


def entry_block(func: ir.Operation) -> ir.Block:
    return func.regions[0].blocks[0]


def read_tasks(module: ir.Module, *, strict: bool = False) -> dict[str, MeshRecord]:
    """The module's ``mm.tasks`` table, checked (:class:`DiagnosticError` at the module).

    ``strict``: ``mm-verify``'s reading (see :meth:`MeshRecord.from_dict`'s ``keys``).
    """
    attrs = module.operation.attributes
    if TASKS_ATTR not in attrs:
        return {}
    loc = module.operation.location
    table = _check_dict(attr_to_py(attrs[TASKS_ATTR]), f"'{TASKS_ATTR}'", loc)
    keys = TASK_ENTRY_KEYS if strict else None
    out = {}
    for k, v in table.items():
        if not k:
            raise DiagnosticError(f"'{TASKS_ATTR}' has an entry with an empty task name", loc)
        out[k] = MeshRecord.from_dict(v, loc, f"'{TASKS_ATTR}' entry \"{k}\"", keys)
    return out


def write_tasks(module: ir.Module, tasks: dict[str, MeshRecord]) -> None:
    with module.context:
        module.operation.attributes[TASKS_ATTR] = dict_attr(
            {k: tasks[k].to_dict() for k in sorted(tasks)})




_TAG_CACHES = WeakKeyCache("multimesh task tags of plain MLIR contexts")
"""Per-context tag caches for contexts that take no Python attributes (plain ``ir.Context``)."""


def _tag_cache(ctx: ir.Context) -> dict[int, Tag]:
    """The tag cache of one context: ``{attribute pointer: tag}``.

    It lives on the context, so it goes when the context goes: a cache keyed by the
    attributes themselves would keep every compiled program's context alive. Within
    a context, attributes are uniqued and never freed, so their pointers are stable keys.
    """
    d = getattr(ctx, "__dict__", None)
    if d is None:
        return _TAG_CACHES.setdefault(ctx, {})
    cache = d.get("_mm_tag_cache")
    if cache is None:
        cache = d["_mm_tag_cache"] = {}
    return cache


def tag_of(op: ir.Operation) -> Tag | None:
    """The :data:`Tag` of an op tagged in flat form, else None.

    A malformed tag (missing or mistyped ``name``/``transpose_count``, empty name) is a
    :class:`DiagnosticError` at the op. Do not call this inside an ``op.walk`` callback:
    the bindings turn the exception into a ``RuntimeError``.
    """
    attrs = op.attributes
    if TASK_ATTR not in attrs:
        return None
    a = attrs[TASK_ATTR]
    # Attributes are uniqued per context, so a few distinct tags cover a whole module.
    cache = _tag_cache(a.context)
    key = hash(a)
    tag = cache.get(key)
    if tag is None:
        what = f"'{TASK_ATTR}' on '{op.name}'"
        tag = _tag_from_dict(_check_dict(attr_to_py(a), what, op.location), what, op.location)
        cache[key] = tag
    return tag


def owner_tag(op: ir.Operation) -> Tag | None:
    """The :data:`Tag` of the task that owns ``op``: its own ``mm.task``, else that of
    the nearest enclosing tagged op (an op in a ``stablehlo.while`` body or another
    region, or in the body function of a leaf task call, which carries the call's tag);
    None when nothing up to the module is tagged. The one reader of "whose op is this"
    (a malformed tag is a :class:`DiagnosticError` there, as for :func:`tag_of`)."""
    cur: ir.Operation | None = op
    while cur is not None and cur.name != "builtin.module":
        tag = tag_of(cur)
        if tag is not None:
            return tag
        parent = cur.parent
        cur = parent.operation if parent is not None else None
    return None


def task_call(call: ir.Operation, *, strict: bool = False) -> tuple[Tag, MeshRecord | None]:
    """Tag and mesh of a task call's ``mm.task`` (mesh None for a flat ``{name,
    transpose_count}`` reference), checked as ``mm-verify`` does: a
    :class:`DiagnosticError` at the call on the first violation.

    ``strict``: ``mm-verify``'s reading of a call that must carry its mesh (front-end
    form): unknown keys are errors and the mesh is required.
    """
    what, loc = f"'{TASK_ATTR}'", call.location
    d = _check_dict(attr_to_py(call.attributes[TASK_ATTR]), what, loc)
    if strict:
        check_keys(d, TASK_CALL_KEYS, what, loc)
    tag = _tag_from_dict(d, what, loc)
    if not strict and not any(k in d for k in MESH_KEYS):
        return tag, None
    return tag, MeshRecord.from_dict(d, loc, what, TASK_CALL_KEYS if strict else None)


def is_task_reference(op: ir.Operation) -> bool:
    """Whether ``op``'s ``mm.task`` is a flat-form tag (only :data:`TAG_KEYS`), not a
    task call's full entry."""
    a = op.attributes[TASK_ATTR]
    if not isinstance(a, ir.DictAttr):
        return False
    d = ir.DictAttr(a)
    return all(d[i].name in TAG_KEYS for i in range(len(d)))


def task_reference(op: ir.Operation, tasks: dict[str, MeshRecord] | None) -> Tag:
    """The tag of an op in flat form, read strictly (``mm-verify``): only
    :data:`TAG_KEYS`, naming an entry of ``tasks`` (the ``mm.tasks`` table, None if
    the module has none); a :class:`DiagnosticError` at the op otherwise."""
    what, loc = f"'{TASK_ATTR}' on '{op.name}'", op.location
    d = _check_dict(attr_to_py(op.attributes[TASK_ATTR]), what, loc)
    for key in d:
        if key not in TAG_KEYS:
            raise DiagnosticError(
                f"{what} has unexpected key '{key}' (only task calls carry the mesh; "
                f"expected name, transpose_count)", loc)
    tag = _tag_from_dict(d, what, loc)
    if tasks is None:
        raise DiagnosticError(
            f"{what} names task \"{tag[0]}\" but the module has no '{TASKS_ATTR}' table", loc)
    _known(op, tag[0], tasks)
    return tag


def check_task_calls(root: ir.Operation) -> None:
    """Check the ``mm.task`` of every ``func.call`` under ``root`` (see :func:`task_call`)."""
    calls: list[ir.Operation] = []

    def cb(op):
        op = op.operation
        if op.name == "func.call" and TASK_ATTR in op.attributes:
            calls.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(cb, ir.WalkOrder.PRE_ORDER)
    for call in calls:  # outside the walk: exceptions in callbacks become RuntimeError
        task_call(call)


def known_task(op: ir.Operation, tasks: dict[str, MeshRecord]) -> MeshRecord:
    """The ``mm.tasks`` entry of a tagged op's task (:class:`DiagnosticError` if none)."""
    tag = tag_of(op)
    if tag is None:
        raise DiagnosticError("op is not assigned to a task", op.location)
    return _known(op, tag[0], tasks)


def _known(op: ir.Operation, name: str, tasks: dict[str, MeshRecord]) -> MeshRecord:
    info = tasks.get(name)
    if info is None:
        known = ta.listing(f'"{k}"' for k in sorted(tasks)) or "none"
        raise DiagnosticError(
            f"'{TASK_ATTR}' on '{op.name}' names task \"{name}\" which is not in "
            f"'{TASKS_ATTR}' (known: {known})", op.location)
    return info


def tag_attr(name: str, count: int, loop: int = -1) -> ir.Attribute:
    d = {"name": name, "transpose_count": count}
    if loop >= 0:
        d["loop"] = loop
    return py_to_attr(d)


def loop_of(op: ir.Operation) -> int:
    """The microbatch loop an op belongs to (flat form), -1 if none."""
    tag = tag_of(op)
    if tag is not None:
        return tag[2]
    return ta.read_attr(op, LOOP_ATTR, LOOP_ID, default=-1)


LOOP_ID = ta.int_in(0, (1 << 31) - 1, ("a microbatch loop id", "microbatch loop ids"))
MICROBATCH_SPEC = ta.dict_of(loop=LOOP_ID, num_microbatches=ta.MICROBATCHES)
"""``mm.microbatch = {loop = 0, num_microbatches = M}``."""


def microbatch_of(op: ir.Operation) -> dict | None:
    """The ``mm.microbatch`` of a front-end loop call or marker, checked (None if absent)."""
    return ta.read_attr(op, MICROBATCH_ATTR, MICROBATCH_SPEC, default=None)


def is_loop_marker(op: ir.Operation) -> bool:
    """``mm.microbatch_index`` / ``mm.microbatch_sum``: loop structure, not task work."""
    return custom_call_target(op) in (INDEX_TARGET, SUM_TARGET)


def loop_body(loop: ir.Operation, funcs: dict[str, ir.Operation]) -> tuple[ir.Operation, int]:
    """The body function and microbatch count of an ``mm.microbatch_loop``, checked.

    The body takes the index (``tensor<i32>``) and then one argument per loop operand
    (the running sums first), and returns one value per loop result (the new sums).
    """
    loc = loop.location
    attrs = loop.attributes
    if BODY_ATTR not in attrs or not isinstance(attrs[BODY_ATTR], ir.FlatSymbolRefAttr):
        raise DiagnosticError(f"'{LOOP_TARGET}' needs '{BODY_ATTR}', a symbol reference to "
                              f"its body function", loc)
    name = ir.FlatSymbolRefAttr(attrs[BODY_ATTR]).value
    fn = funcs.get(name)
    if fn is None:
        raise DiagnosticError(f"'{LOOP_TARGET}' body @{name} is not a function of the module",
                              loc)
    num = ta.read_attr(loop, NUM_MICROBATCHES_ATTR, ta.MICROBATCHES,
                      f"'{NUM_MICROBATCHES_ATTR}' on '{LOOP_TARGET}'")
    block = entry_block(fn)
    ops = list(block.operations)
    if len(block.arguments) != 1 + len(loop.operands):
        raise DiagnosticError(
            f"'{LOOP_TARGET}' passes {len(loop.operands)} operands, but its body @{name} "
            f"takes {len(block.arguments)} arguments (the index and one per operand)", loc)
    if str(block.arguments[0].type) != "tensor<i32>":
        raise DiagnosticError(
            f"the first argument of the loop body @{name} is the microbatch index, a "
            f"tensor<i32>, got {block.arguments[0].type}", loc)
    if not ops or len(ops[-1].operation.operands) != len(loop.results):
        raise DiagnosticError(
            f"'{LOOP_TARGET}' has {len(loop.results)} results, but its body @{name} does not "
            f"return as many running sums", loc)
    return fn, num


def logical_marker_axes(op: ir.Operation) -> list[list[str]]:
    """The ``mm.axes`` of an ``mm.logical_sharding`` marker, checked: one operand and one
    result of the same type, one list of logical axis names per dimension, no name on
    two dimensions (a :class:`DiagnosticError` at the marker otherwise)."""
    loc, what = op.location, f"'{LOGICAL_TARGET}'"
    _check_marker_shape(op, what, loc)
    if AXES_ATTR not in op.attributes:
        raise DiagnosticError(f"{what} is missing '{AXES_ATTR}'", loc)
    a = op.attributes[AXES_ATTR]
    if not isinstance(a, ir.ArrayAttr):
        raise DiagnosticError(f"{what} '{AXES_ATTR}' must be a list of lists of strings, got {a}",
                              loc)
    dims = attr_to_py(a)
    t = op.operands[0].type
    if isinstance(t, ir.ShapedType) and ir.ShapedType(t).has_rank \
            and len(dims) != ir.ShapedType(t).rank:
        raise DiagnosticError(
            f"{what} '{AXES_ATTR}' has {len(dims)} entries but the operand {t} has rank "
            f"{ir.ShapedType(t).rank}", loc)
    used: dict[str, int] = {}
    for i, dim in enumerate(dims):
        for n in _str_list(dim, f"{what} '{AXES_ATTR}' entry {i}", loc):
            if n in used:
                raise DiagnosticError(
                    f"{what} logical axis \"{n}\" is used by dimensions {used[n]} and {i}", loc)
            used[n] = i
    return dims


def _check_marker_shape(op: ir.Operation, what: str, loc) -> None:
    if len(op.operands) != 1:
        raise DiagnosticError(f"{what} must have exactly one operand, got {len(op.operands)}",
                              loc)
    if len(op.results) != 1:
        raise DiagnosticError(f"{what} must have exactly one result, got {len(op.results)}",
                              loc)
    in_t, out_t = op.operands[0].type, op.results[0].type
    if in_t != out_t:
        raise DiagnosticError(f"{what} result type {out_t} differs from operand type {in_t}",
                              loc)


def warn_at(location, message: str) -> None:
    """A pass warning (``mm-opt`` prints it as ``file:line:col: warning: ...``)."""
    warnings.warn(DiagnosticWarning(message, location), stacklevel=user_stacklevel())


def is_custom_call(op: ir.Operation, target: str) -> bool:
    return custom_call_target(op) == target


def value_bytes(v: ir.Value) -> int:
    """Size in bytes of a ranked tensor value (1 for anything else)."""
    t = v.type
    if not isinstance(t, ir.RankedTensorType):
        try:
            t = ir.RankedTensorType(t)
        except (ValueError, TypeError):
            return 1
    n = 1
    for s in t.shape:
        n *= max(s, 1)
    et = t.element_type
    width = getattr(et, "width", None)
    if width is None:
        try:
            width = ir.FloatType(et).width
        except (ValueError, TypeError):
            width = 8
    return n * max(1, width // 8)


def num_devices(module: ir.Module) -> int | None:
    """The module's ``mm.num_devices``, checked (None if absent)."""
    return read_num_devices(module)


def referenced_meshes(fn: ir.Operation, mesh_names: set[str]) -> list[str]:
    """Names of ``sdy.mesh`` symbols that shardings inside ``fn`` refer to (sorted).

    jax itself emits some constraints on meshes of its own (e.g. ``@empty_mesh``
    for PRNG keys); a fragment extracted into its own module must take those along.
    """
    if len(mesh_names) <= 1:
        return sorted(mesh_names)
    return scan_fragment(fn, mesh_names)[0]


_SHARDING_KEYS = ("sharding", "sdy.sharding", "in_shardings", "out_shardings",
                  "replica_groups")
"""Attributes that name meshes. ``replica_groups``: jax >= 0.12 writes a collective's
groups as mesh axes (``#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, ...>``)."""


def scan_fragment(fn: ir.Operation, mesh_names: set[str]) -> tuple[list[str],
                                                                     ir.Operation | None]:
    """One walk over ``fn``: the meshes its shardings name (see
    :func:`referenced_meshes`) and its first :data:`INTERNAL_SDY_OPS` op, if any."""
    scan = _FragmentScan(mesh_names)
    fn.walk(scan.visit, ir.WalkOrder.PRE_ORDER)
    if not scan.many:
        return sorted(mesh_names), scan.internal
    for key in ("arg_attrs", "res_attrs"):
        if key in fn.attributes:
            scan.names_in(fn.attributes[key])
    return sorted(scan.found), scan.internal


class _FragmentScan:
    """The state of one :func:`scan_fragment` walk (meshes are looked for only when
    there is more than one to tell apart)."""

    def __init__(self, mesh_names: set[str]):
        self.mesh_names = mesh_names
        self.many = len(mesh_names) > 1
        self.found: set[str] = set()
        self.internal: ir.Operation | None = None

    def names_in(self, attr: ir.Attribute) -> None:
        text = str(attr)
        for name in self.mesh_names:
            if f"@{name}," in text or f"@{name}>" in text or f"@{name} " in text:
                self.found.add(name)

    def visit(self, op):
        if self.many:
            attrs = op.attributes
            if len(attrs):
                for key in _SHARDING_KEYS:
                    if key in attrs:
                        self.names_in(attrs[key])
        if self.internal is None and op.name in INTERNAL_SDY_OPS:
            self.internal = op.operation
        return ir.WalkResult.ADVANCE


def top_finder(main: ir.Operation):
    """A function mapping any op nested in ``main`` to its top-level ancestor in ``main``.

    Returns None for ops outside ``main`` (e.g. already moved into a fragment).
    """
    def top(o) -> ir.Operation | None:
        o = o.operation
        while True:
            p = o.parent
            if p is None:
                return None
            if p == main:
                return o
            o = p.operation
    return top


INTERNAL_SDY_OPS = ("sdy.data_flow_edge",)
"""Shardy ops that only its own passes create (jax never emits them); running
``sdy-propagation-pipeline`` on a module that holds one can crash the process."""


def reject_internal_sdy_ops(root: ir.Operation, found: ir.Operation | None = None, *,
                            scanned: bool = False) -> None:
    """:class:`DiagnosticError` at the first :data:`INTERNAL_SDY_OPS` op under ``root``
    (with ``scanned``, a walk already looked: ``found`` is that op or None, e.g. from
    :func:`scan_fragment`)."""
    if not scanned:
        hits: list[ir.Operation] = []

        def cb(op):
            if op.name in INTERNAL_SDY_OPS:
                hits.append(op.operation)
                return ir.WalkResult.INTERRUPT
            return ir.WalkResult.ADVANCE

        root.walk(cb, ir.WalkOrder.PRE_ORDER)
        found = hits[0] if hits else None
    if found is not None:
        raise DiagnosticError(
            f"'{found.name}' is internal to Shardy propagation and must not appear in "
            f"the input", found.location)


def fragment_calls(main: ir.Operation) -> list[ir.Operation]:
    """The ``func.call`` ops at the top level of ``@main`` (MPMD form), in order."""
    return [o.operation for o in entry_block(main).operations if o.operation.name == "func.call"]


# ----------------------------------------------------------------------------- fragments


@dataclass(frozen=True)
class FragmentInfo:
    """What the MPMD-form passes read off a fragment function (docs/ir.md section 4)."""

    devices: tuple[int, ...]
    devices_attr: ir.Attribute
    """``mm.devices`` as written (copied onto transfers and nested modules)."""
    mesh: str | None
    """The ``sdy.mesh`` symbol named by ``mm.mesh`` (None when not asked for)."""
    tag: Tag | None


def fragment_info(fn: ir.Operation, meshes=None, *, need_task: bool = False) -> FragmentInfo:
    """Check and read a fragment's ``mm.devices``, ``mm.mesh`` (and ``mm.task``).

    ``meshes`` maps the module's ``sdy.mesh`` symbol names to their ``MeshAttr`` (or
    ``sdy.mesh`` op); ``mm.mesh`` must name one of them, over as many devices as
    ``mm.devices`` lists. With ``meshes=None`` only ``mm.devices`` is read (``mesh``
    is then None). Violations are a :class:`DiagnosticError` at the fragment.
    """
    loc = fn.location
    what = f"fragment '@{func_name(fn)}'"
    attrs = fn.attributes
    keys = (DEVICES_ATTR,) + ((MESH_ATTR,) if meshes is not None else ()) + (
        (TASK_ATTR,) if need_task else ())
    for key in keys:
        if key not in attrs:
            raise DiagnosticError(f"{what} is missing '{key}'", loc)
    devices = _int_list(attr_to_py(attrs[DEVICES_ATTR]), f"{what} '{DEVICES_ATTR}'", loc)
    if not devices:
        raise DiagnosticError(f"{what} '{DEVICES_ATTR}' must not be empty", loc)
    if (dup := _duplicate(devices)) is not None:
        raise DiagnosticError(
            f"{what} '{DEVICES_ATTR}' {_fmt(devices)} list device {dup} twice", loc)
    ta.read(devices, ta.list_of(ta.POSITION), f"{what} '{DEVICES_ATTR}'", loc)
    if meshes is None:
        return FragmentInfo(tuple(devices), attrs[DEVICES_ATTR], None, tag_of(fn))
    ref = attrs[MESH_ATTR]
    if not isinstance(ref, ir.FlatSymbolRefAttr):
        raise DiagnosticError(
            f"{what} '{MESH_ATTR}' must be a symbol reference to an sdy.mesh, got {ref}", loc)
    mesh = ir.FlatSymbolRefAttr(ref).value
    axes = _mesh_axes(meshes, mesh, f"{what} '{MESH_ATTR}'", loc)
    if prod(axes.values()) != len(devices):
        raise DiagnosticError(
            f"{what} '{MESH_ATTR}' @{mesh} has {prod(axes.values())} devices but '{DEVICES_ATTR}' "
            f"{_fmt(devices)} lists {len(devices)}", loc)
    return FragmentInfo(tuple(devices), attrs[DEVICES_ATTR], mesh, tag_of(fn))


def check_placement(devices: ir.Attribute, sharding: ir.Attribute, meshes, what: str,
                    loc) -> None:
    """Check an ``mm.devices`` / ``mm.sharding`` pair (where an ``@main`` argument lives).

    ``mm.sharding`` must be a ``#sdy.sharding`` on an ``sdy.mesh`` of the module (or an
    inline mesh) using only that mesh's axes, over as many devices as ``mm.devices``
    lists; Shardy's verifier does not look at ``mm.*`` attributes. ``meshes`` is as for
    :func:`fragment_info`. Violations are a :class:`DiagnosticError` at ``loc``.
    """
    devs = _int_list(attr_to_py(devices), f"{what} '{DEVICES_ATTR}'", loc)
    if not sdy.TensorShardingAttr.isinstance(sharding):
        raise DiagnosticError(f"{what} '{SHARDING_ATTR}' must be a #sdy.sharding, got {sharding}",
                              loc)
    ts = sdy.TensorShardingAttr(sharding)
    mesh = ts.mesh_or_ref
    if isinstance(mesh, ir.FlatSymbolRefAttr):
        name = f"@{mesh.value}"
        axes = _mesh_axes(meshes, mesh.value, f"{what} '{SHARDING_ATTR}'", loc)
    else:
        name = "its mesh"
        m = sdy.MeshAttr(mesh)
        axes = {sdy.MeshAxisAttr(a).name: sdy.MeshAxisAttr(a).size for a in m.axes}
    for d in ts.dimension_shardings:
        for a in sdy.DimensionShardingAttr(d).axes:
            axis = sdy.AxisRefAttr(a).name
            if axis not in axes:
                raise DiagnosticError(
                    f"{what} '{SHARDING_ATTR}' uses axis \"{axis}\", which is not an axis of "
                    f"{name}", loc)
    if prod(axes.values()) != len(devs):
        raise DiagnosticError(
            f"{what} '{SHARDING_ATTR}' is on {name} of {prod(axes.values())} devices but "
            f"'{DEVICES_ATTR}' {_fmt(devs)} lists {len(devs)}", loc)


def _mesh_axes(meshes, name: str, what: str, loc) -> dict[str, int]:
    """Axis sizes of the ``sdy.mesh`` ``@name`` (``meshes`` as for :func:`fragment_info`)."""
    if name not in meshes:
        raise DiagnosticError(f"{what} names @{name}, which is not an sdy.mesh of the module",
                              loc)
    m = meshes[name]
    if isinstance(m, ir.OpView | ir.Operation):
        m = m.operation.attributes["mesh"]
    m = sdy.MeshAttr(m)
    return {sdy.MeshAxisAttr(a).name: sdy.MeshAxisAttr(a).size for a in m.axes}


