"""``tools/bench_parallel.py``'s pricing of a ``jax.jit`` step (issue 38): the one cost
model's ``call_seconds`` of its XLA flops and bytes and the collectives its compiled
HLO runs, found in it (the data-parallel step's one combined gradient all-reduce is a
tuple of every gradient), with the calibrated rendezvous where it runs any."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax._analysis.costs import call_seconds, fragment_collectives
from tests.tools import load_tool

DM = mm.DeviceModel(peak_flops=1e9, memory_bandwidth=1e9, overhead=1e-4,
                    link_bandwidth=1e8, collective_latency=1e-5)


def test_a_jit_steps_gradient_all_reduce_and_rendezvous_are_priced():
    bench = load_tool("bench_parallel")
    model, params, tokens = bench.example(layers=1, batch=8, seq=8)
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    p = jax.device_put(params, NamedSharding(mesh, P()))
    t = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    c = jax.jit(jax.value_and_grad(model.apply)).lower(p, t).compile()
    ran = fragment_collectives(c.as_text())
    grads = sum(x.nbytes for x in jax.tree.leaves(params))
    # every gradient is all-reduced over the 8 devices (in one combined collective)
    assert sum(n for op, n, k in ran if op == "all-reduce" and k == 8) >= grads
    ca = c.cost_analysis()
    alone = DM.seconds(ca["flops"], ca["bytes accessed"])
    assert bench.jit_predicted(c, DM) == pytest.approx(call_seconds(
        DM, ca["flops"], ca["bytes accessed"], ran))
    assert bench.jit_predicted(c, DM) >= alone + DM.collective_seconds("all-reduce", grads, 8)
    waits = dataclasses.replace(DM, rendezvous=0.5)
    assert bench.jit_predicted(c, waits) - bench.jit_predicted(c, DM) == pytest.approx(
        0.5 * DM.roofline_seconds(ca["flops"], ca["bytes accessed"]))
