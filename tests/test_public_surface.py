"""The public surface: error classes by name, named results of ``parallelize`` and
``parallelize_step`` in every form, cache inspection, the per-process plan."""

from __future__ import annotations

import builtins
import copy
import inspect
import re
import typing
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
import multimesh.jax.errors as mm_errors
from multimesh._src import errors as src_errors
from multimesh.jax import flax as mmf
from tests.error_catalogue import ENTRIES

ROOT = Path(__file__).resolve().parent.parent


def _ids(a) -> list[int]:
    return sorted(d.id for d in a.devices())


def _mesh4(first: int) -> mm.TaskMesh:
    return mm.TaskMesh(devices=range(first, first + 4), axis_names=("x",), axis_sizes=(4,))


# --------------------------------------------------------------------------- errors


def _documented_classes() -> list[str]:
    """Every error or warning class a page of docs/ (or the README) names, except
    Python's builtins and jax's own."""
    names: set[str] = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        names |= set(re.findall(r"\b[A-Z][A-Za-z]*(?:Error|Warning|Failure)\b", page.read_text()))
    names -= set(dir(builtins)) | {"JaxRuntimeError"}
    section = (ROOT / "docs" / "errors.md").read_text().split("## Error classes", 1)[1]
    assert set(re.findall(r"^- `(\w+)\(", section, re.M)) <= names
    return sorted(names)


@pytest.mark.parametrize("name", _documented_classes())
def test_every_documented_class_is_importable_from_multimesh_jax_errors(name):
    cls = getattr(mm_errors, name)
    assert issubclass(cls, (mm_errors.MultimeshError, mm_errors.MultimeshWarning))
    assert getattr(mm.errors, name) is cls


def test_every_error_class_of_the_library_is_public():
    """Classes defined in ``_src/errors.py``, and every class the error catalogue
    checks for, are all in ``multimesh.jax.errors`` under their own names."""
    defined = {n for n, c in inspect.getmembers(src_errors, inspect.isclass)
               if c.__module__ == src_errors.__name__}
    raised = {e.exc.__name__ for e in ENTRIES if e.exc is not None}
    public = {n for n in dir(mm_errors) if not n.startswith("_")}
    assert defined <= public and raised <= public, (defined - public, raised - public)
    for name in public:
        assert getattr(mm_errors, name).__name__ == name


def _library_modules() -> list[str]:
    """Every module of the library, by the name it is imported under."""
    names = []
    for path in sorted((ROOT / "multimesh").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(p for p in parts if p != "__init__"))
    return names


def _subclasses(cls) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_every_error_class_anywhere_in_the_library_is_public():
    """Any ``MultimeshError`` or ``MultimeshWarning`` subclass that a library module
    defines (not only those in ``_src/errors.py``) is in ``multimesh.jax.errors``, as
    jax's ``jax.errors`` names jax's; a private (``_``) class is a signal, not an error."""
    import importlib

    for name in _library_modules():
        importlib.import_module(name)
    classes = {c for base in (mm_errors.MultimeshError, mm_errors.MultimeshWarning)
               for c in _subclasses(base)
               if c.__module__.startswith("multimesh.") and not c.__name__.startswith("_")}
    assert {"ScheduleError", "SourceError", "PassFailure"} <= {c.__name__ for c in classes}
    missing = sorted(f"{c.__module__}.{c.__name__}" for c in classes
                     if getattr(mm_errors, c.__name__, None) is not c)
    assert not missing, f"not re-exported by multimesh.jax.errors: {missing}"


def test_errors_are_caught_by_their_builtin_and_public_class():
    with pytest.raises(mm_errors.MeshError) as ei:
        mm.TaskMesh(devices=range(6), axis_names=("x", "y"), axis_sizes=(2, 2))
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, mm_errors.MultimeshError)
    from multimesh.passes.schedules import ScheduleError, build_schedule, pipeline_units

    assert mm_errors.ScheduleError is ScheduleError
    with pytest.raises(mm_errors.ScheduleError, match="custom_schedule"):
        build_schedule(pipeline_units(2, 2), "custom", custom=[["nope"], ["nope"]])


# --------------------------------------------------------------------------- parallelize


