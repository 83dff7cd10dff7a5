"""End-to-end snapshots: whole tutorial programs after the full mjit pipeline.

Run ``pytest tests/test_goldens.py --update-goldens`` to rewrite them (the test then
fails once, so a refresh is always a deliberate, reviewed change).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from multimesh._src.mlir import print_module
from multimesh.jax import TaskMesh, mjit, task
from multimesh.jax import with_sharding_constraint as wsc
from multimesh.jax._mjit import _i64, run_pipeline

GOLDENS = pathlib.Path(__file__).parent / "goldens"


def _f(param, x):
    return jnp.einsum("bm,mh->bh", x, param)


def _e2_model():
    tm = TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    axes = (("batch", "x"), ("model", "x"))
    layer1 = task(_f, name="layer1", mesh=tm, logical_axes=axes)
    layer2 = task(_f, name="layer2", mesh=tm.place((4, 5, 6, 7)), logical_axes=axes)

    def model(params, x):
        p1, p2 = params
        x = wsc(x, P("batch", None))
        p1 = wsc(p1, P("model", None))
        p2 = wsc(p2, P(None, "model"))
        x = layer2(p2, layer1(p1, x))
        return wsc(x, P("batch", None))

    return model


def _e1_model():
    def model(params, x):
        p1, p2 = params
        x = wsc(x, P("batch", None))
        p1 = wsc(p1, P("model", None))
        p2 = wsc(p2, P(None, "model"))
        return wsc(_f(p2, _f(p1, x)), P("batch", None))

    return task(model, name="model", mesh=TaskMesh(devices=range(8), axis_names=("x",),
                                                   axis_sizes=(8,)),
                logical_axes=(("batch", "x"), ("model", "x")))


PROGRAMS = {"e1_spmd_autosharding": _e1_model, "e2_mpmd_autosharding": _e2_model}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_pipeline_snapshot(name, request):
    params = (jnp.arange(64).reshape(8, 8), jnp.arange(64).reshape(8, 8))
    batch = jnp.arange(64).reshape(8, 8)
    lowered = mjit(PROGRAMS[name]()).lower(params, batch)
    module = lowered.compiler_ir()
    module.operation.attributes["mm.num_devices"] = _i64(module, len(jax.devices()))
    run_pipeline(module, lowered.pipeline)
    text = print_module(module)
    path = GOLDENS / f"{name}.mlir"
    if request.config.getoption("--update-goldens"):
        path.write_text(text)
        pytest.fail(f"Rewrote {path}; rerun without --update-goldens.")
    assert path.exists(), f"{path} is missing; create it with --update-goldens."
    assert text == path.read_text(), f"{name} differs from {path}; review and --update-goldens."
