"""``mm-merge-fragments``: consecutive fragments on one submesh become one fragment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import attr_entries
from multimesh._src.mlir import func, ir

from . import _contract as c
from .base import ModulePass
from .schedule_fragments import find_loop, loop_calls, read_loop

__all__ = ["MergeFragmentsPass", "SCOPES"]

SCOPES = ("one-submesh", "all")
"""``scope``: merge only in a program whose fragments all run on one submesh, or in
every program (also the last stage's forward and backward of 1F1B, ...)."""

_KEPT = (c.DEVICES_ATTR, c.MESH_ATTR, c.TASK_ATTR, c.LOOP_DEVICES_ATTR)


@dataclass(frozen=True)
class MergeFragmentsPass(ModulePass):
    """Merge each run of consecutive fragment calls on one submesh into one fragment.

    Input is the MPMD form after ``mm-propagate-shardings`` (and after
    ``mm-schedule-fragments`` for a microbatched program), before
    ``mm-insert-transfers``. A *run* is a sequence of fragment calls, adjacent in
    ``@main`` (or in the microbatch loop's body), on the same ``mm.devices`` and
    ``mm.mesh``, where every value one of them hands to a later one arrives in the
    sharding the later one wants (no transfer, not even a resharding one, would sit
    between them). A run of two or more becomes one call of a new fragment whose
    body is the run's bodies in order: the run's outside operands are its arguments
    (one per value and sharding; a running sum keeps its ``jax.buffer_donor`` when
    the run reads it once), and only the results used after the run are returned;
    values used only inside the run (a forward's residuals read by its backward)
    stay internal, never written out. The new fragment runs on the run's
    ``mm.devices``, ``mm.mesh`` and ``mm.loop_devices`` and is named after its parts
    (``stage0_fwd`` + ``stage0_bwd``: ``stage0_fwd_bwd``). Its ``mm.task`` is the last
    fragment's outside the loop (a forward and backward merged hand out gradients, not
    activations, to the memory accounting) and the first's inside it (the schedule
    sees one forward unit per stage and microbatch, and places the stage by it).
    Fragments no call uses any longer are removed.

    Inside the microbatch loop, a run's calls merge only where the loop's
    ``mm.schedule`` lets them: the merged call takes the place of the run's last call
    for each microbatch, so no call the schedule runs between the run's first and
    last may read a result of the run, and, in a loop over several submeshes, none
    may run on the run's submesh (the schedule runs the run back to back there: the
    last stage's forward and backward under 1F1B, not ZB's deferred weight halves). The schedule's order is rewritten for the
    merged body (one unit per merged run and microbatch).

    ``scope=one-submesh`` (the default) merges only in a program whose every
    fragment runs on the same submesh (a one-stage pipeline plan, or a microbatch
    loop over one task): such a program becomes one fragment call per step (one per
    microbatch, and the loop's initial and final fragments, with a loop).
    ``scope=all`` merges runs in every program, e.g. a pipeline's last stage's
    forward and backward under 1F1B; the identical-fragment compile sharing between
    stages may then be lost (docs/performance.md measures when it pays). The
    pipeline leaves the pass out for a program with ``remat=True`` tasks: their
    backwards recompute the forward's residuals, and in one XLA program with the
    forward the recomputed values would be computed once and kept, undoing the remat.
    """

    argument = "mm-merge-fragments"
    summary = "Merge consecutive fragment calls on one submesh into one fragment call."
    consumes = ("mpmd",)
    requires = ("mm-propagate-shardings",)

    scope: str = "one-submesh"
    """``one-submesh`` (only a program whose fragments all run on one submesh) or ``all``."""

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise self.bad_option("scope", f"one of {', '.join(SCOPES)}")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            funcs = c.func_by_name(module)
            main = c.main_func(module)
            loop = find_loop(module)
            body = c.loop_body(loop, funcs)[0] if loop is not None else None
            blocks = [c.entry_block(main)] + ([c.entry_block(body)] if body else [])
            if self.scope == "one-submesh" and len({_key(funcs, op) for b in blocks
                                                    for op in _calls(b)}) > 1:
                return
            merger = _Merger(module, funcs)
            for run in _runs(c.entry_block(main), funcs):
                merger.merge(run)
            if loop is not None and body is not None:
                _merge_loop(module, loop, body, merger)
            merger.drop_unused()


# ---------------------------------------------------------------------------- runs


def _calls(block: ir.Block) -> list[ir.Operation]:
    return [o.operation for o in block.operations if o.operation.name == "func.call"
            and c.FRAGMENT_ATTR in o.operation.attributes]


def _key(funcs: dict[str, ir.Operation], call: ir.Operation) -> tuple:
    """Where a fragment call runs: its devices, mesh and loop devices, as written."""
    fn = funcs[c.callee_of(call)]
    return tuple(str(fn.attributes[k]) if k in fn.attributes else None
                 for k in (c.DEVICES_ATTR, c.MESH_ATTR, c.LOOP_DEVICES_ATTR))


def _sharding(entries: list[ir.DictAttr], k: int) -> str | None:
    d = entries[k] if k < len(entries) else None
    return str(d["sdy.sharding"]) if d is not None and "sdy.sharding" in d else None


def _fits(funcs: dict[str, ir.Operation], run: list[ir.Operation], call: ir.Operation) -> bool:
    """Whether ``call`` extends ``run``: same submesh, and every value the run hands it
    arrives in the sharding it wants (no transfer between them)."""
    if _key(funcs, call) != _key(funcs, run[0]):
        return False
    made: dict[ir.Value, tuple[ir.Operation, int]] = {
        r: (p, j) for p in run for j, r in enumerate(p.results)}
    want = attr_entries(funcs[c.callee_of(call)], "arg_attrs")
    for k, v in enumerate(call.operands):
        if v in made:
            p, j = made[v]
            have = attr_entries(funcs[c.callee_of(p)], "res_attrs")
            if _sharding(have, j) != _sharding(want, k):
                return False
    return True


def _runs(block: ir.Block, funcs: dict[str, ir.Operation]) -> list[list[ir.Operation]]:
    """The block's runs of two or more adjacent fragment calls that may merge."""
    out: list[list[ir.Operation]] = []
    run: list[ir.Operation] = []
    for view in block.operations:
        op = view.operation
        is_call = op.name == "func.call" and c.FRAGMENT_ATTR in op.attributes
        if is_call and run and _fits(funcs, run, op):
            run.append(op)
            continue
        if len(run) > 1:
            out.append(run)
        run = [op] if is_call else []
    if len(run) > 1:
        out.append(run)
    return out


# ---------------------------------------------------------------------------- merging


class _Merger:
    """Builds the merged fragments and rewrites the calls."""

    def __init__(self, module: ir.Module, funcs: dict[str, ir.Operation]) -> None:
        self.module, self.funcs = module, funcs
        self.parts: set[str] = set()  # the fragments merged into others

    def merge(self, run: Sequence[ir.Operation], *, in_loop: bool = False) -> ir.Operation:
        """Replace ``run`` by one call of a new fragment; the new call. ``in_loop``: the
        new fragment takes the first fragment's ``mm.task`` (else the last's)."""
        inside = set(run)
        args, arg_attrs, where = self._arguments(run)
        fn = self._new_function(run, run[0] if in_loop else run[-1])
        block = fn.regions[0].blocks[0]
        with ir.InsertionPoint(block), fn.location:
            end = func.ReturnOp([]).operation  # what the bodies are moved before
        for v in args:
            block.add_argument(v.type, fn.location)
        value: dict = {}  # a run call's result -> its value inside the merged body
        for op in run:
            self._inline(op, end, [block.arguments[where[(op, k)]]
                                     if (op, k) in where else value[v]
                                     for k, v in enumerate(op.operands)], value)
        outs: list[tuple[ir.Operation, int, ir.Value]] = [
            (op, j, r) for op in run for j, r in enumerate(op.results)
            if any(u.owner not in inside for u in r.uses)]
        res_attrs = [self._result_attr(op, j) for op, j, _ in outs]
        with ir.InsertionPoint(end), fn.location:
            func.ReturnOp([value[r] for _, _, r in outs])
        end.erase()
        fn.attributes["arg_attrs"] = ir.ArrayAttr.get(arg_attrs)
        fn.attributes["res_attrs"] = ir.ArrayAttr.get(res_attrs)
        fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [v.type for v in args], [r.type for _, _, r in outs]))
        with ir.InsertionPoint(run[-1]), run[-1].location:
            new = func.CallOp([r.type for _, _, r in outs], ir.FlatSymbolRefAttr.get(
                c.func_name(fn)), args).operation
        new.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
        for (_, _, old), r in zip(outs, new.results):
            old.replace_all_uses_with(r)
        for op in reversed(run):
            op.erase()
        return new

    def _arguments(self, run: Sequence[ir.Operation]):
        """The run's outside operands (one per value and wanted sharding), their
        argument attributes, and ``(call, operand number) -> argument number``."""
        made = {r for op in run for r in op.results}
        args: list[ir.Value] = []
        attrs: list[ir.DictAttr] = []
        index: dict = {}
        where: dict = {}
        count: dict = {}
        for op in run:
            for v in op.operands:
                if v not in made:
                    count[v] = count.get(v, 0) + 1
        for op in run:
            want = attr_entries(self.funcs[c.callee_of(op)], "arg_attrs")
            for k, v in enumerate(op.operands):
                if v in made:
                    continue
                entry = want[k] if k < len(want) else ir.DictAttr.get({})
                key = (v, _sharding(want, k))
                if key not in index:
                    index[key] = len(args)
                    args.append(v)
                    attrs.append(entry if count[v] == 1 else _without_donor(entry))
                where[(op, k)] = index[key]
        return args, attrs, where

    def _result_attr(self, op: ir.Operation, n: int) -> ir.DictAttr:
        entries = attr_entries(self.funcs[c.callee_of(op)], "res_attrs")
        return entries[n] if n < len(entries) else ir.DictAttr.get({})

    def _new_function(self, run: Sequence[ir.Operation], tagged: ir.Operation) -> ir.Operation:
        first = self.funcs[c.callee_of(run[0])]
        name = _merged_name([c.callee_of(op) for op in run], self.funcs)
        with ir.InsertionPoint(first), first.location:
            fn = func.FuncOp(  # type: ignore[call-arg]  # the bindings' stubs lag
                name, ir.FunctionType.get([], []), visibility="private").operation
        fn.regions[0].blocks.append()
        for key in _KEPT:
            if key in first.attributes:
                fn.attributes[key] = first.attributes[key]
        fn.attributes[c.TASK_ATTR] = self.funcs[c.callee_of(tagged)].attributes[c.TASK_ATTR]
        self.funcs[name] = fn
        return fn

    def _inline(self, call: ir.Operation, end: ir.Operation, operands: list, value: dict) -> None:
        """Move a copy of ``call``'s fragment body before ``end``, its arguments
        replaced by ``operands``; its results' values into ``value``."""
        self.parts.add(c.callee_of(call))
        fn = self.funcs[c.callee_of(call)]
        copy = fn.clone(ip=ir.InsertionPoint(fn))
        src = copy.regions[0].blocks[0]
        for a, v in zip(list(src.arguments), operands):
            a.replace_all_uses_with(v)
        ops = [o.operation for o in src.operations]
        for o in ops[:-1]:
            o.move_before(end)
        for r, v in zip(call.results, ops[-1].operands):
            value[r] = v
        copy.erase()

    def drop_unused(self) -> None:
        """Remove the fragments no call names any more."""
        used: set[str] = set()

        def cb(op):
            if op.name == "func.call":
                used.add(c.callee_of(op))
            return ir.WalkResult.ADVANCE

        self.module.operation.walk(cb, ir.WalkOrder.PRE_ORDER)
        for name in sorted(self.parts - used):
            self.funcs.pop(name).erase()


