"""Differential fuzzing of ``mjit`` against plain JAX (fast profile; docs/testing.md).

Random programs (tests/fuzz/programs.py) of 2-6 tasks on random submeshes run through
``mjit`` and, under ``ignore_transforms``, as plain JAX; outputs and gradients must
match, every output must live on the devices of the task that produced it, every
fragment on its task's devices, and a constraint that cannot divide its dimension
must raise a clear ``LogicalShardingError``. A failure prints the program as a
standalone Python file.

The long profile is ``python tools/fuzz.py --programs 500 --seed N`` (``--microbatch 1``
for microbatched programs only). Set
``MULTIMESH_FUZZ_EXAMPLES`` to run more examples here.
"""

from __future__ import annotations

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax import with_sharding_constraint as wsc
from tests.fuzz import programs as gen

_N = int(os.environ.get("MULTIMESH_FUZZ_EXAMPLES", "0"))


def _settings(n):
    return settings(max_examples=_N or n, deadline=None, derandomize=not _N, database=None,
                    print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def _run(spec):
    note(gen.render(spec))
    out = gen.check(spec)
    event(f"outcome: {out.status}")
    for k in out.known:
        event(f"known bug touched: {k}")
    event(f"tasks: {len(spec.tasks)}")
    if spec.microbatch:
        il = spec.microbatch.interleave
        event(f"schedule: {spec.microbatch.schedule} x {spec.microbatch.num_microbatches}"
              + (f", interleave={il}" if il else ""))
    for feature, on in (("vmap", spec.vmap), ("int32", spec.dtype == "int32"),
                        ("dict inputs", spec.pytree), ("device order", spec.device_perm),
                        ("checkpoint", any(s.remat for s in spec.steps)),
                        ("glue op", any(s.kind == "glue" for s in spec.steps)),
                        ("microbatch", spec.microbatch),
                        ("task called twice", len({s.task for s in spec.steps if s.kind == "task"})
                         < sum(s.kind == "task" for s in spec.steps))):
        if on:
            event(f"feature: {feature}")
    return out


# ----------------------------------------------------------------------------- fast profile
# 60 forward + 50 grad programs: about 20 s on 2 cores (docs/testing.md).


@_settings(60)
@given(gen.programs(grad=False))
def test_forward_programs_match_plain_jax(spec):
    _run(spec)


@_settings(50)
@given(gen.programs(grad=True))
def test_grad_programs_match_plain_jax(spec):
    _run(spec)


# 40 microbatched gradient programs: ``mm.microbatch(value_and_grad(loss), argnum=k)`` with
# 2-4 microbatches and a random schedule (gpipe, 1f1b, zero-bubble-h1, interleaved-1f1b),
# compared with the sum over microbatches of plain JAX, gradients placed on their tasks,
# and ``compiled.schedule`` checked (gen._check_schedule): about 12 s.


@_settings(40)
@given(gen.programs(microbatch=True))
def test_microbatched_programs_match_plain_jax(spec):
    _run(spec)


# ----------------------------------------------------------------------------- generator


def test_generator_is_deterministic():
    a = [gen.render(gen.random_program(s)) for s in range(20)]
    b = [gen.render(gen.random_program(s)) for s in range(20)]
    assert a == b
    assert len(set(a)) == 20


def test_generator_covers_the_space():
    """Over 300 seeds every feature the issue asks for shows up."""
    seen = set()
    for s in range(300):
        p = gen.random_program(s)
        seen.add(f"tasks={len(p.tasks)}")
        seen.add("grad" if p.grad else "fwd")
        for t in p.tasks:
            seen.add(f"axes={len(t.axis_sizes)}")
            seen.add(f"ndev={len(t.devices)}")
            if t.logical_axes is None:
                seen.add("identity-mapping")
            if any(op.kind == "wsc" for op in t.body):
                seen.add("wsc")
            for op in t.body:
                seen.add(op.kind)
        sets = [frozenset(t.devices) for t in p.tasks]
        for i, a in enumerate(sets):
            for b in sets[:i]:
                seen.add("same" if a == b else "disjoint" if not a & b
                         else "nested" if a < b or b < a else "overlap")
        for st_ in p.steps:
            seen.add(f"step:{st_.kind}")
            if st_.remat:
                seen.add("remat")
        if gen.predict_error(p) == "must":
            seen.add("must-error")
        if p.device_perm:
            seen.add("device-perm")
    want = {"tasks=2", "tasks=6", "grad", "fwd", "axes=1", "axes=2", "ndev=1", "ndev=8",
            "identity-mapping", "wsc", "unary", "binary", "dot", "reduce", "transpose",
            "same", "disjoint", "nested", "overlap", "step:glue", "step:wsc", "remat",
            "must-error", "device-perm"}
    assert want <= seen, want - seen


def test_generator_microbatch_draws():
    """``microbatch=p`` microbatches about a fraction p of programs, with every schedule,
    2-4 microbatches and any input sliced; ``microbatch=False`` draws nothing extra."""
    for s in range(20):
        assert gen.random_program(s, microbatch=False) == gen.random_program(s)
    progs = [gen.random_program(s, microbatch=0.25) for s in range(200)]
    mbs = [p.microbatch for p in progs if p.microbatch]
    assert 30 <= len(mbs) <= 70, len(mbs)
    assert {m.schedule for m in mbs} == set(gen.MB_SCHEDULES)
    assert {m.num_microbatches for m in mbs} == {2, 3, 4}
    assert {m.argnum for m in mbs} == {0, 1, 2}
    for p in progs:
        if p.microbatch:
            assert p.grad and p.vmap is None and not p.pytree and len(p.input_ranks) >= 2
            assert p.microbatch.argnum not in gen.grad_argnums(p)
    # interleaved-1f1b: tasks alternate between two submeshes; interleave=k when k stages
    # are predicted on each
    il = [p for p in (gen.random_program(s, microbatch=True) for s in range(200))
          if p.microbatch.schedule == "interleaved-1f1b"]
    for p in il:
        assert len({t.devices for t in p.tasks}) <= 2
        k = set(gen.predicted_stages(p).values())
        assert p.microbatch.interleave == (min(k) if len(k) == 1 and min(k) >= 2 else None)
    assert any(p.microbatch.interleave for p in il)
    assert all(gen.random_program(s, microbatch=0.5, grad=False).microbatch is None
               for s in range(20))
    with pytest.raises(ValueError, match="grad=False"):
        gen.random_program(0, microbatch=True, grad=False)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_oracle_matches_resolve_logical_spec(data):
    """The generator's reference model of the logical rule agrees with the library's."""
    from multimesh._src.errors import LogicalShardingError
    from multimesh.passes.logical_axes import resolve_logical_spec

    d = gen.HypothesisDrawer(data.draw)
    k = d.choice((1, 2, 3, 4, 6, 8))
    shape = d.choice(gen._factorizations(k))
    names = gen.AXIS_NAMES[: len(shape)]
    mapping = gen._gen_mapping(d, names)
    rank = d.integer(1, 2)
    dims = gen._gen_wsc_spec(d, rank)
    tshape = tuple(d.choice((8, 4, 6, 2, 1)) for _ in range(rank))
    want = gen.expected_resolution(dims, tshape, names, shape, mapping)
    per_dim = [() if e is None else (e,) if isinstance(e, str) else e for e in dims]
    eff = tuple((a, a) for a in names) if mapping is None else mapping
    try:
        have = resolve_logical_spec(per_dim, tshape, names, shape, eff)
    except LogicalShardingError as e:
        assert want == "nondividing", (want, str(e))
        assert "does not evenly divide" in str(e)
        return
    assert have == want


# ----------------------------------------------------------------------------- regressions
# Shrunk fuzz failures. Each strict xfail names a library bug (docs/testing.md, "Bugs found");
# when the bug is fixed the test XPASSes, fails, and its KNOWN_BUGS entry in
# tests/fuzz/programs.py must be removed along with the xfail mark.


def _ids(a):
    return sorted(d.id for d in a.devices())


def test_regression_constraint_only_task_with_empty_mapping():
    a = mm.task(jnp.sin, name="a", mesh=mm.TaskMesh(devices=(0, 1, 2, 3)))
    b = mm.task(lambda x: wsc(x, P("x")), name="b", mesh=mm.TaskMesh(devices=(4, 5, 6, 7)),
                logical_axes=())
    out = mm.mjit(lambda x: b(a(x)))(jnp.arange(8.0))
    assert _ids(out) == [4, 5, 6, 7]


def test_regression_constraint_only_task_with_identity_mapping():
    """The same program with a non-empty mapping keeps b's fragment (passes today)."""
    a = mm.task(jnp.sin, name="a", mesh=mm.TaskMesh(devices=(0, 1, 2, 3)))
    b = mm.task(lambda x: wsc(x, P("x")), name="b", mesh=mm.TaskMesh(devices=(4, 5, 6, 7)))
    out = mm.mjit(lambda x: b(a(x)))(jnp.arange(8.0))
    assert _ids(out) == [4, 5, 6, 7]
    np.testing.assert_allclose(np.asarray(out), np.sin(np.arange(8.0)), rtol=1e-6)


def test_regression_grad_through_identity_backward():
    b = mm.task(lambda x, y: x + y, name="b", mesh=mm.TaskMesh(devices=(2, 3)))
    a = mm.task(jnp.sin, name="a", mesh=mm.TaskMesh(devices=(0, 1)))
    x = jnp.ones((8, 8))
    gx, gy = mm.mjit(jax.grad(lambda x, y: jnp.sum(a(b(x, y))), argnums=(0, 1)))(x, x)
    np.testing.assert_allclose(np.asarray(gx), np.cos(2.0) * np.ones((8, 8)), rtol=1e-6)
    assert _ids(gx) == [2, 3] and _ids(gy) == [2, 3]


def test_regression_no_transfer_between_identical_layouts():
    a = mm.task(jnp.sin, name="a", mesh=mm.TaskMesh(devices=(0, 1), axis_names=("x",),
                                                    axis_sizes=(2,)))
    b = mm.task(jnp.cos, name="b", mesh=mm.TaskMesh(devices=(0, 1), axis_names=("y",),
                                                    axis_sizes=(2,)))
    compiled = mm.mjit(lambda x: b(a(x))).lower(jnp.ones(8)).compile()
    assert not compiled.transfers, compiled.plan()


@pytest.mark.parametrize("wrap", [jax.checkpoint, jax.jit])
def test_regression_checkpointed_task_keeps_its_microbatch(wrap):
    """Fixed: jax caches the trace of a checkpointed (or nested-jitted) function, so every
    microbatch's call of ``a`` replayed microbatch 0's trace and was tagged microbatch 0
    ('a_fwd_mb0_1', '_2'; under jit one fragment for all microbatches); its backwards
    merged into one 'a_bwd_mb0' and 1F1B on a's submesh became F0 F0 F0 ... B0. The
    values were right. Found by the fuzzer (jax.checkpoint'd task calls)."""
    a = mm.task(lambda w, x: jnp.sin(x @ w), name="a", mesh=mm.TaskMesh(devices=(0, 1)))
    b = mm.task(lambda w, x: jnp.cos(x @ w), name="b", mesh=mm.TaskMesh(devices=(2, 3)))
    wa = wrap(a)

    def loss(ws, x):
        return jnp.sum(b(ws[1], wa(ws[0], x)))

    ws, x = [jnp.eye(4) * 0.5, jnp.eye(4) * 0.7], jnp.linspace(0, 1, 48).reshape(12, 4)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule="1f1b")
    compiled = mm.mjit(f).lower(ws, x).compile()
    with mm.ignore_transforms():
        ref = jax.value_and_grad(loss)(ws, x)
    for o, r in zip(jax.tree.leaves(compiled(ws, x)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-6)
    units = compiled.schedule.units
    for kind in ("fwd", "bwd"):  # (checkpoint: a rematerialised forward per microbatch too)
        mbs = collections.Counter(u.microbatch for u in units if u.task == "a" and
                                  u.kind == kind and u.microbatch is not None)
        assert set(mbs) == {0, 1, 2} and len(set(mbs.values())) == 1, (kind, mbs)


def test_regression_live_activations_backward_before_forward():
    """Fixed: a loss task whose backward reads nothing (``sum(h * 0.5)``: a constant
    cotangent) may be dispatched backward first: the fuzz program ``random_program(30,
    microbatch=True)`` gets the loss submesh row F0 B0 B1 B2 B3 F1 F2 F3 under gpipe, and
    ``live_activations()`` reported 3 there, not 1 (the late forwards opened activations
    that nothing closed). The same order, by hand:"""
    from multimesh.passes.schedules import Schedule, Unit, live_activation_profile

    units = tuple(Unit(2 * m + (kind == "bwd"), 0, kind, m, 0, (), "loss",
                       f"loss_{kind}_mb{m}") for m in range(3) for kind in ("fwd", "bwd"))
    row = (0, 1, 3, 5, 2, 4)  # F0 B0 B1 B2 F1 F2
    sched = Schedule("gpipe", units, orders=(row,), order=row)
    assert live_activation_profile(sched) == [[1, 0, 0, 0, 0, 0]]
    assert sched.live_activations() == [1]


def test_regression_dead_nondividing_constraint_under_microbatch():
    """Found by the long fuzz (an oracle error, not a library one): a constraint that
    cannot divide (8 rows over y=3), whose value only reaches an argument the next task
    ignores, is dead. The microbatch loop drops it, as ``jax.jit`` drops a dead
    constraint, and computes jax's numbers; the flat form still resolves it and raises.
    The oracle therefore says 'may raise' (``predict_error`` follows used outputs)."""
    mesh3 = mm.TaskMesh(devices=(0, 1, 2), axis_names=("x", "y"), axis_sizes=(1, 3))
    t1 = mm.task(lambda v: (jnp.tanh(v), wsc(v, P(None, "y"))), name="t1", mesh=mesh3)
    t2 = mm.task(lambda ignored, v: jnp.tanh(v), name="t2", mesh=mm.TaskMesh(devices=(3, 4)))

    def loss(x, w):
        a, b = t1(x * w)
        return jnp.sum(t2(b, a))

    rng = np.random.RandomState(0)
    x = rng.uniform(-1, 1, (16, 8)).astype(np.float32)
    w = rng.uniform(-1, 1, (8,)).astype(np.float32)
    step = mm.microbatch(jax.value_and_grad(loss, argnums=1), dim=0, size=8, argnum=0,
                         schedule="gpipe")
    value, grad = mm.mjit(step)(x, w)
    with mm.ignore_transforms():
        ref = [jax.value_and_grad(loss, argnums=1)(x[i * 8:(i + 1) * 8], w) for i in (0, 1)]
    np.testing.assert_allclose(float(value), float(ref[0][0] + ref[1][0]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref[0][1] + ref[1][1]), rtol=1e-5)
    assert _ids(value) == [3, 4] and _ids(grad) == [0, 1, 2]
    with pytest.raises(ValueError, match="3 does not evenly divide 8"):
        mm.mjit(jax.value_and_grad(loss, argnums=1))(x[:8], w)
