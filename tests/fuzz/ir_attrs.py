"""IR fuzzing by attribute *type and value*: one attribute replaced at the MLIR level.

Text mutations (``tests/test_fuzz_ir.py``) rarely produce a well-formed module whose
attribute merely has the wrong type, which is what crashed jaxlib and our readers
(issue 21: a ``topology`` string, ``num_stages = "4"``, a 64-bit device position).
:func:`mutate_attributes` parses a seed, picks an attribute that multimesh or its
dialects read (dialect-prefixed attributes such as ``mm.*``, ``sdy.sharding``,
``mhlo.*``, ``topology``, ``mesh_shape``, and the entries of ``@main``'s and the
fragments' argument dictionaries) and replaces it, or one entry deep inside it (a
dictionary key, a list element), by a value of another type or an extreme value of its
own: strings, integers of every width and sign (``i64`` max, ``i128``), floats (NaN,
1e300), lists (empty, mixed, 2,000 long), dictionaries, ``unit``, booleans, symbol
references, dense arrays, types, Shardy meshes and mpmd topologies. One time in seven
the choice extends to ops' inherent attributes (``sym_name``, ``function_type``,
``callee``, mpmd's ``origin``); the custom printers read those, so such a module is
printed in generic form, as it is one time in four anyway.
"""

from __future__ import annotations

import random

from multimesh._src.mlir import ir, make_context

__all__ = ["VALUES", "mutate_attributes"]

_I = ("0", "1", "-1", "3", "7", "8", "4294967296", "9223372036854775807",
      "-9223372036854775808", "2147483648")
VALUES = (
    '"m1"', '""', '"x"', '"mm.default"', '"1f1b"', '"custom"', '"' + "a" * 300 + '"',
    '"caf\\C3\\A9"', *(f"{i} : i64" for i in _I), "99999999999999999999999 : i128",
    "1 : i32", "-3 : i8", "5 : index", "2.5 : f64", "0x7FF8000000000000 : f64",
    "1.0e300 : f64", "-0.0 : f32", "unit", "true", "false", "[]", "[1, 2]", "[0, 1, 2, 3]",
    "[-1]", "[0, 0]", '["x"]', '[["a", "x"]]', '[1, "a", 2.5]', "[[]]", "[unit]",
    "[" + ", ".join(str(i) for i in range(2000)) + "]", "{}", '{name = "a"}',
    '{name = "a", transpose_count = 0 : i64}', "{loop = 0 : i64, num_microbatches = "
    "1000000000 : i64}", '{schedule = "1f1b", num_stages = "4"}', "{unrolling = 2.5 : f64}",
    '{m1 = [0, 1, 2, 3], m2 = [4, 5, 6, 9223372036854775807]}', '{devices = [0], '
    'axis_names = ["x"], axis_sizes = [1], logical_axes = []}', "@main", "@nowhere",
    "array<i64: 1, 2>", "array<i32>", "f32", "tensor<2xf32>", "dense<1> : tensor<2xi32>",
    'dense<"0x0000803F"> : tensor<1xf32>', '#sdy.mesh<["x"=4]>', "#sdy.mesh<[]>",
    '#sdy.sharding<@mesh, [{}, {}]>', '#mpmd.topology<<"m1" : <["x"=4]>>>',
    '#mpmd.topology<<"m1" : <["x"=2]>>, <"m2" : <["x"=2]>>>',
    "affine_map<(d0) -> (d0)>",
)
_INHERENT = {"sym_name", "function_type", "callee", "sym_visibility", "arg_attrs",
             "res_attrs", "call_target_name", "api_version", "backend_config",
             "has_side_effect", "operand_layouts", "result_layouts", "output_operand_aliases",
             "called_computations", "mesh", "sharding", "no_inline"}


def _readable(name: str) -> bool:
    """Attributes multimesh or a dialect reads that the printer does not (discardable)."""
    return name not in _INHERENT and ("." in name or name in ("topology", "mesh_shape"))


