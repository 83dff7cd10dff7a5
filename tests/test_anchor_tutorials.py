"""The MultiMesh tutorials E1-E6 (shared/reference/multimesh-anchor.md §3), run as written.

Each test is the anchor's program, bar the plugin initialisation (``init(cpus=8)``:
the root conftest gives 8 CPU devices; E6's ``init(cpus=2)`` is the first two of
them). What it prints is compared with what the anchor prints: the sharding lines
(mesh axes and PartitionSpec, ignoring jax-version details such as ``axis_types``,
``memory_kind`` and trailing ``None``s) and the device -> block layout of every
``visualize_array_sharding`` box (labels ``MULTIMESH i`` read as ``CPU i``). Numbers
are checked against plain JAX (or plain Flax) on the same program.
"""

from __future__ import annotations

import ast
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax import (
    MultiMesh,
    Task,
    TaskMesh,
    clear_tasks,
    mjit,
    parallelize,
    register_task,
    task,
    with_sharding_constraint,
)

# --------------------------------------------------------------------------- printing

_SHARDING = re.compile(
    r"NamedSharding\(mesh=Mesh\((?P<axes>[^()]*?)(?:, axis_types=\([^()]*\))?\), "
    r"spec=(?:PartitionSpec|P)\((?P<spec>[^()]*)\)(?:, memory_kind=\w+)?\)")


def _spec(text: str) -> tuple:
    text = text.strip().rstrip(",")
    entries = list(ast.literal_eval(f"({text},)")) if text else []
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _line(line: str) -> str:
    """A printed line with each NamedSharding reduced to its mesh axes and spec."""
    return _SHARDING.sub(
        lambda m: f"NamedSharding(Mesh({m['axes']}), P{_spec(m['spec'])!r})", line.strip())


def _box(lines: list[str]) -> tuple:
    """A visualize_array_sharding box as its rows of device labels."""
    rows = []
    for ln in lines:
        if not ln.startswith("│"):
            continue
        cells = [c.strip() for c in ln.strip().strip("│").split("│")]
        if any(cells):
            rows.append(tuple(c.replace("MULTIMESH", "CPU") for c in cells))
    return ("box", tuple(rows))


def parse(text: str) -> list:
    """Printed output as a list of normalised lines and boxes."""
    out, box = [], None
    for ln in text.splitlines():
        s = ln.strip()
        if not s:
            continue
        if s[0] in "┌│├└":
            box = (box or []) + [s]
            if s[0] == "└":
                out.append(_box(box))
                box = None
            continue
        out.append(_line(s))
    return out


def rows(*labels) -> tuple:
    """An expected box: one row per entry, a row of several cells as a tuple."""
    return ("box", tuple((r,) if isinstance(r, str) else tuple(r) for r in labels))


def ids(*d) -> str:
    return "CPU " + ",".join(str(i) for i in d)


# The anchor's boxes (§3 "Exact visualize_array_sharding strings").
V1 = rows(*[ids(i) for i in range(8)])
V2 = rows(ids(*range(8)))
V3 = rows(*[ids(i) for i in range(4)])
V4 = rows([ids(i) for i in range(4, 8)])
V5 = rows(ids(0, 2), ids(1, 3))
V6 = rows([ids(4, 6), ids(5, 7)])
V7_LOW, V7_HIGH = rows(ids(0, 1, 2, 3)), rows(ids(4, 5, 6, 7))
V8 = V3
V9 = rows(*[ids(i) for i in range(4, 8)])


def expect(*items) -> list:
    return [i if isinstance(i, tuple) else _line(i) for i in items]


def device_ids(x) -> list[int]:
    return sorted(d.id for d in x.devices())


# --------------------------------------------------------------------------- E1, E2, E5 model


def f(param, x):
    return jnp.einsum("bm,mh->bh", x, param)


def get_input_batch():
    return jnp.arange(64).reshape(8, 8)


def init_params():
    return jnp.arange(64).reshape(8, 8), jnp.arange(64).reshape(8, 8)


def inspect(x):
    print(x.shape, x.sharding)


def plain_result():
    p1, p2 = init_params()
    return np.asarray(f(p2, f(p1, get_input_batch())))


