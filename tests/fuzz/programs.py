"""Random MPMD programs for differential fuzzing (docs/testing.md, "Differential fuzzing").

A program is plain data (:class:`ProgramSpec`): 2-6 tasks on random submeshes of
the program's 8 devices (disjoint, nested, overlapping or identical device sets,
TaskMesh shapes with 1-2 axes, devices in any order), random logical mappings,
random elementwise / dot / reduce / transpose bodies with logical
``with_sharding_constraint``s, optional glue ops between tasks (which
``mm-assign-tasks`` places), optional ``jax.value_and_grad``, optionally under
``mm.microbatch`` (:class:`MicrobatchSpec`: 2-4 microbatches of one input, a random
schedule; checked against the sum over microbatches of plain JAX and through
``compiled.schedule``).

:func:`render` turns a spec into a standalone Python source text and
:func:`build` ``exec``s it, so the program that fails *is* its repro: the
source is printed on failure, and ``tools/fuzz.py`` writes it to a file that
runs on its own.

The generator is written against a tiny :class:`Drawer` interface, implemented
both over hypothesis (``programs()`` strategy: shrinking, CI) and over
``random.Random`` (``random_program(seed)``: the long profile keeps going after a
failure). Every choice list is ordered simplest-first so hypothesis shrinks
towards small, plain programs.

:func:`check` runs a program through ``mjit`` and through plain JAX
(``ignore_transforms``), compares outputs (and gradients), checks that every
output lives on the devices of the task that produced it, and that every
fragment runs on the devices of its task. Errors are predicted from the
documented logical-sharding rule (``multimesh/passes/logical_axes.py``): a live
in-task constraint whose shard count does not divide its dimension must raise
``LogicalShardingError``; no other program may raise.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import re
import textwrap
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = [
    "Op", "TaskSpec", "Step", "ProgramSpec", "MicrobatchSpec", "Drawer", "RandomDrawer",
    "HypothesisDrawer", "gen_program", "random_program", "programs", "render", "build",
    "check", "Outcome", "expected_resolution", "FuzzFailure",
]

NUM_DEVICES = 8
AXIS_NAMES = ("x", "y", "z")
# 'x' / 'y' double as device axis names: under the identity mapping (logical_axes=None)
# they resolve to the axis of the same name.
LOGICAL_NAMES = ("a", "b", "x", "y")
TASK_NAMES = ("t0", "t1", "t2", "t3", "t4", "t5", "t6")
ODD_TASK_NAMES = ("layer.1", "a-b", "mesh_t0", "_t", "T")

# ----------------------------------------------------------------------------- spec


@dataclasses.dataclass(frozen=True)
class Op:
    """One op. ``args`` index the values visible at that point (task: locals; top: names)."""

    kind: str  # unary | binary | dot | reduce | transpose | wsc
    fn: str
    args: tuple
    spec: tuple | None = None  # wsc: one entry per dim: None | str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str
    devices: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    logical_axes: tuple[tuple[str, str], ...] | None  # None: identity over axis names
    in_ranks: tuple[int, ...]
    body: tuple[Op, ...]  # local value i: inputs first, then one per op
    outputs: tuple[int, ...]  # local indices
    bare: bool = False  # a single output returned bare rather than as a 1-tuple


@dataclasses.dataclass(frozen=True)
class Step:
    """A top-level step; defines ``len(outs)`` new top-level names.

    kind ``task``: call ``tasks[task]`` on ``args`` (top-level names);
    ``glue``: an untagged op between tasks; ``wsc``: a top-level logical constraint.
    """

    kind: str
    args: tuple[str, ...]
    outs: tuple[str, ...]
    task: int | None = None
    op: Op | None = None
    remat: bool = False  # task call wrapped in jax.checkpoint


MB_SCHEDULES = ("gpipe", "1f1b", "zero-bubble-h1", "interleaved-1f1b")
_PLAIN_SCHEDULES = MB_SCHEDULES[:3]


@dataclasses.dataclass(frozen=True)
class MicrobatchSpec:
    """``mm.microbatch(jax.value_and_grad(loss, argnums=<the others>), dim=0, size=N,
    argnum=argnum, schedule=schedule)``: input ``argnum`` has ``num_microbatches * N``
    rows, each microbatch the ``(N, ...)`` slice every task body expects; the gradients
    are those of the other inputs (the weights), accumulated over microbatches."""

    num_microbatches: int
    schedule: str
    argnum: int = 0
    # interleaved-1f1b: the tasks alternate between two submeshes; ``interleave=k`` when
    # the generator predicts k stages on each (:func:`predicted_stages`), else not given
    interleave: int | None = None


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    n: int  # every value has shape (n,) * rank
    input_ranks: tuple[int, ...]
    tasks: tuple[TaskSpec, ...]
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    grad: bool = False
    loss_task: int | None = None  # grad: index of the task computing the loss, else glue
    data_seed: int = 0
    device_perm: tuple[int, ...] | None = None  # mjit(devices=[jax.devices()[i] for i in perm])
    vmap: int | None = None  # batch size: the whole program under jax.vmap
    dtype: str = "float32"  # int32: forward only, exact comparison
    pytree: bool = False  # inputs passed as one dict {"x0": ..., ...}
    microbatch: MicrobatchSpec | None = None

    def source(self) -> str:
        return render(self)


# ----------------------------------------------------------------------------- drawers


class Drawer:
    """The choices the generator makes; simplest answer = smallest index / False."""

    def integer(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def choice(self, seq: Sequence) -> Any:
        return seq[self.integer(0, len(seq) - 1)]

    def boolean(self, p: float = 0.5) -> bool:
        return self.integer(0, 99) >= round(100 * (1 - p))

    def permutation(self, seq: Sequence) -> list:
        rest, out = list(seq), []
        while rest:
            out.append(rest.pop(self.integer(0, len(rest) - 1)))
        return out


class RandomDrawer(Drawer):
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo, hi):
        return self.rng.randint(lo, hi)


class HypothesisDrawer(Drawer):
    def __init__(self, draw):
        from hypothesis import strategies as st

        self._draw, self._st = draw, st

    def integer(self, lo, hi):
        return self._draw(self._st.integers(lo, hi))


# ----------------------------------------------------------------------------- generator


def _factorizations(k: int) -> list[tuple[int, ...]]:
    out = [(k,)]
    for a in range(1, k + 1):
        if k % a == 0:
            out.append((a, k // a))
    return out


def _gen_mesh(d: Drawer, prev: list[TaskSpec], allow_errors: bool):
    sizes = (2, 4, 1, 8, 3, 6) if allow_errors else (2, 4, 1, 8)
    k = d.choice(sizes)
    mode = d.choice(("fresh", "disjoint", "nested", "same")) if prev else "fresh"
    if mode == "same":
        p = d.choice(prev)
        devs = list(p.devices)
        k = len(devs)
        if d.boolean(0.3):
            devs = d.permutation(devs)
    elif mode == "nested" and any(len(p.devices) >= 2 for p in prev):
        p = d.choice([p for p in prev if len(p.devices) >= 2])
        k = min(k, len(p.devices))
        devs = d.permutation(p.devices)[:k]
    else:
        pool = list(range(NUM_DEVICES))
        if mode == "disjoint":
            used = {x for p in prev for x in p.devices}
            free = [x for x in pool if x not in used]
            if len(free) >= k:
                pool = free
        devs = d.permutation(pool)[:k]
        if not d.boolean(0.3):  # mostly in increasing order, sometimes shuffled
            devs = sorted(devs)
    shape = d.choice(_factorizations(k))
    names = tuple(d.permutation(AXIS_NAMES)[: len(shape)]) if d.boolean(0.3) \
        else AXIS_NAMES[: len(shape)]
    return tuple(devs), names, tuple(shape)


def _gen_mapping(d: Drawer, axis_names) -> tuple[tuple[str, str], ...] | None:
    if d.boolean(0.25):
        return None
    if d.boolean(0.1):
        return ()
    pairs = []
    for _ in range(d.integer(1, 3)):
        logical, device = d.choice(LOGICAL_NAMES), d.choice(axis_names)
        if logical in axis_names and logical != device:
            continue  # a mesh axis named as another axis's logical name: refused by design
        pairs.append((logical, device))
    return tuple(pairs)


def _gen_wsc_spec(d: Drawer, rank: int) -> tuple:
    out = []
    for _ in range(rank):
        r = d.integer(0, 9)
        if r < 3:
            out.append(None)
        elif r < 9:
            out.append(d.choice(LOGICAL_NAMES))
        else:
            out.append(tuple(d.permutation(LOGICAL_NAMES)[:2]))
    return tuple(out)


UNARY = ("tanh", "sin", "neg", "half", "cos", "sigmoid")
BINARY = ("add", "sub", "mul_tanh", "max")
REDUCE2 = ("center0", "center1", "sum0", "sum1", "max1")  # rank 2 -> (2, 2, 1, 1, 1)
REDUCE1 = ("center",)


def _gen_op(d: Drawer, ranks: list[int], *, allow_wsc: bool = True) -> tuple[Op, int]:
    """An op over values of the given ranks; returns (op, result rank)."""
    n = len(ranks)
    kinds = ["unary", "binary", "dot", "reduce", "transpose"] + (["wsc"] if allow_wsc else [])
    for _ in range(20):
        kind = d.choice(kinds)
        a = d.integer(0, n - 1)
        ra = ranks[a]
        if kind == "unary":
            return Op("unary", d.choice(UNARY), (a,)), ra
        if kind == "binary":
            b = d.integer(0, n - 1)
            return Op("binary", d.choice(BINARY), (a, b)), max(ra, ranks[b])
        if kind == "dot":
            b = d.integer(0, n - 1)
            rb = ranks[b]
            if (ra == 1 and rb == 1) or ra == 0 or rb == 0:
                continue
            fn = d.choice(("ab", "abT")) if rb == 2 else "ab"
            return Op("dot", fn, (a, b)), ra + rb - 2
        if kind == "reduce":
            if ra == 0:
                continue
            if d.boolean(0.15):
                return Op("reduce", "mean", (a,)), 0
            if ra == 2:
                fn = d.choice(REDUCE2)
                return Op("reduce", fn, (a,)), 2 if fn.startswith("center") else 1
            return Op("reduce", "center", (a,)), 1
        if kind == "transpose":
            if ra != 2:
                continue
            return Op("transpose", "T", (a,)), 2
        if kind == "wsc":
            return Op("wsc", "wsc", (a,), _gen_wsc_spec(d, ra)), ra
    return Op("unary", "tanh", (0,)), ranks[0]


def _gen_on(d: Drawer, devices: tuple[int, ...]):
    """A TaskMesh over exactly ``devices`` (same order: the same submesh), random shape."""
    shape = d.choice(_factorizations(len(devices)))
    names = tuple(d.permutation(AXIS_NAMES)[: len(shape)]) if d.boolean(0.3) \
        else AXIS_NAMES[: len(shape)]
    return devices, names, tuple(shape)


def _gen_task(d: Drawer, name: str, in_ranks: tuple[int, ...], prev: list[TaskSpec],
              allow_errors: bool, on: tuple[int, ...] | None = None) -> TaskSpec:
    devices, axis_names, axis_sizes = _gen_mesh(d, prev, allow_errors) if on is None \
        else _gen_on(d, on)
    mapping = _gen_mapping(d, axis_names)
    ranks = list(in_ranks)
    body = []
    # a constraint on an input first, as models usually do
    if d.boolean(0.4):
        a = d.integer(0, len(ranks) - 1)
        body.append(Op("wsc", "wsc", (a,), _gen_wsc_spec(d, ranks[a])))
        ranks.append(ranks[a])
    for _ in range(d.integer(1, 4)):
        op, r = _gen_op(d, ranks)
        body.append(op)
        ranks.append(r)
    outs = [len(ranks) - 1]
    if d.boolean(0.35):
        extra = d.integer(len(in_ranks), len(ranks) - 1)  # never a bare input (passthrough)
        if extra not in outs:
            outs.append(extra)
    return TaskSpec(name, devices, axis_names, axis_sizes, mapping, tuple(in_ranks),
                    tuple(body), tuple(outs), bare=len(outs) == 1 and d.boolean(0.5))


def gen_program(d: Drawer, *, max_tasks: int = 6, grad: bool | None = None,
                allow_errors: bool = True, microbatch: bool | float = False) -> ProgramSpec:
    """Draw one program. ``grad=None``: draw whether to differentiate.

    ``microbatch``: ``True`` (or 1) always, a fraction ``p`` with probability ``p``, ``False``
    (default; draws nothing, so seeds give the same programs as before) never. A
    microbatched program is a gradient program with 2-3 inputs, no vmap and no dict
    inputs (``grad=False`` excludes it).
    """
    if microbatch is True or float(microbatch) >= 1:  # 1.0 draws as True does
        if grad is False:
            raise ValueError("microbatched programs are value_and_grad programs: grad=False "
                             "excludes microbatch=True")
        mb_on = True
    elif microbatch and grad is not False:
        mb_on = d.boolean(float(microbatch))
    else:
        mb_on = False
    do_grad = True if mb_on else d.boolean(0.4) if grad is None else grad
    dtype = "int32" if not do_grad and d.boolean(0.1) else "float32"
    n = d.choice((8, 4, 6)) if allow_errors else d.choice((8, 4))
    n_inputs = d.integer(2, 3) if mb_on else d.integer(1, 3)
    subs: tuple = ()  # interleaved-1f1b: task i runs on subs[i % 2]
    if mb_on:
        mb_draw = (d.integer(2, 4), d.choice(MB_SCHEDULES), d.integer(0, n_inputs - 1))
        if mb_draw[1] == "interleaved-1f1b":
            ka, kb = d.choice(((2, 2), (4, 4), (1, 1), (4, 2), (2, 1)))
            pool = d.permutation(range(NUM_DEVICES))
            subs = (tuple(sorted(pool[:ka])), tuple(sorted(pool[ka:ka + kb])))
    input_ranks = tuple(1 if d.boolean(0.15) else 2 for _ in range(n_inputs))
    names = [f"x{i}" for i in range(n_inputs)]
    rank_of = dict(zip(names, input_ranks))
    odd_names = d.boolean(0.1)
    n_tasks = d.integer(2, max_tasks)
    tasks: list[TaskSpec] = []
    steps: list[Step] = []
    consumed: set[str] = set()
    # top-level constraints on inputs
    for x in list(names):
        if d.boolean(0.25):
            new = f"{x}c"
            steps.append(Step("wsc", (x,), (new,), op=Op("wsc", "wsc", (0,),
                                                         _gen_wsc_spec(d, rank_of[x]))))
            rank_of[new] = rank_of[x]
            names[names.index(x)] = new
            consumed.add(x)
    visible = list(names)
    for ti in range(n_tasks):
        # glue op between tasks, placed by mm-assign-tasks
        if tasks and d.boolean(0.2):
            ranks = [rank_of[v] for v in visible]
            op, r = _gen_op(d, ranks, allow_wsc=False)
            g = f"g{len(steps)}"
            steps.append(Step("glue", tuple(visible[i] for i in op.args), (g,), op=op))
            consumed.update(visible[i] for i in op.args)
            rank_of[g] = r
            visible.append(g)
        # reuse an earlier task (same callable, a second call site)
        if len(tasks) >= 2 and d.boolean(0.1):
            src = d.integer(0, len(tasks) - 1)
            want = tasks[src].in_ranks
            cands = [[v for v in visible if rank_of[v] == r] for r in want]
            if all(cands):
                args = tuple(d.choice(c) for c in cands)
                outs = tuple(f"t{ti}_o{j}" for j in range(len(tasks[src].outputs)))
                steps.append(Step("task", args, outs, task=src))
                for o, j in zip(outs, tasks[src].outputs):
                    rank_of[o] = _local_ranks(tasks[src])[j]
                consumed.update(args)
                visible.extend(outs)
                continue
        n_args = d.integer(1, min(3, len(visible)))
        # prefer fresh values (the latest outputs) so programs form chains and DAGs
        args = []
        for _ in range(n_args):
            fresh = [v for v in visible if v not in consumed and v not in args]
            pool = fresh if fresh and d.boolean(0.7) else visible
            args.append(d.choice(pool[::-1]))
        name = (d.choice(ODD_TASK_NAMES) if odd_names and d.boolean(0.5)
                else TASK_NAMES[len(tasks)])
        if any(t.name == name for t in tasks):
            name = TASK_NAMES[len(tasks)]
        t = _gen_task(d, name, tuple(rank_of[a] for a in args), tasks, allow_errors,
                      subs[len(tasks) % 2] if subs else None)
        tasks.append(t)
        outs = tuple(f"t{ti}_o{j}" for j in range(len(t.outputs)))
        steps.append(Step("task", tuple(args), outs, task=len(tasks) - 1,
                          remat=d.boolean(0.1)))
        lr = _local_ranks(t)
        for o, j in zip(outs, t.outputs):
            rank_of[o] = lr[j]
        consumed.update(args)
        visible.extend(outs)
    produced = [o for s in steps if s.kind in ("task", "glue") for o in s.outs]
    outputs = [v for v in produced if v not in consumed]
    for v in produced:
        if v not in outputs and d.boolean(0.15):
            outputs.append(v)
    if not outputs:
        outputs = [produced[-1]]
    if d.boolean(0.05):  # a program input returned as is
        outputs.append(d.choice([f"x{i}" for i in range(n_inputs)]))
    if d.boolean(0.05):  # the same value returned twice
        outputs.append(d.choice(outputs))
    if d.boolean(0.05) and len(outputs) > 1:  # a dead sink: its task's result is unused
        outputs.pop(0)
    loss_task = None
    if do_grad and d.boolean(0.5):
        devices, axis_names, axis_sizes = _gen_mesh(d, tasks, allow_errors) if not subs \
            else _gen_on(d, subs[len(tasks) % 2])
        tasks.append(TaskSpec("loss", devices, axis_names, axis_sizes, None,
                              tuple(rank_of[o] for o in outputs), (), (), bare=True))
        loss_task = len(tasks) - 1
    perm = tuple(d.permutation(range(NUM_DEVICES))) if d.boolean(0.15) else None
    if mb_on:  # vmap and dict inputs would slice every leaf: not with a weight to grad
        vmap, pytree = None, False
    else:
        vmap = d.choice((2, 4)) if d.boolean(0.1) else None
        pytree = d.boolean(0.1)
    spec = ProgramSpec(n, input_ranks, tuple(tasks), tuple(steps), tuple(outputs),
                       grad=do_grad, loss_task=loss_task, data_seed=d.integer(0, 2**16),
                       device_perm=perm, vmap=vmap, dtype=dtype, pytree=pytree,
                       microbatch=MicrobatchSpec(*mb_draw) if mb_on else None)
    if subs:
        k = set(predicted_stages(spec).values())
        if len(k) == 1 and min(k) >= 2:
            spec = dataclasses.replace(spec, microbatch=dataclasses.replace(
                spec.microbatch, interleave=min(k)))
    return spec


def predicted_stages(p: ProgramSpec) -> dict[tuple[int, ...], int]:
    """Pipeline stages per submesh as ``mm-schedule-fragments`` derives them, predicted
    from the spec: a run of consecutive live task calls on one device list is one stage.
    A guess (the pass sees fragments; CSE or hoisting can reorder them); check() verifies."""
    live = _fine_liveness(p)
    calls = [p.tasks[s.task] for i, s in enumerate(p.steps) if s.kind == "task" and i in live]
    if p.loss_task is not None:
        calls.append(p.tasks[p.loss_task])
    out: dict[tuple[int, ...], int] = {}
    last, seen = None, set()
    for t in calls:  # a task's stage comes from its first call
        if t.name in seen:
            continue
        seen.add(t.name)
        if t.devices != last:
            out[t.devices] = out.get(t.devices, 0) + 1
            last = t.devices
    return out


def grad_argnums(p: ProgramSpec) -> tuple[int, ...]:
    """The ``argnums`` of a gradient program: every input but a microbatched one."""
    if p.pytree:
        return (0,)
    return tuple(i for i in range(len(p.input_ranks))
                 if p.microbatch is None or i != p.microbatch.argnum)


def _local_ranks(t: TaskSpec) -> list[int]:
    ranks = list(t.in_ranks)
    for op in t.body:
        ranks.append(_result_rank(op, ranks))
    return ranks


def _result_rank(op: Op, ranks: list[int]) -> int:
    r = [ranks[i] for i in op.args]
    if op.kind == "binary":
        return max(r)
    if op.kind == "dot":
        return r[0] + r[1] - 2
    if op.kind == "reduce":
        return 0 if op.fn == "mean" else r[0] if op.fn.startswith("center") else 1
    return r[0]


def random_program(seed: int, **kw) -> ProgramSpec:
    return gen_program(RandomDrawer(seed), **kw)


def programs(**kw):
    """Hypothesis strategy of :class:`ProgramSpec` (keywords as :func:`gen_program`)."""
    from hypothesis import strategies as st

    @st.composite
    def _programs(draw):
        return gen_program(HypothesisDrawer(draw), **kw)

    return _programs()


# ----------------------------------------------------------------------------- render

_UNARY_SRC = {"tanh": "jnp.tanh({0})", "sin": "jnp.sin({0})", "neg": "-{0}",
              "half": "0.5 * {0}", "cos": "jnp.cos({0})", "sigmoid": "jax.nn.sigmoid({0})"}
_BINARY_SRC = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul_tanh": "{0} * jnp.tanh({1})",
               "max": "jnp.maximum({0}, {1})"}
_REDUCE_SRC = {"center0": "{0} - jnp.mean({0}, axis=0, keepdims=True)",
               "center1": "{0} - jnp.mean({0}, axis=1, keepdims=True)",
               "sum0": "jnp.sum({0}, axis=0) / N", "sum1": "jnp.sum({0}, axis=1) / N",
               "max1": "jnp.max({0}, axis=1)", "center": "{0} - jnp.mean({0})",
               "mean": "jnp.mean({0})"}


# int32 programs: the same op structure with exact integer ops that stay small
_UNARY_INT = {"tanh": "jnp.clip({0}, -3, 3)", "sin": "{0} % 5", "neg": "-{0}",
              "half": "{0} // 2", "cos": "jnp.abs({0})", "sigmoid": "jnp.sign({0})"}
_BINARY_INT = {"add": "{0} + {1}", "sub": "{0} - {1}", "mul_tanh": "{0} * jnp.clip({1}, -1, 1)",
               "max": "jnp.maximum({0}, {1})"}
_REDUCE_INT = {"center0": "{0} - jnp.min({0}, axis=0, keepdims=True)",
               "center1": "{0} - jnp.max({0}, axis=1, keepdims=True)",
               "sum0": "jnp.sum({0}, axis=0) % 97", "sum1": "jnp.sum({0}, axis=1) % 97",
               "max1": "jnp.max({0}, axis=1)", "center": "{0} - jnp.min({0})",
               "mean": "jnp.sum({0}) % 97"}


def _spec_src(spec: tuple) -> str:
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _op_src(op: Op, args: list[str], ints: bool = False) -> str:
    if op.kind == "unary":
        return (_UNARY_INT if ints else _UNARY_SRC)[op.fn].format(*args)
    if op.kind == "binary":
        return (_BINARY_INT if ints else _BINARY_SRC)[op.fn].format(*args)
    if op.kind == "dot":
        b = f"{args[1]}.T" if op.fn == "abT" else args[1]
        return f"({args[0]} @ {b}) % 97" if ints else f"({args[0]} @ {b}) / N"
    if op.kind == "reduce":
        return (_REDUCE_INT if ints else _REDUCE_SRC)[op.fn].format(*args)
    if op.kind == "transpose":
        return f"{args[0]}.T"
    if op.kind == "wsc":
        return f"wsc({args[0]}, {_spec_src(op.spec)})"
    raise AssertionError(op.kind)


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def render(p: ProgramSpec) -> str:
    """A standalone Python module defining ``tasks``, ``f`` (the program), ``args``."""
    L = []
    L.append("# multimesh fuzz program (tests/fuzz/programs.py); run: python this_file.py")
    L.append("import os")
    L.append("os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')")
    L.append("os.environ.setdefault('JAX_PLATFORMS', 'cpu')")
    L.append("import jax, jax.numpy as jnp, numpy as np")
    L.append("from jax.sharding import PartitionSpec as P")
    L.append("import multimesh.jax as mm")
    L.append("from multimesh.jax import with_sharding_constraint as wsc")
    L.append(f"N = {p.n}")
    ints = p.dtype == "int32"
    L.append("")
    for i, t in enumerate(p.tasks):
        params = [f"v{j}" for j in range(len(t.in_ranks))]
        L.append(f"def body{i}({', '.join(params)}):")
        if i == p.loss_task:
            terms = [f"jnp.sum(v{j} * {0.5 + 0.25 * j})" for j in range(len(t.in_ranks))]
            L.append(f"    return {' + '.join(terms)}")
        else:
            k = len(params)
            for op in t.body:
                L.append(f"    v{k} = {_op_src(op, [f'v{a}' for a in op.args], ints)}")
                k += 1
            outs = [f"v{o}" for o in t.outputs]
            L.append(f"    return {outs[0]}" if t.bare else f"    return ({', '.join(outs)},)")
        mesh = (f"mm.TaskMesh(devices={t.devices}, axis_names={t.axis_names}, "
                f"axis_sizes={t.axis_sizes})")
        L.append(f"task{i} = mm.task(body{i}, name={t.name!r}, mesh={mesh},")
        L.append(f"                 logical_axes={t.logical_axes!r})")
        L.append("")
    ins = [f"x{i}" for i in range(len(p.input_ranks))]
    if p.pytree:
        L.append("def f(xs):")
        L.append(f"    {', '.join(ins)}, = {', '.join(f'xs[{x!r}]' for x in ins)},")
    else:
        L.append(f"def f({', '.join(ins)}):")
    for s in p.steps:
        if s.kind == "task":
            t = p.tasks[s.task]
            fn = f"jax.checkpoint(task{s.task})" if s.remat else f"task{s.task}"
            call = f"{fn}({', '.join(s.args)})"
            if t.bare:
                L.append(f"    {s.outs[0]} = {call}")
            else:
                L.append(f"    {', '.join(s.outs)}, = {call}")
        else:
            L.append(f"    {s.outs[0]} = {_op_src(s.op, list(s.args), ints)}")
    L.append(f"    return ({', '.join(p.outputs)},)")
    L.append("")
    if p.grad:
        L.append("def loss(*xs):")
        L.append("    outs = f(*xs)")
        if p.loss_task is not None:
            L.append(f"    return task{p.loss_task}(*outs)")
        else:
            L.append("    return sum(jnp.sum(o * (0.5 + 0.25 * i)) for i, o in enumerate(outs))")
        L.append("")
        argnums = grad_argnums(p)
        L.append(f"program = jax.value_and_grad(loss, argnums={argnums})")
    else:
        L.append("program = f")
    mb = p.microbatch
    if mb:
        k = mb.argnum
        L.append(f"# input {k} holds M = {mb.num_microbatches} microbatches of N rows; the "
                 "result is the sum over them")
        L.append(f"M = {mb.num_microbatches}")
        il = f", interleave={mb.interleave}" if mb.interleave else ""
        L.append(f"program = mm.microbatch(program, dim=0, size=N, argnum={k}, "
                 f"schedule={mb.schedule!r}{il})")
        L.append("")
        L.append("def reference(*args):")
        L.append('    """Plain JAX (call under mm.ignore_transforms()): the sum over '
                 'microbatches."""')
        L.append(f"    vg = jax.jit(jax.value_and_grad(loss, argnums={argnums}))")
        L.append(f"    outs = [vg(*args[:{k}], args[{k}][i * N:(i + 1) * N], *args[{k + 1}:])")
        L.append("            for i in range(M)]")
        L.append("    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *outs)")
        L.append("")
    if p.vmap:
        L.append("program = jax.vmap(program)")
    L.append(f"_rng = np.random.RandomState({p.data_seed})")
    batch = (p.vmap,) if p.vmap else ()
    shapes = [batch + (p.n,) * r for r in p.input_ranks]
    if mb:
        r = p.input_ranks[mb.argnum]
        shapes[mb.argnum] = (mb.num_microbatches * p.n,) + (p.n,) * (r - 1)
    if ints:
        L.append(f"args = [_rng.randint(-5, 6, s).astype(np.int32) for s in {shapes}]")
    else:
        L.append(f"args = [_rng.uniform(-1, 1, s).astype(np.float32) for s in {shapes}]")
    if p.pytree:
        L.append("args = [{f'x{i}': a for i, a in enumerate(args)}]")
    perm = p.device_perm or tuple(range(NUM_DEVICES))
    L.append(f"devices = [jax.devices()[i] for i in {perm}]")
    L.append("")
    L.append("if __name__ == '__main__':")
    L.append(textwrap.indent(textwrap.dedent("""\
        compiled = mm.mjit(program, devices=devices).lower(*args).compile()
        out = compiled(*args)
        with mm.ignore_transforms():
            ref = {ref}(*args)
        print(compiled.plan())
        for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
            print(sorted(d.id for d in o.devices()), float(np.max(np.abs(np.asarray(o) - np.asarray(r)))))
            np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-4, atol=1e-4)
        print('OK')""").replace("{ref}", "reference" if mb else "program"), "    "))
    return "\n".join(L) + "\n"


