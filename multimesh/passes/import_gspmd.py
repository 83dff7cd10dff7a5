"""``mm-import-gspmd``: rewrite GSPMD ``mhlo.sharding`` strings into Shardy (``sdy``) form.

Consumes modules as jax emits them with ``jax_use_shardy_partitioner=False`` (and as
older exports carry them):

* ``mhlo.sharding = "{devices=[2,1,4]<=[8] last_tile_dim_replicate}"`` on function
  arguments and results and on ops;
* ``stablehlo.custom_call @Sharding(%x) {mhlo.sharding = "..."}`` constraints
  (``backend_config = "unspecified_dims=[...]"`` marks open dimensions).

Produces the sdy form of docs/ir.md: one ``sdy.mesh`` per distinct tile assignment
(axes ``"d0"``, ``"d1"``, ... one per tile dimension larger than one, the replicated
subgroup dimension included; ``device_ids=[...]`` when the device order is not the
iota), ``sdy.sharding`` on arguments and results, ``sdy.sharding_constraint`` for
``@Sharding`` and ``sdy.sharding = #sdy.sharding_per_value<[...]>`` on other ops. The
resulting sharding maps every device to exactly the shard the GSPMD string gave it.

Rejected with a diagnostic: ``{manual}`` and ``last_tile_dims={manual}``,
``@SPMDFullToShardShape``/``@SPMDShardToFullShape`` (shard_map in GSPMD form: export
with Shardy instead), malformed strings, rank mismatches, and non-maximal shardings
over different device counts in one module. A module without any ``mhlo.sharding``
passes through unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar, NoReturn

from multimesh._src.ir_util import AttrsKey, custom_call_target, update_attr_dicts
from multimesh._src.mlir import ir, sdy

from .base import DiagnosticError, ModulePass

__all__ = ["ImportGspmdPass", "GspmdSharding", "GspmdParseError", "parse_gspmd_sharding"]

_ATTR = "mhlo.sharding"
_SHARD_MAP_TARGETS = ("SPMDFullToShardShape", "SPMDShardToFullShape")
_VISITED = ("stablehlo.custom_call", "func.func")
_INT = re.compile(r"\d+")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class GspmdParseError(ValueError):
    """A GSPMD sharding string is malformed or uses an unsupported feature."""


@dataclass(frozen=True)
class GspmdSharding:
    """A parsed ``HloSharding`` string.

    ``kind`` is ``"replicated"``, ``"maximal"``, ``"tiled"``, ``"manual"``,
    ``"unknown"``, ``"unreduced"`` or ``"tuple"``. For ``"tiled"``,
    ``tile_dims`` is the full tile-assignment shape (subgroup dimensions included),
    ``devices`` the row-major flattened tile assignment and ``subgroups`` the types of
    the trailing subgroup dimensions (``("replicated",)`` for
    ``last_tile_dim_replicate``).
    """

    kind: str
    tile_dims: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    subgroups: tuple[str, ...] = ()
    device: int | None = None
    elements: tuple[GspmdSharding, ...] = field(default=())

    @property
    def data_rank(self) -> int:
        return len(self.tile_dims) - len(self.subgroups)

    @property
    def num_devices(self) -> int:
        return math.prod(self.tile_dims)


# ----------------------------------------------------------------------------- parser


class _ShardingParser:
    """Parses one GSPMD sharding string (``HloSharding::ToString``) into a ``GspmdSharding``."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def fail(self, what: str) -> NoReturn:
        raise GspmdParseError(f"{what} at offset {self.i} in GSPMD sharding '{self.s}'")

    def ws(self):
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def peek(self, tok: str) -> bool:
        self.ws()
        return self.s.startswith(tok, self.i)

    def eat(self, tok: str) -> bool:
        if self.peek(tok):
            self.i += len(tok)
            return True
        return False

    def expect(self, tok: str):
        if not self.eat(tok):
            self.fail(f"expected '{tok}'")

    def _token(self, pattern: re.Pattern[str], what: str) -> str:
        self.ws()
        m = pattern.match(self.s, self.i)
        if not m:
            self.fail(f"expected {what}")
        self.i = m.end()
        return m.group()

    def integer(self) -> int:
        return int(self._token(_INT, "an integer"))

    def int_list(self) -> list[int]:
        self.expect("[")
        out: list[int] = []
        if self.eat("]"):
            return out
        while True:
            out.append(self.integer())
            if self.eat("]"):
                return out
            self.expect(",")

    def word(self) -> str:
        return self._token(_WORD, "a keyword")

    def skip_balanced(self):
        """Skip a ``{...}`` group (metadata), honouring quoted strings."""
        self.expect("{")
        depth = 1
        while self.i < len(self.s) and depth:
            c = self.s[self.i]
            if c == '"':
                j = self.i + 1
                while j < len(self.s) and self.s[j] != '"':
                    j += 2 if self.s[j] == "\\" else 1
                self.i = j
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            self.i += 1
        if depth:
            self.fail("unbalanced '{'")

    def sharding(self) -> GspmdSharding:
        self.expect("{")
        if self.eat("}"):
            return GspmdSharding("tuple")
        if self.peek("{"):
            elems = [self.sharding()]
            while self.eat(","):
                elems.append(self.sharding())
            self.expect("}")
            return GspmdSharding("tuple", elements=tuple(elems))
        kw = self.word()
        if kw in ("replicated", "manual", "unknown", "unreduced"):
            result = GspmdSharding(kw)
        elif kw == "maximal":
            self.expect("device")
            self.expect("=")
            result = GspmdSharding("maximal", device=self.integer())
        elif kw == "devices":
            result = self._tiled()
        else:
            self.fail(f"unknown sharding kind '{kw}'")
        self._annotations()
        self.expect("}")
        return result

    def _tiled(self) -> GspmdSharding:
        """``devices=[dims]`` then the assignment (iota or a list) and the subgroups."""
        self.expect("=")
        tile_dims = self.int_list()
        if not tile_dims or any(d < 1 for d in tile_dims):
            self.fail("tile dimensions must be positive")
        n = math.prod(tile_dims)
        devices = self._iota(n) if self.eat("<=") else self._device_list(n, tile_dims)
        subgroups = self._subgroups()
        if len(subgroups) > len(tile_dims):
            self.fail("more subgroup dimensions than tile dimensions")
        return GspmdSharding("tiled", tuple(tile_dims), tuple(devices), subgroups)

    def _iota(self, n: int) -> list[int]:
        """``<=[reshape]`` with an optional ``T(perm)``."""
        reshape = self.int_list()
        perm = list(range(len(reshape)))
        if self.eat("T"):
            self.expect("(")
            perm = [self.integer()]
            while self.eat(","):
                perm.append(self.integer())
            self.expect(")")
        if math.prod(reshape) != n:
            self.fail(f"iota shape {reshape} does not hold {n} devices")
        if sorted(perm) != list(range(len(reshape))):
            self.fail(f"T{tuple(perm)} is not a permutation of {len(reshape)} dims")
        return _iota_devices(reshape, perm)

    def _device_list(self, n: int, tile_dims: list[int]) -> list[int]:
        devices = [self.integer()]
        while self.eat(","):
            devices.append(self.integer())
        if len(devices) != n:
            self.fail(f"{len(devices)} device ids for a {tile_dims} tile assignment")
        if sorted(devices) != list(range(n)):
            self.fail(f"device ids {devices} are not a permutation of 0..{n - 1}")
        return devices

    def _subgroups(self) -> tuple[str, ...]:
        if self.eat("last_tile_dim_replicate"):
            return ("replicated",)
        if not self.eat("last_tile_dims"):
            return ()
        self.expect("=")
        self.expect("{")
        types = [self.word()]
        while self.eat(","):
            types.append(self.word())
        self.expect("}")
        return tuple(types)

    def _annotations(self) -> None:
        """Trailing annotations that do not change the device -> shard mapping."""
        while True:
            if self.eat("metadata"):
                self.expect("=")
                self.skip_balanced()
            elif self.peek("shard_as") or self.peek("shard_like"):
                self.fail("shard_as/shard_like shardings are not supported")
            else:
                break


