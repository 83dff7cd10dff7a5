"""``jax.shard_map`` with collectives inside pipeline stages (issue 37, item 4).

Two stages of 2x2 devices on a global mesh ``("stage", "data", "model") = (2, 2, 2)``,
each running a ``shard_map`` over the stage's kept axes with a ``psum``, an
``all_gather`` or a ``ppermute``. The stages are placed four ways: registered rules
(``register_task`` with ``Task(mesh_slice=...)``, and a callback returning
``TaskMesh`` tasks), and explicit tasks (``task(..., mesh_slice=...)``,
``task(..., mesh=TaskMesh(...))``). Every stage is traced under its own mesh (a
registered one through the name-scope hook, as an explicit task's body), so its
``shard_map`` is traced and lowered on the stage's 2x2 mesh; a collective over the
sliced ``stage`` axis, or a ``shard_map`` naming another mesh, is an error while
tracing. (The renumbering of ``multimesh/passes/_collectives.py`` remains for a
``shard_map`` traced on another mesh: a registered stage under ``Explicit`` axes, in
the error catalogue.) Every case is compared with ``jax.jit`` of the same program on a
2x2 stage mesh: value and gradients (rtol 1e-5), and where each gradient lives and how
it is sharded.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.layouts import flops_of as _flops
from tests.layouts import global_mesh as _global_mesh
from tests.layouts import spec_of as _spec
from tests.layouts import stage_mesh as _stage_mesh

AUTO = AxisType.Auto
# (in_specs, out_spec, local body) per collective. The ppermute rotates the rows over
# the four devices of ("data", "model"), so two stages rotate by two: the weighted loss
# below tells a rotation from none.
COLLECTIVES = {
    "psum": ((P("model", None), P("data", "model")), P("data", None),
             lambda w, x: jax.lax.psum(x @ w, "model")),
    "all_gather": ((P(None, "model"), P("data", "model")), P("data", "model"),
                   lambda w, x: jax.lax.all_gather(x, "model", axis=1, tiled=True) @ w),
    "ppermute": ((P(None, None), P(("data", "model"), None)), P(("data", "model"), None),
                 lambda w, x: jax.lax.ppermute(x @ w, ("data", "model"),
                                               perm=[(i, (i + 1) % 4) for i in range(4)])),
}
PLACEMENTS = ["registered-mesh_slice", "registered-TaskMesh", "mesh_slice", "TaskMesh"]


def _body(coll: str, check_vma: bool = True):
    in_specs, out_spec, local = COLLECTIVES[coll]

    def body(w, x):
        return jnp.tanh(jax.shard_map(local, in_specs=in_specs, out_specs=out_spec,
                                      check_vma=check_vma)(w, x))
    return body


def _layers(body):
    """Two layers named ``l0``/``l1`` in the name stack, for registered rules."""
    def layer(k):
        def f(w, x):
            with jax.named_scope(f"l{k}"):
                return body(w, x)
        return f
    return [layer(0), layer(1)]


def _task_meshes():
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("data", "model"), axis_sizes=(2, 2))
    return m0, m0.place((4, 5, 6, 7))


@contextlib.contextmanager
def _placed(body, placement: str):
    """The two stages of ``body`` placed as ``placement`` says, under the global mesh."""
    mm.clear_tasks()
    try:
        if placement == "registered-mesh_slice":
            for k in range(2):
                mm.register_task(f"l{k}", task=mm.Task(mesh_slice={"stage": k}))
            stages = _layers(body)
        elif placement == "registered-TaskMesh":
            meshes = dict(zip(("l0", "l1"), _task_meshes(), strict=True))
            mm.register_task(r"(l\d)", callback=lambda name, bwd: mm.Task(mesh=meshes[name]))
            stages = _layers(body)
        elif placement == "mesh_slice":
            stages = [mm.task(body, name=f"s{k}", mesh_slice={"stage": k}) for k in range(2)]
        else:
            stages = [mm.task(body, name=f"s{k}", mesh=m)
                      for k, m in enumerate(_task_meshes())]
        with jax.set_mesh(_global_mesh()):
            yield stages
    finally:
        mm.clear_tasks()


ROW_WEIGHTS = jnp.arange(1.0, 5.0)[:, None]


def _loss_of(stages):
    def loss(ws, x):
        return jnp.sum(stages[1](ws[1], stages[0](ws[0], x)) ** 2 * ROW_WEIGHTS)
    return loss


def _inputs():
    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    return (w, 0.5 * w), x


def _reference(body, ws, x):
    with jax.set_mesh(_stage_mesh()):
        return jax.jit(jax.value_and_grad(_loss_of([body, body])))(ws, x)


def _assert_as_jax(got, ref, *, devices: bool = True, layout: bool = True):
    """``got = (value, grads)`` equal ``jax.jit``'s ``ref``; with ``devices``, stage k's
    gradient lives on devices 4k..4k+3; with ``layout``, it is split as ``ref``'s."""
    (value, grads), (ref_value, ref_grads) = got, ref
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for k in range(2):
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(ref_grads[k]),
                                   rtol=1e-5, atol=1e-6)
        if devices:
            assert {d.id for d in grads[k].devices()} == set(range(4 * k, 4 * k + 4))
        if layout:
            assert _spec(grads[k].sharding, 2) == _spec(ref_grads[k].sharding, 2)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("coll", sorted(COLLECTIVES))
