"""The alpha-beta collective model (issue 38): each collective pays a latency per ring
step besides its bytes, ``calibrate`` measures that latency on the devices, the
planner counts the collectives an fsdp stage runs (one per parameter array and
pass), and a ``DeviceModel`` round-trips through JSON with and without the field.

No wall-clock limits: the calibrated latency is checked to be a positive measurement
of the chain of all-gathers it times, not against a number of seconds.
"""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import multimesh.jax as mm
from multimesh._src.errors import MultimeshValueError
from multimesh.jax._analysis import costs as _costs
from multimesh.jax._analysis.devices import DEVICE_KINDS
from multimesh.jax._planner import _search
from multimesh.jax._planner._units import measure_units

AB = mm.DeviceModel(peak_flops=1e9, memory_bandwidth=1e9, overhead=0.0,
                    link_bandwidth=1e6, collective_latency=2e-3,
                    network_latency=5e-3, devices_per_node=4, network_bandwidth=5e5)


def test_alpha_beta_formula():
    # all-gather over 4: 3 steps of alpha, 3/4 of the bytes over the link
    assert AB.collective_seconds("all-gather", 1e6, 4) == pytest.approx(3 * 2e-3 + 0.75)
    assert AB.collective_seconds("reduce-scatter", 1e6, 4) == pytest.approx(3 * 2e-3 + 0.75)
    # all-reduce: 2 (n - 1) steps (a reduce-scatter then an all-gather)
    assert AB.collective_seconds("all-reduce", 1e6, 4) == pytest.approx(6 * 2e-3 + 1.5)
    assert AB.all_reduce_seconds(1e6, 4) == AB.collective_seconds("all-reduce", 1e6, 4)
    # leaving the node: the network's latency per step and its bandwidth
    assert AB.collective_seconds("all-gather", 1e6, 8, across_nodes=True) == pytest.approx(
        7 * 5e-3 + 7 / 8 * 1e6 / 5e5)
    # count: the same bytes in 5 collectives pay 5 latencies, the bytes once
    assert AB.collective_seconds("all-gather", 1e6, 4, count=5) == pytest.approx(
        5 * 3 * 2e-3 + 0.75)
    assert AB.collective_seconds("all-gather", 0.0, 4) == pytest.approx(3 * 2e-3)
    assert AB.collective_seconds("all-gather", 1e6, 1) == 0.0
    # no latency: the bandwidth model as before
    flat = dataclasses.replace(AB, collective_latency=0.0, network_latency=None)
    assert flat.collective_seconds("all-gather", 1e6, 4) == pytest.approx(0.75)


def test_published_kinds_carry_nccls_latencies():
    for spec in DEVICE_KINDS.values():
        dm = mm.DeviceModel.from_spec(spec)
        assert dm.collective_latency == spec.link_latency > 0
        assert dm.network_latency == spec.network_latency > dm.collective_latency
        assert "latency" in spec.source
    h100 = mm.Cluster("h100", 16).device_model()
    assert h100.collective_latency == pytest.approx(3.4e-6)
    assert h100.network_latency == pytest.approx(9.6e-6)


def test_latency_must_be_a_non_negative_number():
    for bad in (-1e-6, float("inf"), "1us", True):
        with pytest.raises(MultimeshValueError, match=r"`collective_latency` must be a finite "
                                                       r"number >= 0 \(seconds per collective"):
            mm.DeviceModel(1e9, 1e9, collective_latency=bad)
    with pytest.raises(MultimeshValueError, match=r"`network_latency` must be a finite"):
        mm.DeviceModel(1e9, 1e9, network_latency=-1.0)


def test_json_round_trip_with_and_without_the_latency():
    assert mm.DeviceModel.from_json(AB.to_json()) == AB
    assert eval(repr(AB), {"DeviceModel": mm.DeviceModel}) == AB
    # a file written before the latency existed: the fields take their defaults
    old = json.loads(AB.to_json())
    del old["collective_latency"], old["network_latency"]
    got = mm.DeviceModel.from_json(json.dumps(old))
    assert got == dataclasses.replace(AB, collective_latency=0.0, network_latency=None)
    assert got.collective_seconds("all-gather", 1e6, 4) == pytest.approx(0.75)
    with pytest.raises(MultimeshValueError, match=r"`DeviceModel.from_json` takes an object "
                                                   r"with `peak_flops`.*got \['latency'"):
        mm.DeviceModel.from_json(json.dumps({"latency": 1.0, "peak_flops": 1.0}))


def test_calibrate_measures_the_latency_of_a_chain_of_all_gathers():
    devices = jax.devices()
    assert len(devices) == 8
    dm = mm.DeviceModel.calibrate(devices)
    assert dm.collective_latency > 0 and dm.network_latency is None
    assert "us per collective step" in dm.describe()
    # the probe is what it says: LATENCY_CHAIN all-gathers over the 8 devices, each
    # reading the one before, none combined
    probe = _costs._probes(devices)["gather"]
    hlo = probe[0].lower(*probe[1]).compile().as_text()
    ran = _costs.fragment_collectives(hlo)
    assert [op for op, _, _ in ran] == ["all-gather"] * _costs.LATENCY_CHAIN
    assert {k for _, _, k in ran} == {8}
    # one device: no collective to time
    assert _costs._measure(mm.DeviceModel, devices[:1], rounds=1).collective_latency == 0.0


# ----------------------------------------------------------------------------- the planner