def test_e1_spmd_autosharding(capsys):
    # 1. Plain JAX with explicit shardings.
    def model(params, x):
        param_1, param_2 = params
        x = f(param_1, x)
        return f(param_2, x)

    mesh = Mesh(np.array(jax.devices()), ("x",))
    input_sharding = NamedSharding(mesh, P("x", None))
    param_sharding = NamedSharding(mesh, P("x", None))
    batch = jax.jit(get_input_batch, out_shardings=input_sharding)()
    params = jax.jit(init_params, out_shardings=(param_sharding, param_sharding))()
    print("Input")
    jax.tree.map(inspect, batch)
    print("Params")
    jax.tree.map(inspect, params)
    jax.debug.visualize_array_sharding(batch, use_color=False)
    sharded_model = jax.jit(model, in_shardings=((param_sharding, param_sharding), input_sharding))
    output = sharded_model(params, batch)
    np.testing.assert_array_equal(np.asarray(output), plain_result())
    line = "(8, 8) NamedSharding(mesh=Mesh('x': 8), spec=PartitionSpec('x', None))"
    assert parse(capsys.readouterr().out) == expect("Input", line, "Params", line, line, V1)

    # 2. Logical constraints, no task: every array replicated on all devices.
    def model(params, x):  # noqa: F811
        x = with_sharding_constraint(x, P("batch", None))
        param_1, param_2 = params
        param_1 = with_sharding_constraint(param_1, P("model", None))
        param_2 = with_sharding_constraint(param_2, P(None, "model"))
        x = f(param_1, x)
        x = f(param_2, x)
        return with_sharding_constraint(x, P("batch", None))

    sharded_model, init_sharded_params, get_sharded_batch = parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch)
    batch = get_sharded_batch()
    params = init_sharded_params()
    print("Input")
    jax.tree.map(inspect, batch)
    print("Params")
    jax.tree.map(inspect, params)
    jax.debug.visualize_array_sharding(batch, use_color=False)
    np.testing.assert_array_equal(np.asarray(sharded_model(params, batch)), plain_result())
    line = "(8, 8) NamedSharding(mesh=Mesh('x': 8), spec=PartitionSpec())"
    assert parse(capsys.readouterr().out) == expect("Input", line, "Params", line, line, V2)

    # 3. One task over all 8 devices.
    task_mesh = TaskMesh(devices=range(0, 8), axis_names=("x",), axis_sizes=(8,))
    mm_model = task(model, mesh=task_mesh, logical_axes=(("batch", "x"), ("model", "x")))
    sharded_model, init_sharded_params, get_sharded_batch = parallelize(
        mm_model, init_params=init_params, get_input_batch=get_input_batch)
    batch = get_sharded_batch()
    params = init_sharded_params()
    print("Input")
    jax.tree.map(inspect, batch)
    print("Params")
    jax.tree.map(inspect, params)
    jax.debug.visualize_array_sharding(batch, use_color=False)
    np.testing.assert_array_equal(np.asarray(sharded_model(params, batch)), plain_result())
    assert parse(capsys.readouterr().out) == expect(
        "Input", "(8, 8) NamedSharding(mesh=Mesh('x': 8), spec=PartitionSpec('x',))",
        "Params", "(8, 8) NamedSharding(mesh=Mesh('x': 8), spec=PartitionSpec('x',))",
        "(8, 8) NamedSharding(mesh=Mesh('x': 8), spec=PartitionSpec(None, 'x'))", V1)

    # 4. Appendix: an initial batch with its own sharding.
    example_batch = jax.jit(lambda: jnp.arange(64).reshape(8, 8),
                            out_shardings=NamedSharding(mesh, P("x", None)))()
    result = parallelize(mm_model, init_params=init_params, initial_batch=example_batch)
    assert len(result) == 2
    compiled, init_sharded_params = result
    assert compiled.input_shardings[0][1].is_equivalent_to(example_batch.sharding, 2)
    out = compiled(init_sharded_params(), example_batch)
    np.testing.assert_array_equal(np.asarray(out), plain_result())


def _e2_model():
    task_mesh = TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    layer1 = task(f, mesh=task_mesh, logical_axes=(("batch", "x"), ("model", "x")))
    layer2 = task(f, mesh=task_mesh.place((4, 5, 6, 7)),
                  logical_axes=(("batch", "x"), ("model", "x")))

    def model(params, x):
        param_1, param_2 = params
        x = with_sharding_constraint(x, P("batch", None))
        param_1 = with_sharding_constraint(param_1, P("model", None))
        param_2 = with_sharding_constraint(param_2, P(None, "model"))
        x = layer1(param_1, x)
        x = layer2(param_2, x)
        return with_sharding_constraint(x, P("batch", None))

    return model


