"""The conformance matrix (issue 37, item 11): its cells, how one runs, and its table.

Rows are a model placed one way; columns are a way to run its training step. Models
(each cut into 2 or 4 pipeline stages, its parameters laid out by its own annotations):

* ``linen`` -- lm1b-shaped linen stages (``tests/real_models.py``) whose parameters carry
  logical names, laid out by flax's rules (``RULES``) on a ``(data, model)`` mesh;
* ``nnx`` -- the same stages written in NNX, sharded by ``nnx.with_partitioning``
  metadata over ``(data, model)``;
* ``explicit`` -- a Gemma-like NNX decoder for jax's explicit sharding mode
  (``tests/real_models_explicit.py``), flax's fsdp/tp sharding config over an explicit
  ``(fsdp, tp)`` mesh, its activations typed by ``out_sharding=``.

Placements: ``mesh_slice`` (each stage a slice of a global ``(stage, *axes)`` mesh) and
``TaskMesh`` (each stage on a ``TaskMesh`` of 2x2 device positions, no global mesh).
Columns: ``none`` (the whole batch, two stages) and the schedules, each on 4
microbatches of 4 rows with its stage-to-submesh placement: GPipe, 1F1B and ZB-H1 with 2
stages on 2 submeshes, interleaved 1F1B with 4 stages round-robin, DualPipeV with 4
stages V-shaped.

A cell (:func:`run_cell`) checks, against ``jax.jit`` of the same stages composed in
plain jax on one stage's 2x2 mesh (for microbatched steps, a Python loop over the
microbatches), that the value and every gradient agree (rtol 1e-5), that every gradient
lives on its stage's devices with ``jax.jit``'s partition spec, and that the per-device
flops (every fragment summed, one microbatch's worth) are at most 1.1x ``jax.jit``'s;
it returns that flops ratio. ``KNOWN`` lists the cells that fail and why,
``DEVIATIONS`` the gradients laid out otherwise than by ``jax.jit``, and why.
``tests/test_conformance.py`` runs every cell and checks ``docs/conformance.md`` shows
what they measured; ``tools/gen_conformance_doc.py`` writes that page (:func:`render`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from tests.layouts import flops_of, spec_of
from tests.real_models import loss_of

BATCH, SIZE = 16, 4
M = BATCH // SIZE
TOLERANCE = 1.1
"""Per-device flops allowed, as a multiple of ``jax.jit``'s."""

MODELS = {
    "linen": "linen with rules (lm1b-shaped)",
    "nnx": "NNX with partition metadata (lm1b-shaped)",
    "explicit": "explicit mode, Gemma-like (fsdp/tp)",
}
PLACEMENTS = ("mesh_slice", "TaskMesh")
# column -> (stages, the submesh of stage k): contiguous, round-robin and V-shaped
SCHEDULES: dict[str, tuple[int, Callable[[int], int]]] = {
    "none": (2, lambda k: k),
    "gpipe": (2, lambda k: k),
    "1f1b": (2, lambda k: k),
    "interleaved-1f1b": (4, lambda k: k % 2),
    "zero-bubble-h1": (2, lambda k: k),
    "dualpipe-v": (4, lambda k: k if k < 2 else 3 - k),
}
_NO_TYPES = ("A `TaskMesh` has no axis types (its axes are Auto), so an explicit-mode "
             "model's `out_sharding=` einsums raise jax's ValueError \"PartitionSpec passed "
             "to einsum cannot contain axis names that are of type Auto\"; explicit-mode "
             "stages take a `mesh_slice` of an explicit mesh.")
KNOWN: dict[tuple[str, str, str], str] = {
    ("explicit", "TaskMesh", s): _NO_TYPES for s in SCHEDULES}
"""(model, placement, schedule) -> why that cell fails (an xfail, strict, in the suite)."""
DEVIATIONS: dict[str, dict[str, str]] = {
    "nnx": {"['embed']['embedding']": (
        "The NNX embedding's gradient comes back in its parameter's layout "
        "`P('model', None)`; `jax.jit`'s is replicated, `P()`, and so is multimesh's for "
        "the same embedding in linen (no constraint in the traced step asks for either). "
        "The cell checks this layout, and fails once multimesh's and `jax.jit`'s agree.")},
}
"""model -> a gradient (its key path in its stage) -> why its layout differs from
``jax.jit``'s; the cell checks it is its parameter's and still differs from jax's."""

