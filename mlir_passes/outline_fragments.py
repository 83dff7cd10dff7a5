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
            _remat_constants(ops, main)
            ops = [o.operation for o in block.operations][:-1]
            top = c.top_finder(main)
            frag_of: dict[ir.Operation, int] = {}
            frags: list[tuple[c.Tag, list[ir.Operation]]] = []
            last: dict[c.Tag, int] = {}
            for op in ops:
                key = c.tag_of(op)
                deps = {frag_of[t] for t in _producers(op, top) if t in frag_of}
                f = last.get(key)
                if f is None or any(d > f for d in deps):
                    f = len(frags)
                    frags.append((key, []))
                    last[key] = f
                frags[f][1].append(op)
                frag_of[op] = f
            frags = _merge_down(frags, top)
            meshes = mesh_symbol_names(sorted(tasks))
            _ensure_meshes(module, tasks, meshes, {k[0] for k, _ in frags})
            names = _fragment_names([k for k, _ in frags])
            _outline_all(module, main, ret, frags, names, tasks, meshes, top)


def _value_top(v: ir.Value, top) -> ir.Operation | None:
    owner = v.owner
    if isinstance(owner, ir.Block):
        parent = owner.owner
        return None if parent is None else top(parent)
    return top(owner)


def _producers(op: ir.Operation, top) -> list[ir.Operation]:
    out = []
    for v in op.operands:
        owner = v.owner
        if not isinstance(owner, ir.Block):
            out.append(owner.operation)
    if len(op.regions):
        def cb(o):
            for v in o.operands:
                t = _value_top(v, top)
                if t is not None and t != op:
                    out.append(t)
            return ir.WalkResult.ADVANCE
        op.walk(cb, ir.WalkOrder.PRE_ORDER)
    return out


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
    for op, *_ in plans:
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


def _merge_down(frags, top):
    """Merge a fragment into the next one of its key when nothing in between needs it.

    Program order can open a fragment early for an op (say a constraint on an
    input) whose only consumers come much later; sinking it into the next fragment
    of the same task and direction avoids a tiny extra fragment.
    """
    frag_of = {op: i for i, (_, ops) in enumerate(frags) for op in ops}
    alive = [True] * len(frags)
    ops_of = [list(ops) for _, ops in frags]
    for i in range(len(frags) - 1, -1, -1):
        key = frags[i][0]
        nxt = next((j for j in range(i + 1, len(frags)) if alive[j] and frags[j][0] == key), None)
        if nxt is None:
            continue
        ok = True
        for op in ops_of[i]:
            for r in op.results:
                for use in r.uses:
                    t = top(use.owner)
                    j = frag_of.get(t)
                    if j is not None and j != i and j < nxt:
                        ok = False
                        break
                if not ok:
                    break
            if not ok:
                break
        if ok:
            ops_of[nxt] = ops_of[i] + ops_of[nxt]
            for op in ops_of[i]:
                frag_of[op] = nxt
            alive[i] = False
    return [(frags[i][0], ops_of[i]) for i in range(len(frags)) if alive[i]]


def _outline_all(module, main, ret, frags, names, tasks, meshes, top) -> None:
    frag_of = {op: i for i, (_, ops) in enumerate(frags) for op in ops}
    main_block = c.entry_block(main)
    ins: list[list[ir.Value]] = []
    outs: list[list[ir.Value]] = []
    for i, (_, fops) in enumerate(frags):
        inputs, seen = [], set()

        def add(v, inputs=inputs, seen=seen):
            if v not in seen:
                seen.add(v)
                inputs.append(v)

        for op in fops:
            for v in op.operands:
                owner = v.owner
                if isinstance(owner, ir.Block) or frag_of.get(owner.operation) != i:
                    add(v)
            if len(op.regions):
                def cb(o, i=i, add=add):
                    for v in o.operands:
                        owner = v.owner
                        if isinstance(owner, ir.Block):
                            if owner == main_block:
                                add(v)
                            continue
                        t = top(owner)
                        if t is not None and frag_of.get(t) != i:
                            add(v)
                    return ir.WalkResult.ADVANCE
                op.walk(cb, ir.WalkOrder.PRE_ORDER)
        ins.append(inputs)
        outputs = []
        for op in fops:
            for r in op.results:
                for use in r.uses:
                    t = top(use.owner)
                    if t is None or frag_of.get(t) != i:
                        outputs.append(r)
                        break
        outs.append(outputs)
    # Where each produced value is available in @main after outlining.
    avail: dict[ir.Value, ir.Value] = {}
    for i, ((_, fops), name) in enumerate(zip(frags, names)):
        inputs = [avail.get(v, v) for v in ins[i]]
        with ir.InsertionPoint(ret), fops[-1].location:
            call = func.CallOp([v.type for v in outs[i]], ir.FlatSymbolRefAttr.get(name), inputs)
        call.operation.attributes["mm.fragment"] = ir.UnitAttr.get()
        for v, r in zip(outs[i], call.results):
            avail[v] = r
    for j, v in enumerate(list(ret.operands)):
        if v in avail:
            ret.operands[j] = avail[v]
    for i, ((key, fops), name) in enumerate(zip(frags, names)):
        task = tasks[key[0]]
        with ir.InsertionPoint(module.body), main.location:
            fn = func.FuncOp(name, ir.FunctionType.get([v.type for v in ins[i]],
                                                       [v.type for v in outs[i]]),
                             visibility="private")
            body = fn.add_entry_block()
        fn.operation.attributes[c.TASK_ATTR] = c.tag_attr(*key)
        fn.operation.attributes["mm.devices"] = py_to_attr(list(task.devices))
        fn.operation.attributes["mm.mesh"] = ir.FlatSymbolRefAttr.get(meshes[key[0]])
        remap = dict(zip(ins[i], body.arguments))
        for op in fops:
            body.append(op)

        def fix(o, remap=remap):
            ops = o.operands
            for k in range(len(ops)):
                nv = remap.get(ops[k])
                if nv is not None:
                    ops[k] = nv
            return ir.WalkResult.ADVANCE

        for op in fops:
            op.walk(fix, ir.WalkOrder.PRE_ORDER)
        with ir.InsertionPoint(body), ret.location:
            func.ReturnOp(outs[i])