def build(p: ProgramSpec) -> dict:
    """Exec the rendered source; returns its namespace (``program``, ``args``, ``task<i>``)."""
    src = render(p)
    ns: dict = {"__name__": "multimesh_fuzz_program"}
    exec(compile(src, "<fuzz program>", "exec"), ns)
    return ns


# ----------------------------------------------------------------------------- oracle


def expected_resolution(dims: Sequence, shape: Sequence[int], axis_names, axis_sizes,
                        mapping) -> tuple[tuple[str, ...], ...] | str:
    """Reference model of the documented logical->device rule (multimesh/passes/logical_axes.py).

    Returns the per-dim device axes, or the string ``"nondividing"``. Written
    from the docstring, not the code, so the two can disagree.
    """
    names = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in dims]
    if mapping is None:
        mapping = tuple((a, a) for a in axis_names)
    size = dict(zip(axis_names, axis_sizes))
    used, shard = set(), [1] * len(shape)
    assigned = [[] for _ in shape]
    for logical, dev in mapping:
        for i, dn in enumerate(names):
            if logical in dn and dev not in used and shard[i] * size[dev] <= shape[i]:
                assigned[i].append(dev)
                used.add(dev)
                shard[i] *= size[dev]
    for i, axes in enumerate(assigned):
        if axes and shape[i] % shard[i]:
            return "nondividing"
    order = {a: i for i, a in enumerate(axis_names)}
    return tuple(tuple(sorted(a, key=order.__getitem__)) for a in assigned)


