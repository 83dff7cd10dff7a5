"""Unmodified NNX models placed by name: module graph paths in the name stack.

The model is a small NNX port of nanoGPT's ``model.py`` (github.com/karpathy/nanoGPT):
token and position embeddings, ``n_layer`` pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and a linear head (untied here). Its
blocks sit in an ``nnx.List`` (``h``) or in numbered attributes (``h_0``, ``h_1``,
...); nothing in it mentions multimesh. ``register_task`` rules over the blocks'
names alone pipeline it over 2 and 4 submeshes.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
optax = pytest.importorskip("optax")

from flax import nnx  # noqa: E402

import multimesh.jax as mm  # noqa: E402
from multimesh.jax.flax import _nnx_names, parallelize_step  # noqa: E402
from multimesh.jax.flax import mjit as nnx_mjit  # noqa: E402
from multimesh.passes.schedules import build_schedule, pipeline_units  # noqa: E402


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    block_size: int = 8
    vocab_size: int = 32
    n_layer: int = 4
    n_head: int = 2
    n_embd: int = 16


class CausalSelfAttention(nnx.Module):
    def __init__(self, c: GPTConfig, rngs: nnx.Rngs):
        self.c_attn = nnx.Linear(c.n_embd, 3 * c.n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(c.n_embd, c.n_embd, rngs=rngs)
        self.n_head = c.n_head

    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)

        def heads(y):
            return y.reshape(b, t, self.n_head, c // self.n_head).transpose(0, 2, 1, 3)

        q, k, v = heads(q), heads(k), heads(v)
        att = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(k.shape[-1])
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        y = jax.nn.softmax(att, axis=-1) @ v
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))


class MLP(nnx.Module):
    def __init__(self, c: GPTConfig, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(c.n_embd, 4 * c.n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(4 * c.n_embd, c.n_embd, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class Block(nnx.Module):
    def __init__(self, c: GPTConfig, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(c.n_embd, rngs=rngs)
        self.attn = CausalSelfAttention(c, rngs)
        self.ln_2 = nnx.LayerNorm(c.n_embd, rngs=rngs)
        self.mlp = MLP(c, rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
    """Blocks in ``self.h`` (an ``nnx.List``), or ``self.h_0``... with ``numbered``."""

    def __init__(self, c: GPTConfig, rngs: nnx.Rngs, numbered: bool = False):
        self.wte = nnx.Embed(c.vocab_size, c.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(c.block_size, c.n_embd, rngs=rngs)
        blocks = [Block(c, rngs) for _ in range(c.n_layer)]
        self.numbered, self.n_layer = numbered, c.n_layer
        if numbered:
            for i, b in enumerate(blocks):
                setattr(self, f"h_{i}", b)
        else:
            self.h = nnx.List(blocks)
        self.ln_f = nnx.LayerNorm(c.n_embd, rngs=rngs)
        self.lm_head = nnx.Linear(c.n_embd, c.vocab_size, use_bias=False, rngs=rngs)

    def blocks(self):
        if self.numbered:
            return [getattr(self, f"h_{i}") for i in range(self.n_layer)]
        return list(self.h)

    def __call__(self, idx):
        x = self.wte(idx) + self.wpe(jnp.arange(idx.shape[1]))
        for block in self.blocks():
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(model, batch):
    """Next-token cross entropy over a batch of token rows, averaged."""
    logits = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


CONFIG = GPTConfig()
BATCH = jax.random.randint(jax.random.key(1), (8, CONFIG.block_size + 1), 0, CONFIG.vocab_size)


def _model(numbered):
    return GPT(CONFIG, nnx.Rngs(0), numbered=numbered)


def _stage_rules(num_stages: int, numbered: bool):
    """``register_task`` rules alone: block i -> stage i * num_stages // n_layer."""
    per = 8 // num_stages

    def stage(name, backprop):
        s = int(name) * num_stages // CONFIG.n_layer
        return mm.Task(name=f"stage{s}", mesh=mm.TaskMesh(
            devices=range(per * s, per * s + per), axis_names=("x",), axis_sizes=(per,)))

    def configure():
        mm.register_task(r"/h_(\d+)" if numbered else r"/h/(\d+)", callback=stage)

    return configure


