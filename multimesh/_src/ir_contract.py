"""The IR contract between the layers (docs/ir.md), spelled once, at the bottom.

Every ``mm.*`` attribute, op and custom-call name the library writes or reads is a
constant here; no other module spells one (``tests/test_ir_contract.py``). The front end
writes the IR with these names and records, the passes read and rewrite it (their
diagnostic-rich helpers live on top, in ``multimesh.passes._contract``), and the runtime
reads the MPMD form with the readers at the end of this module, checked: a malformed
module is an :class:`IRContractError` naming the attribute, not a ``KeyError``.

One record describes a task's mesh, :class:`MeshRecord`, read and written by every layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from math import prod

from multimesh._src import ir_attrs as ta
from multimesh._src.errors import DiagnosticError, IRContractError
from multimesh._src.mlir import attr_to_py, ir, py_to_attr, sdy

PREFIX = "mm."
"""Every name of the contract starts with it (``mm-extract-fragments`` and the runtime
strip attributes by it)."""

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

# Module attributes.
NUM_DEVICES_ATTR = "mm.num_devices"
"""The program's device count (``mjit`` writes it; the runtime plans on it)."""
SCHEDULE_CONFIG_ATTR = "mm.schedule_config"
"""``microbatch``'s schedule options, for ``mm-schedule-fragments``."""
MESHES_ATTR = "mm.meshes"
"""``mm-import-mpmd``: the Shardy:MPMD topology's meshes, by name."""

# Fragments, transfers and ``@main`` arguments (MPMD form, docs/ir.md section 4).
DEVICES_ATTR = "mm.devices"
"""Device positions of a fragment, a transfer's destination or an ``@main`` argument."""
SHARDING_ATTR = "mm.sharding"
"""The ``#sdy.sharding`` of a transfer's destination or an ``@main`` argument."""
MESH_ATTR = "mm.mesh"
"""The ``sdy.mesh`` symbol a fragment runs on."""
FRAGMENT_ATTR = "mm.fragment"
"""The fragment (nested module) an ``mm.fragment_call`` runs."""
SPLIT_ATTR = "mm.split"
"""``mm-split-backward``'s half of a backward fragment (``activation`` / ``weight``)."""
SCHEDULE_ATTR = "mm.schedule"
"""The recorded dispatch order of a microbatch loop (``{name, order}``)."""
DONOR_ATTR = "jax.buffer_donor"
"""jax's argument attribute of a buffer a fragment may reuse for an output (a running
sum's accumulator)."""

# Markers of the front end.
AXES_ATTR = "mm.axes"
"""The logical axis names per dimension on an ``mm.logical_sharding`` marker."""
CALLBACK_KEY = "mm.callback"
"""multimesh's host-callback number, beside jax's index in ``mhlo.backend_config``."""