def _live_locals(t: TaskSpec, outs: Sequence[int] | None = None) -> set[int]:
    """Locals that reach the task outputs at positions ``outs`` (default: all)."""
    live = set(t.outputs) if outs is None else {t.outputs[j] for j in outs}
    k0 = len(t.in_ranks)
    for idx in range(len(t.body) - 1, -1, -1):
        if k0 + idx in live:
            live.update(t.body[idx].args)
    return live


def _fine_liveness(p: ProgramSpec) -> dict[int, set[int]]:
    """Step index -> live locals of its task, following only the outputs that are used."""
    live_names = set(p.outputs)
    out: dict[int, set[int]] = {}
    for i in range(len(p.steps) - 1, -1, -1):
        s = p.steps[i]
        used_outs = [j for j, o in enumerate(s.outs) if o in live_names]
        if not used_outs:
            continue
        if s.kind == "task":
            t = p.tasks[s.task]
            ll = _live_locals(t, used_outs)
            out[i] = ll
            live_names.update(a for j, a in enumerate(s.args) if j in ll)
        else:
            out[i] = set()
            live_names.update(s.args)
    return out


def predict_error(p: ProgramSpec) -> str:
    """``"none"``, ``"must"`` (a live in-task constraint cannot divide) or ``"may"``.

    "Live" follows only the task outputs that are used (:func:`_fine_liveness`): a
    constraint whose value only reaches arguments the next task ignores is dead. The
    flat form still resolves it (the value crosses the task boundary) and raises; the
    microbatch loop's body drops it, like ``jax.jit`` drops a dead constraint. So such a
    constraint *may* raise."""
    must = may = False
    fine = _fine_liveness(p)
    shape = lambda r: (p.n,) * r  # noqa: E731
    for i, s in enumerate(p.steps):
        if s.kind == "task":
            t = p.tasks[s.task]
            ranks = _local_ranks(t)
            for j, op in enumerate(t.body):
                if op.kind != "wsc":
                    continue
                r = expected_resolution(op.spec, shape(ranks[op.args[0]]), t.axis_names,
                                        t.axis_sizes, t.logical_axes)
                if r == "nondividing":
                    if len(t.in_ranks) + j in fine.get(i, ()):
                        must = True
                    else:
                        may = True
        elif s.kind == "wsc":  # placed on a task by mm-assign-tasks: any task may resolve it
            rank = p.input_ranks[int(s.args[0][1:])]
            for t in p.tasks:
                r = expected_resolution(s.op.spec, shape(rank), t.axis_names, t.axis_sizes,
                                        t.logical_axes)
                if r == "nondividing":
                    may = True
    return "must" if must else "may" if may else "none"


