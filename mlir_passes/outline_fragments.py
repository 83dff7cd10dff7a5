"""``mm-outline-fragments``: one function per task and direction, called from ``@main``."""

from __future__ import annotations

from dataclasses import dataclass

from mlir_passes import _contract as c
from mlir_passes.base import ModulePass
from mlir_passes.resolve_logical_shardings import mesh_symbol_names
from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import func, ir, py_to_attr, sdy

_REMAT = ("stablehlo.constant", "stablehlo.iota")


@dataclass(frozen=True)
class OutlineFragmentsPass(ModulePass):
    """Outline the tagged ops of ``@main`` into fragment functions.

    Ops are grouped by ``(task, transpose_count)`` in program order; an op joins
    its group's latest fragment unless that would make the fragment depend on a
    later one, in which case a new fragment starts (so fragments are always in
    dependency order and never form a cycle). Constants and iotas used by several
    fragments are cloned into each instead of being passed around. Each fragment
    becomes ``func.func private @<task>_<fwd|bwd>[_k]`` with ``mm.task``,
    ``mm.devices`` and ``mm.mesh`` (an ``sdy.mesh`` symbol created for the task);
    ``@main`` is left holding only ``func.call``s marked ``mm.fragment`` and the
    return.
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
            for op in ops:
                if c.tag_of(op) is None:
                    raise DiagnosticError(
                        "op is not assigned to a task; run mm-assign-tasks first", op.location)
                c.known_task(op, tasks)
            _remat_constants(ops, main)
            ops = [o.operation for o in block.operations][:-1]
            tags = [c.tag_of(op) for op in ops]
            uses = _operand_uses(ops, main, block)
            frag = _merge_down(tags, _assign_fragments(tags, uses), uses)
            renum = {f: k for k, f in enumerate(sorted(set(frag)))}
            frag = [renum[f] for f in frag]
            keys: list = [None] * len(renum)
            for i, f in enumerate(frag):
                keys[f] = tags[i]
            meshes = mesh_symbol_names(sorted(tasks))
            _ensure_meshes(module, tasks, meshes, {k[0] for k in keys})
            names = _fragment_names(keys)
            _outline_all(module, main, ret, ops, frag, keys, names, uses, tasks, meshes)


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
                        else index[owner.operation]))
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
                        nested.append((o, k, v, index[t]))
                return ir.WalkResult.ADVANCE

            op.walk(cb, ir.WalkOrder.PRE_ORDER)
            rec.extend(nested)
        out.append(rec)
    return out


def _assign_fragments(tags, uses) -> list[int]:
    """Fragment number per op: its key's latest fragment unless that would need a later one."""
    frag: list[int] = []
    last: dict = {}
    count = 0
    for i, key in enumerate(tags):
        f = last.get(key)
        if f is None or any(p >= 0 and frag[p] > f for _, _, _, p in uses[i]):
            f = count
            count += 1
            last[key] = f
        frag.append(f)
    return frag


def _merge_down(tags, frag, uses) -> list[int]:
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
    for j, rec in enumerate(uses):
        for _, _, _, p in rec:
            if p >= 0 and frag[p] != frag[j]:
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
        mine = c.tag_of(op)
        groups: dict[c.Tag, list] = {}
        for r in op.results:
            for use in r.uses:
                user = top(use.owner)
                t = c.tag_of(user) if user is not None else None
                if t is None or t == mine:
                    continue
                groups.setdefault(t, []).append((use.owner.operation, use.operand_number, user))
        for t, uses in groups.items():
            first = min((u[2] for u in uses), key=lambda o: index.get(o, 0))
            plans.append((op, t, first, [(o, k) for o, k, _ in uses]))
    for op, t, first, uses in plans:
        clone = op.clone(ip=ir.InsertionPoint(first))
        clone.attributes[c.TASK_ATTR] = c.tag_attr(*t)
        for owner, k in uses:
            owner.operands[k] = clone.results[0]
    done = []
    for op, *_ in plans:
        if any(op is d for d in done):
            continue
        done.append(op)
        if all(not list(r.uses) for r in op.results):
            op.erase()


def _fragment_names(keys: list[c.Tag]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name, count, mb in keys:
        safe = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
        base = f"{safe}_{'fwd' if count == 0 else 'bwd' if count == 1 else f'bwd{count}'}"
        if mb >= 0:
            base += f"_mb{mb}"
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.append(base if k == 0 else f"{base}_{k}")
    return out


def _ensure_meshes(module, tasks, meshes, used) -> None:
    existing = {ir.StringAttr(o.operation.attributes["sym_name"]).value
                for o in module.body.operations if o.operation.name == "sdy.mesh"}
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


def _outline_all(module, main, ret, ops, frag, keys, names, uses, tasks, meshes) -> None:
    n = len(keys)
    members: list[list[int]] = [[] for _ in range(n)]
    for i, f in enumerate(frag):
        members[f].append(i)
    ins: list[list[ir.Value]] = [[] for _ in range(n)]
    in_seen: list[set] = [set() for _ in range(n)]
    out_set: list[dict] = [{} for _ in range(n)]  # value -> (producer, result number)
    rewire: list[list] = [[] for _ in range(n)]  # (user op, operand number, value)
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
    index = {op: i for i, op in enumerate(ops)}
    for v in ret.operands:
        owner = v.owner
        if not isinstance(owner, ir.Block):
            p = index[owner.operation]
            out_set[frag[p]].setdefault(v, (p, v.result_number))
    outs = [sorted(d, key=d.get) for d in out_set]
    avail: dict[ir.Value, ir.Value] = {}
    for f in range(n):
        inputs = [avail.get(v, v) for v in ins[f]]
        with ir.InsertionPoint(ret), ops[members[f][-1]].location:
            call = func.CallOp([v.type for v in outs[f]], ir.FlatSymbolRefAttr.get(names[f]),
                               inputs)
        call.operation.attributes["mm.fragment"] = ir.UnitAttr.get()
        for v, r in zip(outs[f], call.results):
            avail[v] = r
    for j, v in enumerate(list(ret.operands)):
        if v in avail:
            ret.operands[j] = avail[v]
    for f in range(n):
        key = keys[f]
        task = tasks[key[0]]
        with ir.InsertionPoint(module.body), main.location:
            fn = func.FuncOp(names[f], ir.FunctionType.get([v.type for v in ins[f]],
                                                           [v.type for v in outs[f]]),
                             visibility="private")
            body = fn.add_entry_block()
        fn.operation.attributes[c.TASK_ATTR] = c.tag_attr(*key)
        fn.operation.attributes["mm.devices"] = py_to_attr(list(task.devices))
        fn.operation.attributes["mm.mesh"] = ir.FlatSymbolRefAttr.get(meshes[key[0]])
        remap = dict(zip(ins[f], body.arguments))
        for i in members[f]:
            body.append(ops[i])
        for user, k, v in rewire[f]:
            user.operands[k] = remap[v]
        with ir.InsertionPoint(body), ret.location:
            func.ReturnOp(outs[f])