@dataclass(frozen=True)
class MeshRecord:
    """A task's submesh and logical mapping: an ``mm.tasks`` entry, and the mesh half of
    a task call's ``mm.task``. One record for the front end (its task call record
    extends it), the passes and the runtime. Not the public ``multimesh.jax.TaskMesh``
    (what a user writes, checked and resolved against the program's mesh), which the
    front end turns into this record when it binds a task."""

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
                  keys: tuple[str, ...] | None = None) -> MeshRecord:
        """Read a task mesh (``attr_to_py`` of an ``mm.task`` / ``mm.tasks`` entry).

        Checks it as ``mm-verify`` does (keys present and typed, positive axis sizes
        that multiply to the device count, logical axes as string pairs) and raises
        :class:`DiagnosticError` at ``loc`` on the first violation; ``what`` names the
        attribute in the message. With ``keys`` (``mm-verify``'s strict reading) a key
        outside ``keys`` is an error, and so is a logical axis mapped to a device axis
        the task lacks (passes leave that to ``mm-resolve-logical-shardings``, which
        reports it at the marker that uses it).
        """
        d = check_dict(d, what, loc)
        if keys is not None:
            check_keys(d, keys, what, loc)
        for key in ("devices", "axis_names", "axis_sizes"):
            if key not in d:
                raise DiagnosticError(f"{what} is missing '{key}'", loc)
        devices = int_list(d["devices"], f"{what} devices", loc)
        names = str_list(d["axis_names"], f"{what} axis_names", loc)
        sizes = int_list(d["axis_sizes"], f"{what} axis_sizes", loc)
        check_mesh(devices, names, sizes, what, loc)
        info = cls(tuple(devices), tuple(names), tuple(sizes),
                   logical_axes_value(d.get("logical_axes", []), what, loc),
                   split_backprop_value(d.get("split_backprop"), what, loc),
                   loop_devices_value(d.get("loop_devices"), len(devices), what, loc),
                   forward_value(d.get("forward"), what, loc))
        if keys is not None:
            info.check_device_axes(what, loc)
        return info

    def check_device_axes(self, what: str, loc) -> None:
        """Every logical axis maps to one of the task's device axes."""
        for logical, axis in self.logical_axes:
            if axis not in self.axis_names:
                raise DiagnosticError(
                    f"{what} logical axis \"{logical}\" maps to device axis \"{axis}\" "
                    f"which is not in axis_names {fmt(list(self.axis_names))}", loc)

    def mesh_text(self) -> str:
        """``devices=[...], axis_names=[...], ...``: the mesh as messages show it."""
        d = self.to_dict()
        return ", ".join(f"{k}={fmt(d[k])}" for k in MESH_KEYS)

    def to_dict(self) -> dict:
        d = {"devices": [int(x) for x in self.devices], "axis_names": list(self.axis_names),
             "axis_sizes": [int(x) for x in self.axis_sizes],
             "logical_axes": [list(p) for p in self.logical_axes]}
        if self.split_backprop:
            d["split_backprop"] = list(self.split_backprop)
        if self.loop_devices:
            d["loop_devices"] = [[int(x) for x in r] for r in self.loop_devices]
        if self.forward:
            d["forward"] = self.forward
        return d

    def mesh_key(self) -> tuple:
        return (self.devices, self.axis_names, self.axis_sizes)

    def to_attr(self) -> ir.Attribute:
        """The entry as an attribute (an ``mm.tasks`` value)."""
        return py_to_attr(self.to_dict())

    @classmethod
    def from_attr(cls, attr: ir.Attribute, loc: ir.Location | None = None,
                  what: str = f"'{TASK_ATTR}'") -> MeshRecord:
        """Read and check an ``mm.tasks`` entry or a task call's ``mm.task``."""
        return cls.from_dict(attr_to_py(attr), loc, what)


Tag = tuple[str, int, int]
"""``(task name, transpose_count, loop)``; loop is the microbatch loop's id, -1 outside."""


# ----------------------------------------------------------------------------- checking
# On ``attr_to_py`` values; the messages follow mm-verify's (multimesh/passes/verify.py).


def fmt(v) -> str:
    return ta.show(v)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_dict(d, what: str, loc) -> dict:
    if not isinstance(d, dict):
        raise DiagnosticError(f"{what} must be a dictionary attribute, got {fmt(d)}", loc)
    return d


def list_value(v, what: str, of: str, loc) -> list:
    if not isinstance(v, list):
        raise DiagnosticError(f"{what} must be a list of {of}, got {fmt(v)}", loc)
    return v


def int_list(v, what: str, loc) -> list[int]:
    if not all(is_int(x) for x in list_value(v, what, "integers", loc)):
        raise DiagnosticError(f"{what} must be a list of integers, got {fmt(v)}", loc)
    return v


def str_list(v, what: str, loc) -> list[str]:
    if not all(isinstance(x, str) for x in list_value(v, what, "strings", loc)):
        raise DiagnosticError(f"{what} must be a list of strings, got {fmt(v)}", loc)
    return v


def check_keys(d: dict, allowed: tuple[str, ...], what: str, loc) -> None:
    """Every key of ``d`` is one of ``allowed`` (``mm-verify``'s strict reading)."""
    for key in d:
        if key not in allowed:
            raise DiagnosticError(
                f"{what} has unknown key '{key}' (expected {', '.join(allowed)})", loc)


def logical_axes_value(v, what: str, loc) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in list_value(v, f"{what} logical_axes", "pairs", loc):
        if (not isinstance(item, list) or len(item) != 2
                or not all(isinstance(x, str) for x in item)):
            raise DiagnosticError(
                f"{what} logical_axes entries must be [logical, device] string pairs, "
                f"got {fmt(item)}", loc)
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def split_backprop_value(v, what: str, loc) -> tuple[str, str] | None:
    if v is None or v == []:
        return None
    if not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, str) and x for x in v):
        raise DiagnosticError(
            f"{what} split_backprop must be two non-empty name suffixes, got {fmt(v)}", loc)
    return v[0], v[1]