def _two_stage_model():
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=_mesh4(0),
                 logical_axes=(("batch", "x"),))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=_mesh4(4),
                 logical_axes=(("batch", "x"),))

    def model(params, batch):
        batch = mm.with_sharding_constraint(batch, P("batch", None))
        return s1(params[1], s0(params[0], batch))

    def plain(params, batch):
        return jnp.tanh(jnp.tanh(batch @ params[0]) @ params[1])

    def init_params():
        k0, k1 = jax.random.split(jax.random.key(0))
        return (jax.random.normal(k0, (8, 8)), jax.random.normal(k1, (8, 8)))

    def get_input_batch():
        return jnp.arange(64.0).reshape(8, 8) / 64

    return model, plain, init_params, get_input_batch


def test_parallelize_with_get_input_batch_unpacks_as_three():
    model, plain, init_params, get_input_batch = _two_stage_model()
    res = mm.parallelize(model, init_params=init_params, get_input_batch=get_input_batch)
    assert isinstance(res, mm.ParallelizeResult) and isinstance(res, tuple) and len(res) == 3
    sharded_fun, init_sharded_params, get_sharded_batch = res
    assert (sharded_fun, init_sharded_params, get_sharded_batch) == \
        (res.sharded_fun, res.init_sharded_params, res.get_sharded_batch)
    params, batch = init_sharded_params(), get_sharded_batch()
    assert _ids(params[0]) == [0, 1, 2, 3] and _ids(params[1]) == [4, 5, 6, 7]
    assert _ids(batch) == [0, 1, 2, 3]
    out = sharded_fun(params, batch)
    np.testing.assert_allclose(out, jax.jit(plain)(init_params(), get_input_batch()),
                               rtol=1e-5, atol=1e-6)
    assert _ids(out) == [4, 5, 6, 7]
    assert repr(res).startswith("ParallelizeResult(sharded_fun=")
    assert list(res._asdict()) == ["sharded_fun", "init_sharded_params", "get_sharded_batch"]
    assert copy.copy(res) == res and len(copy.copy(res)) == 3


def test_parallelize_with_initial_batch_unpacks_as_two_and_keeps_every_field():
    model, plain, init_params, get_input_batch = _two_stage_model()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    example = jax.device_put(get_input_batch(), jax.sharding.NamedSharding(mesh, P("d")))
    res = mm.parallelize(model, init_params=init_params, initial_batch=example)
    assert len(res) == 2
    sharded_fun, init_sharded_params = res
    assert res.sharded_fun is sharded_fun and res.init_sharded_params is init_sharded_params
    batch = res.get_sharded_batch()  # the initial batch, where the program reads it
    assert batch.sharding.is_equivalent_to(example.sharding, 2)
    np.testing.assert_array_equal(batch, example)
    out = sharded_fun(init_sharded_params(), batch)
    np.testing.assert_allclose(out, jax.jit(plain)(init_params(), get_input_batch()),
                               rtol=1e-5, atol=1e-6)
    assert _ids(out) == [4, 5, 6, 7]
    assert "get_sharded_batch" not in repr(res)  # the repr shows the tuple's form


# --------------------------------------------------------------------------- parallelize_step


class LinenTwoStage(nn.Module):
    tasks: bool = True

    @nn.compact
    def __call__(self, x):
        w0 = self.param("w0", nn.initializers.normal(0.5), (6, 6))
        w1 = self.param("w1", nn.initializers.normal(0.5), (6, 6))

        def layer(w, x):
            return jnp.tanh(x @ w)

        s0 = mm.task(layer, name="s0", mesh=_mesh4(0)) if self.tasks else layer
        s1 = mm.task(layer, name="s1", mesh=_mesh4(4)) if self.tasks else layer
        return (s1(w1, s0(w0, x)) ** 2).mean()


def _plain_linen_step(x):
    model = LinenTwoStage(tasks=False)
    state = TrainState.create(apply_fn=model.apply,
                              params=model.init(jax.random.key(42), x)["params"],
                              tx=optax.sgd(0.1))
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: state.apply_fn({"params": p}, x)))(state.params)
    return loss, state.apply_gradients(grads=grads)