def _iota_devices(reshape: list[int], perm: list[int]) -> list[int]:
    """``iota(prod(reshape)).reshape(reshape).transpose(perm).flatten()`` without numpy."""
    strides = [math.prod(reshape[k + 1:]) for k in range(len(reshape))]
    tdims = [reshape[p] for p in perm]
    tstrides = [strides[p] for p in perm]
    out = []
    for flat in range(math.prod(reshape)):
        idx, rem = [], flat
        for d in reversed(tdims):
            idx.append(rem % d)
            rem //= d
        idx.reverse()
        out.append(sum(i * s for i, s in zip(idx, tstrides, strict=True)))
    return out


def parse_gspmd_sharding(text: str) -> GspmdSharding:
    """Parse an ``HloSharding::ToString`` string; raises :class:`GspmdParseError`."""
    p = _ShardingParser(text)
    result = p.sharding()
    p.ws()
    if p.i != len(text):
        p.fail("trailing characters")
    return result


# ----------------------------------------------------------------------------- pass


@dataclass
class _Target:
    """One place that carries an ``mhlo.sharding``: a func arg/result or an op."""

    kind: str  # "arg" | "res" | "op" | "constraint"
    op: ir.Operation
    index: int  # argument/result index for "arg"/"res"
    types: list[ir.Type]  # one per value the sharding applies to
    shardings: list[GspmdSharding]  # one per value
    open_dims: tuple[int, ...] = ()


