"""Checks at ``mjit``'s door and at a compiled program's call: argument structure,
shapes and dtypes against what was compiled, distinct devices, and the ``jax.jit``
options an MPMD program has no use for. Each raises early, naming the argument."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh._src import jax_compat
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError

__all__ = ["check_call", "check_leaf_types", "check_distinct_devices", "check_unsupported",
           "leaf_name", "is_key", "abstract_value", "typed_sharding",
           "typed_specs"]


def is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _type_str(shape, dtype) -> str:
    """``float32[4,8]``: how jax prints an array type."""
    return f"{dtype}[{','.join(str(int(d)) for d in shape)}]"


def _leaf_type(x) -> tuple[tuple[int, ...], object]:
    """(shape, canonical dtype) of an argument leaf, as the compiled program sees it."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:  # a Python scalar
        dtype = jax.numpy.result_type(x)
    return tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def leaf_name(path) -> str:
    """``args[0]['w']`` / ``kwargs['x']`` for a key path into ``(args, kwargs)``."""
    head = "args" if path[0].idx == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


def check_leaf_types(flat, in_avals, args, kwargs) -> None:
    """Raise if an argument's shape or dtype differs from what the program was compiled for."""
    bad = []
    for i, (x, aval) in enumerate(zip(flat, in_avals)):
        shape, dtype = _leaf_type(x)
        if shape != tuple(aval.shape) or dtype != aval.dtype:
            bad.append((i, shape, dtype, aval))
    if not bad:
        return
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]]
    i, shape, dtype, aval = bad[0]
    more = (f" ({len(bad) - 1} more argument{'s' if len(bad) > 2 else ''} also "
            f"differ{'' if len(bad) > 2 else 's'})") if len(bad) > 1 else ""
    raise MultimeshTypeError(
        f"Compiled function called with {leaf_name(paths[i])} of type "
        f"{_type_str(shape, dtype)}, but it was compiled for "
        f"{_type_str(aval.shape, aval.dtype)}{more}. Lower it again for the new types, or "
        f"call the `mjit` function, which compiles for each new set of types.")


_ArrayImpl = jax_compat.array_impl_type()


def check_call(in_tree, in_avals, args, kwargs, seen: list | None = None) -> list:
    """The leaves of a compiled program's arguments, checked against what it was
    compiled for (structure, shapes and dtypes).

    ``seen``: a one-slot list where the check remembers the types of the last call
    that passed, as jax's C++ dispatch remembers its last signature: whether 64-bit
    types were enabled and each leaf's aval. A call whose leaves are ``jax.Array`` s
    with avals equal to those (the very objects, step after step, when they are the
    outputs of the same executables) passed the same check and skips it; any other
    leaf (a NumPy array, a scalar) never matches and is checked in full."""
    flat, tree = jax.tree.flatten((args, kwargs))
    if tree != in_tree:
        raise MultimeshValueError(
            f"Compiled function called with arguments of structure {tree}, but it was "
            f"compiled for {in_tree}.")
    if in_avals is None:
        return flat
    sig = (jax.config.read("jax_enable_x64"),
           *[x.aval if type(x) is _ArrayImpl else object() for x in flat])
    if seen is None or sig != seen[0]:
        check_leaf_types(flat, in_avals, args, kwargs)
        if seen is not None:
            seen[0] = sig
    return flat


def abstract_value(x):
    """``x`` as the program is traced for: its shape and dtype, and in jax's explicit
    sharding mode the sharding its type carries (:func:`typed_sharding`); a physical
    layout is pinned after the trace."""
    typed = typed_sharding(x)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=typed)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=typed,
                                    weak_type=getattr(x, "weak_type", False))
    return x


def typed_specs(leaves) -> tuple | None:
    """The partition specs of :func:`typed_sharding` per leaf (part of ``mjit``'s cache
    key: the program is traced with them); None outside explicit mode."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or AxisType.Explicit not in tuple(context.axis_types):
        return None
    typed = [typed_sharding(x) for x in leaves]
    return tuple(None if t is None else t.spec for t in typed)


def typed_sharding(x) -> NamedSharding | None:
    """The sharding ``x`` carries in its type in jax's explicit sharding mode, over the
    abstract mesh in context (None: it carries none, or no mesh with explicit axes is
    in context).

    An array sharded over explicit axes (``jax.sharding.reshard``, NNX's eager
    sharding) is typed ``float32[16,64@model]``; traced with that type, the backward's
    cotangents keep it as under ``jax.jit`` (the transpose of a dot types the weight's
    gradient like the weight). The spec keeps the axes that are explicit both in
    ``x``'s mesh and, with the same size, in the mesh in context, so an array laid out
    on one stage's submesh (a previous step's output) types over the program's mesh by
    axis name."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not isinstance(sharding.spec, P):
        return None
    context = jax.sharding.get_abstract_mesh()
    if context.empty or AxisType.Explicit not in tuple(context.axis_types):
        return None
    own = dict(zip(sharding.mesh.axis_names, zip(sharding.mesh.axis_sizes,
                                                   sharding.mesh.axis_types)))
    outer = dict(zip(context.axis_names, zip(context.axis_sizes, context.axis_types)))

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and own.get(n) is not None
                     and own[n][1] == AxisType.Explicit and outer.get(n) == own[n])
        return None if not kept else kept[0] if len(kept) == 1 else kept
    spec = tuple(keep(e) for e in sharding.spec)
    if all(e is None for e in spec):
        return None
    return NamedSharding(context, P(*spec))


def check_distinct_devices(devices) -> None:
    seen: dict = {}
    for d in devices:
        seen[d] = seen.get(d, 0) + 1
    for d, count in seen.items():
        if count > 1:
            times = "twice" if count == 2 else f"{count} times"
            ids = [getattr(x, "id", x) for x in devices]
            raise MultimeshValueError(
                f"`mjit` devices must be distinct, but device {getattr(d, 'id', d)} appears "
                f"{times} in {ids}.")


def check_unsupported(device, backend, inline, compiler_options) -> None:
    """``jax.jit`` options that have no meaning for an MPMD program: an error each."""
    why = None
    if device is not None or backend is not None:
        name = "device" if device is not None else "backend"
        why = (f"`mjit` does not take {name}= (deprecated in `jax.jit` too): an MPMD "
               f"program runs on a list of devices. Pass `devices=` or `mesh=` instead.")
    elif inline:
        why = ("`mjit` does not take inline=True: an MPMD program runs in multimesh's "
               "runtime, one XLA executable per fragment, and cannot be inlined into an "
               "enclosing jax trace. Call the function itself (without `mjit`) there.")
    elif compiler_options:
        why = (f"`mjit` does not take compiler_options= ({sorted(compiler_options)}): each "
               f"fragment is compiled separately with XLA's defaults; set XLA flags through "
               f"the XLA_FLAGS environment variable instead.")
    if why is not None:
        raise MultimeshValueError(why)
