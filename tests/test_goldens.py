"""End-to-end snapshots: whole tutorial programs after the full mjit pipeline.

Run ``pytest tests/test_goldens.py --update-goldens`` to rewrite them (the test then
fails once, so a refresh is always a deliberate, reviewed change).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import pytest

from multimesh._src.mlir import print_module
from multimesh.jax import TaskMesh, mjit, task
from multimesh.jax._stages.lowered import _i64
from multimesh.jax._stages.pipeline_runner import run_pipeline
from tests.models import LOGICAL, e1_model, e2_model

GOLDENS = pathlib.Path(__file__).parent / "goldens"


def _e1_model():
    return task(e1_model, name="model", mesh=TaskMesh(devices=range(8), axis_names=("x",),
                                                      axis_sizes=(8,)), logical_axes=LOGICAL)


PROGRAMS = {"e1_spmd_autosharding": _e1_model, "e2_mpmd_autosharding": e2_model}


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
