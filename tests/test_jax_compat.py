"""jax's own classes stay jax's (issue 37, item 10), and the jax-0.12 subset that
``.ci/run`` runs reaches every shim of ``multimesh/_src/jax_compat.py``.

A multimesh trace (``mjit``, a task's body) is a program of many meshes: jax's
``use_abstract_mesh`` may change the mesh's size there, in that thread only
(``jax_compat.many_meshes``). Outside, and in other threads meanwhile, it refuses as
jax's does, and its ``__enter__`` is jax's own function.
"""

from __future__ import annotations

import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import multimesh.jax as mm
from multimesh._src import jax_compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
JAX_ENTER = jax.sharding.use_abstract_mesh.__enter__  # jax's own, as imported
AUTO = AxisType.Auto


def _meshes():
    big = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AUTO,) * 3)
    small = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AUTO,) * 2,
                          devices=jax.devices()[:4])
    return big.abstract_mesh, small.abstract_mesh


def _change_size() -> None:
    """Enter a 4-device abstract mesh under an 8-device one (jax refuses)."""
    big, small = _meshes()
    with jax.sharding.use_abstract_mesh(big):
        with jax.sharding.use_abstract_mesh(small):
            assert jax.sharding.get_abstract_mesh() == small
        assert jax.sharding.get_abstract_mesh() == big


def _refused_in_a_thread() -> BaseException | None:
    box: list[BaseException | None] = [None]

    def run():
        try:
            _change_size()
        except BaseException as e:  # noqa: BLE001 (handed back to the test)
            box[0] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return box[0]


def test_use_abstract_mesh_is_jaxs_own_outside_multimesh_traces():
    with pytest.raises(ValueError, match="use_abstract_mesh cannot change the size of the mesh"):
        _change_size()
    seen = {}

    def body(x):
        # inside the trace, this thread: the program's meshes may differ in size
        _change_size()
        # another thread meanwhile: jax's check, unchanged
        seen["other thread"] = _refused_in_a_thread()
        return jnp.sin(x)

    stage = mm.task(body, name="s", mesh=mm.TaskMesh(devices=range(4)))
    out = mm.mjit(lambda x: stage(x) * 2)(jnp.arange(8.0))
    np.testing.assert_allclose(out, np.sin(np.arange(8.0)) * 2, rtol=1e-6)
    assert isinstance(seen["other thread"], ValueError), seen
    assert "cannot change the size of the mesh" in str(seen["other thread"])
    # after the program: jax's class as jax defined it, and its check
    assert jax.sharding.use_abstract_mesh.__enter__ is JAX_ENTER
    with pytest.raises(ValueError, match="use_abstract_mesh cannot change the size of the mesh"):
        _change_size()


def test_a_failed_trace_leaves_jaxs_class_alone():
    def body(x):
        raise RuntimeError("boom in the body")

    stage = mm.task(body, name="s", mesh=mm.TaskMesh(devices=range(4)))
    with pytest.raises(RuntimeError, match="boom in the body"):
        mm.mjit(stage)(jnp.arange(8.0))
    assert jax.sharding.use_abstract_mesh.__enter__ is JAX_ENTER
    with pytest.raises(ValueError, match="use_abstract_mesh cannot change the size of the mesh"):
        _change_size()


def test_mesh_scope_restores_both_meshes():
    big, small = _meshes()
    with jax.sharding.use_abstract_mesh(big):
        with jax_compat.mesh_scope(small):
            assert jax.sharding.get_abstract_mesh() == small
            assert jax_compat.concrete_mesh() is None
        assert jax.sharding.get_abstract_mesh() == big
    assert jax.sharding.get_abstract_mesh().empty


