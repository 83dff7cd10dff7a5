"""A microbatch keeps its batch's layout: the rows are split once per step, not gathered.

``microbatch`` traces its function on microbatch ``i`` of the full batch:
``dynamic_slice(batch, i * size)`` along the cut dimension. When the batch arrives
sharded along that dimension (its input sharding, a constraint before the loop),
microbatch ``i``'s rows all live on one shard, and a dynamic slice along a sharded
dimension makes XLA gather the whole batch onto every device: each microbatch then runs
unsplit on every device of the batch's mesh axes (twice ``jax.jit``'s per-device work
on a ``data`` axis of 2). Sharding propagation cannot help: a slice's rows are not the
batch's rows, so Shardy does not carry a sharding through the sliced dimension.

``mm-propagate-shardings`` calls :class:`MicrobatchRows` on each fragment before it
propagates it. For every argument that a loop fragment only slices by the microbatch
index, and whose layout shards the cut dimension, the batch is rearranged once per step
by a new fragment before the loop, ``@<task>_microbatches``: a reshape of
``(..., n * size, ...)`` to ``(..., n, size, ...)`` whose result carries the cut
dimension's mesh axes on the ``size`` dimension (XLA moves the rows with one
all-to-all). The loop fragment then takes that and picks microbatch ``i`` along the
unsharded ``n`` dimension (``dynamic_slice`` at ``i``, a reshape): its rows are split
exactly as the batch's are, and propagation carries that layout through the stage and
on to the next. Microbatch ``i`` is still rows ``[i * size, (i + 1) * size)``.

Only the axes whose product divides ``size`` move (a prefix of the cut dimension's
axes, major first); the others are dropped, with a warning: a microbatch cannot be split
into more pieces than it has rows, so every device of those axes runs it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.mlir import func, ir, sdy, stablehlo

from . import _contract as c

__all__ = ["MicrobatchRows", "Split"]


@dataclass(frozen=True)
class Split:
    """Operand ``number`` of a fragment call now reads ``value``, the split batch laid
    out as ``layout``; the batch, ``source``, is read by the split fragment laid out as
    ``source_layout`` (what the loop fragment wanted before)."""

    number: int
    value: ir.Value
    layout: ir.Attribute
    source: ir.Value
    source_layout: ir.Attribute


@dataclass(frozen=True)
class _Cut:
    """Microbatch ``i`` is ``size`` rows at ``i * size`` along ``dim``."""

    dim: int
    size: int


class MicrobatchRows:
    """The split batches of one run of ``mm-propagate-shardings``, each made once."""

    def __init__(self, main: ir.Operation, funcs: dict, meshes: dict) -> None:
        self.funcs = funcs
        self.meshes = meshes
        ops = [o.operation for o in c.entry_block(main).operations]
        self.index = {op.results[0] for op in ops if c.is_custom_call(op, c.INDEX_TARGET)}
        self.ncalls: dict[str, int] = {}
        for op in ops:
            if op.name == "func.call":
                self.ncalls[c.callee_of(op)] = self.ncalls.get(c.callee_of(op), 0) + 1
        self.made: dict[tuple, ir.Value] = {}

    def split(self, call: ir.Operation, hints: list) -> list[Split]:
        """Split the batches ``call``'s fragment slices by the microbatch index along a
        dimension their layout (``hints``, per operand; None: unknown) shards, and make
        the fragment pick its rows from the split batch. Returns what changed."""
        name = c.callee_of(call)
        if not self.index or self.ncalls.get(name) != 1:
            return []  # no loop; or a fragment called twice, whose calls must agree
        fn = self.funcs[name]
        if c.LOOP_DEVICES_ATTR in fn.attributes:
            return []  # placed per microbatch: a split before the loop has no one place
        args = c.entry_block(fn).arguments
        index_args = {args[k] for k, v in enumerate(call.operands) if v in self.index}
        out = []
        for k, v in enumerate(call.operands):
            if hints[k] is None or v in self.index or not self._outside_loop(v):
                continue
            cut = _cut_of(args[k], index_args)
            if cut is None:
                continue
            moved, dropped = _moved_layout(hints[k], cut, self.meshes)
            if dropped:
                _warn_unsplit(call, fn, cut, dropped)
            if moved is not None:
                with call.location:
                    out.append(self._rewrite(call, fn, k, cut, hints[k], moved))
        return out

    def _outside_loop(self, v: ir.Value) -> bool:
        """Whether ``v`` is made once per step: an ``@main`` argument or a result of a
        fragment outside the loop."""
        owner = v.owner
        if isinstance(owner, ir.Block):
            return True
        op = owner.operation
        if op.name != "func.call" or c.callee_of(op) not in self.funcs:
            return False
        tag = c.tag_of(self.funcs[c.callee_of(op)])
        return tag is not None and tag[2] < 0

    def _rewrite(self, call, fn, k: int, cut: _Cut, hint, moved) -> Split:
        source = call.operands[k]
        old = ir.RankedTensorType(source.type)
        shape = list(old.shape)
        shape[cut.dim:cut.dim + 1] = [shape[cut.dim] // cut.size, cut.size]
        split_type = ir.RankedTensorType.get(shape, old.element_type)
        key = (source, str(fn.attributes[c.MESH_ATTR]), str(fn.attributes[c.DEVICES_ATTR]),
               str(hint), cut)
        if key not in self.made:
            self.made[key] = self._split_call(call, fn, source, split_type, hint, moved)
        value = self.made[key]
        call.operands[k] = value
        _pick_rows(fn, k, cut, split_type)
        return Split(k, value, moved, source, hint)

    def _split_call(self, call, fn, source, split_type, hint, moved) -> ir.Value:
        """A fragment of ``fn``'s task, on its mesh and out of the loop, reshaping the
        batch ``source`` to ``split_type`` laid out as ``moved``; called before ``call``."""
        task = c.tag_of(fn)
        assert task is not None  # a loop fragment (the index reaches it) has its tag
        safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in task[0])
        name, n = f"{safe}_microbatches", 1
        while name in self.funcs:
            name, n = f"{safe}_microbatches_{n}", n + 1
        with ir.InsertionPoint(fn), fn.location:
            split = func.FuncOp(  # type: ignore[call-arg]  # stubs show the generated
                name, ir.FunctionType.get([source.type], [split_type]),  # FuncOp, not
                visibility="private")  # func.py's subclass, which adds these
            body = split.add_entry_block()  # type: ignore[attr-defined]  # (the same)
        with ir.InsertionPoint(body), fn.location:
            func.ReturnOp([stablehlo.ReshapeOp(split_type, body.arguments[0]).result])
        op = split.operation
        op.attributes[c.TASK_ATTR] = c.tag_attr(task[0], 0)
        for key in (c.DEVICES_ATTR, c.MESH_ATTR):
            op.attributes[key] = fn.attributes[key]
        op.attributes["arg_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get({"sdy.sharding": hint})])
        op.attributes["res_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get({"sdy.sharding": moved})])
        self.funcs[name] = op
        self.ncalls[name] = 1
        with ir.InsertionPoint(call), call.location:
            made = func.CallOp([split_type], ir.FlatSymbolRefAttr.get(name), [source]).operation
        made.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
        return made.results[0]


def _cut_of(arg: ir.BlockArgument, index_args: set) -> _Cut | None:
    """How ``arg`` is cut into microbatches, if every use of it slices microbatch ``i``
    out of it (``dynamic_slice`` at ``i * size`` along one dimension, whole along the
    others) the same way; else None."""
    uses = [u.owner for u in arg.uses]
    cuts = {_slice_cut(op, arg, index_args) for op in uses}
    if not uses or len(cuts) != 1 or None in cuts:
        return None
    return cuts.pop()


def _slice_cut(op, arg, index_args) -> _Cut | None:
    op = op.operation
    if op.name != "stablehlo.dynamic_slice" or op.operands[0] != arg:
        return None
    shape = ir.RankedTensorType(arg.type).shape
    sizes = list(ir.DenseI64ArrayAttr(op.attributes["slice_sizes"]))
    starts = list(op.operands)[1:]
    cut = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if len(cut) != 1 or shape[cut[0]] % sizes[cut[0]]:
        return None
    d = cut[0]
    if any(not _is_int(starts[e], 0) for e in range(len(shape)) if e != d):
        return None
    if _index_of(starts[d], sizes[d], index_args) is None:
        return None
    return _Cut(d, sizes[d])


def _constant(v: ir.Value):
    """The splat integer ``v`` holds if it is an integer constant, else None."""
    owner = v.owner
    if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.constant":
        return None
    value = ir.DenseElementsAttr(owner.operation.attributes["value"])
    splat = value.get_splat_value() if value.is_splat else None
    return splat.value if isinstance(splat, ir.IntegerAttr) else None


def _is_int(v: ir.Value, n: int) -> bool:
    return _constant(v) == n


def _index_of(v: ir.Value, size: int, index_args: set) -> ir.Value | None:
    """The microbatch index ``i`` if ``v`` is ``i * size``, else None."""
    owner = v.owner
    if isinstance(owner, ir.Block) or owner.operation.name != "stablehlo.multiply":
        return None
    a, b = owner.operation.operands
    for i, s in ((a, b), (b, a)):
        if i in index_args and _is_int(s, size):
            return i
    return None


def _axis_size(ref, mesh) -> int | None:
    """The size of an axis reference (None for a sub-axis, which is left alone)."""
    ref = sdy.AxisRefAttr(ref)
    if ref.sub_axis_info is not None:
        return None
    for a in sdy.MeshAttr(mesh).axes:
        if sdy.MeshAxisAttr(a).name == ref.name:
            return sdy.MeshAxisAttr(a).size
    return None


def _moved_layout(hint, cut: _Cut, meshes: dict) -> tuple[ir.Attribute | None, list]:
    """``hint`` (the batch's layout) for the split batch ``(..., n, size, ...)``: the cut
    dimension's axes that divide ``size`` on ``size``, ``n`` whole (None when the cut
    dimension is not sharded or no axis of it can move); and the ``(axis, size)`` of the
    cut dimension's axes that cannot move."""
    ts = sdy.TensorShardingAttr(hint)
    if len(ts.unreduced_axes):
        return None, []
    ref = ts.mesh_or_ref
    assert isinstance(ref, ir.FlatSymbolRefAttr)  # hints name their fragment's mesh
    dims = [sdy.DimensionShardingAttr(d) for d in ts.dimension_shardings]
    keep: list = []
    dropped: list[tuple[str, int | None]] = []
    product = 1
    for axis in dims[cut.dim].axes:
        size = _axis_size(axis, meshes[ref.value])
        if dropped or size is None or cut.size % (product * size):
            dropped.append((sdy.AxisRefAttr(axis).name, size))
            continue
        keep.append(axis)
        product *= size
    if not keep:
        return None, dropped

    def closed(refs):
        return sdy.DimensionShardingAttr.get(list(refs), is_closed=True)

    new = ([closed(d.axes) for d in dims[:cut.dim]] + [closed([]), closed(keep)]
           + [closed(d.axes) for d in dims[cut.dim + 1:]])
    return sdy.TensorShardingAttr.get(ref.value, new,
                                      replicated_axes=list(ts.replicated_axes)), dropped


