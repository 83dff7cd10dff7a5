"""A tied output head in an NNX model runs where the plan puts it (issue 31, item 3).

``self.embed.attend(x)`` is a method other than ``__call__``. It is named as linen names
it, ``LM/embed.attend``: a unit of its own, apart from the lookup in ``LM/embed``, that a
plan places and costs, and whose backward (the [vocab, d] weight gradient of the shared
table included) runs in that stage's backward fragments.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax import flax as mmf  # noqa: E402

D, V = 32, 1024
TOK = (jnp.arange(8 * 16).reshape(8, 16) * 7) % V


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 64, rngs=rngs)
        self.down = nnx.Linear(64, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jnp.tanh(self.up(self.ln(x))))


class TiedLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(4)])

    def __call__(self, tok):
        x = self.embed(tok)
        for b in self.blocks:
            x = b(x)
        logits = self.embed.attend(x)  # the output head: the embedding's table, tied
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), tok[..., None], -1)
        return -jnp.mean(picked)


def _stacks(model):
    from multimesh.jax.flax._nnx_names import module_names

    def loss(m, t):
        return m(t)

    with module_names(model):
        jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(model, TOK)
    return [(e.primitive.name, str(e.source_info.name_stack), e) for e in jaxpr.jaxpr.eqns]


def _vocab_dots(eqns):
    return [(p, s) for p, s, e in eqns if p == "dot_general"
            and any(V in getattr(v.aval, "shape", ()) for v in (*e.invars, *e.outvars))]


def test_a_method_call_is_named_by_its_module_path():
    dots = _vocab_dots(_stacks(TiedLM(nnx.Rngs(0))))
    assert len(dots) == 3  # the head's matmul, its input and its weight gradient
    for _, stack in dots:
        assert re.search(r"TiedLM\)*/embed\.attend$", stack), stack
    assert sum(s.startswith("transpose(") for _, s in dots) == 2  # backward, named so


def test_the_plan_places_and_costs_the_tied_head():
    model = TiedLM(nnx.Rngs(0))
    plan = mm.plan_pipeline(lambda m, t: m(t), model, TOK, num_stages=4, num_microbatches=2)
    units = [u for st in plan.stages for u in st.units]
    assert units == ["embed", "blocks/0", "blocks/1", "blocks/2", "blocks/3", "embed.attend"]
    head = next(u for u in plan.units if u["name"] == "embed.attend")
    matmul = 2 * TOK.size * V * D  # one [tokens, d] x [d, vocab] product
    assert head["fwd_flops"] == pytest.approx(matmul, rel=0.1)
    assert head["bwd_flops"] == pytest.approx(2 * matmul, rel=0.1)
    last = plan.stages[-1]
    assert "embed.attend" in last.units and last.index != 0
    assert r"embed\.attend" in plan.as_code()  # the rule claims the head, not the lookup


def _accumulated(model, tok, m):
    g, p, rest = nnx.split(model, nnx.Param, ...)
    rows = tok.shape[0] // m
    parts = [jax.value_and_grad(lambda p, t: nnx.merge(g, p, rest)(t))(p, tok[rows * i:rows * (i + 1)])
             for i in range(m)]
    loss = sum(x[0] for x in parts) / m
    grads = jax.tree.map(lambda *gs: sum(gs[1:], gs[0]) / m, *[x[1] for x in parts])
    return loss, p, grads


def test_the_step_runs_the_head_where_the_plan_put_it():
    lr = 0.5
    model, ref = TiedLM(nnx.Rngs(0)), TiedLM(nnx.Rngs(0))
    result = mmf.parallelize_step(model, optax.sgd(lr), global_batch=TOK,
                                  num_stages="auto", num_microbatches=2)
    plan = result.plan
    head_stage = next(st for st in plan.stages if "embed.attend" in st.units)
    embed_stage = next(st for st in plan.stages if "embed" in st.units)
    assert head_stage.index != embed_stage.index
    loss, state = result.step_fn(result.state, TOK)
    ref_loss, p, grads = _accumulated(ref, TOK, 2)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    want = jax.tree.map(lambda w, g: w - lr * g, p, grads)
    got = nnx.state(state.model, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    table = state.model.embed.embedding.get_value()  # the tied gradient reached the table
    np.testing.assert_allclose(table, want["embed"]["embedding"], rtol=2e-4, atol=1e-6)
    # every [vocab, d] matmul (the head, its input and weight gradient) runs on the head's
    # stage, the gradients in backward fragments
    vocab_dots = {}
    for frag in result.step_fn.compiled.fragments:
        dots = [ln for ln in frag["module"].splitlines()
                if "stablehlo.dot_general" in ln and str(V) in ln]
        if dots:
            vocab_dots[frag["name"]] = (frag["devices"], frag["direction"], len(dots))
    assert vocab_dots, "no head matmul found"
    for name, (devices, _, _) in vocab_dots.items():
        assert devices == list(head_stage.devices), (name, vocab_dots)
    assert sum(n for _, d, n in vocab_dots.values() if d == "bwd") == 2, vocab_dots
    assert sum(n for _, d, n in vocab_dots.values() if d == "fwd") == 1, vocab_dots


def test_the_loss_backward_runs_in_the_heads_backward():
    """The loss's backward (the cotangent of the log-softmax, summed over its two uses,
    and the scatter of the picked tokens) is backward work of the head: jax traces it in
    calls of its own (``jit(log_softmax)``), whose ops name only their stack relative
    to the call. Named by their whole stack, they join the head's backward fragment, on
    the head's stage; before, they ran on stage 0 in a fragment labelled forward, and
    their [batch, seq, vocab] results crossed the pipeline."""
    model = TiedLM(nnx.Rngs(0))
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, t):
        return nnx.merge(graph, p, rest)(t)

    plan = mm.plan_pipeline(lambda m, t: m(t), model, TOK, num_stages=4, num_microbatches=2)
    head = next(st for st in plan.stages if "embed.attend" in st.units)
    with plan:
        compiled = mm.mjit(plan.microbatch(jax.value_and_grad(loss))).lower(params, TOK).compile()
    got_loss, got = compiled(params, TOK)
    ref_loss, _, ref = _accumulated(TiedLM(nnx.Rngs(0)), TOK, 2)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
    vocab = re.compile(rf"tensor<\d+x\d+x{V}xf32>")  # logits and their cotangents
    touching = {}
    for frag in compiled.fragments:
        ops = [ln.split("=", 1)[1].split()[0] for ln in frag["module"].splitlines()
               if " = " in ln and "stablehlo." in ln and vocab.search(ln)]
        if ops:
            touching[frag["name"]] = (frag["devices"], frag["direction"], ops)
    for name, (devices, direction, ops) in touching.items():
        assert devices == list(head.devices), (name, touching)  # no logits cross stages
        if direction == "fwd":  # the head's forward: no gradient work
            assert not {"stablehlo.add", "stablehlo.scatter", "\"stablehlo.scatter\"(",
                        "stablehlo.negate"} & set(ops), (name, ops)
    assert any(d == "bwd" and "stablehlo.add" in ops for _, d, ops in touching.values())


def test_ops_of_a_plain_call_are_named_by_their_whole_name_stack():
    """mm-inline-tasks puts the call site's name stack in front of an inlined op's own
    (as jax names the ops of a call it inlines), so mm-assign-tasks sees that the ops
    of ``jit(log_softmax)`` called from a backward pass are backward."""
    from multimesh._src.mlir import make_context, parse_module
    from multimesh.passes import _contract
    from multimesh.passes.inline_tasks import InlineTasksPass
    from multimesh.passes.match_tasks import name_stack

    text = """
    func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = call @f(%arg0) : (tensor<8xf32>) -> tensor<8xf32> loc("transpose(jvp(LM))/jit(f)")
      return %0 : tensor<8xf32>
    }
    func.func private @f(%arg0: tensor<8xf32>) -> tensor<8xf32> {
      %0 = stablehlo.add %arg0, %arg0 : tensor<8xf32> loc("add_any")
      %1 = stablehlo.negate %0 : tensor<8xf32> loc(unknown)
      return %1 : tensor<8xf32>
    }
    """
    module = parse_module(text, make_context())
    InlineTasksPass().apply(module)
    with module.context:
        main = _contract.main_func(module)
        ops = [op.operation for op in _contract.entry_block(main).operations][:-1]
        assert [name_stack(op.location) for op in ops] == [
            "transpose(jvp(LM))/jit(f)/add_any", "transpose(jvp(LM))/jit(f)"]