def test_a_microbatch_loop_nobody_reads_is_dropped_by_jaxs_dce():
    """``register_dce_rule``/``has_effects``: jax's DCE (whose rules take one more
    argument on 0.12) removes a loop whose outputs are unused and keeps one that is read."""
    from jax.interpreters import partial_eval as pe

    def f(w, x):
        s = mm.microbatch(lambda w, x: jnp.sum(x @ w), dim=0, size=2, argnum=1)(w, x)
        return s, x * 2

    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((8, 4)))
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["mm_microbatch", "mul"]
    dropped, used = pe.dce_jaxpr(closed.jaxpr, [False, True])
    assert [e.primitive.name for e in dropped.eqns] == ["mul"] and used == [False, True]
    kept, used = pe.dce_jaxpr(closed.jaxpr, [True, False])
    assert [e.primitive.name for e in kept.eqns] == ["mm_microbatch"] and used == [True, True]


# ----------------------------------------------------------------------------
# The jax-0.12 subset of .ci/run

SUBSET = ROOT / ".ci" / "jax012-tests.txt"

# Each public name of jax_compat, and a file of the subset that reaches it under jax
# 0.12.0.1, as `tools/jax_compat_coverage.py` measured (files run in-process) (docs/testing.md, "jax 0.12").
# Names read at import (the primitives' rules, the constants) are reached by every file;
# the multi-process ones in `python -m multimesh.launch`'s workers.
REACHED_BY = {
    # read or called when multimesh is imported: every file
    "JAX_VERSION": "tests/test_jax_compat.py",
    "register_call_primitive": "tests/test_jax_compat.py",
    "def_jit_impl": "tests/test_jax_compat.py",
    "register_dce_rule": "tests/test_jax_compat.py",
    "register_cache": "tests/test_jax_compat.py",
    "REUSE_INPUT": "tests/test_jax_compat.py",
    "ALWAYS_COPY": "tests/test_jax_compat.py",
    "ORDERED_EFFECTS": "tests/test_callbacks.py::test_ordered_callbacks_run_in_program_order",
    # measured
    "fresh_ir_context": "tests/test_jax_compat.py",
    "lower_call": "tests/test_jax_compat.py",
    "compile_module": "tests/test_jax_compat.py",
    "dispatcher": "tests/test_jax_compat.py",
    "shard_args": "tests/test_jax_compat.py",
    "array_impl_type": "tests/test_jax_compat.py",
    "concrete_mesh": "tests/test_jax_compat.py",
    "mesh_scope": "tests/test_jax_compat.py",
    "many_meshes": "tests/test_jax_compat.py",
    "unused_inputs": "tests/test_jax_compat.py",
    "linearize_call": "tests/test_jax_compat.py",
    "lowered_callbacks": "tests/test_jax_compat.py",
    "trace_context": "tests/test_jax_compat.py",
    "persistent_cache_on": "tests/test_jax_compat.py",
    "persistent_cache_hits": "tests/test_jax_compat.py",
    "has_effects": "tests/test_jax_compat.py",
    "device_assignment": "tests/test_jax_compat.py",
    "is_committed": "tests/test_jax_compat.py",
    "key_impl": "tests/test_jax_compat.py",
    "positional_effects": "tests/test_stage_sharding_microbatch.py",
    "in_config_of_caller": "tests/test_stage_sharding_microbatch.py",
    "separate_consts": "tests/test_stage_sharding_microbatch.py",
    "batched_copy": "tests/test_stage_sharding_microbatch.py",
    "device_list": "tests/test_stage_sharding_microbatch.py",
    "load_on_devices": "tests/test_stage_sharding_microbatch.py",
    "eqn_effects": "tests/test_microbatch.py",
    "staging": "tests/test_microbatch.py",
    "gspmd_sharding": "tests/test_import_gspmd.py",
    "sdy_mpmd_partitioner": "tests/test_shardy_mpmd.py",
    # in subprocesses: test_compile's second process, the launcher's workers
    "persistent_cache_settings": "tests/test_compile.py",
    "serialized_executable": "tests/test_compile.py",
    "distributed_client": "tests/test_multiprocess.py::test_readme_two_stage_two_processes",
    "cluster_env_base": "tests/test_multiprocess.py::test_readme_two_stage_two_processes",
    "backends_initialized": "tests/test_multiprocess.py::test_readme_two_stage_two_processes",
    "mesh_scope_depth": "tests/test_registered_taskmesh_rules.py",
    "name_scope_hook": "tests/test_registered_taskmesh_rules.py",
    "unbound_collective": "tests/test_stage_collectives.py",
    "shard_map_mesh_refused": "tests/test_stage_collectives.py",
}