def _warn_unsplit(call, fn, cut: _Cut, dropped: list) -> None:
    """The batch's rows are sharded over axes a microbatch is too small to be split over."""
    task = c.tag_of(fn)
    axes = ", ".join(f"'{a}' ({n} devices)" if n else f"'{a}'" for a, n in dropped)
    c.warn_at(call.location,
              f"the microbatches of {cut.size} row{'s' * (cut.size != 1)} cannot be split over mesh axes {axes} of "
              f"task '{task[0] if task else c.callee_of(call)}', which shard the batch's "
              f"dimension {cut.dim}: every device of those axes runs each microbatch's rows "
              f"whole, repeating its neighbours' work; choose a microbatch size those axes "
              f"divide, or shard the batch over fewer devices")


def _pick_rows(fn: ir.Operation, k: int, cut: _Cut, split_type) -> None:
    """Make ``fn``'s argument ``k`` the split batch: each microbatch slice of it becomes
    ``reshape(dynamic_slice(split, [.., i, 0, ..], [.., 1, size, ..]))``."""
    arg = c.entry_block(fn).arguments[k]
    arg.set_type(split_type)
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    inputs = list(ftype.inputs)
    inputs[k] = split_type
    fn.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get(inputs, list(ftype.results)))
    for op in [u.owner.operation for u in arg.uses]:
        starts = list(op.operands)[1:]
        product = starts[cut.dim].owner.operation
        index = next(v for v in product.operands if not _is_int(v, cut.size))
        sizes = list(ir.DenseI64ArrayAttr(op.attributes["slice_sizes"]))
        with ir.InsertionPoint(op), op.location:
            zero = stablehlo.ConstantOp(ir.DenseElementsAttr.get_splat(
                ir.RankedTensorType(index.type), ir.IntegerAttr.get(
                    ir.RankedTensorType(index.type).element_type, 0))).result
            picked = stablehlo.DynamicSliceOp(
                arg, starts[:cut.dim] + [index, zero] + starts[cut.dim + 1:],
                ir.DenseI64ArrayAttr.get(sizes[:cut.dim] + [1, cut.size] + sizes[cut.dim + 1:]))
            rows = stablehlo.ReshapeOp(op.results[0].type, picked.result)
        for new in (zero.owner.operation, picked.operation, rows.operation):
            if c.TASK_ATTR in op.attributes:
                new.attributes[c.TASK_ATTR] = op.attributes[c.TASK_ATTR]
        op.results[0].replace_all_uses_with(rows.result)
        op.erase()
        _erase_if_dead(product)


def _erase_if_dead(op: ir.Operation) -> None:
    """Erase ``op`` (and then its constant operands) once nothing reads it."""
    if any(True for r in op.results for _ in r.uses):
        return
    operands = [v.owner.operation for v in op.operands if not isinstance(v.owner, ir.Block)]
    op.erase()
    for o in operands:
        if o.name == "stablehlo.constant":
            _erase_if_dead(o)
