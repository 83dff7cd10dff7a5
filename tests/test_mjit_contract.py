"""``mjit`` is ``jax.jit`` for MPMD: every option and stage method, against jax.jit.

Each test runs a two-submesh program (tasks on devices 0-3 and 4-7), compares its
values with ``jax.jit`` of the same function (``ignore_transforms``: plain jax) and
checks where the outputs live. The NNX half trains a small MLP with both spellings
of ``mjit`` against ``nnx.jit``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh._src.errors import (
    MultimeshAttributeError,
    MultimeshTypeError,
    MultimeshValueError,
)
from multimesh.runtime import executor


def _stage(k):
    def body(w, x):
        return jnp.tanh(mm.with_sharding_constraint(x, P("batch", None)) @ w)

    mesh = mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))
    return mm.task(body, name=f"stage{k}", mesh=mesh, logical_axes=(("batch", "x"),))


STAGES = [_stage(0), _stage(1)]
WS = [jnp.eye(16) * 0.5, jnp.eye(16) * 0.7 + 0.01]
X = jnp.linspace(-1, 1, 8 * 16).reshape(8, 16)


def model(ws, x, scale=1.0):
    for s, w in zip(STAGES, ws):
        x = s(w, x)
    return x * scale


def _ids(a) -> list[int]:
    return sorted(d.id for d in a.devices())


def _plain(fun, *args, **kwargs):
    """What ``jax.jit`` gives for the same function and options."""
    with mm.ignore_transforms():
        return jax.jit(fun, **kwargs)(*args)


# --------------------------------------------------------------------------- options


def test_static_argnames_by_keyword_and_by_position():
    f = mm.mjit(model, static_argnames="scale")
    want = _plain(lambda ws, x: model(ws, x, 3.0), WS, X)
    for out in (f(WS, X, scale=3.0), f(WS, X, 3.0)):
        np.testing.assert_allclose(out, want, rtol=1e-6)
        assert _ids(out) == [4, 5, 6, 7]
    assert len(f._cache) == 2  # by keyword and by position: two call signatures
    np.testing.assert_allclose(f(WS, X, scale=2.0), want * 2 / 3, rtol=1e-6)


def test_static_argnums_infers_the_name_as_jax_does():
    f = mm.mjit(model, static_argnums=2)
    assert f.options.static_argnames == jax.jit(model, static_argnums=2)._jit_info.static_argnames
    out = f(WS, X, scale=3.0)  # given by keyword: static through its inferred name
    np.testing.assert_allclose(out, _plain(lambda ws, x: model(ws, x, 3.0), WS, X), rtol=1e-6)
    assert f.trace(WS, X, scale=3.0).jaxpr.in_avals == f.trace(WS, X).jaxpr.in_avals


def test_negative_static_index_is_static_only():
    f = mm.mjit(model, static_argnums=-1)
    traced = f.trace(WS, X, 3.0)
    assert len(traced.jaxpr.in_avals) == 3  # two weights and x: the scale is folded in
    out = f(WS, X, 3.0)
    np.testing.assert_allclose(out, _plain(model, WS, X, 3.0, static_argnums=-1), rtol=1e-6)
    assert _ids(out) == [4, 5, 6, 7]


def test_donate_argnames_deletes_the_donated_keyword_argument():
    def step(ws, x):
        return [w - 0.1 * g for w, g in zip(ws, jax.grad(lambda v: model(v, x).sum())(ws))]

    f = mm.mjit(step, donate_argnames="ws")
    assert f.options.donate_argnums == (0,)
    want = _plain(step, WS, X)
    # Where the program reads them (a donated input moved elsewhere first is a copy).
    where = f.lower(ws=WS, x=X).compile().input_shardings[1]["ws"]
    ws = jax.device_put([w.copy() for w in WS], where)
    out = f(ws=ws, x=X)
    assert all(w.is_deleted() for w in ws)
    for o, w, stage in zip(out, want, (0, 1)):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-7)
        assert _ids(o) == list(range(4 * stage, 4 * stage + 4))
    kept = jax.device_put([w.copy() for w in WS], where)
    f(kept, X)  # donate_argnums was inferred from the name: donated by position too
    assert all(w.is_deleted() for w in kept)
    assert not any(w.is_deleted() for w in WS)


def test_keep_unused_reports_input_shardings_as_jax():
    def f(ws, unused, x):
        return model(ws, x)

    y = jnp.ones(3)
    with mm.ignore_transforms():  # jax's own answer, tasks as plain calls
        jax_in = jax.jit(f).lower(WS, y, X).compile().input_shardings[0]
    assert jax_in[1] is None  # what keep_unused=False means for jax
    c = mm.mjit(f).lower(WS, y, X).compile()
    assert c.input_shardings[0][1] is None
    np.testing.assert_allclose(c(WS, y, X), _plain(f, WS, y, X), rtol=1e-6)
    kept = mm.mjit(f, keep_unused=True).lower(WS, y, X).compile().input_shardings[0][1]
    assert isinstance(kept, NamedSharding)
    with mm.ignore_transforms():
        assert jax.jit(f, keep_unused=True).lower(WS, y, X).compile().input_shardings[0][1]


def test_in_shardings_cover_the_dynamic_arguments_as_jax():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    rows = NamedSharding(mesh, P("d", None))
    f = mm.mjit(model, static_argnums=2, in_shardings=[None, rows])  # no entry for `scale`
    c = f.lower(WS, X, 2.0).compile()
    assert c.input_shardings[0][1].is_equivalent_to(rows, 2)
    out = c(WS, X)  # as jax's Compiled: the dynamic arguments only
    np.testing.assert_allclose(out, _plain(model, WS, X, 2.0, static_argnums=2), rtol=1e-6)
    assert _ids(out) == [4, 5, 6, 7]
    with pytest.raises(MultimeshValueError, match="prefix"):
        mm.mjit(model, static_argnums=2, in_shardings=(None, rows, None))(WS, X, 2.0)


def test_out_shardings_logical_and_physical():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    rows = NamedSharding(mesh, P("d", None))
    want = _plain(model, WS, X)
    # logical: the task producing the output resolves "batch" on its own submesh
    out = mm.mjit(model, out_shardings=P("batch", None))(WS, X)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert _ids(out) == [4, 5, 6, 7] and out.sharding.spec == P("x", None)
    # physical (no task maps "d"): the output is returned on it, as jax.jit returns it
    c = mm.mjit(model, out_shardings=rows).lower(WS, X).compile()
    out = c(WS, X)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert out.sharding.is_equivalent_to(rows, 2) and c.output_shardings == rows
    plain = mm.mjit(lambda w, x: jnp.tanh(x @ w), out_shardings=rows)  # the fast path too
    assert plain.lower(WS[0], X).compile().fast_path
    out = plain(WS[0], X)
    assert out.sharding.is_equivalent_to(rows, 2)
    np.testing.assert_allclose(out, jnp.tanh(X @ WS[0]), rtol=1e-6)


def test_decorator_form():
    @mm.mjit(static_argnames="scale")
    def g(ws, x, scale):
        return model(ws, x, scale)

    np.testing.assert_allclose(g(WS, X, scale=2.0), _plain(model, WS, X, 2.0), rtol=1e-6)
    assert g.__name__ == "g" and g.__wrapped__.__name__ == "g"


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(static_argnums=3), MultimeshValueError, r"static_argnums=\(3,\) names argument 3, "
     r"but `model` takes 3 positional arguments \(valid indices are -3\.\.2\)"),
    (dict(donate_argnums=-4), MultimeshValueError, r"names argument -4"),
    (dict(static_argnums=(1, -2)), MultimeshValueError, r"names the same argument twice"),
    (dict(static_argnames=("scale", "scale")), MultimeshValueError, r"twice"),
    (dict(static_argnames="sclae"), MultimeshValueError,
     r"'sclae', which is not one of its parameters.*\['ws', 'x', 'scale'\]"),
    (dict(static_argnums=2, donate_argnames="scale"), MultimeshValueError,
     r"both static and donated"),
    (dict(static_argnums=True), MultimeshTypeError, r"int or a sequence of ints"),
    (dict(static_argnames=1), MultimeshTypeError, r"str or a sequence of str"),
    (dict(device=jax.devices()[0]), MultimeshValueError, r"device=.*`devices=` or `mesh=`"),
    (dict(backend="cpu"), MultimeshValueError, r"backend="),
    (dict(inline=True), MultimeshValueError, r"inline=True"),
    (dict(compiler_options={"xla_cpu_enable_fast_math": True}), MultimeshValueError,
     r"compiler_options=.*XLA_FLAGS"),
])
def test_bad_options_are_rejected_when_mjit_is_called(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        mm.mjit(model, **kwargs)


def test_positional_only_name_and_call_time_checks():
    def pos_only(a, /, b):
        return a + b

    with pytest.raises(MultimeshValueError, match="positional-only"):
        mm.mjit(pos_only, static_argnames="a")
    with pytest.raises(MultimeshTypeError, match=r"static argument 'scale' must be hashable"):
        mm.mjit(model, static_argnames="scale")(WS, X, scale=[2.0])

    def varargs(*xs):
        return xs[0]

    with pytest.raises(MultimeshValueError, match=r"names argument 2, but the function was "
                       r"called with 1 positional argument"):
        mm.mjit(varargs, static_argnums=2)(X)
    with pytest.raises(MultimeshValueError, match="both static .* and donated"):
        mm.mjit(varargs, static_argnums=-1, donate_argnums=1)(X, X)


# --------------------------------------------------------------------------- stages


def test_trace_eval_shape_and_lower_compare_with_jax():
    f = mm.mjit(model, static_argnums=2)
    compiles = len(executor._COMPILE_CACHE)
    want = jax.jit(model, static_argnums=2).trace(WS, X, 2.0)
    assert f.eval_shape(WS, X, 2.0) == jax.jit(model, static_argnums=2).eval_shape(WS, X, 2.0)
    traced = f.trace(WS, X, 2.0)
    assert traced.out_info == want.out_info
    assert traced.in_avals == tuple(want.jaxpr.in_avals)
    assert len(executor._COMPILE_CACHE) == compiles and len(f._cache) == 0  # nothing compiled
    out = traced.lower().compile()(WS, X)
    np.testing.assert_allclose(out, _plain(model, WS, X, 2.0, static_argnums=2), rtol=1e-6)
    assert _ids(out) == [4, 5, 6, 7]
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (WS, X))
    assert f.lower(*abstract, 2.0).compile().fragments  # lowers from shapes alone


def test_stage_attributes_jax_has_and_multimesh_does_not_offer():
    lowered = mm.mjit(model).lower(WS, X)
    with pytest.raises(MultimeshAttributeError, match=r"compile\(\)\.cost_analysis\(\)"):
        lowered.cost_analysis()
    assert not hasattr(lowered, "args_info")  # an AttributeError, as hasattr expects
    with pytest.raises(MultimeshValueError, match="dialect='hlo'"):
        lowered.compiler_ir("hlo")
    assert "stablehlo" in str(lowered.compiler_ir("stablehlo"))
    compiled = lowered.compile()
    with pytest.raises(AttributeError, match="one XLA executable per fragment"):
        compiled.runtime_executable()
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        compiled.nonsense  # noqa: B018
    with pytest.raises(MultimeshValueError, match="compiler_options"):
        lowered.compile({"xla_cpu_enable_fast_math": True})


def test_analyses_sum_the_fragments():
    compiled = mm.mjit(model).lower(WS, X).compile()
    names = {f["name"] for f in compiled.fragments}
    per_cost = compiled.cost_analysis(by_fragment=True)
    per_mem = compiled.memory_analysis(by_fragment=True)
    assert set(per_cost) == set(per_mem) == names == {"stage0_fwd", "stage1_fwd"}
    total = compiled.cost_analysis()
    assert total["flops"] == sum(c["flops"] for c in per_cost.values()) > 0
    mem = compiled.memory_analysis()
    for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"):
        assert getattr(mem, field) == sum(getattr(m, field) for m in per_mem.values())


def test_one_fragment_analyses_equal_jax_jit_on_the_same_submesh():
    """A single task's fragment is the same SPMD computation jax.jit compiles."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    rows, rep = NamedSharding(mesh, P("x", None)), NamedSharding(mesh, P())
    ref = jax.jit(lambda w, x: jnp.tanh(x @ w), in_shardings=(rep, rows),
                  out_shardings=rows).lower(WS[0], X).compile()
    ours = mm.mjit(lambda w, x: STAGES[0](w, x)).lower(WS[0], X).compile()
    assert ours.cost_analysis()["flops"] == ref.cost_analysis()["flops"]
    for field in ("argument_size_in_bytes", "output_size_in_bytes"):
        assert getattr(ours.memory_analysis(), field) == getattr(ref.memory_analysis(), field)


