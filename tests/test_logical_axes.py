"""Unit tests for the logical -> physical sharding algorithm (reference §1.14)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multimesh._src.errors import LogicalShardingError
from multimesh.passes.logical_axes import resolve_logical_spec, to_partition_spec


def P(*dims):
    """PartitionSpec-like input: None -> [], "a" -> ["a"], ("a", "b") -> ["a", "b"]."""
    out = []
    for d in dims:
        if d is None:
            out.append([])
        elif isinstance(d, str):
            out.append([d])
        else:
            out.append(list(d))
    return out


def resolve(spec, shape, names, sizes, mapping, **kw):
    return resolve_logical_spec(spec, shape, names, sizes, mapping, **kw)


# --- the anchor's examples ------------------------------------------------------------

BM_X = (("batch", "x"), ("model", "x"))


@pytest.mark.parametrize("spec, expected", [
    (P("model", None), ("x", None)),
    (P(None, "model"), (None, "x")),
    (P("batch", None), ("x", None)),
])
def test_anchor_1d(spec, expected):
    r = resolve(spec, (8, 8), ["x"], [8], BM_X)
    assert to_partition_spec(r) == expected


def test_anchor_2d_two_axes_on_one_dim():
    mapping = (("batch", "x"), ("embed", "x"), ("model", "y"))
    r = resolve(P(("batch", "model"), "seq"), (8, 4), ["x", "y"], [4, 2], mapping)
    assert r == (("x", "y"), ())
    assert to_partition_spec(r) == (("x", "y"), None)


def test_anchor_hidden_embed():
    mapping = (("batch", "x"), ("embed", "x"), ("model", "y"))
    r = resolve(P("hidden", "embed"), (16, 16), ["x", "y"], [2, 2], mapping)
    assert to_partition_spec(r) == (None, "x")


# --- individual rules -----------------------------------------------------------------

def test_priority_order_first_pair_wins():
    # "a" and "b" both want x; the earlier pair gets it.
    r = resolve(P("a", "b"), (8, 8), ["x"], [4], (("b", "x"), ("a", "x")))
    assert r == ((), ("x",))
    r = resolve(P("a", "b"), (8, 8), ["x"], [4], (("a", "x"), ("b", "x")))
    assert r == (("x",), ())


def test_same_logical_name_on_two_dims_uses_axis_once():
    r = resolve(P("a", "a"), (8, 8), ["x"], [4], (("a", "x"),))
    assert r == (("x",), ())


def test_same_logical_name_two_axes_two_dims():
    r = resolve(P("a", "a"), (8, 8), ["x", "y"], [4, 2], (("a", "x"), ("a", "y")))
    # pair (a,x) goes to dim 0; pair (a,y): dim 0 has 4*2 <= 8 so y joins dim 0.
    assert r == (("x", "y"), ())


def test_each_device_axis_used_once():
    r = resolve(P("a", "b"), (8, 8), ["x"], [2], (("a", "x"), ("b", "x")))
    assert r == (("x",), ())


def test_over_shard_skip():
    # dim 0 has size 2 < 4: x is skipped silently, then goes to dim 1 via "b".
    r = resolve(P("a", "b"), (2, 8), ["x"], [4], (("a", "x"), ("b", "x")))
    assert r == ((), ("x",))


def test_over_shard_skip_second_axis():
    # x fits (4 <= 4) but x*y = 8 > 4: y skipped.
    r = resolve(P(("a", "b")), (4,), ["x", "y"], [4, 2], (("a", "x"), ("b", "y")))
    assert r == (("x",),)


def test_multiple_axes_on_one_dim_in_mesh_order():
    # y assigned first (priority), but the result lists x before y (mesh order).
    r = resolve(P(("a", "b")), (8,), ["x", "y"], [2, 4], (("b", "y"), ("a", "x")))
    assert r == (("x", "y"),)
    assert to_partition_spec(r) == (("x", "y"),)


def test_unknown_logical_name_unsharded():
    r = resolve(P("nope", "batch"), (8, 8), ["x"], [8], BM_X)
    assert r == ((), ("x",))


def test_empty_mapping_fully_replicated():
    r = resolve(P("batch", ("model", "seq")), (8, 8), ["x", "y"], [2, 2], ())
    assert r == ((), ())
    assert to_partition_spec(r) == (None, None)


def test_scalar():
    assert resolve([], (), ["x"], [2], (("a", "x"),)) == ()


def test_size_one_axis_assigned():
    r = resolve(P("a", "b"), (8, 8), ["x", "y"], [4, 1], (("a", "x"), ("b", "y")))
    assert r == (("x",), ("y",))


def test_unknown_device_axis_error():
    with pytest.raises(LogicalShardingError) as e:
        resolve(P("batch", None), (8, 8), ["x", "y"], [4, 2], (("batch", "z"),))
    msg = str(e.value)
    assert msg == ("Logical axis 'batch' is mapped to device axis 'z', which is not an axis "
                   "of the task mesh. Valid device axis names are: 'x', 'y'.")


def test_unknown_device_axis_for_unused_logical_name_is_ignored():
    # the pair never applies to any dim, so its device axis is never looked up
    assert resolve(P("a"), (8,), ["x"], [4], (("other", "z"), ("a", "x"))) == (("x",),)


def test_non_dividing_error_single_axis():
    with pytest.raises(LogicalShardingError) as e:
        resolve(P("a", None), (6, 8), ["x"], [4], (("a", "x"),))
    assert str(e.value) == (
        "Cannot shard dimension 0 of tensor of shape (6, 8) over device axis 'x' (size 4): "
        "4 does not evenly divide 6.")


def test_non_dividing_error_two_axes_and_desc():
    with pytest.raises(LogicalShardingError) as e:
        resolve(P(None, ("a", "b")), (3, 12), ["x", "y"], [4, 2], (("a", "x"), ("b", "y")),
                tensor_desc="'w'")
    msg = str(e.value)
    assert msg == (
        "Cannot shard dimension 1 of tensor 'w' of shape (3, 12) over device axes "
        "'x' (size 4) and 'y' (size 2): 8 does not evenly divide 12.")


def test_rank_mismatch_error():
    with pytest.raises(LogicalShardingError, match="has rank 1"):
        resolve(P("a", None), (8,), ["x"], [4], (("a", "x"),))


def test_is_value_error():
    with pytest.raises(ValueError):
        resolve(P("a"), (6,), ["x"], [4], (("a", "x"),))


def test_to_partition_spec():
    assert to_partition_spec(((), ("x",), ("x", "y"))) == (None, "x", ("x", "y"))


# --- property test ---------------------------------------------------------------------

LOGICAL = ["a", "b", "c", "d"]


@st.composite
def problems(draw):
    n_axes = draw(st.integers(0, 3))
    names = [f"ax{i}" for i in range(n_axes)]
    sizes = [draw(st.sampled_from([1, 2, 3, 4])) for _ in names]
    rank = draw(st.integers(0, 3))
    shape = [draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16])) for _ in range(rank)]
    spec = [draw(st.lists(st.sampled_from(LOGICAL), max_size=2, unique=True))
            for _ in range(rank)]
    device_choices = names + ["bogus"] if draw(st.booleans()) else names
    mapping = []
    if device_choices:
        mapping = draw(st.lists(
            st.tuples(st.sampled_from(LOGICAL), st.sampled_from(device_choices)), max_size=6))
    return spec, shape, names, sizes, mapping


def _run(spec, shape, names, sizes, mapping):
    try:
        return resolve(spec, shape, names, sizes, mapping)
    except LogicalShardingError as e:
        return ("error", str(e))


@settings(max_examples=300, deadline=None)
@given(problems(), st.data())
def test_properties(problem, data):
    spec, shape, names, sizes, mapping = problem
    result = _run(spec, shape, names, sizes, mapping)
    size_of = dict(zip(names, sizes, strict=True))
    if not (isinstance(result, tuple) and result and result[0] == "error"):
        assert len(result) == len(shape)
        flat = [a for axes in result for a in axes]
        assert len(flat) == len(set(flat)), "a device axis is used at most once"
        for d, axes in enumerate(result):
            assert list(axes) == sorted(axes, key=names.index), "mesh-axis order"
            assert shape[d] % math.prod(size_of[a] for a in axes) == 0
            for a in axes:
                # only axes reachable through a pair naming one of the dim's logical names
                assert any(L in spec[d] and D == a for L, D in mapping)
    # Duplicating a pair anywhere after its first occurrence changes nothing.
    if mapping:
        i = data.draw(st.integers(0, len(mapping) - 1))
        j = data.draw(st.integers(i + 1, len(mapping)))
        dup = list(mapping[:j]) + [mapping[i]] + list(mapping[j:])
        assert _run(spec, shape, names, sizes, dup) == result
    # An empty mapping never shards and never fails.
    assert _run(spec, shape, names, sizes, []) == tuple(() for _ in shape)


FLAX_RULES = (("batch", "data"), ("embed", None), ("embed", "model"), ("mlp", "model"),
              ("heads", ("model", "data")), ("kv", "data"), ("kv", "model"))


def test_flax_rules_become_one_rule_table():
    """flax's ``nn.logical_axis_rules``, converted once (``multimesh.jax.flax``): a rule
    onto several axes gives a pair per axis, one onto ``None`` gives none and hides the
    name's later rules, as flax's resolution does."""
    from multimesh.jax.flax._linen import logical_pairs

    assert logical_pairs(FLAX_RULES) == (
        ("batch", "data"), ("mlp", "model"), ("heads", "model"), ("heads", "data"),
        ("kv", "data"), ("kv", "model"))


@pytest.mark.parametrize("names", [("batch", "mlp"), ("embed", "mlp"), ("mlp", "batch"),
                                   ("kv", "mlp"), ("batch", "kv"), ("mlp", "kv"), ("embed", None)])
def test_the_converted_table_resolves_as_flax_does(names):
    """On a ``data=2, model=4`` mesh, each task resolving flax's names through the table
    gives flax's own ``logical_to_mesh_axes`` (shapes large enough that no axis
    over-shards; multiple axes on one dimension in mesh order)."""
    from flax import linen as nn

    from multimesh.jax.flax._linen import logical_pairs

    mesh_names, sizes = ("data", "model"), (2, 4)
    got = resolve([[] if n is None else [n] for n in names], (64, 64), mesh_names, sizes,
                  logical_pairs(FLAX_RULES))
    want = tuple(nn.logical_to_mesh_axes(names, FLAX_RULES))
    assert to_partition_spec(got) == tuple(
        tuple(sorted(w, key=mesh_names.index)) if isinstance(w, tuple) else w for w in want)
