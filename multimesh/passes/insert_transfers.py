"""``mm-insert-transfers``: an explicit ``mm.transfer`` on every edge that moves or reshards."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import attr_entries, mesh_attrs
from multimesh._src.layouts import layout_key
from multimesh._src.mlir import attr_to_py, ir, sdy, stablehlo

from . import _contract as c
from .base import ModulePass


@dataclass(frozen=True)
class InsertTransfersPass(ModulePass):
    """Make every cross-submesh or resharding edge of ``@main`` an explicit op.

    Input is the MPMD form after ``mm-propagate-shardings``: a value lives where its
    producer put it (a fragment result's ``sdy.sharding`` on the fragment's
    ``mm.devices``, or an argument's ``mm.sharding``/``mm.devices``). Where a
    consuming fragment wants another device set or layout, the pass inserts

        %t = stablehlo.custom_call @mm.transfer(%v)
               {mm.devices = [...], mm.sharding = #sdy.sharding<@mesh_b, ...>}

    right after the producer, so the copy can start as early as possible, and
    rewires the consumer to ``%t``. One transfer per value and destination layout.
    Two layouts are the same when every device holds the same piece of the value,
    whatever the mesh axes are called (``layout_key`` in ``multimesh/_src/layouts.py``).
    """

    argument = "mm-insert-transfers"
    summary = "Insert an explicit `mm.transfer` on every edge that changes devices or sharding."
    consumes = ("mpmd",)
    requires = ("mm-propagate-shardings",)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            main = c.main_func(module)
            funcs = c.func_by_name(module)
            meshes = mesh_attrs(module)
            block = c.entry_block(main)
            where: dict[ir.Value, tuple] = {}
            for a, d in zip(block.arguments, attr_entries(main, "arg_attrs")):
                if c.SHARDING_ATTR in d and c.DEVICES_ATTR in d:
                    c.check_placement(d[c.DEVICES_ATTR], d[c.SHARDING_ATTR], meshes,
                                      f"@main argument #{a.arg_number}", main.location)
                    where[a] = _layout(d[c.DEVICES_ATTR], d[c.SHARDING_ATTR], meshes)
            edges = _Edges(funcs, meshes)
            for op in [o.operation for o in block.operations]:
                if op.name == "func.call":
                    edges.call(op, where)
                elif c.is_custom_call(op, c.LOOP_TARGET):
                    _loop(op, where, edges, funcs)
            edges.insert(block)


class _Edges:
    """The transfers a block needs: one per (value, destination layout)."""

    def __init__(self, funcs, meshes):
        self.funcs = funcs
        self.meshes = meshes
        self.plans = []  # (consumer call, operand index, value, layout, sharding, devices)

    def wants(self, call: ir.Operation, k: int):
        """(layout, sharding, devices) that fragment argument ``k`` of ``call`` wants."""
        fn = self.funcs[c.callee_of(call)]
        devs = c.fragment_info(fn, self.meshes).devices_attr
        arg_attrs = attr_entries(fn, "arg_attrs")
        if k >= len(arg_attrs) or "sdy.sharding" not in arg_attrs[k]:
            raise DiagnosticError(
                f"fragment '@{c.callee_of(call)}' argument #{k} has no sdy.sharding; "
                f"run mm-propagate-shardings first", call.location)
        sh = arg_attrs[k]["sdy.sharding"]
        return _layout(devs, sh, self.meshes), sh, devs

    def call(self, call: ir.Operation, where: dict, hoist=None) -> None:
        fn = self.funcs[c.callee_of(call)]
        for k, v in enumerate(call.operands):
            want, sh, devs = self.wants(call, k)
            have = where.get(v)
            if have is not None and have != want:
                if hoist is not None and hoist(call, k, v, want, sh, devs):
                    continue
                self.plans.append((call, k, v, want, sh, devs))
        devs = c.fragment_info(fn, self.meshes).devices_attr
        res_attrs = list(fn.attributes["res_attrs"]) if "res_attrs" in fn.attributes else []
        for j, (r, ra) in enumerate(zip(call.results, res_attrs)):
            if "sdy.sharding" not in ir.DictAttr(ra):
                raise DiagnosticError(
                    f"fragment '@{c.callee_of(call)}' result #{j} has no sdy.sharding; "
                    f"run mm-propagate-shardings first", call.location)
            where[r] = _layout(devs, ir.DictAttr(ra)["sdy.sharding"], self.meshes)

    def insert(self, block: ir.Block) -> None:
        made: dict[tuple, ir.Value] = {}
        for call, k, v, want, sh, devs in self.plans:
            key = (v, want)
            t = made.get(key)
            if t is None:
                t = _transfer(v, block, call.location, sh, devs)
                made[key] = t
            call.operands[k] = t
        self.plans = []


def _transfer(v: ir.Value, block: ir.Block | None, loc, sh, devs, ip=None) -> ir.Value:
    """``mm.transfer`` of ``v`` right after its producer (or at ``ip``)."""
    owner = v.owner
    if ip is None:
        if isinstance(owner, ir.Block):
            assert block is not None  # callers give the block of any block argument
            ip = ir.InsertionPoint.at_block_begin(block)
        else:
            ip = ir.InsertionPoint.after(owner)
    with ip, loc:
        op = stablehlo.CustomCallOp(
            [v.type], [v], call_target_name=ir.StringAttr.get(c.TRANSFER_TARGET),
            has_side_effect=ir.BoolAttr.get(False),
            api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1))
    op.operation.attributes[c.DEVICES_ATTR] = devs
    op.operation.attributes[c.SHARDING_ATTR] = sh
    return op.results[0]


def _loop(loop: ir.Operation, where: dict, edges: _Edges, funcs) -> None:
    """Transfers of a microbatch loop: inside its body per microbatch, except that an
    input of the loop that a body fragment wants elsewhere moves once, before the loop."""
    _LoopTransfers(loop, where, funcs).run(edges)


class _LoopTransfers:
    """One microbatch loop's transfers, and the loop inputs hoisted out of it."""

    def __init__(self, loop: ir.Operation, where: dict, funcs) -> None:
        self.loop = loop
        self.where = where
        self.body_fn, _ = c.loop_body(loop, funcs)
        self.body = c.entry_block(self.body_fn)
        self.ret = list(self.body.operations)[-1].operation
        self.n_carry = len(self.ret.operands)
        self.args = list(self.body.arguments)
        self.inner: dict[ir.Value, tuple] = {}  # body value -> layout
        self.outer_of: dict[ir.Value, ir.Value] = {}  # body argument -> loop operand
        for k, v in enumerate(loop.operands):
            a = self.args[1 + k]
            self.outer_of[a] = v
            if v in where:
                self.inner[a] = where[v]
        self.hoisted: dict[tuple, ir.Value] = {}  # (outer value, layout) -> new argument
        self.extra: list[ir.Value] = []  # new loop operands (transfers in @main)

    def hoist(self, call, k, v, want, sh, devs) -> bool:
        """Move a loop input once, before the loop, instead of every microbatch."""
        if v not in self.outer_of or self.args.index(v) <= self.n_carry:
            return False  # the index, a running sum, or a value made inside the loop
        key = (self.outer_of[v], want)
        a = self.hoisted.get(key)
        if a is None:
            outer = self.outer_of[v]
            owner = outer.owner
            ip = (ir.InsertionPoint(self.loop) if isinstance(owner, ir.Block)
                  else ir.InsertionPoint.after(owner))
            self.extra.append(_transfer(outer, None, call.location, sh, devs, ip=ip))
            a = self.body.add_argument(v.type, self.body_fn.location)
            self.hoisted[key] = a
            self.inner[a] = want
        call.operands[k] = a
        return True

    def run(self, edges: _Edges) -> None:
        inside = _Edges(edges.funcs, edges.meshes)
        for op in [o.operation for o in self.body.operations]:
            if op.name == "func.call":
                inside.call(op, self.inner, self.hoist)
        inside.insert(self.body)
        inner, ret = self.inner, self.ret
        for j, v in enumerate(ret.operands):  # a running sum keeps one layout
            a = self.args[1 + j]
            if inner.get(a) is not None and inner.get(v) is not None and inner[a] != inner[v]:
                raise DiagnosticError(
                    f"running sum #{j} of the microbatch loop changes layout between "
                    f"microbatches", self.loop.location)
        loop = self.loop
        if self.extra:
            loop = _add_loop_operands(loop, self.extra, self.body_fn)
        for j, r in enumerate(loop.results):
            if ret.operands[j] in inner:
                self.where[r] = inner[ret.operands[j]]


def _add_loop_operands(loop: ir.Operation, extra, body_fn) -> ir.Operation:
    """The loop op again, with ``extra`` operands (its body has the matching arguments)."""
    body = c.entry_block(body_fn)
    with ir.InsertionPoint(loop), loop.location:
        new = stablehlo.CustomCallOp(
            [r.type for r in loop.results], list(loop.operands) + list(extra),
            call_target_name=ir.StringAttr.get(c.LOOP_TARGET),
            has_side_effect=ir.BoolAttr.get(False),
            api_version=ir.IntegerAttr.get(ir.IntegerType.get_signless(32), 1)).operation
    for name in (c.BODY_ATTR, c.NUM_MICROBATCHES_ATTR, c.SCHEDULE_ATTR):
        if name in loop.attributes:
            new.attributes[name] = loop.attributes[name]
    for old, r in zip(loop.results, new.results):
        old.replace_all_uses_with(r)
    loop.erase()
    ftype = ir.FunctionType(ir.TypeAttr(body_fn.attributes["function_type"]).value)
    body_fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
        [a.type for a in body.arguments], list(ftype.results)))
    return new


def _layout(devices: ir.Attribute, sharding: ir.Attribute, meshes: dict[str, ir.Attribute]):
    """The device -> shard mapping of a value (see ``multimesh._src.layouts``)."""
    ts = sdy.TensorShardingAttr(sharding)
    ref = ts.mesh_or_ref
    mesh = sdy.MeshAttr(meshes[ref.value] if isinstance(ref, ir.FlatSymbolRefAttr) else ref)
    names = [sdy.MeshAxisAttr(a).name for a in mesh.axes]
    sizes = [sdy.MeshAxisAttr(a).size for a in mesh.axes]
    dims = [[sdy.AxisRefAttr(a).name for a in sdy.DimensionShardingAttr(d).axes]
            for d in ts.dimension_shardings]
    return layout_key(attr_to_py(devices), names, sizes, dims)