CELLS = [(m, p, s) for m in MODELS for p in PLACEMENTS for s in SCHEDULES]


# --------------------------------------------------------------------------- models


@dataclasses.dataclass
class Built:
    """A model cut into stages: ``fns[k](params[k], x, targets)`` returns stage ``k``'s
    activations (the loss on the last), ``specs[k]`` its parameters' mesh specs."""

    fns: list
    params: list
    specs: list
    axes: tuple[str, str]
    explicit: bool = False

    @property
    def axis_types(self) -> tuple:
        return (AxisType.Explicit if self.explicit else AxisType.Auto,) * 3

    def context(self, model: str):
        """The model's sharding context: flax's rules for the linen model."""
        if model != "linen":
            return contextlib.nullcontext()
        import flax.linen as nn

        from tests.real_models import RULES
        return nn.logical_axis_rules(RULES)

    def placed(self, mesh) -> list:
        """The parameters laid out on ``mesh`` by their specs."""
        return [jax.device_put(p, jax.tree.map(lambda s: NamedSharding(mesh, s), spec,
                                               is_leaf=lambda s: isinstance(s, P)))
                for p, spec in zip(self.params, self.specs, strict=True)]

    def stage_mesh(self, first: int = 0) -> jax.sharding.Mesh:
        devices = np.asarray(jax.devices()[first:first + 4]).reshape(2, 2)
        return jax.sharding.Mesh(devices, self.axes, axis_types=self.axis_types[:2])

    def global_mesh(self) -> jax.sharding.Mesh:
        return jax.make_mesh((2, 2, 2), ("stage", *self.axes), axis_types=self.axis_types)


def _linen(num_stages: int, batch) -> Built:
    import flax.linen as nn

    from tests.real_models import RULES, init_stages, stage_modules, stage_specs
    stages = stage_modules(num_stages)
    specs = [nn.logical_to_mesh(s, RULES) for s in stage_specs(stages, batch)]
    return Built([s.apply for s in stages], init_stages(stages, batch), specs, ("data", "model"))


def _functional(modules, call) -> tuple[list, list, list]:
    """NNX modules as functions of their state: ``call(module, x, targets)``."""
    from flax import nnx
    fns, params, specs = [], [], []
    for m in modules:
        graph, state = nnx.split(m)
        fns.append(lambda s, x, t, graph=graph: call(nnx.merge(graph, s), x, t))
        params.append(state)
        specs.append(nnx.get_partition_spec(state))
    return fns, params, specs


def _nnx(num_stages: int, batch) -> Built:
    from tests.real_models import nnx_stage_modules
    b = Built([], [], [], ("data", "model"))
    with jax.set_mesh(b.stage_mesh()):  # NNX shards the parameters as it makes them
        b.fns, b.params, b.specs = _functional(nnx_stage_modules(num_stages),
                                               lambda m, x, t: m(x, t))
    return b


def _explicit(num_stages: int, batch) -> Built:
    from tests import real_models_explicit as rm

    def call(m, x, targets):
        if not isinstance(m, rm.Last):
            return m(x)
        logp = jax.nn.log_softmax(m(x), axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(targets, rm.VOCAB), axis=-1))

    b = Built([], [], [], ("fsdp", "tp"), explicit=True)
    with jax.set_mesh(b.stage_mesh()):
        b.fns, b.params, b.specs = _functional(
            rm.stage_modules(num_stages, rm.Sharding.fsdp_tp()), call)
    return b


@functools.cache
def token_batch() -> dict:
    from tests.real_models import token_batch as tokens
    return tokens(BATCH)


@functools.cache
def built(model: str, num_stages: int) -> Built:
    return {"linen": _linen, "nnx": _nnx, "explicit": _explicit}[model](num_stages, token_batch())


# --------------------------------------------------------------------------- references


@dataclasses.dataclass
class Reference:
    """``jax.jit`` on one stage's 2x2 mesh: the whole batch's value and gradients and its
    flops; the microbatched step's (a loop over the microbatches) gradients and flops
    per microbatch."""

    value: jax.Array
    grads: list
    flops: float
    looped_grads: list
    looped_flops: float