def test_shard_map_collectives_in_a_stage(coll, placement):
    """Values, gradients, their devices and layout, and per-device flops (summed over
    the fragments) as ``jax.jit``'s on the stage's 2x2 mesh."""
    body = _body(coll)
    ws, x = _inputs()
    with _placed(body, placement) as stages:
        step = mm.mjit(jax.value_and_grad(_loss_of(stages)))
        value, grads = step(ws, x)
        flops = _flops(step.lower(ws, x).compile())
    ref_value, ref_grads = _reference(body, ws, x)
    with jax.set_mesh(_stage_mesh()):
        ref_flops = _flops(jax.jit(jax.value_and_grad(_loss_of([body, body])))
                           .lower(ws, x).compile())
    assert flops <= 1.1 * ref_flops, (flops, ref_flops)
    _assert_as_jax((value, grads), (ref_value, ref_grads))


def test_the_ppermute_case_tells_a_rotation_from_none():
    """The oracle is sharp: the same program with the ppermute left out gives another
    value, so a collective renumbered to a no-op could not pass."""
    ws, x = _inputs()
    in_specs, out_spec, _ = COLLECTIVES["ppermute"]

    def still(w, x):
        return jnp.tanh(jax.shard_map(lambda w, x: x @ w, in_specs=in_specs,
                                      out_specs=out_spec)(w, x))
    rotated, _ = _reference(_body("ppermute"), ws, x)
    unrotated, _ = _reference(still, ws, x)
    assert abs(float(rotated) - float(unrotated)) > 1e-3 * abs(float(rotated))


def test_registered_stage_collectives_follow_the_mesh_order():
    """Under the global mesh over devices 7..0, stage 0 is devices 7..4: a registered
    stage's ``psum`` groups are its own devices' in that order, and the numbers are
    ``jax.jit``'s."""
    body = _body("psum")
    ws, x = _inputs()
    mm.clear_tasks()
    try:
        for k in range(2):
            mm.register_task(f"l{k}", task=mm.Task(mesh_slice={"stage": k}))
        with jax.set_mesh(_global_mesh(reverse=True)):
            value, grads = mm.mjit(jax.value_and_grad(_loss_of(_layers(body))))(ws, x)
    finally:
        mm.clear_tasks()
    ref_value, ref_grads = _reference(body, ws, x)
    _assert_as_jax((value, grads), (ref_value, ref_grads), devices=False, layout=False)
    for k in range(2):
        want = _global_mesh(reverse=True).devices[k].flatten().tolist()
        assert [d.id for d in grads[k].sharding.mesh.devices.flat] == [d.id for d in want]


def _over_stage(coll: str):
    def local(w, x):
        if coll == "psum":
            return jax.lax.psum(x @ w, "stage")
        if coll == "all_gather":  # jax's NameError, where the other two are AssertionErrors
            return jax.lax.all_gather(x @ w, "stage", axis=0, tiled=True)[:2]
        return jax.lax.ppermute(x @ w, "stage", perm=[(0, 1), (1, 0)])

    def body(w, x):
        return jax.shard_map(local, in_specs=(P(None, None), P("data", None)),
                             out_specs=P("data", None))(w, x)
    return body


@pytest.mark.parametrize("placement", ["registered-mesh_slice", "mesh_slice"])
@pytest.mark.parametrize("coll", ["psum", "ppermute", "all_gather"])
def test_a_collective_over_the_sliced_axis_is_an_error(coll, placement):
    """A stage's ``shard_map`` is traced on the stage's mesh, which has no ``stage``
    axis; a collective over ``stage`` (under ``jax.jit`` on the global mesh: across the
    stages) is an error while tracing, naming the collective, the axis and the task,
    in place of jax's bare ``AssertionError`` or ``NameError``."""
    ws, x = _inputs()
    with _placed(_over_stage(coll), placement) as stages, \
            pytest.raises(mm.errors.MeshError, match=(
                rf"a `{coll}` in task '[ls]0' runs over the mesh axis 'stage', which is "
                r"sliced away \(the task is one slice of it\); inside a task a collective "
                r"runs among the task's devices only, over the axes \['data', 'model'\] of "
                r"its mesh \(sizes \[2, 2\]\)")):
        mm.mjit(jax.value_and_grad(_loss_of(stages)))(ws, x)


def test_check_vma_false_in_a_registered_stage():
    """Under ``check_vma=False`` jax's gradient sums the replicated weight over every
    axis of the mesh the ``shard_map`` was traced on: the stage's, so ``data`` alone,
    as ``jax.jit`` on the stage's 2x2 mesh."""
    body = _body("psum", check_vma=False)
    ws, x = _inputs()
    with _placed(body, "registered-mesh_slice") as stages:
        value, grads = mm.mjit(jax.value_and_grad(_loss_of(stages)))(ws, x)
    ref_value, ref_grads = _reference(body, ws, x)
    _assert_as_jax((value, grads), (ref_value, ref_grads))


