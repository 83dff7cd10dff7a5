"""Tensor parallelism in ``plan_pipeline``: each stage's submesh may get a ``model``
axis where the model's own shardings name one (flax's logical rules, NNX partition
metadata, jax sharding constraints).

For each size ``t`` of that axis (a divisor of the devices, inside a node unless
asked), the units are costed again with the step traced under a ``(data=1,
model=t)`` mesh and each unit compiled on it (:func:`._units.measure_tensor`):
per-device flops and bytes as XLA's cost analysis of the partitioned program gives
them, the parameters' bytes divided as ``jax.jit`` splits their gradients, and the
collectives the compiled unit runs, priced by ``DeviceModel.collective_seconds``.
The search (:func:`._search.search`) weighs every size against data, fsdp and
pipeline parallelism with these tables.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys

from multimesh._src.caches import LRUCache
from multimesh._src.errors import MultimeshTypeError, MultimeshValueError
from multimesh.jax._analysis.costs import DeviceModel
from multimesh.jax._planner._search import Costs
from multimesh.jax._planner._units import (
    MODEL,
    Profile,
    TensorUnits,
    measure_tensor,
    names_model,
)

__all__ = ["TensorTables", "tensor_sizes", "tensor_tables", "check_axes", "check_tensor"]


@dataclasses.dataclass(frozen=True)
class TensorTables:
    """Per ``model`` axis size: the search's cost table, and each unit's flops per
    device (forward and backward, one data replica)."""

    costs: dict[int, Costs]
    flops: dict[int, tuple[float, ...]]
    counts: dict[int, tuple[int, ...]]  # each unit's parameter elements per device


_TABLES = LRUCache("multimesh planner tensor-parallel unit costs", max_size=32)


def _rules() -> tuple:
    """flax's logical axis rules in context (they decide what the trace shards)."""
    linen = sys.modules.get("flax.linen")
    if linen is None:
        return ()
    try:
        return tuple(tuple(r) for r in linen.get_logical_axis_rules())
    except Exception:  # noqa: BLE001 - an unexpected rules object: do not reuse
        return (object(),)


def tensor_sizes(tensor, n_devices: int, stage_devices: int, model: DeviceModel) -> list[int]:
    """The ``model`` axis sizes to weigh (besides 1): ``tensor`` as asked, or every
    divisor of the largest stage (``stage_devices``) whose group of neighbours stays
    inside a node."""
    if tensor is None:
        return [t for t in range(2, stage_devices + 1)
                if stage_devices % t == 0 and not model.crosses_nodes(1, t)]
    check_tensor(tensor, n_devices, stage_devices)
    return [int(tensor)] if tensor > 1 else []


def check_tensor(tensor, n_devices: int, stage_devices: int) -> None:
    """``tensor``: None, or an integer dividing a stage's devices."""
    if tensor is None:
        return
    if isinstance(tensor, bool) or not isinstance(tensor, numbers.Integral):
        raise MultimeshTypeError(
            f"`plan_pipeline`: `tensor` must be the size of each stage's `model` axis (an "
            f"integer) or None (the planner chooses), got {type(tensor).__name__} "
            f"{tensor!r}.")
    if tensor < 1 or stage_devices % tensor:
        where = (f"the {n_devices} devices" if stage_devices == n_devices else
                 f"the {stage_devices} devices of a stage ({n_devices} devices in all)")
        raise MultimeshValueError(
            f"`plan_pipeline`: tensor={tensor} does not divide {where}; choose one of "
            f"{[t for t in range(1, stage_devices + 1) if stage_devices % t == 0]}, or "
            f"None (the planner chooses).")


def _units_at(fun, args, profile: Profile, t: int, devices, key) -> TensorUnits | None:
    """The units of ``profile`` costed at ``model`` size ``t``; reused for the same
    step, argument types, flax rules and units (as the profile itself is)."""
    k = None if key is None else (*key, tuple(u.name for u in profile.units), t)
    got = None if k is None else _TABLES.get(k)
    if got is None:
        got = (measure_tensor(fun, args, profile, t, devices) or False)
        if k is not None:
            _TABLES[k] = got
    return got if isinstance(got, TensorUnits) else None


