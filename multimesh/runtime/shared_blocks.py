"""Compile each distinct block once across stages (issue 40, CSCALE).

XLA:CPU compiles a kernel once per program, but again in every program. A pipeline's
stages run the same blocks: stage 0's forward is the embedding then two blocks, stage
1's the same two blocks, the last stage's two blocks then the head. Fragments identical
up to their devices compile once already (``executor._shape_key``); this module makes a
fragment that *contains* another distinct fragment reuse that one's executable too.

For a distinct fragment A and a smaller distinct fragment B on a submesh of the same
shape, :func:`_match` walks from B's results back through B's ops and A's ops in lock
step (same op, attributes, types and operand structure), mapping each of B's values to
one of A's, one to one. When every result of B maps and the ops matched are closed
(what they read from the rest of A is exactly the images of B's arguments, and what
the rest of A reads from them is exactly the images of B's results), A runs as up to
three programs (:func:`_cut`): ``pre`` (what B's inputs depend on), B's own program
(its text, argument and result order, shardings and layouts: identical up to devices,
so the executor loads B's executable instead of compiling it), and ``post`` (the rest).
Values that cross between them take B's argument and result shardings, or A's own
where they are A's arguments or results, so XLA reshards inside ``pre`` or ``post``
where a layout differs: correct by construction.

The plan does not change: the fragment's call runs a :class:`SplitExecutable`, which
calls the pieces' executables in turn and returns A's results in A's order, so the
schedule, the transfers and the memory accounting see one call. A donated argument is
donated into the one piece that reads it; one that several pieces read is not donated
(the executor then frees it after its last use, as for any donation an executable
cannot make). B's own donations (running sums) need an argument only B's piece reads.

A fragment is split only when that saves compiling: B is compiled anyway (it is one of
the program's distinct fragments, and not split itself), B has at least
:data:`MIN_SHARED_OPS` ops, and neither has host callbacks.
``$MULTIMESH_SHARE_BLOCKS=off`` turns it off (:func:`share_blocks`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from multimesh._src import callbacks, jax_compat
from multimesh._src.caches import LRUCache
from multimesh._src.errors import MultimeshValueError
from multimesh._src.ir_contract import DONOR_ATTR
from multimesh._src.log import compile_log_level, logger
from multimesh._src.mlir import func, ir, make_context, parse_module, print_module
from multimesh.runtime import fragment_store
from multimesh.runtime.memory import shard_bytes
from multimesh.runtime.plan import Fragment, moved

__all__ = ["SHARE_ENV", "MIN_SHARED_OPS", "share_blocks", "SplitFragment", "SplitExecutable",
           "plan_splits"]

SHARE_ENV = "MULTIMESH_SHARE_BLOCKS"
"""``on`` (the default) or ``off``: whether a fragment that contains another distinct
fragment runs that one's executable for the part they share."""

MIN_SHARED_OPS = 32
"""The fewest ops (constants aside) a shared fragment must have: below that, the
compile it saves is not worth a fragment's extra calls."""

Key = tuple[int, int]
"""A value of a fragment's function: ``(op index, result number)``, or ``(-1, i)`` for
argument ``i``."""
Port = tuple[tuple, str, tuple]
"""How a value crosses between pieces: ``(placement, sdy.sharding text, (shape, dtype))``."""
Wire = tuple[int, int]
"""Where a piece's argument comes from: ``(0, i)`` the fragment's argument i, ``(p, i)``
result i of the p-th piece (1-based)."""

_SSA = re.compile(r"%[\w.$#-]+|\^bb\d+")
_SYMBOL = re.compile(r'@("(?:[^"\\]|\\.)*"|[\w$.-]+)')
_OP_NAME = re.compile(r"\b(?:stablehlo|chlo|sdy|mhlo)\.\w+")
_PIECE_ATTRS = {"sdy.sharding", DONOR_ATTR}


def share_blocks() -> bool:
    """``$MULTIMESH_SHARE_BLOCKS``, checked: True unless it is ``off``."""
    raw = os.environ.get(SHARE_ENV, "")
    env = raw.strip().lower()
    if env in ("", "on"):
        return True
    if env == "off":
        return False
    raise MultimeshValueError(
        f"{SHARE_ENV} must be on or off, got {raw!r}; for example {SHARE_ENV}=off to "
        f"compile every distinct fragment whole, even where it contains another "
        f"fragment's program.")


# ----------------------------------------------------------------------------- graphs


