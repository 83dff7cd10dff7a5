"""Tests of ``mm-import-gspmd``: the GSPMD string parser and jax round trips.

The 8 CPU devices come from the root conftest.py (XLA_FLAGS set before jax loads).
"""

from __future__ import annotations

import contextlib
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from multimesh._src.errors import DiagnosticError
from multimesh._src.jax_compat import gspmd_sharding
from multimesh._src.mlir import ir, parse_module, print_module, sdy, walk
from multimesh.passes.import_gspmd import (
    GspmdParseError,
    GspmdSharding,
    ImportGspmdPass,
    parse_gspmd_sharding,
)

# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def gspmd_mode():
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def run_pass(text: str) -> ir.Module:
    module = parse_module(text)
    ImportGspmdPass().apply(module)
    assert module.operation.verify()
    return module


def meshes_of(module: ir.Module) -> dict[str, sdy.MeshAttr]:
    out = {}
    for op in module.body.operations:
        if op.operation.name == "sdy.mesh":
            name = ir.StringAttr(op.operation.attributes["sym_name"]).value
            out[name] = sdy.MeshAttr(op.operation.attributes["mesh"])
    return out


def named_from_sdy(meshes, attr, devices) -> NamedSharding:
    """The NamedSharding an sdy ``TensorShardingAttr`` denotes over ``devices``."""
    ts = sdy.TensorShardingAttr(attr)
    mesh_name = ir.FlatSymbolRefAttr(ts.mesh_or_ref).value
    mesh = meshes[mesh_name]
    axes = [sdy.MeshAxisAttr(a) for a in mesh.axes]
    names = [a.name for a in axes]
    sizes = [a.size for a in axes]
    ids = list(mesh.device_ids) or list(range(int(np.prod(sizes)) if sizes else len(devices)))
    devs = np.array(devices, dtype=object)
    if not names:  # empty (fully replicated) or maximal mesh
        assert len(ts.dimension_shardings) == 0 or all(
            len(sdy.DimensionShardingAttr(d).axes) == 0 for d in ts.dimension_shardings)
        if mesh.device_ids:
            return NamedSharding(Mesh(devs[ids], ("_m",)), P())
        return NamedSharding(Mesh(devs, ("_r",)), P())
    spec = []
    for d in ts.dimension_shardings:
        d_axes = [sdy.AxisRefAttr(a).name for a in sdy.DimensionShardingAttr(d).axes]
        spec.append(tuple(d_axes) if len(d_axes) > 1 else (d_axes[0] if d_axes else None))
    return NamedSharding(Mesh(devs[ids].reshape(sizes), tuple(names)), P(*spec))


def same_mapping(a, b, shape) -> bool:
    return a.devices_indices_map(shape) == b.devices_indices_map(shape)


def func_io_shardings(module: ir.Module):
    main = next(op.operation for op in module.body.operations
                if op.operation.name == "func.func"
                and ir.StringAttr(op.operation.attributes["sym_name"]).value == "main")
    def get(key):
        if key not in main.attributes:
            return []
        return [ir.DictAttr(d)["sdy.sharding"] if "sdy.sharding" in ir.DictAttr(d) else None
                for d in ir.ArrayAttr(main.attributes[key])]
    return get("arg_attrs"), get("res_attrs")


def ops_named(module, name):
    found = []
    walk(module.operation, lambda o: found.append(o) if o.name == name else None)
    return found


# ----------------------------------------------------------------------------- parser


def test_parse_replicated_maximal_manual():
    assert parse_gspmd_sharding("{replicated}") == GspmdSharding("replicated")
    assert parse_gspmd_sharding("{maximal device=3}") == GspmdSharding("maximal", device=3)
    assert parse_gspmd_sharding("{manual}").kind == "manual"


def test_parse_iota():
    s = parse_gspmd_sharding("{devices=[2,1,4]<=[8] last_tile_dim_replicate}")
    assert s.kind == "tiled"
    assert s.tile_dims == (2, 1, 4)
    assert s.devices == tuple(range(8))
    assert s.subgroups == ("replicated",)
    assert s.data_rank == 2 and s.num_devices == 8


def test_parse_transposed_iota():
    s = parse_gspmd_sharding("{devices=[4,2]<=[2,4]T(1,0)}")
    assert s.devices == tuple(np.arange(8).reshape(2, 4).T.flatten())
    s = parse_gspmd_sharding("{devices=[2,2,2]<=[2,2,2]T(2,0,1)}")
    assert s.devices == tuple(np.arange(8).reshape(2, 2, 2).transpose(2, 0, 1).flatten())


