"""``mm-assign-tasks``: give every op outside a task the task of its heaviest neighbour."""

from __future__ import annotations

from dataclasses import dataclass

from multimesh._src import ir_attrs as ta
from multimesh._src.errors import DiagnosticError
from multimesh._src.mlir import ir

from . import _contract as c
from .base import ModulePass
from .match_tasks import BACKPROP_MARKER, name_stack


@dataclass(frozen=True)
class AssignTasksPass(ModulePass):
    """Colour untagged ops of ``@main`` (flat form) by the original library's rule.

    An op outside every task joins the task whose ops it exchanges the most bytes
    with (operands and users together; a leaf task call counts a value once per op of
    its body that reads it), preferring tasks of its own direction (an op
    of a backward pass, ``transpose(jvp(...))`` in its whole name stack, joins a
    backward task when one reaches it: such ops first spread among backward tasks
    alone, and only those no backward task reaches then take any neighbour),
    repeated forward and backward until nothing changes; it keeps its own microbatch loop (``mm.loop``, which moves into
    its tag). The loop markers ``mm.microbatch_index``/``mm.microbatch_sum`` get no
    task. An op whose regions hold tagged ops (a loop around a task)
    takes that task; tasks on different submeshes inside one loop are an error,
    since a loop body runs on one submesh. Ops still untagged at the end (or every
    op, in a program with no task at all) go to the implicit task ``mm.default``:
    all ``num-devices`` devices (on a mesh ``x``, unless the module's ``mm.tasks``
    already has an ``mm.default`` entry: the program's own mesh), no logical
    mapping, so constraints there resolve to replicated.
    """

    argument = "mm-assign-tasks"
    summary = "Give every untagged op in `@main` a task by the heaviest-neighbour rule."
    consumes = ("flat",)

    num_devices: int = 0
    """Devices of the implicit default task; 0 reads `mm.num_devices` or `mhlo.num_partitions`."""

    def __post_init__(self):
        if not 0 <= self.num_devices <= ta.MAX_DEVICES:
            raise self.bad_option("num_devices", f"a device count in 1..{ta.MAX_DEVICES}, or 0 "
                                                 f"to read it from the module")

    def apply(self, module: ir.Module) -> None:
        with module.context:
            tasks = c.read_tasks(module)
            main = c.main_func(module)
            # drop func.return; loop markers belong to the loop, not to a task, but a sum
            # passes its task on to what reads it (so it is coloured, never written)
            ops = [o.operation for o in c.entry_block(main).operations][:-1]
            markers = {op for op in ops if c.is_loop_marker(op)}
            loop = {op: -1 if op in markers else c.loop_of(op) for op in ops}
            tag = _given_tags(ops, loop, tasks)
            pretagged = {op for op in ops if op in tag and c.TASK_ATTR in op.attributes}
            pretagged |= markers
            untagged = _spread(module, main, ops, tag, loop)
            untagged = [op for op in untagged if op not in markers]
            if untagged or not tasks:
                n = self.num_devices or c.num_devices(module) or _num_partitions(module)
                # A caller may have given mm.default its mesh (the program's own mesh).
                tasks.setdefault(c.DEFAULT_TASK,
                                 c.MeshRecord(tuple(range(n)), ("x",), (n,), ()))
                for op in untagged:
                    tag[op] = (c.DEFAULT_TASK, 0, loop[op])
            _write_tags(ops, tag, pretagged, markers)
            c.write_tasks(module, tasks)


def _given_tags(ops: list[ir.Operation], loop: dict[ir.Operation, int],
                tasks: dict[str, c.MeshRecord]) -> dict[ir.Operation, c.Tag]:
    """The tags ops carry already, or that ops with regions get from their nested ops."""
    tag: dict[ir.Operation, c.Tag] = {}
    for op in ops:
        t = c.tag_of(op)
        if t is None and len(op.regions):
            nested = _nested_tag(op, tasks)
            if nested is not None:
                t = (nested[0], nested[1], loop[op])
        if t is not None:
            tag[op] = t
    return tag


def _spread(module: ir.Module, main: ir.Operation, ops: list[ir.Operation],
            tag: dict[ir.Operation, c.Tag], loop: dict[ir.Operation, int]) -> list[ir.Operation]:
    """Give untagged ops the task of their heaviest tagged neighbour, sweeping forward
    and backward until nothing changes; returns the ops still untagged.

    Ops of a backward pass first wait for a backward neighbour (the loss's backward
    joins the backward of the unit it feeds, not a forward task that merely gave it its
    indices); only what no backward task reaches takes any neighbour afterwards."""
    untagged = [op for op in ops if op not in tag]
    pos = {op: i for i, op in enumerate(ops)}
    top = c.top_finder(main)
    backward = {op: _is_backward(op) for op in untagged}
    reads = _Reads(c.func_by_name(module))
    for strict in (True, False):
        changed = True
        while changed and untagged:
            changed = False
            for order in (untagged, list(reversed(untagged))):
                for op in order:
                    if op in tag:
                        continue
                    bwd = backward.get(op, False)
                    best = _heaviest(op, tag, top, pos, bwd, reads, strict=strict and bwd)
                    if best is not None:
                        tag[op] = (best[0], best[1], loop[op])
                        changed = True
            untagged = [op for op in untagged if op not in tag]
    return untagged


