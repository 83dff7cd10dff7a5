"""``mm-propagate-shardings``: Shardy propagation inside each fragment, one mesh at a time."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import AttrsKey, attr_entries, mesh_attrs, update_attr_dicts
from multimesh._src.layouts import translate_dims
from multimesh._src.mlir import attr_to_py, ir, passmanager, sdy

from . import _contract as c
from ._microbatch_rows import MicrobatchRows
from .base import ModulePass, verify_each_pass

SHARDING = "sdy.sharding"


@dataclass(frozen=True)
class PropagateShardingsPass(ModulePass):
    """Run ``sdy-propagation-pipeline`` on every fragment in its own module.

    Shardy needs every mesh of a module to have one device count, so each
    fragment is propagated alone, on its task's mesh. Fragments are visited in
    ``@main`` order; an argument that receives a value already laid out on an
    equivalent mesh (same axis names and sizes) starts from that layout, so a
    forward fragment hands its residuals to the backward one with no reshard and a
    pipeline stage hands activations to the next with a pure device-to-device
    copy. Afterwards every fragment argument and result carries a closed
    ``sdy.sharding``, and every ``@main`` argument carries ``mm.sharding`` and
    ``mm.devices`` (the layout of its first consumer), which is where the program wants its inputs.
    A boundary sharding that does not divide its dimension (5 rows over 2 devices) takes
    its longest dividing prefix (``sdy-update-non-divisible-input-output-shardings``), as
    XLA does for ``jax.jit``'s own arguments and results; inside the fragment XLA pads.

    An ``@main`` argument that already carries ``mm.sharding``/``mm.devices`` (a
    physical input sharding the caller gave) keeps them: the program takes that
    input there. A consumer over the same devices whose mesh can express that layout
    starts from it (so it needs no transfer); other consumers get a transfer from
    ``mm-insert-transfers``.

    A microbatch keeps its batch's layout. A loop fragment slices microbatch ``i`` out
    of the full batch (``dynamic_slice`` at ``i * size``); when the batch arrives with
    the cut dimension sharded, that slice would gather it onto every device. So before
    such a fragment is propagated, the batch is split once per step by a new fragment
    before the loop, ``@<task>_microbatches``: a reshape to ``(n, size)`` along the cut
    whose result carries the cut dimension's mesh axes on ``size``, and the loop
    fragment picks microbatch ``i`` along ``n`` (the rows are the same).
    """

    argument = "mm-propagate-shardings"
    summary = "Propagate shardings inside each fragment with Shardy, one submesh at a time."
    consumes = ("mpmd",)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            _Propagation(module).run()


_Placed = tuple[str, ir.Attribute, ir.Attribute]
"""Where a value lives, as the IR says it: (mesh symbol, sharding attr, devices attr)."""


class _Propagation:
    """One run of the pass: fragments in ``@main`` order, each handing its layouts on."""

    def __init__(self, module: ir.Module) -> None:
        self.main = c.main_func(module)
        self.funcs = c.func_by_name(module)
        self.meshes = mesh_attrs(module)
        self.layout: dict[ir.Value, _Placed] = {}  # as laid out where the value lives
        self.pinned = _pinned_args(self.main, self.meshes)  # inputs the caller placed
        self.calls = c.fragment_calls(self.main)
        self.rows = MicrobatchRows(self.main, self.funcs, self.meshes)
        # A boundary sharding that does not divide its dimension (5 rows over 2 devices)
        # becomes its longest dividing prefix, as XLA makes jax.jit's own inputs and
        # outputs: XLA pads only inside a module, never at its arguments or results.
        self.pm = passmanager.PassManager.parse(
            "builtin.module(sdy-aggressive-propagate,"
            "sdy-update-non-divisible-input-output-shardings)")
        self.pm.enable_verifier(verify_each_pass())  # the pipeline verifies the result

    def run(self) -> None:
        self._check_fragments()
        for call in self.calls:
            self._fragment(call)
        self._place_main_args()

    def _check_fragments(self) -> None:
        """Check every fragment before Shardy sees any (it may crash on bad input)."""
        names = [c.callee_of(call) for call in self.calls]
        self.infos = {n: c.fragment_info(self.funcs[n], self.meshes) for n in names}
        self.scans: dict[str, list[str]] = {}
        for n in self.infos:  # one walk each: meshes named inside, Shardy-internal ops
            self.scans[n], internal = c.scan_fragment(self.funcs[n], set(self.meshes))
            c.reject_internal_sdy_ops(self.funcs[n], internal, scanned=True)

    def _hints(self, call: ir.Operation, mesh_sym: str, devices: ir.Attribute) -> list:
        """Per operand, the layout the fragment should start from (None: Shardy's choice)."""
        mesh = self.meshes[mesh_sym]
        hints: list[ir.Attribute | None] = []
        for v in call.operands:
            src = self.layout.get(v)
            if v in self.pinned:
                hints.append(_pinned_hint(self.pinned[v], mesh_sym, mesh, devices))
            elif src is not None and _same_shape(self.meshes[src[0]], mesh):
                hints.append(_rebase(src[1], mesh_sym))
            else:
                hints.append(None)
        return hints

    def _fragment(self, call: ir.Operation) -> None:
        name = c.callee_of(call)
        fn = self.funcs[name]
        info = self.infos[name]
        mesh_sym, devs = info.mesh, info.devices_attr
        assert mesh_sym is not None  # fragment_info was given the meshes
        hints = self._hints(call, mesh_sym, devs)
        for split in self.rows.split(call, hints):  # a sharded batch, cut by the loop
            hints[split.number] = split.layout
            self.layout[split.value] = (mesh_sym, split.layout, devs)
            if isinstance(split.source.owner, ir.Block):
                self.layout.setdefault(split.source, (mesh_sym, split.source_layout, devs))
        done = _propagate(fn, mesh_sym, self.meshes, self.scans[name], hints, self.pm)
        arg_sh = _shardings(done, "arg_attrs", len(call.operands), mesh_sym)
        res_sh = _shardings(done, "res_attrs", len(call.results), mesh_sym)
        done.erase()
        # Only the boundary is kept: XLA re-propagates inside the body at compile
        # time, exactly as for a plain jax module.
        _write(fn, "arg_attrs", arg_sh)
        _write(fn, "res_attrs", res_sh)
        for v, sh in zip(call.operands, arg_sh):
            if isinstance(v.owner, ir.Block) and v not in self.layout:
                self.layout[v] = (mesh_sym, sh, devs)
        for r, sh in zip(call.results, res_sh):
            self.layout[r] = (mesh_sym, sh, devs)

    def _place_main_args(self) -> None:
        """Each unpinned ``@main`` argument goes where its first consumer wants it."""
        changes = {a.arg_number: {c.SHARDING_ATTR: self.layout[a][1],
                                  c.DEVICES_ATTR: self.layout[a][2]}
                   for a in c.entry_block(self.main).arguments
                   if a in self.layout and a not in self.pinned}
        update_attr_dicts(self.main, "arg_attrs", changes)


# a caller-given layout: (devices, axis names, axis sizes, per-dim axes)
_Pin = tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[tuple[str, ...], ...]]