def _subset() -> list[str]:
    lines = SUBSET.read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


DIRECT = jax_compat.JAX_VERSION < (0, 11)  # jax 0.10: a task linearized as it traces


def _spy_linearize(monkeypatch) -> list[bool]:
    """Whether each task bound under ``grad`` was linearized as it was traced."""
    got: list[bool] = []
    real = jax_compat.linearize_call

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        got.append(out is not None)
        return out
    monkeypatch.setattr(jax_compat, "linearize_call", spy)
    return got


def _two_submeshes():
    a = mm.TaskMesh(devices=(0, 1), axis_names=("x",), axis_sizes=(2,))
    b = mm.TaskMesh(devices=(2, 3), axis_names=("x",), axis_sizes=(2,))
    return a, b


def test_a_task_under_grad_is_traced_once_into_forward_and_tangent(monkeypatch):
    """Under ``grad`` on jax 0.10 a task's body is traced straight into its forward
    and tangent jaxprs (``jax_compat.linearize_call``), not traced and then evaluated
    again: values, gradients and where they live are plain jax's. A constant the
    body closes over (``scale``) reaches the backward as a constant."""
    got = _spy_linearize(monkeypatch)
    a, b = _two_submeshes()
    scale = np.linspace(0.5, 1.5, 8, dtype=np.float32)

    def layer(w, x):
        return jnp.sin(x @ w) * scale

    def loss_of(f1, f2):
        def loss(ws, x):
            return jnp.sum(f2(ws[1], f1(ws[0], x)) ** 2)
        return loss
    t1, t2 = mm.task(layer, name="l1", mesh=a), mm.task(layer, name="l2", mesh=b)
    ws = [jnp.eye(8) * 0.3 + 0.01 * k for k in range(2)]
    x = jnp.arange(32.0).reshape(4, 8) / 32
    loss, grads = mm.mjit(jax.value_and_grad(loss_of(t1, t2)))(ws, x)
    want_loss, want = jax.value_and_grad(loss_of(layer, layer))(ws, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert got == [DIRECT, DIRECT]
    assert {d.id for d in grads[0].devices()} <= {0, 1}
    assert {d.id for d in grads[1].devices()} <= {2, 3}


@pytest.mark.parametrize("transform", ["grad of grad", "vmap of grad"])
def test_tasks_traced_once_keep_every_kind_of_output(monkeypatch, transform):
    """A task linearized as it traces, with an integer output, an input passed through
    and a constant output, under a second transformation around ``grad``: values as
    plain jax's."""
    got = _spy_linearize(monkeypatch)
    a, b = _two_submeshes()

    def body(w, x, n):
        return jnp.sin(x @ w), n + 1, x, jnp.ones(3)

    def head(y):
        return (y ** 3).sum()

    def loss_of(f, g):
        def loss(w, x):
            y, n, same, c = f(w, x, jnp.int32(3))
            return g(y) + (same * 0.5).sum() + c.sum() * n
        return loss

    if transform == "grad of grad":
        def wrap(f):
            return jax.grad(lambda w, x: jax.grad(f)(w, x).sum())
    else:
        def wrap(f):
            return jax.vmap(jax.grad(f), in_axes=(None, 0))
    w = jnp.eye(4) * 0.7 + 0.05
    x = jnp.arange(8.0).reshape(2, 4) / 8
    x = x if transform == "grad of grad" else jnp.stack([x, 2 * x])
    ours = mm.mjit(wrap(loss_of(mm.task(body, name="a", mesh=a),
                                 mm.task(head, name="b", mesh=b))))(w, x)
    np.testing.assert_allclose(ours, wrap(loss_of(body, head))(w, x), rtol=1e-5, atol=1e-6)
    assert got == [DIRECT, DIRECT]


def test_a_task_closing_over_a_traced_value_is_traced_plainly(monkeypatch):
    """A body that closes over a value of the trace around it (``w``, a parameter the
    gradient is taken of) takes the plain path, so that value's tangent is kept: the
    gradient is plain jax's, not zero."""
    got = _spy_linearize(monkeypatch)
    a, _ = _two_submeshes()

    def loss(w, x):
        t = mm.task(lambda x: jnp.tanh(x @ w), name="closes", mesh=a)
        return jnp.sum(t(x) ** 2)

    def plain(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)
    w, x = jnp.eye(4) * 0.5, jnp.arange(8.0).reshape(2, 4) / 8
    g = mm.mjit(jax.grad(loss))(w, x)
    np.testing.assert_allclose(g, jax.grad(plain)(w, x), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(g).sum()) > 0
    assert got == [False]


def test_the_private_attribute_shims_agree_with_public_jax():
    """The shims that read jax's private attributes (``tests/test_layering.py`` keeps
    every such read here) give what jax's public API shows, in every supported version."""
    devs = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devs[:4])[::-1].reshape(2, 2), ("a", "b"))
    s = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
    assert jax_compat.device_assignment(s) == tuple(mesh.devices.flat)  # its order, not ids'
    x = jnp.arange(4.0)
    assert not jax_compat.is_committed(x)  # left on jax's default device
    assert jax_compat.is_committed(jax.device_put(x, devs[1]))
    assert not jax_compat.is_committed(np.arange(4.0)) and not jax_compat.is_committed(None)
    key = jax.random.key(3, impl="rbg")
    impl = jax_compat.key_impl(key.dtype)
    again = jax.random.wrap_key_data(jax.random.key_data(key), impl=impl)
    assert again.dtype == key.dtype and jnp.array_equal(jax.random.key_data(again),
                                                        jax.random.key_data(key))