def test_parse_explicit_and_subgroups_and_metadata():
    s = parse_gspmd_sharding("{devices=[2,2]0,2,1,3}")
    assert s.tile_dims == (2, 2) and s.devices == (0, 2, 1, 3) and s.subgroups == ()
    s = parse_gspmd_sharding(
        '{devices=[2,1,2,2]<=[8] last_tile_dims={manual, replicated} metadata={op_name="a}"}}')
    assert s.subgroups == ("manual", "replicated") and s.data_rank == 2


def test_parse_tuple():
    s = parse_gspmd_sharding("{{replicated}, {devices=[2,1]<=[2]}, {maximal device=0}}")
    assert s.kind == "tuple"
    assert [e.kind for e in s.elements] == ["replicated", "tiled", "maximal"]
    assert parse_gspmd_sharding("{}") == GspmdSharding("tuple")


@pytest.mark.parametrize("bad", [
    "", "{", "{replicated", "{replicatd}", "{devices=[2,2]<=[8]}", "{devices=[2,2]0,1,2}",
    "{devices=[2,2]0,1,1,3}", "{devices=[4]<=[2,2]T(0,0)}", "{maximal device=}",
    "{replicated} x", "{devices=[2]<=[2] bogus}", "{devices=[0]<=[0]}",
])
def test_parse_malformed(bad):
    with pytest.raises(GspmdParseError):
        parse_gspmd_sharding(bad)


def _random_named_shardings(n, seed=0):
    rng = random.Random(seed)
    devices = jax.devices()
    shapes = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8), (2, 1, 4)]
    for _ in range(n):
        shape = rng.choice(shapes)
        perm = list(range(8))
        rng.shuffle(perm)
        names = tuple("abc"[: len(shape)])
        mesh = Mesh(np.array(devices)[perm].reshape(shape), names)
        rank = rng.choice([1, 2, 3])
        pool = list(names)
        rng.shuffle(pool)
        spec = []
        for _d in range(rank):
            k = rng.choice([0, 0, 1, 1, 2])
            taken, pool = pool[:k], pool[k:]
            spec.append(None if not taken else (taken[0] if len(taken) == 1 else tuple(taken)))
        yield mesh, P(*spec), rank


