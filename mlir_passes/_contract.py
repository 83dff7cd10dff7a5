"""Shared readers/writers for the ``mm.*`` IR contract (docs/ir.md).

Passes use these instead of poking attributes directly, so the contract is
spelled in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from multimesh._src import ir_attrs as ta
from multimesh._src.caches import WeakKeyCache
from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import custom_call_target
from multimesh._src.mlir import attr_to_py, dict_attr, ir, py_to_attr, sdy

TASK_ATTR = "mm.task"
TASKS_ATTR = "mm.tasks"
LOGICAL_TARGET = "mm.logical_sharding"
TRANSFER_TARGET = "mm.transfer"
FRAGMENT_CALL_TARGET = "mm.fragment_call"
DEFAULT_TASK = "mm.default"

# Microbatch loops (docs/ir.md "Microbatch loops").
MICROBATCH_ATTR = "mm.microbatch"
"""``{loop = 0, num_microbatches = M}`` on the front end's loop-body call and sum markers."""
LOOP_ATTR = "mm.loop"
"""Loop id on an in-loop op that has no task yet (flat form); tagged ops carry it in the tag."""
INDEX_TARGET = "mm.microbatch_index"
"""The microbatch index (``tensor<i32>``) inside the loop body."""
SUM_TARGET = "mm.microbatch_sum"
"""The sum over all microbatches of an in-loop value (an op after the loop)."""
LOOP_TARGET = "mm.microbatch_loop"
"""MPMD form: the loop itself, a custom call whose body is the function ``mm.body``."""
BODY_ATTR = "mm.body"
NUM_MICROBATCHES_ATTR = "mm.num_microbatches"
LOOP_DEVICES_ATTR = "mm.loop_devices"
"""On a fragment whose task moves with the microbatch: its device positions per microbatch."""

# The keys of the task dictionaries (docs/ir.md), in the order messages list them.
TAG_KEYS = ("name", "transpose_count", "loop")
"""``mm.task`` on an op of a task (flat form): ``{name, transpose_count[, loop]}``."""
MESH_KEYS = ("devices", "axis_names", "axis_sizes", "logical_axes")
TASK_ENTRY_KEYS = (*MESH_KEYS, "split_backprop", "loop_devices", "forward")
"""An ``mm.tasks`` entry."""
TASK_CALL_KEYS = (*TAG_KEYS, "split_backprop", "loop_devices", *MESH_KEYS)
"""``mm.task`` on a task call (front-end form): the tag and the task's mesh."""