@dataclass
class _Graph:
    """One fragment's function as a value graph (the ``func.return`` left out)."""

    sigs: list[str]
    """Per op: its generic form with values renamed by first appearance and meshes by
    declaration order (equal signatures: the same op on the same types)."""
    operands: list[tuple[Key, ...]]
    n_results: list[int]
    free: list[bool]
    """Ops without operands or regions (constants, iotas): copied wherever used."""
    captures: list[bool]
    """Ops with regions that read values from outside them (never copied or shared)."""
    returns: list[Key]
    types: dict[Key, str]
    arg_shardings: list[str]
    res_shardings: list[str]
    meshes: list[tuple[str, str]]
    """``(name, mesh attribute)`` of each ``sdy.mesh``, in order."""
    func_attrs: dict[str, str]
    users: dict[Key, list[int]] = field(default_factory=dict)
    by_sig: dict[str, list[int]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.sigs) - sum(self.free)


def _module_parts(module) -> tuple[list, Any] | None:
    """(the ``sdy.mesh`` ops, the one function), or None for any other module."""
    meshes, funcs = [], []
    for view in module.body.operations:
        op = view.operation
        if op.name == "sdy.mesh":
            meshes.append(op)
        elif op.name == "func.func":
            funcs.append(op)
        else:
            return None
    return (meshes, funcs[0]) if len(funcs) == 1 else None


def _sig(text: str, mesh_index: dict[str, str]) -> str:
    """An op's printed text with its values renamed by first appearance and its
    meshes by declaration order."""
    names: dict[str, str] = {}
    text = _SSA.sub(lambda m: names.setdefault(m[0], f"%{len(names)}"), text)
    return _SYMBOL.sub(lambda m: "@" + mesh_index.get(m[1], m[1]), text)


def _op_texts(text: str, ops: list) -> list[str]:
    """Each op of the function as printed: the fragment's own lines, one op from each
    line indented four spaces to the next (its regions' lines between); each op
    printed on its own where the lines do not fall into as many ops."""
    body = text[text.index("func.func"):].split("\n")[1:]
    chunks: list[list[str]] = []
    for line in body:
        if line.startswith("    ") and line[4:5] not in (" ", "}", "^", ")", ""):
            chunks.append([line])
        elif line.startswith("     ") or line.startswith("    }") or \
                line.startswith("    ^") or line.startswith("    )"):
            if not chunks:
                break
            chunks[-1].append(line)
        elif line.strip():
            break
    if len(chunks) == len(ops) and "\n#" not in text and "\n!" not in text:
        return ["\n".join(c) for c in chunks]
    return [str(op.get_asm(print_generic_op_form=True, use_local_scope=True)) for op in ops]


def _named(attrs) -> list:
    return [attrs[i] for i in range(len(attrs))]


def _captures(op) -> bool:
    """Whether a nested op of ``op`` reads a value defined outside ``op``."""
    if not len(op.regions):
        return False
    inside: set = set()
    seen = [0, False]  # ops visited, a capture found

    def visit(o):
        o = o.operation
        if seen[0]:  # not ``op`` itself, whose operands come from outside
            seen[1] = seen[1] or any(v not in inside for v in o.operands)
        seen[0] += 1
        for region in o.regions:
            for block in region.blocks:
                inside.update(block.arguments)
        inside.update(o.results)
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return bool(seen[1])


def _attrs(fn, which: str, n: int) -> list[dict[str, str]] | None:
    """Per argument (or result): its attributes as text; None if any is one a piece
    cannot carry (only ``sdy.sharding`` and the donor mark are known)."""
    if which not in fn.attributes:
        return [{} for _ in range(n)]
    out = []
    for d in ir.ArrayAttr(fn.attributes[which]):
        d = ir.DictAttr(d)
        got = {d[i].name: str(d[i].attr) for i in range(len(d))}
        if set(got) - _PIECE_ATTRS or "sdy.sharding" not in got:
            return None
        out.append(got)
    return out


def _graph(text: str, ctx) -> _Graph | None:
    """The value graph of a fragment's text; None where no split can apply."""
    module = parse_module(text, ctx)
    with ctx:
        parts = _module_parts(module)
        if parts is None:
            return None
        meshes, fn = parts
        mesh_names = [ir.StringAttr(m.attributes["sym_name"]).value for m in meshes]
        # Each mesh's name made canonical (no symbol name holds "<" or a space).
        index = {n: f"<mesh {i}>" for i, n in enumerate(mesh_names)}
        index.update({f'"{n}"': f"<mesh {i}>" for i, n in enumerate(mesh_names)})
        block = fn.regions[0].blocks[0]
        ops = [o.operation for o in block.operations]
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        arg_attrs = _attrs(fn, "arg_attrs", len(ftype.inputs))
        res_attrs = _attrs(fn, "res_attrs", len(ftype.results))
        if arg_attrs is None or res_attrs is None or ops[-1].name != "func.return":
            return None
        return _fill(ops, _op_texts(text, ops), block, index, arg_attrs, res_attrs,
                     [(n, str(m.attributes["mesh"])) for n, m in zip(mesh_names, meshes)],
                     {a.name: str(a.attr) for a in _named(fn.attributes)})


