"""``mm-import-mpmd``: Shardy's partitioned MPMD form -> multimesh's MPMD form (docs/ir.md §4).

Shardy's MPMD partitioner (``apply_mpmd_partitioning``, in jaxlib's ``_sdy_mpmd``) emits a
``@main`` of ``mpmd.fragment_call``s and ``mpmd.transfer``s over
``!mpmd.mesh_tensor<"m1", tensor<..>, sharding=<@mesh, ..>>`` values, plus one
private function per fragment. Only Pathways can run that. This pass rewrites it
into what ``multimesh.runtime.build_plan`` reads, so stock jax runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from multimesh._src import ir_attrs as ta
from multimesh._src.errors import DiagnosticError, PipelineError
from multimesh._src.ir_util import attr_dicts, mesh_ops, set_attr_dicts, update_attr_dicts
from multimesh._src.layouts import layout_key
from multimesh._src.mlir import attr_to_py, ir, mpmd, py_to_attr, sdy, stablehlo

from . import _contract as c
from .base import ModulePass

__all__ = ["ImportMpmdPass", "MESHES_ATTR", "MeshTensor", "parse_mesh_tensor", "parse_meshes_option",
           "read_topology"]

_MAIN_OPS = ("mpmd.fragment_call", "mpmd.transfer", "func.return")
_TOP_OPS = ("func.func", "sdy.mesh")
_UNPARTITIONED = ("mpmd.named_computation", "mpmd.call", "mpmd.fragment", "mpmd.assign",
                  "mpmd.unassign", "mpmd.named_tensor")
_DROPPED_FUNC_ATTRS = ("mesh_shape", "reserved_hbm_bytes")
_DONATION_ATTRS = ("tf.aliasing_output", "jax.buffer_donor")
_MEMORY_KIND_ATTRS = ("mhlo.memory_kind",)


@dataclass(frozen=True)
class ImportMpmdPass(ModulePass):
    """Turns a module partitioned by Shardy:MPMD into multimesh's MPMD form.

    Input: the output of jaxlib's ``_sdy_mpmd.apply_mpmd_partitioning`` (or
    ``MpmdLowered.as_text("mpmd")`` from Shardy's JAX front end): ``@main`` holds
    only ``mpmd.fragment_call``, ``mpmd.transfer`` and ``return`` over
    ``!mpmd.mesh_tensor`` values; each fragment is a ``func.func`` with
    ``mesh_shape`` and ``sdy.sharding``s on one mesh. The mpmd dialect names meshes
    but no devices, so ``meshes`` says which device positions each mesh is.

    Output (docs/ir.md §4), in the partitioner's order of calls, which becomes the
    dispatch order:

        module attributes {mm.tasks = {stage1 = {devices = [0, 1, 2, 3], ...}}} {
          sdy.mesh @mesh_m1 = <["x"=4]>
          func.func @main(%arg0: tensor<8x8xf32> {mm.devices = [0, 1, 2, 3],
                                                  mm.sharding = #sdy.sharding<@mesh_m1, ..>})
            %0 = stablehlo.custom_call @mm.fragment_call(%arg0) {mm.fragment = @p0_stage0_fwd}
            %1 = stablehlo.custom_call @mm.transfer(%0) {mm.devices = [4, 5, 6, 7], ...}
          module @p0_stage0_fwd attributes {mm.devices = [0, 1, 2, 3],
              mm.task = {name = "stage1", transpose_count = 0 : i64}, ...} {
            sdy.mesh @mesh = <["x"=4]>      // the fragment's own `mesh_shape`
            func.func public @main(...)      // every argument and result has a sharding
          }

    One ``sdy.mesh`` per mesh comes from the ``topology`` on ``@main``; implicit
    (absent) shardings become explicit replicated ones. A fragment's task is its
    origins' names joined by ``+`` (the mesh name when it has none) and the highest
    transpose count among them. The partitioner's donation attributes are dropped
    inside fragments: multimesh's runtime donates buffers itself (a
    ``jax.buffer_donor`` on an ``@main`` argument is kept, so callers can honour it).
    Rejected with a diagnostic: any other op in ``@main`` (an unpartitioned module,
    whose cross-mesh ``mpmd.reduce`` and ``mpmd.broadcast`` the partitioner has not
    yet lowered into transfers and fragments; ``mpmd.for`` loops), memory kinds other
    than ``device``, ``unreduced`` axes or sub-axes in a sharding that crosses a
    fragment boundary, a call whose operand or result layout differs from its
    fragment's (the mpmd verifier does not compare shardings), and meshes missing from
    ``meshes`` or of the wrong size.
    """

    argument = "mm-import-mpmd"
    summary = ("Turn Shardy's partitioned MPMD form (`mpmd.fragment_call`, `mpmd.transfer`, "
               "`!mpmd.mesh_tensor`) into multimesh's MPMD form.")

    meshes: str = ""
    """Device positions of each mesh, row-major over its axes: ``m1=0-3;m2=4-7`` or
    ``m1=0,1,2,3;m2=4,5,6,7`` (quote a value with commas on the command line). When
    empty, the module attribute ``mm.meshes = {m1 = [0, 1, 2, 3], ...}`` gives them."""

    def __post_init__(self):
        parse_meshes_option(self.meshes)  # fail while the pipeline is parsed

    def apply(self, module: ir.Module) -> None:
        with module.context:
            positions = parse_meshes_option(self.meshes)
            source = "option 'meshes'"
            attrs = module.operation.attributes
            if MESHES_ATTR in attrs:
                recorded = _read_meshes_attr(attrs[MESHES_ATTR], module.operation.location)
                if positions and positions != recorded:
                    raise DiagnosticError(
                        f"option 'meshes' ({_format_meshes(positions)}) disagrees with the "
                        f"module's '{MESHES_ATTR}' ({_format_meshes(recorded)}); give one",
                        module.operation.location)
                if not positions:
                    positions, source = recorded, f"'{MESHES_ATTR}'"
            _Rewriter(_Importer(module, positions, source).check()).rewrite()


MESHES_ATTR = c.MESHES_ATTR
"""Module attribute ``{m1 = [0, 1, 2, 3], ...}``: the mesh map when the option is not given
(``compile_mpmd`` sets it, so a failing module saved for a repro replays as is)."""


_MESHES = ta.map_of(ta.list_of(ta.POSITION, non_empty=True), "mesh names")


def _read_meshes_attr(attr: ir.Attribute, loc) -> dict[str, tuple[int, ...]]:
    value = ta.read(attr, _MESHES, f"'{MESHES_ATTR}'", loc)
    return {k: tuple(v) for k, v in value.items()}


def _format_meshes(positions: dict[str, tuple[int, ...]]) -> str:
    def one(v: tuple[int, ...]) -> str:
        more = f",...({len(v)} positions)" if len(v) > ta.MAX_SHOWN else ""
        return ",".join(map(str, v[:ta.MAX_SHOWN])) + more
    return ";".join(f"{k}={one(v)}" for k, v in positions.items())


# ----------------------------------------------------------------------------- parsing


def parse_meshes_option(text: str) -> dict[str, tuple[int, ...]]:
    """``"m1=0-3;m2=4,5,6,7"`` -> ``{"m1": (0, 1, 2, 3), "m2": (4, 5, 6, 7)}``."""
    out: dict[str, tuple[int, ...]] = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        name, eq, spec = entry.partition("=")
        name = name.strip()
        if not eq or not name:
            raise _option_error(f"entry '{entry}' is not of the form name=positions")
        if name in out:
            raise _option_error(f"mesh '{name}' is given twice")
        positions = [p for item in spec.split(",") for p in _positions(name, item.strip())]
        if len(set(positions)) != len(positions):
            raise _option_error(f"mesh '{name}' lists a device position twice: "
                                f"{ta.show(positions)}")
        out[name] = tuple(positions)
    return out



def _positions(mesh: str, item: str) -> list[int]:
    """``"3"`` or ``"0-3"`` (increasing) -> device positions (below ``MAX_DEVICES``)."""
    lo, dash, hi = item.partition("-")
    try:
        first, last = (int(lo), int(hi)) if dash else (int(item), int(item))
        if last < first:
            raise ValueError
    except ValueError:
        raise _option_error(
            f"mesh '{mesh}' has device position '{item}', which is not an integer "
            f"or an increasing range a-b") from None
    if first < 0:
        raise _option_error(f"mesh '{mesh}' has a negative device position")
    if last >= ta.MAX_DEVICES:
        raise _option_error(
            f"mesh '{mesh}' has device position {last}, but positions are below "
            f"{ta.MAX_DEVICES} (MAX_DEVICES)")
    return list(range(first, last + 1))

def _option_error(what: str) -> PipelineError:
    return PipelineError(
        f"Pass 'mm-import-mpmd' option 'meshes': {what}. Expected "
        f"'name=positions;...', e.g. 'm1=0-3;m2=4,5,6,7'.")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets and quotes."""
    parts, cur, depth, quote, escape = [], [], 0, False, False
    for ch in text:
        if quote:
            cur.append(ch)
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                quote = False
            continue
        if ch == '"':
            quote = True
        elif ch in "<[{(":
            depth += 1
        elif ch in ">]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    return parts


def _unquote(text: str) -> str:
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        raise ValueError(text)
    return text[1:-1].replace('\\"', '"').replace("\\\\", "\\")


@dataclass(frozen=True)
class MeshTensor:
    """The parameters of an ``!mpmd.mesh_tensor`` type (the bindings have no class for it)."""

    mesh: str
    tensor: ir.Type
    sharding: ir.Attribute | None  # #sdy.sharding, None = fully replicated
    memory_kind: str | None


_MESH_TENSOR = "!mpmd.mesh_tensor<"


def parse_mesh_tensor(t: ir.Type) -> MeshTensor | None:
    """Read an ``!mpmd.mesh_tensor`` type; None for any other type."""
    text = str(t)
    if not text.startswith(_MESH_TENSOR) or not text.endswith(">"):
        return None
    parts = _split_top(text[len(_MESH_TENSOR):-1])
    mesh, tensor = _unquote(parts[0]), ir.Type.parse(parts[1])
    sharding = memory_kind = None
    for p in parts[2:]:
        key, _, value = (x.strip() for x in p.partition("="))
        if key == "sharding":
            sharding = ir.Attribute.parse("#sdy.sharding" + value)
        elif key == "memory_kind":
            memory_kind = _unquote(value)
        else:
            raise ValueError(f"unknown mesh_tensor parameter in {text}")
    return MeshTensor(mesh, tensor, sharding, memory_kind)


def read_topology(main: ir.Operation) -> dict[str, ir.Attribute] | None:
    """``{mesh name: #sdy.mesh}`` from ``@main``'s ``topology`` attribute (None if absent)."""
    topology = ta.read_attr(main, "topology", ta.TOPOLOGY, "'topology' on @main",
                           default=None)
    if topology is None:
        return None
    text = str(topology)
    prefix = "#mpmd.topology<"
    out = {}
    for entry in _split_top(text[len(prefix):-1]):
        inner = entry[1:-1] if entry.startswith("<") and entry.endswith(">") else entry
        name, sep, mesh = inner.partition(" : ")
        if not sep:
            raise DiagnosticError(f"cannot read mesh '{entry}' of the topology on @main",
                                  main.location)
        out[_unquote(name.strip())] = ir.Attribute.parse("#sdy.mesh" + mesh.strip())
    return out


# ----------------------------------------------------------------------------- the rewrite


def _axes(mesh: ir.Attribute) -> tuple[tuple[str, ...], tuple[int, ...]]:
    m = sdy.MeshAttr(mesh)
    axes = [sdy.MeshAxisAttr(a) for a in m.axes]
    return tuple(a.name for a in axes), tuple(a.size for a in axes)


def _mesh_str(mesh: ir.Attribute) -> str:
    names, sizes = _axes(mesh)
    return "[" + ", ".join(f'"{n}"={s}' for n, s in zip(names, sizes)) + "]"


def _dims(sharding: ir.Attribute | None, rank: int) -> tuple[tuple[str, ...], ...]:
    if sharding is None:
        return tuple(() for _ in range(rank))
    ts = sdy.TensorShardingAttr(sharding)
    return tuple(tuple(sdy.AxisRefAttr(a).name for a in sdy.DimensionShardingAttr(d).axes)
                 for d in ts.dimension_shardings)


def _rank(t: ir.Type) -> int:
    return len(ir.RankedTensorType(t).shape)


def _replicated(mesh_ref: str, rank: int) -> ir.Attribute:
    dim = sdy.DimensionShardingAttr.get([], is_closed=True)
    return sdy.TensorShardingAttr.get(mesh_ref, [dim] * rank)


def _on_mesh(sharding: ir.Attribute | None, mesh_ref: str, rank: int) -> ir.Attribute:
    """``sharding`` re-pointed at ``@mesh_ref`` (replicated when None)."""
    if sharding is None:
        return _replicated(mesh_ref, rank)
    ts = sdy.TensorShardingAttr(sharding)
    return sdy.TensorShardingAttr.get(mesh_ref, list(ts.dimension_shardings),
                                      list(ts.replicated_axes), list(ts.unreduced_axes))


def _check_boundary_sharding(sharding: ir.Attribute | None, axes: tuple[str, ...], what: str,
                             loc) -> None:
    """A sharding the runtime moves values by: known axes, no unreduced or sub-axes."""
    if sharding is None:
        return
    ts = sdy.TensorShardingAttr(sharding)
    if len(ts.unreduced_axes):
        raise DiagnosticError(
            f"{what} has unreduced axes {sharding}; multimesh moves only fully reduced "
            f"values between fragments", loc)
    for d in ts.dimension_shardings:
        for a in sdy.DimensionShardingAttr(d).axes:
            ref = sdy.AxisRefAttr(a)
            if ref.sub_axis_info is not None:
                raise DiagnosticError(
                    f"{what} shards over sub-axis {a} in {sharding}; multimesh moves values "
                    f"between fragments only on whole mesh axes", loc)
            if ref.name not in axes:
                raise DiagnosticError(
                    f"{what} uses axis \"{ref.name}\" in {sharding}, which is not an axis of "
                    f"its mesh {list(axes)}", loc)


def _memory_kind_error(kind: str, what: str, loc) -> DiagnosticError:
    return DiagnosticError(
        f"{what} has memory kind \"{kind}\"; multimesh runs values in device memory only "
        f"(no host offloading)", loc)



def _unsupported(op: ir.Operation) -> DiagnosticError:
    """The error for an op that cannot be in @main, saying what to do first."""
    if op.name in ("mpmd.reduce", "mpmd.broadcast"):
        return DiagnosticError(
            f"'{op.name}' in @main: a cross-mesh {op.name[5:]} cannot run as an op "
            f"(multimesh's runtime has no cross-mesh collectives); Shardy's partitioner "
            f"lowers it into transfers and fragments, so partition with phases=ALL first",
            op.location)
    if op.name == "mpmd.for":
        return DiagnosticError(
            "'mpmd.for' in @main: multimesh runs flat programs of fragment calls and "
            "transfers; unroll the loop before partitioning (e.g. one mpmd.call per "
            "microbatch)", op.location)
    if op.name in _UNPARTITIONED:
        return DiagnosticError(
            f"'{op.name}' in @main: the module is not partitioned yet; run Shardy's "
            f"apply_mpmd_partitioning with phases=ALL first", op.location)
    return DiagnosticError(
        f"'{op.name}' in @main cannot run: multimesh runs only 'mpmd.fragment_call', "
        f"'mpmd.transfer' and 'return' there", op.location)


@dataclass
class _Fragment:
    fn: ir.Operation
    mesh_shape: ir.Attribute
    args: list[dict[str, ir.Attribute]]
    results: list[dict[str, ir.Attribute]]
    in_types: list[ir.Type]
    out_types: list[ir.Type]
    mesh_syms: list[str]  # the module's sdy.mesh symbols its shardings name


class _Importer:
    """Checks everything first (:meth:`check`); :class:`_Rewriter` then rewrites."""

    def __init__(self, module: ir.Module, positions: dict[str, tuple[int, ...]],
                 source: str):
        self.module = module
        self.positions = positions
        self.source = source  # where the mesh map came from, for messages
        # Types and attributes are uniqued per context: one program repeats a few of them.
        self._types: dict[ir.Type, MeshTensor | None] = {}
        self._layouts: dict[tuple, tuple] = {}
        self._checked: set[tuple] = set()

    def check(self) -> _Importer:
        module = self.module
        self.main = main = c.main_func(module)
        self.block = block = c.entry_block(main)
        self.funcs = c.func_by_name(module)
        self.sdy_meshes = mesh_ops(module)
        for view in module.body.operations:
            if view.operation.name not in _TOP_OPS:
                raise DiagnosticError(
                    f"'{view.operation.name}' at the top level of the module: the output of "
                    f"Shardy's MPMD partitioner holds only functions and sdy.mesh "
                    f"symbols", view.operation.location)
        ops = [o.operation for o in block.operations]
        for op in ops:
            if op.name not in _MAIN_OPS:
                raise _unsupported(op)
        self.arg_types = self._arg_types()
        self.topology = read_topology(main)
        self.calls = [op for op in ops if op.name == "mpmd.fragment_call"]
        self.transfers = [op for op in ops if op.name == "mpmd.transfer"]
        self.ret = ops[-1]
        self.fragments: dict[str, _Fragment] = {}
        for call in self.calls:
            name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
            if name not in self.fragments:
                self.fragments[name] = self._read_fragment(name, call)
        self.mesh_shapes = self._mesh_shapes()
        self._check_positions()
        # Values in @main: where each one lives, as (mesh, sharding or None).
        self.value_mesh: dict[ir.Value, MeshTensor] = {}
        self._check_args()
        for op in ops:
            if op.name == "mpmd.fragment_call":
                self._check_call(op)
            elif op.name == "mpmd.transfer":
                dst = self._result_type(op, 0)
                self._check_value(dst, "the transfer's result", op.location)
                self.value_mesh[op.results[0]] = dst
        return self

    def _arg_types(self) -> list[MeshTensor]:
        out = []
        for a in self.block.arguments:
            mt = self._mesh_tensor(a.type)
            if mt is None:
                raise DiagnosticError(
                    f"@main argument #{a.arg_number} has type {a.type}, not an "
                    f"!mpmd.mesh_tensor; is this the output of Shardy's MPMD partitioner?",
                    self.main.location)
            out.append(mt)
        return out

    def _check_args(self) -> None:
        main = self.main
        arg_dicts = attr_dicts(main, "arg_attrs")
        for a, mt, d in zip(self.block.arguments, self.arg_types, arg_dicts):
            what = f"@main argument #{a.arg_number}"
            for key in _MEMORY_KIND_ATTRS:
                if key in d and attr_to_py(d[key]) != "device":
                    raise _memory_kind_error(attr_to_py(d[key]), what, main.location)
            self._check_value(mt, what, main.location)
            self.value_mesh[a] = mt

    def _read_fragment(self, name: str, call: ir.Operation) -> _Fragment:
        fn = self.funcs.get(name)
        if fn is None:
            raise DiagnosticError(f"fragment '@{name}' is not a function of the module",
                                  call.location)
        if "mesh_shape" not in fn.attributes:
            raise DiagnosticError(
                f"fragment '@{name}' has no 'mesh_shape'; is this the output of Shardy's "
                f"MPMD partitioner?", fn.location)
        mesh_shape = fn.attributes["mesh_shape"]
        axes = _axes(mesh_shape)[0]
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        frag = _Fragment(fn, mesh_shape, attr_dicts(fn, "arg_attrs"), attr_dicts(fn, "res_attrs"),
                         list(ftype.inputs), list(ftype.results), [])
        for kind, dicts in (("argument", frag.args), ("result", frag.results)):
            for k, d in enumerate(dicts):
                what = f"fragment '@{name}' {kind} #{k}"
                for key in _MEMORY_KIND_ATTRS:
                    if key in d:
                        kind_ = attr_to_py(d[key])
                        if kind_ != "device":
                            raise _memory_kind_error(kind_, what, fn.location)
                sh = d.get("sdy.sharding")
                _check_boundary_sharding(sh, axes, what, fn.location)
        frag.mesh_syms = _own_mesh_first(frag, c.referenced_meshes(fn, set(self.sdy_meshes)))
        return frag

    def _mesh_shapes(self) -> dict[str, ir.Attribute]:
        """Each mesh's axes, from the topology; a fragment's ``mesh_shape`` must agree."""
        if self.topology is None:  # the mpmd verifier already demands one
            raise DiagnosticError("@main has no mpmd 'topology'; is this the output of "
                                  "Shardy's MPMD partitioner?", self.main.location)
        shapes: dict[str, ir.Attribute] = dict(self.topology)
        for mt in self.arg_types:
            if mt.mesh not in shapes:
                raise DiagnosticError(
                    f"@main has an argument on mesh \"{mt.mesh}\", which is not in the "
                    f"topology {sorted(shapes)}", self.main.location)
        for call in self.calls:
            mesh = ir.StringAttr(call.attributes["mesh_name"]).value
            frag = self.fragments[ir.FlatSymbolRefAttr(call.attributes["callee"]).value]
            if mesh not in shapes:
                raise DiagnosticError(
                    f"fragment call on mesh \"{mesh}\", which is not in the topology "
                    f"{sorted(shapes)}", call.location)
            if _axes(shapes[mesh]) != _axes(frag.mesh_shape):
                raise DiagnosticError(
                    f"fragment '@{c.func_name(frag.fn)}' has mesh_shape "
                    f"{_mesh_str(frag.mesh_shape)} but mesh \"{mesh}\" is "
                    f"{_mesh_str(shapes[mesh])}", call.location)
        for mesh, shape in shapes.items():
            if len(sdy.MeshAttr(shape).device_ids):
                raise DiagnosticError(
                    f"mesh \"{mesh}\" has explicit device_ids; give the device order in the "
                    f"pass's 'meshes' option instead", self.main.location)
        return shapes

    def _check_positions(self) -> None:
        known = sorted(self.mesh_shapes)
        src = self.source
        if not self.positions:
            raise DiagnosticError(
                f"mm-import-mpmd needs the device positions of every mesh; set its option "
                f"'meshes' (or the module attribute '{MESHES_ATTR}'), e.g. "
                f"meshes={_example(self.mesh_shapes)}", self.main.location)
        for mesh in self.positions:
            if mesh not in self.mesh_shapes:
                raise DiagnosticError(
                    f"{src} names mesh \"{mesh}\", which the program does not have "
                    f"(its meshes: {ta.listing(known)})", self.main.location)
        for mesh in known:
            if mesh not in self.positions:
                raise DiagnosticError(
                    f"{src} gives no device positions for mesh \"{mesh}\" (it gives "
                    f"{ta.listing(sorted(self.positions))})", self.main.location)
            size = prod(_axes(self.mesh_shapes[mesh])[1])
            if len(self.positions[mesh]) != size:
                raise DiagnosticError(
                    f"mesh \"{mesh}\" {_mesh_str(self.mesh_shapes[mesh])} has {size} devices "
                    f"but {src} gives it {len(self.positions[mesh])}: "
                    f"{ta.show(list(self.positions[mesh]))}", self.main.location)
        for mesh, pos in self.positions.items():
            if len(set(pos)) != len(pos):
                raise DiagnosticError(f"{src} lists a device of mesh \"{mesh}\" twice: "
                                      f"{ta.show(list(pos))}", self.main.location)

    def _mesh_tensor(self, t: ir.Type) -> MeshTensor | None:
        if t not in self._types:
            self._types[t] = parse_mesh_tensor(t)
        return self._types[t]

    def _check_value(self, mt: MeshTensor, what: str, loc) -> None:
        key = (mt.mesh, mt.sharding, mt.memory_kind)
        if key in self._checked:
            return
        if mt.memory_kind not in (None, "device"):
            raise _memory_kind_error(mt.memory_kind, what, loc)
        _check_boundary_sharding(mt.sharding, _axes(self.mesh_shapes[mt.mesh])[0], what, loc)
        self._checked.add(key)

    def _result_type(self, op: ir.Operation, k: int) -> MeshTensor:
        mt = self._mesh_tensor(op.results[k].type)
        if mt is None:
            raise DiagnosticError(f"result #{k} of '{op.name}' is not an !mpmd.mesh_tensor",
                                  op.location)
        return mt

    def _layout(self, mesh: str, axes_of: ir.Attribute, sharding, t: ir.Type):
        rank = _rank(t)
        key = (mesh, axes_of, sharding, rank)
        out = self._layouts.get(key)
        if out is None:
            names, sizes = _axes(axes_of)
            out = layout_key(self.positions[mesh], names, sizes, _dims(sharding, rank))
            self._layouts[key] = out
        return out

    def _check_call(self, call: ir.Operation) -> None:
        mesh = ir.StringAttr(call.attributes["mesh_name"]).value
        name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        frag = self.fragments[name]
        if len(call.operands) != len(frag.in_types) or len(call.results) != len(frag.out_types):
            raise DiagnosticError(
                f"call of '@{name}' has {len(call.operands)} operands and {len(call.results)} "
                f"results but the fragment takes {len(frag.in_types)} and returns "
                f"{len(frag.out_types)}", call.location)
        for k, v in enumerate(call.operands):
            mt = self.value_mesh[v]
            if mt.mesh != mesh:
                raise DiagnosticError(
                    f"operand #{k} of the call of '@{name}' on mesh \"{mesh}\" lives on mesh "
                    f"\"{mt.mesh}\" (a transfer is missing)", call.location)
            want = self._layout(mesh, frag.mesh_shape, frag.args[k].get("sdy.sharding"),
                                frag.in_types[k])
            have = self._layout(mesh, self.mesh_shapes[mesh], mt.sharding, mt.tensor)
            if want != have:
                raise DiagnosticError(
                    f"operand #{k} of the call of '@{name}' is laid out as "
                    f"{mt.sharding or 'replicated'} but the fragment wants "
                    f"{frag.args[k].get('sdy.sharding', 'replicated')}", call.location)
        for k, r in enumerate(call.results):
            mt = self._result_type(call, k)
            self._check_value(mt, f"result #{k} of the call of '@{name}'", call.location)
            want = self._layout(mesh, frag.mesh_shape, frag.results[k].get("sdy.sharding"),
                                frag.out_types[k])
            have = self._layout(mesh, self.mesh_shapes[mesh], mt.sharding, mt.tensor)
            if mt.mesh != mesh or want != have:
                raise DiagnosticError(
                    f"result #{k} of the call of '@{name}' is typed {r.type} but the fragment "
                    f"returns it on mesh \"{mesh}\" as "
                    f"{frag.results[k].get('sdy.sharding', 'replicated')}", call.location)
            self.value_mesh[r] = mt


class _Rewriter:
    """Rewrites a checked program (:class:`_Importer`) into multimesh's MPMD form."""

    def __init__(self, checked: _Importer):
        # What _Importer.check() read and verified; only rewritten here.
        self.module, self.positions = checked.module, checked.positions
        self.main, self.block, self.ret = checked.main, checked.block, checked.ret
        self.funcs, self.sdy_meshes = checked.funcs, checked.sdy_meshes
        self.mesh_shapes, self.fragments = checked.mesh_shapes, checked.fragments
        self.arg_types, self.value_mesh = checked.arg_types, checked.value_mesh
        self.calls, self.transfers = checked.calls, checked.transfers

    def rewrite(self) -> None:
        taken = set(self.funcs) | set(self.sdy_meshes)
        mesh_sym = {mesh: _fresh(f"mesh_{_safe(mesh)}", taken)
                    for mesh in sorted(self.mesh_shapes)}
        devices = {m: py_to_attr(list(p)) for m, p in self.positions.items()}
        tasks, modules, frag_tasks = self._plan_tasks(taken)
        # Top-level meshes, before @main.
        with ir.InsertionPoint(self.main), self.main.location:
            for mesh in sorted(self.mesh_shapes):
                sdy.MeshOp(mesh_sym[mesh], self.mesh_shapes[mesh])
        # Nested fragment modules (cloned when one function runs on two meshes).
        moved: set[str] = set()
        for (name, mesh), sub_name in modules.items():
            self._nest_fragment(name, mesh, sub_name, frag_tasks[(name, mesh)],
                                devices[mesh], clone=name in moved)
            moved.add(name)
        self._rewrite_main(devices, mesh_sym, modules)
        self._drop_moved_meshes()
        self._set_module_attrs(tasks)

    def _plan_tasks(self, taken: set[str]) -> tuple[
            dict[str, dict], dict[tuple[str, str], str], dict[tuple[str, str], tuple[str, int]]]:
        """Tasks (one per origins and mesh; a name on two meshes gets the mesh appended),
        the nested module name of each (fragment, mesh) and its task tag."""
        tasks: dict[str, dict] = {}
        modules: dict[tuple[str, str], str] = {}  # (fragment, mesh) -> nested module name
        frag_tasks: dict[tuple[str, str], tuple[str, int]] = {}
        for call in self.calls:
            mesh = ir.StringAttr(call.attributes["mesh_name"]).value
            name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
            task, count = _task_of(call, mesh)
            names, sizes = _axes(self.mesh_shapes[mesh])
            entry = {"devices": list(self.positions[mesh]), "axis_names": list(names),
                     "axis_sizes": list(sizes), "logical_axes": []}
            if task in tasks and tasks[task] != entry:
                task = f"{task}@{mesh}"
            tasks[task] = entry
            key = (name, mesh)
            if key in modules:  # several calls, several origins: keep the highest count
                old_task, old_count = frag_tasks[key]
                frag_tasks[key] = (old_task, max(old_count, count))
                continue
            modules[key] = name if not any(k[0] == name for k in modules) else \
                _fresh(f"{name}_{_safe(mesh)}", taken)
            taken.add(modules[key])
            frag_tasks[key] = (task, count)
        return tasks, modules, frag_tasks

    def _nest_fragment(self, name: str, mesh: str, sub_name: str, tag: tuple[str, int],
                       devices: ir.Attribute, *, clone: bool) -> None:
        """Move (or copy) fragment ``name`` into its own module as that module's ``@main``."""
        module = self.module
        i32 = ir.IntegerType.get_signless(32)
        frag = self.fragments[name]
        fn = frag.fn.clone(ip=ir.InsertionPoint(module.body)) if clone else frag.fn
        with ir.InsertionPoint(module.body), fn.location:
            sub = ir.Operation.create("builtin.module", regions=1)
        sub.regions[0].blocks.append()
        sub.attributes["sym_name"] = ir.StringAttr.get(sub_name)
        sub.attributes[c.DEVICES_ATTR] = devices
        sub.attributes[c.TASK_ATTR] = c.tag_attr(*tag)
        sub.attributes["mhlo.num_partitions"] = ir.IntegerAttr.get(
            i32, len(self.positions[mesh]))
        sub.attributes["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)
        body = sub.regions[0].blocks[0]
        own = frag.mesh_syms[0] if frag.mesh_syms else "mesh"
        with ir.InsertionPoint(body), fn.location:
            sdy.MeshOp(own, frag.mesh_shape)
            for sym in frag.mesh_syms[1:]:
                shape = self.sdy_meshes[sym].attributes["mesh"]
                sdy.MeshOp(sym, shape if _is_empty(shape) else frag.mesh_shape)
        body.append(fn)
        _to_fragment_main(fn, frag, own)

    def _rewrite_main(self, devices: dict[str, ir.Attribute], mesh_sym: dict[str, str],
                      modules: dict[tuple[str, str], str]) -> None:
        """``@main``: plain tensors placed by ``mm.devices`` / ``mm.sharding``, fragment
        calls and transfers as custom calls."""
        main, block = self.main, self.block
        changes = {}
        for a, mt in zip(block.arguments, self.arg_types):
            changes[a.arg_number] = {
                c.DEVICES_ATTR: devices[mt.mesh],
                c.SHARDING_ATTR: _on_mesh(mt.sharding, mesh_sym[mt.mesh], _rank(mt.tensor))}
            a.set_type(mt.tensor)
        for call in self.calls:
            self._rewrite_call(call, modules)
        for t in self.transfers:
            self._rewrite_transfer(t, devices, mesh_sym)
        ftype = ir.FunctionType.get([a.type for a in block.arguments],
                                    [v.type for v in self.ret.operands])
        main.attributes["function_type"] = ir.TypeAttr.get(ftype)
        update_attr_dicts(main, "arg_attrs", changes)
        if "topology" in main.attributes:
            del main.attributes["topology"]

    def _rewrite_call(self, call: ir.Operation, modules: dict[tuple[str, str], str]) -> None:
        mesh = ir.StringAttr(call.attributes["mesh_name"]).value
        name = ir.FlatSymbolRefAttr(call.attributes["callee"]).value
        with ir.InsertionPoint(call), call.location:
            op = stablehlo.CustomCallOp(
                [self.value_mesh[r].tensor for r in call.results], list(call.operands),
                call_target_name=ir.StringAttr.get(c.FRAGMENT_CALL_TARGET),
                has_side_effect=ir.BoolAttr.get(False),
                api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1))
        op.operation.attributes[c.FRAGMENT_ATTR] = ir.FlatSymbolRefAttr.get(modules[(name, mesh)])
        for old, new in zip(call.results, op.results):
            old.replace_all_uses_with(new)
        call.erase()

    def _rewrite_transfer(self, t: ir.Operation, devices: dict[str, ir.Attribute],
                          mesh_sym: dict[str, str]) -> None:
        dst = self.value_mesh[t.results[0]]
        with ir.InsertionPoint(t), t.location:
            op = stablehlo.CustomCallOp(
                [dst.tensor], list(t.operands),
                call_target_name=ir.StringAttr.get(c.TRANSFER_TARGET),
                has_side_effect=ir.BoolAttr.get(False),
                api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1))
        op.operation.attributes[c.DEVICES_ATTR] = devices[dst.mesh]
        op.operation.attributes[c.SHARDING_ATTR] = _on_mesh(
            dst.sharding, mesh_sym[dst.mesh], _rank(dst.tensor))
        t.results[0].replace_all_uses_with(op.results[0])
        t.erase()

    def _drop_moved_meshes(self) -> None:
        """Erase the top-level ``sdy.mesh`` ops whose users all moved into fragment modules
        (functions that are not fragments are left alone, with their meshes)."""
        still_used: set[str] = set()
        for view in self.module.body.operations:
            fn = view.operation
            if fn.name == "func.func" and fn != self.main:
                still_used.update(c.referenced_meshes(fn, set(self.sdy_meshes)))
        for sym, mesh in self.sdy_meshes.items():
            if sym not in still_used:
                mesh.erase()

    def _set_module_attrs(self, tasks: dict[str, dict]) -> None:
        attrs = self.module.operation.attributes
        if MESHES_ATTR in attrs:  # now spelled out as mm.devices everywhere
            del attrs[MESHES_ATTR]
        attrs[c.TASKS_ATTR] = py_to_attr({k: tasks[k] for k in sorted(tasks)})
        if c.NUM_DEVICES_ATTR not in attrs:
            top = max(p for ps in self.positions.values() for p in ps)
            attrs[c.NUM_DEVICES_ATTR] = py_to_attr(top + 1)


def _example(shapes: dict[str, ir.Attribute]) -> str:
    parts, start = [], 0
    for mesh in sorted(shapes):
        n = prod(_axes(shapes[mesh])[1])
        parts.append(f"{mesh}={start}-{start + n - 1}" if n > 1 else f"{mesh}={start}")
        start += n
    return ";".join(parts)


def _task_of(call: ir.Operation, mesh: str) -> tuple[str, int]:
    names: list[str] = []
    count = 0
    for o in ir.ArrayAttr(call.attributes["origin"]):
        u = mpmd.UserOriginAttr(o)
        if u.user_name not in names:
            names.append(u.user_name)
        count = max(count, u.transpose_count)
    return ("+".join(names) if names else mesh), count


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _own_mesh_first(frag: _Fragment, syms: list[str]) -> list[str]:
    """The ``sdy.mesh`` symbols a fragment names, the one its boundary shardings use first.

    That one becomes the fragment's ``mesh_shape`` in its module (the runtime reads a
    fragment's layouts against the first mesh there)."""
    for d in (*frag.args, *frag.results):
        sh = d.get("sdy.sharding")
        if sh is not None:
            ref = sdy.TensorShardingAttr(sh).mesh_or_ref
            if isinstance(ref, ir.FlatSymbolRefAttr):
                own = ir.FlatSymbolRefAttr(ref).value
                return [own, *(s for s in syms if s != own)]
    if "mesh" in syms:
        return ["mesh", *(s for s in syms if s != "mesh")]
    return syms


def _is_empty(mesh: ir.Attribute) -> bool:
    return not len(sdy.MeshAttr(mesh).axes)


def _to_fragment_main(fn: ir.Operation, frag: _Fragment, mesh_ref: str) -> None:
    """The nested module's public ``@main``: explicit shardings, no partitioner extras."""
    fn.attributes["sym_name"] = ir.StringAttr.get("main")
    fn.attributes["sym_visibility"] = ir.StringAttr.get("public")
    for key in _DROPPED_FUNC_ATTRS:
        if key in fn.attributes:
            del fn.attributes[key]
    set_attr_dicts(fn, "arg_attrs", _boundary_dicts(frag.args, frag.in_types, mesh_ref))
    set_attr_dicts(fn, "res_attrs", _boundary_dicts(frag.results, frag.out_types, mesh_ref))


def _boundary_dicts(dicts: list[dict[str, ir.Attribute]], types: list[ir.Type],
                    mesh_ref: str) -> list[dict[str, ir.Attribute]]:
    """Each boundary value's attributes with an explicit sharding and without the
    donation and memory-kind attributes the partitioner leaves."""
    out = []
    for d, t in zip(dicts, types):
        d = {k: v for k, v in d.items()
             if k not in _DONATION_ATTRS and k not in _MEMORY_KIND_ATTRS}
        if "sdy.sharding" not in d:
            d["sdy.sharding"] = _replicated(mesh_ref, _rank(t))
        out.append(d)
    return out