def test_e2_mpmd_autosharding(capsys):
    # The same function wrapped twice, with its default name `f` both times.
    model = _e2_model()
    sharded_model, init_sharded_params, get_sharded_batch = parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch)
    param_1, param_2 = init_sharded_params()
    jax.debug.visualize_array_sharding(param_1, use_color=False)
    jax.debug.visualize_array_sharding(param_2, use_color=False)
    batch = get_sharded_batch()
    jax.debug.visualize_array_sharding(batch, use_color=False)
    assert parse(capsys.readouterr().out) == [V3, V4, V3]

    out = sharded_model((param_1, param_2), batch)
    np.testing.assert_array_equal(np.asarray(out), plain_result())
    assert device_ids(out) == [4, 5, 6, 7]
    frags = {(fr["task"], fr["direction"]): fr["devices"] for fr in sharded_model.fragments}
    assert frags == {("f", "fwd"): [0, 1, 2, 3], ("f.1", "fwd"): [4, 5, 6, 7]}

    # Appendix: a batch over all 8 devices; parallelize reshards it 8 -> 4.
    mesh = Mesh(np.array(jax.devices()), ("x",))
    example_batch = jax.jit(lambda: jnp.arange(64).reshape(8, 8),
                            out_shardings=NamedSharding(mesh, P("x", None)))()
    jax.debug.visualize_array_sharding(example_batch, use_color=False)
    assert parse(capsys.readouterr().out) == [V1]
    compiled, init_sharded_params = parallelize(
        model, init_params=init_params, initial_batch=example_batch)
    assert compiled.input_shardings[0][1] == example_batch.sharding
    assert compiled.transfers, compiled.plan()  # the batch moves onto devices 0-3
    out = compiled(init_sharded_params(), example_batch)
    np.testing.assert_array_equal(np.asarray(out), plain_result())


def test_e2_gradients_match_plain_jax():
    model = _e2_model()
    params = tuple(p.astype(jnp.float32) / 64 for p in init_params())
    batch = get_input_batch().astype(jnp.float32) / 64

    def loss(params, x):
        return jnp.sum(model(params, x) ** 2)

    value, grads = mjit(jax.value_and_grad(loss))(params, batch)
    with mm.ignore_transforms():
        ref_value, ref_grads = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for g, r, want in zip(grads, ref_grads, ([0, 1, 2, 3], [4, 5, 6, 7])):
        np.testing.assert_allclose(g, r, rtol=1e-5)
        assert device_ids(g) == want


# --------------------------------------------------------------------------- E3, E4 (Flax)

nn = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")


def _flax_inspect(x):
    print(x.shape)
    if x.ndim > 0:
        jax.debug.visualize_array_sharding(x, use_color=False)
    else:
        print("REPLICATED", x.sharding)


E3_STATE = expect(
    "()",
    "REPLICATED NamedSharding(mesh=Mesh('x': 8, 'y': 1, axis_types=(Auto, Auto)), "
    "spec=PartitionSpec(), memory_kind=unpinned_host)",
    "(4,)", V7_LOW, "(16, 4)", V8, "(4,)", V7_HIGH, "(4, 4)", V9)


