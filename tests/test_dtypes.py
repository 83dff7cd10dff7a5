"""Every dtype that ``jax.jit`` accepts crosses a task boundary (issue 20).

The runtime reads each fragment's argument and result types from the IR
(``complex<f32>``, ``f8E4M3FN``, ``i4``); its table of element types is derived
from jax's own lowering, so the matrix below is numpy's dtypes, jnp's and
ml_dtypes' that jax can run on this backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.mlir import element_dtype

DTYPES = ["bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16",
          "float32", "bfloat16", "complex64", "int2", "int4", "uint2", "uint4",
          "float4_e2m1fn", "float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz",
          "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
          "float8_e8m0fnu"]
X64 = ["int64", "uint64", "float64", "complex128"]


def _program():
    """Two tasks on disjoint submeshes; the value crosses from one to the other."""
    mesh_a = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x",), axis_sizes=(4,))
    a = mm.task(lambda x: x[::-1], name="a", mesh=mesh_a)
    b = mm.task(lambda x: jnp.roll(x, 1, axis=1), name="b", mesh=mesh_a.place((4, 5, 6, 7)))
    return lambda x: (b(a(x)), a(x))


def _value(name: str):
    dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
    x = np.arange(32).reshape(8, 4) % 3
    if dtype.kind == "c":
        x = x + 1j * (x % 2)
    return jnp.asarray(x.astype(dtype))


def _wide(x) -> np.ndarray:
    """Exact in a wide type, to compare (a NaN equals a NaN there)."""
    x = np.asarray(x)
    return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def _check(name: str) -> None:
    x = _value(name)
    f = _program()
    with mm.ignore_transforms():
        want = jax.jit(f)(x)
    got = mm.mjit(f)(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == x.dtype
        np.testing.assert_array_equal(_wide(g), _wide(w))
    assert sorted(d.id for d in got[0].devices()) == [4, 5, 6, 7]
    assert sorted(d.id for d in got[1].devices()) == [0, 1, 2, 3]


@pytest.mark.parametrize("name", DTYPES)
def test_dtype_crosses_a_task(name):
    _check(name)


@pytest.mark.parametrize("name", X64)
def test_x64_dtype_crosses_a_task(name):
    with jax.enable_x64(True):
        _check(name)


def test_element_type_table_is_jaxs_and_names_what_it_knows():
    assert element_dtype("complex<f32>") == np.complex64
    assert element_dtype("f8E4M3FN") == jnp.float8_e4m3fn
    assert element_dtype("i1") == np.bool_ and element_dtype("i4") == jnp.int4
    with pytest.raises(ValueError, match="known element types: .*bf16"):
        element_dtype("f7")


@pytest.mark.parametrize("name", ["bool", "int4", "uint8", "int16", "float16", "bfloat16",
                                  "float8_e4m3fn", "complex64"])
def test_microbatch_sums_cross_tasks_in_their_dtype(name):
    """The loop's running sums of every dtype: zero-initialised, accumulated in place and
    moved between submeshes, as plain jax adds the microbatches' outputs."""
    x = _value(name)
    f = _program()
    got = mm.mjit(mm.microbatch(f, dim=0, size=2))(x)
    with mm.ignore_transforms():
        parts = [jax.jit(f)(x[2 * m:2 * m + 2]) for m in range(4)]
    for k, g in enumerate(got):
        want = parts[0][k]
        for p in parts[1:]:
            want = want | p[k] if name == "bool" else want + p[k]
        assert g.dtype == x.dtype
        np.testing.assert_array_equal(_wide(g), _wide(want))
    assert sorted(d.id for d in got[0].devices()) == [4, 5, 6, 7]
    assert sorted(d.id for d in got[1].devices()) == [0, 1, 2, 3]