def _looped(loss):
    def step(params, batch):
        total = None
        for i in range(M):
            part = jax.tree.map(lambda a, i=i: a[i * SIZE:(i + 1) * SIZE], batch)
            out = jax.value_and_grad(loss)(params, part)
            total = out if total is None else jax.tree.map(jnp.add, total, out)
        return jax.tree.map(lambda a: a / M, total)
    return step


@functools.cache
def reference(model: str, num_stages: int) -> Reference:
    b = built(model, num_stages)
    mesh, loss = b.stage_mesh(), loss_of(b.fns)
    with jax.set_mesh(mesh), b.context(model):
        params = b.placed(mesh)
        batch = jax.device_put(token_batch(), NamedSharding(mesh, P(b.axes[0])))
        whole = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
        looped = jax.jit(_looped(loss)).lower(params, batch).compile()
        value, grads = whole(params, batch)
        return Reference(value, grads, flops_of(whole), looped(params, batch)[1],
                         flops_of(looped) / M)


# --------------------------------------------------------------------------- a cell


def _tasks_and_inputs(b: Built, placement: str, submesh):
    """The stages as tasks placed as ``placement`` says, the parameters and the batch
    laid out for them, and the mesh to set (or none)."""
    batch = token_batch()
    if placement == "mesh_slice":
        mesh = b.global_mesh()
        tasks = [mm.task(f, name=f"s{k}", mesh_slice={"stage": submesh(k)})
                 for k, f in enumerate(b.fns)]
        return (tasks, b.placed(mesh), jax.device_put(batch, NamedSharding(mesh, P(b.axes[0]))),
                jax.set_mesh(mesh))
    m0 = mm.TaskMesh(devices=(0, 1, 2, 3), axis_names=b.axes, axis_sizes=(2, 2))
    tasks, params = [], []
    for k, f in enumerate(b.fns):
        first = 4 * submesh(k)
        tasks.append(mm.task(f, name=f"s{k}", mesh=m0.place(tuple(range(first, first + 4)))))
        params.append(b.placed(b.stage_mesh(first))[k])
    batch = jax.device_put(batch, NamedSharding(b.stage_mesh(), P(b.axes[0])))
    return tasks, params, batch, contextlib.nullcontext()


def _check_layout(model: str, name: str, got, jit, params, path) -> None:
    """``got``'s spec is ``jax.jit``'s, or for a listed deviation, its parameter's and
    not ``jax.jit``'s."""
    spec, want = spec_of(got.sharding, got.ndim), spec_of(jit.sharding, jit.ndim)
    deviation = [k for k in DEVIATIONS.get(model, {}) if k in name]
    if not deviation:
        assert spec == want, (name, got.sharding, jit.sharding)
        return
    param = jax.tree_util.tree_flatten_with_path(params)[0]
    param = next(p for q, p in param if q == path)
    assert spec == spec_of(param.sharding, param.ndim), (name, got.sharding, param.sharding)
    assert spec != want, f"{name} is laid out as jax.jit's now: remove it from DEVIATIONS"


def run_cell(model: str, placement: str, schedule: str) -> float:
    """Run one cell, check it (assertions), and return its per-device flops as a
    multiple of ``jax.jit``'s."""
    num_stages, submesh = SCHEDULES[schedule]
    b, ref = built(model, num_stages), reference(model, num_stages)
    tasks, params, batch, mesh = _tasks_and_inputs(b, placement, submesh)
    step = jax.value_and_grad(loss_of(tasks))
    if schedule != "none":
        step = mm.microbatch(step, dim=0, size=SIZE, argnum=1, schedule=schedule,
                             reduction="mean")
    with mesh, b.context(model):
        compiled = mm.mjit(step).lower(params, batch).compile()
        value, grads = compiled(params, batch)
    layouts, jit_flops = ((ref.grads, ref.flops) if schedule == "none"
                          else (ref.looped_grads, ref.looped_flops))
    np.testing.assert_allclose(value, ref.value, rtol=1e-5)
    for k in range(num_stages):
        devices = set(range(4 * submesh(k), 4 * submesh(k) + 4))
        got = jax.tree_util.tree_flatten_with_path(grads[k])[0]
        for (path, g), want, jit in zip(got, jax.tree.leaves(ref.grads[k]),
                                        jax.tree.leaves(layouts[k]), strict=True):
            name = f"stage {k}{jax.tree_util.keystr(path)}"
            np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-6,
                                       err_msg=name)
            assert {d.id for d in g.devices()} == devices, (name, g.devices())
            _check_layout(model, name, g, jit, params[k], path)
    flops = flops_of(compiled)
    assert flops <= TOLERANCE * jit_flops, (flops, jit_flops)
    return flops / jit_flops