def _costs_with(leaves: int) -> _search.Costs:
    """Two units of fixed bytes whose parameters are split into ``leaves`` arrays."""
    return _search.Costs(("a", "b"), (8e6, 8e6), (16e6, 16e6), (10**6, 10**6), (0, 0),
                         (10**4,), leaves=(leaves, leaves), bwd_leaves=(leaves, 1))


def test_fsdp_pays_one_collective_per_parameter_array():
    m = _search.Limits(AB, num_devices=4, memory_limit=None, optimizer_state_factor=0.0)
    fsdp, data = _search.Layout(4, 4, True), _search.Layout(4, 4)
    times = {n: _search._stage_times(_search._Prefix(_costs_with(n)), m, fsdp, 2, 0, 2)
             for n in (1, 3, 10)}
    step = 3 * AB.collective_latency  # one all-gather's or reduce-scatter's latency over 4
    for n in (3, 10):
        # forward: a gather per array the forward reads (2 units of n); backward: a
        # gather per array it reads (n + 1) and a reduce-scatter per array (2 n)
        assert times[n][0] - times[1][0] == pytest.approx((2 * n - 2) * step)
        assert times[n][1] - times[1][1] == pytest.approx((n + 1 - 2 + 2 * n - 2) * step)
    # the bytes are the same: without latency the counts change nothing
    flat = dataclasses.replace(m, model=dataclasses.replace(AB, collective_latency=0.0))
    assert _search._stage_times(_search._Prefix(_costs_with(10)), flat, fsdp, 2, 0, 2) == \
        pytest.approx(_search._stage_times(_search._Prefix(_costs_with(1)), flat, fsdp, 2, 0, 2))
    # data parallel: one all-reduce per backward however many arrays (XLA combines them)
    d1, d10 = (_search._stage_times(_search._Prefix(_costs_with(n)), m, data, 2, 0, 2)
               for n in (1, 10))
    assert d1 == pytest.approx(d10)
    flat_d = _search._stage_times(_search._Prefix(_costs_with(10)), flat, data, 2, 0, 2)
    assert d10[1] - flat_d[1] == pytest.approx(2 * step)  # one all-reduce: 2 (n - 1) steps
    assert d10[0] == pytest.approx(flat_d[0])


class _Layers(nn.Module):
    n: int

    @nn.compact
    def __call__(self, x):
        for k in range(2):
            with jax.named_scope(f"u{k}"):
                x = jnp.tanh(nn.Dense(16, name=f"u{k}")(x))
        return jnp.mean(x)


def test_units_count_the_arrays_each_pass_reads():
    model = _Layers(2)
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x)
    prof = measure_units(model.apply, (params, x))
    assert [u.param_leaves for u in prof.units] == [2, 2]  # kernel and bias
    # the backward reads each kernel (the input gradient of u1; u0's is not needed)
    assert [u.bwd_param_leaves for u in prof.units] == [0, 1]


def test_an_fsdp_plans_collectives_grow_with_its_arrays():
    """The same parameter bytes in 1 array or 8: the fsdp plan's predicted step grows by
    the latency of the extra gathers and reduce-scatters, the data-parallel one not."""
    dm = mm.DeviceModel(peak_flops=1e12, memory_bandwidth=1e12, overhead=0.0,
                        link_bandwidth=1e10, collective_latency=1e-4)

    def chain(params, x):
        for i, ws in enumerate(params):
            with jax.named_scope(f"layer{i}"):
                x = jnp.tanh(x @ jnp.concatenate(ws, axis=1))
        return jnp.mean(x)

    x = jnp.ones((16, 32))
    one = [[jnp.eye(32) * 0.5] for _ in range(2)]
    many = [[jnp.eye(32)[:, 4 * k:4 * k + 4] * 0.5 for k in range(8)] for _ in range(2)]
    step = {}
    for name, params in (("one", one), ("many", many)):
        for fsdp in (True, False):
            plan = mm.plan_pipeline(chain, params, x, num_stages=2, num_microbatches=1,
                                    fsdp=fsdp, device_model=dm)
            assert plan.fsdp is fsdp and plan.stages[0].param_bytes == 32 * 32 * 4
            step[name, fsdp] = plan.predicted_step_time
    # per stage of 4 devices, 7 more arrays: 7 forward gathers, 7 backward gathers and
    # 7 reduce-scatters, 3 ring steps each (the two stages overlap in the pipeline: at
    # least one stage's worth)
    extra = step["many", True] - step["one", True]
    assert extra >= 21 * 3 * 1e-4 * 0.999
    assert step["many", False] == pytest.approx(step["one", False])


def test_a_cluster_overrides_the_latencies():
    c = mm.Cluster("h100", 16, link_latency=1e-6, network_latency=0.0)
    dm = c.device_model()
    assert (dm.collective_latency, dm.network_latency) == (1e-6, 0.0)
    assert "overridden: ['link_latency', 'network_latency']" in c.spec.source
    assert mm.Cluster(**c.to_dict()) == c
    old = {k: v for k, v in c.to_dict().items() if "latency" not in k}  # an older plan file
    assert mm.Cluster(**old).device_model().collective_latency == pytest.approx(3.4e-6)
    with pytest.raises(MultimeshValueError, match=r"`Cluster`: `link_latency` must be a "
                                                   r"number of seconds >= 0"):
        mm.Cluster("h100", 8, link_latency=-1.0)