def test_parser_and_import_match_jax_on_random_shardings():
    """Property: jax's own GSPMD string -> pass -> sdy describes the same device map."""
    for mesh, spec, rank in _random_named_shardings(150):
        ns = NamedSharding(mesh, spec)
        text = str(ns._to_xla_hlo_sharding(rank))
        parsed = parse_gspmd_sharding(text)
        shape = (16,) * rank
        # The GSPMD string is over positions in the mesh's device list.
        devices = list(mesh.devices.flat)
        if parsed.kind == "tiled":
            tiles = np.array(parsed.devices).reshape(parsed.tile_dims)
            assert tiles.shape[: parsed.data_rank] == tuple(
                (16 // ns.shard_shape(shape)[d]) for d in range(rank))
        ty = "tensor<" + "x".join(["16"] * rank) + "xf32>"
        module = run_pass(
            f'module {{ func.func @main(%a: {ty} {{mhlo.sharding = "{text}"}}) -> {ty} {{\n'
            f"  return %a : {ty}\n}} }}")
        (arg,), _ = func_io_shardings(module)
        got = named_from_sdy(meshes_of(module), arg, devices)
        assert same_mapping(got, ns, shape), (text, spec)


# ----------------------------------------------------------------------------- pass


def test_sdy_module_passes_through_unchanged():
    text = """module @m attributes {mhlo.num_partitions = 8 : i32} {
  sdy.mesh @mesh = <["a"=2, "b"=4]>
  func.func public @main(%arg0: tensor<8x8xf32> {sdy.sharding = #sdy.sharding<@mesh, [{"a"}, {}]>}) -> tensor<8x8xf32> {
    %0 = sdy.sharding_constraint %arg0 <@mesh, [{}, {"b"}]> : tensor<8x8xf32>
    return %0 : tensor<8x8xf32>
  }
}"""
    before = print_module(parse_module(text))
    assert print_module(run_pass(text)) == before


def _expect_error(text, match):
    module = parse_module(text)
    before = print_module(module)
    with pytest.raises(DiagnosticError, match=match) as info:
        ImportGspmdPass().apply(module)
    assert info.value.location is not None
    assert print_module(module) == before  # nothing half-rewritten
    return info.value


def test_rejects_shard_map_and_manual():
    _expect_error("""func.func @main(%arg0: tensor<8xf32>) -> tensor<4xf32> {
  %0 = stablehlo.custom_call @SPMDFullToShardShape(%arg0) {mhlo.sharding = "{manual}"} : (tensor<8xf32>) -> tensor<4xf32>
  return %0 : tensor<4xf32>
}""", "shard_map in GSPMD form")
    _expect_error("""func.func @main(%arg0: tensor<8xf32> {mhlo.sharding = "{devices=[2,4]<=[8] last_tile_dims={manual}}"}) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}""", "manual")


def test_rejects_mixed_device_counts_and_bad_strings():
    e = _expect_error("""func.func @main(%arg0: tensor<8xf32> {mhlo.sharding = "{devices=[8]<=[8]}"}) -> (tensor<8xf32> {mhlo.sharding = "{devices=[4]<=[4]}"}) {
  return %arg0 : tensor<8xf32>
}""", "different device counts")
    assert "8" in e.message and "4" in e.message
    _expect_error("""func.func @main(%arg0: tensor<8xf32> {mhlo.sharding = "{devices=[2,2]<=[4]"}) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}""", r'cannot parse GSPMD sharding "\{devices=\[2,2\]<=\[4\]"')
    _expect_error("""func.func @main(%arg0: tensor<8xf32> {mhlo.sharding = "{devices=[2,2]<=[4]}"}) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}""", "2 tiled dimensions")


# ----------------------------------------------------------------------------- end to end


def _swap_and_compile(f, in_s, out_s, args, module):
    lowered = jax.jit(f, in_shardings=in_s, out_shardings=out_s).lower(*args)
    lowered._lowering._hlo = module
    return lowered.compile()


def _swap_and_run(f, in_s, out_s, args, module):
    return _swap_and_compile(f, in_s, out_s, args, module)(*args)


def _executable_shardings(compiled, devices):
    """The shardings XLA actually compiled the parameters/outputs with."""
    ex = compiled._executable.xla_executable
    return ([gspmd_sharding(devices, s) for s in ex.get_parameter_shardings()],
            [gspmd_sharding(devices, s) for s in ex.get_output_shardings()])


def _roundtrip(f, in_s, out_s, args, constraints=()):
    with gspmd_mode():
        gspmd_lowered = jax.jit(f, in_shardings=in_s, out_shardings=out_s).lower(*args)
        text = gspmd_lowered.as_text()
        gspmd_compiled = gspmd_lowered.compile()
    assert "mhlo.sharding" in text and "sdy." not in text
    module = run_pass(text)
    out_text = print_module(module)
    assert "mhlo.sharding" not in out_text and "@Sharding" not in out_text

    # 1. Every sdy sharding denotes the same device -> shard map as the jax sharding.
    mesh_attrs = meshes_of(module)
    devices = list(next(s for s in in_s if isinstance(s, NamedSharding)).mesh.devices.flat)
    arg_sh, res_sh = func_io_shardings(module)
    for attr, ns, x in zip(arg_sh, in_s, args, strict=True):
        assert same_mapping(named_from_sdy(mesh_attrs, attr, devices), ns, x.shape)
    outs = jax.eval_shape(f, *args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    out_s = out_s if isinstance(out_s, tuple) else (out_s,)
    for attr, ns, o in zip(res_sh, out_s, outs, strict=True):
        assert same_mapping(named_from_sdy(mesh_attrs, attr, devices), ns, o.shape)
    cons = ops_named(module, "sdy.sharding_constraint")
    assert len(cons) == len(constraints)
    for op, ns in zip(cons, constraints, strict=True):
        shape = tuple(ir.RankedTensorType(op.results[0].type).shape)
        assert same_mapping(named_from_sdy(mesh_attrs, op.attributes["sharding"], devices),
                            ns, shape)

    # 2. The sdy module compiles to the same parameter/output shardings as the GSPMD one
    #    and computes what plain jax computes.
    compiled = _swap_and_compile(f, in_s, out_s if len(out_s) > 1 else out_s[0], args, module)
    for want_list, got_list, values in zip(_executable_shardings(gspmd_compiled, devices),
                                           _executable_shardings(compiled, devices),
                                           (args, outs), strict=True):
        assert len(want_list) == len(got_list) == len(values)
        for w, g, v in zip(want_list, got_list, values, strict=True):
            assert same_mapping(w, g, v.shape)
    got = compiled(*args)
    want = jax.jit(f)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b)),
                 got, want)
    return module