# --------------------------------------------------------------------------- the page


HEADER = """\
<!-- Generated by tools/gen_conformance_doc.py from tests/conformance.py; do not edit. -->
# Conformance matrix

Every cell is a test (`tests/test_conformance.py`, its cells defined in
`tests/conformance.py`): a model's training step (the loss and the gradients of every
parameter) cut into pipeline stages, placed one way, run one way. Each cell checks,
against `jax.jit` of the same stages composed in plain jax on one stage's 2x2 mesh
(for microbatched steps, a Python loop over the microbatches):

* the value and every gradient (f32, rtol 1e-5);
* every gradient's devices (its stage's) and partition spec (`jax.jit`'s);
* per-device flops (`cost_analysis()["flops"]`, every fragment summed, one
  microbatch's worth) at most 1.1x `jax.jit`'s.

A ✓ shows the flops ratio (multimesh's per-device flops over `jax.jit`'s, rounded to
2 decimals; XLA's counts are deterministic, and the suite checks this page shows what
its run measured). A ≠ passes every check but one: a gradient is laid out otherwise
than by `jax.jit`, as its note says (the cell checks that layout, so it fails once the
two agree); it shows the flops ratio too. A ✗ is a cell that cannot run or fails, its
reason in the notes (an `xfail(strict=True)` in the suite).

**Models.** *linen with rules*: lm1b-shaped linen stages (token and position
embeddings, pre-norm attention and MLP blocks, a logits head and the loss) whose
parameters carry logical names, laid out by flax's rules (`nn.logical_axis_rules`) on a
`(data, model)` mesh. *NNX with partition metadata*: the same stages in NNX, sharded by
`nnx.with_partitioning`. *Explicit mode, Gemma-like*: an NNX decoder for jax's explicit
sharding mode (`AxisType.Explicit`) with flax's gemma fsdp/tp sharding config and typed
activations (`out_sharding=`). The batch (16 sequences of 8 tokens) is placed over
`data`/`fsdp`.

**Placements.** `mesh_slice`: each stage a slice `{"stage": i}` of a global
`(stage, data, model)` (or `(stage, fsdp, tp)`) mesh of 2x2x2 devices. `TaskMesh`: each
stage on a `TaskMesh` of 2x2 device positions, no global mesh.

**Columns.** `none`: no microbatching, 2 stages on 2 submeshes. The schedules run 4
microbatches of 4 rows: `gpipe`, `1f1b` and `zero-bubble-h1` with 2 stages on 2
submeshes; `interleaved-1f1b` with 4 stages placed round-robin; `dualpipe-v` with 4
stages placed V-shaped (stages 0 and 3 on one submesh, 1 and 2 on the other).
"""


def _note(notes: list[str], note: str) -> int:
    """``note``'s number in ``notes`` (added if new)."""
    if note not in notes:
        notes.append(note)
    return notes.index(note) + 1


def render(results: dict[tuple[str, str, str], float]) -> str:
    """The page: ``results`` maps every cell not in ``KNOWN`` to its flops ratio."""
    notes: list[str] = []
    lines = ["| model | placement | " + " | ".join(f"`{s}`" for s in SCHEDULES) + " |",
             "|---|---|" + "---|" * len(SCHEDULES)]
    for m, label in MODELS.items():
        for p in PLACEMENTS:
            row = []
            for s in SCHEDULES:
                if (m, p, s) in KNOWN:
                    row.append(f"✗ [{_note(notes, KNOWN[m, p, s])}]")
                else:
                    differs = "".join(f" [{_note(notes, n)}]"
                                      for n in DEVIATIONS.get(m, {}).values())
                    row.append(f"{'≠' if differs else '✓'} {results[m, p, s]:.2f}{differs}")
            lines.append(f"| {label} | `{p}` | " + " | ".join(row) + " |")
    text = HEADER + "\n" + "\n".join(lines) + "\n"
    if notes:
        text += "\n**Notes.**\n\n" + "".join(
            f"{i}. {note}\n" for i, note in enumerate(notes, 1))
    return text