def _rank(t: ir.Type) -> int | None:
    return ir.RankedTensorType(t).rank if isinstance(t, ir.RankedTensorType) else None


@dataclass(frozen=True)
class ImportGspmdPass(ModulePass):
    """Rewrite GSPMD ``mhlo.sharding`` strings and ``@Sharding`` custom calls into sdy form.

    Each distinct tile assignment becomes an ``sdy.mesh`` (``mesh_0``, ``mesh_1``, ...;
    axes ``"d0"``, ``"d1"``, ... for the tile dimensions larger than one, including the
    ``last_tile_dim_replicate`` dimension; ``device_ids`` when the order is not the
    iota) and ``{maximal device=N}`` becomes ``maximal_mesh_N = <[], device_ids=[N]>``.
    Function arguments/results get ``sdy.sharding``, ``@Sharding`` becomes
    ``sdy.sharding_constraint`` (``unspecified_dims`` become open ``{?}`` dimensions) and
    other ops get ``sdy.sharding = #sdy.sharding_per_value<[...]>`` (a non-tuple sharding
    on a multi-result op applies to every result, as in XLA).

    Rejects manual shardings, shard_map in GSPMD form (``@SPMDFullToShardShape`` /
    ``@SPMDShardToFullShape``), malformed strings, modules whose non-maximal
    shardings use different device counts, and maximal device ids outside the
    module's devices (``mhlo.num_partitions``). Modules without ``mhlo.sharding`` are
    left untouched.
    """

    argument: ClassVar[str] = "mm-import-gspmd"
    summary: ClassVar[str] = "Rewrite GSPMD mhlo.sharding strings into sdy meshes and shardings."
    consumes = ("front-end", "flat")

    def apply(self, module: ir.Module) -> None:
        with module.context, ir.Location.unknown():
            targets = _collect(module)
            if not targets:
                return
            _rewrite(module, targets)


# -- phase 1: parse and check everything before touching the IR


def _collect(module: ir.Module) -> list[_Target]:
    """Every ``mhlo.sharding`` of the module, parsed and checked."""
    # Exceptions raised inside an MLIR walk callback come back as RuntimeError, so
    # collect the ops first and visit them outside the walk.
    targets: list[_Target] = []
    for op in _sharded_ops(module):
        targets.extend(_visit(op))
    first_count = _check_targets(targets)
    _check_maximal_devices(module, targets, first_count)
    return targets