def _stage_of(path: tuple, num_stages: int) -> int | None:
    """The stage whose devices a parameter at ``path`` must live on (None: not a block)."""
    head = str(path[0])
    if head in ("wte", "wpe"):  # read by block 0's stage only
        return 0
    if head in ("ln_f", "lm_head"):
        return num_stages - 1
    i = int(head[2:]) if head.startswith("h_") else int(path[1])
    return i * num_stages // CONFIG.n_layer


def _devices(num_stages: int, stage: int) -> list[int]:
    per = 8 // num_stages
    return list(range(per * stage, per * stage + per))


def _ids(x) -> list[int]:
    return sorted(d.id for d in x.devices())


def _assert_close(got, want, rtol=2e-5, atol=2e-6):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------- names


def _name_stacks(text: str) -> set[str]:
    return {n for n in re.findall(r'loc\("([^"]*)"', text) if "/" in n}


@pytest.mark.parametrize("numbered", [False, True], ids=["nnx_list", "numbered"])
def test_modules_are_named_by_graph_path(numbered):
    """Forward and backward ops carry ``GPT/<graph path>``, as linen's carry its paths."""
    model = _model(numbered)
    graphdef, params = nnx.split(model)

    def loss(p, b):
        return lm_loss(nnx.merge(graphdef, p), b)

    stacks = _name_stacks(mm.mjit(jax.grad(loss)).lower(params, BATCH).as_text())
    block = "h_2" if numbered else "h/2"
    for want in (f"jvp(GPT)/{block}/attn/c_attn/dot_general",
                 f"transpose(jvp(GPT))/{block}/mlp/c_fc/dot_general",
                 "jvp(GPT)/wte/", "jvp(GPT)/ln_f/", "transpose(jvp(GPT))/lm_head/dot_general"):
        assert any(want in s for s in stacks), (want, sorted(stacks)[:20])
    # a module's scope holds its path below the enclosing call: no path twice
    assert not any(f"{block}/{block}" in s or "GPT/GPT" in s for s in stacks)


def test_copies_made_inside_a_call_are_named_by_class():
    """A flax transform inside a module call copies the module: the copy is named by its
    class under its caller; the documented remedies keep the block's path."""

    class Unit(nnx.Module):
        def __init__(self, rngs, remat_inside=False):
            self.fc = nnx.Linear(8, 8, rngs=rngs)
            self.remat_inside = remat_inside

        def __call__(self, x):
            if self.remat_inside:
                return jnp.tanh(nnx.remat(lambda m, y: m.fc(y))(self, x))
            return jnp.tanh(self.fc(x))

    class Stack(nnx.Module):
        def __init__(self, rngs, how):
            self.blocks = nnx.List([Unit(rngs, how == "inside") for _ in range(2)])
            self.how = how

        def __call__(self, x):
            for i, b in enumerate(self.blocks):
                if self.how == "inside":
                    x = b(x)
                elif self.how == "scope":
                    with jax.named_scope(f"blocks/{i}"):
                        x = nnx.remat(lambda m, y: m(y))(b, x)
                else:
                    x = nnx.remat(lambda m, y: m(y))(b, x)
            return x.sum()

    x = jnp.ones((2, 8))
    found = {}
    for how in ("outside", "scope", "inside"):
        text = nnx_mjit(lambda m, x: m(x)).lower(Stack(nnx.Rngs(0), how), x).as_text()
        found[how] = sorted(s.replace("checkpoint/", "") for s in _name_stacks(text)
                            if s.endswith("dot_general"))  # remat adds `checkpoint/`
    assert found["outside"] == ["jit(<lambda>)/Stack/Unit/fc/dot_general"], found
    assert found["scope"] == [f"jit(<lambda>)/Stack/blocks/{i}/Unit/fc/dot_general"
                              for i in (0, 1)], found
    assert found["inside"] == [f"jit(<lambda>)/Stack/blocks/{i}/Linear/dot_general"
                               for i in (0, 1)], found