def _pinned_args(main, meshes) -> dict[ir.Value, _Pin]:
    """``@main`` arguments with a caller-given layout."""
    out: dict[ir.Value, _Pin] = {}
    for a, d in zip(c.entry_block(main).arguments, attr_entries(main, "arg_attrs")):
        if c.SHARDING_ATTR not in d or c.DEVICES_ATTR not in d:
            continue
        c.check_placement(d[c.DEVICES_ATTR], d[c.SHARDING_ATTR], meshes,
                          f"@main argument #{a.arg_number}", main.location)
        ts = sdy.TensorShardingAttr(d[c.SHARDING_ATTR])
        mesh = ts.mesh_or_ref
        mesh = sdy.MeshAttr(meshes[mesh.value] if isinstance(mesh, ir.FlatSymbolRefAttr)
                            else mesh)
        dims = tuple(tuple(sdy.AxisRefAttr(x).name
                           for x in sdy.DimensionShardingAttr(dim).axes)
                     for dim in ts.dimension_shardings)
        out[a] = (tuple(attr_to_py(d[c.DEVICES_ATTR])),
                  tuple(sdy.MeshAxisAttr(x).name for x in mesh.axes),
                  tuple(sdy.MeshAxisAttr(x).size for x in mesh.axes), dims)
    return out


def _pinned_hint(pin: _Pin, mesh_sym, mesh, devices_attr) -> ir.Attribute | None:
    """The pinned layout on the consumer's mesh, if that mesh can express it."""
    m = sdy.MeshAttr(mesh)
    dims = translate_dims(pin[0], pin[1], pin[2], pin[3], attr_to_py(devices_attr),
                          [sdy.MeshAxisAttr(x).name for x in m.axes],
                          [sdy.MeshAxisAttr(x).size for x in m.axes])
    if dims is None:
        dims = _by_axis_name(pin, m)
    if dims is None:
        return None
    return sdy.TensorShardingAttr.get(
        mesh_sym, [sdy.DimensionShardingAttr.get([sdy.AxisRefAttr.get(x) for x in axes],
                                                 is_closed=True) for axes in dims])