# ----------------------------------------------------------------------------- check

# Known library bugs the fuzzer checks leniently, each pinned by a strict xfail test in
# tests/test_fuzz_mpmd.py. Remove an entry, and its lenient branch, once its bug is fixed
# (the xfail then XPASSes). All fixed today: see docs/testing.md, "Bugs found".
KNOWN_BUGS: dict[str, str] = {}


@dataclasses.dataclass
class Outcome:
    status: str  # ok | expected-error | interleave-mismatch (interleave=k rightly rejected)
    n_fragments: int = 0
    n_transfers: int = 0
    seconds: float = 0.0
    known: tuple[str, ...] = ()  # known bugs this program touched (checked leniently)


class FuzzFailure(AssertionError):
    """A program misbehaved; ``kind`` classifies it, the message holds the repro source."""

    def __init__(self, kind: str, detail: str, spec: ProgramSpec):
        self.kind, self.detail, self.spec = kind, detail, spec
        super().__init__(f"[{kind}] {detail}\n\n--- repro (python file) ---\n{render(spec)}")


def _producers(p: ProgramSpec) -> dict[str, tuple]:
    """Top-level name -> ("task", task index) | ("glue",) | ("input", i) | ("wsc", i)."""
    out = {f"x{i}": ("input", i) for i in range(len(p.input_ranks))}
    for s in p.steps:
        for o in s.outs:
            out[o] = ("task", s.task) if s.kind == "task" else (s.kind,)
    return out