def _wide_mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.asarray(jax.devices()).reshape(4, 2), ("data", "model"),
                             axis_types=(AUTO,) * 2)


@contextlib.contextmanager
def _registered_task_meshes():
    m0, m1 = _task_meshes()
    mm.clear_tasks()
    try:
        mm.register_task("l0", task=mm.Task(mesh=m0))
        mm.register_task("l1", task=mm.Task(mesh=m1))
        with jax.set_mesh(_wide_mesh()):
            yield _layers
    finally:
        mm.clear_tasks()


def test_a_registered_stage_of_other_sizes_traces_on_its_own_mesh():
    """A registered ``TaskMesh`` stage with ``data=2`` under a program mesh with
    ``data=4``: its ``shard_map`` (no ``mesh=``) is traced on the stage's mesh, as in an
    explicit task; values, gradients and their devices as ``jax.jit``'s on 2x2."""
    body = _body("psum")
    ws, x = _inputs()
    with _registered_task_meshes() as layers:
        value, grads = mm.mjit(jax.value_and_grad(_loss_of(layers(body))))(ws, x)
    ref_value, ref_grads = _reference(body, ws, x)
    _assert_as_jax((value, grads), (ref_value, ref_grads))


@pytest.mark.parametrize("named", ["Mesh", "AbstractMesh"])
def test_a_shard_map_naming_a_mesh_of_other_sizes_is_an_error(named):
    """A ``shard_map`` in a registered stage (``data=2``) that names a mesh with
    ``data=4`` (``mesh=``): its local shapes would not fit the stage; an error while
    tracing, in place of jax's "The context mesh ... should match"."""
    in_specs, out_spec, local = COLLECTIVES["psum"]
    wide = _wide_mesh() if named == "Mesh" else _wide_mesh().abstract_mesh

    def body(w, x):
        return jax.shard_map(local, mesh=wide, in_specs=in_specs, out_specs=out_spec)(w, x)
    ws, x = _inputs()
    with _registered_task_meshes() as layers, pytest.raises(mm.errors.MeshError, match=(
            r"a `shard_map` in task 'l[01]' was traced on a mesh where the axis 'data' "
            r"has size 4, but the task's mesh gives it size 2")):
        mm.mjit(_loss_of(layers(body)))(ws, x)


def test_axis_index_and_psum_in_a_registered_stage_with_its_axes_reordered():
    """A registered ``TaskMesh`` stage with the axes ``("model", "data")`` under the
    program mesh ``("stage", "data", "model")``: its ``shard_map`` is traced and lowered
    on the stage's mesh, so ``axis_index`` (jax's arithmetic on the device number, which
    recursed when lowered over the program's concrete mesh) and the ``psum`` groups are
    the task's, by axis name; values, gradients and placement as ``jax.jit``'s on a 2x2
    mesh."""
    def local(w, x):  # this device's column block of the sum, scaled by its data row
        block = jax.lax.dynamic_slice_in_dim(jax.lax.psum(x @ w, "model"),
                                             4 * jax.lax.axis_index("model"), 4, axis=1)
        return block * (1.0 + jax.lax.axis_index("data"))

    def body(w, x):
        return jnp.tanh(jax.shard_map(local, in_specs=(P("model", None), P("data", "model")),
                                      out_specs=P("data", "model"))(w, x) / 2)

    ws, x = _inputs()
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=("model", "data"), axis_sizes=(2, 2))
    meshes = {"l0": m0, "l1": m0.place((4, 5, 6, 7))}
    mm.clear_tasks()
    try:
        mm.register_task(r"(l\d)", callback=lambda name, bwd: mm.Task(mesh=meshes[name]))
        with jax.set_mesh(_global_mesh()):
            value, grads = mm.mjit(jax.value_and_grad(_loss_of(_layers(body))))(ws, x)
    finally:
        mm.clear_tasks()
    ref_value, ref_grads = _reference(body, ws, x)
    _assert_as_jax((value, grads), (ref_value, ref_grads), layout=False)


def test_registered_stage_collectives_under_microbatch():
    """The registered stages' ``psum`` inside a 1F1B microbatch loop (4 microbatches of
    4 rows): value and gradients as ``jax.jit``'s on the whole batch."""
    body = _body("psum")
    ws, _ = _inputs()
    x = jax.random.normal(jax.random.key(2), (16, 8))

    def loss(stages):
        return lambda ws, x: jnp.mean(stages[1](ws[1], stages[0](ws[0], x)) ** 2)

    with _placed(body, "registered-mesh_slice") as stages:
        step = mm.mjit(mm.microbatch(jax.value_and_grad(loss(stages)), dim=0, size=4,
                                     argnum=1, schedule="1f1b", reduction="mean"))
        value, grads = step(ws, x)
    with jax.set_mesh(_stage_mesh()):
        ref_value, ref_grads = jax.jit(jax.value_and_grad(loss([body, body])))(ws, x)
    _assert_as_jax((value, grads), (ref_value, ref_grads), layout=False)
