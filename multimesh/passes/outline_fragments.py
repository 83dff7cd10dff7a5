"""``mm-outline-fragments``: one function per task and direction, called from ``@main``."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src.errors import DiagnosticError
from multimesh._src.ir_util import mesh_ops
from multimesh._src.mlir import func, ir, py_to_attr, sdy

from . import _contract as c
from .base import ModulePass
from .resolve_logical_shardings import mesh_symbol_names

_REMAT = ("stablehlo.constant", "stablehlo.iota")


@dataclass(frozen=True)
class OutlineFragmentsPass(ModulePass):
    """Outline the tagged ops of ``@main`` into fragment functions.

    Ops are grouped by ``(task, transpose_count, loop)`` in program order; an op joins
    its group's latest fragment unless that would make the fragment depend on a
    later one, in which case a new fragment starts (so fragments are always in
    dependency order and never form a cycle). Constants and iotas used by several
    fragments are cloned into each instead of being passed around. Each fragment
    becomes ``func.func private @<task>_<fwd|bwd>[_k]`` with ``mm.task``,
    ``mm.devices`` and ``mm.mesh`` (an ``sdy.mesh`` symbol created for the task);
    ``@main`` is left holding only ``func.call``s marked ``mm.fragment`` and the
    return. A microbatched program keeps its loop markers in ``@main``: the
    ``mm.microbatch_index`` becomes an argument of the fragments that read it, and
    each ``mm.microbatch_sum`` moves right after the call that produces what it
    sums. A fragment of a task whose submesh moves with the microbatch also gets
    ``mm.loop_devices``. A leaf task call (flat form) is one op here and becomes its
    body inside its fragment; where its inlined ops would have gone to two fragments
    (part of the body needing only earlier values), it is placed op by op instead.
    """

    argument = "mm-outline-fragments"
    summary = "Outline each task's ops into fragment functions called from `@main`."
    consumes = ("flat",)

    def apply(self, module: ir.Module) -> None:
        with module.context:
            tasks = c.read_tasks(module)
            main = c.main_func(module)
            block = c.entry_block(main)
            ops = [o.operation for o in block.operations]
            ret = ops.pop()
            markers = [op for op in ops if c.is_loop_marker(op)]
            ops = [op for op in ops if not c.is_loop_marker(op)]
            for op in ops:
                if c.tag_of(op) is None:
                    raise DiagnosticError(
                        "op is not assigned to a task; run mm-assign-tasks first", op.location)
                c.known_task(op, tasks)
            _remat_constants(ops, main)
            funcs = c.func_by_name(module)
            while True:
                ops = [o.operation for o in block.operations][:-1]
                ops = [op for op in ops if not c.is_loop_marker(op)]
                tags = [c.tag_of(op) for op in ops]
                uses = _operand_uses(ops, main, block)
                through = _through_sums(ops, markers)
                deps = _order_deps(uses, through)
                first = _assign_fragments(tags, deps)
                split = _split_calls(ops, tags, uses, through, first, funcs)
                if not split:
                    break
                count = _call_counts(ops)
                for i in split:  # inlined: its ops are placed one by one, as in flat form
                    _inline_leaf(ops[i], funcs, count, ops[i].attributes[c.TASK_ATTR])
            frag = _merge_down(tags, first, deps)
            renum = {f: k for k, f in enumerate(sorted(set(frag)))}
            frag = [renum[f] for f in frag]
            keys: list = [None] * len(renum)
            for i, f in enumerate(frag):
                keys[f] = tags[i]
            meshes = mesh_symbol_names(sorted(tasks))
            _ensure_meshes(module, tasks, meshes, {k[0] for k in keys})
            names = _fragment_names(keys)
            _outline_all(module, main, ret, ops, frag, keys, names, uses, tasks, meshes, markers)


def _operand_uses(ops, main, block):
    """Per top-level op: ``[(user op, operand number, value, producer index or -1)]``.

    Producer index -1 means a program input. Values captured by nested regions are
    included with the nested user op, so outlining can rewire them too. This is
    the one scan over operands the pass makes.
    """
    index = {op: i for i, op in enumerate(ops)}
    top = c.top_finder(main)
    out = []
    for op in ops:
        rec = []
        for k, v in enumerate(op.operands):
            owner = v.owner
            rec.append((op, k, v, -1 if isinstance(owner, ir.Block)
                        else index.get(owner.operation, -1)))  # a loop marker: external
        if len(op.regions):
            nested: list = []

            def cb(o, nested=nested, op=op):
                o = o.operation
                if o == op:
                    return ir.WalkResult.ADVANCE
                for k, v in enumerate(o.operands):
                    owner = v.owner
                    if isinstance(owner, ir.Block):
                        if owner == block:
                            nested.append((o, k, v, -1))
                        continue
                    t = top(owner)
                    if t is not None and t != op:
                        nested.append((o, k, v, index.get(t, -1)))
                return ir.WalkResult.ADVANCE

            op.walk(cb, ir.WalkOrder.PRE_ORDER)
            rec.extend(nested)
        out.append(rec)
    return out


def _through_sums(ops, markers) -> dict:
    """``mm.microbatch_sum`` result -> index of the op that makes what it sums."""
    index = {op: i for i, op in enumerate(ops)}
    through: dict[ir.Value, int] = {}
    for m in markers:
        for v in m.operands:
            owner = v.owner
            if not isinstance(owner, ir.Block) and owner.operation in index:
                through[m.results[0]] = index[owner.operation]
    return through


def _order_deps(uses, through) -> list[list[int]]:
    """Per op, the ops it must follow: its producers, seen through ``mm.microbatch_sum``.

    A value summed over the loop is an input to the fragments after the loop, but
    they still have to come after the loop's fragment that produces it.
    """
    out = []
    for rec in uses:
        d = []
        for _, _, v, p in rec:
            if p >= 0:
                d.append(p)
            elif v in through:
                d.append(through[v])
        out.append(d)
    return out


def _split_calls(ops, tags, uses, through, frag, funcs) -> list[int]:
    """Leaf task calls whose ops would not all land in one fragment, had the call been
    inlined: the call needs a fragment later than its key's latest one, while the
    first op of its body could still join that latest fragment (a constant, or an op
    reading only earlier values). Those calls are outlined op by op instead, so a
    program places exactly the same ops in each fragment as its fully inlined form."""
    last: dict = {}
    out = []
    for i, key in enumerate(tags):
        f = last.get(key)
        if f is not None and frag[i] != f and ops[i].name == "func.call":
            late = set()
            for _, k, v, p in uses[i]:
                d = p if p >= 0 else through.get(v)
                if d is not None and frag[d] > f:
                    late.add(k)
            if _first_op_is_early(ops[i], funcs, late):
                out.append(i)
        last[key] = frag[i]
    return out


def _first_op_is_early(call: ir.Operation, funcs, late: set[int]) -> bool:
    """Whether the first op of ``call``'s body reads none of the call operands in
    ``late`` (by operand number); an op with regions counts as reading them all."""
    fn = funcs.get(c.callee_of(call))
    if fn is None:
        return False
    blk = c.entry_block(fn)
    op = blk.operations[0].operation
    if op.name == "func.return":
        return False
    if len(op.regions):
        return True
    for v in op.operands:
        if isinstance(v.owner, ir.Block) and v.owner == blk and \
                ir.BlockArgument(v).arg_number in late:
            return False
    return True


def _call_counts(ops) -> dict[str, int]:
    count: dict[str, int] = {}
    for op in ops:
        if op.name == "func.call":
            count[c.callee_of(op)] = count.get(c.callee_of(op), 0) + 1
    return count


def _assign_fragments(tags, deps) -> list[int]:
    """Fragment number per op: its key's latest fragment unless that would need a later one."""
    frag: list[int] = []
    last: dict = {}
    count = 0
    for i, key in enumerate(tags):
        f = last.get(key)
        if f is None or any(frag[p] > f for p in deps[i]):
            f = count
            count += 1
            last[key] = f
        frag.append(f)
    return frag