def loop_devices_value(v, count: int, what: str, loc) -> tuple[tuple[int, ...], ...] | None:
    if v is None:
        return None
    rows = []
    for row in list_value(v, f"{what} loop_devices", "device lists", loc):
        row = ta.read(row, ta.list_of(ta.POSITION), f"{what} loop_devices entry", loc)
        if len(row) != count or len(set(row)) != len(row) or min(row) < 0:
            raise DiagnosticError(
                f"{what} loop_devices entries must list {count} distinct "
                f"non-negative device positions (as many as devices), got {fmt(row)}", loc)
        rows.append(tuple(row))
    return tuple(rows) or None


def forward_value(v, what: str, loc) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise DiagnosticError(f"{what} forward must be a task name, got {fmt(v)}", loc)
    return v


def check_mesh(devices: list[int], names: list[str], sizes: list[int], what: str,
               loc) -> None:
    """The rules of a task mesh (shared by every pass and ``mm-verify``)."""
    if not devices:
        raise DiagnosticError(f"{what} devices must not be empty", loc)
    if (dup := duplicate(devices)) is not None:
        raise DiagnosticError(f"{what} devices {fmt(devices)} list device {dup} twice", loc)
    ta.read(devices, ta.list_of(ta.POSITION), f"{what} devices", loc)
    if (dup := duplicate(names)) is not None:
        raise DiagnosticError(f"{what} axis_names {fmt(names)} name axis \"{dup}\" twice", loc)
    if len(sizes) != len(names):
        raise DiagnosticError(
            f"{what} has {len(names)} axis_names {fmt(names)} but {len(sizes)} "
            f"axis_sizes {fmt(sizes)}", loc)
    if (bad := [s for s in sizes if s <= 0]):
        raise DiagnosticError(
            f"{what} axis_sizes {fmt(sizes)} must be positive, got {bad[0]}", loc)
    if (bad := [s for s in sizes if s > ta.MAX_DEVICES]):
        raise DiagnosticError(
            f"{what} axis_sizes {fmt(sizes)} must be at most {ta.MAX_DEVICES} (MAX_DEVICES), "
            f"got {bad[0]}", loc)
    if prod(sizes) != len(devices):
        raise DiagnosticError(
            f"{what} axis_sizes {fmt(sizes)} multiply to {prod(sizes)} but devices has "
            f"{len(devices)} entries", loc)


def duplicate(values: list):
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


def tag_from_dict(d: dict, what: str, loc) -> Tag:
    for key in ("name", "transpose_count"):
        if key not in d:
            raise DiagnosticError(f"{what} is missing '{key}'", loc)
    name, count, mb = d["name"], d["transpose_count"], d.get("loop", -1)
    if not isinstance(name, str):
        raise DiagnosticError(f"{what} name must be a string, got {fmt(name)}", loc)
    if not name:
        raise DiagnosticError(f"{what} name must not be empty", loc)
    if not is_int(count):
        raise DiagnosticError(
            f"{what} transpose_count must be an integer, got {fmt(count)}", loc)
    if count < 0:
        raise DiagnosticError(f"{what} transpose_count must be >= 0, got {count}", loc)
    ta.read(count, TRANSPOSE_COUNT, f"{what} transpose_count", loc)
    if not is_int(mb) or not -1 <= mb <= MAX_ID:
        raise DiagnosticError(
            f"{what} loop must be a microbatch loop id (an integer in 0..{MAX_ID}), got "
            f"{fmt(mb)}", loc)
    return name, count, mb


MAX_ID = (1 << 31) - 1
"""The largest transpose count or loop id (they are written back as 64-bit integers)."""
TRANSPOSE_COUNT = ta.int_in(0, MAX_ID, ("a transpose count", "transpose counts"))


# ----------------------------------------------------------------------------- MPMD readers
# What the runtime reads off the MPMD form, checked, in the user's voice.


