"""``CallConvention``: how a compiled program's call becomes the inputs of what runs it,
and what that returns becomes the caller's results. Written once, here.

Every way a compiled program runs goes through it: ``MpmdCompiled.__call__``,
``profile``, ``step_profile`` and ``memory_profile`` (the executor's inputs and
outputs), the fast path's ``FastCompiled`` (``jax.jit``'s), and the flax wing's NNX
stages, whose typed keys cross with :func:`encode_keys`/:func:`decode_keys`. One
frozen record per compiled stage, built from the lowered record when the stage is
built, holds what the conversion needs:

- the call's structure and types (``check_call``) and the leaves the program takes;
- typed PRNG keys, which cross the MPMD runtime as their raw ``uint32`` data;
- the donated leaves (the executor checks them at each call) and how errors name an
  argument (``args[0]['w']``);
- where outputs go: a physical ``out_shardings`` entry moves its output there
  (``place_outputs``), and in jax's explicit sharding mode an output comes back on a
  mesh whose axes are ``Explicit`` again (``retype_outputs``: the same buffers);
- the stage's ``input_shardings`` and ``output_shardings`` trees, from the same.

A test (``tests/test_call_convention.py``) fails if the conversion appears anywhere
else in the library.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from multimesh._src import jax_compat
from multimesh.jax._stages.call_checks import check_call, is_key, leaf_name
from multimesh.jax._stages.stage import LoweredProgram

__all__ = ["CallConvention", "encode_keys", "decode_keys", "abstract_keys", "traced_key_impls"]


@dataclasses.dataclass(frozen=True, slots=True)
class CallConvention:
    """A compiled program's calling convention (see the module's docstring)."""

    in_tree: Any
    """The tree of the arguments, ``(args, kwargs)``, that calls take."""
    in_avals: tuple | None
    out_tree: Any
    taken: tuple[int, ...] | None
    """The argument leaves the program takes, in order; None: all of them."""
    key_inputs: tuple[bool, ...]
    """Per taken leaf, whether it crosses as a typed key's raw data; () when none."""
    key_outputs: tuple
    """Per output leaf, the key implementation to rewrap it with, else None; ()."""
    donated: frozenset[int]
    """The donated leaves (of the taken ones), which the executor checks at a call."""
    placements: Mapping[int, NamedSharding]
    """Output leaf -> the physical ``out_shardings`` entry it is moved onto."""
    retyped: Mapping[int, NamedSharding]
    """Output leaf -> its sharding over a mesh with ``Explicit`` axes (explicit mode)."""
    unused: frozenset[int]
    """Argument leaves the program never reads: None as their input sharding."""
    place: Callable[[Any, Any], Any] | None = None
    in_shardings: tuple = ()
    """The fast path: each leaf goes through ``place(leaf, sharding)`` first."""
    seen: list = dataclasses.field(default_factory=lambda: [None], compare=False, repr=False)
    """The types of the last call that passed ``check_call`` (its ``seen``)."""

    @classmethod
    def for_runtime(cls, record: LoweredProgram, output_shardings: Sequence
                    ) -> CallConvention:
        """The MPMD runtime's convention: typed keys as raw data, outputs placed and
        retyped. ``output_shardings``: the plan's, per output leaf."""
        taken = tuple(record.dyn_idx)
        all_taken = taken == tuple(range(record.in_tree.num_leaves))
        return cls(record.in_tree, record.in_avals, record.out_tree,
                   None if all_taken else taken, tuple(record.key_inputs),
                   tuple(record.key_outputs), frozenset(record.donated_leaves),
                   dict(record.out_placements),
                   _explicit_placements(output_shardings, record.explicit_outputs,
                                        record.out_placements),
                   frozenset(record.unused_leaves))

    @classmethod
    def for_jit(cls, record: LoweredProgram, in_shardings: Sequence,
                place: Callable[[Any, Any], Any]) -> CallConvention:
        """The fast path's: ``jax.jit`` takes typed keys and types its outputs itself;
        each leaf goes through ``place(leaf, sharding)`` (the caller's placement)."""
        return cls(record.in_tree, record.in_avals, record.out_tree, None, (), (),
                   frozenset(record.donated_leaves), dict(record.out_placements), {},
                   frozenset(record.unused_leaves), place, tuple(in_shardings))

    def inputs(self, args: tuple, kwargs: dict) -> list:
        """The call's arguments as the runtime takes them: checked, the leaves the
        program takes, typed keys as their data, placed (the fast path)."""
        flat = check_call(self.in_tree, self.in_avals, args, kwargs, self.seen)
        if self.taken is not None:
            flat = [flat[i] for i in self.taken]
        if self.key_inputs:  # typed PRNG keys travel as their raw uint32 data
            flat = [jax.random.key_data(x) if k else x for x, k in zip(flat, self.key_inputs)]
        if self.place is not None:
            flat = [self.place(x, sh) for x, sh in zip(flat, self.in_shardings)]
        return flat

    def results(self, outs: Sequence) -> Any:
        """The runtime's outputs as the caller's results: placed, retyped, typed keys
        rewrapped, in the output tree."""
        if self.placements:
            outs = list(outs)
            for i, sh in self.placements.items():
                outs[i] = jax.device_put(outs[i], sh)
        if self.retyped:
            outs = _retype_outputs(outs, self.retyped)
        if self.key_outputs:
            outs = decode_keys(outs, self.key_outputs)
        return jax.tree.unflatten(self.out_tree, outs)

    def arg_name(self, i: int) -> str:
        """``args[0]['w']``: how errors name the runtime's argument ``i``."""
        stand_in = jax.tree.unflatten(self.in_tree, list(range(self.in_tree.num_leaves)))
        paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(stand_in)[0]]
        return leaf_name(paths[i if self.taken is None else self.taken[i]])

    def input_shardings(self, per_input: Sequence) -> Any:
        """The stage's ``input_shardings``: per argument leaf, the sharding of the
        runtime's input it becomes (``per_input``), None for a leaf never read."""
        shardings: list = [None] * self.in_tree.num_leaves
        for i, sh in zip(range(len(shardings)) if self.taken is None else self.taken,
                         per_input):
            shardings[i] = None if i in self.unused else sh
        return jax.tree.unflatten(self.in_tree, shardings)

    def output_shardings(self, per_output: Sequence) -> Any:
        """The stage's ``output_shardings``: per output leaf, where ``results`` leaves
        it (the runtime's ``per_output``, or its placement or retyping)."""
        return jax.tree.unflatten(self.out_tree, [
            self.placements.get(i, self.retyped.get(i, sh)) for i, sh in enumerate(per_output)])