def _by_axis_name(pin: _Pin, mesh) -> tuple[tuple[str, ...], ...] | None:
    """The pinned spec on a consumer whose mesh has every axis it names, with the
    same sizes: an input laid out on the global mesh (over ``model``, replicated over
    ``stage``) goes to a stage's slice with the same spec on the kept axes."""
    sizes = {sdy.MeshAxisAttr(x).name: sdy.MeshAxisAttr(x).size for x in mesh.axes}
    pin_sizes = dict(zip(pin[1], pin[2], strict=True))
    used = {a for dim in pin[3] for a in dim}
    if not used or any(sizes.get(a) != pin_sizes.get(a) for a in used):
        return None
    return pin[3]


def _same_shape(a: ir.Attribute, b: ir.Attribute) -> bool:
    return str(a) == str(b)


def _rebase(sharding: ir.Attribute, mesh_sym: str) -> ir.Attribute:
    ts = sdy.TensorShardingAttr(sharding)
    return sdy.TensorShardingAttr.get(
        mesh_sym, list(ts.dimension_shardings), replicated_axes=list(ts.replicated_axes))


def _propagate(fn, mesh_sym, meshes, referenced, hints, pm) -> ir.Operation:
    name = c.func_name(fn)
    tmp = ir.Module.create(fn.location)
    with ir.InsertionPoint(tmp.body), fn.location:
        sdy.MeshOp(mesh_sym, meshes[mesh_sym])
    for other in referenced:
        if other != mesh_sym:
            with ir.InsertionPoint(tmp.body), fn.location:
                sdy.MeshOp(other, meshes[other])
    clone = fn.clone(ip=ir.InsertionPoint(tmp.body))
    clone.attributes["sym_name"] = ir.StringAttr.get("main")
    clone.attributes["sym_visibility"] = ir.StringAttr.get("public")
    update_attr_dicts(clone, "arg_attrs",
                      {i: {SHARDING: h} for i, h in enumerate(hints) if h is not None})
    try:
        pm.run(tmp.operation)
    except ir.MLIRError as e:
        d = e.error_diagnostics[0] if e.error_diagnostics else None
        raise DiagnosticError(
            f"sharding propagation failed in fragment '{name}': {d.message if d else e}",
            d.location if d else fn.location) from None
    new_main = None
    for op in tmp.body.operations:
        if op.operation.name == "func.func":
            new_main = op.operation
    assert new_main is not None  # the module holds the one function it was given
    return new_main.detach_from_parent().operation


def _shardings(fn, which: str, n: int, mesh_sym: str) -> list[ir.Attribute]:
    out = []
    attrs = list(fn.attributes[which]) if which in fn.attributes else [None] * n
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    types = ftype.inputs if which == "arg_attrs" else ftype.results
    for i in range(n):
        a = attrs[i] if i < len(attrs) else None
        sh = None
        if a is not None:
            d = ir.DictAttr(a)
            if SHARDING in d:
                sh = d[SHARDING]
        if sh is None:
            rank = len(ir.RankedTensorType(types[i]).shape) if _ranked(types[i]) else 0
            sh = sdy.TensorShardingAttr.get(
                mesh_sym, [sdy.DimensionShardingAttr.get([], is_closed=True)] * rank)
        out.append(_close(sh, mesh_sym))
    return out


def _ranked(t) -> bool:
    try:
        ir.RankedTensorType(t)
        return True
    except (ValueError, TypeError):
        return False


def _close(sh: ir.Attribute, mesh_sym: str) -> ir.Attribute:
    ts = sdy.TensorShardingAttr(sh)
    dims = [sdy.DimensionShardingAttr.get(list(d.axes), is_closed=True)
            for d in (sdy.DimensionShardingAttr(x) for x in ts.dimension_shardings)]
    return sdy.TensorShardingAttr.get(mesh_sym, dims)


def _write(fn: ir.Operation, which: AttrsKey, shardings: list[ir.Attribute]) -> None:
    update_attr_dicts(fn, which, {i: {SHARDING: sh} for i, sh in enumerate(shardings)})