def _need(op: ir.Operation, name: str, what: str) -> ir.Attribute:
    if name not in op.attributes:
        raise IRContractError(
            f"The {what} has no '{name}' attribute; in MPMD form every one carries it "
            f"(docs/ir.md, section 4). Give the runtime a module the whole pass pipeline "
            f"produced (mm-extract-fragments last), or add the attribute.",
            op.location)
    return op.attributes[name]


def read_num_devices(module: ir.Module, default: int | None = None) -> int | None:
    """The module's ``mm.num_devices`` (``default`` when absent), checked."""
    return ta.read_attr(module.operation, NUM_DEVICES_ATTR, DEVICE_COUNT,
                        f"'{NUM_DEVICES_ATTR}'", default=default)


DEVICE_COUNT = ta.int_in(1, ta.MAX_DEVICES, ("a device count", "device counts"))


def read_placement(op: ir.Operation, what: str) -> tuple[ir.Attribute, ir.Attribute]:
    """The ``mm.devices`` and ``mm.sharding`` of a transfer, checked present."""
    return _need(op, DEVICES_ATTR, what), _need(op, SHARDING_ATTR, what)


def read_callee(call: ir.Operation) -> str:
    """The fragment an ``mm.fragment_call`` runs (its ``mm.fragment``), checked."""
    a = _need(call, FRAGMENT_ATTR, f"'{FRAGMENT_CALL_TARGET}'")
    if not isinstance(a, ir.FlatSymbolRefAttr):
        raise IRContractError(
            f"'{FRAGMENT_ATTR}' on '{FRAGMENT_CALL_TARGET}' must be a symbol reference to "
            f"a nested module, got {a}.", call.location)
    return ir.FlatSymbolRefAttr(a).value


@dataclass(frozen=True)
class FragmentHeader:
    """What the runtime reads off a fragment's nested module."""

    task: str
    transpose_count: int
    devices: tuple[int, ...]
    loop_devices: tuple[tuple[int, ...], ...] | None


def read_fragment_header(sub: ir.Operation, name: str) -> FragmentHeader:
    """The task tag, devices and per-microbatch devices of the fragment module ``@name``,
    checked (an :class:`IRContractError` at the module otherwise)."""
    what, loc = f"fragment module '@{name}'", sub.location
    tag_d = attr_to_py(_need(sub, TASK_ATTR, what))
    tag = tag_from_dict(check_dict(tag_d, f"{what} '{TASK_ATTR}'", loc),
                        f"{what} '{TASK_ATTR}'", loc)
    devices = int_list(attr_to_py(_need(sub, DEVICES_ATTR, what)),
                       f"{what} '{DEVICES_ATTR}'", loc)
    ta.read(devices, ta.list_of(ta.POSITION, non_empty=True), f"{what} '{DEVICES_ATTR}'", loc)
    loop = None
    if LOOP_DEVICES_ATTR in sub.attributes:
        loop = loop_devices_value(attr_to_py(sub.attributes[LOOP_DEVICES_ATTR]),
                                  len(devices), f"{what} '{LOOP_DEVICES_ATTR}'", loc)
    return FragmentHeader(tag[0], tag[1], tuple(devices), loop)


@dataclass(frozen=True)
class LoopHeader:
    """What the runtime reads off an ``mm.microbatch_loop``."""

    body: str
    num_microbatches: int
    schedule_name: str | None
    order: tuple[tuple[int, int], ...] | None
    """(body call, microbatch) pairs in dispatch order, from ``mm.schedule``."""