def _write_tags(ops: list[ir.Operation], tag: dict[ir.Operation, c.Tag],
                pretagged: set[ir.Operation], markers: set[ir.Operation]) -> None:
    """Attributes are written last: in these bindings an Operation's hash follows its
    contents, so editing ops would break the maps built before."""
    attrs: dict = {}
    writes = [(op, tag[op] if op not in pretagged else None) for op in ops
              if op not in markers]
    for op, t in writes:
        if t is not None:
            if t not in attrs:
                attrs[t] = c.tag_attr(*t)
            op.attributes[c.TASK_ATTR] = attrs[t]
        if c.LOOP_ATTR in op.attributes:  # the loop now lives in the tag
            del op.attributes[c.LOOP_ATTR]


def _is_backward(op: ir.Operation) -> bool:
    """Whether jax traced the op for a backward pass (``transpose(jvp(...))`` in its name)."""
    stack = name_stack(op.location)
    return stack is not None and BACKPROP_MARKER in stack


class _Reads:
    """How often a leaf task call's body reads each of its arguments.

    A value that a task call takes is read by as many ops of its body as read the
    argument, exactly as if the body were inlined: each read counts its bytes.
    """

    def __init__(self, funcs):
        self.funcs = funcs
        self.memo: dict[tuple[str, int], int] = {}

    def __call__(self, user: ir.Operation, operand: int) -> int:
        if user.name != "func.call" or c.TASK_ATTR not in user.attributes:
            return 1
        key = (c.callee_of(user), operand)
        n = self.memo.get(key)
        if n is None:
            callee = self.funcs.get(key[0])
            args = c.entry_block(callee).arguments if callee is not None else []
            n = self.memo[key] = (sum(1 for _ in args[operand].uses)
                                  if operand < len(args) else 1)
        return n


def _heaviest(op: ir.Operation, tag, top, pos, backward: bool,
              reads=lambda user, operand: 1, strict: bool = False) -> c.Tag | None:
    """The neighbouring task with the most bytes; ties go to the earliest neighbour.

    Neighbours of the op's own direction win over the others (glue of a backward
    pass joins a backward task, not the forward whose residuals it reads). A leaf
    task call counts once per op of its body that reads the value (``reads``).
    ``strict``: only neighbours of the op's own direction count (None without one).
    """
    scores: dict[c.Tag, list[int]] = {}

    def add(t, nbytes, where):
        s = scores.setdefault(t, [0, where])
        s[0] += nbytes
        s[1] = min(s[1], where)

    for v in op.operands:
        owner = v.owner
        if isinstance(owner, ir.Block):
            continue
        o = top(owner)
        t = tag.get(o)
        if t is not None:
            add(t, c.value_bytes(v), pos.get(o, 0))
    for r in op.results:
        nbytes = c.value_bytes(r)
        for use in r.uses:
            o = top(use.owner)
            t = tag.get(o)
            if t is not None:
                n = reads(o, use.operand_number) if o == use.owner.operation else 1
                add(t, n * nbytes, pos.get(o, 1 << 30))
    if not scores:
        return None
    same = {t: v for t, v in scores.items() if (t[1] > 0) == backward}
    if strict and not same:
        return None
    return min((same or scores).items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[0]))[0]


def _nested_tag(op: ir.Operation, tasks) -> c.Tag | None:
    tagged: list[ir.Operation] = []

    def cb(o):
        if c.TASK_ATTR in o.operation.attributes:
            tagged.append(o.operation)
        return ir.WalkResult.ADVANCE

    op.walk(cb, ir.WalkOrder.PRE_ORDER)
    # tag_of outside the walk: an exception in a walk callback becomes a RuntimeError
    found = [(t, o) for o in tagged if (t := c.tag_of(o)) is not None]
    if not found:
        return None
    first, _ = found[0]
    first_mesh = tasks[first[0]].mesh_key() if first[0] in tasks else None
    for t, o in found[1:]:
        mesh = tasks[t[0]].mesh_key() if t[0] in tasks else None
        if mesh != first_mesh:
            if op.name in ("stablehlo.case", "stablehlo.if"):  # lax.cond / lax.switch
                why = ("the branches of a conditional (lax.cond, lax.switch) run on one "
                       "submesh. Call the tasks outside the conditional (select the result "
                       "with jnp.where) or give both tasks one submesh.")
            else:
                why = ("a loop body runs on one submesh. Unroll the loop (a Python for loop, "
                       "or lax.scan(..., unroll=True)) or give both tasks one submesh.")
            raise DiagnosticError(
                f"tasks '{first[0]}' and '{t[0]}' run on different submeshes but sit inside "
                f"the same '{op.name}'; {why}", o.location)
    return first


def _num_partitions(module: ir.Module) -> int:
    return ta.read_attr(module.operation, "mhlo.num_partitions", c.DEVICE_COUNT,
                       "'mhlo.num_partitions'", default=1)