def test_the_jax012_subset_reaches_every_shim():
    subset = _subset()
    assert len(subset) == len(set(subset)), subset
    for path in subset:
        file, _, test = path.partition("::")
        assert (ROOT / file).is_file(), f"{SUBSET.name} names {file}, which does not exist"
        assert not test or f"def {test}(" in (ROOT / file).read_text(), path
    public = set(jax_compat.__all__)
    missing = sorted(public - set(REACHED_BY))
    assert not missing, (f"jax_compat's {missing} are reached by no file of the jax-0.12 "
                         f"subset: measure with tools/jax_compat_coverage.py, add a file to "
                         f"{SUBSET.name} if needed, and name it in REACHED_BY")
    assert not set(REACHED_BY) - public, sorted(set(REACHED_BY) - public)
    outside = sorted({f for f in REACHED_BY.values() if f not in subset})
    assert not outside, f"REACHED_BY names files {SUBSET.name} does not run: {outside}"
    defined = {n for n, v in vars(jax_compat).items()
               if not n.startswith("_") and getattr(v, "__module__", None) == jax_compat.__name__
               and callable(v)}
    assert defined <= public, f"public shims not in jax_compat.__all__: {sorted(defined - public)}"


def test_the_readme_shows_what_ci_runs():
    """README "Set-up": its test command is the first one .ci/run runs, and its jax-0.12
    install and test commands are the ones .ci/run runs after it."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    first = ".venv/bin/python -m pytest -q -x -n 2 --dist loadfile --durations=15"
    assert f"```bash\n{first}\n```" in readme
    ci_tests = [ln for ln in ci.splitlines() if " -m pytest " in ln]
    assert ci_tests[0].startswith(first + " ||"), ci_tests
    for shared in (".venv-jax012/bin/pip install -e '.[test,flax]' 'jax==0.12.0.1' "
                   "'jaxlib==0.12.0.1'",
                   ".venv-jax012/bin/python -m pytest -q -x -n 2 --dist loadfile "
                   "--durations=15"):
        assert shared in readme and shared in ci.replace("pip install -q", "pip install"), \
            shared
    assert ci_tests[1].startswith(".venv-jax012/bin/python -m pytest"), ci_tests
    assert ci.index(first) < ci.index(".venv-jax012")
