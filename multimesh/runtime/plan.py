"""Read the MPMD form of a module (docs/ir.md §4) into a runnable plan.

The plan is plain data: fragments (a standalone SPMD module each, its devices
and argument/result layouts) and the steps of one run, in dispatch order: fragment
calls, transfers, and the values they read and write. A microbatch loop is
instantiated here: its body's calls and transfers are repeated once per
microbatch, in the order its ``mm.schedule`` records, with the running sums
chained from one microbatch to the next in the order the schedule runs them (a sum
is commutative, so a schedule that runs microbatches' backwards out of index order
just adds them in that order). Transfers are decided here, once, by
comparing where a value lives with where its consumer wants it, so the hot loop in
:mod:`executor` does no sharding comparisons.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from multimesh._src.calls import Call
from multimesh._src.errors import MultimeshValueError
from multimesh._src.ir_contract import (
    DEVICES_ATTR,
    DONOR_ATTR,
    FRAGMENT_CALL_TARGET,
    LOOP_TARGET,
    PREFIX,
    SHARDING_ATTR,
    TRANSFER_TARGET,
    read_callee,
    read_fragment_header,
    read_loop_header,
    read_num_devices,
    read_placement,
)
from multimesh._src.ir_util import custom_call_target
from multimesh._src.layouts import Placement, layout_key
from multimesh._src.mlir import attr_to_py, ir, make_context, parse_module, print_module, sdy

FRAGMENT_CALL = FRAGMENT_CALL_TARGET
TRANSFER = TRANSFER_TARGET
LOOP = LOOP_TARGET


@dataclass
class Fragment:
    name: str
    task: str
    transpose_count: int
    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    text: str
    in_layouts: list[Placement]
    out_layouts: list[Placement]
    in_types: list[tuple[tuple[int, ...], str]]
    out_types: list[tuple[tuple[int, ...], str]]
    loop_devices: tuple[tuple[int, ...], ...] | None = None
    """Device positions per microbatch, for a task placed by ``loop_dependent_mesh_slice``."""
    donors: tuple[int, ...] = ()
    """Arguments the fragment itself donates (``jax.buffer_donor``: running sums)."""


@dataclass
class Transfer:
    src: int
    dst: int
    layout: Placement


@dataclass
class Plan:
    num_devices: int
    fragments: dict[str, Fragment]
    steps: list  # Call | Transfer, in dispatch order
    inputs: list[Placement]
    input_ids: list[int]
    outputs: list[int]
    out_layouts: list[Placement]
    last_use: dict[int, int] = field(default_factory=dict)
    constants: dict[int, tuple[int, Placement]] = field(default_factory=dict)
    """Value id -> (int32 value, layout): the microbatch index where a fragment reads it."""
    num_microbatches: int | None = None
    schedule_name: str | None = None
    zeros: dict[int, tuple[tuple[tuple[int, ...], str], Placement]] = field(default_factory=dict)
    """Value id -> ((shape, dtype), layout): zeros the runtime makes at the start of each
    run, in place of a fragment that only returns zeros (a loop's running sums start
    from them, see :func:`_trivial`)."""

    def describe(self) -> str:
        """A readable plan: one line per fragment call and transfer."""
        lines = [f"multimesh plan over {self.num_devices} devices:"]
        for vid, (_, lay) in self.zeros.items():
            lines.append(f"  zeros %{vid} onto devices {list(lay[0])} {_spec_str(lay[3])} "
                         f"(put there at the start of each run)")
        for s in self.steps:
            if isinstance(s, Call):
                mb = f" mb {s.microbatch}" if s.microbatch is not None else ""
                lines.append(f"  {s.fragment:<24} devices {list(self.call_devices(s))}{mb}  "
                             f"args {s.args} -> {s.results}")
            else:
                lines.append(f"  transfer %{s.src} -> %{s.dst} onto devices {list(s.layout[0])} "
                             f"{_spec_str(s.layout[3])}")
        lines.append(f"  outputs {self.outputs}")
        return "\n".join(lines)

    def call_devices(self, call: Call) -> tuple[int, ...]:
        return call.devices or self.fragments[call.fragment].devices

    def calls(self) -> list[Call]:
        """Every fragment call of one run, in dispatch order."""
        return [s for s in self.steps if isinstance(s, Call)]

    def value_layouts(self) -> dict[int, Placement]:
        """Where every value of one run lives (value id -> layout)."""
        out: dict[int, Placement] = dict(zip(self.input_ids, self.inputs))
        out.update({vid: lay for vid, (_, lay) in self.constants.items()})
        out.update({vid: lay for vid, (_, lay) in self.zeros.items()})
        for s in self.steps:
            if isinstance(s, Call):
                frag = self.fragments[s.fragment]
                for r, lay in zip(s.results, frag.out_layouts):
                    out[r] = moved(lay, frag.devices, s.devices) if s.devices else lay
            else:
                out[s.dst] = s.layout
        return out


def _spec_str(dims) -> str:
    return "P(" + ", ".join(repr(d[0]) if len(d) == 1 else (repr(d) if d else "None")
                            for d in dims) + ")"


def _sharding_dims(attr: ir.Attribute) -> tuple[tuple[str, ...], ...]:
    ts = sdy.TensorShardingAttr(attr)
    out = []
    for d in ts.dimension_shardings:
        dim = sdy.DimensionShardingAttr(d)
        out.append(tuple(sdy.AxisRefAttr(a).name for a in dim.axes))
    return tuple(out)


def _attr_list(fn, which, n):
    if which in fn.attributes:
        return [ir.DictAttr(a) for a in fn.attributes[which]]
    return [None] * n


def _type_info(t) -> tuple[tuple[int, ...], str]:
    rt = ir.RankedTensorType(t)
    return tuple(rt.shape), str(rt.element_type)


def same_layout(a: Placement, b: Placement) -> bool:
    return a == b or layout_key(*a) == layout_key(*b)


def moved(layout: Placement, home: tuple[int, ...], devices: tuple[int, ...]) -> Placement:
    """``layout`` of a fragment on ``home`` devices, for the fragment run on ``devices``."""
    where = dict(zip(home, devices))
    return (tuple(where.get(p, p) for p in layout[0]),) + layout[1:]


def build_plan(module: ir.Module | str | bytes) -> Plan:
    """Build a :class:`Plan` from a module after ``mm-extract-fragments`` (an
    ``ir.Module``, or its text or bytecode, e.g. what ``mm-opt`` printed)."""
    if isinstance(module, (str, bytes)):
        module = parse_module(module, make_context())
    with module.context:
        return _PlanBuilder(module).build()


class _LayoutReader:
    """Layouts read off a module's device and sharding attributes, cached: a loop's
    transfers repeat the same pair per microbatch."""

    def __init__(self, module: ir.Module):
        self.module = module
        self._cache: dict = {}

    def __call__(self, devices_attr, sharding_attr) -> Placement:
        key = (devices_attr, sharding_attr)
        lay = self._cache.get(key)
        if lay is None:
            lay = self._cache[key] = self._read(devices_attr, sharding_attr)
        return lay

    def _read(self, devices_attr, sharding_attr) -> Placement:
        devices = tuple(attr_to_py(devices_attr))
        ts = sdy.TensorShardingAttr(sharding_attr)
        mesh_ref = ts.mesh_or_ref
        if isinstance(mesh_ref, ir.FlatSymbolRefAttr):
            mesh = _find_mesh(self.module, mesh_ref.value)
        else:
            mesh = sdy.MeshAttr(mesh_ref)
        names = tuple(sdy.MeshAxisAttr(a).name for a in mesh.axes)
        sizes = tuple(sdy.MeshAxisAttr(a).size for a in mesh.axes)
        return devices, names, sizes, _sharding_dims(sharding_attr)


class _PlanBuilder:
    """Builds the ``Plan`` of an MPMD-form module: its fragments, calls and transfers."""

    def __init__(self, module: ir.Module):
        self.module = module
        self.subs: dict[str, ir.Operation] = {}
        self.funcs: dict[str, ir.Operation] = {}
        for view in module.body.operations:
            op = view.operation
            if op.name == "builtin.module":
                if "sym_name" not in op.attributes:
                    raise MultimeshValueError(
                        "The program has a nested module without a name; in MPMD form every "
                        "nested module is a fragment, named by the calls that run it.")
                self.subs[ir.StringAttr(op.attributes["sym_name"]).value] = op
            elif op.name == "func.func":
                self.funcs[ir.StringAttr(op.attributes["sym_name"]).value] = op
        main = self.funcs.get("main")
        if main is None:
            raise MultimeshValueError("The module has no 'main' function.")
        self.main: ir.Operation = main
        self.num_devices: int = read_num_devices(module, default=1) or 1
        self.fragments: dict[str, Fragment] = {}
        self.steps: list = []
        self.layout_of: dict[int, Placement] = {}
        self.moving: set[int] = set()  # values made by (or for) a task that moves
        self.constants: dict[int, tuple[int, Placement]] = {}
        self.zeros: dict[int, tuple[tuple[tuple[int, ...], str], Placement]] = {}
        self._trivial: dict[str, tuple[str, list[int]] | None] = {}
        self.const_ids: dict[tuple, int] = {}
        self.next_id = 0
        self.num_microbatches: int | None = None
        self.schedule_name: str | None = None
        self._layout = _LayoutReader(module)

    def new_id(self, layout: Placement | None) -> int:
        i = self.next_id
        self.next_id += 1
        if layout is not None:
            self.layout_of[i] = layout
        return i

    def build(self) -> Plan:
        block = self.main.regions[0].blocks[0]
        arg_attrs = _attr_list(self.main, "arg_attrs", len(block.arguments))
        ids: dict[ir.Value, int] = {}
        inputs: list[Placement] = []
        for a, d in zip(block.arguments, arg_attrs):
            rank = len(ir.RankedTensorType(a.type).shape)
            if d is not None and SHARDING_ATTR in d and DEVICES_ATTR in d:
                lay = self._layout(d[DEVICES_ATTR], d[SHARDING_ATTR])
            else:  # unused by any fragment: keep it replicated on every device
                lay = (tuple(range(self.num_devices)), ("x",), (self.num_devices,),
                       tuple(() for _ in range(rank)))
            inputs.append(lay)
            ids[a] = self.new_id(lay)
        input_ids = list(range(len(inputs)))
        ret = None
        for op in block.operations:
            op = op.operation
            if op.name == "func.return":
                ret = op
            elif custom_call_target(op) == LOOP:
                self._loop(op, ids)
            else:
                self._op(op, ids)
        assert ret is not None  # a func.func body ends with its func.return
        outputs = [ids[v] for v in ret.operands]
        self.steps = defer_transfers(self.steps, self.fragments)
        plan = Plan(self.num_devices, self.fragments, self.steps, inputs, input_ids, outputs,
                    [self.layout_of[o] for o in outputs], constants=self.constants,
                    num_microbatches=self.num_microbatches, schedule_name=self.schedule_name,
                    zeros=self.zeros)
        for i, s in enumerate(self.steps):
            for vid in (s.args if isinstance(s, Call) else [s.src]):
                plan.last_use[vid] = i
        return plan

    # -- one op of @main or of a loop body ------------------------------------------

    def _op(self, op: ir.Operation, ids: dict, microbatch: int | None = None,
            index: ir.Value | None = None) -> None:
        target = custom_call_target(op)
        if target == TRANSFER:
            src = ids[op.operands[0]]
            lay = self._layout(*read_placement(op, f"'{TRANSFER}'"))
            if src in self.moving and same_layout(self.layout_of[src], lay):
                ids[op.results[0]] = src  # this microbatch's producer is there already
                return
            dst = self.new_id(lay)
            ids[op.results[0]] = dst
            self.steps.append(Transfer(src, dst, lay))
        elif target == FRAGMENT_CALL:
            name = read_callee(op)
            if microbatch is None and self._elide(op, name, ids):
                return
            frag = self._fragment(name)
            devices = None
            if frag.loop_devices is not None and microbatch is not None:
                devices = frag.loop_devices[microbatch % len(frag.loop_devices)]
                if devices == frag.devices:
                    devices = None
            args = [self._arg(v, k, frag, devices, ids, index, name)
                    for k, v in enumerate(op.operands)]
            results = []
            for r, lay in zip(op.results, frag.out_layouts):
                if devices is not None:
                    lay = moved(lay, frag.devices, devices)
                rid = self.new_id(lay)
                ids[r] = rid
                if frag.loop_devices is not None:
                    self.moving.add(rid)
                results.append(rid)
            self.steps.append(Call(name, devices=devices, microbatch=microbatch, args=args,
                                   results=results))
        else:
            raise MultimeshValueError(
                f"Expected only fragment calls, transfers and a microbatch loop in the "
                f"program, found '{op.name}'" + (f" @{target}" if target else "") +
                "; run mm-extract-fragments.")

    def _elide(self, op: ir.Operation, name: str, ids: dict) -> bool:
        """Stand in for a call of a fragment that computes nothing (:func:`_trivial`):
        its zeros become :attr:`Plan.zeros`, its passed-through arguments its results.
        Nothing is compiled or dispatched for it. Returns whether it did."""
        if name not in self._trivial:
            sub = self.subs.get(name)
            self._trivial[name] = _trivial(sub) if sub is not None else None
        trivial = self._trivial[name]
        if trivial is None:
            return False
        kind, sources = trivial
        frag = _fragment(name, self.subs[name])
        if frag.loop_devices is not None:
            return False
        if kind == "zeros":
            for r, t, lay in zip(op.results, frag.out_types, frag.out_layouts):
                rid = ids[r] = self.new_id(lay)
                self.zeros[rid] = (t, lay)
            return True
        if any(getattr(u.owner, "operation", u.owner).name == "func.return"
               for r in op.results for u in r.uses):
            return False  # the program returns it: a fresh array, as jax.jit returns
        if not all(same_layout(self.layout_of[ids[op.operands[a]]], lay)
                   and same_layout(frag.in_layouts[a], lay)
                   for a, lay in zip(sources, frag.out_layouts)):
            return False
        for r, a in zip(op.results, sources):
            ids[r] = ids[op.operands[a]]
        return True

    def _arg(self, v, k, frag, devices, ids, index, name) -> int:
        want = frag.in_layouts[k]
        if devices is not None:
            want = moved(want, frag.devices, devices)
        if index is not None and v == index:
            return self._index(want)
        vid = ids[v]
        have = self.layout_of[vid]
        if same_layout(have, want):
            return vid
        if vid in self.moving or frag.loop_devices is not None:
            # a task that moves with the microbatch: the IR's transfers are for its
            # default devices, this microbatch needs its own
            dst = self.new_id(want)
            self.moving.add(dst)
            self.steps.append(Transfer(vid, dst, want))
            return dst
        raise MultimeshValueError(
            f"Fragment '{name}' argument #{k} is laid out as {have} but the fragment wants "
            f"{want}; the module is missing an mm.transfer (run mm-insert-transfers).")

    def _index(self, want: Placement) -> int:
        mb = self._microbatch
        key = (mb, layout_key(*want))
        vid = self.const_ids.get(key)
        if vid is None:
            vid = self.new_id(want)
            self.const_ids[key] = vid
            self.constants[vid] = (mb, want)
        return vid

    # -- the microbatch loop --------------------------------------------------------

    def _loop(self, loop: ir.Operation, ids: dict) -> None:
        header = read_loop_header(loop)
        body_name = header.body
        body = self.funcs.get(body_name)
        if body is None:
            raise MultimeshValueError(f"The microbatch loop's body @{body_name} is missing.")
        M = header.num_microbatches
        self.num_microbatches = M
        block = body.regions[0].blocks[0]
        ops = [o.operation for o in block.operations]
        ret = ops.pop()
        args = list(block.arguments)
        # Body ops grouped per call: the call, then the transfers of its results.
        units: list[list[ir.Operation]] = []
        before: list[ir.Operation] = []
        for op in ops:
            if custom_call_target(op) == FRAGMENT_CALL:
                units.append(before + [op])
                before = []
            elif units and custom_call_target(op) == TRANSFER and not isinstance(
                    op.operands[0].owner, ir.Block):
                units[-1].append(op)
            else:
                before.append(op)
        if before:
            raise MultimeshValueError(
                f"The microbatch loop body @{body_name} ends with ops that no call reads.")
        order = _order(header.order, len(units), M)
        self.schedule_name = header.schedule_name
        chains = _sum_chains(units, args, ret.operands, order, M)
        envs = _Env.per_microbatch(M, args, [ids[v] for v in loop.operands], ret.operands,
                                   chains)
        for k, m in order:
            self._microbatch = m
            for op in units[k]:
                self._op(op, envs[m], microbatch=m, index=args[0])
        for r, v, chain in zip(loop.results, ret.operands, chains, strict=True):
            ids[r] = envs[chain[-1]][v]

    # -- reading fragments -------------------------------------------------------------

    def _fragment(self, name: str) -> Fragment:
        frag = self.fragments.get(name)
        if frag is None:
            sub = self.subs.get(name)
            if sub is None:
                raise MultimeshValueError(f"Fragment call to unknown fragment '{name}'.")
            frag = self.fragments[name] = _fragment(name, sub)
        return frag


def defer_transfers(steps: list, fragments: dict[str, Fragment]) -> list:
    """``steps`` with each microbatch loop transfer moved to just after the last call
    on its destination devices before the call that first reads it.

    The loop body lists a call's transfers right after it, so a stage's output would
    cross to the next stage's submesh as soon as it is made and wait there, beside
    the microbatches the schedule holds, for that stage's forward (1F1B's next
    microbatch arrives during the warm-up). Moved here it arrives while its receiver
    is idle, right before it is needed; until then it waits on the sender, whose
    forward made it. A transfer is not moved past a call that reads its source (which
    may donate it), and one whose value another transfer reads first stays put.
    """
    calls_on: dict[int, list[int]] = {}  # device position -> its calls' step indices
    first_read: dict[int, int] = {}
    readers: dict[int, list[int]] = {}  # value -> the calls reading it, in order
    for i, s in enumerate(steps):
        if isinstance(s, Call):
            for p in s.devices or fragments[s.fragment].devices:
                calls_on.setdefault(p, []).append(i)
            for a in s.args:
                first_read.setdefault(a, i)
                readers.setdefault(a, []).append(i)
        else:
            first_read.setdefault(s.src, i)
    keys = []
    for i, s in enumerate(steps):
        slot = i
        r = first_read.get(s.dst) if isinstance(s, Transfer) else None
        if r is not None and isinstance(steps[r], Call) and steps[r].microbatch is not None:
            # the last call on a destination device before the reader
            before = [on[k - 1] for on in map(calls_on.get, s.layout[0]) if on
                      for k in [bisect.bisect_left(on, r)] if k]
            slot = max([i, *before])
            reads = readers.get(s.src, [])
            if bisect.bisect_right(reads, slot) > bisect.bisect_right(reads, i):
                slot = i  # a call between would read (and may donate) the source
        keys.append((slot, slot != i, i))
    return [steps[k[2]] for k in sorted(keys)]


def _order(recorded: tuple[tuple[int, int], ...] | None, S: int,
           M: int) -> list[tuple[int, int]]:
    """(body call, microbatch) pairs in dispatch order: the recorded schedule, or
    microbatch after microbatch."""
    if recorded is not None:
        order = list(recorded)
        if sorted(order) != [(k, m) for k in range(S) for m in range(M)]:
            raise MultimeshValueError(
                "The microbatch loop's mm.schedule does not list every (call, "
                "microbatch) pair exactly once; run mm-schedule-fragments again.")
        return order
    return [(k, m) for m in range(M) for k in range(S)]


def _sum_chains(units: list[list[ir.Operation]], args: list, carry: list,
                order: list[tuple[int, int]], M: int) -> list[list[int]]:
    """Per running sum, the microbatches in the order it accumulates them.

    A sum that only the call producing it reads (``mm-form-microbatch-loop``'s in-place
    accumulation) follows the order the schedule runs that call, so a schedule may run
    microbatches' backwards in any order (``mm-schedule-fragments`` leaves it free);
    any other carried value keeps microbatch order."""
    unit_of = {r: k for k, ops in enumerate(units) for op in ops for r in op.results}
    readers: dict = {}
    for u, ops in enumerate(units):
        for op in ops:
            for o in op.operands:
                readers.setdefault(o, set()).add(u)
    chains = []
    for j, v in enumerate(carry):
        p = unit_of.get(v)
        if p is not None and readers.get(args[1 + j], set()) <= {p}:
            chains.append([m for k, m in order if k == p])
        else:
            chains.append(list(range(M)))
    return chains


class _Env(dict):
    """Value ids of one microbatch; a running sum is looked up in the microbatch that
    accumulated it before (in the schedule's order)."""

    carried: dict = {}

    @staticmethod
    def per_microbatch(M: int, args: list, outer: list[int], carry: list,
                       chains: list[list[int]]) -> list[_Env]:
        """One environment per microbatch. ``args`` are the body's block arguments (the
        index, then one per loop operand), ``outer`` the loop operands' value ids,
        ``carry`` the body's returned values and ``chains`` per running sum the
        microbatches in accumulation order: a sum starts from its loop operand in the
        chain's first microbatch and from the previous one's result after."""
        envs = [_Env({args[1 + j]: outer[j] for j in range(len(carry), len(outer))})
                for _ in range(M)]
        carried: list[dict] = [{} for _ in range(M)]
        for j, (v, chain) in enumerate(zip(carry, chains, strict=True)):
            envs[chain[0]][args[1 + j]] = outer[j]
            for prev, m in zip(chain, chain[1:]):
                carried[m][args[1 + j]] = (envs[prev], v)
        for env, c in zip(envs, carried, strict=True):
            env.carried = c
        return envs

    def __missing__(self, key):
        if key in self.carried:
            env, v = self.carried[key]
            return env[v]
        raise KeyError(key)


def _mesh_of(sub: ir.Operation):
    for op in sub.regions[0].blocks[0].operations:
        if op.operation.name == "sdy.mesh":
            return op.operation
    raise MultimeshValueError("A fragment module has no sdy.mesh.")


def _find_mesh(module: ir.Module, name: str):
    for view in module.body.operations:
        op = view.operation
        if op.name == "sdy.mesh" and ir.StringAttr(op.attributes["sym_name"]).value == name:
            return sdy.MeshAttr(op.attributes["mesh"])
    raise MultimeshValueError(f"Unknown mesh @{name}.")


def _fragment(name: str, sub: ir.Operation) -> Fragment:
    header = read_fragment_header(sub, name)
    devices, loop_devices = header.devices, header.loop_devices
    mesh = sdy.MeshAttr(_mesh_of(sub).attributes["mesh"])
    axis_names = tuple(sdy.MeshAxisAttr(a).name for a in mesh.axes)
    axis_sizes = tuple(sdy.MeshAxisAttr(a).size for a in mesh.axes)
    fn = None
    for op in sub.regions[0].blocks[0].operations:
        if op.operation.name == "func.func":
            fn = op.operation
    assert fn is not None  # mm-extract-fragments puts the fragment's function in it
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    arg_attrs = _attr_list(fn, "arg_attrs", len(ftype.inputs))

    def layouts(which, n):
        return [(devices, axis_names, axis_sizes, _sharding_dims(a["sdy.sharding"]))
                for a in _attr_list(fn, which, n)]

    donors = tuple(k for k, a in enumerate(arg_attrs)
                   if a is not None and DONOR_ATTR in a)
    return Fragment(name, header.task, header.transpose_count, devices, axis_names,
                    axis_sizes, _standalone(sub), layouts("arg_attrs", len(ftype.inputs)),
                    layouts("res_attrs", len(ftype.results)),
                    [_type_info(t) for t in ftype.inputs], [_type_info(t) for t in ftype.results],
                    loop_devices, donors)


def _trivial(sub: ir.Operation) -> tuple[str, list[int]] | None:
    """How a fragment computes nothing, if it does: ``("zeros", [])`` when it takes no
    arguments and returns splat zeros (``mm-form-microbatch-loop``'s ``<task>_acc_init``),
    ``("pass", [argument number per result])`` when it returns its arguments, at most
    through ``sdy.sharding_constraint`` (e.g. a constraint to the layout an input has
    already, outside a microbatch loop); else None."""
    fn = next((op.operation for op in sub.regions[0].blocks[0].operations
               if op.operation.name == "func.func"), None)
    if fn is None or not fn.regions[0].blocks:
        return None  # not a fragment: reading it (_fragment) says what is wrong
    block = fn.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    source: dict[ir.Value, int] = {a: a.arg_number for a in block.arguments}
    for op in ops[:-1]:
        if op.name == "stablehlo.constant" and not len(block.arguments) and _zero(op):
            source[op.results[0]] = -1
        elif op.name == "sdy.sharding_constraint" and op.operands[0] in source \
                and source[op.operands[0]] >= 0:
            source[op.results[0]] = source[op.operands[0]]
        else:
            return None
    if not ops[-1].operands or any(v not in source for v in ops[-1].operands):
        return None
    found: list[int] = [source[v] for v in ops[-1].operands]
    if all(f == -1 for f in found):
        return "zeros", []
    return ("pass", found) if all(f >= 0 for f in found) else None


def _zero(op: ir.Operation) -> bool:
    """Whether a ``stablehlo.constant`` is a splat of integer or real zero."""
    try:
        value = ir.DenseElementsAttr(op.attributes["value"])
        if not value.is_splat:
            return False
        splat = value.get_splat_value()
        if isinstance(splat, (ir.IntegerAttr, ir.FloatAttr)):
            return splat.value == 0
    except (ValueError, TypeError):
        pass
    return False


def _standalone(sub: ir.Operation) -> str:
    """The nested module as its own text, with a generic name and no mm.* attributes.

    A generic module name makes identical fragments identical text, so they
    compile once.
    """
    op = sub.clone()  # detached: printed once, no round trip through text
    try:
        for n in [a if isinstance(a, str) else a.name for a in op.attributes]:
            if n.startswith(PREFIX):
                del op.attributes[n]
        op.attributes["sym_name"] = ir.StringAttr.get("multimesh_fragment")
        return print_module(op)
    finally:
        op.erase()