def test_modules_built_inside_the_program_keep_their_paths():
    """A model constructed inside the traced function (a method named while it was half
    built) still names children added after that by their paths."""

    class Late(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(8, 8, rngs=rngs)
            self.build(rngs)  # a public method: named while only `first` exists

        def build(self, rngs):
            self.second = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return self.second(self.first(x)).sum()

    text = mm.mjit(lambda x: Late(nnx.Rngs(0))(x)).lower(jnp.ones((2, 8))).as_text()
    stacks = {s for s in _name_stacks(text) if s.endswith("dot_general")}
    assert stacks == {"jit(<lambda>)/Late/first/dot_general",
                      "jit(<lambda>)/Late/second/dot_general"}, stacks


@pytest.mark.parametrize("matcher,hint", [
    (r"H/(\d+)", "Ignoring case it would match 'h/0', 'h/1', 'h/2'."),
    (r"attn/(c_atn)", "Did you mean 'attn/c_attn'"),
])
def test_a_path_rule_that_matches_nothing_names_the_paths(matcher, hint):
    """A typo in a path rule warns with the NNX paths it may have meant."""
    model = _model(False)
    graphdef, params = nnx.split(model)

    def configure():
        mm.register_task(matcher, task=mm.Task(mesh=mm.TaskMesh(devices=range(4))))

    with mm.tasks(configure), pytest.warns(mm.MultimeshWarning) as caught:
        mm.mjit(lambda p, b: lm_loss(nnx.merge(graphdef, p), b)).lower(params, BATCH)
    message = str(caught[0].message)
    assert f"Task matcher {matcher!r} claimed no op" in message and hint in message, message


def test_names_exist_only_while_multimesh_traces():
    model = _model(False)
    original = Block.__call__
    nnx_mjit(lambda m, b: lm_loss(m, b)).lower(model, BATCH)
    assert Block.__call__ is original  # the classes are restored
    # plain jax tracing (outside multimesh) sees no module names
    jaxpr = jax.make_jaxpr(lambda b: lm_loss(model, b))(BATCH)
    assert "h/0" not in str(jaxpr.jaxpr.eqns[-1].source_info.name_stack)
    assert not any("attn" in str(e.source_info.name_stack) for e in jaxpr.jaxpr.eqns)


def test_naming_is_per_thread():
    """Another thread tracing while one thread names modules sees no names."""
    model = _model(False)
    entered, done = threading.Event(), threading.Event()
    seen: list[str] = []

    def other():
        entered.wait(600)
        jaxpr = jax.make_jaxpr(lambda b: lm_loss(model, b))(BATCH)
        seen.extend(str(e.source_info.name_stack) for e in jaxpr.jaxpr.eqns)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with _nnx_names.module_names(model):
        entered.set()
        assert done.wait(600)
        mine = jax.make_jaxpr(lambda b: lm_loss(model, b))(BATCH)
    t.join()
    assert seen and not any("attn" in s for s in seen), seen
    assert any("GPT/h/0/attn/c_attn" in str(e.source_info.name_stack) for e in mine.jaxpr.eqns)


def test_arguments_name_modules_called_directly():
    """A block called without its parent (``model.h[i](x)``) keeps its path in the argument."""
    model = _model(False)

    def first_blocks(m, x):
        return m.h[1](m.h[0](x)).sum()

    x = jax.random.normal(jax.random.key(2), (2, CONFIG.block_size, CONFIG.n_embd))

    def configure():
        for i in (0, 1):
            mm.register_task(f"/h/{i}/", task=mm.Task(name=f"b{i}", mesh=mm.TaskMesh(
                devices=range(4 * i, 4 * i + 4), axis_names=("x",), axis_sizes=(4,))))

    with mm.tasks(configure):
        compiled = nnx_mjit(first_blocks).lower(model, x).compile()
        got = compiled(model, x)
    assert {f["task"]: f["devices"] for f in compiled.fragments} == {
        "b0": [0, 1, 2, 3], "b1": [4, 5, 6, 7]}
    np.testing.assert_allclose(got, first_blocks(model, x), rtol=1e-5)


def test_one_multimesh_rule_places_linen_and_nnx_alike():
    """Numbered blocks are ``h_0``, ``h_1`` in linen and in NNX: one ``MultiMesh`` rule
    places both models the same way, with equal gradients."""
    import flax.linen as nn
    from jax.sharding import Mesh

    class LinenBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(8, name="fc")(x))

    class LinenNet(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = LinenBlock(name=f"h_{i}")(x)
            return (x ** 2).sum()

    class NnxBlock(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.fc(x))

    class NnxNet(nnx.Module):
        def __init__(self, rngs):
            self.h_0, self.h_1 = NnxBlock(rngs), NnxBlock(rngs)

        def __call__(self, x):
            return (self.h_1(self.h_0(x)) ** 2).sum()

    x = jnp.cos(jnp.arange(64.0)).reshape(8, 8)
    linen_params = LinenNet().init(jax.random.key(0), x)
    nnx_net = NnxNet(nnx.Rngs(0))
    for i in range(2):  # the same weights in both
        dense = linen_params["params"][f"h_{i}"]["fc"]
        getattr(nnx_net, f"h_{i}").fc.kernel[...] = dense["kernel"]
        getattr(nnx_net, f"h_{i}").fc.bias[...] = dense["bias"]
    graphdef, nnx_params = nnx.split(nnx_net)

    def nnx_loss(p, x):
        return nnx.merge(graphdef, p)(x)

    multi_mesh = mm.MultiMesh(global_mesh=Mesh(np.array(jax.devices()).reshape(2, 4),
                                               ("stage", "x")))
    multi_mesh.register_task(r"/h_(\d+)", callback=lambda name, backprop: mm.Task(
        name=f"stage{name}", mesh_slice={"stage": int(name)}))
    placed = []
    with multi_mesh:
        for fun, params in ((lambda p, x: LinenNet().apply(p, x), linen_params),
                            (nnx_loss, nnx_params)):
            compiled = mm.mjit(jax.grad(fun)).lower(params, x).compile()
            grads = compiled(params, x)
            _assert_close(grads, jax.jit(jax.grad(fun))(params, x))
            placed.append({f["task"]: f["devices"] for f in compiled.fragments})
            kernels = [g for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]
                       if "kernel" in jax.tree_util.keystr(path)]
            assert [_ids(k) for k in kernels] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert placed[0] == placed[1] == {"stage0": [0, 1, 2, 3], "stage1": [4, 5, 6, 7]}


