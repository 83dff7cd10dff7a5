"""One cost model: every second multimesh predicts comes from ``DeviceModel``.

Two halves. The source scan fails when a second roofline (``max(a / x, b / y)``), a
second transfer or collective formula (a division by a bandwidth or a flop rate), or
a copied hardware model (a class with two or more rate fields) appears anywhere in
the library outside ``multimesh/jax/_analysis/costs.py``. The behavioural checks
price the same work through the planner's search, ``compare_schedules``, the
schedule simulator and the cluster planner, and compare the seconds with
``DeviceModel``'s own methods.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import pytest

import multimesh.jax as mm
from multimesh.jax._analysis.costs import (
    edge_bytes,
    fragment_collectives,
    transfer_costs,
    xla_costs,
)
from multimesh.jax._analysis.devices import DEVICE_KINDS
from multimesh.jax._planner import _search
from multimesh.schedules.costs import predict

ROOT = pathlib.Path(__file__).resolve().parents[1]
THE_MODEL = ROOT / "multimesh" / "jax" / "_analysis" / "costs.py"
RATES = ("bandwidth", "peak_flops", "device_flops", "flops_per_s")
RATE_FIELDS = {"peak_flops", "device_flops", "memory_bandwidth", "link_bandwidth",
               "network_bandwidth", "hbm_bandwidth", "fragment_overhead", "overhead"}
# classes that hold figures without pricing anything: the one datasheet, and a
# described cluster's overrides of it (both build a DeviceModel; neither has a formula)
FIGURE_RECORDS = {("multimesh/jax/_analysis/devices.py", "DeviceSpec"),
                  ("multimesh/jax/_planner/_cluster.py", "Cluster")}
# divisions by a rate that are not prices: MFU is achieved over peak flops
NOT_PRICES = {("multimesh/jax/_planner/_cluster_plan.py", "mfu")}


@functools.lru_cache(maxsize=1)
def _parsed() -> tuple:
    return tuple((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text()))
                 for path in sorted((ROOT / "multimesh").rglob("*.py")) if path != THE_MODEL)


def _library():
    yield from _parsed()


def _names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _functions(tree: ast.AST):
    """(function name, node) for every node, by its innermost enclosing function."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef,
                                                     ast.AsyncFunctionDef)) else fn
            yield inner, child
            yield from walk(child, inner)
    yield from walk(tree, "<module>")


def _is_div(node) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)


def test_no_second_roofline_in_the_library():
    found = []
    for rel, tree in _library():
        for fn, node in _functions(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "max" and len(node.args) >= 2
                    and sum(_is_div(a) for a in node.args) >= 2):
                found.append(f"{rel}:{node.lineno} ({fn}): {ast.unparse(node)}")
    assert not found, ("a second roofline (max of two quotients) outside DeviceModel; "
                       "price it with DeviceModel.roofline_seconds: " + "; ".join(found))


def test_no_second_transfer_or_collective_formula():
    found = []
    for rel, tree in _library():
        for fn, node in _functions(tree):
            if not _is_div(node) or (rel, fn) in NOT_PRICES:
                continue
            rate = [n for n in _names(node.right) if any(r in n for r in RATES)]
            if rate:
                found.append(f"{rel}:{node.lineno} ({fn}): {ast.unparse(node)}")
    assert not found, ("a division by a bandwidth or flop rate outside DeviceModel (a "
                       "second transfer, collective or compute price); use "
                       "DeviceModel.transfer_seconds / collective_seconds / "
                       "roofline_seconds: " + "; ".join(found))