def read_loop_header(loop: ir.Operation) -> LoopHeader:
    """The body, microbatch count and recorded schedule of a loop, checked."""
    what, loc = f"'{LOOP_TARGET}'", loop.location
    body = _need(loop, BODY_ATTR, what)
    if not isinstance(body, ir.FlatSymbolRefAttr):
        raise IRContractError(f"{what} needs '{BODY_ATTR}', a symbol reference to its body "
                              f"function, got {body}.", loc)
    _need(loop, NUM_MICROBATCHES_ATTR, what)
    num = ta.read_attr(loop, NUM_MICROBATCHES_ATTR, ta.MICROBATCHES,
                       f"'{NUM_MICROBATCHES_ATTR}' on {what}")
    name = order = None
    if SCHEDULE_ATTR in loop.attributes:
        sched = loop.attributes[SCHEDULE_ATTR]
        if not isinstance(sched, ir.DictAttr) or "order" not in sched or not isinstance(
                ir.DictAttr(sched)["order"], ir.DenseI64ArrayAttr):
            raise IRContractError(
                f"'{SCHEDULE_ATTR}' on {what} must be a dictionary with 'order', an "
                f"array<i64> of (call, microbatch) pairs, got {sched}.", loc)
        pairs = list(ir.DenseI64ArrayAttr(ir.DictAttr(sched)["order"]))
        order = tuple((pairs[2 * j], pairs[2 * j + 1]) for j in range(len(pairs) // 2))
        n = attr_to_py(sched).get("name")
        name = n if isinstance(n, str) else None
    return LoopHeader(ir.FlatSymbolRefAttr(body).value, num, name, order)


# ----------------------------------------------------------------------------- shardings
# One typed view of an ``sdy`` sharding, read and built through the bindings' attribute
# API (never by editing printed text): the passes that move shardings between meshes
# rewrite these fields and build the attribute back.


@dataclass(frozen=True)
class AxisRef:
    """One axis of a sharding: ``"x"``, or the sub-axis ``"x":(pre_size)size``."""

    name: str
    sub: ir.Attribute | None = None
    """The ``#sdy<sub_axis_info>``, None for the whole axis."""

    def to_attr(self) -> ir.Attribute:
        return sdy.AxisRefAttr.get(self.name, self.sub)

    @classmethod
    def from_attr(cls, a: ir.Attribute) -> AxisRef:
        ref = sdy.AxisRefAttr(a)
        return cls(ref.name, ref.sub_axis_info)


@dataclass(frozen=True)
class DimSharding:
    """The axes one dimension is sharded over (``{"x", ?}p1``: open, priority 1)."""

    axes: tuple[AxisRef, ...]
    closed: bool
    priority: int | None = None


@dataclass(frozen=True)
class Sharding:
    """A ``#sdy.sharding``: its mesh (a symbol name, or an inline ``#sdy.mesh``), one
    :class:`DimSharding` per dimension, and the ``replicated``/``unreduced`` axes."""

    mesh: str | ir.Attribute
    dims: tuple[DimSharding, ...]
    replicated: tuple[AxisRef, ...] = ()
    unreduced: tuple[AxisRef, ...] = ()

    @classmethod
    def from_attr(cls, a: ir.Attribute) -> Sharding:
        ts = sdy.TensorShardingAttr(a)
        ref = ts.mesh_or_ref
        mesh = ir.FlatSymbolRefAttr(ref).value if isinstance(ref, ir.FlatSymbolRefAttr) else ref
        dims = []
        for d in ts.dimension_shardings:
            d = sdy.DimensionShardingAttr(d)
            dims.append(DimSharding(tuple(AxisRef.from_attr(x) for x in d.axes),
                                    bool(d.is_closed), d.priority))
        return cls(mesh, tuple(dims), tuple(AxisRef.from_attr(x) for x in ts.replicated_axes),
                   tuple(AxisRef.from_attr(x) for x in ts.unreduced_axes))

    def to_attr(self) -> ir.Attribute:
        dims = [sdy.DimensionShardingAttr.get([x.to_attr() for x in d.axes], d.closed,
                                              d.priority) for d in self.dims]
        return sdy.TensorShardingAttr.get(self.mesh, dims,
                                          [x.to_attr() for x in self.replicated],
                                          [x.to_attr() for x in self.unreduced])

    @property
    def mesh_axes(self) -> dict[str, int] | None:
        """``{axis: size}`` of an inline mesh; None for a mesh symbol."""
        return None if isinstance(self.mesh, str) else mesh_axes(self.mesh)

    def axes(self) -> list[AxisRef]:
        """Every axis the sharding names, dimensions first (``replicated`` and
        ``unreduced`` after)."""
        return [x for d in self.dims for x in d.axes] + [*self.replicated, *self.unreduced]

    def keep_axes(self, keep: Callable[[AxisRef], bool]) -> Sharding:
        """The sharding without the axes ``keep`` refuses (on every dimension and in
        ``replicated``/``unreduced``)."""
        return replace(self, dims=tuple(replace(d, axes=tuple(x for x in d.axes if keep(x)))
                                        for d in self.dims),
                       replicated=tuple(x for x in self.replicated if keep(x)),
                       unreduced=tuple(x for x in self.unreduced if keep(x)))


def mesh_axes(mesh: ir.Attribute) -> dict[str, int]:
    """``{axis: size}`` of a ``#sdy.mesh`` attribute, in the mesh's order."""
    return {sdy.MeshAxisAttr(a).name: sdy.MeshAxisAttr(a).size for a in sdy.MeshAttr(mesh).axes}


def map_shardings(attr: ir.Attribute,
                  fn: Callable[[Sharding], Sharding | None]) -> ir.Attribute | None:
    """``attr`` with ``fn`` applied to every ``#sdy.sharding`` it holds, or None when
    ``fn`` changed none (``fn`` returns None for "unchanged").

    ``attr`` is a sharding, a per-value list of them (an op's results, a
    ``manual_computation``'s ``in_shardings``), or a function's ``arg_attrs`` /
    ``res_attrs`` (a list of dictionaries whose values may be shardings); anything
    else holds none.
    """
    if sdy.TensorShardingAttr.isinstance(attr):
        changed = fn(Sharding.from_attr(attr))
        return None if changed is None else changed.to_attr()
    if sdy.TensorShardingPerValueAttr.isinstance(attr):
        items = list(sdy.TensorShardingPerValueAttr(attr).shardings)
        out = [map_shardings(a, fn) for a in items]
        if all(o is None for o in out):
            return None
        return sdy.TensorShardingPerValueAttr.get([_either(o, a) for o, a in zip(out, items)])
    if isinstance(attr, ir.ArrayAttr):
        items = list(ir.ArrayAttr(attr))
        out = [map_shardings(a, fn) for a in items]
        if all(o is None for o in out):
            return None
        return ir.ArrayAttr.get([_either(o, a) for o, a in zip(out, items)])
    if isinstance(attr, ir.DictAttr):
        d = ir.DictAttr(attr)
        entries = {d[i].name: d[i].attr for i in range(len(d))}
        new = {k: map_shardings(v, fn) for k, v in entries.items()}
        if all(v is None for v in new.values()):
            return None
        return ir.DictAttr.get({k: _either(new[k], v) for k, v in entries.items()})
    return None


def _either(new: ir.Attribute | None, old: ir.Attribute) -> ir.Attribute:
    return old if new is None else new


def shardings_in(attr: ir.Attribute) -> list[Sharding]:
    """Every ``#sdy.sharding`` that ``attr`` holds (see :func:`map_shardings`)."""
    found: list[Sharding] = []

    def collect(s: Sharding) -> None:
        found.append(s)

    map_shardings(attr, collect)
    return found


# Two attributes the bindings of jaxlib 0.10.2 build but cannot read (no accessors):
# read from their text here, and nowhere else.

_MANUAL_AXES = re.compile(r'"((?:[^"\\]|\\.)*)"')


def manual_axes(attr: ir.Attribute) -> list[str]:
    """The axis names of a ``#sdy<manual_axes{"a", "b"}>`` (built back with
    ``sdy.ManualAxesAttr.get``)."""
    return _MANUAL_AXES.findall(str(attr))


@dataclass(frozen=True)
class MeshAxesGroups:
    """jax >= 0.12's collective groups named by mesh axes,
    ``#stablehlo.replica_group_mesh_axes<mesh = @m, axes = [...]>``: its mesh symbol and
    axis names, and the same groups on another mesh symbol."""

    attr: ir.Attribute

    PREFIX = "#stablehlo.replica_group_mesh_axes"
    _AXIS = re.compile(r'name = "([^"]+)"')
    _MESH = re.compile(r"mesh = @[A-Za-z_][A-Za-z0-9_$.]*")

    @classmethod
    def read(cls, attr: ir.Attribute) -> MeshAxesGroups | None:
        """The groups, or None for numbered ones (``dense<...>``)."""
        return cls(attr) if str(attr).startswith(cls.PREFIX) else None

    @property
    def axes(self) -> list[str]:
        return self._AXIS.findall(str(self.attr))

    def on_mesh(self, target: str) -> ir.Attribute:
        """The same groups over the mesh symbol ``target``."""
        return ir.Attribute.parse(self._MESH.sub(f"mesh = @{target}", str(self.attr)))