def test_fast_path_analyses():
    compiled = mm.mjit(lambda w, x: jnp.tanh(x @ w)).lower(WS[0], X).compile()
    assert compiled.fast_path
    ref = jax.jit(lambda w, x: jnp.tanh(x @ w)).lower(WS[0], X).compile()
    assert compiled.cost_analysis()["flops"] == ref.cost_analysis()["flops"]
    assert set(compiled.memory_analysis(by_fragment=True)) == {"main"}


def test_clear_cache():
    f = mm.mjit(model)
    f(WS, X)
    assert len(f._cache) == 1
    f.clear_cache()
    assert len(f._cache) == 0


def test_mjit_does_not_import_flax():
    code = textwrap.dedent("""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax.numpy as jnp
        import multimesh.jax as mm
        mesh = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x",), axis_sizes=(4,))
        t = mm.task(lambda a: a * 2, name="t", mesh=mesh)
        print(float(mm.mjit(lambda a: t(a).sum())(jnp.ones(8))), "flax" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["16.0", "False"]


def test_mjit_takes_nnx_objects_without_the_flax_wing_imported():
    """A program that imported ``flax.nnx`` but never ``multimesh.jax.flax``: ``mjit``
    still takes NNX objects (the composition root's handler loads the wing on demand)
    and writes their updates back as ``nnx.jit`` does; a linen class given to the core
    ``task`` is the Flax task there too."""
    pytest.importorskip("flax")
    code = textwrap.dedent("""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax.numpy as jnp
        from flax import nnx
        import multimesh.jax as mm
        print("multimesh.jax.flax" in sys.modules)
        class Counter(nnx.Module):
            def __init__(self):
                self.count = nnx.Variable(jnp.zeros(()))
                self.w = nnx.Param(jnp.arange(4.0))
        def step(m, x):
            m.count.value = m.count.value + 1
            return (m.w.value * x).sum()
        got_m, want_m = Counter(), Counter()
        want = nnx.jit(step)(want_m, jnp.ones(4))
        got = mm.mjit(step)(got_m, jnp.ones(4))
        print(float(got), float(want), float(got_m.count.value), float(want_m.count.value))
        print("multimesh.jax.flax" in sys.modules)
        from flax import linen as nn
        class Dense(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(x)
        print(mm.task(Dense, name="d").__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[:3] == ["False", "6.0 6.0 1.0 1.0", "True"], out.stdout
    assert lines[3].startswith("Task"), out.stdout


def test_linen_apply_tasks_do_not_load_the_flax_wing():
    """A linen program whose tasks are ``module.apply`` (plain functions) never loads
    the flax wing, nor ``flax.nnx`` with it (a restart would pay for importing them);
    a linen class given to ``task`` still loads it and is the Flax task."""
    pytest.importorskip("flax")
    code = textwrap.dedent("""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp
        from flax import linen as nn
        import multimesh.jax as mm
        class Dense(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(2)(x)
        d = Dense()
        p = d.init(jax.random.key(0), jnp.ones((4, 3)))
        mesh = mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,))
        t = mm.task(d.apply, name="t", mesh=mesh)
        loss = lambda p, x: t(p, x).sum()
        got = mm.mjit(jax.grad(loss))(p, jnp.ones((4, 3)))
        want = jax.grad(lambda p, x: d.apply(p, x).sum())(p, jnp.ones((4, 3)))
        print(bool(jax.tree.all(jax.tree.map(jnp.allclose, got, want))),
              "flax.nnx" in sys.modules, "multimesh.jax.flax" in sys.modules)
        print(mm.task(Dense, name="d").__name__, "multimesh.jax.flax" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert lines[0] == "True False False", out.stdout
    assert lines[1].startswith("Task") and lines[1].endswith("True"), out.stdout


# --------------------------------------------------------------------------- NNX: one mjit


@pytest.fixture(scope="module")
def nnx_kit():
    """flax.nnx, optax and a two-task MLP (tasks on devices 0-3 and 4-7)."""
    pytest.importorskip("flax")
    optax = pytest.importorskip("optax")
    from flax import nnx

    import multimesh.jax.flax as mmf

    class MLP(nnx.Module):
        def __init__(self, rngs, tasks=True):
            layers = [nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)]
            if tasks:
                layers = [mmf.task(m, name=f"layer{i}", mesh=_submesh(i))
                          for i, m in enumerate(layers)]
            self.layers = nnx.List(layers)

        def __call__(self, x):
            return self.layers[1](jax.nn.relu(self.layers[0](x)))

    return nnx, optax, mmf, MLP


def _submesh(i):
    return mm.TaskMesh(devices=range(4 * i, 4 * i + 4), axis_names=("x",), axis_sizes=(4,))


def _train_step(model, optimizer, x, scale):
    from flax import nnx

    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2) * scale)(model)
    optimizer.update(model, grads)
    return loss


XN = jax.random.normal(jax.random.key(1), (8, 8))


def _params(nnx, model):
    return [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def _train(nnx, optax, MLP, make_step, tasks=True, steps=3):
    model = MLP(nnx.Rngs(0), tasks=tasks)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_step(_train_step)
    return [float(step(model, opt, XN, 2.0)) for _ in range(steps)], model, opt


def test_both_mjits_train_nnx_like_nnx_jit(nnx_kit):
    nnx, optax, mmf, MLP = nnx_kit
    assert mmf.mjit is mm.mjit and mmf.nnx_mjit is mm.mjit  # one implementation
    want, ref, ref_opt = _train(nnx, optax, MLP, lambda f: nnx.jit(f, static_argnums=3),
                                tasks=False)
    for mjit in (mm.mjit, mmf.mjit):
        got, model, opt = _train(nnx, optax, MLP, lambda f, j=mjit: j(f, static_argnums=3))
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for g, w in zip(_params(nnx, model), _params(nnx, ref)):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert int(opt.step.get_value()) == int(ref_opt.step.get_value()) == 3
        got_opt, want_opt = jax.tree.leaves(nnx.state(opt)), jax.tree.leaves(nnx.state(ref_opt))
        assert len(got_opt) == len(want_opt) > 8  # adam's mu and nu for each parameter
        for g, w in zip(got_opt, want_opt):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
        for i, layer in enumerate(model.layers):  # each layer's state on its submesh
            assert _ids(layer.kernel.get_value()) == list(range(4 * i, 4 * i + 4))
        mu = nnx.state(opt)["opt_state"][0]["mu"]["layers"][1]["kernel"]
        assert _ids(mu.get_value()) == [4, 5, 6, 7]


def test_nnx_donation_negative_static_and_argnames(nnx_kit):
    nnx, optax, _, MLP = nnx_kit
    want, ref, _ = _train(nnx, optax, MLP, lambda f: nnx.jit(f, static_argnums=-1),
                          tasks=False, steps=2)
    model = MLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = mm.mjit(_train_step, static_argnums=-1, donate_argnames=("model", "optimizer"))
    assert step.options.donate_argnums == (0, 1)
    traced = step.trace(model, opt, XN, 2.0)
    n_state = len(jax.tree.leaves(nnx.state((model, opt))))
    assert len(traced.jaxpr.in_avals) == n_state + 1  # the Variables and x; not the scale
    got = []
    for _ in range(2):
        before = [model.layers[0].kernel.get_value(), opt.step.get_value()]
        got.append(float(step(model, opt, XN, 2.0)))
        assert all(b.is_deleted() for b in before)  # donated: buffers reused
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(_params(nnx, model), _params(nnx, ref)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_nnx_static_argnames_and_eval_shape(nnx_kit):
    nnx, _, _, MLP = nnx_kit
    model = MLP(nnx.Rngs(0))
    ref = MLP(nnx.Rngs(0), tasks=False)

    def apply(m, x, *, act):
        return getattr(jax.nn, act)(m(x))

    f = mm.mjit(apply, static_argnames="act")
    kernel = model.layers[0].kernel.get_value()
    assert f.eval_shape(model, XN, act="relu") == jax.ShapeDtypeStruct((8, 4), jnp.float32)
    assert model.layers[0].kernel.get_value() is kernel  # eval_shape changed nothing
    for act in ("relu", "tanh"):
        out = f(model, XN, act=act)
        np.testing.assert_allclose(out, nnx.jit(apply, static_argnames="act")(ref, XN, act=act),
                                   rtol=1e-5, atol=1e-6)
        assert _ids(out) == [4, 5, 6, 7]
    compiled = f.lower(model, XN, act="tanh").compile()
    want = nnx.jit(apply, static_argnames="act")(ref, XN, act="tanh")
    np.testing.assert_allclose(compiled(model, XN), want, rtol=1e-5, atol=1e-6)  # as jax's
    np.testing.assert_allclose(compiled(model, XN, act="tanh"), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(MultimeshValueError, match="static arguments"):
        compiled(model, XN, act="relu")
    lowered = f.lower(model, XN, act="tanh")
    assert "stablehlo" in str(lowered.compiler_ir())
    with pytest.raises(MultimeshAttributeError, match="cost_analysis"):
        lowered.cost_analysis()
    assert compiled.cost_analysis()["flops"] == sum(
        c["flops"] for c in compiled.cost_analysis(by_fragment=True).values()) > 0
    assert compiled.memory_analysis().argument_size_in_bytes > 0


def test_nnx_shardings_must_be_logical(nnx_kit):
    nnx, _, _, MLP = nnx_kit
    rows = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P("d", None))
    f = mm.mjit(lambda m, x: m(x), in_shardings=(None, rows))
    with pytest.raises(MultimeshValueError, match=r"in_shardings entry .* names mesh axes "
                       r"\['d'\] that no task of the program maps"):
        f(MLP(nnx.Rngs(0)), XN)


def test_unused_committed_argument_reuses_the_program():
    def f(ws, unused, x):
        return model(ws, x)

    g = mm.mjit(f)
    g(WS, jnp.ones(3), X)
    y = jax.device_put(jnp.ones(3), jax.devices()[5])  # committed, but never read
    np.testing.assert_allclose(g(WS, y, X), _plain(f, WS, y, X), rtol=1e-6)
    assert list(map(id, g._placed.values())) == list(map(id, g._cache.values()))