def _one_step(model, x, capsys):
    """The tutorials' training step: parallelize_step, then one step inside `with mesh:`."""
    from multimesh.jax.flax import parallelize_step

    opt = optax.sgd(learning_rate=0.02)
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("x", "y"))
    step_fn, state, mesh, prepare_batch = parallelize_step(
        model=model, optimizer=opt, mesh=mesh, local_batch=x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` (jax 0.10)
        with mesh:
            batch = prepare_batch(x)
            loss, state = step_fn(state, batch)
    print("Loss = ", loss)
    jax.tree.map(_flax_inspect, state)
    printed = parse(capsys.readouterr().out)
    assert printed[0] == "Loss =  " + str(loss)
    return float(loss), state, printed[1:]


def _plain_flax_loss(model, x):
    """The same module in plain Flax: parameters from jax.random.key(42), one loss."""
    from flax.training.train_state import TrainState

    with mm.ignore_transforms():
        variables = jax.jit(model.init)(jax.random.key(42), x)
        state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                                  tx=optax.sgd(learning_rate=0.02))
        return float(jax.jit(state.apply_fn)({"params": state.params}, x)), state


def test_e3_flax_mpmd(capsys):
    from multimesh.jax.flax import shard_axes
    from multimesh.jax.flax import task as flax_task
    from multimesh.jax.flax import with_sharding_constraint as flax_wsc

    class MLPBlock(nn.Module):
        features: int = 4

        @nn.compact
        def __call__(self, x):
            x = flax_wsc(x, P("batch"))
            x = nn.Dense(self.features, kernel_init=shard_axes("data", "model"))(x)
            return nn.relu(x)

    class Pipeline(nn.Module):
        n_layers: int = 2
        shape: tuple = (4, 1)
        axes: tuple = ("x", "y")
        axis_map: tuple = (("batch", "x"), ("data", "x"), ("model", "y"))

        def submesh(self, layer):
            return TaskMesh(devices=range(layer * 4, layer * 4 + 4), axis_names=self.axes,
                            axis_sizes=self.shape)

        @nn.compact
        def __call__(self, x):
            for i in range(self.n_layers):
                x = flax_task(MLPBlock, mesh=self.submesh(i), name=f"layer_{i}",
                              logical_axes=self.axis_map)()(x)
            return (x * x).sum()

    x = jnp.arange(16)
    loss, state, printed = _one_step(Pipeline(), x, capsys)
    assert printed == E3_STATE

    # The anchor's parameter tree: unnamed Task[MLPBlock] modules, their variables in
    # one parameter `mod`; the multimesh task names (layer_i) are not module names.
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nn.meta.unbox(state.params))[0]]
    assert paths == [f"['Task[MLPBlock]_{i}']['mod']['params']['Dense_0']['{n}']"
                     for i in range(2) for n in ("bias", "kernel")]

    # The published loss is plain Flax's for the same naming (anchor §3 E3).
    class PlainBlock(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_partitioning(nn.initializers.xavier_normal(), ("data", "model"))
            return nn.relu(nn.Dense(4, kernel_init=init)(x))

    class PlainTask(nn.Module):
        @nn.compact
        def __call__(self, x):
            inner = PlainBlock(parent=None)
            return inner.apply(self.param("mod", lambda rng: inner.init(rng, x)), x)

    PlainTask.__name__ = "Task[MLPBlock]"

    class PlainPipeline(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = PlainTask()(x)
            return (x * x).sum()

    ref_loss, ref_state = _plain_flax_loss(PlainPipeline(), x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    # After one sgd step the parameters are plain Flax's after one step too.
    grads = jax.grad(lambda p: ref_state.apply_fn({"params": p}, x))(ref_state.params)
    want = ref_state.apply_gradients(grads=grads)
    for got, ref in zip(jax.tree.leaves(nn.meta.unbox(state.params)),
                        jax.tree.leaves(nn.meta.unbox(want.params))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)

    # Naming the modules layer_i (what multimesh did before) gives other numbers: the
    # comparison above can fail.
    class NamedPipeline(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(2):
                x = PlainTask(name=f"layer_{i}")(x)
            return (x * x).sum()

    assert not np.isclose(_plain_flax_loss(NamedPipeline(), x)[0], loss, rtol=1e-3)


def test_e4_implicit_flax_tasks(capsys, monkeypatch):
    from functools import partial

    # MultiMesh's plugin init makes jax.lax.with_sharding_constraint the logical one,
    # and this tutorial relies on it.
    monkeypatch.setattr(jax.lax, "with_sharding_constraint", mm.with_sharding_constraint)
    init_shard = partial(nn.with_partitioning, fn=nn.initializers.xavier_normal())

    class MLPBlock(nn.Module):
        features: int = 4

        @nn.compact
        def __call__(self, x):
            x = jax.lax.with_sharding_constraint(x, P("batch"))
            x = nn.Dense(self.features, kernel_init=init_shard(names=("data", "model")))(x)
            return nn.relu(x)

    class Pipeline(nn.Module):
        n_layers: int = 2

        @nn.compact
        def __call__(self, x):
            for i in range(self.n_layers):
                x = MLPBlock(name=f"layer_{i}")(x)
            return (x * x).sum()

    x = jnp.arange(16)
    axis_map = [("batch", "x"), ("data", "x"), ("model", "y")]
    task_mesh = TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    try:
        register_task("layer_0", task=Task(mesh=task_mesh, logical_axes=axis_map))
        register_task("layer_1", task=Task(mesh=task_mesh.place((4, 5, 6, 7)),
                                           logical_axes=axis_map))
        loss, state, printed = _one_step(Pipeline(), x, capsys)
        assert printed == E3_STATE

        # Advanced: dynamic device lists from a callback.
        clear_tasks()

        def callback(name, backprop):
            layer = int(name.split("_")[1])
            mesh = TaskMesh(devices=range(4 * layer, 4 * layer + 4), axis_names=("x", "y"),
                            axis_sizes=(4, 1))
            return Task(name=f"layer_{layer}", mesh=mesh, logical_axes=axis_map)

        register_task(r"(layer_\d+)", callback=callback)
        loss2, _, printed2 = _one_step(Pipeline(), x, capsys)
        assert printed2 == E3_STATE
    finally:
        clear_tasks()
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nn.meta.unbox(state.params))[0]]
    assert paths == [f"['layer_{i}']['Dense_0']['{n}']"
                     for i in range(2) for n in ("bias", "kernel")]
    ref_loss, _ = _plain_flax_loss(Pipeline(), x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(loss2, ref_loss, rtol=1e-5)


# --------------------------------------------------------------------------- E5, E6


def test_e5_mpmd_multimesh(capsys):
    def model(params, x):
        param_1, param_2 = params
        x = with_sharding_constraint(x, P("batch", None))
        param_1 = with_sharding_constraint(param_1, P("model", None))
        param_2 = with_sharding_constraint(param_2, P(None, "model"))
        with jax.named_scope("layer0"):
            x = f(param_1, x)
        with jax.named_scope("layer1"):
            x = f(param_2, x)
        return with_sharding_constraint(x, P("batch", None))

    global_mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("stage", "batch", "model"))
    multi_mesh = MultiMesh(global_mesh=global_mesh)

    def callback(name, backprop):
        layer = int(re.search(r"layer(\d+)", name).group(1))
        return Task(name=f"layer{layer}_" + ("bwd" if backprop else "fwd"),
                    mesh_slice={"stage": layer})

    multi_mesh.register_task(r"layer\d+", callback=callback)
    with multi_mesh:
        sharded_model, init_sharded_params, get_sharded_batch = parallelize(
            model, init_params=init_params, get_input_batch=get_input_batch)
    param_1, param_2 = init_sharded_params()
    jax.debug.visualize_array_sharding(param_1, use_color=False)
    jax.debug.visualize_array_sharding(param_2, use_color=False)
    assert parse(capsys.readouterr().out) == [V5, V6]
    out = sharded_model((param_1, param_2), get_sharded_batch())
    np.testing.assert_array_equal(np.asarray(out), plain_result())
    assert device_ids(out) == [4, 5, 6, 7]


def test_e6_hello_world():
    all_devices = jax.devices()[:2]  # init(cpus=2)

    def f(x):
        return jnp.cos(x), jnp.sin(x)

    def g(x, y):
        return x * x + y * y

    c = jax.jit(lambda x: g(*f(x)))
    result = c(jnp.arange(8))
    np.testing.assert_allclose(
        result, [1.0, 0.99999994, 0.99999994, 1.0, 1.0, 1.0, 0.99999994, 1.0], atol=1e-6)
    assert result.devices() == {jax.devices()[0]}
    mesh = Mesh(np.array(all_devices), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    batch = jax.jit(jnp.arange, out_shardings=sharding, static_argnums=0)(8)
    assert c(batch).devices() == set(all_devices)

    # MPMD: f on the first device, g on the second (the v0.2 spelling of
    # task(f, devices=all_devices[0:1])).
    mm_f = task(f, mesh=TaskMesh(devices=(0,), axis_names=("x",), axis_sizes=(1,)))
    mm_g = task(g, mesh=TaskMesh(devices=(1,), axis_names=("x",), axis_sizes=(1,)))
    mm_c = mjit(lambda x: mm_g(*mm_f(x)), devices=all_devices, in_shardings=(sharding,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `with mesh:` (jax 0.10)
        with mesh:
            batch = mjit(jnp.arange, devices=all_devices, out_shardings=sharding,
                         static_argnums=0)(8)
            out = mm_c(batch)
    assert out.devices() == {jax.devices()[1]}
    np.testing.assert_allclose(out, g(*f(jnp.arange(8))), rtol=1e-6)