def _fill(ops, texts, block, index, arg_attrs, res_attrs, meshes, fn_attrs) -> _Graph:
    key: dict = {a: (-1, a.arg_number) for a in block.arguments}
    types: dict[Key, str] = {(-1, a.arg_number): str(a.type) for a in block.arguments}
    g = _Graph([], [], [], [], [], [], types, [a["sdy.sharding"] for a in arg_attrs],
               [a["sdy.sharding"] for a in res_attrs], meshes, fn_attrs)
    for i, op in enumerate(ops[:-1]):
        g.sigs.append(_sig(texts[i], index))
        g.operands.append(tuple(key[v] for v in op.operands))
        g.n_results.append(len(op.results))
        g.free.append(not len(op.operands) and not len(op.regions))
        g.captures.append(_captures(op))
        for r in op.results:
            key[r] = (i, r.result_number)
            types[(i, r.result_number)] = str(r.type)
        for k in g.operands[-1]:
            g.users.setdefault(k, []).append(i)
        g.by_sig.setdefault(g.sigs[-1], []).append(i)
    g.returns = [key[v] for v in ops[-1].operands]
    return g


# ----------------------------------------------------------------------------- matching


class _Match:
    """A one-to-one map of B's values onto A's (constants may share an image)."""

    def __init__(self, a: _Graph, b: _Graph):
        self.a, self.b = a, b
        self.args: dict[int, Key] = {}  # B argument -> A value
        self.ops: dict[int, int] = {}  # B op -> A op
        self._arg_images: set[Key] = set()
        self._op_images: set[int] = set()

    def value(self, bk: Key) -> Key:
        return self.args[bk[1]] if bk[0] < 0 else (self.ops[bk[0]], bk[1])

    @property
    def op_images(self) -> set[int]:
        return self._op_images

    def unify(self, bk: Key, ak: Key) -> bool:
        """Map B's value ``bk`` and everything it depends on onto A's from ``ak``; on
        failure the map is left as it was."""
        trail: list[Key] = []
        stack = [(bk, ak)]
        while stack:
            if not self._bind(*stack.pop(), trail, stack):
                self._undo(trail)
                return False
        return True

    def _bind(self, bk: Key, ak: Key, trail: list[Key], stack: list) -> bool:
        a, b = self.a, self.b
        if bk[0] < 0:
            got = self.args.get(bk[1])
            if got is not None:
                return got == ak
            if ak in self._arg_images or b.types[bk] != a.types[ak]:
                return False
            self.args[bk[1]] = ak
            self._arg_images.add(ak)
            trail.append(bk)
            return True
        if ak[0] < 0 or ak[1] != bk[1]:
            return False
        got_op = self.ops.get(bk[0])
        if got_op is not None:
            return got_op == ak[0]
        if a.sigs[ak[0]] != b.sigs[bk[0]] or (ak[0] in self._op_images
                                              and not b.free[bk[0]]):
            return False
        self.ops[bk[0]] = ak[0]
        self._op_images.add(ak[0])
        trail.append(bk)
        stack.extend(zip(b.operands[bk[0]], a.operands[ak[0]]))
        return True

    def _undo(self, trail: list[Key]) -> None:
        for bk in trail:
            if bk[0] < 0:
                self._arg_images.discard(self.args.pop(bk[1]))
            else:
                ai = self.ops.pop(bk[0])
                if ai not in self.ops.values():
                    self._op_images.discard(ai)


def _match(a: _Graph, b: _Graph) -> _Match | None:
    """B's whole computation found inside A (every result and argument mapped)."""
    m = _Match(a, b)
    # the results with the most ops behind them first: their anchors are the least
    # ambiguous (B's arguments match any value, so a small cone may match many places)
    cone = {k: len(_ancestors(b, [bk])) for k, bk in enumerate(b.returns)}
    for k in sorted(cone, key=lambda k: -cone[k]):
        bk = b.returns[k]
        if bk[0] < 0 or bk[0] in m.ops:
            continue
        cands = a.by_sig.get(b.sigs[bk[0]], ())
        if not any(m.unify(bk, (ai, bk[1])) for ai in cands):
            return None
    n_args = len(b.arg_shardings)
    return m if len(m.args) == n_args else None


# ----------------------------------------------------------------------------- cutting


@dataclass
class _BlockCut:
    """A's ops in three parts: ``pre`` (before B's program), the matched ones, ``post``."""

    pre: list[int]
    shared: set[int]
    post: list[int]
    outs: dict[Key, int]
    """A value -> the B result it is."""