def _expected_grad_task(p: ProgramSpec, i: int) -> tuple[int | None, str]:
    """The task that must produce d loss / d x_i: its only, live, direct consumer.

    Returns (task index or None, reason when None).
    """
    x = f"x{i}"
    uses = [(s, j) for s in p.steps for j, a in enumerate(s.args) if a == x]
    if len(uses) != 1 or uses[0][0].kind != "task" or x in p.outputs:
        return None, "not a single task use"
    s, j = uses[0]
    live = _fine_liveness(p).get(p.steps.index(s))
    if live is None or j not in live:
        return None, "dead"
    return s.task, ""


_MB_SUFFIX = re.compile(r"_mb\d+$")  # a loop-dependent task of microbatch i: '<task>_mb<i>'
_MB_NAME = re.compile(r"_mb\d+(_\d+)?$")  # a fragment of microbatch i: '<task>_<dir>_mb<i>'


def _microbatched_tasks(p: ProgramSpec) -> set[str]:
    """Names of the tasks every live call of which computes on the microbatched input."""
    # backwards: which outputs of each step are used
    live_names, used_outs = set(p.outputs), {}
    for i in range(len(p.steps) - 1, -1, -1):
        s = p.steps[i]
        used = [j for j, o in enumerate(s.outs) if o in live_names]
        if not used:
            continue
        used_outs[i] = used
        if s.kind == "task":
            ll = _live_locals(p.tasks[s.task], used)
            live_names.update(a for m, a in enumerate(s.args) if m in ll)
        else:
            live_names.update(s.args)
    # forwards: which values depend on the microbatched input
    deps = {f"x{p.microbatch.argnum}"}
    reads: dict[str, list[bool]] = {}
    for i, s in enumerate(p.steps):
        if s.kind == "task":
            t = p.tasks[s.task]
            on = {j for j in range(len(s.outs)) if any(
                a in deps for m, a in enumerate(s.args) if m in _live_locals(t, [j]))}
            deps.update(s.outs[j] for j in on)
            if i in used_outs:
                reads.setdefault(t.name, []).append(bool(on & set(used_outs[i])))
        elif any(a in deps for a in s.args):
            deps.update(s.outs)
    if p.loss_task is not None:
        reads.setdefault(p.tasks[p.loss_task].name, []).append(
            any(o in deps for o in p.outputs))
    return {name for name, r in reads.items() if all(r)}