# --------------------------------------------------------------------------- pipelines


def _plain_accumulation(loss, params, n: int):
    """Plain jax: the loss and gradients summed over ``n`` microbatches of BATCH."""
    size = BATCH.shape[0] // n
    parts = [jax.jit(jax.value_and_grad(loss))(params, BATCH[size * k:size * (k + 1)])
             for k in range(n)]
    return (sum(v for v, _ in parts),
            jax.tree.map(lambda *g: sum(g), *[g for _, g in parts]))


# Each naming (a list of blocks, numbered attributes) with each stage count and
# schedule once: the other two pairings add no path that these miss.
@pytest.mark.parametrize("numbered,num_stages,schedule", [
    (False, 4, "1f1b"), (True, 2, "gpipe")], ids=["nnx_list-4-1f1b", "numbered-2-gpipe"])
def test_rules_alone_pipeline_an_unmodified_transformer(numbered, num_stages, schedule):
    model = _model(numbered)
    graphdef, params = nnx.split(model)

    def loss(p, b):
        return lm_loss(nnx.merge(graphdef, p), b)

    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=2, argnum=1, schedule=schedule)
    with mm.tasks(_stage_rules(num_stages, numbered)):
        compiled = mm.mjit(step).lower(params, BATCH).compile()
        value, grads = compiled(params, BATCH)

    want_value, want_grads = _plain_accumulation(loss, params, 4)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    _assert_close(grads, want_grads)
    stages = {f["task"]: f["devices"] for f in compiled.fragments if f["task"] != "mm_default"}
    assert stages == {f"stage{s}": _devices(num_stages, s) for s in range(num_stages)}
    assert compiled.schedule.labels() == build_schedule(
        pipeline_units(num_stages, 4), schedule).labels()
    in_params = compiled.input_shardings[0][0]
    for (path, g), (_, sh) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(in_params)):
        want = _devices(num_stages, _stage_of(path, num_stages))
        assert _ids(g.get_value()) == want, path
        sh = sh.get_value() if isinstance(sh, nnx.Variable) else sh  # State of shardings
        assert sorted(d.id for d in sh.device_set) == want, path