def test_no_copied_hardware_model():
    found = []
    for rel, tree in _library():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef) or (rel, node.name) in FIGURE_RECORDS:
                continue
            fields = {t.target.id for t in node.body
                      if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
            rates = fields & RATE_FIELDS
            if len(rates) >= 2:
                found.append(f"{rel}:{node.lineno} class {node.name} {sorted(rates)}")
    assert not found, ("a class carrying hardware rates outside DeviceModel (a copied "
                       "model); hold a DeviceModel instead: " + "; ".join(found))


def test_the_scan_catches_a_copy(tmp_path):
    """The scan's own check: the planner's old copy would have been caught."""
    old = ast.parse(
        "class Machine:\n    device_flops: float\n    link_bandwidth: float\n"
        "def _compute(m, flops, nbytes):\n"
        "    return max(flops / m.device_flops, nbytes / m.memory_bandwidth)\n"
        "def move(m, n):\n    return n / m.link_bandwidth\n")
    divs = [n for _, n in _functions(old) if _is_div(n)
            and any(any(r in x for r in RATES) for x in _names(n.right))]
    maxes = [n for _, n in _functions(old) if isinstance(n, ast.Call)
             and getattr(n.func, "id", "") == "max"]
    cls = [n for n in ast.walk(old) if isinstance(n, ast.ClassDef)]
    assert len(divs) == 3 and len(maxes) == 1 and cls[0].name == "Machine"


# ----------------------------------------------------------------------------- behaviour

DM = mm.DeviceModel(peak_flops=2e9, memory_bandwidth=5e9, overhead=3e-5,
                    link_bandwidth=1e6)


def test_collectives_and_transfers_are_one_formula():
    assert DM.transfer_seconds(1e6) == pytest.approx(1.0)
    assert DM.all_reduce_seconds(1e6, 4) == DM.collective_seconds("all-reduce", 1e6, 4)
    assert DM.collective_seconds("all-gather", 1e6, 4) == pytest.approx(
        DM.transfer_seconds(0.75e6))
    assert DM.collective_seconds("all-reduce", 1e6, 4) == pytest.approx(
        DM.collective_seconds("all-gather", 1e6, 4)
        + DM.collective_seconds("reduce-scatter", 1e6, 4))
    net = dataclasses.replace(DM, network_bandwidth=2.5e5, devices_per_node=2)
    assert net.transfer_seconds(1e6, across_nodes=True) == pytest.approx(4.0)
    assert DM.seconds(4e9, 1e9) == pytest.approx(3e-5 + DM.roofline_seconds(4e9, 1e9))
    assert DM.roofline_seconds(4e9, 1e9) == pytest.approx(2.0)  # flops bound
    assert DM.roofline_seconds(1e9, 2e10) == pytest.approx(4.0)  # bytes bound


def test_the_planners_stage_times_are_the_device_models():
    costs = _search.Costs(("a", "b"), (8e9, 4e9), (16e9, 8e9), (10**6, 3 * 10**6), (0, 0),
                          (10**5,), fwd_bytes=(1e9, 1e11), bwd_bytes=(2e9, 2e11))
    p = _search._Prefix(costs)
    m = _search.Limits(DM, num_devices=4, memory_limit=None, optimizer_state_factor=0.0)
    # unit b alone, replicated, rows over 4, 2 microbatches: bytes bound
    f, b, _ = _search._stage_times(p, m, _search.Layout(4, 4), 2, 1, 2)
    move = DM.transfer_seconds(1e5 / 2 / 4)  # a device receives its rows
    assert f == pytest.approx(DM.seconds(4e9 / 2 / 4, 1e11 / 2 / 4) + move)
    assert b == pytest.approx(DM.seconds(8e9 / 2 / 4, 2e11 / 2 / 4) + move
                              + DM.collective_seconds("all-reduce", 3e6, 4))
    # fsdp: the forward all-gathers the parameters, the backward gathers and scatters
    ff, bf, _ = _search._stage_times(p, m, _search.Layout(4, 4, True), 2, 1, 2)
    assert ff - f == pytest.approx(DM.collective_seconds("all-gather", 3e6, 4))
    assert bf - b == pytest.approx(DM.collective_seconds("all-gather", 3e6, 4)
                                   + DM.collective_seconds("reduce-scatter", 3e6, 4)
                                   - DM.collective_seconds("all-reduce", 3e6, 4))


def _chain(params, x):
    for i, w in enumerate(params):
        with jax.named_scope(f"layer{i}"):
            x = jnp.tanh(x @ w)
    return jnp.mean(x)


@pytest.fixture(scope="module")
def two_stages():
    params = [jnp.eye(64) * 0.5 for _ in range(4)]
    x = jnp.linspace(-1, 1, 64 * 64).reshape(64, 64)
    plan = mm.plan_pipeline(_chain, params, x, num_stages=2, num_microbatches=4,
                            schedule="1f1b", fsdp=False, device_model=DM)
    with plan:
        compiled = mm.mjit(plan.microbatch(jax.value_and_grad(_chain))).lower(
            params, x).compile()
    return plan, compiled


def test_compare_schedules_prices_transfers_by_their_bytes(two_stages):
    _, compiled = two_stages
    sizes = edge_bytes(compiled)
    # one microbatch's activations, 16 rows x 64 float32 split over a stage's 4
    # devices, cross the cut forward (to the next stage's forward and backward) and back
    hop = 16 // 4 * 64 * 4
    assert sizes == {("stage0_fwd", "stage1_fwd"): hop, ("stage0_fwd", "stage1_bwd"): hop,
                     ("stage1_bwd", "stage0_bwd"): hop}, sizes
    comm = transfer_costs(compiled, DM)
    sched = compiled.schedule
    src = next(u for u in sched.units if u.kind == "fwd" and u.mesh == 0
               and u.microbatch is not None)
    dst = next(u for u in sched.units if u.kind == "fwd" and u.mesh == 1
               and u.microbatch == src.microbatch)
    assert comm(src, dst) == pytest.approx(DM.transfer_seconds(hop))
    # compare_schedules == the simulator with xla costs and these transfers
    got = mm.compare_schedules(compiled, device_model=DM, memory=None)["1f1b"].step_time
    want = predict(sched, xla_costs(compiled, DM), comm=comm).step_time
    assert got == pytest.approx(want)
    # the transfers are charged: a flat 0 is faster by at least one hop each way
    free = mm.compare_schedules(compiled, device_model=DM, memory=None, comm=0.0)
    assert got - free["1f1b"].step_time >= 2 * DM.transfer_seconds(hop) * 0.999


def test_planner_and_compare_schedules_agree(two_stages):
    plan, compiled = two_stages
    got = mm.compare_schedules(compiled, device_model=DM, memory=None)["1f1b"].step_time
    assert plan.predicted_step_time == pytest.approx(got, rel=0.1)


def test_one_datasheet_for_real_and_described_devices():
    class H100:
        device_kind = "NVIDIA H100 80GB HBM3"

    assert mm.DeviceModel.for_device(H100()) == mm.Cluster("h100", 8).device_model()
    for kind, words in (("h200", "NVIDIA H200"), ("a100-40gb", "NVIDIA A100-SXM4-40GB"),
                        ("a100-80gb", "NVIDIA A100-SXM4-80GB"), ("tpu-v5e", "TPU v5 lite"),
                        ("tpu-v5p", "TPU v5p"), ("tpu-v4", "TPU v4")):
        dev = type("D", (), {"device_kind": words})()
        assert mm.DeviceModel.for_device(dev) == mm.DeviceModel.from_spec(DEVICE_KINDS[kind])


def test_fragment_collectives_are_read_from_the_compiled_program(two_stages):
    hlo = ("%ar = (f32[64,64]{1,0}, f32[64,64]{1,0}) all-reduce(%a, %b), channel_id=1, "
           "replica_groups=mesh['x'=4,'y'=2] {'x'}, to_apply=%add\n"
           "%ag = bf16[16,64]{1,0} all-gather(%c), replica_groups=[2,4]<=[8], dimensions={0}\n"
           "%rs = f32[8]{0} reduce-scatter(f32[32]{0} %d), replica_groups={{0,1,2,3}}\n"
           "%gs = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %e), "
           "replica_groups={{0,1,2,3}}\n"
           "%gd = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %gs)\n")
    assert fragment_collectives(hlo) == [("all-reduce", 2 * 64 * 64 * 4, 4),
                                         ("all-gather", 16 * 64 * 2, 4),
                                         ("reduce-scatter", 32 * 4, 4),
                                         ("all-gather", 16 * 4, 4)]
    # the program's backward all-reduces its stage's gradients over the 4 devices of
    # the data axis: xla_costs charges that collective, as the planner does
    _, compiled = two_stages
    ran = fragment_collectives(compiled._exec.exes["stage0_bwd"].as_text())
    assert ("all-reduce", 2 * 64 * 64 * 4, 4) in ran
    c = compiled.cost_analysis(by_fragment=True)["stage0_bwd"]
    alone = DM.seconds(c["flops"], c["bytes accessed"])
    got = xla_costs(compiled, DM).seconds["stage0_bwd"]
    assert got == pytest.approx(alone + sum(DM.collective_seconds(*r) for r in ran))
    assert got - alone >= DM.collective_seconds("all-reduce", 2 * 64 * 64 * 4, 4)


def test_xla_costs_pay_each_collectives_latency(two_stages):
    """Each collective instruction of a compiled fragment pays the model's latency per
    ring step (an all-reduce 2 (n - 1) steps), on top of its bytes."""
    _, compiled = two_stages
    slow = dataclasses.replace(DM, collective_latency=1e-3)
    ran = fragment_collectives(compiled._exec.exes["stage0_bwd"].as_text())
    assert ran
    steps = sum((2 if op == "all-reduce" else 1) * (k - 1) for op, _, k in ran)
    diff = (xla_costs(compiled, slow).seconds["stage0_bwd"]
            - xla_costs(compiled, DM).seconds["stage0_bwd"])
    assert diff == pytest.approx(steps * 1e-3)


def test_xla_costs_pay_the_rendezvous_of_fragments_with_collectives(two_stages):
    """A fragment that runs collectives waits in them for its compute (the model's
    ``rendezvous`` share of its roofline); one that runs none does not."""
    _, compiled = two_stages
    waits = dataclasses.replace(DM, rendezvous=0.25)
    per = compiled.cost_analysis(by_fragment=True)
    with_it, without = xla_costs(compiled, waits).seconds, xla_costs(compiled, DM).seconds
    runs = {f: bool(fragment_collectives(compiled._exec.exes[f].as_text())) for f in per}
    assert any(runs.values()) and not all(runs.values())
    for f, d in per.items():
        wait = 0.25 * DM.roofline_seconds(d["flops"], d["bytes accessed"]) if runs[f] else 0.0
        assert with_it[f] - without[f] == pytest.approx(wait)