def _without_donor(entry: ir.DictAttr) -> ir.DictAttr:
    if c.DONOR_ATTR not in entry:
        return entry
    kept = (entry[k] for k in range(len(entry)))  # NamedAttributes
    return ir.DictAttr.get({a.name: a.attr for a in kept if a.name != c.DONOR_ATTR})


def _merged_name(names: list[str], funcs: dict[str, ir.Operation]) -> str:
    """``a_fwd`` + ``a_bwd`` -> ``a_fwd_bwd``; parts of different prefixes join with ``__``."""
    prefix = names[0].rsplit("_", 1)[0] + "_" if "_" in names[0] else ""
    if prefix and all(n.startswith(prefix) for n in names):
        base = prefix + "_".join(n[len(prefix):] for n in names)
    else:
        base = "__".join(names)
    name, n = base, 1
    while name in funcs:
        name, n = f"{base}_{n}", n + 1
    return name


# ---------------------------------------------------------------------------- the loop


def _merge_loop(module: ir.Module, loop: ir.Operation, body: ir.Operation,
                merger: _Merger) -> None:
    """Merge the runs of the loop body that the schedule runs back to back, and
    rewrite the schedule's order for the merged body."""
    info = read_loop(module, loop)
    S, M = len(info.calls), info.num_microbatches
    units = loop_calls(info)
    order = _order(loop, S, M)
    pos = {u: p for p, u in enumerate(order)}
    calls = _calls(c.entry_block(body))
    index = {op: k for k, op in enumerate(calls)}
    # one submesh: every order runs its microbatches one after another, and merging a
    # microbatch's calls only keeps them together; else the schedule's order stands
    back_to_back = len({cl.devices for cl in info.calls}) > 1
    group = list(range(S))  # body call -> the body call whose merged call runs it
    for run in _runs(c.entry_block(body), merger.funcs):
        ks = [index[op] for op in run]
        if _in_the_way(ks, units, pos, S, M, back_to_back):
            continue
        merger.merge(run, in_loop=True)
        for k in ks:
            group[k] = ks[0]
    if group == list(range(S)) or c.SCHEDULE_ATTR not in loop.attributes:
        return
    new_index = {g: j for j, g in enumerate(sorted(set(group)))}
    at: dict[tuple[int, int], int] = {}  # (merged call, microbatch) -> its last member's place
    for u, p in pos.items():
        key = (new_index[group[u % S]], u // S)
        at[key] = max(at.get(key, -1), p)
    pairs: list[int] = []
    for k, m in sorted(at, key=at.__getitem__):
        pairs += [k, m]
    d = ir.DictAttr(loop.attributes[c.SCHEDULE_ATTR])
    loop.attributes[c.SCHEDULE_ATTR] = ir.DictAttr.get({
        "name": d["name"], "order": ir.DenseI64ArrayAttr.get(pairs)})


def _order(loop: ir.Operation, S: int, M: int) -> list[int]:
    """The schedule's units (``m * S + k``) in dispatch order; without a schedule,
    microbatch after microbatch."""
    if c.SCHEDULE_ATTR not in loop.attributes:
        return list(range(S * M))
    pairs = list(ir.DenseI64ArrayAttr(ir.DictAttr(loop.attributes[c.SCHEDULE_ATTR])["order"]))
    order = [pairs[2 * j + 1] * S + pairs[2 * j] for j in range(len(pairs) // 2)]
    if len(pairs) % 2 or sorted(order) != list(range(S * M)) or any(
            not 0 <= k < S for k in pairs[::2]):
        raise DiagnosticError(
            f"mm-merge-fragments: the loop's `mm.schedule` order must list every (body call, "
            f"microbatch) pair of its {S} calls and {M} microbatches once, as "
            f"`mm-schedule-fragments` writes it; got {pairs}.", loop.location)
    return order


def _in_the_way(ks: list[int], units, pos: dict[int, int], S: int, M: int,
                back_to_back: bool) -> bool:
    """Whether, for some microbatch, a unit the schedule runs between the run's first
    and last call reads a result of the run (the merged call comes at the last's
    place, so those results would come later), or, with ``back_to_back``, runs on
    the run's submesh at all (the merge would reorder that submesh's calls)."""
    where = units[ks[0]].devices
    for m in range(M):
        members = {m * S + k for k in ks}
        first = min(pos[u] for u in members)
        last = max(pos[u] for u in members)
        for u, p in pos.items():
            if first < p < last and u not in members and (
                    set(units[u].deps) & members
                    or (back_to_back and units[u].devices == where)):
                return True
    return False
