"""The stage-sharding tutorial's own set-up under ``microbatch`` (issue 37, item 10).

docs/tutorials/stage-sharding.md places the parameters (by flax's logical rules) and
the batch on the global mesh ``("stage", "data", "model")``, makes its stages
``mesh_slice``s of that mesh, and its loss reads the targets outside any stage. Cut into
microbatches, the loss's ``x - y`` meets a stage's output (typed on the stage's 2x2
mesh) and a slice of the targets (typed on the global 2x2x2 mesh): ``sub``'s JVP puts a
``reshard`` between them, whose transpose enters the stage's mesh from the global one,
which jax's ``use_abstract_mesh`` refuses ("cannot change the size of the mesh") outside
a multimesh trace (``jax_compat.many_meshes``).

Each schedule runs on as many stages as it needs, on the two 2x2 slices of 8 devices
(interleaved 1F1B: four stages round-robin; DualPipeV: four in a V). Values and every
gradient are plain jax's; every gradient lives on its stage's devices with its
parameter's spec on the kept axes.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.models import LOGICAL_RULES as RULES
from tests.models import LogicalBlock

# schedule -> (stages, the submesh of stage k)
SCHEDULES = {
    "gpipe": (2, lambda k: k),
    "1f1b": (2, lambda k: k),
    "interleaved-1f1b": (4, lambda k: k % 2),
    "zero-bubble-h1": (2, lambda k: k),
    "dualpipe-v": (4, lambda k: k if k < 2 else 3 - k),
}


def _loss_of(stages):
    def loss(params, batch):
        x, y = batch
        for stage, p in zip(stages, params, strict=True):
            x = stage(p, x)
        return jnp.mean((x - y) ** 2)  # the targets are read outside any stage
    return loss


def _spec(spec, ndim):
    return tuple(spec) + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_tutorial_setup_pipelines_under_microbatch(schedule):
    n, submesh = SCHEDULES[schedule]
    block = LogicalBlock(hidden=32)  # the tutorial's block, smaller
    x = jax.random.normal(jax.random.key(1), (32, 16))
    y = jax.random.normal(jax.random.key(2), (32, 16))
    params = tuple(nn.unbox(block.init(jax.random.key(k), x)) for k in range(n))
    mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"),
                         axis_types=(AxisType.Auto,) * 3)
    stages = [mm.task(block.apply, name=f"stage{k}", mesh_slice={"stage": submesh(k)})
              for k in range(n)]
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        specs = nn.get_partition_spec(jax.eval_shape(block.init, jax.random.key(0), x))
        shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
        placed = tuple(jax.device_put(p, shardings) for p in params)
        batch = tuple(jax.device_put(a, NamedSharding(mesh, P("data", None))) for a in (x, y))
        step = mm.mjit(mm.microbatch(jax.value_and_grad(_loss_of(stages)), dim=0, size=4,
                                     argnum=1, schedule=schedule, reduction="mean"))
        compiled = step.lower(placed, batch).compile()
        value, grads = compiled(placed, batch)
        # where jax.jit leaves each gradient, the same program and placement, no stages
        _, jit_grads = jax.jit(jax.value_and_grad(_loss_of([block.apply] * n)))(placed, batch)
    assert compiled.schedule.name == schedule
    ref_value, ref_grads = jax.value_and_grad(_loss_of([block.apply] * n))(params, (x, y))
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for k in range(n):
        devices = set(range(4 * submesh(k), 4 * submesh(k) + 4))
        got, ref = jax.tree.leaves(grads[k]), jax.tree.leaves(ref_grads[k])
        for g, r, j in zip(got, ref, jax.tree.leaves(jit_grads[k]), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
            assert {d.id for d in g.devices()} == devices, (k, g.sharding)
            assert _spec(g.sharding.spec, g.ndim) == _spec(j.sharding.spec, g.ndim), \
                (k, g.sharding, j.sharding)
    kernel = grads[n - 1]["params"]["Dense_0"]["kernel"]
    assert kernel.addressable_shards[0].data.shape == (16, 16)  # split over "model"