def test_end_to_end_iota_transposed_replicated_constraint():
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    cons = NamedSharding(m, P("b", "a"))

    def f(x, y):
        z = jax.lax.with_sharding_constraint(x * 2, cons)
        return z + y, jnp.sin(x)

    x = jnp.arange(64.0).reshape(8, 8)
    in_s = (NamedSharding(m, P("a")), NamedSharding(m, P(None, ("b", "a"))))
    out_s = (NamedSharding(m, P()), NamedSharding(m, P("b")))
    module = _roundtrip(f, in_s, out_s, (x, x + 1), constraints=(cons,))
    text = print_module(module)
    assert 'sdy.mesh @mesh_0 = <["d0"=2, "d1"=4]>' in text
    assert "device_ids=[0, 4, 1, 5, 2, 6, 3, 7]" in text


def test_end_to_end_permuted_devices_3d():
    devs = np.array(jax.devices())[[5, 2, 7, 0, 3, 6, 1, 4]]
    m = Mesh(devs.reshape(2, 2, 2), ("a", "b", "c"))
    cons = NamedSharding(m, P(("c", "a"), None, "b"))

    def f(x):
        return jax.lax.with_sharding_constraint(jnp.cos(x), cons) * 3

    x = jnp.arange(8.0 * 4 * 6).reshape(8, 4, 6)
    _roundtrip(f, (NamedSharding(m, P("b", "c")),), NamedSharding(m, P(None, ("a", "b"))),
               (x,), constraints=(cons,))


def test_end_to_end_fully_replicated():
    m = Mesh(np.array(jax.devices()), ("a",))

    def f(x):
        return x @ x.T

    x = jnp.arange(32.0).reshape(8, 4)
    module = _roundtrip(f, (NamedSharding(m, P()),), NamedSharding(m, P()), (x,))
    assert "sdy.mesh @empty_mesh = <[]>" in print_module(module)


def test_end_to_end_unconstrained_dim_is_open():
    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def f(x):
        return jax.lax.with_sharding_constraint(x + 1, NamedSharding(m, P(P.UNCONSTRAINED, "a")))

    x = jnp.arange(64.0).reshape(8, 8)
    with gspmd_mode():
        text = jax.jit(f, in_shardings=NamedSharding(m, P("b"))).lower(x).as_text()
    assert "unspecified_dims=[0]" in text
    module = run_pass(text)
    (con,) = ops_named(module, "sdy.sharding_constraint")
    assert str(con.attributes["sharding"]) == '#sdy.sharding<@mesh_1, [{?}, {"d0"}]>'
    got = _swap_and_run(f, (NamedSharding(m, P("b")),), None, (x,), module)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x + 1))


def test_end_to_end_all_sharding_combinations_on_2x4():
    """Every spec of a rank-2 tensor over a 2x4 mesh (and its reversed-device twin)."""
    specs = [None, "a", "b", ("a", "b"), ("b", "a")]
    devs = np.array(jax.devices())
    x = jnp.arange(64.0).reshape(8, 8)
    for order in (devs, devs[::-1]):
        m = Mesh(order.reshape(2, 4), ("a", "b"))
        shardings = []
        for s0, s1 in itertools.product(specs, specs):
            used = [a for s in (s0, s1) if s for a in (s if isinstance(s, tuple) else (s,))]
            if len(used) == len(set(used)):
                shardings.append(NamedSharding(m, P(s0, s1)))
        # One jit with many arguments covers all of them at once.
        n = len(shardings)
        args = tuple(x + i for i in range(n))

        def f(*xs):
            return tuple(v * 2 for v in xs)

        _roundtrip(f, tuple(shardings), tuple(reversed(shardings)), args)


def test_end_to_end_host_callback_maximal_tuple():
    """io_callback carries `{maximal device=0}` on a (token, tensor) custom call."""
    from jax.experimental import io_callback

    m = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))

    def f(x):
        y = io_callback(lambda v: v * 10, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                        ordered=True)
        return y + 1

    x = jnp.arange(64.0).reshape(8, 8)
    in_s = (NamedSharding(m, P("a")),)
    with gspmd_mode():
        text = jax.jit(f, in_shardings=in_s).lower(x).as_text()
    assert 'mhlo.sharding = "{maximal device=0}"' in text
    module = run_pass(text)
    out = print_module(module)
    assert "sdy.mesh @maximal_mesh_0 = <[], device_ids=[0]>" in out
    assert "#sdy.sharding_per_value<[<@maximal_mesh_0, []>, <@maximal_mesh_0, []>]>" in out
    got = _swap_and_run(f, in_s, None, (x,), module)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x * 10 + 1))