def _check_linen_step(step_fn, state, batch, x):
    assert _ids(state.params["w0"]) == [0, 1, 2, 3]
    assert _ids(state.params["w1"]) == [4, 5, 6, 7]
    loss, new = step_fn(state, batch)
    ref_loss, ref_new = _plain_linen_step(x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for k in ("w0", "w1"):
        np.testing.assert_allclose(new.params[k], ref_new.params[k],
                                   rtol=1e-5, atol=1e-6)
    assert _ids(new.params["w1"]) == [4, 5, 6, 7]


def test_parallelize_step_linen_global_batch_unpacks_as_three():
    x = jnp.linspace(-1, 1, 48).reshape(8, 6)
    res = mmf.parallelize_step(LinenTwoStage(), optax.sgd(0.1), global_batch=x)
    assert isinstance(res, mmf.ParallelizeStepResult) and len(res) == 3
    step_fn, state, mesh = res
    assert (res.step_fn, res.state, res.mesh) == (step_fn, state, mesh)
    assert mesh.devices.size == 8
    batch = res.prepare_batch(np.asarray(x))  # present in this form too
    np.testing.assert_array_equal(batch, x)
    _check_linen_step(step_fn, state, batch, x)


def test_parallelize_step_linen_local_batch_unpacks_as_four():
    x = jnp.linspace(-1, 1, 48).reshape(8, 6)
    res = mmf.parallelize_step(LinenTwoStage(), optax.sgd(0.1), local_batch=x)
    assert len(res) == 4
    step_fn, state, mesh, prepare_batch = res
    assert res.prepare_batch is prepare_batch and res.state is state
    assert list(res._asdict()) == ["step_fn", "state", "mesh", "prepare_batch"]
    _check_linen_step(step_fn, state, prepare_batch(x), x)


class NnxTwoStage(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, tasks: bool = True):
        self.w0 = nnx.Param(0.5 * jax.random.normal(rngs.params(), (6, 6)))
        self.w1 = nnx.Param(0.5 * jax.random.normal(rngs.params(), (6, 6)))
        self.tasks = tasks

    def __call__(self, x):
        def layer(w, x):
            return jnp.tanh(x @ w)

        s0 = mm.task(layer, name="s0", mesh=_mesh4(0)) if self.tasks else layer
        s1 = mm.task(layer, name="s1", mesh=_mesh4(4)) if self.tasks else layer
        return (s1(self.w1[...], s0(self.w0[...], x)) ** 2).mean()


def _plain_nnx_loss(x):
    ref = NnxTwoStage(nnx.Rngs(0), tasks=False)
    opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(m, o, x):
        loss, grads = nnx.value_and_grad(lambda m: m(x))(m)
        o.update(m, grads)
        return loss

    return step(ref, opt, x), ref


@pytest.mark.parametrize("form", ["global_batch", "local_batch"])
def test_parallelize_step_nnx_forms(form):
    x = jnp.linspace(-1, 1, 48).reshape(8, 6)
    model = NnxTwoStage(nnx.Rngs(0))
    res = mmf.parallelize_step(model, optax.sgd(0.1), **{form: x})
    assert isinstance(res, mmf.ParallelizeStepResult)
    assert len(res) == (3 if form == "global_batch" else 4)
    step_fn, state, mesh = res[:3]
    assert res.step_fn is step_fn and res.state is state and res.mesh is mesh
    loss, state = step_fn(state, res.prepare_batch(x))
    ref_loss, ref = _plain_nnx_loss(x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(model.w1[...], ref.w1[...], rtol=1e-5, atol=1e-6)
    assert _ids(model.w0[...]) == [0, 1, 2, 3] and _ids(model.w1[...]) == [4, 5, 6, 7]


# --------------------------------------------------------------------------- caches


def test_cache_info_and_clearing():
    model, plain, init_params, get_input_batch = _two_stage_model()
    params, batch = init_params(), get_input_batch()
    mm.clear_caches()
    f = mm.mjit(model)
    assert f.cache_info().currsize == 0
    f(params, batch)
    out = f(params, batch)
    info = f.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 1, 1), info
    every = mm.cache_info()
    assert isinstance(every, mm.CachesInfo) and every.programs.currsize >= 1
    assert every.fragments.currsize >= 2  # s0 and s1, shared by every program
    f.clear_cache()  # this function's programs; the fragments stay
    assert f.cache_info().currsize == 0 and mm.cache_info().fragments.currsize >= 2
    again = f(params, batch)
    assert f.cache_info().misses == 1 and mm.cache_info().fragments.hits >= 2
    mm.clear_caches()
    assert f.cache_info().currsize == 0 and mm.cache_info().fragments.currsize == 0
    last = f(params, batch)
    for y in (out, again, last):
        np.testing.assert_allclose(y, jax.jit(plain)(params, batch), rtol=1e-5, atol=1e-6)
        assert _ids(y) == [4, 5, 6, 7]


def test_jax_clear_caches_clears_what_cache_info_counts():
    f = mm.mjit(lambda x: x * 2)
    y = f(jnp.arange(4.0))
    np.testing.assert_array_equal(y, [0, 2, 4, 6])
    assert _ids(y) == list(range(8))  # no task: the program's devices
    assert f.cache_info().currsize == 1
    jax.clear_caches()
    assert f.cache_info().currsize == 0 and mm.cache_info().fragments.currsize == 0


def test_process_plan_is_none_in_one_process():
    model, _, init_params, get_input_batch = _two_stage_model()
    compiled = mm.mjit(model).lower(init_params(), get_input_batch()).compile()
    assert compiled.process_plan() is None
    assert "s1_fwd" in compiled.plan()


def test_nnx_mjit_cache_info_and_clear_cache():
    """``multimesh.jax.flax.mjit`` functions count and forget their programs too."""
    model = NnxTwoStage(nnx.Rngs(0))
    ref = NnxTwoStage(nnx.Rngs(0), tasks=False)
    x = jnp.linspace(-1, 1, 48).reshape(8, 6)
    f = mmf.mjit(lambda m, x: m(x))
    first, second = f(model, x), f(model, x)
    info = f.cache_info()
    assert (info.hits, info.misses, info.currsize) == (1, 1, 1), info
    f.clear_cache()
    assert f.cache_info().currsize == 0
    third = f(model, x)
    for y in (first, second, third):
        np.testing.assert_allclose(float(y), float(ref(x)), rtol=1e-5)
    assert f.cache_info().misses == 1 and f.cache_info().currsize == 1
    assert _ids(third) == [4, 5, 6, 7]  # the loss is computed by the last stage


def test_schedule_cost_names_are_public():
    """Issue 23: the cost and schedule-advice API, from ``multimesh.jax``."""
    from multimesh.jax._analysis import costs as _costs

    for name in ("DeviceModel", "StepProfile", "compare_schedules", "xla_costs",
                 "residual_bytes"):
        assert getattr(mm, name) is getattr(_costs, name)
    assert "schedule-costs.md" in (ROOT / "README.md").read_text()
    from multimesh.jax._stages.compiled import MpmdCompiled

    assert callable(MpmdCompiled.step_profile)


def test_both_comparisons_are_public_under_their_own_names():
    """Issue 32: ``compare_schedules`` answers a ``ScheduleComparison`` (schedules on one
    program), ``PipelinePlan.compare`` a ``StageComparison`` (predicted vs measured per
    stage); once two classes both named ``Comparison``."""
    from multimesh.jax._planner._plan import PipelinePlan
    from multimesh.schedules.costs import compare

    assert mm.ScheduleComparison.__name__ == "ScheduleComparison"
    assert mm.StageComparison.__name__ == "StageComparison"
    assert mm.ScheduleComparison is not mm.StageComparison
    assert typing.get_type_hints(compare)["return"] is mm.ScheduleComparison
    assert typing.get_type_hints(mm.compare_schedules)["return"] is mm.ScheduleComparison
    assert typing.get_type_hints(PipelinePlan.compare)["return"] is mm.StageComparison


def test_planner_is_public():
    assert mm.plan_pipeline.__module__ == "multimesh.jax._planner._api"
    assert mm.PipelinePlan.__name__ == "PipelinePlan"
    assert callable(mm.PipelinePlan.from_json)
    params = {"w0": jnp.eye(4), "w1": jnp.eye(4)}

    def loss(p, x):
        with jax.named_scope("a"):
            x = x @ p["w0"]
        with jax.named_scope("b"):
            return (x @ p["w1"]).sum()

    plan = mm.plan_pipeline(loss, params, jnp.ones((8, 4)), num_stages=2,
                            num_microbatches=2)
    assert isinstance(plan, mm.PipelinePlan)
    assert [s.units for s in plan.stages] == [("a",), ("b",)]
    assert [s.devices for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