@dataclass(frozen=True)
class TaskMeshInfo:
    """A task's submesh and logical mapping, as stored in ``mm.tasks``."""

    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    logical_axes: tuple[tuple[str, str], ...]
    split_backprop: tuple[str, str] | None = None
    """``Task.split_backprop``: name suffixes of the activation and weight halves."""
    loop_devices: tuple[tuple[int, ...], ...] | None = None
    """``Task.loop_dependent_mesh_slice``: the device positions in each microbatch."""
    forward: str | None = None
    """For a backward task named apart from its forward (a registered task's callback
    returning ``layer0_bwd`` for the backward of ``layer0_fwd``): the forward's name."""

    @classmethod
    def from_dict(cls, d, loc: ir.Location | None = None,
                  what: str = f"'{TASK_ATTR}'",
                  keys: tuple[str, ...] | None = None) -> TaskMeshInfo:
        """Read a task mesh (``attr_to_py`` of an ``mm.task`` / ``mm.tasks`` entry).

        Checks it as ``mm-verify`` does (keys present and typed, positive axis sizes
        that multiply to the device count, logical axes as string pairs) and raises
        :class:`DiagnosticError` at ``loc`` on the first violation; ``what`` names the
        attribute in the message. With ``keys`` (``mm-verify``'s strict reading) a key
        outside ``keys`` is an error, and so is a logical axis mapped to a device axis
        the task lacks (passes leave that to ``mm-resolve-logical-shardings``, which
        reports it at the marker that uses it).
        """
        d = _check_dict(d, what, loc)
        if keys is not None:
            check_keys(d, keys, what, loc)
        for key in ("devices", "axis_names", "axis_sizes"):
            if key not in d:
                raise DiagnosticError(f"{what} is missing '{key}'", loc)
        devices = _int_list(d["devices"], f"{what} devices", loc)
        names = _str_list(d["axis_names"], f"{what} axis_names", loc)
        sizes = _int_list(d["axis_sizes"], f"{what} axis_sizes", loc)
        check_mesh(devices, names, sizes, what, loc)
        info = cls(tuple(devices), tuple(names), tuple(sizes),
                   _logical_axes(d.get("logical_axes", []), what, loc),
                   _split_backprop(d.get("split_backprop"), what, loc),
                   _loop_devices(d.get("loop_devices"), len(devices), what, loc),
                   _forward(d.get("forward"), what, loc))
        if keys is not None:
            info.check_device_axes(what, loc)
        return info

    def check_device_axes(self, what: str, loc) -> None:
        """Every logical axis maps to one of the task's device axes."""
        for logical, axis in self.logical_axes:
            if axis not in self.axis_names:
                raise DiagnosticError(
                    f"{what} logical axis \"{logical}\" maps to device axis \"{axis}\" "
                    f"which is not in axis_names {_fmt(list(self.axis_names))}", loc)

    def mesh_text(self) -> str:
        """``devices=[...], axis_names=[...], ...``: the mesh as messages show it."""
        d = self.to_dict()
        return ", ".join(f"{k}={_fmt(d[k])}" for k in MESH_KEYS)

    def to_dict(self) -> dict:
        d = {"devices": list(self.devices), "axis_names": list(self.axis_names),
             "axis_sizes": list(self.axis_sizes),
             "logical_axes": [list(p) for p in self.logical_axes]}
        if self.split_backprop:
            d["split_backprop"] = list(self.split_backprop)
        if self.loop_devices:
            d["loop_devices"] = [list(r) for r in self.loop_devices]
        if self.forward:
            d["forward"] = self.forward
        return d

    def mesh_key(self) -> tuple:
        return (self.devices, self.axis_names, self.axis_sizes)


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


def read_tasks(module: ir.Module, *, strict: bool = False) -> dict[str, TaskMeshInfo]:
    """The module's ``mm.tasks`` table, checked (:class:`DiagnosticError` at the module).

    ``strict``: ``mm-verify``'s reading (see :meth:`TaskMeshInfo.from_dict`'s ``keys``).
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
        out[k] = TaskMeshInfo.from_dict(v, loc, f"'{TASKS_ATTR}' entry \"{k}\"", keys)
    return out


def write_tasks(module: ir.Module, tasks: dict[str, TaskMeshInfo]) -> None:
    with module.context:
        module.operation.attributes[TASKS_ATTR] = dict_attr(
            {k: tasks[k].to_dict() for k in sorted(tasks)})


Tag = tuple[str, int, int]
"""``(task name, transpose_count, loop)``; loop is the microbatch loop's id, -1 outside."""


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


def task_call(call: ir.Operation, *, strict: bool = False) -> tuple[Tag, TaskMeshInfo | None]:
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
    return tag, TaskMeshInfo.from_dict(d, loc, what, TASK_CALL_KEYS if strict else None)


def is_task_reference(op: ir.Operation) -> bool:
    """Whether ``op``'s ``mm.task`` is a flat-form tag (only :data:`TAG_KEYS`), not a
    task call's full entry."""
    a = op.attributes[TASK_ATTR]
    if not isinstance(a, ir.DictAttr):
        return False
    d = ir.DictAttr(a)
    return all(d[i].name in TAG_KEYS for i in range(len(d)))


def task_reference(op: ir.Operation, tasks: dict[str, TaskMeshInfo] | None) -> Tag:
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