def _cut(m: _Match) -> _BlockCut | None:
    a, b = m.a, m.b
    shared = {i for i in m.op_images if not a.free[i]}
    outs: dict[Key, int] = {}
    for k, bk in enumerate(b.returns):
        outs.setdefault(m.value(bk), k)
    returned = set(a.returns)
    for i in shared:
        for r in range(a.n_results[i]):
            ak = (i, r)
            if ak not in outs and (ak in returned or any(
                    u not in shared for u in a.users.get(ak, ()))):
                return None  # the rest of A reads a value B's program does not return
    sources = [ak for ak in m.args.values() if ak[0] >= 0 and not a.free[ak[0]]]
    pre = _ancestors(a, sources)
    if pre & shared:
        return None
    post = [i for i in range(len(a.sigs))
            if i not in pre and i not in shared and not a.free[i]]
    if any(a.captures[i] for i in (*pre, *post)):
        return None
    return _BlockCut(sorted(pre), shared, post, outs)


def _ancestors(a: _Graph, values: Sequence[Key]) -> set[int]:
    """The ops (constants aside) that ``values`` are computed from, theirs included."""
    seen: set[int] = set()
    stack = [k[0] for k in values if k[0] >= 0]
    while stack:
        i = stack.pop()
        if i in seen or a.free[i]:
            continue
        seen.add(i)
        stack.extend(k[0] for k in a.operands[i] if k[0] >= 0)
    return seen


# ----------------------------------------------------------------------------- wiring


@dataclass
class _Piece:
    """One program of a split fragment, as A's ops and its ports."""

    name: str
    ops: list[int]
    inputs: list[tuple[Key, Port, Wire]] = field(default_factory=list)
    outputs: list[tuple[Key, Port]] = field(default_factory=list)

    def __post_init__(self):
        self.op_set = set(self.ops)

    @property
    def empty(self) -> bool:
        return not self.ops and not self.outputs

    def output(self, ak: Key, port: Port) -> int:
        for i, (k, p) in enumerate(self.outputs):
            if k == ak and p[0] == port[0]:
                return i
        self.outputs.append((ak, port))
        return len(self.outputs) - 1

    def input(self, ak: Key, port: Port, wire: Wire) -> None:
        if all(w != wire for _, _, w in self.inputs):
            self.inputs.append((ak, port, wire))


@dataclass
class _Wiring:
    """How A's arguments flow through ``pre``, B's program and ``post`` to A's results."""

    pre: _Piece
    post: _Piece
    s_args: list[Wire]
    results: list[Wire]


class _Ports:
    """The ports of A's arguments and results and of B's (as B's program on A's devices)."""

    def __init__(self, a: Fragment, ga: _Graph, s: Fragment, gb: _Graph, rename):
        self.a_in = [(lay, sh, t) for lay, sh, t in zip(a.in_layouts, ga.arg_shardings,
                                                       a.in_types)]
        self.a_out = [(lay, sh, t) for lay, sh, t in zip(a.out_layouts, ga.res_shardings,
                                                        a.out_types)]
        self.s_in = [(lay, rename(sh), t) for lay, sh, t in zip(s.in_layouts,
                                                               gb.arg_shardings, s.in_types)]
        self.s_out = [(lay, rename(sh), t) for lay, sh, t in zip(
            s.out_layouts, gb.res_shardings, s.out_types)]
        self._types = ga.types
        self._home = (a.devices, a.axis_names, a.axis_sizes)
        self._mesh = _SYMBOL.search(ga.arg_shardings[0] if ga.arg_shardings
                                    else ga.res_shardings[0])

    def like(self, mlir_type: str) -> Port:
        """A port for a value ``pre`` hands to ``post`` alone: the sharding of the
        first port of its type (B's arguments, A's results, B's results, A's
        arguments), else replicated on the submesh. Any is correct: XLA reshards."""
        want = _shape_dtype(mlir_type)
        for port in (*self.s_in, *self.a_out, *self.s_out, *self.a_in):
            if (tuple(port[2][0]), port[2][1]) == want:
                return port
        shape, dtype = _shape_dtype(mlir_type)
        mesh = self._mesh[0] if self._mesh else "@mesh"
        spec = ", ".join("{}" for _ in shape)
        return ((*self._home, ((),) * len(shape)), f"#sdy.sharding<{mesh}, [{spec}]>",
                (shape, dtype))


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([^,>]+)>")


def _shape_dtype(mlir_type: str) -> tuple[tuple[int, ...], str]:
    m = _TENSOR.fullmatch(mlir_type)
    if m is None:
        raise ValueError(f"Not a ranked tensor type without an encoding: {mlir_type}.")
    return tuple(int(d) for d in m[1].split("x")[:-1]), m[2]


PRE, S, POST = 1, 2, 3  # the pieces' slots in a SplitExecutable run


