"""Fewer, fused calls (issue 40 item 3): ``mm-merge-fragments`` makes consecutive
fragments on one submesh one fragment call.

A one-stage plan (and any program whose fragments all run on one submesh) is one
fragment call per step (per microbatch in a loop), as ``jax.jit`` is one executable;
with ``MULTIMESH_MERGE_FRAGMENTS=all`` a pipeline's last stage's forward and backward
under 1F1B are one call per microbatch. Values, gradients and where they live stay
``jax.jit``'s; the schedule, the memory profile and the trace read the merged calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src.errors import MultimeshValueError, PipelineError
from multimesh.passes.merge_fragments import MergeFragmentsPass
from tests.layouts import spec_of
from tests.layouts import work_per_device as _work
from tests.models import TinyLM, lm_tokens, tanh_chain

VOCAB = 256


@pytest.fixture(scope="module")
def lm():
    model = TinyLM(VOCAB, n=1, d=16, mlp=32)
    tok = lm_tokens(16, 8, VOCAB)
    return model, model.init(jax.random.key(0), tok), tok


def _one_stage(model, params, tok):
    plan = mm.plan_pipeline(model.apply, params, tok, num_stages=1, num_microbatches=1)
    assert plan.num_stages == 1
    with plan:
        return mm.mjit(plan.microbatch(jax.value_and_grad(model.apply))).lower(
            params, tok).compile()


def _same_as_jit(out, ref):
    """Values equal (f32, rtol 1e-5), on the same devices, split the same way."""
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert {d.id for d in got.devices()} == {d.id for d in want.devices()}
        assert spec_of(got.sharding, got.ndim) == spec_of(want.sharding, want.ndim)


def test_a_one_stage_plan_is_one_call_per_step(lm, monkeypatch):
    model, params, tok = lm
    compiled = _one_stage(model, params, tok)
    assert [c["fragment"] for c in compiled.calls] == ["stage0_fwd_bwd"]
    assert compiled.calls[0]["devices"] == list(range(8))
    placed = jax.device_put((params, tok), compiled.input_shardings[0])
    jitted = jax.jit(jax.value_and_grad(model.apply)).lower(*placed).compile()
    _same_as_jit(compiled(*placed), jitted(*placed))
    # every device works as much as jax.jit's SPMD step does (within 5%)
    jit_flops = float(jitted.cost_analysis()["flops"])
    for flops in _work(compiled).values():
        assert abs(flops - jit_flops) <= 0.05 * jit_flops, (flops, jit_flops)
    # the forward's residuals are no longer written out between two calls
    merged = compiled.memory_profile(*placed).submeshes[0]
    monkeypatch.setenv("MULTIMESH_MERGE_FRAGMENTS", "off")
    split = _one_stage(model, params, tok)
    assert [c["fragment"] for c in split.calls] == ["stage0_fwd", "stage0_bwd"]
    held = split.memory_profile(*placed).submeshes[0]
    assert merged.activations == 0 < held.activations
    assert merged.peak < held.peak


def test_a_microbatch_loop_over_one_task_is_one_call_per_microbatch():
    loss, ws, _ = tanh_chain(1)
    x = jnp.linspace(-1, 1, 4 * 8 * 16).reshape(4 * 8, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1)
    compiled = mm.mjit(f).lower(ws, x).compile()
    assert [(c["fragment"], c["microbatch"]) for c in compiled.calls] == \
        [("s0_fwd_bwd", m) for m in range(4)]
    placed = jax.device_put((ws, x), compiled.input_shardings[0])
    with mm.ignore_transforms():
        ref = jax.jit(jax.value_and_grad(loss))(*placed)
    _same_as_jit(compiled(*placed), ref)
    # the schedule reads the merged loop: one unit per microbatch, in order
    assert compiled.schedule.orders == ((0, 1, 2, 3),)
    compiled.profile(ws, x)
    assert compiled.last_profile is not None
    assert mm.residual_bytes(compiled) == {"s0_fwd_bwd": 0}


def _two_stage_1f1b():
    loss, ws, _ = tanh_chain(2)
    x = jnp.linspace(-1, 1, 4 * 8 * 16).reshape(4 * 8, 16)
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, schedule="1f1b")
    return loss, ws, x, mm.mjit(f).lower(ws, x).compile()


def test_a_pipeline_keeps_its_fragments_by_default():
    *_, compiled = _two_stage_1f1b()
    assert {c["fragment"] for c in compiled.calls} == {"s0_fwd", "s0_bwd", "s1_fwd", "s1_bwd"}


def test_the_last_stage_fuses_under_1f1b_when_asked(monkeypatch):
    *_, split = _two_stage_1f1b()
    monkeypatch.setenv("MULTIMESH_MERGE_FRAGMENTS", "all")
    loss, ws, x, compiled = _two_stage_1f1b()
    assert len(compiled.calls) == len(split.calls) - 4
    assert compiled.calls_per_submesh()[(4, 5, 6, 7)] == [f"s1_fwd_bwd@{m}" for m in range(4)]
    assert compiled.calls_per_submesh()[(0, 1, 2, 3)] == split.calls_per_submesh()[(0, 1, 2, 3)]
    with mm.ignore_transforms():
        ref = jax.jit(jax.value_and_grad(loss))(ws, x)
    out = compiled(ws, x)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    for k, (g, w) in enumerate(zip(out[1], ref[1])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert sorted(d.id for d in g.devices()) == list(range(4 * k, 4 * k + 4))
    assert compiled.schedule.orders[1] == tuple(
        u.index for u in compiled.schedule.units if u.mesh == 1)
    compiled.memory_profile(ws, x)  # the accounting reads the merged calls


def test_bad_choices_are_refused(monkeypatch):
    with pytest.raises(PipelineError, match="option 'scope' must be one of one-submesh, all, "
                                            "got some"):
        MergeFragmentsPass(scope="some")
    monkeypatch.setenv("MULTIMESH_MERGE_FRAGMENTS", "yes")
    loss, ws, _ = tanh_chain(1)
    with pytest.raises(MultimeshValueError, match="MULTIMESH_MERGE_FRAGMENTS must be one of"):
        mm.mjit(jax.grad(loss)).lower(ws, jnp.ones((8, 16)))