def _check_schedule(p: ProgramSpec, compiled, dev_ids: list[int]) -> None:
    """A microbatched program's ``compiled.schedule``: one row per submesh that runs a
    fragment, every fragment call once, the drawn schedule, ``M`` microbatches."""
    mb = p.microbatch
    frags = compiled.fragments
    # the microbatch loop runs its fragments once per microbatch (glue included: every
    # op of the traced microbatch is in the loop)
    in_loop = [c for c in compiled.calls if c["microbatch"] is not None]
    sched = compiled.schedule
    if sched is None:
        raise FuzzFailure("schedule", f"a microbatched program without compiled.schedule; "
                          f"plan:\n{compiled.plan()}", p)
    per_mb = collections.Counter(c["microbatch"] for c in in_loop)
    if sorted(per_mb) != list(range(mb.num_microbatches)) or len(set(per_mb.values())) != 1 \
            or len(in_loop) != len(sched.units):
        raise FuzzFailure("schedule", f"fragment calls per microbatch {dict(per_mb)} for "
                          f"{len(sched.units)} schedule units; plan:\n{compiled.plan()}", p)
    # devices in the schedule are positions in mjit's device list, as in mm.devices
    rows = [tuple(dev_ids[x] for x in sub) for sub in sched.devices]
    used = {tuple(c["devices"]) for c in in_loop}
    if len(sched.orders) != len(rows) or len(set(rows)) != len(rows) or set(rows) != used:
        raise FuzzFailure("schedule", f"schedule rows on submeshes {rows}, fragments run on "
                          f"{sorted(used)}; plan:\n{compiled.plan()}", p)
    flat = sorted(i for row in sched.orders for i in row)
    if flat != list(range(len(sched.units))) or sorted(sched.order) != flat:
        raise FuzzFailure("schedule", f"schedule rows {sched.orders} / order {sched.order} do "
                          f"not hold each of the {len(sched.units)} units once", p)
    names = {fr["name"] for fr in frags}
    for u in sched.units:
        if u.fragment not in names or rows[u.mesh] != tuple(
                next(fr["devices"] for fr in frags if fr["name"] == u.fragment)):
            raise FuzzFailure("schedule", f"unit {u} is no fragment on its row's submesh", p)
    pos = {i: k for k, i in enumerate(sched.order)}
    for u in sched.units:  # the global order runs every unit after the units it reads
        if any(pos[d] >= pos[u.index] for d in u.deps):
            raise FuzzFailure("schedule", f"unit {u.fragment} is dispatched before one of its "
                              f"inputs; order {sched.order}", p)
    for row in sched.orders:  # and merges the per-submesh orders
        if [pos[i] for i in row] != sorted(pos[i] for i in row):
            raise FuzzFailure("schedule", f"global order {sched.order} does not keep row {row}",
                              p)
    if sched.name != mb.schedule:
        raise FuzzFailure("schedule", f"schedule {sched.name!r}, asked for {mb.schedule!r}", p)
    # a task whose every call reads the microbatch runs forward once per call and
    # microbatch, tagged with it (one that does not may be computed once, for microbatch 0)
    sliced = _microbatched_tasks(p)
    per: dict[str, collections.Counter] = {}
    for u in sched.units:
        if u.kind == "fwd" and u.microbatch is not None and u.task in sliced:
            per.setdefault(u.task, collections.Counter())[u.microbatch] += 1
    for task, cnt in sorted(per.items()):
        if set(cnt) != set(range(mb.num_microbatches)) or len(set(cnt.values())) != 1:
            raise FuzzFailure("schedule", f"forward units of task {task!r} per microbatch: "
                              f"{dict(sorted(cnt.items()))} (M = {mb.num_microbatches}); "
                              f"schedule:\n{sched.labels()}", p)
    exact = any(t in per for t in sliced)
    if sched.num_microbatches > mb.num_microbatches or (
            exact and sched.num_microbatches != mb.num_microbatches):
        raise FuzzFailure("schedule", f"{sched.num_microbatches} microbatches in the "
                          f"schedule, {mb.num_microbatches} in the program", p)
    if mb.interleave and set(_stages_per_submesh(sched).values()) != {mb.interleave}:
        raise FuzzFailure("schedule", f"interleave={mb.interleave} accepted, but the "
                          f"submeshes run {_stages_per_submesh(sched)} stages", p)
    live, bubble = sched.live_activations(), sched.bubble_fraction()
    if len(live) != len(sched.orders) or not 0.0 <= bubble < 1.0:
        raise FuzzFailure("schedule", f"live activations {live}, bubble {bubble}", p)
    # peak live activations: the library's count against a model written from the
    # docstring of multimesh.passes.schedules.live_activation_profile (_expected_live)
    _check_live(p, sched)
    # the same units under every schedule (pure Python, no compile): on every submesh that
    # runs one stage 1F1B holds no more activations than GPipe (with V stages on a submesh
    # Megatron's warm-up runs up to (P-1)*2 + (V-1)*P forwards first, which on these DAGs
    # can exceed what GPipe's repaired order holds); ZB-H1 stays under 1F1B's peak (docs),
    # the largest over submeshes (a later stage may hold more under ZB-H1 than under 1F1B,
    # as in the paper). (ZB-H1's bubble is not always below 1F1B's on these DAGs: a
    # heuristic, not checked.)
    from multimesh.passes.schedules import build_schedule

    alt = {name: build_schedule(sched.units, name) for name in _PLAIN_SCHEDULES}
    peak = {name: _check_live(p, a) for name, a in alt.items()}
    f1, gp, zb = peak["1f1b"], peak["gpipe"], peak["zero-bubble-h1"]
    one_stage = {m for m, k in _stages_per_submesh(sched).items() if k == 1}
    for bad, what in ((any(f1[m] > gp[m] for m in one_stage), f"1f1b {f1} > gpipe {gp}"),
                      (max(zb, default=0) > max(f1, default=0), f"zero-bubble-h1 {zb} > 1f1b "
                       f"{f1} at the peak")):
        if bad:
            raise FuzzFailure("schedule", f"peak live activations per submesh: {what}", p)