def known_task(op: ir.Operation, tasks: dict[str, TaskMeshInfo]) -> TaskMeshInfo:
    """The ``mm.tasks`` entry of a tagged op's task (:class:`DiagnosticError` if none)."""
    tag = tag_of(op)
    if tag is None:
        raise DiagnosticError("op is not assigned to a task", op.location)
    return _known(op, tag[0], tasks)


def _known(op: ir.Operation, name: str, tasks: dict[str, TaskMeshInfo]) -> TaskMeshInfo:
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
    if "mm.axes" not in op.attributes:
        raise DiagnosticError(f"{what} is missing 'mm.axes'", loc)
    a = op.attributes["mm.axes"]
    if not isinstance(a, ir.ArrayAttr):
        raise DiagnosticError(f"{what} 'mm.axes' must be a list of lists of strings, got {a}",
                              loc)
    dims = attr_to_py(a)
    t = op.operands[0].type
    if isinstance(t, ir.ShapedType) and ir.ShapedType(t).has_rank \
            and len(dims) != ir.ShapedType(t).rank:
        raise DiagnosticError(
            f"{what} 'mm.axes' has {len(dims)} entries but the operand {t} has rank "
            f"{ir.ShapedType(t).rank}", loc)
    used: dict[str, int] = {}
    for i, dim in enumerate(dims):
        for n in _str_list(dim, f"{what} 'mm.axes' entry {i}", loc):
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
    import warnings

    from multimesh._src.errors import DiagnosticWarning

    warnings.warn(DiagnosticWarning(message, location), stacklevel=2)


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
    return ta.read_attr(module.operation, "mm.num_devices", DEVICE_COUNT, "'mm.num_devices'",
                       default=None)


DEVICE_COUNT = ta.int_in(1, ta.MAX_DEVICES, ("a device count", "device counts"))


def referenced_meshes(fn: ir.Operation, mesh_names: set[str]) -> list[str]:
    """Names of ``sdy.mesh`` symbols that shardings inside ``fn`` refer to (sorted).

    jax itself emits some constraints on meshes of its own (e.g. ``@empty_mesh``
    for PRNG keys); a fragment extracted into its own module must take those along.
    """
    if len(mesh_names) <= 1:
        return sorted(mesh_names)
    return scan_fragment(fn, mesh_names)[0]


_SHARDING_KEYS = ("sharding", "sdy.sharding", "in_shardings", "out_shardings")


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
    keys = ("mm.devices",) + (("mm.mesh",) if meshes is not None else ()) + (
        (TASK_ATTR,) if need_task else ())
    for key in keys:
        if key not in attrs:
            raise DiagnosticError(f"{what} is missing '{key}'", loc)
    devices = _int_list(attr_to_py(attrs["mm.devices"]), f"{what} 'mm.devices'", loc)
    if not devices:
        raise DiagnosticError(f"{what} 'mm.devices' must not be empty", loc)
    if (dup := _duplicate(devices)) is not None:
        raise DiagnosticError(
            f"{what} 'mm.devices' {_fmt(devices)} list device {dup} twice", loc)
    ta.read(devices, ta.list_of(ta.POSITION), f"{what} 'mm.devices'", loc)
    if meshes is None:
        return FragmentInfo(tuple(devices), attrs["mm.devices"], None, tag_of(fn))
    ref = attrs["mm.mesh"]
    if not isinstance(ref, ir.FlatSymbolRefAttr):
        raise DiagnosticError(
            f"{what} 'mm.mesh' must be a symbol reference to an sdy.mesh, got {ref}", loc)
    mesh = ir.FlatSymbolRefAttr(ref).value
    axes = _mesh_axes(meshes, mesh, f"{what} 'mm.mesh'", loc)
    if prod(axes.values()) != len(devices):
        raise DiagnosticError(
            f"{what} 'mm.mesh' @{mesh} has {prod(axes.values())} devices but 'mm.devices' "
            f"{_fmt(devices)} lists {len(devices)}", loc)
    return FragmentInfo(tuple(devices), attrs["mm.devices"], mesh, tag_of(fn))