def encode_keys(values: Sequence) -> tuple[list, list]:
    """Typed PRNG keys among ``values`` as their raw data, and per value its key
    implementation (None for a value that is no key)."""
    impls = [jax.random.key_impl(v) if is_key(v) else None for v in values]
    data = [jax.random.key_data(v) if i is not None else v for v, i in zip(values, impls)]
    return data, impls


def traced_key_impls(avals: Sequence) -> list:
    """Per traced output (``ShapeDtypeStruct`` or aval), its typed key's implementation
    (None for a value that is no key): what :func:`decode_keys` rewraps at a call."""
    return [jax_compat.key_impl(a.dtype) if is_key(a) else None for a in avals]


def decode_keys(values: Sequence, impls: Sequence) -> list:
    """``values`` with the raw data of each typed key (its ``impls`` entry) rewrapped."""
    return [jax.random.wrap_key_data(v, impl=i) if i is not None else v
            for v, i in zip(values, impls)]


def abstract_keys(structs: Sequence, impls: Sequence) -> list:
    """:func:`decode_keys` on ``jax.ShapeDtypeStruct`` s: the typed keys' structs."""
    return [s if i is None else
            jax.eval_shape(functools.partial(jax.random.wrap_key_data, impl=i), s)
            for s, i in zip(structs, impls)]


def _explicit_placements(shardings: Sequence, explicit: Sequence[tuple[str, ...]],
                         placed: Mapping) -> dict[int, NamedSharding]:
    """Output leaf -> its sharding with the axes ``explicit`` names made ``Explicit``
    (jax's explicit sharding mode types an output over such a mesh, and a later call
    reads its type from there); leaves a physical ``out_shardings`` entry places are
    left to it."""
    out = {}
    for i, (sh, names) in enumerate(zip(shardings, explicit or ())):
        if not names or i in placed or not isinstance(sh, NamedSharding):
            continue
        mesh = sh.mesh
        types = tuple(AxisType.Explicit if n in names else AxisType.Auto
                      for n in mesh.axis_names)
        if types != tuple(mesh.axis_types):
            out[i] = NamedSharding(Mesh(mesh.devices, mesh.axis_names, axis_types=types),
                                   sh.spec, memory_kind=sh.memory_kind)
    return out


def _retype_outputs(outs: Sequence, retyped: Mapping[int, NamedSharding]) -> list:
    """Outputs given the shardings of :func:`_explicit_placements`: the same buffers
    (the layout is the same), a mesh with ``Explicit`` axes."""
    outs = list(outs)
    for i, sh in retyped.items():
        o = outs[i]
        outs[i] = jax.make_array_from_single_device_arrays(
            o.shape, sh, [s.data for s in o.addressable_shards])
    return outs