def _expected_live(sched) -> list[int]:
    """Per submesh, the peak number of live activations: ``(stage, microbatch)`` is live
    from its first forward unit until its last backward unit on that submesh (stages
    without a backward hold nothing)."""
    peaks = []
    for row in sched.rows():
        first_f: dict = {}
        last_b: dict = {}
        for k, u in enumerate(row):
            if u.free:
                continue
            key = (u.stage, u.microbatch)
            if u.kind == "fwd":
                first_f.setdefault(key, k)
            elif u.kind in ("bwd", "bwd_w"):
                last_b[key] = k
        peak = 0
        for k in range(len(row)):
            peak = max(peak, sum(1 for key, f in first_f.items()
                                 if key in last_b and f <= k < last_b[key]))
        peaks.append(peak)
    return peaks


def _check_live(p: ProgramSpec, sched) -> list[int]:
    """The library's ``live_activations()``, checked against :func:`_expected_live`;
    returns the expected peaks."""
    want = _expected_live(sched)
    have = list(sched.live_activations())
    if have != want:
        raise FuzzFailure("schedule", f"{sched.name}: live_activations() {have}, "
                          f"expected {want}; rows {sched.labels()}", p)
    return want


def _stages_per_submesh(sched) -> dict[int, int]:
    stages: dict[int, set] = {}
    for u in sched.units:
        if not u.free:
            stages.setdefault(u.mesh, set()).add(u.stage)
    return {m: len(v) for m, v in stages.items()}


def _check_interleave_error(p: ProgramSpec, e: Exception, t0: float) -> Outcome:
    """``interleave=k`` was rejected: right only if some submesh does not run k stages.

    The generator predicts the stages from the spec; the library derives them from the
    fragments. Compile again without ``interleave`` and count."""
    import time

    import multimesh.jax as mm

    q = dataclasses.replace(p, microbatch=dataclasses.replace(p.microbatch, interleave=None))
    ns = build(q)
    try:
        sched = mm.mjit(ns["program"], devices=ns["devices"]).lower(*ns["args"]) \
            .compile().schedule
    except Exception as e2:
        raise FuzzFailure("crash", f"without interleave: {type(e2).__name__}: {e2}", p) from e2
    counts = _stages_per_submesh(sched) if sched is not None else {}
    if counts and set(counts.values()) == {p.microbatch.interleave}:
        raise FuzzFailure("unexpected-error", f"every pipelined submesh runs "
                          f"{p.microbatch.interleave} stages, yet: {e}", p) from e
    return Outcome("interleave-mismatch", seconds=time.perf_counter() - t0)


def _check_warnings(p: ProgramSpec, compiled, caught) -> None:
    """A schedule that cannot apply says so -- exactly when the loop has one pipeline stage
    and the schedule is not GPipe's order; any other warning is passed on to the caller."""
    skipped = [w for w in caught if "does not apply" in str(w.message)]
    sched = compiled.schedule if p.microbatch else None
    single = sched is not None and len(sched.orders) == 1
    if p.microbatch and single and p.microbatch.schedule != "gpipe" and not skipped:
        raise FuzzFailure("warning", f"schedule {p.microbatch.schedule!r} ran on one stage "
                          "without a warning that it does not apply", p)
    if skipped and not single:
        raise FuzzFailure("warning", f"warned {str(skipped[0].message)!r} on a "
                          f"{len(sched.orders) if sched else 0}-stage loop", p)
    _check_not_applied(p, sched, caught, single)
    for w in caught:
        if w not in skipped and not _not_applied(w):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _not_applied(w) -> bool:
    return any(s in str(w.message) for s in ("has nothing to interleave",
                                              "has no weight-gradient half"))


def _check_not_applied(p: ProgramSpec, sched, caught, single: bool) -> None:
    """Interleaving with one stage per submesh, or zero-bubble with no weight half, warns
    -- exactly then."""
    if sched is None or single or p.microbatch.schedule == "gpipe":
        return
    units = [u for u in sched.units if not u.free]
    stages: dict[int, set] = {}
    for u in units:
        stages.setdefault(u.mesh, set()).add(u.stage)
    expect = ((p.microbatch.schedule == "interleaved-1f1b"
               and all(len(v) == 1 for v in stages.values()))
              or (p.microbatch.schedule.startswith("zero-bubble")
                  and not any(u.kind == "bwd_w" for u in units)))
    warned = any(_not_applied(w) for w in caught)
    if expect != warned:
        raise FuzzFailure("warning", f"schedule {p.microbatch.schedule!r} "
                          f"{'ran as 1F1B without' if expect else 'warned with'} a warning "
                          f"that it has nothing to interleave or split; schedule units "
                          f"{units}", p)