def _merge_down(tags, frag, deps) -> list[int]:
    """Merge a fragment into the next one of its key when nothing in between needs it.

    Program order can open a fragment early for an op (say a constraint on an
    input) whose only consumers come much later; sinking it into the next fragment
    of the same task and direction avoids a tiny extra fragment.
    """
    n = max(frag, default=-1) + 1
    key_of: dict = {}
    for i, f in enumerate(frag):
        key_of[f] = tags[i]
    consumers: list[set[int]] = [set() for _ in range(n)]
    for j, d in enumerate(deps):
        for p in d:
            if frag[p] != frag[j]:
                consumers[frag[p]].add(frag[j])
    target = list(range(n))
    for f in range(n - 1, -1, -1):
        nxt = next((g for g in range(f + 1, n) if target[g] == g and key_of[g] == key_of[f]),
                   None)
        if nxt is not None and all(_final(target, u) >= nxt for u in consumers[f]):
            target[f] = nxt
    return [_final(target, f) for f in frag]


def _final(target: list[int], f: int) -> int:
    while target[f] != f:
        f = target[f]
    return f


def _remat_constants(ops, main) -> None:
    """Clone constants/iotas into every other task that uses them (planned, then applied).

    Planning happens before any edit: an Operation's hash follows its contents in
    these bindings, so maps keyed by ops go stale once an op is changed.
    """
    top = c.top_finder(main)
    index = {op: i for i, op in enumerate(ops)}
    plans = []
    for op in ops:
        if op.name not in _REMAT or len(op.operands):
            continue
        for t, uses in _uses_by_other_task(op, top).items():
            first = min((u[2] for u in uses), key=lambda o: index.get(o, 0))
            plans.append((op, t, first, [(o, k) for o, k, _ in uses]))
    for op, t, first, uses in plans:
        clone = op.clone(ip=ir.InsertionPoint(first))
        clone.attributes[c.TASK_ATTR] = c.tag_attr(*t)
        for owner, k in uses:
            owner.operands[k] = clone.results[0]
    done: list[ir.Operation] = []
    for op, *_ in plans:
        if any(op is d for d in done):
            continue
        done.append(op)
        if all(not list(r.uses) for r in op.results):
            op.erase()