def _sites(module: ir.Module, inherent: bool = False
           ) -> list[tuple[ir.Operation, str, int | None]]:
    """``(op, attribute name, argument index or None)`` for every attribute to mutate
    (with ``inherent``, ops' inherent attributes too); an argument index means an entry
    of the op's ``arg_attrs`` (a function argument)."""
    sites: list[tuple[ir.Operation, str, int | None]] = []

    def visit(op):
        op = op.operation
        attrs = op.attributes
        for i in range(len(attrs)):
            name = attrs[i].name
            if _readable(name) or (inherent and name not in ("arg_attrs", "res_attrs")):
                sites.append((op, name, None))
        if op.name == "func.func" and "arg_attrs" in attrs:
            for k, d in enumerate(ir.ArrayAttr(attrs["arg_attrs"])):
                for j in range(len(ir.DictAttr(d))):
                    sites.append((op, ir.DictAttr(d)[j].name, k))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return sites


def _value(rng: random.Random) -> ir.Attribute:
    return ir.Attribute.parse(rng.choice(VALUES))


def _same_type(attr: ir.Attribute, rng: random.Random) -> ir.Attribute:
    """An extreme value of ``attr``'s own kind."""
    if isinstance(attr, ir.IntegerAttr) and not isinstance(attr, ir.BoolAttr):
        t = ir.IntegerAttr(attr).type
        t = t.maybe_downcast() if hasattr(t, "maybe_downcast") else t
        width = t.width if isinstance(t, ir.IntegerType) else 64
        bound = 1 << (width - 1)
        v = rng.choice((0, -1, 1, bound - 1, -bound, 1 << 20, 65537, bound // 2))
        return ir.IntegerAttr.get(t, max(-bound, min(bound - 1, v)))
    if isinstance(attr, ir.StringAttr):
        return ir.StringAttr.get(rng.choice(("", "x", "m9", "a" * 500, "é", "{", '"')))
    return _value(rng)


def _mutate(attr: ir.Attribute, rng: random.Random, depth: int = 0) -> ir.Attribute:
    """``attr`` with itself or one entry deep inside it replaced."""
    attr = attr.maybe_downcast() if hasattr(attr, "maybe_downcast") else attr
    r = rng.random()
    if isinstance(attr, ir.DictAttr) and len(attr) and r < 0.7 and depth < 4:
        d = {attr[i].name: attr[i].attr for i in range(len(attr))}
        key = rng.choice(sorted(d))
        how = rng.random()
        if how < 0.7:
            d[key] = _mutate(d[key], rng, depth + 1)
        elif how < 0.85:
            del d[key]
        else:
            d[rng.choice(("extra", "name", "loop", "devices", "schedule"))] = _value(rng)
        return ir.DictAttr.get(d)
    if isinstance(attr, ir.ArrayAttr) and len(attr) and r < 0.7 and depth < 4:
        items = list(attr)
        k = rng.randrange(len(items))
        how = rng.random()
        if how < 0.7:
            items[k] = _mutate(items[k], rng, depth + 1)
        elif how < 0.85:
            del items[k]
        else:
            items.insert(k, items[k])
        return ir.ArrayAttr.get(items)
    if r < 0.35:
        return _same_type(attr, rng)
    return _value(rng)


def mutate_attributes(text: str, rng: random.Random, count: int = 1) -> str:
    """``text`` with ``count`` readable attributes (or entries inside them) of another
    type or value; ``text`` unchanged when it has none or does not parse. Only ``text``
    is parsed (a seed, known to parse): a mutated module may crash jaxlib's parser,
    which is what the fuzzer looks for, in a worker process."""
    with make_context():
        try:
            module = ir.Module.parse(text)
        except ir.MLIRError:
            return text
        inherent = rng.random() < 1 / 7
        sites = _sites(module, inherent)
        if not sites:
            return text
        generic = inherent or rng.random() < 0.25
        for op, name, arg in rng.sample(sites, min(count, len(sites))):
            _mutate_site(op, name, arg, rng)
            generic = generic or name == "topology"  # mpmd's printers read it unchecked
        return str(module.operation.get_asm(print_generic_op_form=generic))


def _mutate_site(op: ir.Operation, name: str, arg: int | None, rng: random.Random) -> None:
    if arg is None:
        op.attributes[name] = _mutate(op.attributes[name], rng)
        return
    dicts = list(ir.ArrayAttr(op.attributes["arg_attrs"]))
    d = ir.DictAttr(dicts[arg])
    entries = {d[i].name: d[i].attr for i in range(len(d))}
    entries[name] = _mutate(entries[name], rng)
    dicts[arg] = ir.DictAttr.get(entries)
    op.attributes["arg_attrs"] = ir.ArrayAttr.get(dicts)