def _wire(m: _Match, cut: _BlockCut, ports: _Ports, name: str) -> _Wiring | None:
    """Which piece computes each value that crosses, and with which sharding; None
    where a value ``pre`` hands to ``post`` has no sharding to take."""
    a = m.a
    pre_set = set(cut.pre)
    pre, post = _Piece(f"{name}.pre", cut.pre), _Piece(f"{name}.post", cut.post)
    s_args: list[Wire] = []
    for i in range(len(m.b.arg_shardings)):
        ak = m.args[i]
        if ak[0] < 0 and ports.a_in[ak[1]][0] == ports.s_in[i][0]:
            s_args.append((0, ak[1]))
        else:  # computed by pre, or an argument resharded by it
            s_args.append((PRE, pre.output(ak, ports.s_in[i])))
    results: list[Wire] = []
    for j, ak in enumerate(a.returns):
        if ak[0] < 0 or ak[0] in pre_set:
            results.append((PRE, pre.output(ak, ports.a_out[j])))
        elif ak in cut.outs and ports.s_out[cut.outs[ak]][0] == ports.a_out[j][0]:
            results.append((S, cut.outs[ak]))
        else:
            results.append((POST, post.output(ak, ports.a_out[j])))
    w = _Wiring(pre, post, s_args, results)
    return w if _inputs(m, cut, ports, w) else None


def _inputs(m: _Match, cut: _BlockCut, ports: _Ports, w: _Wiring) -> bool:
    """Fill ``pre``'s and ``post``'s inputs; False where ``post`` reads a value of
    ``pre`` that crosses with no known sharding."""
    a = m.a
    pre_set = set(cut.pre)
    for ak, _ in w.pre.outputs:  # pass-throughs of arguments
        if ak[0] < 0:
            w.pre.input(ak, ports.a_in[ak[1]], (0, ak[1]))
    for piece in (w.pre, w.post):
        for i in piece.ops:
            for ak in a.operands[i]:
                if not _input(m, cut, ports, w, piece, ak, pre_set):
                    return False
        for ak, _ in piece.outputs:
            if piece is w.post and not _input(m, cut, ports, w, piece, ak, pre_set):
                return False
    return True


def _input(m: _Match, cut: _BlockCut, ports: _Ports, w: _Wiring, piece: _Piece, ak: Key,
           pre_set: set[int]) -> bool:
    a = m.a
    if ak[0] < 0:
        piece.input(ak, ports.a_in[ak[1]], (0, ak[1]))
    elif a.free[ak[0]] or ak[0] in piece.op_set:
        return True
    elif ak[0] in pre_set:
        hit = next((i for i, (k, _) in enumerate(w.pre.outputs) if k == ak), None)
        if hit is None:  # a value only the two pieces share
            hit = w.pre.output(ak, ports.like(a.types[ak]))
        piece.input(ak, w.pre.outputs[hit][1], (PRE, hit))
    elif ak in cut.outs:
        piece.input(ak, ports.s_out[cut.outs[ak]], (S, cut.outs[ak]))
    else:
        return False
    return True


# ----------------------------------------------------------------------------- emitting


def _emit(text: str, g: _Graph, piece: _Piece, ctx) -> str:
    """``piece`` as a module of its own: A's module with a new ``main`` of its ops."""
    module = parse_module(text, ctx)
    with ctx, ir.Location.unknown():
        parts = _module_parts(module)
        assert parts is not None  # _graph read the same text
        old = parts[1]
        ops = [o.operation for o in old.regions[0].blocks[0].operations]
        new = func.FuncOp("piece", ([ir.Type.parse(g.types[k]) for k, _, _ in piece.inputs],
                                    [ir.Type.parse(g.types[k]) for k, _ in piece.outputs]),
                          ip=ir.InsertionPoint(module.body))
        block = new.add_entry_block()  # type: ignore[attr-defined]
        env: dict[Key, Any] = {}
        for i, (k, _, _) in enumerate(piece.inputs):
            env.setdefault(k, block.arguments[i])
        with ir.InsertionPoint(block):
            for i in piece.ops:
                _clone(ops, i, env, g)
            func.ReturnOp([_value(ops, k, env, g) for k, _ in piece.outputs])
        _signature(new.operation, old, piece)
        old.erase()
        new.operation.attributes["sym_name"] = ir.StringAttr.get("main")
        return print_module(module)


def _value(ops: list, k: Key, env: dict, g: _Graph):
    if k not in env:  # a constant: copied here
        assert k[0] >= 0 and g.free[k[0]]
        _clone(ops, k[0], env, g)
    return env[k]


def _clone(ops: list, i: int, env: dict, g: _Graph) -> None:
    values = [_value(ops, k, env, g) for k in g.operands[i]]
    new = ops[i].clone()
    for n, v in enumerate(values):
        new.operands[n] = v
    for r in range(g.n_results[i]):
        env[(i, r)] = new.results[r]


