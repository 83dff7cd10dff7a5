"""Physical input shardings: inputs the caller has already placed, or says where to place.

``mjit`` reads two kinds of input sharding. *Logical* ones name axes a task maps
(``in_shardings=P("batch")``, or a ``NamedSharding`` whose axis names some task of
the program maps): they become constraints that the consuming task resolves on its
own submesh, as before. *Physical* ones fix where an input lives, as for
``jax.jit``:

* an ``in_shardings`` entry that is a ``NamedSharding`` on real devices whose axis
  names no task of the program maps (``NamedSharding(mesh, P("d", None))``); and
* a committed ``jax.Array`` (``jax.device_put(x, sharding)``, or the output of
  another program) that no ``in_shardings`` entry covers, unless the program puts a
  logical constraint on that very input (then, as for every input, the constraint
  says where it lives, and the call moves the array there). ``parallelize``'s
  ``initial_batch`` is always pinned (MultiMesh keeps its shardings).

A physical input is pinned on the program's ``@main`` argument (``mm.sharding`` and
``mm.devices``, docs/ir.md §1): the compiled program takes it with exactly that
layout (``compiled.input_shardings`` is equivalent to it), a consumer whose mesh can
express the layout on the same devices reads it in place, and any other consumer
gets a transfer inside the program.
"""

from __future__ import annotations

from collections.abc import Set

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from multimesh._src.errors import MeshError
from multimesh._src.ir_contract import DEVICES_ATTR, LOGICAL_TARGET, SHARDING_ATTR
from multimesh._src.ir_util import custom_call_target, update_attr_dicts
from multimesh._src.jax_compat import is_committed
from multimesh._src.layouts import Placement
from multimesh._src.mlir import ir, make_context, parse_module, print_module
from multimesh.jax._task import (
    broadcast_prefix,
    logical_axes_of,  # per-dim names; here mesh axis names
)
from multimesh.jax._task import is_spec as _is_spec

__all__ = ["leaf_in_shardings", "plan_pins", "pin_module", "committed_key", "fits",
           "is_physical"]


def is_physical(sharding, mapped: Set[str]) -> bool:
    """Whether ``sharding`` is kept as given: a ``NamedSharding`` on a concrete mesh
    none of whose axis names a task of the program maps (``mapped``)."""
    return (isinstance(sharding, NamedSharding)
            and not isinstance(sharding.mesh, jax.sharding.AbstractMesh)
            and not _names(sharding.spec) & mapped)


def leaf_in_shardings(in_shardings, args, static: tuple[int, ...], n_kwargs_leaves: int) -> list:
    """The ``in_shardings`` entry of every dynamic leaf of ``(dyn args, kwargs)``.

    ``in_shardings`` is a prefix of the positional arguments (as for ``jax.jit``);
    kwargs get None. Returns [] when it cannot be spread over the leaves (the trace
    has already reported such a mismatch).
    """
    out: list = []
    for i, a in enumerate(args):
        if i in static:
            continue
        whole = _is_spec(in_shardings)  # one entry for every argument
        if not whole and (not isinstance(in_shardings, (tuple, list))
                          or len(in_shardings) != len(args)):
            return []
        try:
            sub = in_shardings if whole else in_shardings[i]
            out += broadcast_prefix(sub, a)
        except ValueError:
            return []
    return out + [None] * n_kwargs_leaves


def _names(spec: PartitionSpec) -> set[str]:
    out: set[str] = set()
    for e in spec:
        if isinstance(e, str):
            out.add(e)
        elif isinstance(e, (tuple, list)):
            out.update(x for x in e if isinstance(x, str))
    return out


def layout_of(sharding, ndim: int, devices: tuple) -> Placement | None:
    """``sharding`` as a layout over positions in ``devices``; None if it is not a
    concrete ``NamedSharding``/``SingleDeviceSharding`` or uses other devices."""
    index = {d: i for i, d in enumerate(devices)}
    if isinstance(sharding, SingleDeviceSharding):
        (dev,) = sharding.device_set
        if dev not in index:
            return None
        return (index[dev],), ("x",), (1,), ((),) * ndim
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh):
        return None
    mesh = sharding.mesh
    if any(d not in index for d in mesh.devices.flat):
        return None
    return (tuple(index[d] for d in mesh.devices.flat), tuple(mesh.axis_names),
            tuple(int(s) for s in mesh.devices.shape), logical_axes_of(sharding.spec, ndim))