def check(p: ProgramSpec, *, rtol: float = 1e-4, atol: float = 1e-4,
          known_bugs: frozenset = frozenset(KNOWN_BUGS)) -> Outcome:
    """Run ``p`` through ``mjit`` and plain JAX; raise :class:`FuzzFailure` on any mismatch."""
    import time

    import jax
    import numpy as np

    import multimesh.jax as mm
    from multimesh._src.errors import LogicalShardingError, MultimeshError

    t0 = time.perf_counter()
    ns = build(p)
    program, args, devices = ns["program"], ns["args"], ns["devices"]
    ids = [d.id for d in devices]
    predicted = predict_error(p)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = mm.mjit(program, devices=devices).lower(*args).compile()
        out = compiled(*args)
        out = jax.block_until_ready(out)
    except LogicalShardingError as e:
        if predicted == "none":
            raise FuzzFailure("unexpected-error", f"{type(e).__name__}: {e}", p) from e
        if "does not evenly divide" not in str(e):
            raise FuzzFailure("unclear-error", f"{type(e).__name__}: {e}", p) from e
        return Outcome("expected-error", seconds=time.perf_counter() - t0)
    except MultimeshError as e:
        if p.microbatch and p.microbatch.interleave and "pipeline stage(s)" in str(e):
            return _check_interleave_error(p, e, t0)
        cause = getattr(e, "cause", None)
        if predicted != "none" and isinstance(cause, LogicalShardingError) or (
                predicted != "none" and "does not evenly divide" in str(e)):
            return Outcome("expected-error", seconds=time.perf_counter() - t0)
        raise FuzzFailure("unexpected-error", f"{type(e).__name__}: {e}", p) from e
    except Exception as e:
        raise FuzzFailure("crash", f"{type(e).__name__}: {e}", p) from e
    if predicted == "must":
        raise FuzzFailure("missing-error",
                          "a live constraint does not divide its dimension but compile "
                          "succeeded", p)
    with mm.ignore_transforms():  # traced inside the context: plain JAX, jitted for speed
        ref = ns["reference"](*args) if p.microbatch else jax.jit(program)(*args)
    o_leaves, o_tree = jax.tree.flatten(out)
    r_leaves, r_tree = jax.tree.flatten(ref)
    if o_tree != r_tree:
        raise FuzzFailure("structure", f"mjit returned {o_tree}, plain JAX {r_tree}", p)
    for k, (o, r) in enumerate(zip(o_leaves, r_leaves)):
        o_np, r_np = np.asarray(o), np.asarray(r)
        if o_np.shape != r_np.shape or o_np.dtype != r_np.dtype:
            raise FuzzFailure("mismatch", f"output {k}: {o_np.shape}/{o_np.dtype} vs "
                              f"{r_np.shape}/{r_np.dtype}", p)
        if not np.allclose(o_np, r_np, rtol=rtol, atol=atol):
            err = float(np.max(np.abs(o_np - r_np)))
            raise FuzzFailure("mismatch", f"output leaf {k} differs from plain JAX by {err}; "
                              f"plan:\n{compiled.plan()}", p)
    # a second call on inputs already placed where the program wants them: same results,
    # and the caller's arrays survive (the runtime frees only its own intermediates)
    try:
        placed = jax.device_put(tuple(args), compiled.input_shardings[0])
        again = jax.block_until_ready(compiled(*placed))
    except Exception as e:
        raise FuzzFailure("second-call", f"{type(e).__name__}: {e}", p) from e
    for k, (o, a) in enumerate(zip(o_leaves, jax.tree.leaves(again))):
        if not np.array_equal(np.asarray(o), np.asarray(a)):
            raise FuzzFailure("second-call", f"output leaf {k} differs on a second call", p)
    for k, a in enumerate(jax.tree.leaves(placed)):
        if a.is_deleted():
            raise FuzzFailure("second-call", f"input leaf {k} was deleted by the call", p)
    # placement of outputs
    task_devs = [frozenset(ids[x] for x in t.devices) for t in p.tasks]
    known: set[str] = set()
    prod = _producers(p)
    expect: list[frozenset | None] = []
    if p.grad:
        loss_devs = task_devs[p.loss_task] if p.loss_task is not None else None
        expect.append(loss_devs)
        for i in grad_argnums(p):
            gt, _ = _expected_grad_task(p, i)
            expect.append(task_devs[gt] if gt is not None else None)
    else:
        for o in p.outputs:
            pr = prod[o]
            expect.append(task_devs[pr[1]] if pr[0] == "task" else None)
    for k, (o, want) in enumerate(zip(o_leaves, expect)):
        have = frozenset(d.id for d in o.devices())
        if want is not None and have != want:
            raise FuzzFailure("placement", f"output leaf {k} lives on {sorted(have)}, its task "
                              f"runs on {sorted(want)}; plan:\n{compiled.plan()}", p)
        if want is None and have not in task_devs and have != frozenset(ids):
            raise FuzzFailure("placement", f"output leaf {k} lives on {sorted(have)}, which is "
                              f"no task's device set; plan:\n{compiled.plan()}", p)
    # every fragment runs on its task's devices
    by_name = {t.name: task_devs[i] for i, t in enumerate(p.tasks)}
    # values no task touches (e.g. the zero gradient of an unused input) form the implicit
    # task mm.default on all devices (docs/ir.md section 2)
    by_name.setdefault("mm.default", frozenset(ids))
    names = [fr["name"] for fr in compiled.fragments]
    if len(set(names)) != len(names):
        raise FuzzFailure("fragments", f"duplicate fragment names {names}", p)
    for fr in compiled.fragments:
        # under microbatch the task of microbatch i is named '<task>_mb<i>'
        task = _MB_SUFFIX.sub("", fr["task"]) if p.microbatch else fr["task"]
        want = by_name.get(task)
        if want is not None and frozenset(fr["devices"]) != want:
            raise FuzzFailure("fragments", f"fragment {fr['name']} of task {fr['task']} runs on "
                              f"{fr['devices']}, the task on {sorted(want)}", p)
        if want is None and task not in by_name:
            raise FuzzFailure("fragments", f"fragment {fr['name']} has unknown task "
                              f"{fr['task']!r}", p)
    if p.microbatch:
        _check_schedule(p, compiled, ids)
    _check_warnings(p, compiled, caught)
    return Outcome("ok", len(names), len(compiled.transfers), time.perf_counter() - t0,
                   tuple(sorted(known)))