def _signature(new, old, piece: _Piece) -> None:
    """The piece's argument and result shardings, and ``old``'s other attributes."""
    def dicts(ports):
        return ir.ArrayAttr.get([ir.DictAttr.get({"sdy.sharding": ir.Attribute.parse(p[1])})
                                 for p in ports])
    new.attributes["arg_attrs"] = dicts([p for _, p, _ in piece.inputs])
    new.attributes["res_attrs"] = dicts([p for _, p in piece.outputs])
    for a in _named(old.attributes):
        if a.name not in ("sym_name", "function_type", "arg_attrs", "res_attrs"):
            new.attributes[a.name] = a.attr


# ----------------------------------------------------------------------------- donations


def _reads(w: _Wiring) -> Counter:
    """How many piece arguments each of A's arguments feeds."""
    wires = [*(x for _, _, x in w.pre.inputs), *w.s_args, *(x for _, _, x in w.post.inputs)]
    return Counter(i for p, i in wires if p == 0)


def _may_donate(wire: Wire, w: _Wiring, reads: Counter, donatable: set[int]) -> bool:
    """Whether the piece argument fed by ``wire`` may be donated: an argument of A that
    A may donate and only it reads, or a value of ``pre`` only B's program reads."""
    if wire[0] == 0:
        return wire[1] in donatable and reads[wire[1]] == 1
    uses = [*w.s_args, *w.results, *(x for _, _, x in w.post.inputs)]
    return uses.count(wire) == 1


def _donations(w: _Wiring, a_donors: set[int], b: Fragment, b_job: tuple[int, ...]
               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], set[int]] | None:
    """Donors of ``pre``, of B's program (B's job's, which its executable has) and of
    ``post``, and A's arguments donated; None if B's program must donate an argument
    it may not."""
    reads = _reads(w)
    if not all(_may_donate(w.s_args[i], w, reads, a_donors) for i in (*b.donors, *b_job)):
        return None
    pre = tuple(n for n, (_, _, x) in enumerate(w.pre.inputs)
                if x[0] == 0 and _may_donate(x, w, reads, a_donors))
    post = tuple(n for n, (_, _, x) in enumerate(w.post.inputs)
                 if x[0] == 0 and _may_donate(x, w, reads, a_donors))
    done = {x[1] for n, (_, _, x) in enumerate(w.pre.inputs) if n in pre}
    done |= {x[1] for n, (_, _, x) in enumerate(w.post.inputs) if n in post}
    done |= {w.s_args[i][1] for i in (*b.donors, *b_job) if w.s_args[i][0] == 0}
    return pre, b_job, post, done


# ----------------------------------------------------------------------------- splits

Job = tuple[Fragment, tuple[int, ...], tuple[int, ...] | None]


@dataclass
class SplitFragment:
    """A fragment run as up to three programs: its jobs and how their results combine."""

    fragment: Fragment
    shares: str
    """The fragment whose program (and executable) the middle piece is."""
    jobs: list[Job]
    slots: list[int]
    """Each job's slot (:data:`PRE`, :data:`S`, :data:`POST`)."""
    wires: list[list[Wire]]
    results: list[Wire]
    donated: frozenset[int]

    def assemble(self, got: list[tuple]) -> tuple[SplitExecutable, float]:
        """The split fragment's executable from its jobs' ``(executable, origin,
        seconds)``, and the seconds summed."""
        names = [job[0].name for job in self.jobs]
        exe = SplitExecutable(self, [e for e, _, _ in got],
                              [(n, o, s) for n, (_, o, s) in zip(names, got)])
        return exe, sum(s for _, _, s in got)


def _renamer(ga: _Graph, gb: _Graph) -> Callable[[str], str]:
    table = {}
    for (bn, _), (an, _) in zip(gb.meshes, ga.meshes):
        table[bn] = table[f'"{bn}"'] = f'"{an}"'
    return lambda text: _SYMBOL.sub(lambda m: "@" + table.get(m[1], m[1]), text)


def _middle(a: Fragment, b: Fragment) -> Fragment:
    """B's program on A's devices."""
    def move(lays):
        return [moved(lay, b.devices, a.devices) for lay in lays]
    return dataclasses.replace(b, name=f"{a.name}.{b.name}", devices=a.devices,
                               in_layouts=move(b.in_layouts), out_layouts=move(b.out_layouts),
                               loop_devices=a.loop_devices)


def _piece_fragment(a: Fragment, piece: _Piece, text: str) -> Fragment:
    return Fragment(piece.name, a.task, a.transpose_count, a.devices, a.axis_names,
                    a.axis_sizes, text, [p[0] for _, p, _ in piece.inputs],
                    [p[0] for _, p in piece.outputs], [p[2] for _, p, _ in piece.inputs],
                    [p[2] for _, p in piece.outputs], a.loop_devices, ())