def check_placement(devices: ir.Attribute, sharding: ir.Attribute, meshes, what: str,
                    loc) -> None:
    """Check an ``mm.devices`` / ``mm.sharding`` pair (where an ``@main`` argument lives).

    ``mm.sharding`` must be a ``#sdy.sharding`` on an ``sdy.mesh`` of the module (or an
    inline mesh) using only that mesh's axes, over as many devices as ``mm.devices``
    lists; Shardy's verifier does not look at ``mm.*`` attributes. ``meshes`` is as for
    :func:`fragment_info`. Violations are a :class:`DiagnosticError` at ``loc``.
    """
    devs = _int_list(attr_to_py(devices), f"{what} 'mm.devices'", loc)
    if not sdy.TensorShardingAttr.isinstance(sharding):
        raise DiagnosticError(f"{what} 'mm.sharding' must be a #sdy.sharding, got {sharding}",
                              loc)
    ts = sdy.TensorShardingAttr(sharding)
    mesh = ts.mesh_or_ref
    if isinstance(mesh, ir.FlatSymbolRefAttr):
        name = f"@{mesh.value}"
        axes = _mesh_axes(meshes, mesh.value, f"{what} 'mm.sharding'", loc)
    else:
        name = "its mesh"
        m = sdy.MeshAttr(mesh)
        axes = {sdy.MeshAxisAttr(a).name: sdy.MeshAxisAttr(a).size for a in m.axes}
    for d in ts.dimension_shardings:
        for a in sdy.DimensionShardingAttr(d).axes:
            axis = sdy.AxisRefAttr(a).name
            if axis not in axes:
                raise DiagnosticError(
                    f"{what} 'mm.sharding' uses axis \"{axis}\", which is not an axis of "
                    f"{name}", loc)
    if prod(axes.values()) != len(devs):
        raise DiagnosticError(
            f"{what} 'mm.sharding' is on {name} of {prod(axes.values())} devices but "
            f"'mm.devices' {_fmt(devs)} lists {len(devs)}", loc)


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


# ----------------------------------------------------------------------------- checking
# On ``attr_to_py`` values; the messages follow mm-verify's (mlir_passes/verify.py).


def _fmt(v) -> str:
    return ta.show(v)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_dict(d, what: str, loc) -> dict:
    if not isinstance(d, dict):
        raise DiagnosticError(f"{what} must be a dictionary attribute, got {_fmt(d)}", loc)
    return d


def _list(v, what: str, of: str, loc) -> list:
    if not isinstance(v, list):
        raise DiagnosticError(f"{what} must be a list of {of}, got {_fmt(v)}", loc)
    return v


def _int_list(v, what: str, loc) -> list[int]:
    if not all(_is_int(x) for x in _list(v, what, "integers", loc)):
        raise DiagnosticError(f"{what} must be a list of integers, got {_fmt(v)}", loc)
    return v


def _str_list(v, what: str, loc) -> list[str]:
    if not all(isinstance(x, str) for x in _list(v, what, "strings", loc)):
        raise DiagnosticError(f"{what} must be a list of strings, got {_fmt(v)}", loc)
    return v


def check_keys(d: dict, allowed: tuple[str, ...], what: str, loc) -> None:
    """Every key of ``d`` is one of ``allowed`` (``mm-verify``'s strict reading)."""
    for key in d:
        if key not in allowed:
            raise DiagnosticError(
                f"{what} has unknown key '{key}' (expected {', '.join(allowed)})", loc)


def _logical_axes(v, what: str, loc) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in _list(v, f"{what} logical_axes", "pairs", loc):
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(x, str) for x in item)):
            raise DiagnosticError(
                f"{what} logical_axes entries must be [logical, device] string pairs, "
                f"got {_fmt(item)}", loc)
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def _split_backprop(v, what: str, loc) -> tuple[str, str] | None:
    if v is None or v == []:
        return None
    if not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, str) and x for x in v):
        raise DiagnosticError(
            f"{what} split_backprop must be two non-empty name suffixes, got {_fmt(v)}", loc)
    return v[0], v[1]