def _sharded_ops(module: ir.Module) -> list[ir.Operation]:
    """The ops :func:`_visit` looks at (it is a pass over every op: keep the walk cheap)."""
    found: list[ir.Operation] = []

    def pick(op):
        attrs = op.attributes
        if len(attrs) and (_ATTR in attrs or op.name in _VISITED):
            found.append(op.operation)
        return ir.WalkResult.ADVANCE

    module.operation.walk(pick, ir.WalkOrder.PRE_ORDER)
    return found


def _parse(op: ir.Operation, attr: ir.Attribute, where: str) -> GspmdSharding:
    if not isinstance(attr, ir.StringAttr):
        raise DiagnosticError(f"'{_ATTR}' on {where} must be a string, got {attr}", op.location)
    text = attr.value
    try:
        return parse_gspmd_sharding(text)
    except GspmdParseError as e:
        raise DiagnosticError(
            f"cannot parse GSPMD sharding \"{text}\" on {where}: {e}", op.location) from None


def _single(s: GspmdSharding, op: ir.Operation, where: str) -> GspmdSharding:
    """A one-element tuple sharding on a single value is that element."""
    if s.kind != "tuple":
        return s
    if len(s.elements) != 1:
        raise DiagnosticError(
            f"tuple sharding with {len(s.elements)} elements on {where}", op.location)
    return s.elements[0]


def _visit(op: ir.Operation) -> list[_Target]:
    name = op.name
    if name == "stablehlo.custom_call":
        return _visit_custom_call(op) or _visit_op(op)
    if name == "func.func":
        return _visit_func(op)
    return _visit_op(op)


def _visit_custom_call(op: ir.Operation) -> list[_Target]:
    """A ``@Sharding`` constraint; rejects shard_map in GSPMD form."""
    target = custom_call_target(op)
    if target in _SHARD_MAP_TARGETS:
        raise DiagnosticError(
            f"shard_map in GSPMD form (custom_call @{target}) is not supported; "
            "export the program with Shardy (jax_use_shardy_partitioner=True)", op.location)
    if target != "Sharding":
        return []
    if _ATTR not in op.attributes:
        raise DiagnosticError(f"custom_call @Sharding has no '{_ATTR}' attribute", op.location)
    if len(op.operands) != 1 or len(op.results) != 1:
        raise DiagnosticError(
            "custom_call @Sharding must have exactly one operand and one result", op.location)
    s = _parse(op, op.attributes[_ATTR], "custom_call @Sharding")
    s = _single(s, op, "a single-value custom_call @Sharding")
    return [_Target("constraint", op, 0, [op.results[0].type], [s], _unspecified_dims(op))]


def _visit_func(op: ir.Operation) -> list[_Target]:
    """Shardings on a function's arguments and results."""
    ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
    out: list[_Target] = []
    for kind, attrs_name, types in (("arg", "arg_attrs", ftype.inputs),
                                    ("res", "res_attrs", ftype.results)):
        if attrs_name not in op.attributes:
            continue
        for i, d in enumerate(ir.ArrayAttr(op.attributes[attrs_name])):
            d = ir.DictAttr(d)
            if _ATTR in d:
                where = f"{'argument' if kind == 'arg' else 'result'} #{i}"
                s = _single(_parse(op, d[_ATTR], where), op, where)
                out.append(_Target(kind, op, i, [types[i]], [s]))
    return out


def _visit_op(op: ir.Operation) -> list[_Target]:
    """A sharding on any other op: per result, or one for all results."""
    if _ATTR not in op.attributes:
        return []
    s = _parse(op, op.attributes[_ATTR], f"'{op.name}'")
    types = [r.type for r in op.results]
    if s.kind == "tuple":
        if len(s.elements) != len(types):
            raise DiagnosticError(
                f"tuple sharding with {len(s.elements)} elements on an op with "
                f"{len(types)} results", op.location)
        shardings = list(s.elements)
    else:
        shardings = [s] * len(types)
    if not types:
        raise DiagnosticError(
            f"'{_ATTR}' on an op without results cannot be expressed in sdy form", op.location)
    return [_Target("op", op, 0, types, shardings)]