def _priced(base: Costs, tu: TensorUnits, model: DeviceModel, timed: bool,
            profile: Profile) -> Costs:
    """``base`` with the units' per-device figures at ``model`` axis ``tu.size`` and
    the seconds of their collectives (the whole batch on one data replica)."""
    t = tu.size
    across = model.crosses_nodes(1, t)

    # each collective's latency (bytes 0) apart: a microbatch's call pays it whole
    fixed = [sum(model.collective_seconds(op, 0.0, t, across) for op, _ in unit)
             for unit in tu.collectives]
    seconds = [sum(model.collective_seconds(op, b, t, across) for op, b in unit) - a
               for unit, a in zip(tu.collectives, fixed)]

    fwd, bwd, wgrad = tu.fwd_flops, tu.bwd_flops, tu.wgrad_flops
    if timed:  # measured seconds on one device, scaled as XLA's per-device flops fall
        u = profile.units

        def scaled(mine, base_col, flops):
            return tuple(b * (x / f if f else 1.0) for b, x, f in zip(base_col, mine, flops))

        fwd = scaled(fwd, base.fwd, [x.fwd_flops for x in u])
        bwd = scaled(bwd, base.bwd, [x.bwd_flops for x in u])
        wgrad = scaled(wgrad, base.wgrad or [b / 2 for b in base.bwd],
                       [x.wgrad_flops or x.bwd_flops / 2 for x in u])
    return dataclasses.replace(
        base, fwd=tuple(fwd), bwd=tuple(bwd),
        wgrad=tuple(wgrad) if base.wgrad is not None else None,
        params=tu.param_bytes, bwd_params=tu.bwd_param_bytes,
        fwd_bytes=None if base.fwd_bytes is None else tu.fwd_bytes,
        bwd_bytes=None if base.bwd_bytes is None else tu.bwd_bytes,
        comm_fwd=tuple(c * f for c, f in zip(seconds, tu.fwd_share)),
        comm_bwd=tuple(c * (1 - f) for c, f in zip(seconds, tu.fwd_share)),
        comm_latency_fwd=tuple(a * f for a, f in zip(fixed, tu.fwd_share)),
        comm_latency_bwd=tuple(a * (1 - f) for a, f in zip(fixed, tu.fwd_share)))


def tensor_tables(fun, args, profile: Profile, base: Costs, devices, model: DeviceModel,
                  sizes: list[int], tensor, notes: dict, key) -> TensorTables | None:
    """Per ``model`` axis size, the search's cost table; None when the model names no
    ``model`` axis (its stages get none)."""
    if not _names_model(fun, args, devices, key):
        if tensor is not None and tensor > 1:
            raise MultimeshValueError(
                f"`plan_pipeline` got tensor={tensor}, but no sharding in the step names "
                f"the mesh axis {MODEL!r}: the planner shards what the model's own "
                f"shardings put on {MODEL!r} (flax's logical rules in context, NNX "
                f"partition metadata, jax sharding constraints). Annotate the model, or "
                f"leave `tensor` unset.")
        return None
    tables = {t: tu for t in sizes
              if (tu := _units_at(fun, args, profile, t, devices, key)) is not None}
    timed = base.fwd_bytes is None
    out = {} if tensor is not None and tensor > 1 else {1: base}
    out.update({t: _priced(base, tu, model, timed, profile) for t, tu in tables.items()})
    flops = {t: tuple(f + b for f, b in zip(tu.fwd_flops, tu.bwd_flops))
             for t, tu in tables.items()}
    notes["tensor parallelism"] = (
        f"the model's shardings name {MODEL!r}: each stage's submesh is (data, {MODEL}), "
        f"{MODEL} over neighbouring devices, of size "
        f"{' or '.join(str(t) for t in sorted(out))} weighed; each unit costed per "
        f"device compiled on a {MODEL} axis of that size (XLA's cost analysis), its "
        f"collectives priced by the device model (ring, not overlapped), its parameters "
        f"divided as jax.jit splits their gradients; residuals and temporaries "
        f"priced unsplit over {MODEL}")
    return TensorTables(out, flops, {t: tu.param_count for t, tu in tables.items()})


def _names_model(fun, args, devices, key) -> bool:
    """Whether the step names ``model`` at all (with no size to weigh, the stages
    still need the axis, of size 1)."""
    k = None if key is None else (*key, "named")
    got = None if k is None else _TABLES.get(k)
    if got is None:
        got = names_model(fun, args, devices)
        if k is not None:
            _TABLES[k] = got
    return got


def check_axes(logical_axes, tables, explicit) -> None:
    """The user's ``logical_axes`` name axes the stages will have: ``data``, and
    ``model`` where the model names one; an explicit model's own axes."""
    if explicit is not None:
        have = tuple(explicit[0])
    else:
        have = ("data", MODEL) if tables is not None else ("data",)
    for name, axis in logical_axes:
        if axis in have:
            continue
        why = (f"; stages get a {MODEL!r} axis only where the model's own shardings name "
               f"it (flax's logical rules in context, NNX partition metadata, jax sharding "
               f"constraints), and this model's do not" if axis == MODEL else "")
        raise MultimeshValueError(
            f"`plan_pipeline`: logical_axes maps {name!r} onto the mesh axis {axis!r}, but "
            f"each stage's submesh has only the axes {have}{why}. Map it onto one of "
            f"{list(have)}, or drop the pair.")