class LanguageModel(nnx.Module):
    """``parallelize_step`` wants ``model(batch) -> loss``: the loss around the GPT."""

    def __init__(self, gpt: GPT):
        self.gpt = gpt

    def __call__(self, batch):
        return lm_loss(self.gpt, batch)


def test_parallelize_step_pipelines_nnx_by_rules():
    """NNX ``parallelize_step(num_microbatches=...)``: one SGD step equals plain jax
    (mean over microbatches), every parameter on its stage's devices."""
    model = LanguageModel(_model(False))
    params0 = jax.device_get(nnx.state(model, nnx.Param))
    with mm.tasks(_stage_rules(2, False)):
        step, state, _ = parallelize_step(model, optax.sgd(0.5), global_batch=BATCH,
                                          num_microbatches=4, schedule="1f1b")
        loss, state = step(state, BATCH)

    graphdef, ref_params = nnx.split(LanguageModel(_model(False)), nnx.Param)

    def plain_loss(p, b):
        return nnx.merge(graphdef, p)(b)

    value, grads = _plain_accumulation(plain_loss, ref_params, 4)
    np.testing.assert_allclose(loss, value / 4, rtol=1e-5)
    want = jax.tree.map(lambda p, g: p - 0.5 * g / 4, params0, grads)
    got = nnx.state(state.model, nnx.Param)
    _assert_close(jax.device_get(got), want)
    assert step.compiled.schedule.labels() == build_schedule(
        pipeline_units(2, 4), "1f1b").labels()
    for path, v in nnx.to_flat_state(got):
        assert _ids(v.get_value()) == _devices(2, _stage_of(path[1:], 2)), path


# --------------------------------------------------------------------------- explicit mode

_EXPLICIT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, PartitionSpec as P
    from flax import nnx
    import multimesh.jax as mm
    from multimesh.jax.flax import mjit

    mesh = jax.make_mesh((2, 2, 2), ("stage", "fsdp", "tp"), axis_types=(AxisType.Explicit,) * 3)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.l0 = nnx.Linear(8, 16, kernel_init=nnx.with_partitioning(init, ("fsdp", "tp")),
                                 rngs=rngs)
            self.l1 = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return self.l1(jax.sharding.reshard(jax.nn.relu(self.l0(x)), P("fsdp", "tp")))

    def step(m, x):
        return nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(m)

    for i in (0, 1):
        mm.register_task(f"l{i}", task=mm.Task(mesh_slice={"stage": i}))
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
        x = jax.sharding.reshard(jnp.linspace(-1, 1, 64).reshape(8, 8), P("fsdp"))
        loss, grads = mjit(step)(model, x)
        want_loss, want_grads = nnx.jit(step)(model, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for (path, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads)):
        np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(w.get_value()),
                                   rtol=1e-5, atol=1e-6)
        stage = 0 if path[0] == "l0" else 1
        ids = sorted(d.id for d in g.get_value().devices())
        assert ids == list(range(4 * stage, 4 * stage + 4)), (path, ids)
    print("OK")
""")


def test_explicit_sharding_mode_runs_on_each_stage():
    """An NNX model written for explicit-sharding mode (``with_partitioning`` metadata,
    ``reshard``), placed by rules on mesh slices: each stage keeps the model's explicit
    shardings on its own devices, values and gradients as ``nnx.jit``'s (in a child
    process: it aborted the process in Shardy before)."""
    proc = subprocess.run([sys.executable, "-c", _EXPLICIT], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "OK" in proc.stdout, proc.stdout


def test_explicit_sharding_without_tasks_runs():
    """Under an explicit mesh a program with no task runs as before, equal to jax."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)

    def f(w, x):
        return jnp.tanh(jax.sharding.reshard(x @ w, P("fsdp", "tp"))).sum()

    w, x = jnp.linspace(-1, 1, 128).reshape(8, 16), jnp.ones((8, 8))
    with jax.set_mesh(mesh):
        got = mm.mjit(jax.value_and_grad(f))(w, x)
        want = jax.jit(jax.value_and_grad(f))(w, x)
    _assert_close(got, want)