def _split(job: Job, ga: _Graph, b_job: Job, gb: _Graph, ctx) -> SplitFragment | None:
    """A's job split around B's program, or None where it cannot be."""
    a, donors, positions = job
    b = b_job[0]
    m = _match(ga, gb)
    cut = _cut(m) if m is not None else None
    if m is None or cut is None:
        return None
    s = _middle(a, b)
    w = _wire(m, cut, _Ports(a, ga, s, gb, _renamer(ga, gb)), a.name)
    don = _donations(w, set(donors) | set(a.donors), b, b_job[1]) if w is not None else None
    if w is None or don is None:
        return None
    jobs: list[Job] = []
    slots, wires = [], []
    for slot, piece, d in ((PRE, w.pre, don[0]), (S, None, don[1]), (POST, w.post, don[2])):
        if piece is None:
            jobs.append((s, d, positions))
            wires.append(w.s_args)
        elif not piece.empty:
            jobs.append((_piece_fragment(a, piece, _emit(a.text, ga, piece, ctx)), d, positions))
            wires.append([x for _, _, x in piece.inputs])
        else:
            continue
        slots.append(slot)
    return SplitFragment(a, b.name, jobs, slots, wires, w.results, frozenset(don[3]))



class SplitExecutable:
    """A split fragment's executable: its pieces' executables called in turn (a
    ``FragmentCall``'s ``fn``), with XLA's analyses combined over them."""

    def __init__(self, split: SplitFragment, exes: list, pieces: list[tuple[str, str, float]]):
        self.split = split
        self.exes = exes
        self.pieces = pieces
        """``(piece name, where its executable came from, seconds)``, in call order."""
        self.donated = split.donated
        """A's arguments some piece donates."""
        self._calls = [(slot, jax_compat.dispatcher(e), wires)
                       for slot, e, wires in zip(split.slots, exes, split.wires)]
        self._results = split.results

    def __call__(self, *args):
        slots: list = [args, (), (), ()]
        for slot, fn, wires in self._calls:
            slots[slot] = fn(*[slots[p][i] for p, i in wires])
        return [slots[p][i] for p, i in self._results]

    def describe(self) -> str:
        return " + ".join(n for n, _, _ in self.pieces)

    def cost_analysis(self) -> dict:
        total: dict = {}
        for e in self.exes:
            ca = e.cost_analysis()
            for k, v in dict((ca[0] if isinstance(ca, (list, tuple)) else ca) or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    total[k] = total.get(k, 0) + v
        return total

    def memory_analysis(self) -> _Stats:
        """The pieces' stats summed, except: arguments and outputs are A's own, and the
        temporaries are the largest piece's plus every value that crosses between
        pieces (as if all were alive at once)."""
        stats = [e.memory_analysis() for e in self.exes]
        fields: dict[str, int] = {}
        for st in stats:
            for n in dir(st):
                v = getattr(st, n)
                if not n.startswith("_") and isinstance(v, int) and not isinstance(v, bool):
                    fields[n] = fields.get(n, 0) + v
        a = self.split.fragment
        args = sum(shard_bytes(*t, lay) for t, lay in zip(a.in_types, a.in_layouts))
        outs = sum(shard_bytes(*t, lay) for t, lay in zip(a.out_types, a.out_layouts))
        fields.update(argument_size_in_bytes=args, output_size_in_bytes=outs,
                      temp_size_in_bytes=max(st.temp_size_in_bytes for st in stats)
                      + max(0, sum(st.output_size_in_bytes for st in stats) - outs))
        return _Stats(fields)

    def as_text(self) -> str:
        return "\n".join(f"// piece {n} ({o})\n{e.as_text() or ''}"
                         for (n, o, _), e in zip(self.pieces, self.exes))


class _Stats:
    """XLA's memory statistics of a :class:`SplitExecutable`, as attributes."""

    def __init__(self, fields: dict[str, int]):
        for k, v in fields.items():
            setattr(self, k, v)


_TEXT_OPS = LRUCache("multimesh shared-block op counts", max_size=512)


def _op_counts(text: str) -> Counter:
    got = _TEXT_OPS.get(text)
    if got is None:
        got = _TEXT_OPS[text] = Counter(_OP_NAME.findall(text))
    return got


def _eligible(frag: Fragment) -> bool:
    return not callbacks.may_call_back(frag.text)


def _may_contain(a: Fragment, b: Fragment) -> bool:
    """A cheap test that A may hold B's program: the same submesh shape, and at
    least as many of each op."""
    if (len(a.devices), a.axis_names, a.axis_sizes) != (len(b.devices), b.axis_names,
                                                         b.axis_sizes):
        return False
    ca, cb = _op_counts(a.text), _op_counts(b.text)
    return sum(cb.values()) >= MIN_SHARED_OPS and all(ca[k] >= n for k, n in cb.items())


PLANS = fragment_store.SPLIT_PLANS
"""The fragment store's folder for split plans."""


def plan_splits(jobs: Sequence[Job], shape_key: Callable, device=None
                ) -> dict[int, SplitFragment]:
    """Job index -> its :class:`SplitFragment`, for each job whose fragment holds the program of
    another distinct fragment of ``jobs`` (``shape_key``: the executor's test for
    fragments identical up to their devices); empty when :func:`share_blocks` is off.

    With jax's persistent cache on, the result is kept in :mod:`.fragment_store` (keyed
    by the jobs and by ``device``'s kind and the versions), so that a restarted process
    loads it instead of matching the fragments again (about 0.1 s for the lm1b step)."""
    if not share_blocks():
        return {}
    key = fragment_store.entry_key(("shared-blocks plan", repr(list(jobs))), device) \
        if device is not None and fragment_store.directory(PLANS) is not None else None
    stored = _read_plan(key, len(jobs))
    if stored is not None:
        for j in sorted(stored):
            _log(stored[j])
        return stored
    t0 = time.perf_counter()
    out = _plan_splits(jobs, shape_key)
    if key is not None:
        fragment_store.write(key, pickle.dumps(out), time.perf_counter() - t0, PLANS)
    return out


def _read_plan(key: str | None, n_jobs: int) -> dict[int, SplitFragment] | None:
    """A stored plan, or None (none stored, or one that cannot be read: planned again)."""
    data = fragment_store.read(key, PLANS) if key is not None else None
    if data is None:
        return None
    try:
        plan = pickle.loads(data)  # noqa: S301 - our own entry, in the user's cache dir
    except Exception:  # noqa: BLE001 - a stale or damaged entry: plan again
        return None
    ok = isinstance(plan, dict) and all(
        isinstance(j, int) and 0 <= j < n_jobs and isinstance(v, SplitFragment)
        for j, v in plan.items())
    return plan if ok else None


def _plan_splits(jobs: Sequence[Job], shape_key: Callable) -> dict[int, SplitFragment]:
    leaders: dict = {}
    for j, (frag, donors, _) in enumerate(jobs):
        if _eligible(frag):
            leaders.setdefault(shape_key(frag, donors), j)
    order = sorted(leaders.values(), key=lambda j: sum(_op_counts(jobs[j][0].text).values()))
    graphs = _Graphs(jobs)
    whole: list[int] = []  # distinct fragments kept whole so far (the ones to share)
    found: dict = {}  # A's shape key -> B's job
    out: dict[int, SplitFragment] = {}
    for j in order:
        hit = _find(j, jobs, whole, graphs)
        if hit is None:
            whole.append(j)
        else:
            found[shape_key(jobs[j][0], jobs[j][1])], out[j] = hit
    for j, job in enumerate(jobs):
        bj = found.get(shape_key(job[0], job[1]))
        if j not in out and bj is not None:
            split = _split_job(j, bj, jobs, graphs)
            if split is not None:
                out[j] = split
    for j in sorted(out):
        _log(out[j])
    return out


class _Graphs:
    """The jobs' fragments' graphs, read once each, in one MLIR context."""

    def __init__(self, jobs: Sequence[Job]):
        self.jobs = jobs
        self._graphs: dict[int, _Graph | None] = {}
        self._ctx: Any = None

    @property
    def ctx(self):
        if self._ctx is None:
            self._ctx = make_context()
        return self._ctx

    def __getitem__(self, j: int) -> _Graph | None:
        if j not in self._graphs:
            self._graphs[j] = _graph(self.jobs[j][0].text, self.ctx)
        return self._graphs[j]


def _split_job(j: int, bj: int, jobs: Sequence[Job], graphs: _Graphs) -> SplitFragment | None:
    ga, gb = graphs[j], graphs[bj]
    return _split(jobs[j], ga, jobs[bj], gb, graphs.ctx) if ga and gb else None


def _find(j: int, jobs: Sequence[Job], whole: list[int], graphs: _Graphs
          ) -> tuple[int, SplitFragment] | None:
    """The largest distinct fragment kept whole whose program job ``j`` holds, and
    job ``j`` split around it."""
    a = jobs[j][0]
    for bj in reversed(whole):
        b = jobs[bj][0]
        if not _may_contain(a, b):
            continue
        ga, gb = graphs[j], graphs[bj]
        if ga is None or gb is None or gb.size < MIN_SHARED_OPS:
            continue
        split = _split(jobs[j], ga, jobs[bj], gb, graphs.ctx) \
            if [m for _, m in ga.meshes] == [m for _, m in gb.meshes] else None
        if split is not None:
            return bj, split
    return None


def _log(split: SplitFragment) -> None:
    level = compile_log_level()
    if logger.isEnabledFor(level):
        logger.log(level, "multimesh: fragment %s runs as %s (sharing %s's program)",
                   split.fragment.name, " + ".join(j[0].name for j in split.jobs),
                   split.shares)