def _check_targets(targets: list[_Target]) -> int | None:
    """Kinds, ranks and device counts; returns the tiled shardings' device count."""
    first_count: int | None = None
    for t in targets:
        for s, ty in zip(t.shardings, t.types, strict=True):
            _check_kind(s, t.op)
            if s.kind != "tiled":
                continue
            if _rank(ty) != s.data_rank:
                raise DiagnosticError(
                    f"GSPMD sharding with {s.data_rank} tiled dimensions on a value "
                    f"of type {ty}", t.op.location)
            if first_count is None:
                first_count = s.num_devices
            elif s.num_devices != first_count:
                raise DiagnosticError(
                    f"GSPMD shardings over different device counts in one module: "
                    f"{first_count} and {s.num_devices} devices (sdy meshes must "
                    "all have the same size)", t.op.location)
        for d in t.open_dims:
            rank = _rank(t.types[0])
            if rank is None or d >= rank:
                raise DiagnosticError(f"unspecified_dims entry {d} is out of range",
                                      t.op.location)
    return first_count


def _check_kind(s: GspmdSharding, op: ir.Operation) -> None:
    """Reject the sharding kinds sdy cannot express here."""
    if s.kind == "tuple":
        raise DiagnosticError("nested tuple shardings are not supported", op.location)
    if s.kind == "manual" or "manual" in s.subgroups:
        raise DiagnosticError(
            "manual GSPMD shardings (shard_map in GSPMD form) are not supported; "
            "export the program with Shardy (jax_use_shardy_partitioner=True)", op.location)
    if s.kind in ("unknown", "unreduced"):
        raise DiagnosticError(f"GSPMD sharding kind '{s.kind}' is not supported", op.location)
    bad = [g for g in s.subgroups if g != "replicated"]
    if bad:
        raise DiagnosticError(f"GSPMD subgroup type '{bad[0]}' is not supported", op.location)


def _check_maximal_devices(module: ir.Module, targets: list[_Target],
                           first_count: int | None) -> None:
    """Maximal device ids: within the module's device count (mhlo.num_partitions, else
    that of its tiled shardings); with neither, at least a valid int64 id."""
    count, source = _num_partitions(module), "mhlo.num_partitions"
    if count is None and first_count is not None:
        count, source = first_count, "its tiled shardings"
    for t in targets:
        for s in t.shardings:
            if s.kind != "maximal":
                continue
            assert s.device is not None  # the parser sets it on every maximal sharding
            if count is not None and s.device >= count:
                raise DiagnosticError(
                    f"GSPMD sharding '{{maximal device={s.device}}}' names device "
                    f"{s.device}, but the module has {count} devices ({source})",
                    t.op.location)
            if s.device >= 1 << 63:
                raise DiagnosticError(
                    f"GSPMD sharding '{{maximal device={s.device}}}' names device "
                    f"{s.device}, which is not a valid device id", t.op.location)


# -- phase 2: build meshes and rewrite


def _tiled_key(s: GspmdSharding) -> tuple:
    sizes = tuple(d for d in s.tile_dims if d > 1)
    ids = None if list(s.devices) == list(range(len(s.devices))) else s.devices
    return ("tiled", sizes, ids)


def _dim(axes: list[str], closed: bool = True) -> ir.Attribute:
    return sdy.DimensionShardingAttr.get([sdy.AxisRefAttr.get(a) for a in axes],
                                         is_closed=closed)