def _loop_devices(v, count: int, what: str, loc) -> tuple[tuple[int, ...], ...] | None:
    if v is None:
        return None
    rows = []
    for row in _list(v, f"{what} loop_devices", "device lists", loc):
        row = ta.read(row, ta.list_of(ta.POSITION), f"{what} loop_devices entry", loc)
        if len(row) != count or len(set(row)) != len(row) or min(row) < 0:
            raise DiagnosticError(
                f"{what} loop_devices entries must list {count} distinct "
                f"non-negative device positions (as many as devices), got {_fmt(row)}", loc)
        rows.append(tuple(row))
    return tuple(rows) or None


def _forward(v, what: str, loc) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise DiagnosticError(f"{what} forward must be a task name, got {_fmt(v)}", loc)
    return v


def check_mesh(devices: list[int], names: list[str], sizes: list[int], what: str,
               loc) -> None:
    """The rules of a task mesh (shared by every pass and ``mm-verify``)."""
    if not devices:
        raise DiagnosticError(f"{what} devices must not be empty", loc)
    if (dup := _duplicate(devices)) is not None:
        raise DiagnosticError(f"{what} devices {_fmt(devices)} list device {dup} twice", loc)
    ta.read(devices, ta.list_of(ta.POSITION), f"{what} devices", loc)
    if (dup := _duplicate(names)) is not None:
        raise DiagnosticError(f"{what} axis_names {_fmt(names)} name axis \"{dup}\" twice", loc)
    if len(sizes) != len(names):
        raise DiagnosticError(
            f"{what} has {len(names)} axis_names {_fmt(names)} but {len(sizes)} "
            f"axis_sizes {_fmt(sizes)}", loc)
    if (bad := [s for s in sizes if s <= 0]):
        raise DiagnosticError(
            f"{what} axis_sizes {_fmt(sizes)} must be positive, got {bad[0]}", loc)
    if (bad := [s for s in sizes if s > ta.MAX_DEVICES]):
        raise DiagnosticError(
            f"{what} axis_sizes {_fmt(sizes)} must be at most {ta.MAX_DEVICES} (MAX_DEVICES), "
            f"got {bad[0]}", loc)
    if prod(sizes) != len(devices):
        raise DiagnosticError(
            f"{what} axis_sizes {_fmt(sizes)} multiply to {prod(sizes)} but devices has "
            f"{len(devices)} entries", loc)


def _duplicate(values: list):
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


def _tag_from_dict(d: dict, what: str, loc) -> Tag:
    for key in ("name", "transpose_count"):
        if key not in d:
            raise DiagnosticError(f"{what} is missing '{key}'", loc)
    name, count, mb = d["name"], d["transpose_count"], d.get("loop", -1)
    if not isinstance(name, str):
        raise DiagnosticError(f"{what} name must be a string, got {_fmt(name)}", loc)
    if not name:
        raise DiagnosticError(f"{what} name must not be empty", loc)
    if not _is_int(count):
        raise DiagnosticError(
            f"{what} transpose_count must be an integer, got {_fmt(count)}", loc)
    if count < 0:
        raise DiagnosticError(f"{what} transpose_count must be >= 0, got {count}", loc)
    ta.read(count, TRANSPOSE_COUNT, f"{what} transpose_count", loc)
    if not _is_int(mb) or not -1 <= mb <= MAX_ID:
        raise DiagnosticError(
            f"{what} loop must be a microbatch loop id (an integer in 0..{MAX_ID}), got "
            f"{_fmt(mb)}", loc)
    return name, count, mb


MAX_ID = (1 << 31) - 1
"""The largest transpose count or loop id (they are written back as 64-bit integers)."""
TRANSPOSE_COUNT = ta.int_in(0, MAX_ID, ("a transpose count", "transpose counts"))