def plan_pins(leaves, specs: list, mapped: set[str], devices: tuple,
              paths: list[str]) -> tuple[dict[int, Placement], set[int], set[int]]:
    """Which dynamic leaves are pinned where: ``({leaf: layout}, {leaves whose logical
    marker from in_shardings is to be dropped}, {leaves pinned because committed})``.

    ``mapped`` is every logical name some task of the program maps.
    """
    pins: dict[int, Placement] = {}
    drop: set[int] = set()
    committed: set[int] = set()
    for i, x in enumerate(leaves):
        spec = specs[i] if i < len(specs) else None
        ndim = len(getattr(x, "shape", ()))
        if isinstance(spec, NamedSharding):
            if not is_physical(spec, mapped):
                continue  # logical: a task reads these names
            lay = layout_of(spec, ndim, devices)
            if lay is None:
                ids = sorted(d.id for d in spec.mesh.devices.flat)
                raise MeshError(
                    f"`mjit` in_shardings for {paths[i]} is {spec}, on devices {ids}, but the "
                    f"program runs on devices {[d.id for d in devices]}. No task maps its "
                    f"axis names {sorted(_names(spec.spec))}, so it is a physical sharding "
                    f"and must use the program's devices; pass `devices=` (or `mesh=`) to "
                    f"mjit, or use a PartitionSpec of logical names.")
            pins[i] = lay
            drop.add(i)
        elif spec is None and is_committed(x):
            lay = layout_of(getattr(x, "sharding", None), ndim, devices)
            if lay is not None:
                pins[i] = lay
                committed.add(i)
    return pins, drop, committed


def _sharding_attr(lay: Placement) -> ir.Attribute:
    _, names, sizes, dims = lay
    mesh = ", ".join(f'"{n}"={s}' for n, s in zip(names, sizes))
    body = ", ".join("{" + ", ".join(f'"{a}"' for a in axes) + "}" for axes in dims)
    return ir.Attribute.parse(f"#sdy.sharding<mesh<[{mesh}]>, [{body}]>")


def pin_module(text: str | ir.Module, pins: dict[int, Placement], drop: Set[int],
               soft: Set[int] = frozenset()) -> tuple[str | ir.Module, dict[int, Placement]]:
    """``text`` (or a parsed module, edited in place) with pinned ``@main`` arguments and
    the dropped input markers removed, and the pins kept. A ``soft`` pin (a committed input) gives way to a logical
    constraint the program puts on that argument."""
    if not pins and not drop:
        return text, pins
    given = isinstance(text, ir.Module)  # a parsed module: edited in place, not printed
    module = text if isinstance(text, ir.Module) else parse_module(text, make_context())
    with module.context:
        main = next(op.operation for op in module.body.operations
                    if op.operation.name == "func.func"
                    and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main")
        block = main.regions[0].blocks[0]
        args = list(block.arguments)
        constrained = {args.index(op.operands[0]) for op in _markers(block)
                       if len(op.operands) == 1 and op.operands[0] in args
                       and args.index(op.operands[0]) not in drop}
        pins = {i: lay for i, lay in pins.items() if i not in soft or i not in constrained}
        i64 = ir.IntegerType.get_signless(64)
        update_attr_dicts(main, "arg_attrs", {i: {
            SHARDING_ATTR: _sharding_attr(pin),
            DEVICES_ATTR: ir.ArrayAttr.get([ir.IntegerAttr.get(i64, p) for p in pin[0]]),
        } for i, pin in pins.items()})
        for op in _markers(block):
            if len(op.operands) == 1 and op.operands[0] in args \
                    and args.index(op.operands[0]) in drop:
                op.results[0].replace_all_uses_with(op.operands[0])
                op.erase()
    return (module if given else print_module(module, debug_info=True)), pins


def _markers(block) -> list:
    """The logical sharding markers at the top level of ``block``."""
    out = []
    for op in block.operations:
        op = op.operation
        if custom_call_target(op) == LOGICAL_TARGET:
            out.append(op)
    return out


def committed_key(leaves) -> tuple:
    """The shardings of committed array leaves (part of ``mjit``'s cache key)."""
    return tuple(x.sharding if is_committed(x) else None for x in leaves)


def fits(compiled, leaves) -> bool:
    """Whether every committed leaf already has the layout ``compiled`` takes it in
    (then pinning it would compile the same program again)."""
    want = jax.tree.leaves(compiled.input_shardings, is_leaf=lambda s: s is None)
    if len(want) != len(leaves):
        return False
    for x, sh in zip(leaves, want):
        if is_committed(x) and sh is not None:  # None: never read
            have = x.sharding
            if have != sh and not have.is_equivalent_to(sh, len(x.shape)):
                return False
    return True