class _Meshes:
    """The ``sdy.mesh`` symbols the rewrite needs, created on first use."""

    def __init__(self, module: ir.Module) -> None:
        self.used = {ir.StringAttr(o.attributes["sym_name"]).value
                     for o in module.body.operations if "sym_name" in o.attributes}
        self.names: dict[tuple, str] = {}  # key -> symbol name
        self.attrs: list[tuple[str, ir.Attribute]] = []  # in creation order

    def _fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name

    def symbol(self, key: tuple) -> str:
        if key in self.names:
            return self.names[key]
        if key[0] == "maximal":
            name = self._fresh(f"maximal_mesh_{key[1]}")
            attr = sdy.MeshAttr.get([], device_ids=[key[1]])
        elif key[0] == "empty":
            name = self._fresh("empty_mesh")
            attr = sdy.MeshAttr.get([])
        else:
            _, sizes, ids = key
            name = self._fresh(f"mesh_{sum(1 for k in self.names if k[0] == 'tiled')}")
            axes = [sdy.MeshAxisAttr.get(f"d{j}", n) for j, n in enumerate(sizes)]
            attr = sdy.MeshAttr.get(axes, device_ids=list(ids) if ids else [])
        self.names[key] = name
        self.attrs.append((name, attr))
        return name

    def sharding(self, s: GspmdSharding, ty: ir.Type, open_dims=()) -> ir.Attribute:
        """``s`` as an ``sdy.sharding`` on a value of type ``ty``."""
        if s.kind == "maximal":
            return sdy.TensorShardingAttr.get(self.symbol(("maximal", s.device)), [])
        if s.kind == "replicated":
            tiled = [n for k, n in self.names.items() if k[0] == "tiled"]
            name = tiled[0] if tiled else self.symbol(("empty",))
            dims = [_dim([], d not in open_dims) for d in range(_rank(ty) or 0)]
            return sdy.TensorShardingAttr.get(name, dims)
        name = self.symbol(_tiled_key(s))
        dims, j = [], 0
        for d in range(s.data_rank):
            if s.tile_dims[d] > 1:
                dims.append(_dim([f"d{j}"], d not in open_dims))
                j += 1
            else:
                dims.append(_dim([], d not in open_dims))
        return sdy.TensorShardingAttr.get(name, dims)


def _rewrite(module: ir.Module, targets: list[_Target]) -> None:
    meshes = _Meshes(module)
    # Tiled meshes first, in order of appearance, so replicated ones can reuse mesh_0.
    for t in targets:
        for s in t.shardings:
            if s.kind == "tiled":
                meshes.symbol(_tiled_key(s))
    func_changes: dict[tuple[ir.Operation, AttrsKey], dict[int, dict]] = {}
    for t in targets:
        if t.kind in ("arg", "res"):
            key: AttrsKey = "arg_attrs" if t.kind == "arg" else "res_attrs"
            attr = meshes.sharding(t.shardings[0], t.types[0])
            func_changes.setdefault((t.op, key), {})[t.index] = {
                _ATTR: None, "sdy.sharding": attr}
        elif t.kind == "constraint":
            attr = meshes.sharding(t.shardings[0], t.types[0], t.open_dims)
            with ir.InsertionPoint(t.op), t.op.location:
                new = sdy.ShardingConstraintOp(t.op.operands[0], attr)
            t.op.results[0].replace_all_uses_with(new.result)
            t.op.erase()
        else:
            per_value = [meshes.sharding(s, ty)
                         for s, ty in zip(t.shardings, t.types, strict=True)]
            t.op.attributes["sdy.sharding"] = sdy.TensorShardingPerValueAttr.get(per_value)
            del t.op.attributes[_ATTR]
    for (fn, key), changes in func_changes.items():
        update_attr_dicts(fn, key, changes)
    # Insert the meshes at the top of the module, in creation order.
    ops = list(module.body.operations)
    ip = ir.InsertionPoint(ops[0]) if ops else ir.InsertionPoint(module.body)
    for name, attr in meshes.attrs:
        with ip:
            sdy.MeshOp(name, attr)


def _num_partitions(module: ir.Module) -> int | None:
    attrs = module.operation.attributes
    a = attrs["mhlo.num_partitions"] if "mhlo.num_partitions" in attrs else None
    return ir.IntegerAttr(a).value if isinstance(a, ir.IntegerAttr) else None


def _unspecified_dims(op: ir.Operation) -> tuple[int, ...]:
    if "backend_config" not in op.attributes:
        return ()
    cfg = op.attributes["backend_config"]
    if not isinstance(cfg, ir.StringAttr):
        return ()
    m = re.search(r"unspecified_dims=\[([0-9,\s]*)\]", ir.StringAttr(cfg).value)
    if not m:
        return ()
    return tuple(int(x) for x in m.group(1).split(",") if x.strip())