def _uses_by_other_task(op: ir.Operation, top) -> dict[c.Tag, list]:
    """Uses of ``op``'s results by ops of other tasks, by task:
    ``(user, operand number, the user's top-level op)``."""
    mine = c.tag_of(op)
    groups: dict[c.Tag, list] = {}
    for r in op.results:
        for use in r.uses:
            user = top(use.owner)
            t = c.tag_of(user) if user is not None else None
            if t is None or t == mine:
                continue
            groups.setdefault(t, []).append((use.owner.operation, use.operand_number, user))
    return groups


def _fragment_names(keys: list[c.Tag]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name, count, _loop in keys:
        safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
        direction = "fwd" if count == 0 else "bwd" if count == 1 else f"bwd{count}"
        # a task already named for its direction (layer0_bwd) keeps its name
        base = safe if safe.endswith(f"_{direction}") else f"{safe}_{direction}"
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.append(base if k == 0 else f"{base}_{k}")
    return out


def _ensure_meshes(module, tasks, meshes, used) -> None:
    existing = set(mesh_ops(module))
    first = module.body.operations[0] if len(module.body.operations) else None
    for name in sorted(used):
        sym = meshes[name]
        if sym in existing:
            continue
        t = tasks[name]
        mesh = sdy.MeshAttr.get([sdy.MeshAxisAttr.get(a, s)
                                 for a, s in zip(t.axis_names, t.axis_sizes)])
        ip = ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(module.body)
        sdy.MeshOp(sym, mesh, ip=ip, loc=module.operation.location)


def _outline_all(module, main, ret, ops, frag, keys, names, uses, tasks, meshes,
                 markers=()) -> None:
    n = len(keys)
    members: list[list[int]] = [[] for _ in range(n)]
    for i, f in enumerate(frag):
        members[f].append(i)
    ins, rewire, out_set = _boundaries(frag, uses, n)
    external = [(ret, k, v) for k, v in enumerate(ret.operands)]
    external += [(m, k, v) for m in markers for k, v in enumerate(m.operands)]
    index = {op: i for i, op in enumerate(ops)}
    for _, _, v in external:  # values read after the fragments: results too
        owner = v.owner
        if not isinstance(owner, ir.Block) and owner.operation in index:
            p = index[owner.operation]
            out_set[frag[p]].setdefault(v, (p, ir.OpResult(v).result_number))
    outs = [sorted(d, key=d.get) for d in out_set]
    avail = _emit_calls(ret, [ops[m[-1]].location for m in members], names, ins, outs)
    for user, j, v in external:
        if v in avail:
            user.operands[j] = avail[v]
    _follow_producers(markers)
    for f in range(n):
        body = _fragment_func(module, main, names[f], keys[f], tasks[keys[f][0]],
                              meshes[keys[f][0]], ins[f], outs[f])
        remap = dict(zip(ins[f], body.arguments))
        for i in members[f]:
            body.append(ops[i])
        for user, k, v in rewire[f]:
            user.operands[k] = remap[v]
        with ir.InsertionPoint(body), ret.location:
            func.ReturnOp(outs[f])
    _inline_leaves(module, ops)


def _inline_leaves(module: ir.Module, ops: list[ir.Operation]) -> None:
    """Leaf task calls (flat form) become their bodies, now inside their fragments."""
    calls = [op for op in ops if op.name == "func.call"]
    if calls:
        funcs = c.func_by_name(module)
        count = _call_counts(calls)
        for call in calls:
            _inline_leaf(call, funcs, count)



def _emit_calls(ret: ir.Operation, locations: list, names: list[str],
                ins: list[list[ir.Value]], outs: list[list[ir.Value]]) -> dict:
    """One ``func.call`` per fragment before ``ret``, in order; returns the map from
    each value a fragment yields to the call result that now carries it."""
    avail: dict[ir.Value, ir.Value] = {}
    for f, name in enumerate(names):
        inputs = [avail.get(v, v) for v in ins[f]]
        with ir.InsertionPoint(ret), locations[f]:
            call = func.CallOp([v.type for v in outs[f]], ir.FlatSymbolRefAttr.get(name),
                               inputs)
        call.operation.attributes[c.FRAGMENT_ATTR] = ir.UnitAttr.get()
        for v, r in zip(outs[f], call.results):
            avail[v] = r
    return avail

def _boundaries(frag: list[int], uses, n: int) -> tuple[list, list, list]:
    """Per fragment: its inputs (in first-use order), the operands to rewire to its
    arguments ``(user op, operand number, value)``, and the values other fragments
    read from it (value -> (producer, result number))."""
    ins: list[list[ir.Value]] = [[] for _ in range(n)]
    in_seen: list[set] = [set() for _ in range(n)]
    out_set: list[dict] = [{} for _ in range(n)]
    rewire: list[list] = [[] for _ in range(n)]
    for j, rec in enumerate(uses):
        f = frag[j]
        for user, k, v, p in rec:
            if p >= 0 and frag[p] == f:
                continue
            if v not in in_seen[f]:
                in_seen[f].add(v)
                ins[f].append(v)
            rewire[f].append((user, k, v))
            if p >= 0:
                out_set[frag[p]].setdefault(v, (p, v.result_number))
    return ins, rewire, out_set


def _follow_producers(markers) -> None:
    """A sum follows the call that produces what it sums."""
    for m in markers:
        for v in m.operands:
            owner = v.owner
            if not isinstance(owner, ir.Block) and owner.operation != m:
                m.move_after(owner.operation)


def _fragment_func(module, main, name: str, key: c.Tag, task: c.MeshRecord, mesh: str,
                   ins: list[ir.Value], outs: list[ir.Value]) -> ir.Block:
    """An empty fragment function, tagged with its task, mesh and devices; its body."""
    with ir.InsertionPoint(module.body), main.location:
        fn = func.FuncOp(  # type: ignore[call-arg]  # stubs show the generated FuncOp,
            name, ir.FunctionType.get([v.type for v in ins],  # not func.py's subclass
                                      [v.type for v in outs]), visibility="private")
        body = fn.add_entry_block()  # type: ignore[attr-defined]  # (the same subclass)
    attrs = fn.operation.attributes
    attrs[c.TASK_ATTR] = c.tag_attr(*key)
    attrs[c.DEVICES_ATTR] = py_to_attr(list(task.devices))
    if task.loop_devices and key[2] >= 0:
        attrs[c.LOOP_DEVICES_ATTR] = py_to_attr([list(d) for d in task.loop_devices])
    attrs[c.MESH_ATTR] = ir.FlatSymbolRefAttr.get(mesh)
    return body


def _inline_leaf(call: ir.Operation, funcs, count: dict[str, int], tag=None) -> None:
    """Replace a leaf task call by its callee's body (moved when it is the last call);
    with ``tag``, each op of the body gets it (flat form in ``@main``)."""
    name = c.callee_of(call)
    callee = funcs.get(name)
    if callee is None:
        raise DiagnosticError(f"call to unknown function '@{name}'", call.location)
    count[name] -= 1
    body = callee if count[name] == 0 else callee.clone()
    blk = c.entry_block(body)
    for arg, operand in zip(blk.arguments, call.operands):
        arg.replace_all_uses_with(operand)
    ops = [o.operation for o in blk.operations]
    ret = ops.pop()
    for op in ops:
        op.move_before(call)
        if tag is not None:
            op.attributes[c.TASK_ATTR] = tag
    for res, val in zip(call.results, ret.operands):
        res.replace_all_uses_with(val)
    call.erase()
    body.erase()
