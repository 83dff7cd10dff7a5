"""The error catalogue: every user-facing multimesh error, as data.

Each :class:`Entry` names an error (``id``, kebab-case), its category, how to
provoke it (a ``trigger()`` for Python errors; ``mm-opt`` argv plus an input file
for CLI errors), what must come out (exception class or exit code, and a regex the
message must match) and a short "what it means / how to fix".

``tests/test_error_catalogue.py`` runs every entry; ``tools/gen_errors_doc.py``
renders ``docs/errors.md`` from it, with each example message captured by running
the trigger. An entry with ``issue`` set documents an error that is missing,
unclear or raised with the wrong class today: its ``exc``/``match`` say what we
*want*, and its test is a strict xfail until the library is fixed.

Python triggers are ``@error(...)``-decorated functions whose body is shown in the
docs, so keep them short and self-contained (the helpers below are shown too).
Jax must already be configured for 8 CPU devices when this module is imported
(the root conftest does it; so does the doc generator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import shlex
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import multimesh.jax as mm
from multimesh.jax.errors import (
    DiagnosticError,
    DiagnosticWarning,
    DonationError,
    IRContractError,
    LogicalShardingError,  # noqa: F401  (documented class; resolved in passes)
    MeshError,
    MultimeshAttributeError,
    MultimeshError,
    MultimeshTypeError,
    MultimeshValueError,
    MultimeshWarning,
    PassFailure,
    PipelineError,
    ScheduleError,
    ScheduleTypeError,
)

ROOT = Path(__file__).resolve().parent.parent

API = "API misuse"
MESHES = "Bad meshes"
LOGICAL = "Bad logical mappings"
SHAPES = "Non-dividing shapes"
SCHEDULES = "Schedule misuse"
IMPLICIT = "Implicit tasks"
FLAX = "Flax"
SHARDY = "Shardy:MPMD programs"
MULTI = "Multi-process runs"
CLI = "CLI misuse (mm-opt)"
CATEGORIES = (API, MESHES, LOGICAL, SHAPES, SCHEDULES, IMPLICIT, FLAX, SHARDY, MULTI, CLI)

_ID_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One user-facing error."""

    id: str
    category: str
    title: str
    match: str  # re.search(match, message, re.DOTALL) must succeed
    fix: str  # what it means / how to fix
    # Python errors
    exc: type[BaseException] | None = None
    trigger: Callable[[], object] | None = None
    check: Callable[[BaseException], None] | None = None  # extra assertions
    # CLI errors
    argv: tuple[str, ...] | None = None  # mm-opt arguments; run in a directory holding in.mlir
    tool: str = "mm-opt"  # or "python -m multimesh.launch"
    input_text: str | None = None  # written to in.mlir when given
    input_bytes: bytes | None = None  # written to in.mlir as is (not UTF-8 text)
    input_shown: str | None = None  # how docs/errors.md shows input_bytes (e.g. bytecode)
    exit_code: int | None = None
    # known problem: the test is xfail(strict=True, reason=issue) until fixed
    issue: str | None = None
    requires: tuple[str, ...] = ()  # optional modules the trigger imports

    @property
    def is_cli(self) -> bool:
        return self.argv is not None

    @property
    def builtin(self) -> type[BaseException] | None:
        """The builtin exception class ``exc`` also inherits (ValueError, TypeError, ...)."""
        if self.exc is None:
            return None
        for cls in self.exc.__mro__:
            if cls.__module__ == "builtins" and cls not in (Exception, BaseException, object):
                return cls
        return None

    @property
    def is_warning(self) -> bool:
        """A warning entry: the trigger must warn ``exc`` (a ``MultimeshWarning``)."""
        return self.exc is not None and issubclass(self.exc, Warning)

    def source(self) -> str:
        """The trigger's body (Python) or the command line (CLI), for the docs."""
        if self.is_cli:
            return f"{self.tool} " + shlex.join(self.argv)
        return function_body(self.trigger)


ENTRIES: list[Entry] = []


def error(id: str, category: str, title: str, exc: type[BaseException], match: str, fix: str,
          *, issue: str | None = None, check: Callable | None = None,
          requires: tuple[str, ...] = ()):
    """Decorator: register the decorated function as the trigger of a Python error."""

    def register(fn):
        ENTRIES.append(Entry(id=id, category=category, title=title, match=match,
                             fix=" ".join(fix.split()), exc=exc, trigger=fn, check=check,
                             issue=issue, requires=requires))
        return fn

    return register


def warning(id: str, category: str, title: str, exc: type[Warning], match: str, fix: str,
            *, issue: str | None = None, check: Callable | None = None,
            requires: tuple[str, ...] = ()):
    """Decorator: register the decorated function as the trigger of a warning.

    The trigger runs with ``exc`` turned into an error, so the outcome is the first
    such warning, checked like an error (class and message).
    """
    return error(id, category, title, exc, match, fix, issue=issue, check=check,
                 requires=requires)


def cli(id: str, title: str, argv: list[str], exit_code: int, match: str, fix: str, *,
        input_text: str | None = None, input_bytes: bytes | None = None,
        input_shown: str | None = None, issue: str | None = None) -> None:
    ENTRIES.append(Entry(id=id, category=CLI, title=title, match=match,
                         fix=" ".join(fix.split()), argv=tuple(argv), input_text=input_text,
                         input_bytes=input_bytes, input_shown=input_shown,
                         exit_code=exit_code, issue=issue))


LAUNCH = "python -m multimesh.launch"


def launch(id: str, title: str, argv: list[str], match: str, fix: str) -> None:
    """A ``python -m multimesh.launch`` command line it refuses (argparse: exit code 2)."""
    ENTRIES.append(Entry(id=id, category=MULTI, title=title, match=match,
                         fix=" ".join(fix.split()), argv=tuple(argv), exit_code=2, tool=LAUNCH))


def function_body(fn: Callable) -> str:
    """Source of ``fn`` without its decorator and ``def`` line, dedented."""
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("def "))
    while not lines[start].rstrip().endswith(":"):
        start += 1
    return textwrap.dedent("\n".join(lines[start + 1:])).strip("\n")


# --------------------------------------------------------------------------- helpers
# Shown in docs/errors.md ("Helpers"); the examples use them.


def mesh4(first: int = 0) -> mm.TaskMesh:
    """A task mesh with one axis ``x`` of size 4 on device positions first..first+3."""
    return mm.TaskMesh(devices=range(first, first + 4), axis_names=("x",), axis_sizes=(4,))


def two_stage():
    """A two-stage pipeline: task ``s0`` on positions 0-3, ``s1`` on 4-7.

    Returns ``(grad_fn, ws, x)`` where ``grad_fn = value_and_grad(loss)`` and ``x``
    is a batch of 16 rows.
    """
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=mesh4(0))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mesh4(4))

    def loss(ws, x):
        return (s1(ws[1], s0(ws[0], x)) ** 2).sum()

    return jax.value_and_grad(loss), [jnp.eye(16), jnp.eye(16)], jnp.ones((16, 16))


def pipelined():
    """The two-stage pipeline of :func:`two_stage`, compiled with 2 microbatches."""
    grad_fn, ws, x = two_stage()
    return mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1)).lower(ws, x).compile()


def layered_model(ws, x):
    """A plain model whose layers are named scopes ``layer0`` and ``layer1``."""
    with jax.named_scope("layer0"):
        x = jnp.tanh(x @ ws[0])
    with jax.named_scope("layer1"):
        x = jnp.tanh(x @ ws[1])
    return x.sum()


def layered_args():
    return [jnp.eye(16), jnp.eye(16)], jnp.ones((8, 16))


def global_mesh() -> mm.MultiMesh:
    """A MultiMesh over the 8 devices with axes ``stage`` (2) and ``x`` (4)."""
    return mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))


def partitioned_identity() -> str:
    """The smallest Shardy:MPMD-partitioned program: ``@main`` returns its argument,
    which lives on mesh ``m1`` (``x=4``)."""
    t = '!mpmd.mesh_tensor<"m1", tensor<8xf32>>'
    return (f"func.func public @main(%x: {t}) -> {t} attributes "
            f'{{topology = #mpmd.topology<<"m1" : <["x"=4]>>>}} {{\n'
            f"  return %x : {t}\n}}\n")


def calling_back(op: str) -> str:
    """A Shardy:MPMD-partitioned program whose one fragment (on mesh ``m1``, ``x=4``)
    runs ``op`` on its argument ``%a`` (a ``tensor<8xf32>``) and returns it."""
    t = '!mpmd.mesh_tensor<"m1", tensor<8xf32>>'
    return (f"func.func public @main(%x: {t}) -> {t} attributes "
            f'{{topology = #mpmd.topology<<"m1" : <["x"=4]>>>}} {{\n'
            f'  %0 = mpmd.fragment_call<mesh="m1", origin=["f"]> @f(%x) : ({t}) -> {t}\n'
            f"  return %0 : {t}\n}}\n"
            "func.func @f(%a: tensor<8xf32>) -> tensor<8xf32> attributes "
            f'{{mesh_shape = #sdy.mesh<["x"=4]>}} {{\n  {op}\n'
            "  return %a : tensor<8xf32>\n}\n")


def transfer_program(topology: str) -> str:
    """A partitioned program that moves its argument from mesh m1 to m2."""
    t1, t2 = '!mpmd.mesh_tensor<"m1", tensor<8xf32>>', '!mpmd.mesh_tensor<"m2", tensor<8xf32>>'
    return (f"func.func public @main(%x: {t1}) -> {t2} attributes {{topology = {topology}}} "
            f"{{\n  %0 = mpmd.transfer %x : ({t1}) -> {t2}\n  return %0 : {t2}\n}}\n")


HELPERS = (mesh4, two_stage, layered_model, layered_args, global_mesh, partitioned_identity,
           calling_back, transfer_program)


def _repro_check(pass_argument: str):
    def check(e):
        assert e.pass_argument == pass_argument, e.pass_argument
        assert e.repro and e.repro.startswith("mm-opt "), e.repro
        assert pass_argument in e.repro

    return check


# =========================================================================== API misuse


@error("task-unknown-keyword", API, "`task` got an option it does not know",
       MultimeshTypeError,
       r"`task` got unexpected keyword argument\(s\) \['meshes'\]; valid options are \[.*'mesh'",
       """`task` (and `multimesh.jax.flax.task`) accept the fields of `Task` plus the
       legacy `devices=`/`device_axes=`. Check the spelling against the valid options
       listed in the message.""")
def _():
    mm.task(lambda x: x, name="t", meshes=mesh4())


@error("task-not-callable", API, "`task` wraps something that is not a function",
       MultimeshTypeError, r"`task` expects a callable, got int",
       """The first argument of `task` is the function the task runs. Options go in
       keywords: `task(f, name=..., mesh=...)`.""")
def _():
    mm.task(3, name="t")


@error("task-spec-and-options", API, "`task` given both `task=` and keyword options",
       MultimeshValueError,
       r"Task 't': give either `task=` or keyword options, not both \(got \['logical_axes'\]\)",
       """Either pass a complete `Task(...)` as `task=`, or pass its fields as keywords;
       to change one field of an existing Task use `dataclasses.replace(task, ...)`.""")
def _():
    mm.task(lambda x: x, name="t", task=mm.Task(mesh=mesh4()), logical_axes=())


@error("task-mesh-and-devices", API, "`task` given both `mesh` and `devices`",
       MultimeshValueError, r"Task 't': cannot give both `mesh` and `devices`/`device_axes`",
       """`devices=`/`device_axes=` is the older spelling of `mesh=`. Give one of them,
       preferably `mesh=TaskMesh(...)`.""")
def _():
    mm.task(lambda x: x, name="t", mesh=mesh4(), devices=[0, 1, 2, 3], device_axes=("x",))


@error("task-device-axes-without-devices", API, "`device_axes` without `devices`",
       MultimeshValueError, r"Task 't': `device_axes` needs `devices`",
       """`device_axes` names the axes of the `devices` array; without `devices` there is
       nothing to name. Use `mesh=TaskMesh(devices=..., axis_names=..., axis_sizes=...)`.""")
def _():
    mm.task(lambda x: x, name="t", device_axes=("x",))


@error("mjit-not-callable", API, "`mjit` given something that is not a function",
       MultimeshTypeError, r"`mjit` expects a callable, got int",
       """`mjit(f, ...)` compiles a function; pass the function itself.""")
def _():
    mm.mjit(3)


@error("compiled-wrong-structure", API,
       "A compiled program called with arguments of another structure", MultimeshValueError,
       r"Compiled function called with arguments of structure PyTreeDef\(\(\(\*,\), \{\}\)\), "
       r"but it was compiled for PyTreeDef\(\(\(\*, \*\), \{\}\)\)",
       """`mjit(f).lower(...).compile()` is specialised to the argument structure it was
       lowered with. Call it with the same pytree structure, or call `mjit(f)` directly,
       which recompiles for new structures.""")
def _():
    compiled = mm.mjit(lambda x, y: x + y).lower(jnp.ones(4), jnp.ones(4)).compile()
    compiled(jnp.ones(4))


@error("compiled-wrong-shape", API, "A compiled program called with other shapes",
       MultimeshTypeError, r"(?=.*float32\[5\])(?=.*float32\[4\])",
       """A compiled program is specialised to the shapes and dtypes it was lowered with.
       Lower it again for the new shapes, or call `mjit(f)` directly.""")
def _():
    compiled = mm.mjit(lambda x, y: x + y).lower(jnp.ones(4), jnp.ones(4)).compile()
    compiled(jnp.ones(5), jnp.ones(5))


@error("shardings-not-a-prefix", API, "`in_shardings` does not match the arguments",
       MultimeshValueError,
       r"`in_shardings`/`out_shardings` must be a prefix of the arguments/outputs "
       r"\(as for jax.jit\).*length 3.*length 2",
       """As for `jax.jit`, `in_shardings` is a pytree prefix of the positional arguments
       (one entry per argument, or one spec for all) and `out_shardings` of the outputs.""")
def _():
    mm.mjit(lambda x, y: x + y, in_shardings=(P("batch"), P("batch"), P()))(
        jnp.ones(4), jnp.ones(4))


@error("mjit-duplicate-devices", API, "`mjit` given the same device twice",
       MultimeshValueError, r"(?i)devices.*(distinct|twice|more than once)",
       """The program's device list names each device once; task meshes refer to
       positions in it.""")
def _():
    mm.mjit(lambda x: x * 2, devices=[jax.devices()[0]] * 2)(jnp.ones(8))


@error("mjit-unhashable-static-argument", API, "A static argument is not hashable",
       MultimeshTypeError, r"static.*1.*hashable",
       """Arguments named in `static_argnums` are part of the compilation cache key and
       must be hashable: pass a tuple instead of a list, or make the argument dynamic.""")
def _():
    mm.mjit(lambda x, n: x * len(n), static_argnums=1)(jnp.ones(8), [1])


@error("mjit-donate-argnum-out-of-range", API, "`donate_argnums` beyond the parameters",
       MultimeshValueError,
       r"`mjit` donate_argnums=\(3,\) names argument 3, but `<lambda>` takes 2 positional "
       r"arguments \(valid indices are -2\.\.1\)",
       """As for `jax.jit`, `donate_argnums` are checked against the function's signature
       when `mjit` is called; negative ones count from the end.""")
def _():
    mm.mjit(lambda x, y: x + y, donate_argnums=3)


@error("mjit-static-argnum-out-of-range", API, "`static_argnums` beyond the parameters",
       MultimeshValueError,
       r"`mjit` static_argnums=\(2,\) names argument 2, but `<lambda>` takes 2 positional "
       r"arguments \(valid indices are -2\.\.1\)",
       """As for `jax.jit`, `static_argnums` are checked against the function's signature
       when `mjit` is called; negative ones count from the end.""")
def _():
    mm.mjit(lambda x, n=1: x * n, static_argnums=2)


@error("mjit-argnum-beyond-call", API, "`static_argnums`/`donate_argnums` beyond a call's arguments",
       MultimeshValueError,
       r"`mjit` static_argnums names argument 2, but the function was called with 1 "
       r"positional argument \(valid indices are 0\.\.0\)",
       """For a function taking `*args` the positions are checked at each call: pass the
       static or donated argument positionally.""")
def _():
    mm.mjit(lambda *xs: xs[0], static_argnums=2)(jnp.ones(4))


@error("mjit-duplicate-argnums", API, "An argument listed twice in `static_argnums` and the like",
       MultimeshValueError,
       r"`mjit` static_argnums=\(1, -1\) names the same argument twice \(-1\); list each "
       r"argument once",
       """Each argument appears once in `static_argnums`, `static_argnames`,
       `donate_argnums` and `donate_argnames` (negative positions count from the end;
       `jax.jit` ignores duplicates, multimesh names them).""")
def _():
    mm.mjit(lambda x, n: x * n, static_argnums=(1, -1))


@error("mjit-unknown-argname", API, "`static_argnames`/`donate_argnames` names no parameter",
       MultimeshValueError,
       r"`mjit` static_argnames names 'sclae', which is not one of its parameters of "
       r"`f`; names that can be given are \['x', 'scale'\]",
       """Argument names must be parameters that can be passed by keyword (any name, for a
       function taking `**kwargs`; never a positional-only one).""")
def _():
    def f(x, scale):
        return x * scale

    mm.mjit(f, static_argnames="sclae")


@error("mjit-static-and-donated", API, "An argument both static and donated",
       MultimeshValueError, r"`mjit` argument 1 is both static and donated",
       """A static argument is a Python value in the cache key, not an array with a buffer;
       it cannot also be donated.""")
def _():
    mm.mjit(lambda x, n: x * n, static_argnums=1, donate_argnums=1)


@error("mjit-argnums-type", API, "`static_argnums`/`donate_argnums` not integers",
       MultimeshTypeError, r"`mjit` static_argnums must be an int or a sequence of ints, got 'n'",
       """Positions are ints (names go in `static_argnames`/`donate_argnames`); a bool is
       not taken for a position.""")
def _():
    mm.mjit(lambda x, n: x * n, static_argnums="n")


@error("mjit-argnames-type", API, "`static_argnames`/`donate_argnames` not strings",
       MultimeshTypeError, r"`mjit` static_argnames must be a str or a sequence of str, got 1",
       """Names are strings (positions go in `static_argnums`/`donate_argnums`).""")
def _():
    mm.mjit(lambda x, n: x * n, static_argnames=1)


@error("mjit-donate-argnames-without-signature", API,
       "`donate_argnames` for a function without a signature", MultimeshValueError,
       r"cannot read the signature of `max`, so donate_argnames=\('x',\) cannot be "
       r"resolved; pass donate_argnums instead",
       """As for `jax.jit`: names need the signature (builtins have none); use positions.""")
def _():
    mm.mjit(max, donate_argnames="x")


@error("mjit-device-or-backend", API, "`mjit` given `device=` or `backend=`",
       MultimeshValueError, r"`mjit` does not take device=.*Pass `devices=` or `mesh=` instead",
       """`jax.jit` deprecates both; an MPMD program runs on a list of devices
       (`devices=` or `mesh=`), its tasks on submeshes of it.""")
def _():
    mm.mjit(lambda x: x, device=jax.devices()[0])


@error("mjit-inline", API, "`mjit` given `inline=True`", MultimeshValueError,
       r"`mjit` does not take inline=True",
       """An MPMD program runs in multimesh's runtime (one XLA executable per fragment) and
       cannot be inlined into an enclosing jax trace.""")
def _():
    mm.mjit(lambda x: x, inline=True)


@error("mjit-compiler-options", API, "`mjit` given `compiler_options=`", MultimeshValueError,
       r"`mjit` does not take compiler_options=.*XLA_FLAGS",
       """Fragments are compiled separately with XLA's defaults; XLA flags can be set
       through the `XLA_FLAGS` environment variable.""")
def _():
    mm.mjit(lambda x: x, compiler_options={"xla_cpu_enable_fast_math": True})


@error("mjit-stage-attribute-not-offered", API,
       "A `jax.stages` attribute that multimesh's stage does not offer",
       MultimeshAttributeError,
       r"`MpmdLowered.cost_analysis` is not offered, although `jax.stages.Lowered` has it: "
       r".*use `compile\(\)\.cost_analysis\(\)`",
       """The error says what to use instead (docs/mpmd-runtime.md lists every `jax.jit`
       feature and multimesh's answer). It is an `AttributeError`, so `hasattr` is
       False.""")
def _():
    mm.mjit(lambda x: x * 2).lower(jnp.ones(4)).cost_analysis()


@error("mjit-lowered-dialect", API, "`compiler_ir` asked for a dialect other than StableHLO",
       MultimeshValueError, r"dialect='hlo' is not offered \(valid: 'stablehlo'\)",
       """The lowered program is jax's StableHLO module, which the pass pipeline reads; HLO
       exists only per fragment, after `compile()`.""")
def _():
    mm.mjit(lambda x: x * 2).lower(jnp.ones(4)).compiler_ir("hlo")


@error("parallelize-without-batch", API, "`parallelize` without an example batch",
       MultimeshValueError,
       r"parallelize requires either a get_input_batch function or an initial_batch argument",
       """`parallelize` compiles `fun(params, batch)` ahead of time and needs the batch's
       shapes: pass `get_input_batch=` (a function returning a batch) or
       `initial_batch=`.""")
def _():
    mm.parallelize(lambda params, batch: params, init_params=lambda: jnp.ones(3))


@error("parallelize-without-init-params", API, "`parallelize` without `init_params`",
       MultimeshValueError, r"parallelize requires init_params",
       """`parallelize` places the parameters where their tasks want them, so it needs
       the function that creates them.""")
def _():
    mm.parallelize(lambda params, batch: params, initial_batch=jnp.ones(3))


@error("visualize-not-microbatched", API, "`visualize_schedule` on a program without a pipeline",
       MultimeshValueError, r"no pipeline schedule.*microbatch",
       """Only microbatched programs (`microbatch(...)`) have a pipeline schedule to
       draw.""")
def _():
    mm.visualize_schedule(mm.mjit(lambda x: x * 2).lower(jnp.ones(4)).compile())


@error("visualize-wrong-type", API, "`visualize_schedule` given something else",
       MultimeshTypeError, r"expects a compiled program, a module or a Schedule, got int",
       """Pass what `mjit(f).lower(...).compile()` returns, a module after
       `mm-schedule-fragments` (or its text), or a `Schedule`.""")
def _():
    mm.visualize_schedule(3)


@error("visualize-memory-wrong-type", API, "`visualize_schedule(memory=...)` given something else",
       MultimeshTypeError, r"`memory` must be True or a MemoryProfile.*got str",
       """`memory=True` draws each submesh's simulated live activations; a profile from
       `compiled.memory_profile(...)` adds what a real step measured beside them.""")
def _():
    from multimesh.schedules import build_schedule, pipeline_units

    mm.visualize_schedule(build_schedule(pipeline_units(2, 2), "1f1b"), memory="peak")


@error("microbatch-not-callable", API, "`microbatch` given something that is not a function",
       MultimeshTypeError, r"`microbatch` expects a callable, got int",
       """`microbatch(fun, dim=..., size=...)` wraps a function.""")
def _():
    mm.microbatch(3, dim=0, size=2)


@error("microbatch-argnum-out-of-range", API, "`microbatch` argnum beyond the arguments",
       MultimeshValueError, r"`microbatch` argnum=5 but the function got 2 positional arguments",
       """`argnum` is the position of the argument to slice into microbatches (the batch,
       usually 1 for `loss(params, batch)`).""")
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=5))(ws, x)


@error("microbatch-dim-out-of-range", API, "`microbatch` dim beyond the batch's rank",
       MultimeshValueError, r"`microbatch` dim=3 is out of range for a leaf of shape \(16, 16\)",
       """`dim` is the batch dimension of every leaf of the microbatched argument.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=3, size=8, argnum=1))(ws, x)


@error("compiled-deleted-argument", API, "A donated (deleted) array passed again",
       DonationError,
       r"Compiled function called with args\[0\]\[0\] of type float32\[16,16\], an array that "
       r"has been deleted: its buffer was donated to an earlier call \(`donate_argnums`\)",
       """A donated argument's buffer belongs to the call it was donated to: the array you
       passed is deleted afterwards. Pass the array that call returned in its place (for
       example `ws, loss = step(ws, x)`), as in a training loop. Plain `jax.jit` crashes on
       several devices here; multimesh checks before dispatching anything.""")
def _():
    grad_fn, ws, x = two_stage()
    step = mm.mjit(lambda ws, x: [w - 0.1 * g for w, g in zip(ws, grad_fn(ws, x)[1])],
                   donate_argnums=0)
    old = ws
    ws = step(ws, x)  # a training loop passes on what the step returned
    step(old, x)  # but `old` was donated to the first call


@error("compiled-donated-and-read", API, "One array passed as a donated and another argument",
       DonationError,
       r"Compiled function called with the same array as args\[0\] and args\[1\], but "
       r"args\[0\] is donated \(`donate_argnums`\) and args\[1\] is not donated",
       """A donated buffer is consumed by the call, so it cannot also be read as another
       argument. Pass a copy (`jnp.array(w, copy=True)`) as one of them, or do not donate
       it.""")
def _():
    a = mm.task(lambda a, b: a * 2 + b, name="a", mesh=mesh4(0))
    w = jnp.ones(8)
    mm.mjit(lambda a_, b_: a(a_, b_), donate_argnums=0)(w, w)


@error("mjit-devices-not-devices", API, "`mjit` given device positions instead of devices",
       MultimeshTypeError,
       r"`mjit` devices must be jax.Device objects, but entry 0 is int 0\. Device positions",
       """`mjit(devices=...)` is the program's device list: `jax.Device`s such as
       `jax.devices()[:4]`. Integer positions into that list are what `TaskMesh(devices=...)`
       takes.""")
def _():
    mm.mjit(lambda x: x * 2, devices=list(range(8)))


@error("mjit-no-devices", API, "`mjit` given an empty device list", MultimeshValueError,
       r"`mjit` devices is empty; give at least one jax.Device",
       """An empty list used to be ignored silently (the program ran on every device).
       Give the devices, or leave `devices=None` for all of `jax.devices()`.""")
def _():
    mm.mjit(lambda x: x * 2, devices=[])


@error("task-name-not-a-string", API, "A task name that is not a string", MultimeshTypeError,
       r"`task` name must be a string, got int 7",
       """Task names appear in the IR, in fragment names and in schedules; give a
       string.""")
def _():
    mm.task(lambda x: x, name=7, mesh=mesh4())


@error("microbatch-negative-argnum-out-of-range", API,
       "`microbatch` negative argnum beyond the arguments", MultimeshValueError,
       r"`microbatch` argnum=-5 but the function got 2 positional arguments \(valid: -2\.\.1\)",
       """Negative `argnum`s count from the end, as in Python indexing; it must name one of
       the positional arguments.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=-5))(ws, x)


@error("microbatch-unknown-reduction", API, "`microbatch` given an unknown reduction",
       MultimeshValueError,
       r"`microbatch` reduction must be one of 'sum', 'mean', got 'avg'",
       """`reduction="sum"` (the default, the original library's semantics) adds the microbatches'
       outputs, which is gradient accumulation; `reduction="mean"` averages them, which
       gives the full batch's loss and gradients for a loss that averages over its batch.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, reduction="avg")


@error("microbatch-mean-of-integers", API, "`reduction='mean'` with an integer output",
       MultimeshTypeError,
       r"`microbatch` reduction='mean' cannot average the integer output \[1\] \(dtype "
       r"int32\): the mean of integers is not an integer",
       """Under `reduction="mean"` every float output is averaged; an integer output (a
       count, say) has no mean in its own dtype, and rounding it silently would be wrong.
       Return it as a float, or use `reduction="sum"` and divide it yourself.""")
def _():
    def f(x):
        return x.mean(), jnp.sum(x > 0)

    mm.mjit(mm.microbatch(f, dim=0, size=4, reduction="mean"))(jnp.ones((16, 4)))


@error("microbatch-argnum-cuts-the-parameters", API,
       "`microbatch` cutting an argument that is not the batch", MultimeshValueError,
       r"`microbatch`'s function runs on the whole of argument 0 but fails on one microbatch "
       r"of it: argument 0 \(leaf shapes \[\(16, 16\), \(16, 16\)\]\) is cut along dim 0.*"
       r"Is argument 0 the batch\?",
       """`argnum` names the argument that is cut into microbatches. Here it names the
       weights: they happen to divide, but the function fails on a piece of them while it
       runs on the whole. Pass the batch's position as `argnum`.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=0))(ws, x)
@warning("task-traced-outside-mjit", API, "A task traced outside `mjit`", MultimeshWarning,
         r"Task 't' is traced outside `multimesh\.jax\.mjit` \(called eagerly, or under "
         r"jax\.jit or another jax transformation that runs it\), so its placement is "
         r"ignored: it runs as an ordinary jax call where jax puts it, not on its submesh "
         r"\(device positions \[0, 1, 2, 3\]\)\. The values are the same\. To place it, "
         r"compile the program with `multimesh\.jax\.mjit`",
         """Only `mjit` (and `parallelize`, `parallelize_step`) put tasks on their submeshes;
         eagerly or under `jax.jit` a task is an ordinary call (on jax's default device
         for uncommitted inputs). Warned when jax runs it, once per task and program (a
         trace that never runs, `jax.eval_shape`, is quiet). Compile
         the program with `mjit`, or call it under `ignore_transforms()` to run plain jax
         on purpose (a reference value, a debugging run).""")
def _():
    t = mm.task(lambda x: x * 2, name="t", mesh=mesh4())
    jax.jit(t)(jnp.ones(8))


@error("jax-with-sharding-constraint-in-task", API,
       "`jax.lax.with_sharding_constraint` with logical names in a task",
       MeshError,
       r"A sharding inside task 't' names the mesh axis 'batch' \(P\('batch',\)\), which the "
       r"task's mesh lacks: inside a task the mesh is the task's mesh, with the axes "
       r"\('x',\) \(sizes \(4,\)\)\. 'batch' is a logical name that the task maps "
       r"\('batch' -> 'x'\): name it with `multimesh\.jax\.with_sharding_constraint\(x, "
       r"spec\)`, which resolves logical names on each task's mesh\.",
       """Inside a task the mesh is the task's mesh: jax's constraint resolves a
       `PartitionSpec` against the task's own axes (`P("x")` here shards over the task's
       `x`, on its devices). A logical name is not one of them: the logical constraint,
       `multimesh.jax.with_sharding_constraint`, is the one that each task resolves
       through its `logical_axes`.""")
def _():
    t = mm.task(lambda x: lax.with_sharding_constraint(x, P("batch")), name="t",
                mesh=mesh4(), logical_axes=(("batch", "x"),))
    mm.mjit(t)(jnp.ones(8))


@error("logical-name-is-another-mesh-axis", API,
       "A logical name that is also a mesh axis of the task, mapped onto another axis",
       MeshError,
       r"Task 't' maps the logical name 'data' onto the mesh axis 'model', but 'data' is also "
       r"an axis of the task's mesh \('data', 'model'\)",
       """Inside a task the mesh is the task's mesh: `jax.lax.with_sharding_constraint`,
       flax's rules and explicit mode read `data` as the mesh axis `data`, while the pair
       makes multimesh's logical constraint read it as `model`. Name the logical axis
       apart from the mesh's axes, or map it onto itself.""")
def _():
    mesh = mm.TaskMesh(devices=range(4), axis_names=("data", "model"), axis_sizes=(2, 2))
    t = mm.task(lambda x: x * 2, name="t", mesh=mesh, logical_axes=(("data", "model"),))
    mm.mjit(t)(jnp.ones(8))


@error("collective-over-an-axis-the-task-lacks", API,
       "a collective in a stage over the axis its `mesh_slice` slices",
       MeshError,
       r"a `psum` in task 's0' runs over the mesh axis 'stage', which is sliced away \(the "
       r"task is one slice of it\); inside a task a collective runs among the task's devices "
       r"only, over the axes \['data'\] of its mesh \(sizes \[4\]\)",
       """A stage's body (an explicit task's, or a `register_task` stage's under an Auto
       mesh) is traced on the stage's own mesh, which has no sliced axis; under `jax.jit`
       on the global mesh the `psum` over `stage` would sum across the stages. jax's own
       error there is a bare `AssertionError` or "unbound axis name"; multimesh names the
       axis and the task. Reduce over the axes the stage keeps, or do the cross-stage
       step outside the stage.""")
def _():
    mesh = jax.make_mesh((2, 4), ("stage", "data"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    s0 = mm.task(lambda x: jax.shard_map(lambda x: lax.psum(x, "stage"), in_specs=P("data"),
                                         out_specs=P("data"))(x),
                 name="s0", mesh_slice={"stage": 0})
    with jax.set_mesh(mesh):
        mm.mjit(s0)(jnp.ones(8))


@error("shard-map-names-another-mesh", API,
       "a `shard_map` in a stage naming a mesh other than the stage's",
       MeshError,
       r"a `shard_map` in task 'layer_0' was traced on a mesh where the axis 'data' has "
       r"size 8, but the task's mesh gives it size 4: inside a task the mesh is the task's "
       r"mesh",
       """A stage's body is traced on the stage's own mesh, and jax runs a `shard_map`
       only on the mesh in context, so one that names another mesh (`mesh=`, here the
       8-device program mesh) cannot run in the stage. jax's own error there is "The
       context mesh ... should match the mesh passed to shard_map"; multimesh names the
       axis and the task. Leave out `mesh=`: the `shard_map` then runs on the stage's
       mesh.""")
def _():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def layer_0(x):
        with jax.named_scope("layer_0"):
            return jax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("data"),
                                 out_specs=P("data"))(x)

    with mm.context(), jax.set_mesh(mesh):
        mm.register_task("layer_0", task=mm.Task(mesh=mm.TaskMesh(
            devices=range(4), axis_names=("data",), axis_sizes=(4,))))
        mm.mjit(layer_0)(jnp.ones(8))


@error("shard-map-collective-over-a-sliced-axis", IMPLICIT,
       "a `shard_map` collective in a registered stage traced on the program's mesh over "
       "the axis its `mesh_slice` slices",
       PassFailure,
       r"a `psum` in a `shard_map` of task 'layer_0' runs over the mesh axis 'stage', which "
       r"is sliced away \(the task is one slice of it\); inside a task a collective runs "
       r"among the task's devices only \(positions \[0, 1, 2, 3\]\), over the axes "
       r"\['data'\]",
       """Under a mesh of `Explicit` axes a stage placed by a `register_task` rule is
       traced on the program's mesh (its values' types name that mesh), so its
       `shard_map` is manual over every axis of it; its collectives are renumbered onto
       the stage's own devices, which works for the axes the stage keeps. A collective
       over the sliced axis (written, or added by jax's gradient under
       `check_vma=False`) would need the other stages' devices. Reduce over the kept
       axes, keep `check_vma=True`, or do the cross-stage step outside the stage. (Under
       `Auto` axes the stage is traced on its own mesh, and the error is
       `collective-over-an-axis-the-task-lacks`.)""")
def _():
    mesh = jax.make_mesh((2, 4), ("stage", "data"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def layer_0(x):
        with jax.named_scope("layer_0"):
            return jax.shard_map(lambda x: lax.psum(x, "stage"), in_specs=P("data"),
                                 out_specs=P("data"))(jax.reshard(x, P("data")))

    with mm.context(), jax.set_mesh(mesh):
        mm.register_task("layer_0", task=mm.Task(mesh_slice={"stage": 0}))
        mm.mjit(layer_0)(jnp.ones(8))


@error("shard-map-traced-on-other-axis-sizes", IMPLICIT,
       "a `shard_map` in a registered stage traced on a mesh whose axis sizes differ",
       PassFailure,
       r"a `shard_map` in task 'layer_0' was traced on a mesh where the axis 'data' has "
       r"size 8, but the task's mesh gives it size 4",
       """Under a mesh of `Explicit` axes a registered stage is traced on the program's
       mesh, so its `shard_map` is traced there (here all 8 devices over `data`) but runs
       on the stage's mesh (`data=4`), where its per-device shapes would differ. Give the
       stage a mesh with the same axis sizes, use `Auto` axes (a registered stage is then
       traced on its own mesh), or trace the `shard_map` in an explicit
       `mm.task(..., mesh=...)`, which traces it on the stage's own mesh.""")
def _():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def layer_0(x):
        with jax.named_scope("layer_0"):
            return jax.shard_map(lambda x: x * 2, in_specs=P("data"),
                                 out_specs=P("data"))(jax.reshard(x, P("data")))

    with mm.context(), jax.set_mesh(mesh):
        mm.register_task("layer_0", task=mm.Task(mesh=mm.TaskMesh(
            devices=range(4), axis_names=("data",), axis_sizes=(4,))))
        mm.mjit(layer_0)(jnp.ones(8))


@error("multimesh-exit-without-enter", API, "`MultiMesh.__exit__` without `__enter__`",
       MultimeshValueError,
       r"MultiMesh\.__exit__ was called without a matching __enter__ in this thread",
       """Enter a `MultiMesh` (or `Context`) with `with` or use it as a decorator; a manual
       `__exit__` must follow an `__enter__` in the same thread.""")
def _():
    global_mesh().__exit__(None, None, None)



@error("compile-threads-not-a-count", API, "`MULTIMESH_COMPILE_THREADS` is not a thread count",
       MultimeshValueError,
       r"MULTIMESH_COMPILE_THREADS must be a positive whole number of threads, got 'all'; "
       r"for example MULTIMESH_COMPILE_THREADS=4, or MULTIMESH_COMPILE_THREADS=1 to compile "
       r"fragments serially",
       """Fragments compile on a pool of this many threads (default: the CPUs the process
       may use), read when a program compiles. Give a count, e.g.
       `MULTIMESH_COMPILE_THREADS=4`; `1` compiles one fragment after another.""")
def _():
    grad_fn, ws, x = two_stage()
    os.environ["MULTIMESH_COMPILE_THREADS"] = "all"
    try:
        mm.mjit(grad_fn).lower(ws, x).compile()
    finally:
        del os.environ["MULTIMESH_COMPILE_THREADS"]

@error("pipeline-options-invalid", API, "`multimesh.passes.PipelineOptions` given a bad value",
       PipelineError,
       r"PipelineOptions.split_backward must be a SplitBackward \(NONE, FLAGGED, ALL\), "
       r"got 'all'",
       "The pass door's options are typed: a device count, `SplitBackward` members, "
       "tuples of task names and `Rule` values. Use the enum, not its text.")
def _():
    from multimesh.passes import PipelineOptions

    PipelineOptions(8, split_backward="all")


# =========================================================================== bad meshes


@error("taskmesh-device-count-mismatch", MESHES, "TaskMesh devices and axis sizes disagree",
       MeshError,
       r"`TaskMesh` has 6 devices \(0, 1, 2, 3, 4, 5\) but axis_sizes \(2, 2\) describe 4 "
       r"devices; the product of the axis sizes must equal the number of devices",
       """A task mesh lays its devices out in a grid of `axis_sizes`; give exactly
       `prod(axis_sizes)` device positions.""")
def _():
    mm.TaskMesh(devices=range(6), axis_names=("x", "y"), axis_sizes=(2, 2))


@error("taskmesh-names-sizes-length", MESHES, "TaskMesh axis names and sizes differ in number",
       MeshError,
       r"`TaskMesh` got 2 axis names \('x', 'y'\) but 1 axis sizes \(4,\); give one size per name",
       """Give one size per axis name.""")
def _():
    mm.TaskMesh(devices=range(4), axis_names=("x", "y"), axis_sizes=(4,))


@error("taskmesh-duplicate-axis-names", MESHES, "TaskMesh axis names repeat", MeshError,
       r"`TaskMesh` axis names must be distinct strings, got \('x', 'x'\)",
       """Each axis of a task mesh needs its own name; logical axes are mapped onto these
       names.""")
def _():
    mm.TaskMesh(devices=range(4), axis_names=("x", "x"), axis_sizes=(2, 2))


@error("taskmesh-nonpositive-axis-size", MESHES, "TaskMesh axis size below 1", MeshError,
       r"`TaskMesh` axis sizes must be positive, got \(-2, -2\)",
       """Axis sizes count devices along each axis and must be at least 1.""")
def _():
    mm.TaskMesh(devices=range(4), axis_names=("x", "y"), axis_sizes=(-2, -2))


@error("taskmesh-devices-not-positions", MESHES, "TaskMesh given jax devices", MultimeshTypeError,
       r"`TaskMesh` devices must be integer positions in the program's device list, got "
       r"\[CpuDevice\(id=0\), CpuDevice\(id=1\)\]",
       """`TaskMesh` takes *positions* 0..N-1 in the program's device list (the `devices`
       given to `mjit`, all devices by default), so one program runs on any N devices.
       For concrete devices use `task(f, mesh=jax.sharding.Mesh(...))`.""")
def _():
    mm.TaskMesh(devices=jax.devices()[:2], axis_names=("x",), axis_sizes=(2,))


@error("taskmesh-no-devices", MESHES, "TaskMesh with no devices", MeshError,
       r"(?i)at least one device",
       """A task mesh needs at least one device position.""")
def _():
    mm.TaskMesh(devices=[])


@error("taskmesh-negative-device-position", MESHES, "TaskMesh with a negative device position",
       MeshError, r"`TaskMesh` device positions must be non-negative, got \(-1, 0\)",
       """Device positions index the program's device list, from 0.""")
def _():
    mm.TaskMesh(devices=[-1, 0], axis_names=("x",), axis_sizes=(2,))


@error("taskmesh-duplicate-device-position", MESHES, "TaskMesh lists a device twice", MeshError,
       r"`TaskMesh` device positions must be distinct, got \(0, 0\)",
       """Each device appears once in a mesh.""")
def _():
    mm.TaskMesh(devices=[0, 0], axis_names=("x",), axis_sizes=(2,))


@error("device-position-outside-program", MESHES,
       "A task mesh uses a position beyond the program's devices", MeshError,
       r"Task 'far' uses device position 4, outside the program's 4 devices "
       r"\(valid positions are 0\.\.3\)",
       """Task mesh positions refer to the program's device list: `mjit(..., devices=...)`,
       the active `MultiMesh`'s devices, or all of `jax.devices()`. Give the program more
       devices or move the task with `mesh.place(...)`.""")
def _():
    far = mm.task(lambda x: x * 2, name="far", mesh=mesh4(4))
    mm.mjit(far, devices=jax.devices()[:4])(jnp.ones(8))


@error("physical-in-sharding-outside-program", MESHES,
       "A physical input sharding on devices the program does not have", MeshError,
       r"`mjit` in_shardings for args\[0\] is NamedSharding\(.*\), on devices \[4, 5, 6, 7\], "
       r"but the program runs on devices \[0, 1, 2, 3\]\. No task maps its axis names "
       r"\['d'\], so it is a physical sharding",
       """A `NamedSharding` in `in_shardings` whose axis names no task maps fixes where the
       input lives (as for `jax.jit`), so it must use the program's devices. Pass
       `devices=`/`mesh=` to `mjit`, or write the sharding with logical names a task maps
       (e.g. `P("batch")`).""")
def _():
    sharding = NamedSharding(Mesh(jax.devices()[4:8], ("d",)), P("d"))
    mm.mjit(lambda x: x * 2, devices=jax.devices()[:4], in_shardings=sharding)(jnp.ones(8))


@error("device-outside-program", MESHES,
       "A task's jax Mesh uses a device the program does not have", MeshError,
       r"Task 'far' uses device cpu:4, which is not among the program's devices \[0, 1, 2, 3\]",
       """A task given a concrete `jax.sharding.Mesh` must use devices of the program's
       device list.""")
def _():
    far = mm.task(lambda x: x * 2, name="far", mesh=Mesh(jax.devices()[4:8], ("x",)))
    mm.mjit(far, devices=jax.devices()[:4])(jnp.ones(8))


@error("legacy-devices-rank-mismatch", MESHES, "`devices` array rank differs from `device_axes`",
       MeshError,
       r"Task 't': devices array has 2 dims \(shape \(2, 2\)\) but device_axes \('x',\) names 1",
       """With the legacy `devices=`/`device_axes=` spelling, the devices array has one
       dimension per axis name.""")
def _():
    mm.task(lambda x: x, name="t", devices=[[0, 1], [2, 3]], device_axes=("x",))


@error("tasks-on-two-submeshes-in-one-loop", MESHES,
       "Tasks on different submeshes inside one loop body", PassFailure,
       r"multimesh pass 'mm-assign-tasks' failed: tasks 'a' and 'b' run on different submeshes "
       r"but sit inside the same 'stablehlo.while'; a loop body runs on one submesh\. Unroll "
       r"the loop .* or give both tasks one submesh\.\nReproduce with:\n  mm-opt ",
       """A loop body is one program on one set of devices, so every task inside a
       `lax.scan`/`fori_loop`/`while_loop` must share a submesh. Unroll the loop (a Python
       `for` loop, or `lax.scan(..., unroll=True)`) or put both tasks on one submesh.""",
       check=_repro_check("mm-assign-tasks"))
def _():
    a = mm.task(lambda x: x * 2, name="a", mesh=mesh4(0))
    b = mm.task(lambda x: x + 1, name="b", mesh=mesh4(4))

    def f(x):
        return lax.scan(lambda c, _: (b(a(c)), None), x, None, length=3)[0]

    mm.mjit(f)(jnp.ones(8))


@error("taskmesh-fractional-axis-size", MESHES, "TaskMesh axis size that is not an integer",
       MultimeshTypeError, r"`TaskMesh` axis sizes must be integers, got 2\.7 \(float\)",
       """Axis sizes count devices; a float used to be truncated silently (2.7 became 2).""")
def _():
    mm.TaskMesh(devices=range(2), axis_names=("x",), axis_sizes=(2.7,))


@error("tasks-on-two-submeshes-in-one-cond", MESHES,
       "Tasks on different submeshes in the branches of one `lax.cond`", PassFailure,
       r"multimesh pass 'mm-assign-tasks' failed: tasks '.' and '.' run on different submeshes "
       r"but sit inside the same 'stablehlo.case'; the branches of a conditional \(lax\.cond, "
       r"lax\.switch\) run on one submesh",
       """A conditional is one op on one set of devices, so every task in its branches must
       share a submesh. Call both tasks outside the conditional and pick the result with
       `jnp.where`, or put them on one submesh.""",
       check=_repro_check("mm-assign-tasks"))
def _():
    a = mm.task(lambda x: x * 2, name="a", mesh=mesh4(0))
    b = mm.task(lambda x: x + 1, name="b", mesh=mesh4(4))
    mm.mjit(lambda p, x: lax.cond(p, a, b, x))(True, jnp.ones(8))


@error("multimesh-device-count-mismatch", MESHES, "`MultiMesh` axis sizes and devices disagree",
       MeshError, r"MultiMesh axis_sizes \(2, 2\) describe 4 devices but 8 devices were given",
       """`MultiMesh(axis_sizes=...)` reshapes its devices (all of `jax.devices()` by
       default) to `axis_sizes`; the sizes must multiply to the number of devices.""")
def _():
    mm.MultiMesh(axis_sizes=(2, 2), axis_names=("stage", "x"))


@error("multimesh-global-mesh-and-axes", MESHES, "`MultiMesh` given both a mesh and axes",
       MultimeshValueError,
       r"MultiMesh takes either `global_mesh` or `axis_sizes`/`axis_names`/`devices`, not both",
       """Either wrap an existing mesh (`MultiMesh(global_mesh=mesh)`) or describe one
       (`MultiMesh(axis_sizes=..., axis_names=...)`).""")
def _():
    mm.MultiMesh(global_mesh=jax.make_mesh((8,), ("x",)), axis_names=("x",))


@error("multimesh-slice-out-of-range", MESHES, "`MultiMesh.slice` index beyond the axis",
       MeshError,
       r"MultiMesh\.slice: index 2 is out of range for axis 'stage' of size 2 "
       r"\(valid indices are 0\.\.1\)",
       """Slice indices run from 0 to the axis size minus one.""")
def _():
    global_mesh().slice(stage=2)


@error("loop-dependent-mesh-slice-device-count", MESHES,
       "A loop-dependent mesh slice changes the number of devices", MeshError,
       r"loop dependent submesh \(1 devices\) must have the same number of devices as the "
       r"default task mesh \(4 devices\) for task 'emb'; loop_dependent_mesh_slice\(0\) "
       r"returned \{'stage': 0, 'x': 0\}",
       """`loop_dependent_mesh_slice(i)` moves a task to another submesh per microbatch;
       every placement must have as many devices as the task's `mesh_slice`, so the
       fragment compiled once runs on each.""")
def _():
    emb = mm.task(lambda w, x: x @ w, name="emb", mesh_slice={"stage": 0},
                  loop_dependent_mesh_slice=lambda i: {"stage": 0, "x": i % 4})
    f = mm.microbatch(lambda w, x: emb(w, x).sum(), dim=0, size=8, argnum=1)
    with global_mesh():
        mm.mjit(f).lower(jnp.eye(16), jnp.ones((16, 16)))


@error("sharding-names-an-axis-the-task-lacks", MESHES,
       "A sharding in a task names an axis that the task's mesh lacks", PassFailure,
       r"a sharding in task 's0' names the mesh axis 'fsdp', which is not an axis of the "
       r"task's mesh; inside a task the mesh is the task's mesh, with the axes \['x'\] "
       r"\(device positions \[0, 1, 2, 3\]\)",
       """Sharding code written for one mesh (here explicit mode's `reshard` under
       `jax.set_mesh`) applies on each task's mesh, by axis name: the task here runs on
       a `TaskMesh` with the one axis `x`, so a sharding over `fsdp` cannot apply. Give
       the task a mesh with the axes the model names (a `mesh_slice` of the global mesh
       keeps them), or shard over the task's axes.""")
def _():
    explicit = jax.make_mesh((2, 4), ("fsdp", "tp"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    s0 = mm.task(lambda x: jax.sharding.reshard(x, P("fsdp")), name="s0", mesh=mesh4(0))
    with jax.set_mesh(explicit):
        mm.mjit(s0)(jnp.ones((8, 8)))


# =========================================================================== logical mappings


@error("logical-axis-unknown-device-axis", LOGICAL,
       "A logical axis that is used maps to a device axis the mesh does not have", PassFailure,
       r"multimesh pass 'mm-resolve-logical-shardings' failed: Logical axis 'batch' is mapped to "
       r"device axis 'z', which is not an axis of the mesh of task 't'\. Valid device axis names "
       r"are: 'x'\..*Reproduce with:\n  mm-opt ",
       """`logical_axes` pairs `(logical_name, device_axis)`. A pair may name a device axis
       the task's mesh lacks (one map shared by submeshes of different shapes), but a
       constraint inside the task that uses its logical name needs that axis: add it to
       the mesh, or map the name to an axis the mesh has.""",
       check=_repro_check("mm-resolve-logical-shardings"))
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")), name="t", mesh=mesh4(),
                logical_axes=(("batch", "z"),))
    mm.mjit(t)(jnp.ones(8))


@error("logical-axes-not-pairs", LOGICAL, "`logical_axes` given a single flat pair",
       MultimeshValueError,
       r"Task 't': `logical_axes` must be a sequence of \(logical_name, device_axis\) "
       r"(string )?pairs, got \('batch', 'x'\)",
       """`logical_axes` is a sequence of pairs, in priority order: write
       `logical_axes=(("batch", "x"),)` for a single pair.""")
def _():
    mm.task(lambda x: x, name="t", mesh=mesh4(), logical_axes=("batch", "x"))


@error("logical-axes-without-device-axes", LOGICAL,
       "`logical_axes` with legacy `devices` but no axis names", MultimeshValueError,
       r"Task 't' given logical_axes but no device_axes; name the device axes with "
       r"`device_axes=` or pass a `mesh`",
       """Logical axes map onto named device axes; name them with `device_axes=` or use
       `mesh=TaskMesh(...)`.""")
def _():
    mm.task(lambda x: x, name="t", devices=[0, 1], logical_axes=(("batch", "x"),))


@error("sharding-rank-mismatch", LOGICAL, "A logical sharding with more entries than dims",
       MultimeshValueError, r"Sharding P\('batch', 'model'\) has 2 entries but the value has rank 1",
       """A `PartitionSpec` has at most one entry per dimension of the value it
       constrains.""")
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch", "model")), name="t",
                mesh=mesh4(), logical_axes=(("batch", "x"),))
    mm.mjit(t)(jnp.ones(8))


@error("sharding-not-a-spec", LOGICAL, "A logical sharding that is not a PartitionSpec",
       MultimeshTypeError, r"Logical sharding must be a PartitionSpec or NamedSharding, got 'batch'",
       """Write `with_sharding_constraint(x, P("batch"))`, not a bare string.""")
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, "batch"), name="t", mesh=mesh4(),
                logical_axes=(("batch", "x"),))
    mm.mjit(t)(jnp.ones(8))


@error("sharding-structure-mismatch", LOGICAL,
       "A pytree of shardings that does not match the value", MultimeshValueError,
       r"axis_resources structure does not match the value's structure",
       """For a pytree value, `axis_resources` is one spec for every leaf or a prefix tree
       of specs with the value's structure.""")
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, (P("batch"), P("batch"))), name="t",
                mesh=mesh4(), logical_axes=(("batch", "x"),))
    mm.mjit(t)((jnp.ones(8),))


@warning("logical-name-mapped-by-no-task", LOGICAL, "A logical name that no task maps (a typo)",
         DiagnosticWarning,
         r"logical axis name 'btach' is mapped by no task of the program, so it leaves its "
         r"dimension unsharded in task 't'; did you mean 'batch'\? \(the logical names the "
         r"tasks map: 'batch'\) \(at ",
         """A name that no task's `logical_axes` maps shards nothing anywhere. When it is a near
         miss of a name the tasks map, multimesh warns (once per program, at the
         constraint's source line) with the closest names; fix the spelling. An unmapped
         name that resembles no mapped name (`"seq"` without sequence sharding) is taken as
         deliberate and stays quiet: replicated, as in the original library.""")
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("btach")), name="t",
                mesh=mesh4(), logical_axes=(("batch", "x"),))
    mm.mjit(t)(jnp.ones(8))


@warning("mesh-axis-used-as-logical-name", LOGICAL, "A mesh axis name used as a logical name",
         DiagnosticWarning,
         r"logical axis name 'x' is mapped by no task of the program, so it leaves its "
         r"dimension unsharded in task 't'; 'x' is a mesh axis of task 't', not a logical "
         r"name: use a logical name that task 't' maps onto it \('batch'\)",
         """Inside an MPMD program, constraint names are logical: a task with `logical_axes`
         reads only the logical names listed there, not its mesh axes. Use the logical name
         mapped onto that axis, or map the axis name itself (`("x", "x")`).""")
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("x")), name="t",
                mesh=mesh4(), logical_axes=(("batch", "x"),))
    mm.mjit(t)(jnp.ones(8))


@warning("logical-axes-pair-swapped", LOGICAL, "A `logical_axes` pair written backwards",
         DiagnosticWarning,
         r"logical axis name 'batch' is mapped by no task of the program, .*; task 't' has the "
         r"pair \('x', 'batch'\), which maps its mesh axis 'x' as a logical name onto "
         r"'batch', not an axis of its mesh: the pair looks swapped, write \('batch', 'x'\) in "
         r"its logical_axes",
         """Pairs are `(logical_name, device_axis)`: logical name first.""")
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")), name="t",
                mesh=mesh4(), logical_axes=(("x", "batch"),))
    mm.mjit(t)(jnp.ones(8))


# =========================================================================== non-dividing shapes


@error("logical-sharding-does-not-divide", SHAPES,
       "A logical sharding whose device axes do not divide the dimension", PassFailure,
       r"multimesh pass 'mm-resolve-logical-shardings' failed: Cannot shard dimension 0 of "
       r"tensor of shape \(6,\) over device axis 'x' \(size 4\): 4 does not evenly divide 6\."
       r".*Reproduce with:\n  mm-opt \S+ -p 'builtin\.module\(mm-resolve-logical-shardings\)'",
       """The device axes a logical axis maps to must divide the dimension it shards. Change
       the shape, map the logical axis to a smaller device axis, or leave that dimension
       unconstrained. The `mm-opt` command in the message replays the failing pass on the
       saved input.""",
       check=_repro_check("mm-resolve-logical-shardings"))
def _():
    bad = mm.task(lambda x: mm.with_sharding_constraint(x, P("batch")) * 2, name="bad",
                  mesh=mesh4(), logical_axes=(("batch", "x"),))
    mm.mjit(bad, devices=jax.devices()[:4])(jnp.ones(6))


@error("logical-sharding-does-not-divide-names-task", SHAPES,
       "A non-dividing sharding over two device axes", PassFailure,
       r"Task 't'.*logical axis 'model'.*\(at \S*error_catalogue\.py:\d+:\d+\)",
       """As above: `model` maps to `x` and `y` (2 x 2 = 4 shards), which does not divide
       6.""",
       check=_repro_check("mm-resolve-logical-shardings"))
def _():
    t = mm.task(lambda x: mm.with_sharding_constraint(x, P(None, "model")), name="t",
                mesh=mm.TaskMesh(devices=range(4), axis_names=("x", "y"), axis_sizes=(2, 2)),
                logical_axes=(("model", "x"), ("model", "y")))
    mm.mjit(t)(jnp.ones((4, 6)))


@error("microbatch-size-does-not-divide", SHAPES, "Microbatch size does not divide the batch",
       MultimeshValueError,
       r"`microbatch` size 3 does not divide the batch: dim 0 has size 16, which leaves a "
       r"remainder of 1\. Choose a size that divides 16",
       """Unlike the original library (docs/compared.md), multimesh does not drop a
       remainder silently: choose a microbatch `size` that divides the batch dimension.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=3, argnum=1))(ws, x)


@warning("microbatch-too-small-to-split", SHAPES,
         "Microbatches too small to split over the batch's shards", DiagnosticWarning,
         r"the microbatches of 2 rows cannot be split over mesh axes 'x' \(4 devices\) of "
         r"task 's0', which shard the batch's dimension 0: every device of those axes runs "
         r"each microbatch's rows whole",
         """A batch sharded along the microbatched dimension keeps its layout in each
         microbatch: its rows are split once per step so that each microbatch's rows are
         spread as the batch's are (docs/ir.md, "Microbatch loops"). A microbatch of 2 rows
         cannot be spread over 4 devices, so each device of the axis runs it whole. Choose a
         microbatch `size` the batch's mesh axes divide, or shard the batch over fewer
         devices.""")
def _():
    grad_fn, ws, x = two_stage()
    x = jax.device_put(x, NamedSharding(Mesh(np.asarray(jax.devices()[:4]), ("x",)), P("x")))
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=2, argnum=1)).lower(ws, x).compile()


@error("microbatch-unequal-leaves", SHAPES,
       "Microbatched leaves with different batch sizes", MultimeshValueError,
       r"`microbatch`.*(different sizes|same size).*dim 0.*\[4, 6\]",
       """Every leaf of the microbatched argument is sliced along `dim`, so they must all
       have the same size there.""")
def _():
    f = mm.microbatch(lambda a: a[0].sum() + a[1].sum(), dim=0, size=2)
    mm.mjit(f)((jnp.ones((4, 2)), jnp.ones((6, 2))))


@error("microbatch-empty-batch", SHAPES, "An empty batch given to `microbatch`",
       MultimeshValueError,
       r"`microbatch` got an empty batch: argument 1 has size 0 along dim 0, so there is no "
       r"microbatch to run",
       """A batch of size 0 has no microbatch to run (and a sum or mean over none would be
       made up). Pass a batch whose `dim` is a positive multiple of `size`.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1))(ws, x[:0])


# =========================================================================== schedule misuse


@error("compare-schedules-not-pipelined", SCHEDULES,
       "`compare_schedules` on a program without a pipeline",
       MultimeshValueError, r"compare_schedules needs a pipelined program",
       """Only a microbatched program has units to schedule; wrap the step in
       `microbatch(...)`.""")
def _():
    mm.compare_schedules(mm.mjit(lambda x: x * 2).lower(jnp.ones(4)).compile())


@error("compare-schedules-unknown-costs", SCHEDULES, "An unknown cost source",
       MultimeshValueError, r"costs='fast' is not a cost source; valid: 'xla', 'unit'",
       """Give `'xla'`, `'unit'`, a `StepProfile` (`compiled.step_profile(...)`), a
       `{fragment: seconds}` mapping or a `FragmentCosts`.""")
def _():
    mm.compare_schedules(pipelined(), costs="fast")


@error("compare-schedules-bad-memory", SCHEDULES, "An unknown memory source",
       MultimeshTypeError, r"memory must be 'plan', None or the memory_profile\(\) of this",
       """`memory=` takes `'plan'` (`mm.residual_bytes`: the residual sizes read from the
       compiled plan), None, or this program's `compiled.memory_profile(...)`.""")
def _():
    mm.compare_schedules(pipelined(), memory=3)


@error("compare-schedules-unknown-memory", SCHEDULES, "An unknown memory source",
       MultimeshValueError, r"memory='xla' is not a memory source; valid: 'plan', None",
       """Residual sizes come from the compiled plan (`'plan'`) or a measured
       `compiled.memory_profile(...)`; None leaves bytes out of the table.""")
def _():
    mm.compare_schedules(pipelined(), memory="xla")


@error("schedule-costs-wrong-type", SCHEDULES, "Costs of the wrong type",
       MultimeshValueError, r"costs must be None, a FragmentCosts, a measured profile",
       """`schedule.simulate(costs)` takes None (unit costs), `mm.xla_costs(compiled)`, a
       `StepProfile`, a `{fragment: seconds}` mapping or a function of a unit.""")
def _():
    pipelined().schedule.simulate(3)


@error("run-ahead-invalid", API, "A run-ahead bound that is not a positive integer",
       MultimeshValueError,
       r"`run_ahead` must be a positive integer \(the fragment calls of one submesh that may "
       r"be in flight at once\) or None \(no bound\), got 0\.",
       """`MpmdCompiled.run_ahead` bounds how many fragment calls of one submesh the host
       dispatches before the oldest has finished; None dispatches without a bound. The
       same holds for `$MULTIMESH_RUN_AHEAD` (a positive integer, or `none`).""")
def _():
    pipelined().run_ahead = 0


@error("run-ahead-env-not-a-count", API, "`MULTIMESH_RUN_AHEAD` is not a bound",
       MultimeshValueError,
       r"MULTIMESH_RUN_AHEAD must be a positive whole number of fragment calls, or none for "
       r"no bound, got 'lots'; for example MULTIMESH_RUN_AHEAD=2, or MULTIMESH_RUN_AHEAD=none "
       r"to dispatch without waiting\.",
       """The default run-ahead bound of every program compiled while it is set (see
       `run-ahead-invalid`): a count, e.g. `MULTIMESH_RUN_AHEAD=2`, or `none`.""")
def _():
    grad_fn, ws, x = two_stage()
    os.environ["MULTIMESH_RUN_AHEAD"] = "lots"
    try:
        mm.mjit(grad_fn).lower(ws, x).compile()
    finally:
        del os.environ["MULTIMESH_RUN_AHEAD"]


@error("merge-fragments-env-unknown", API, "`MULTIMESH_MERGE_FRAGMENTS` names no choice",
       MultimeshValueError,
       r"MULTIMESH_MERGE_FRAGMENTS must be one of off, one-submesh, all, got 'yes'; for "
       r"example MULTIMESH_MERGE_FRAGMENTS=all to merge a pipeline's last stage's forward and "
       r"backward too, or MULTIMESH_MERGE_FRAGMENTS=off to keep every fragment a call of its "
       r"own\.",
       """Which consecutive fragments on one submesh `mm-merge-fragments` makes one call,
       for every program lowered while it is set: `one-submesh` (the default: a program
       whose fragments all run on one submesh, such as a one-stage plan), `all` (also a
       pipeline's, e.g. the last stage's forward and backward under 1F1B) or `off`.""")
def _():
    grad_fn, ws, x = two_stage()
    os.environ["MULTIMESH_MERGE_FRAGMENTS"] = "yes"
    try:
        mm.mjit(grad_fn).lower(ws, x)
    finally:
        del os.environ["MULTIMESH_MERGE_FRAGMENTS"]


@error("share-blocks-env-unknown", API, "`MULTIMESH_SHARE_BLOCKS` is neither on nor off",
       MultimeshValueError,
       r"MULTIMESH_SHARE_BLOCKS must be on or off, got 'yes'; for example "
       r"MULTIMESH_SHARE_BLOCKS=off to compile every distinct fragment whole, even where it "
       r"contains another fragment's program\.",
       """Whether a fragment that holds another distinct fragment's program (a first
       stage's embedding then the same blocks as the next stage) runs that program's
       executable for the part they share instead of compiling it again, read when a
       program compiles: `on` (the default) or `off`.""")
def _():
    grad_fn, ws, x = two_stage()
    os.environ["MULTIMESH_SHARE_BLOCKS"] = "yes"
    try:
        mm.mjit(grad_fn).lower(ws, x).compile()
    finally:
        del os.environ["MULTIMESH_SHARE_BLOCKS"]


@error("schedule-residual-bytes-wrong-type", SCHEDULES, "Residual sizes of the wrong type",
       MultimeshValueError, r"residual_bytes must be \{forward fragment: bytes\}",
       """Pass `mm.residual_bytes(compiled)`, a `compiled.memory_profile(...)`, or a
       function of `(mesh, stage, microbatch)`.""")
def _():
    pipelined().schedule.simulate(residual_bytes=[1, 2])


@error("simulate-stages-not-divisible", SCHEDULES, "Stages that do not divide among submeshes",
       MultimeshValueError, r"number of stages divisible by num_meshes, got 3 stages on 2",
       """Every submesh holds the same number of stages: give a multiple of
       `num_meshes` stages.""")
def _():
    from multimesh.schedules.costs import simulate_stages

    simulate_stages("1f1b", [1.0] * 3, [2.0] * 3, num_microbatches=4, num_meshes=2)


@error("simulate-stages-v-shape", SCHEDULES, "A V-shape schedule without two stages a submesh",
       MultimeshValueError, r"places 2 stages per submesh in a V: 4 stages need num_meshes=2",
       """DualPipeV puts stage i and stage 2P - 1 - i on submesh i: give twice as many
       stages as submeshes.""")
def _():
    from multimesh.schedules.costs import simulate_stages

    simulate_stages("dualpipe-v", [1.0] * 4, [2.0] * 4, num_microbatches=8)


@error("visualize-cost-and-costs", SCHEDULES, "Both `cost=` and `costs=`",
       MultimeshValueError, r"Give cost= or costs=, not both",
       """`cost` is a function of a unit; `costs` a cost source. Pass one.""")
def _():
    mm.visualize_schedule(pipelined(), cost=lambda u: 1.0, costs="xla")


@error("step-profile-donated", SCHEDULES, "Several profiled steps of a donating program",
       MultimeshValueError, r"steps=2 reruns the program on the same arguments, but it donates",
       """A donated argument is gone after one step: profile with `steps=1` and fresh
       arguments each time.""")
def _():
    grad_fn, ws, x = two_stage()
    c = mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1),
                donate_argnums=(0,)).lower(ws, x).compile()
    c.step_profile(ws, x, steps=2)


@error("compare-schedules-nothing-fits", SCHEDULES, "No schedule within a memory limit",
       MultimeshValueError, r"no schedule keeps its activations within 1 KiB; the least",
       """Every applicable schedule holds more activation bytes on some submesh than the
       limit: recompute stages (`remat=`), use more, smaller microbatches, or raise it.""")
def _():
    mm.compare_schedules(pipelined(), costs="unit").best(memory_limit=1024)


@error("compare-schedules-limit-without-memory", SCHEDULES,
       "A memory limit without residual sizes",
       MultimeshValueError, r"memory_limit needs residual sizes",
       """`best(memory_limit=...)` compares activation bytes: build the table with
       `memory='plan'` (the default) or a memory profile.""")
def _():
    mm.compare_schedules(pipelined(), costs="unit", memory=None).best(memory_limit=1024)


@error("compare-schedules-wrong-type", SCHEDULES, "`compare_schedules` given something else",
       MultimeshTypeError, r"Expected a compiled or lowered multimesh program",
       """Pass `mjit(f).lower(...)` or its `.compile()`.""")
def _():
    mm.compare_schedules("1f1b")


@error("schedule-costs-missing-fragment", SCHEDULES, "Costs that miss a fragment",
       MultimeshValueError, r"no cost for fragment 's0_fwd' \(given costs know: s1_fwd\)",
       """A `{fragment: seconds}` mapping must name every fragment the schedule calls
       (`compiled.fragments`); or use `mm.xla_costs(compiled)` or a `StepProfile`.""")
def _():
    pipelined().schedule.simulate({"s1_fwd": 1e-3})


@error("simulate-stages-lengths", SCHEDULES, "Per-stage numbers of different lengths",
       MultimeshValueError, r"simulate_stages got 2 forward costs but 3 backward values",
       """Give one forward cost, one backward cost (and activation size) per stage.""")
def _():
    from multimesh.schedules.costs import simulate_stages

    simulate_stages("1f1b", [1.0, 1.0], [2.0, 2.0, 2.0], num_microbatches=4)


@error("step-profile-steps", SCHEDULES, "`step_profile` with fewer than one step",
       MultimeshValueError, r"step_profile: `steps` must be a positive integer \(the number "
       r"of steps to time\), got 0",
       """`steps` is how many steps to run and time.""")
def _():
    pipelined().step_profile([jnp.eye(16), jnp.eye(16)], jnp.ones((16, 16)), steps=0)


@error("visualize-xla-costs-of-schedule", SCHEDULES, "`costs='xla'` for a bare Schedule",
       MultimeshValueError, r"costs='xla' needs the compiled program",
       """XLA's costs live in the compiled fragments: pass the compiled program, or
       `costs=mm.xla_costs(compiled)` with the schedule.""")
def _():
    mm.visualize_schedule(pipelined().schedule, costs="xla")


@error("visualize-measured-with-costs", SCHEDULES, "Costs for a measured profile",
       MultimeshValueError, r"A measured StepProfile is drawn as it ran",
       """A `StepProfile` is drawn as measured; to simulate with its costs, pass the
       program and `costs=profile`.""")
def _():
    c = pipelined()
    prof = c.step_profile([jnp.eye(16), jnp.eye(16)], jnp.ones((16, 16)), steps=1)
    mm.visualize_schedule(prof, costs="xla")


@error("microbatch-unknown-schedule", SCHEDULES, "An unknown pipeline schedule name",
       MultimeshValueError,
       r"Unknown microbatch schedule 'round-robin'; valid schedules are gpipe, 1f1b, "
       r"interleaved-1f1b, zero-bubble-h1, zero-bubble-h2, eager-1f1b, interleaved-gpipe, "
       r"gpipe-1f1b-last, circular-reversed-backward, dualpipe-v, zero-bubble-v, kimi-k2, "
       r"custom \(aliases: "
       r"breadth-first = gpipe, CircularWithReversedBackward = circular-reversed-backward, "
       r"DualPipeV = dualpipe-v, Eager1F1B = "
       r"eager-1f1b, fill-drain = gpipe, GPipeBut1F1BForLastMesh = gpipe-1f1b-last, "
       r"InterleavedGPipe = interleaved-gpipe, KimiK2 = kimi-k2, pipedream-flush = 1f1b, "
       r"prefetch-wavefront = 1f1b, wavefront = 1f1b, zb-h1 = zero-bubble-h1, zb-h2 = "
       r"zero-bubble-h2, ZB-V = zero-bubble-v, ZBV = zero-bubble-v\)\.",
       """Pick one of the listed schedules (aliases such as `fill-drain` and `wavefront`
       are accepted too); see docs/schedules.md.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="round-robin")


@error("microbatch-size-not-positive", SCHEDULES, "Microbatch size below 1",
       MultimeshValueError, r"`microbatch` size must be a positive integer, got 0",
       """`size` is the number of rows per microbatch.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=0, argnum=1)


@error("custom-schedule-with-other-schedule", SCHEDULES,
       "`custom_schedule` given with a named schedule", ScheduleError,
       r"When custom_schedule is provided, schedule must be 'custom' or None, but got '1f1b'",
       """A custom schedule replaces the named ones: drop `schedule=` or set it to
       `"custom"`.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="1f1b", custom_schedule=[["s0"]])


@error("custom-schedule-missing", SCHEDULES, "`schedule='custom'` without rows",
       MultimeshValueError, r"schedule='custom' needs a custom_schedule",
       """Give the order with `custom_schedule=[[...], ...]`, one row per submesh.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="custom")


@error("custom-schedule-wrong-count", SCHEDULES,
       "A custom schedule row lists a task the wrong number of times", PassFailure,
       r"task 's0' has 1 microbatch(es)? in custom_schedule row 0, but there are 2 microbatches",
       """Each name must appear once per microbatch in its row: with 2 microbatches,
       `"s0"` appears twice.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    f = mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=[["s0"], ["s1"]])
    mm.mjit(f)(ws, x)


@error("custom-schedule-bad-entry", SCHEDULES, "A custom schedule entry of the wrong type",
       ScheduleTypeError,
       r"custom_schedule row 0 has entry 3\.5; entries are task names or \(microbatch, task "
       r"name\) pairs",
       """Write a task name (the next microbatch of it) or an explicit
       `(microbatch, name)` pair.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=[[3.5]])


@error("custom-schedule-row-count", SCHEDULES, "A custom schedule without a row per submesh",
       PassFailure,
       r"multimesh pass 'mm-schedule-fragments' failed: custom_schedule has 1 rows for 2 "
       r"submeshes; give one row per submesh, in the order the program first uses them",
       """Give one row per submesh, in the order the program first uses them.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    rows = [["s0", "s0", "s0_bwd", "s0_bwd"]]
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=rows))(ws, x)


@error("custom-schedule-task-of-other-submesh", SCHEDULES,
       "A custom schedule row names a task of another submesh", PassFailure,
       r"custom_schedule row 1 entry 4 names 'head', which is not a task of submesh 1 "
       r"\(its tasks: s1, s1_bwd\)",
       """Row *k* lists only the tasks (`name`, `name_bwd`, `name_bwd_w`) that run on
       submesh *k*; the message lists them.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    rows = [["s0", "s0", "s0_bwd", "s0_bwd"], ["s1", "s1_bwd", "s1", "s1_bwd", "head", "head"]]
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=rows))(ws, x)


@error("custom-schedule-misspelt-task", SCHEDULES, "A misspelt task in a custom schedule",
       PassFailure,
       r"custom_schedule row 0 entry 3 names 's0_bdw', which is not a task of submesh 0 "
       r"\(its tasks: s0, s0_bwd\); did you mean 's0_bwd'\?",
       """Names match task names exactly (`name`, `name_bwd`, `name_bwd_w`); the message
       gives the row and entry of the first name that is not a task of that row's
       submesh, the valid names, and the closest one.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    rows = [["s0", "s0", "s0_bwd", "s0_bdw"], ["s1", "s1_bwd", "s1", "s1_bwd"]]
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=rows))(ws, x)


@error("custom-schedule-extra-row", SCHEDULES, "A custom schedule with more rows than submeshes",
       PassFailure,
       r"custom_schedule has 3 rows for 2 submeshes; give one row per submesh, in the order "
       r"the program first uses them",
       """The row count is checked before the rows themselves: drop the extra row.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    rows = [["s0", "s0", "s0_bwd", "s0_bwd"], ["s1", "s1_bwd", "s1", "s1_bwd"], ["s2"]]
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=rows))(ws, x)


@error("custom-schedule-empty", SCHEDULES, "An empty `custom_schedule`", ScheduleError,
       r"custom_schedule is empty; give one row per submesh, in the order the "
       r"program first uses them",
       """Raised by `microbatch` itself. Give one row per submesh, or drop
       `custom_schedule` for a named schedule.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=[])


@error("custom-schedule-deadlock", SCHEDULES, "A custom schedule that cannot run",
       PassFailure,
       r"custom schedule deadlocks: row 0 runs 's0_bwd' microbatch 0 before its input "
       r"'s1_bwd' microbatch 0 \(row 1\) can be computed",
       """Each submesh runs its row in order, so a row may not wait for something that
       another row only computes after waiting for this one. Reorder the rows.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    rows = [["s0", "s0_bwd", "s0", "s0_bwd"],
            [(1, "s1"), (1, "s1_bwd"), (0, "s1"), (0, "s1_bwd")]]
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule=rows))(ws, x)


@error("interleave-mismatch", SCHEDULES,
       "`interleave` that does not match the stages per submesh", PassFailure,
       r"multimesh pass 'mm-schedule-fragments' failed: interleave=3, but submesh 0 runs 1 "
       r"pipeline stage\(s\) \(stages \[0\]\)",
       """`interleave` only checks the program: every pipeline submesh must run exactly that
       many stages (tasks). Drop it or place that many stages on each submesh.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    f = mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="interleaved-1f1b",
                      interleave=3)
    mm.mjit(f)(ws, x)


def three_layers_on_two_submeshes():
    """Layers 0 and 2 on positions 0-3, layer 1 on 4-7: stages 0 and 2 share submesh 0."""
    return tanh_chain([mesh4(4 * (k % 2)) for k in range(3)])


def tanh_chain(meshes):
    """``(grad_fn, ws, x)``: one ``tanh`` layer task per mesh, in order, and a square loss."""
    layers = [mm.task(lambda w, x: jnp.tanh(x @ w), name=f"l{k}", mesh=m)
              for k, m in enumerate(meshes)]

    def loss(ws, x):
        for f, w in zip(layers, ws):
            x = f(w, x)
        return (x ** 2).sum()

    return jax.value_and_grad(loss), [jnp.eye(16)] * len(meshes), jnp.ones((16, 16))


@error("schedule-needs-contiguous-stages", SCHEDULES,
       "A contiguous-stage schedule on several stages per submesh", PassFailure,
       r"schedule 'eager-1f1b' needs one pipeline stage per submesh \(contiguous placement: "
       r"consecutive layers on one submesh, stage k on the k-th submesh\), but submesh 0 runs "
       r"2 stages \(stages \[0, 2\]\)",
       """`eager-1f1b` and `gpipe-1f1b-last` order one stage per submesh. Place consecutive
       layers together (one task, or consecutive tasks, per submesh), or pick a schedule
       without a placement rule (`gpipe`, `1f1b`, `interleaved-1f1b`).""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = three_layers_on_two_submeshes()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="eager-1f1b"))(ws, x)


@error("schedule-needs-round-robin-stages", SCHEDULES,
       "A round-robin schedule on stages placed otherwise", PassFailure,
       r"schedule 'interleaved-gpipe' needs round-robin placement \(stage k on submesh k % P "
       r"for P pipeline submeshes, every submesh running the same number of stages\), but "
       r"submesh 0 runs 2 stages \(stages \[0, 2\]\) and submesh 1 runs fewer",
       """`interleaved-gpipe` and `circular-reversed-backward` expect layer k on submesh
       k % P, the same number of layers on every submesh. Place the layers round-robin, or
       pick a schedule without a placement rule (`gpipe`, `1f1b`).""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = three_layers_on_two_submeshes()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="interleaved-gpipe"))(ws, x)


@error("schedule-needs-v-shape-stages", SCHEDULES,
       "A V-shape schedule on stages placed otherwise", PassFailure,
       r"schedule 'dualpipe-v' needs V-shape placement \(2P stages on P submeshes: stage i "
       r"and stage 2P - 1 - i on submesh i, so the forward goes down the submeshes and back "
       r"up\), but its stages run on submeshes \[0, 1\] in order, where V-shape needs "
       r"\[0, 1, 0\]",
       """DualPipeV runs two stages on every submesh, one on the way down and one on the way
       back up: with P submeshes, layer k (of 2P) goes on submesh k for k < P and on
       submesh 2P - 1 - k after, so the first submesh also holds the last layer (and the
       loss). Place the layers that way, or pick a schedule without a placement rule.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="dualpipe-v"))(ws, x)


def v_shape_two_submeshes():
    """Layers 0 and 3 on positions 0-3, layers 1 and 2 on 4-7 (DualPipeV's placement)."""
    return tanh_chain([mesh4(4 * (k in (1, 2))) for k in range(4)])


@error("dualpipe-v-too-few-microbatches", SCHEDULES,
       "DualPipeV with fewer than 2P microbatches", ScheduleError,
       r"`microbatch` got 2 microbatch\(es\) for schedule 'dualpipe-v', which it accepts on "
       r"no pipeline of 2 to 8 submeshes \(checked before tracing\): schedule 'dualpipe-v' "
       r"needs at least 2P = 4 microbatches for 2 pipeline submeshes, but there are 2",
       """DualPipeV's warm-up sends 2P microbatches through the two legs of the V before its
       steady state (the published schedule asserts the same). A count that no pipeline
       the devices allow accepts is refused before the function is traced. Cut the batch
       into more microbatches (a smaller `size`), or pick another schedule.""")
def _():
    grad_fn, ws, x = v_shape_two_submeshes()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="dualpipe-v"))(ws, x)


@error("zero-bubble-v-needs-v-shape-stages", SCHEDULES,
       "ZB-V on stages placed otherwise than in a V", PassFailure,
       r"schedule 'zero-bubble-v' needs V-shape placement \(2P stages on P submeshes: stage i "
       r"and stage 2P - 1 - i on submesh i, so the forward goes down the submeshes and back "
       r"up\), but its stages run on submeshes \[0, 1\] in order, where V-shape needs "
       r"\[0, 1, 0\]",
       """ZB-V, like DualPipeV, runs two stages on every submesh: with P submeshes, layer k
       (of 2P) on submesh k for k < P and on submesh 2P - 1 - k after, so the first
       submesh also holds the last layer. Place the layers that way, or pick
       `zero-bubble-h1`/`zero-bubble-h2`, which take any placement.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = two_stage()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="ZB-V"))(ws, x)


@error("kimi-k2-needs-round-robin-stages", SCHEDULES,
       "Kimi-K2 on stages that are not round-robin", PassFailure,
       r"schedule 'kimi-k2' needs round-robin placement \(stage k on submesh k % P for P "
       r"pipeline submeshes, every submesh running the same number of stages\), but "
       r"submesh 0 runs 2 stages \(stages \[0, 2\]\) and submesh 1 runs fewer",
       """Kimi-K2 is interleaved 1F1B: layer k on submesh k % P, the same number of layers
       on every submesh. Place the layers round-robin, or pick `1f1b`, which takes any
       placement.""",
       check=_repro_check("mm-schedule-fragments"))
def _():
    grad_fn, ws, x = three_layers_on_two_submeshes()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="kimi-k2"))(ws, x)


@error("kimi-k2-uneven-rounds", SCHEDULES,
       "Kimi-K2 with microbatches that do not fill its rounds", ScheduleError,
       r"`microbatch` got 5 microbatch\(es\) for schedule 'kimi-k2', and the traced step's "
       r"tasks make a pipeline of 2 submeshes \(checked before compiling\): schedule "
       r"'kimi-k2' runs the microbatches in 2 rounds for 2 pipeline submeshes, which 5 "
       r"microbatches do not fill equally; use a multiple of 2 microbatches \(or fewer "
       r"than 4\)",
       """Kimi-K2 (as JaxPP defines it) runs the microbatches in M // P rounds of equal
       size, every stage of a submesh over one round before the next. Use a multiple of P
       microbatches (or fewer than 2P, one round). The count is checked as soon as the
       step is traced and its task calls give the pipeline's submeshes, before any pass
       runs.""")
def _():
    grad_fn, ws, _ = two_stage()
    x = jnp.ones((20, 16))
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="KimiK2"))(ws, x)


def v_shape_four_submeshes():
    """Eight layers on four submeshes of two devices in a V (layer k and 7 - k together)."""
    def sub(r):
        return mm.TaskMesh(devices=range(2 * r, 2 * r + 2), axis_names=("x",), axis_sizes=(2,))

    return tanh_chain([sub(min(k, 7 - k)) for k in range(8)])


@error("dualpipe-v-too-few-microbatches-traced", SCHEDULES,
       "DualPipeV with fewer than 2P microbatches for the traced pipeline", ScheduleError,
       r"`microbatch` got 4 microbatch\(es\) for schedule 'dualpipe-v', and the traced "
       r"step's tasks make a pipeline of 4 submeshes \(checked before compiling\): schedule "
       r"'dualpipe-v' needs at least 2P = 8 microbatches for 4 pipeline submeshes, but "
       r"there are 4",
       """A count that some pipeline would accept (4 microbatches fill DualPipeV on two
       submeshes) passes the check before tracing; once the step is traced, its task calls
       give the pipeline's submeshes, and the count is checked against them before any
       pass runs, not as a pass failure after the compile. Cut the batch into more
       microbatches, or pick another schedule.""")
def _():
    grad_fn, ws, x = v_shape_four_submeshes()
    mm.mjit(mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="dualpipe-v"))(ws, x)


@error("interleave-zero", SCHEDULES, "`interleave=0` (or `num_stages=0`)", MultimeshValueError,
       r"interleave.*(positive|>= 1).*0",
       """`interleave` and `num_stages` are positive integers.""")
def _():
    grad_fn, ws, x = two_stage()
    f = mm.microbatch(grad_fn, dim=0, size=8, argnum=1, schedule="interleaved-1f1b",
                      interleave=0)
    mm.mjit(f)(ws, x)


@error("two-microbatch-loops", SCHEDULES, "Two microbatch loops in one program",
       MultimeshValueError,
       r"A program may contain one microbatch loop, but this one calls a second `microbatch` "
       r"function\. Microbatch one function that does all of the work\.",
       """A program has one pipeline schedule. Microbatch the whole step once.""")
def _():
    grad_fn, ws, x = two_stage()
    f1 = mm.microbatch(grad_fn, dim=0, size=8, argnum=1)
    f2 = mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="1f1b")
    mm.mjit(lambda ws, x: (f1(ws, x), f2(ws, x)))(ws, x)


@error("task-split-backprop-invalid", SCHEDULES, "`split_backprop` that is not two suffixes",
       MultimeshValueError,
       r"Task 't': `split_backprop` must be two distinct, non-empty name suffixes "
       r"\(critical, non-critical\), e\.g\. \('_activations', '_gradients'\), got '_w'\.",
       """`split_backprop=(critical, non_critical)` gives the suffixes appended to the
       names of the two halves of the task's backward fragments (e.g.
       `t_bwd_activations`); give two different, non-empty suffixes.""")
def _():
    mm.task(lambda w, x: x @ w, name="t", mesh=mesh4(), split_backprop="_w")


@error("task-remat-invalid", SCHEDULES, "`remat` that is neither a bool nor a policy",
       MultimeshTypeError,
       r"Task 't': `remat` must be True \(recompute the whole forward in the backward\), "
       r"False, None \(inherit the `microbatch`/`parallelize_step` default\) or a jax "
       r"checkpoint policy such as `jax.checkpoint_policies.dots_saveable`, got str 'all'\.",
       """`remat` on a task (and on `microbatch`/`parallelize_step` for every stage) takes
       True, False, None, or one of `jax.checkpoint_policies` (called, where it is a
       factory such as `save_only_these_names("x")`).""")
def _():
    mm.task(lambda w, x: x @ w, name="t", mesh=mesh4(), remat="all")


@error("custom-schedule-a-string", SCHEDULES, "`custom_schedule` given as a string",
       ScheduleTypeError,
       r"custom_schedule must be a list of rows, one per submesh, each a list of "
       r"task names or \(microbatch, task name\) pairs, got str 's0 s1'",
       """A string used to be read character by character. Give one list per submesh, e.g.
       `[["s0", "s0_bwd"], ["s1", "s1_bwd"]]`.""")
def _():
    grad_fn, ws, x = two_stage()
    mm.microbatch(grad_fn, dim=0, size=8, argnum=1, custom_schedule="s0 s1")


@warning("interleaved-1f1b-nothing-to-interleave", SCHEDULES,
         "`interleaved-1f1b` on contiguous stages", MultimeshWarning,
         r"schedule 'interleaved-1f1b' has nothing to interleave: each of the 2 submeshes "
         r"runs one pipeline stage \(contiguous stages\), so it runs plain 1F1B",
         """Interleaving needs several stages per submesh, placed round-robin (stage k on
         submesh k % P). With one stage per submesh the schedule is plain 1F1B: place more
         stages per submesh, or ask for `schedule="1f1b"`.""")
def _():
    grad_fn, ws, x = two_stage()
    f = mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="interleaved-1f1b")
    mm.mjit(f)(ws, x)


@warning("interleaved-gpipe-nothing-to-interleave", SCHEDULES,
         "`interleaved-gpipe` on contiguous stages", MultimeshWarning,
         r"schedule 'interleaved-gpipe' has nothing to interleave: each of the 2 submeshes "
         r"runs one pipeline stage \(contiguous stages\), so it runs plain GPipe",
         """Interleaved GPipe needs several stages per submesh, placed round-robin (stage k
         on submesh k % P). With one stage per submesh it is GPipe: place more stages per
         submesh, or ask for `schedule="gpipe"`.""")
def _():
    grad_fn, ws, x = two_stage()
    f = mm.microbatch(grad_fn, dim=0, size=4, argnum=1, schedule="interleaved-gpipe")
    mm.mjit(f)(ws, x)


@warning("dualpipe-v-nothing-to-split", SCHEDULES,
         "DualPipeV with no weight-gradient half", MultimeshWarning,
         r"schedule 'dualpipe-v' has no weight-gradient half to defer: no backward fragment "
         r"of the loop splits.*so it runs DualPipeV's order with every weight gradient in its "
         r"backward",
         """DualPipeV defers some weight-gradient halves into the gaps at the end of the
         step. Here no backward splits (only the first stage's weights take a gradient), so
         each backward keeps its weight gradient. Give each stage its own weight arrays.""")
def _():
    layers = [mm.task(lambda w, x: jnp.tanh(x @ w), name=f"l{k}", mesh=mesh4(4 * (k in (1, 2))))
              for k in range(4)]

    def loss(w0, rest, x):  # only the first stage's weights are trained
        x = layers[0](w0, x)
        for f, w in zip(layers[1:], rest):
            x = f(w, x)
        return (x ** 2).sum()

    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=2, schedule="dualpipe-v")
    mm.mjit(f)(jnp.eye(16), [jnp.eye(16)] * 3, jnp.ones((16, 16)))


@warning("zero-bubble-v-nothing-to-split", SCHEDULES,
         "ZB-V with no weight-gradient half", MultimeshWarning,
         r"schedule 'zero-bubble-v' has no weight-gradient half to defer: no backward "
         r"fragment of the loop splits.*so it runs ZB-V's order with every weight gradient "
         r"in its backward",
         """ZB-V fills its bubbles with weight-gradient halves. Here no backward splits
         (only the first stage's weights take a gradient), so each backward keeps its
         weight gradient. Give each stage its own weight arrays.""")
def _():
    layers = [mm.task(lambda w, x: jnp.tanh(x @ w), name=f"l{k}", mesh=mesh4(4 * (k in (1, 2))))
              for k in range(4)]

    def loss(w0, rest, x):  # only the first stage's weights are trained
        x = layers[0](w0, x)
        for f, w in zip(layers[1:], rest):
            x = f(w, x)
        return (x ** 2).sum()

    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=2, schedule="zbv")
    mm.mjit(f)(jnp.eye(16), [jnp.eye(16)] * 3, jnp.ones((16, 16)))


@warning("zero-bubble-nothing-to-split", SCHEDULES,
         "A zero-bubble schedule with no weight-gradient half", MultimeshWarning,
         r"schedule 'zero-bubble-h1' has no weight-gradient half to defer: no backward "
         r"fragment of the loop splits.*so it runs 1F1B's order",
         """Zero-bubble schedules fill the bubbles with the weight-gradient halves of
         backward fragments. Here no backward splits (only the first stage's weights take a
         gradient; or every weight gradient is read by another stage's backward, as for
         stage weights sliced from one stacked array), so the order is 1F1B's. Give each
         stage its own weight arrays, or ask for `schedule="1f1b"`.""")
def _():
    s0 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s0", mesh=mesh4(0))
    s1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mesh4(4))

    def loss(w0, w1, x):  # only the first stage's weights are trained
        return (s1(w1, s0(w0, x)) ** 2).sum()

    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=2,
                      schedule="zero-bubble-h1")
    mm.mjit(f)(jnp.eye(16), jnp.eye(16), jnp.ones((16, 16)))


# =========================================================================== implicit tasks


@error("register-task-matches-empty-string", IMPLICIT, "A matcher that matches nothing at all",
       MultimeshValueError,
       r"Task matcher 'x\*' matches the empty string, so it would claim every op of the program",
       """A matcher that matches the empty string would claim every op. Use a name or a
       regular expression that needs at least one character, e.g. `r"(layer_\\d+)"`.""")
def _():
    mm.register_task("x*", task=mm.Task(mesh_slice={"stage": 0}))


@warning("register-task-matched-nothing", IMPLICIT, "A task rule that places nothing",
         MultimeshWarning,
         r"Task matcher 'layer_7' claimed no op of this program: no op's name stack contains "
         r"a match, so it places nothing",
         """A registered rule matched no op's name stack (a typo, or a model whose modules
         have other names). The warning lists the closest names the program has; fix the
         matcher or drop the rule.""")
def _():
    with mm.context():
        mm.register_task("layer_7", task=mm.Task(mesh=mesh4()))
        mm.mjit(layered_model)(*layered_args())


@error("registered-stage-sharding-names-a-missing-axis", IMPLICIT,
       "A sharding in a registered stage names an axis the stage's mesh lacks", MeshError,
       r"A sharding inside task 'layer0' \(matched by register_task\('layer0'\)\) names the "
       r"mesh axis 'data' \(P\('data',\)\), which the task's mesh lacks: inside a task the "
       r"mesh is the task's mesh, with the axes \('x',\) \(sizes \(4,\)\)\..* \(at "
       r".*error_catalogue\.py:\d+\)",
       """Inside a task the mesh is the task's mesh, however the task was made: a named
       scope (a flax module, a `jax.named_scope` block) that a `register_task` rule claims
       is traced under the task's mesh, so flax's rules, NNX metadata and
       `jax.lax.with_sharding_constraint` shard it over the task's own axes. An axis the
       task's mesh lacks cannot apply there; the error names it, the task, the rule and
       your line. Shard over the task's axes, or give the task a mesh with that axis.""")
def _():
    def f(x):
        with jax.named_scope("layer0"):
            return lax.with_sharding_constraint(x, P("data")) * 2

    with mm.Context():
        mm.register_task("layer0", task=mm.Task(mesh=mesh4()))
        mm.mjit(f)(jnp.ones(8))


@warning("argument-sharded-over-a-sliced-axis", IMPLICIT,
         "An argument placed sharded over the axis its stage slices away", DiagnosticWarning,
         r"argument 'dargs\[0\]' is placed sharded over the mesh axis 'stage' \(.*\), which "
         r"task 's0' "
         r"that uses it slices away: inside a task the mesh is the task's mesh, with the axes "
         r"\['x'\] \(device positions \[0, 1, 2, 3\]\), so the value moves onto it with "
         r"'stage' dropped from its layout",
         """A value placed over the global mesh's `stage` axis (`device_put`, or NNX
         partition metadata `("stage", None)`) and used by a stage cut by
         `mesh_slice={"stage": k}`: the stage is one index of `stage`, so the value moves
         onto the stage's devices sharded over the axes it keeps only. Leave the sliced
         axis out of the value's partitioning.""")
def _():
    mesh = jax.make_mesh((2, 4), ("stage", "x"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    w = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("stage")))
    s0 = mm.task(lambda w: w * 2, name="s0", mesh_slice={"stage": 0})
    with jax.set_mesh(mesh):
        mm.mjit(s0)(w)


@error("register-task-invalid-regex", IMPLICIT, "A matcher that is not a regular expression",
       MultimeshValueError,
       r"Task matcher 'layer\(' is not a valid regular expression: missing \), unterminated "
       r"subpattern at position 5",
       """Matchers are Python regular expressions; escape special characters
       (`re.escape(name)`) to match a literal name.""")
def _():
    mm.register_task("layer(", task=mm.Task(mesh_slice={"stage": 0}))


@error("register-task-matcher-not-a-string", IMPLICIT, "A matcher that is not a string",
       MultimeshTypeError, r"A task matcher must be a string .*got int 3",
       """Matchers are names or regular expressions.""")
def _():
    mm.register_task(3, task=mm.Task(mesh=mesh4()))


@error("register-task-neither-callback-nor-task", IMPLICIT,
       "`register_task` without a callback or a task", MultimeshValueError,
       r"register_task\('layer0'\) needs either `callback=` \(called as "
       r"callback\(matched_name, backprop\) -> Task\) or `task=` \(a Task\); it got neither",
       """Say where matched ops go: a fixed `task=Task(...)` or a
       `callback(matched_name, backprop) -> Task`.""")
def _():
    mm.register_task("layer0")


@error("register-task-callback-and-task", IMPLICIT, "`register_task` with a callback and a task",
       MultimeshValueError, r"register_task\('layer0'\) got both `callback=` and `task=`; give only one",
       """Give only one of `callback=` and `task=`.""")
def _():
    mm.register_task("layer0", callback=lambda name, backprop: None,
                     task=mm.Task(mesh_slice={"stage": 0}))


@error("register-task-task-without-submesh", IMPLICIT, "A registered Task without a submesh",
       MultimeshValueError,
       r"register_task\('layer0'\): the Task has neither `mesh` nor `mesh_slice`; give one of "
       r"them so the matched ops have a submesh",
       """A registered task places ops, so it needs a `mesh` or a `mesh_slice` of the
       active `MultiMesh`.""")
def _():
    mm.register_task("layer0", task=mm.Task(name="x"))


@error("register-task-task-not-a-task", IMPLICIT, "`task=` that is not a Task", MultimeshTypeError,
       r"register_task\('layer0'\): `task` must be a multimesh.jax.Task, got dict "
       r"\{'mesh_slice': \{'stage': 0\}\}",
       """Wrap the options in `multimesh.jax.Task(...)`.""")
def _():
    mm.register_task("layer0", task={"mesh_slice": {"stage": 0}})


@error("register-task-callback-not-callable", IMPLICIT, "`callback=` that is not callable",
       MultimeshTypeError, r"register_task\('layer0'\): `callback` must be callable, got int",
       """The callback is called as `callback(matched_name, backprop)` and returns a
       Task.""")
def _():
    mm.register_task("layer0", callback=3)


@error("callback-returns-non-task", IMPLICIT, "A task callback that returns something else",
       MultimeshTypeError,
       r"The callback registered for task matcher 'layer0' must return a multimesh.jax.Task, but "
       r"for \('layer0', backprop=False\) it returned dict \{'mesh_slice': \{'stage': 0\}\}",
       """Return `multimesh.jax.Task(...)` from the callback (for every matched name and
       both directions).""")
def _():
    mm.register_task("layer0", callback=lambda name, backprop: {"mesh_slice": {"stage": 0}})
    mm.mjit(layered_model).lower(*layered_args())


@error("registered-task-remat-policy", IMPLICIT,
       "A checkpoint policy for a registered task", MultimeshValueError,
       r"Task 'layer0' \(match 'layer0' of task matcher 'layer0'\) is a registered task, "
       r"whose forward multimesh finds in the traced program, so it can only be recomputed "
       r"whole: `remat` must be True or False for it",
       """A registered task's ops are found after tracing, where jax's checkpoint policies
       no longer apply; `remat=True` recomputes its whole forward in its backward. To save
       some values (a policy), wrap the stage in `task(..., remat=policy)` instead.""")
def _():
    policy = jax.checkpoint_policies.dots_saveable
    mm.register_task("layer0", task=mm.Task(mesh=mesh4(), remat=policy))
    mm.mjit(layered_model).lower(*layered_args())


@error("callback-task-without-submesh", IMPLICIT, "A task callback that returns no submesh",
       MultimeshValueError,
       r"The callback registered for task matcher 'layer0' returned a Task for \('layer0', "
       r"backprop=False\) with neither `mesh` nor `mesh_slice`",
       """The returned Task must say where the matched ops run: give it a `mesh` or a
       `mesh_slice`.""")
def _():
    mm.register_task("layer0", callback=lambda name, backprop: mm.Task(name=name))
    mm.mjit(layered_model).lower(*layered_args())


@error("task-mesh-and-mesh-slice", IMPLICIT, "A Task with both `mesh` and `mesh_slice`",
       MultimeshValueError, r"^(?!Task None).*both .*mesh.* and .*mesh_slice",
       """A task's submesh is either a `mesh` or a `mesh_slice` of the active `MultiMesh`,
       not both.""")
def _():
    mm.Task(mesh=mesh4(), mesh_slice={"stage": 0})


@error("mesh-slice-without-multimesh", IMPLICIT, "A mesh_slice with no global mesh to slice",
       MeshError,
       r"Task 'layer0' has mesh_slice=\{'stage': 0\}, but there is no global mesh to slice\. A "
       r"mesh_slice selects part of the global mesh",
       """A mesh_slice cuts the current global mesh: the entered `MultiMesh`, else jax's
       mesh (`jax.set_mesh(mesh)` or `with mesh:`). Compile inside one of them (or
       decorate the function with the `MultiMesh`), or give the task a `mesh` instead.""")
def _():
    mm.register_task("layer0", task=mm.Task(mesh_slice={"stage": 0}))
    mm.mjit(layered_model).lower(*layered_args())


@error("mesh-slice-unknown-axis", IMPLICIT, "A mesh_slice naming an axis the mesh lacks",
       MeshError,
       r"Task 'layer0' mesh_slice: unknown axis name\(s\) \['pipe'\]; the global mesh has axes "
       r"\('stage', 'x'\)",
       """`mesh_slice` keys are axis names of the active `MultiMesh`.""")
def _():
    mm.register_task("layer0", task=mm.Task(mesh_slice={"pipe": 0}))
    with global_mesh():
        mm.mjit(layered_model).lower(*layered_args())


@error("mesh-slice-index-out-of-range", IMPLICIT, "A mesh_slice index beyond the axis",
       MeshError,
       r"Task 'layer0' mesh_slice: index 5 is out of range for axis 'stage' of size 2 "
       r"\(valid indices are 0\.\.1\)",
       """Slice indices run from 0 to the axis size minus one.""")
def _():
    mm.register_task("layer0", task=mm.Task(mesh_slice={"stage": 5}))
    with global_mesh():
        mm.mjit(layered_model).lower(*layered_args())


@error("implicit-task-name-two-submeshes", IMPLICIT,
       "A callback gives one task name two submeshes", MultimeshValueError,
       r"Task name 'layer' was given two different device sets: match 'layer0' \(forward\) of "
       r"task matcher 'layer\\\\d' puts it on device positions \[0, 1, 2, 3\].*match 'layer1' "
       r"\(forward\).* on \[4, 5, 6, 7\].*One task name has one submesh",
       """A task name identifies one submesh: return a different `Task(name=...)` per
       submesh, e.g. the matched name itself.""")
def _():
    mm.register_task(r"layer\d", callback=lambda name, backprop: mm.Task(
        name="layer", mesh_slice={"stage": int(name[-1])}))
    with global_mesh():
        mm.mjit(layered_model).lower(*layered_args())


@error("matcher-empty-capture-group", IMPLICIT, "A matcher whose capture group matches nothing",
       DiagnosticError,
       r"matcher 'layer\(\\d\*\)' produced an empty match on the op name stack "
       r"'jit\(f\)/layer/sin'; its first capture group is the task name",
       """The first capture group of a matcher is the task name and must match at least one
       character: use `\\d+` instead of `\\d*`.""")
def _():
    mm.register_task(r"layer(\d*)", task=mm.Task(mesh=mesh4()))

    def f(x):
        with jax.named_scope("layer"):
            return jnp.sin(x)

    mm.mjit(f).lower(jnp.ones(4))


@error("plan-unit-does-not-fit", IMPLICIT, "`plan_pipeline`: a unit larger than the memory limit",
       MultimeshValueError,
       r"`plan_pipeline` found no plan within memory_limit=1,000 bytes per device: unit "
       r"'layer0' alone needs",
       """The planner never splits a unit, so the largest unit (its parameters, their
       gradient and optimizer state, one microbatch of its residuals) must fit one device.
       Raise the limit, let the planner shard the parameters over each stage's devices
       (leave `fsdp` unset, or `fsdp=True`), or split the unit into smaller named
       parts.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), memory_limit=1000, fsdp=False)


@error("plan-no-split-fits", IMPLICIT, "`plan_pipeline`: no split within the memory limit",
       MultimeshValueError,
       r"every unit fits alone .* but no contiguous split keeps every stage under the limit",
       """Each unit fits a device alone, but with the allowed number of stages some stage
       must hold several and goes over the limit. Allow more stages (leave `num_stages`
       unset) or more microbatches, or raise the limit.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=1, memory_limit=5000,
                     fsdp=False)


@error("cluster-unknown-kind", API, "`Cluster` with a device kind it does not know",
       MultimeshValueError,
       r"`Cluster`: unknown device kind 'b300'; known kinds: \['a100-40gb', 'a100-80gb', "
       r"'h100', 'h200', 'tpu-v4', 'tpu-v5e', 'tpu-v5p'\]",
       """The cluster planner carries published figures for the kinds it names (the
       datasheets cited in docs/planning.md). Use one of them, or describe another device
       with `kind='custom'` and its `peak_flops`, `hbm_bytes`, `hbm_bandwidth`,
       `link_bandwidth` and `network_bandwidth`.""")
def _():
    mm.Cluster("b300", devices=8)


@error("cluster-partial-node", API, "`Cluster` whose devices do not fill whole nodes",
       MultimeshValueError, r"`Cluster`: 12 devices do not fill whole nodes of 8",
       """A described cluster is whole nodes (8 GPUs for the H100, H200 and A100 kinds):
       give a multiple of `devices_per_node`, or set `devices_per_node` to the real
       node size.""")
def _():
    mm.Cluster("h100", devices=12)


@error("plan-cluster-no-fit", API, "`plan_cluster`: no layout fits the devices' memory",
       MultimeshValueError,
       r"`plan_cluster`: none of the \d+ layouts of llama3-405b \(405.9B parameters\) on 8 "
       r"x h100 fits 72.0 GB per device, even with full recompute",
       """Every layout was priced, each pipeline stage with full recompute as its last
       resort, and none fits 90% of a device's HBM. The message says what the weights and
       Adam state alone need per device (16 bytes per parameter): plan for more devices or
       a kind with more HBM (`Cluster('h200', ...)`), or remove pins that force a
       layout.""")
def _():
    mm.plan_cluster(mm.Transformer.llama3("405b"), mm.Cluster("h100", devices=8))


@error("plan-cluster-tensor-across-nodes", API,
       "`plan_cluster` pinned to tensor parallelism wider than a node",
       MultimeshValueError, r"`plan_cluster`: tensor=16 spans more than a node of 8 devices",
       """Tensor parallelism moves every layer's activations several times a step, which
       only a node's links (NVLink, ICI) carry fast enough; the planner keeps it inside a
       node. Pin `tensor` to at most `devices_per_node`, and spread over nodes with
       `pipeline`, `data` or `fsdp`.""")
def _():
    mm.plan_cluster(mm.Transformer.llama3("8b"), mm.Cluster("h100", devices=16), tensor=16)


@error("plan-cluster-not-a-transformer", API, "`plan_cluster` given something else to plan",
       MultimeshTypeError, r"`plan_cluster` plans a `multimesh.jax.Transformer`",
       """The cluster planner plans a decoder-only transformer described by its shapes:
       `mm.Transformer(layers=..., d_model=..., heads=..., kv_heads=..., ffn=..., vocab=...,
       seq=..., global_batch=...)` or `mm.Transformer.llama3('70b')`. To plan your own
       program on the devices at hand use `plan_pipeline`.""")
def _():
    mm.plan_cluster("llama3-70b", mm.Cluster("h100", devices=64))
@error("plan-unit-not-costed", IMPLICIT, "`plan_pipeline`: a unit that cannot be costed alone",
       MultimeshValueError,
       r"`plan_pipeline` cannot cost unit 'odd''s forward: its 1 operation\(s\) "
       r"\(mm_catalogue_unlowerable\) did not lower on their own",
       """The planner lowers each unit's forward and backward operations on their own
       for XLA's cost analysis (with their sharding types, for a model typed over an
       explicit mesh). An operation that has no lowering, or that XLA refuses alone,
       stops it; the error names the unit, its operations and XLA's reason. Check that
       the step lowers under `jax.jit`, name the unit's parts differently, or write the
       stages' `register_task` rules yourself.""")
def _():
    from jax.extend.core import Primitive

    odd = Primitive("mm_catalogue_unlowerable")  # an abstract rule, and no lowering
    odd.def_abstract_eval(lambda x: x)

    def loss(ws, x):
        with jax.named_scope("odd"):
            x = odd.bind(x)
        for i, w in enumerate(ws):
            with jax.named_scope(f"layer{i}"):
                x = jnp.tanh(x @ w)
        return jnp.mean(x)

    mm.plan_pipeline(loss, [jnp.eye(8)] * 2, jnp.ones((8, 8)), num_stages=2)


@error("plan-too-few-units", IMPLICIT, "`plan_pipeline` on a program without named parts",
       MultimeshValueError,
       r"`plan_pipeline` found 0 unit\(s\) \(\[\]\) in the step's name stack",
       """The planner cuts between name-stack units (Flax submodules, NNX attributes,
       `jax.named_scope` blocks) and needs at least two. Name the model's parts.""")
def _():
    mm.plan_pipeline(lambda w, x: (x @ w).sum(), jnp.eye(16), jnp.ones((8, 16)))


@error("plan-stages-do-not-divide", IMPLICIT, "`plan_pipeline` with a non-dividing `num_stages`",
       MultimeshValueError,
       r"num_stages=3 does not divide the 8 devices; .* choose one of \[1, 2, 4, 8\]",
       """Every stage gets the same number of devices: choose a number of stages that
       divides the devices (or leave `num_stages` unset).""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=3)


@error("plan-more-stages-than-units", IMPLICIT, "`plan_pipeline` with more stages than units",
       MultimeshValueError,
       r"num_stages=4 ask for at least 4 stages, but the step has only 2 units "
       r"\(layer0, layer1\)",
       """Each stage holds at least one unit: ask for fewer stages, or name the model's
       parts more finely (more submodules or `jax.named_scope` blocks).""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=4)


@error("plan-schedule-not-modelled", IMPLICIT, "`plan_pipeline` with a schedule it cannot model",
       MultimeshValueError,
       r"schedule='custom' is not one the planner can model: it has no textbook order to "
       r"model",
       """The planner models every registered schedule but `custom`: those for one
       contiguous stage per submesh (chosen among by default) and, when named, the
       interleaved and V-shape ones. Plan with one of them, then write your own order
       for the planned rules if you like.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), schedule="custom")


@error("plan-schedule-accepts-nothing", IMPLICIT,
       "`plan_pipeline` with a schedule no candidate suits",
       MultimeshValueError,
       r"`plan_pipeline` plans schedule 'dualpipe-v' with 2 stages per submesh \(v-shape\), "
       r"so it needs a multiple of 2 stages on at least two submeshes \(4 stages or more\), "
       r"but the candidates are \[2\] stage\(s\)",
       """A schedule with two stages per submesh needs an even number of stages over at
       least two submeshes (and DualPipeV at least 2P microbatches); the planner does not
       plan it with one stage per submesh. Allow more stages or microbatches (or leave
       them to the planner), name the model's parts more finely, or name another
       schedule.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, num_microbatches=2,
                     schedule="dualpipe-v")


@error("plan-bad-cost-source", IMPLICIT, "`plan_pipeline` with an unknown cost source",
       MultimeshValueError,
       r"`plan_pipeline`: costs='flops' is not a cost source; valid choices are "
       r"\['xla', 'profile'\]",
       """`costs="xla"` (the default) prices XLA's cost analysis of each unit at
       `device_flops`; `costs="profile"` runs and times each unit on the first device.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), costs="flops")


@error("plan-bad-memory-limit", IMPLICIT, "`plan_pipeline` with a non-positive memory limit",
       MultimeshValueError,
       r"`plan_pipeline`: `memory_limit` must be a positive number or None, got -1",
       """Give the memory limit in bytes per device, or None for no limit.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), memory_limit=-1)


@error("plan-compare-without-track", IMPLICIT, "`PipelinePlan.compare` with another program's profile",
       MultimeshValueError,
       r"The profile has no track for stage 0's submesh \(devices \[0, 1, 2, 3\]\)",
       """`compare` reads each stage's busy time from the track of its submesh; profile
       the program compiled under this plan (`with plan:`).""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    plan.compare({"traceEvents": []})


@error("plan-json-bad-field", IMPLICIT, "`PipelinePlan.from_json` with an edited plan",
       MultimeshValueError,
       r"`PipelinePlan.from_json`: `batch` must be \[argnum, dim, rows\] with rows divisible "
       r"by num_microbatches=3, got \[1, 0, 8\]",
       """Every field of a saved plan is checked before it is used: the stages, their
       devices and positions, the microbatches (which must divide the batch's rows), the
       schedule, the interleave and the reduction. Load the JSON `plan.to_json()` wrote,
       unedited, or plan again.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, num_microbatches=2)
    saved = json.loads(plan.to_json())
    saved["num_microbatches"] = 3
    mm.PipelinePlan.from_json(json.dumps(saved))


@error("plan-json-old-version", IMPLICIT, "`PipelinePlan.from_json` with a plan of another version",
       MultimeshValueError,
       r"the plan's format_version is None, but this multimesh reads version 2 \(a plan "
       r"written before versions, whose microbatches summed\)",
       """`plan.to_json()` writes its format's version; a plan of another version (or one
       written before versions, whose `plan.microbatch` summed the microbatches where
       plans now average them by default) is refused rather than read differently. Plan
       again and save the new plan.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    saved = json.loads(plan.to_json())
    del saved["format_version"]
    mm.PipelinePlan.from_json(json.dumps(saved))


@error("plan-json-unequal-stages", IMPLICIT,
       "`PipelinePlan.from_json` with stages of different sizes", MultimeshValueError,
       r"`PipelinePlan.from_json`: the stages have 3 and 5 devices; every stage of a plan "
       r"has the same number",
       """Every stage of a plan has as many devices, over the same mesh axes (`data`, and
       `model` for a tensor-parallel plan), so that the plan's logical axes and layout
       hold on each. Keep the stages' device lists equal in size, or plan again.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    saved = json.loads(plan.to_json())
    saved["stages"][0]["devices"] = saved["stages"][0]["positions"] = [0, 1, 2]
    saved["stages"][1]["devices"] = saved["stages"][1]["positions"] = [3, 4, 5, 6, 7]
    mm.PipelinePlan.from_json(json.dumps(saved))


@error("plan-logical-axis-not-on-stages", IMPLICIT,
       "`plan_pipeline` mapping a logical axis onto a mesh axis its stages lack",
       MultimeshValueError,
       r"`plan_pipeline`: logical_axes maps 'mlp' onto the mesh axis 'model', but each "
       r"stage's submesh has only the axes \('data',\); stages get a 'model' axis only "
       r"where the model's own shardings name it",
       """A plan's stages have the axis `data`, and `model` where the model's own
       shardings (flax's logical rules in context, NNX partition metadata, jax sharding
       constraints) name it; a model typed over an explicit mesh has that mesh's axes.
       Map logical axes onto those, or annotate the model so that it names `model`.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), logical_axes=(("mlp", "model"),))


@error("plan-json-logical-axis-not-on-stages", IMPLICIT,
       "A plan's JSON edited to map a logical axis onto a mesh axis its stages lack",
       MultimeshValueError,
       r"PipelinePlan: logical_axes maps 'mlp' onto the mesh axis 'model', but the plan's "
       r"stages have only the axes \('data',\)",
       """The same check as `plan_pipeline`'s, on a plan read back (or built with
       `dataclasses.replace`): each logical axis maps onto one of the stages' axes.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    saved = json.loads(plan.to_json())
    saved["logical_axes"] = [["mlp", "model"]]
    mm.PipelinePlan.from_json(json.dumps(saved))


@error("plan-tensor-not-a-divisor", IMPLICIT,
       "`plan_pipeline` with a `tensor` size that does not divide a stage",
       MultimeshValueError,
       r"`plan_pipeline`: tensor=3 does not divide the 4 devices of a stage \(8 devices in "
       r"all\); choose one of \[1, 2, 4\]",
       """`tensor` is the size of each stage's `model` axis, which the stage's devices
       must divide (the rest form its `data` axis). Give a divisor, or None (the
       planner chooses).""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, tensor=3)


@error("plan-tensor-not-an-integer", IMPLICIT, "`plan_pipeline` with a `tensor` that is no size",
       MultimeshTypeError,
       r"`plan_pipeline`: `tensor` must be the size of each stage's `model` axis \(an "
       r"integer\) or None \(the planner chooses\), got str '2'",
       """`tensor=` takes the size of each stage's `model` axis: an integer dividing a
       stage's devices, or None for the planner's choice.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, tensor="2")


@error("plan-tensor-explicit-model", IMPLICIT,
       "`plan_pipeline` asked for a `model` axis on a model typed over an explicit mesh",
       MultimeshValueError,
       r"`plan_pipeline` got tensor=2, but the parameters are typed over an explicit mesh "
       r"\{'fsdp': 8\}: the plan keeps the model's own axes",
       """A model typed over an explicit mesh (jax's sharding in types) keeps its own
       shardings: each stage gets that mesh's axes over its share of the devices, so
       the planner adds no `model` axis. Leave `tensor` unset; shard over a tensor axis
       of the model's own mesh instead.""")
def _():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        ws = [jax.device_put(jnp.eye(16), P("fsdp")) for _ in range(2)]
        mm.plan_pipeline(layered_model, ws, jnp.ones((8, 16)), num_stages=2, tensor=2)


@error("plan-tensor-nothing-names-model", IMPLICIT,
       "`plan_pipeline` asked for tensor parallelism a model does not name",
       MultimeshValueError,
       r"`plan_pipeline` got tensor=2, but no sharding in the step names the mesh axis "
       r"'model'",
       """The planner shards the dimensions the model's own shardings put on `model`
       (flax's logical rules in context, NNX partition metadata, jax sharding
       constraints); it does not choose them. Annotate the model, or leave `tensor`
       unset.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, tensor=2)


@error("plan-devices-not-devices", IMPLICIT, "`plan_pipeline` given device positions",
       MultimeshTypeError,
       r"`plan_pipeline`: `devices` must be jax devices \(e.g. `jax.devices\(\)\[4:\]`\), got 0 "
       r"\(int\)",
       """`devices=` takes the jax devices to plan on; the plan's rules then give positions
       in that list themselves (`TaskMesh(devices=...)`). Pass `jax.devices()[a:b]`, not
       numbers.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), devices=[0, 1, 2, 3])


@error("plan-duplicate-devices", IMPLICIT, "`plan_pipeline` given a device twice",
       MultimeshValueError, r"`plan_pipeline`: `devices` lists device\(s\) \[0\] more than once",
       """Every stage gets devices of its own; list each device once.""")
def _():
    d = jax.devices()
    mm.plan_pipeline(layered_model, *layered_args(), devices=[d[0], d[0], d[1], d[2]])


@error("plan-no-devices", IMPLICIT, "`plan_pipeline` with `devices=[]`",
       MultimeshValueError, r"`plan_pipeline` got devices=\[\]; a pipeline needs at least two",
       """Give at least two devices, or leave `devices` unset for all of `jax.devices()`.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), devices=[])


@error("plan-schedule-not-a-name", IMPLICIT, "`plan_pipeline` with a schedule that is no name",
       MultimeshTypeError, r"`plan_pipeline`: schedule=3 is not a schedule's name",
       """`schedule=` takes a schedule's name, a sequence of names to choose among, or None
       (the planner chooses).""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), schedule=3)


@error("plan-bad-machine-figure", IMPLICIT,
       "`plan_pipeline` with a zero, negative or NaN machine figure", MultimeshValueError,
       r"`plan_pipeline`: `device_flops` must be a positive number or None, got 0",
       """`device_flops` and `link_bandwidth` are positive rates (None: the platform's
       nominal one), `fragment_overhead` seconds >= 0, `optimizer_state_factor` >= 0 (2
       for Adam), `memory_limit` a positive number of bytes per device.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), device_flops=0)


@error("plan-empty-batch", IMPLICIT, "`plan_pipeline` with an empty batch", MultimeshValueError,
       r"`plan_pipeline` cuts the batch \(argument 1\) along dimension 0, but it has no rows "
       r"there",
       """The planner cuts the example batch into microbatches; give it at least one row,
       and `argnum`/`dim` that name the batch.""")
def _():
    ws, _ = layered_args()
    mm.plan_pipeline(layered_model, ws, jnp.ones((0, 16)))


@error("plan-unknown-reduction", IMPLICIT, "`plan_pipeline` with an unknown reduction",
       MultimeshValueError, r"`plan_pipeline` reduction must be one of 'sum', 'mean', got 'avg'",
       """A plan's microbatches are averaged (`"mean"`, the default, as `parallelize_step`)
       or summed (`"sum"`).""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), reduction="avg")


@warning("mjit-built-in-plan-traced-after", IMPLICIT,
         "An `mjit` built inside `with plan:` but called after it", MultimeshWarning,
         r"`mjit\(layered_model\)` was built inside a `with plan:` \(or `with Context\(\):`\) "
         r"block, but it is traced after the block exited",
         """A plan's (or a `Context`'s) rules apply to what is traced inside its block. Call
         the function (or `.lower(...)`) inside the block, or register the rules for good
         with `plan.apply()`.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    with plan:
        f = mm.mjit(layered_model)
    f(*layered_args())


@warning("pass-cache-damaged-entry", API,
         "A damaged entry in the disk cache beside jax's persistent cache", MultimeshWarning,
         r"multimesh's disk cache of lowered programs has a damaged entry for mjit\(loss\) "
         r"in /tmp/multimesh-example-cache/multimesh-passes: its header "
         r"is not a multimesh pass-cache entry's \(7 bytes\)\. It is ignored \(the program "
         r"is lowered again, and the entry is rewritten\)",
         """With jax's persistent cache on, multimesh keeps each program's lowering and
         its pass pipeline's result in `<jax_compilation_cache_dir>/multimesh-passes/`
         (docs/performance.md, "Warm restarts"). An entry that cannot be read, or whose
         contents do not match their hash (a truncated write, a disk error, another
         tool), is ignored and rewritten: the program compiles as if it were not there,
         and the values are unchanged. Deleting the directory is safe;
         `MULTIMESH_PIPELINE_CACHE=0` turns the cache off.""")
def _():
    import os
    import pathlib
    import shutil

    from jax.experimental.compilation_cache import compilation_cache
    os.environ.pop("MULTIMESH_DUMP_IR_TO", None)  # the cache is off while passes are dumped
    grad_fn, ws, x = two_stage()
    before = jax.config.jax_compilation_cache_dir
    d = pathlib.Path("/tmp/multimesh-example-cache")
    shutil.rmtree(d, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", str(d))
    try:
        for _ in range(2):  # a first compile writes the entries, then they break
            mm.clear_caches()
            mm.mjit(grad_fn).lower(ws, x).compile()
            for entry in (d / "multimesh-passes").iterdir():
                entry.write_bytes(b"damaged")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        compilation_cache.reset_cache()
        shutil.rmtree(d, ignore_errors=True)


@error("remat-policy-factory", API, "`remat=` given a policy factory, uncalled",
       MultimeshTypeError,
       r"`remat` got `jax.checkpoint_policies.save_only_these_names` itself, which makes a "
       r"policy when called",
       """`save_only_these_names` and its kind make a policy from the names to save: call
       them, `remat=jax.checkpoint_policies.save_only_these_names("h")`.""")
def _():
    mm.Task(name="t", remat=jax.checkpoint_policies.save_only_these_names)


@error("parallelize-auto-remat-policy", FLAX,
       "`parallelize_step(num_stages='auto')` with a checkpoint policy", MultimeshValueError,
       r"parallelize_step got num_stages='auto' and the checkpoint policy remat=",
       """The planner's stages are `register_task` rules, and a registered stage is
       recomputed whole or not at all: pass `remat=True` or False, or write the stages as
       `task(..., remat=policy)` yourself.""", requires=("flax", "optax"))
def _():
    import flax.linen as nn
    import optax

    from multimesh.jax import flax as mmf

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(nn.Dense(16, name="l1")(nn.Dense(16, name="l0")(x)) ** 2)

    mmf.parallelize_step(Two(), optax.sgd(0.1), global_batch=jnp.ones((8, 16)),
                         num_stages="auto", remat=jax.checkpoint_policies.dots_saveable)


@error("visualize-memory-of-another-program", SCHEDULES,
       "`visualize_schedule` with another program's memory profile", MultimeshValueError,
       r"visualize_schedule's `memory` is the memory profile of another program",
       """A memory profile is drawn beside the program it measured; pass
       `compiled.memory_profile(...)` of the program you draw.""")
def _():
    grad_fn, ws, x = two_stage()
    a = mm.mjit(mm.microbatch(grad_fn, dim=0, size=8, argnum=1)).lower(ws, x).compile()
    b = mm.mjit(mm.microbatch(grad_fn, dim=0, size=4, argnum=1)).lower(ws, x).compile()
    mm.visualize_schedule(b, memory=a.memory_profile(ws, x))


@error("simulate-cost-not-finite", SCHEDULES, "A schedule simulated with an infinite cost",
       MultimeshValueError, r"must be a positive finite duration, got inf",
       """Every unit's cost is a positive, finite duration; transfers (`comm`) take a
       finite time >= 0 and residual bytes are >= 0.""")
def _():
    sched = pipelined().schedule
    sched.simulate(lambda unit: float("inf"))


@error("profile-without-tasks", SCHEDULES, "A profile or cost of a program without tasks",
       MultimeshValueError, r"This program has no tasks, so multimesh compiled it as one "
       r"`jax.jit` executable",
       """A program without tasks has no fragments, submeshes or schedule: time it with
       `compiled.profile(...)`, or place work with `task`/`register_task`.""")
def _():
    mm.xla_costs(mm.mjit(lambda x: x * 2).lower(jnp.ones(4)).compile())


@error("device-model-not-positive", SCHEDULES, "A `DeviceModel` with a zero rate",
       MultimeshValueError, r"DeviceModel: `peak_flops` must be a finite number > 0",
       """A roofline divides by its peak flops and memory bandwidth: give positive, finite
       rates (and an overhead >= 0).""")
def _():
    mm.DeviceModel(peak_flops=0, memory_bandwidth=1e12)


@error("device-model-negative-latency", SCHEDULES, "A `DeviceModel` with a negative collective latency",
       MultimeshValueError, r"DeviceModel: `collective_latency` must be a finite number >= 0 "
       r"\(seconds per collective step\)",
       """The latency is what each ring step of a collective waits besides its bytes: give
       seconds >= 0 (0: bandwidth only), or let `DeviceModel.calibrate()` measure it.""")
def _():
    mm.DeviceModel(peak_flops=1e12, memory_bandwidth=1e12, collective_latency=-1e-6)


@error("device-model-negative-rendezvous", SCHEDULES, "A `DeviceModel` with a negative rendezvous",
       MultimeshValueError, r"DeviceModel: `rendezvous` must be a finite number >= 0 "
       r"\(the fraction of a call's compute its collectives add\)",
       """The rendezvous is the share of a call's compute that its collectives wait for where
       the devices' threads outnumber the host's cores (XLA:CPU): give a fraction >= 0 (0:
       none, as on accelerators), or let `DeviceModel.calibrate()` measure it.""")
def _():
    mm.DeviceModel(peak_flops=1e12, memory_bandwidth=1e12, rendezvous=-0.5)


@error("cluster-negative-latency", API, "`Cluster` with a negative collective latency",
       MultimeshValueError, r"`Cluster`: `link_latency` must be a number of seconds >= 0",
       """Give the seconds each ring step of a collective waits inside a node (or
       `network_latency` between nodes), 0 for none, or leave it to the datasheet.""")
def _():
    mm.Cluster("h100", 8, link_latency=-1e-6)


@error("device-model-json-bad-keys", SCHEDULES, "`DeviceModel.from_json` with a key that is no field",
       MultimeshValueError, r"`DeviceModel.from_json` takes an object with `peak_flops`, "
       r"`memory_bandwidth` and any of",
       """Load the JSON `DeviceModel.to_json()` wrote; a field it lacks (a file written
       before the field existed) takes its default.""")
def _():
    mm.DeviceModel.from_json('{"peak_flops": 1e12, "memory_bandwidth": 1e12, "alpha": 1e-6}')


@error("best-memory-limit-not-positive", SCHEDULES, "`best(memory_limit=nan)`",
       MultimeshValueError, r"memory_limit must be a positive number of bytes per device",
       """Give the limit in bytes per device, or None for no limit.""")
def _():
    mm.compare_schedules(pipelined()).best(memory_limit=float("nan"))


@error("dump-dir-cannot-be-made", API, "`MULTIMESH_DUMP_IR_TO` that cannot be made",
       MultimeshValueError, r"MULTIMESH_DUMP_IR_TO='/dev/null/dumps' names a directory "
       r"multimesh cannot make or write",
       """Set `MULTIMESH_DUMP_IR_TO` to a directory you can write (it is made if need be),
       or unset it to dump nothing.""")
def _():
    os.environ["MULTIMESH_DUMP_IR_TO"] = "/dev/null/dumps"
    try:
        grad_fn, ws, x = two_stage()
        mm.mjit(grad_fn).lower(ws, x).compile()
    finally:
        del os.environ["MULTIMESH_DUMP_IR_TO"]


@error("mjit-under-jax-transform", API, "An `mjit` function called under `jax.jit`",
       MultimeshTypeError, r"`mjit\(<lambda>\)` was called under jax.jit",
       """An `mjit` program is compiled and run by multimesh on concrete arrays; jax
       cannot trace it. Put the transformation inside (`mjit(jax.grad(f))`) and call the
       `mjit` function outside `jax.jit`, or call the plain function there.""")
def _():
    inner = mm.mjit(lambda x: x * 2)
    jax.jit(inner)(jnp.ones(4))


# =========================================================================== Flax

_FLAX = ("flax", "optax")


@error("parallelize-step-without-batch", FLAX, "`parallelize_step` without an example batch",
       MultimeshValueError,
       r"parallelize_step needs an example batch: pass `global_batch=` \(jax arrays of the "
       r"whole batch\) or `local_batch=`",
       """`parallelize_step` compiles the step ahead of time and needs the batch's shapes:
       pass `global_batch=` (jax arrays) or `local_batch=` (this process's host data).""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    mmf.parallelize_step(Model(), optax.sgd(0.1))


@error("parallelize-step-bad-num-stages", FLAX, "`parallelize_step` with an unknown `num_stages`",
       MultimeshValueError,
       r"parallelize_step `num_stages` must be a positive integer, 'auto' \(the planner "
       r"chooses, see `multimesh.jax.plan_pipeline`\) or None, got 'many'",
       """`num_stages="auto"` lets the planner choose the stages; otherwise give a number.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    mmf.parallelize_step(Model(), optax.sgd(0.1), global_batch=jnp.ones((8, 4)),
                         num_stages="many", num_microbatches=2)


@error("parallelize-step-auto-with-interleave", FLAX,
       "`parallelize_step(num_stages=\"auto\")` with options the planner cannot honour",
       MultimeshValueError,
       r"parallelize_step got num_stages='auto' and `interleave`; the planner places one "
       r"contiguous stage per submesh",
       """The planner chooses contiguous stages and their schedule; `interleave`,
       `custom_schedule` and `unrolling` do not fit its plan. Drop them, or call
       `plan_pipeline` and write the rest yourself.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4, name="a")(x)
            return nn.Dense(4, name="b")(x).sum()

    mmf.parallelize_step(Model(), optax.sgd(0.1), global_batch=jnp.ones((8, 4)),
                         num_stages="auto", num_microbatches=2, interleave=2)


@error("parallelize-step-both-batches", FLAX, "`parallelize_step` with both batch kinds",
       MultimeshValueError,
       r"parallelize_step takes either `global_batch=` or `local_batch=`, not both",
       """Give the global batch (jax arrays) or this process's local batch, not both.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    batch = jnp.ones((8, 4))
    mmf.parallelize_step(Model(), optax.sgd(0.1), global_batch=batch, local_batch=batch)


@error("parallelize-step-not-a-module", FLAX, "`parallelize_step` given something else",
       MultimeshTypeError, r"parallelize_step expects a linen or NNX module instance, got int",
       """Pass a linen module instance or an NNX module.""", requires=_FLAX)
def _():
    import optax

    import multimesh.jax.flax as mmf

    mmf.parallelize_step(3, optax.sgd(0.1), global_batch=jnp.ones((8, 4)))


@error("parallelize-step-module-class", FLAX, "`parallelize_step` given a module class",
       MultimeshTypeError, r"parallelize_step expects a linen or NNX module instance.*Model\(",
       """Pass an instance, `Model(...)`, not the class.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    mmf.parallelize_step(Model, optax.sgd(0.1), global_batch=jnp.ones((8, 4)))


@error("parallelize-step-train-state-other-optimizer", FLAX,
       "`init_state` with another optimizer than `optimizer=`", MultimeshValueError,
       r"parallelize_step got `init_state`, a TrainState with its own optimizer "
       r"\(`init_state.tx`\), and a different `optimizer`; one of them would be ignored",
       """A flax `TrainState` carries its optimizer (`tx`) and that optimizer's state; a
       different `optimizer=` cannot both train it and match its state. Pass the state's
       own (`optimizer=init_state.tx`) or one built the same way (optimizers are compared
       by how they were built: a fresh `optax.adam(1e-3)` after a restart is the saved
       state's `optax.adam(1e-3)`), or restart the optimizer with
       `init_state.replace(tx=optimizer, opt_state=optimizer.init(init_state.params))`.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn
    from flax.training.train_state import TrainState

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    batch = jnp.ones((8, 4))
    params = Model().init(jax.random.key(0), batch)["params"]
    state = TrainState.create(apply_fn=Model().apply, params=params, tx=optax.sgd(0.1))
    mmf.parallelize_step(Model(), optax.adam(1e-3), global_batch=batch, init_state=state)


@error("parallelize-step-init-state-does-not-fit", FLAX,
       "`init_state` that does not fit the model", MultimeshValueError,
       r"parallelize_step `init_state` does not fit the model: it has nothing at "
       r"init_state\['params'\]\['Dense_0'\]\['bias'\]",
       """`init_state` is read against the state `model.init` builds for the example batch
       (flax's layout: `params` is `variables["params"]`): a `TrainState`, the dict orbax
       restores for one, a variables dict `{'params': ...}` or the params alone, of this
       model. The message names the first place where the two differ; restore the
       checkpoint of this model, or convert it.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    batch = jnp.ones((8, 4))
    kernel = jnp.zeros((4, 4))
    mmf.parallelize_step(Model(), optax.sgd(0.1), global_batch=batch,
                         init_state={"params": {"Dense_0": {"kernel": kernel}}})


@error("parallelize-step-linen-other-collections", FLAX,
       "`parallelize_step` (linen) of a model with other collections", MultimeshValueError,
       r"parallelize_step trains a linen model's `params`, as a flax TrainState holds "
       r"them; `model.init` also made the collections \['batch_stats'\]",
       """A flax `TrainState` holds `params` and the optimizer's state only; batch statistics
       and other collections have no place in it. Compile your own step with
       `multimesh.jax.mjit` (apply with `mutable=` and keep the collections beside the
       state), or use an NNX model, whose `parallelize_step` keeps every Variable.""",
       requires=_FLAX)
def _():
    import optax
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=True)(x).sum()

    mmf.parallelize_step(Model(), optax.sgd(0.1), global_batch=jnp.ones((8, 4)))


@error("parallelize-step-bad-optimizer", FLAX, "`parallelize_step` (NNX) given no optimizer",
       MultimeshTypeError,
       r"parallelize_step: `optimizer` must be an optax GradientTransformation or an "
       r"nnx.Optimizer, got int",
       """Pass an optax transformation (e.g. `optax.adam(1e-3)`) or an `nnx.Optimizer`
       built for the model.""",
       requires=_FLAX)
def _():
    from flax import nnx

    import multimesh.jax.flax as mmf

    mmf.parallelize_step(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), 3, global_batch=jnp.ones((8, 4)))


@error("parallelize-step-linen-bad-optimizer", FLAX, "`parallelize_step` (linen) given no optimizer",
       MultimeshTypeError,
       r"parallelize_step: `optimizer` must be an optax GradientTransformation.*got int",
       """Pass an optax transformation (e.g. `optax.adam(1e-3)`).""",
       requires=_FLAX)
def _():
    from flax import linen as nn

    import multimesh.jax.flax as mmf

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4)(x).sum()

    mmf.parallelize_step(Model(), 3, global_batch=jnp.ones((8, 4)))


@error("flax-task-nnx-class", FLAX, "`flax.task` given an NNX module class", MultimeshTypeError,
       r"`task` takes an NNX module \*instance\* \(NNX modules are built eagerly\): write "
       r"task\(Linear\(\.\.\.\), \.\.\.\) instead of task\(Linear, \.\.\.\)",
       """NNX modules are built eagerly: wrap an instance, `task(Model(...), ...)`.""",
       requires=_FLAX)
def _():
    from flax import nnx

    import multimesh.jax.flax as mmf

    mmf.task(nnx.Linear, name="s0", mesh=mesh4())


@error("flax-task-not-callable", FLAX, "`flax.task` given something else", MultimeshTypeError,
       r"`multimesh.jax.flax.task` expects a linen Module class, an nnx.Module instance or a "
       r"callable, got int",
       """Wrap a linen module class, an NNX module instance or a function.""",
       requires=_FLAX)
def _():
    import multimesh.jax.flax as mmf

    mmf.task(3, name="s0", mesh=mesh4())


@error("shard-axes-not-a-name", FLAX, "`shard_axes` given something other than a name",
       MultimeshTypeError, r"`shard_axes` takes logical axis names \(str or None\), got 3",
       """`shard_axes("batch", None)` takes logical axis names, one per dimension (None for
       an unsharded dimension).""",
       requires=_FLAX)
def _():
    import multimesh.jax.flax as mmf

    mmf.shard_axes("batch", 3)


@error("nnx-task-returns-module", FLAX, "An NNX task that returns a module", MultimeshValueError,
       r"task 't': returning NNX objects from a task is not supported; return arrays and update "
       r"the objects passed in instead",
       """Tasks return arrays; changes to NNX objects passed in are written back
       automatically.""",
       requires=_FLAX)
def _():
    from flax import nnx

    import multimesh.jax.flax as mmf

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    t = mmf.task(lambda m, x: m, name="t", mesh=mesh4())
    mmf.mjit(lambda m, x: t(m, x))(model, jnp.ones((2, 4)))


@error("nnx-structure-changed", FLAX, "An NNX object changes structure inside `mjit`",
       MultimeshValueError,
       r"mjit\(f\): an NNX object changed its structure \(new or removed attributes, Variables "
       r"or static fields\) inside the call; only Variable values may change",
       """Inside `mjit` only Variable values may change. Create new attributes and
       Variables before the call.""",
       requires=_FLAX)
def _():
    from flax import nnx

    import multimesh.jax.flax as mmf

    def f(m, x):
        m.extra = nnx.Param(jnp.ones(3))
        return m(x)

    mmf.mjit(f)(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.ones((2, 4)))


@error("nnx-compiled-wrong-arguments", FLAX, "A compiled NNX program called with other shapes",
       MultimeshValueError, r"(?i)compiled function called with.*\(3, 4\).*\(2, 4\)",
       """A compiled program is specialised to the shapes and dtypes it was lowered with;
       lower it again, or call `mjit(f)` directly.""",
       requires=_FLAX)
def _():
    from flax import nnx

    import multimesh.jax.flax as mmf

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    compiled = mmf.mjit(lambda m, x: m(x)).lower(model, jnp.ones((2, 4))).compile()
    compiled(model, jnp.ones((3, 4)))


@error("nnx-compiled-other-static-arguments", FLAX,
       "A compiled NNX program called with other static arguments", MultimeshValueError,
       r"Compiled function called with static arguments \{'act': 'tanh'\}, but it was "
       r"compiled for \{'act': 'relu'\}",
       """Static arguments are part of what was compiled; lower it again, or call `mjit(f)`,
       which compiles once per set of static values.""",
       requires=_FLAX)
def _():
    from flax import nnx

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    f = mm.mjit(lambda m, x, act: getattr(jax.nn, act)(m(x)), static_argnames="act")
    f.lower(model, jnp.ones((2, 4)), act="relu").compile()(model, jnp.ones((2, 4)), act="tanh")


@error("nnx-physical-sharding", FLAX, "A physical `NamedSharding` for `mjit` over NNX objects",
       MultimeshValueError,
       r"mjit\(<lambda>\): in_shardings entry .* names mesh axes \['d'\] that no task of "
       r"the program maps",
       """With NNX objects among the arguments, `in_shardings`/`out_shardings` are logical
       names, read by the task that uses each value; a `NamedSharding` whose axes no task
       maps would do nothing. Use a `PartitionSpec` of logical names, or `jax.device_put`
       the arrays.""",
       requires=_FLAX)
def _():
    from flax import nnx

    rows = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), P("d", None))
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    mm.mjit(lambda m, x: m(x), in_shardings=(None, rows))(model, jnp.ones((4, 4)))


@error("nnx-bad-sharding-entry", FLAX, "An `in_shardings` entry for an NNX object of a wrong kind",
       MultimeshValueError,
       r"mjit\(<lambda>\): the sharding for an NNX object must be a PartitionSpec, "
       r"NamedSharding, nnx.StateSharding or a \(nnx.State or dict\) of specs by path, got 3",
       """For an NNX object give a spec for all its Variables, an `nnx.StateSharding`, or
       an `nnx.State` of specs (e.g. from `nnx.get_partition_spec`).""",
       requires=_FLAX)
def _():
    from flax import nnx

    import multimesh.jax.flax as mmf

    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    mmf.mjit(lambda m, x: m(x), in_shardings=(3, None))(model, jnp.ones((2, 4)))


# =========================================================================== Shardy:MPMD


@error("compile-mpmd-not-a-program", SHARDY, "`compile_mpmd` given something that is not a module",
       MultimeshTypeError,
       r"`compile_mpmd` expects a module partitioned by Shardy:MPMD \(MLIR text or "
       r"bytecode, or an ir\.Module\) or a program lowered by Shardy's front end, got function",
       """Pass the partitioner's output (`apply_mpmd_partitioning(...).mpmd_module` or its
       text), or what Shardy's `mpmd.jit(f, config).lower(...)` returns; to compile a jax
       function with tasks use `mjit`.""")
def _():
    mm.compile_mpmd(lambda x: x, {"m1": range(4)})


@error("compile-mpmd-not-partitioned", SHARDY, "`compile_mpmd` given a module that is not partitioned",
       MultimeshValueError,
       r"`compile_mpmd`: @main argument #0 has type tensor<8xf32>, not an !mpmd.mesh_tensor; "
       r"pass the output of Shardy's MPMD partitioner",
       """A partitioned program's `@main` takes `!mpmd.mesh_tensor`s. Run
       `jaxlib._sdy_mpmd.apply_mpmd_partitioning(..., phases=ALL)` on the
       `named_computation` module first (docs/shardy-mpmd.md).""")
def _():
    mm.compile_mpmd("func.func @main(%x: tensor<8xf32>) -> tensor<8xf32> {\n"
                    "  return %x : tensor<8xf32>\n}\n", {"m1": range(4)})


@error("compile-mpmd-no-meshes", SHARDY, "`compile_mpmd` without the mesh map",
       MultimeshValueError,
       r"`compile_mpmd` needs `meshes`: the device positions of each mesh of the program "
       r"\('m1'\), e.g. \{'m1': range\(0, 4\), 'm2': range\(4, 8\)\}",
       """The mpmd dialect names meshes but no devices. Say where each mesh's devices are:
       positions in `devices` (default `jax.devices()`) or a `jax.sharding.Mesh`. Programs
       lowered by Shardy's front end carry their topology and need no map.""")
def _():
    mm.compile_mpmd(partitioned_identity())


@error("compile-mpmd-unknown-mesh", SHARDY, "`compile_mpmd` given a mesh the program does not have",
       MultimeshValueError,
       r"`compile_mpmd` meshes has mesh 'm2', which the program does not have; its meshes are "
       r"'m1'",
       """The names in `meshes` must be the program's mesh names (its `topology`).""")
def _():
    mm.compile_mpmd(partitioned_identity(), {"m1": range(4), "m2": range(4, 8)})


@error("compile-mpmd-mesh-size", SHARDY, "`compile_mpmd` given the wrong number of devices for a mesh",
       MultimeshValueError,
       r"`compile_mpmd` meshes\['m1'\] has 2 devices, but the program's mesh 'm1' has 4 "
       r"\(axes \{'x': 4\}\)",
       """Give each mesh as many devices as its axes multiply to, in row-major order over
       its axes.""")
def _():
    mm.compile_mpmd(partitioned_identity(), {"m1": [0, 1]})


@error("compile-mpmd-bad-position", SHARDY, "`compile_mpmd` given a device position out of range",
       MultimeshValueError,
       r"`compile_mpmd` meshes\['m1'\] has device position 8, but there are 8 devices "
       r"\(valid positions are 0\.\.7\)",
       """Positions index `devices` (default `jax.devices()`).""")
def _():
    mm.compile_mpmd(partitioned_identity(), {"m1": range(6, 10)})


@error("compile-mpmd-bad-tree", SHARDY, "`compile_mpmd` given a tree that does not fit the program",
       MultimeshValueError,
       r"`compile_mpmd` in_tree has 2 leaves but the program has 1 @main argument\.",
       """`in_tree` is the treedef of the positional arguments (`jax.tree.structure(args)`)
       and must have one leaf per `@main` argument; `out_tree` one per result.""")
def _():
    mm.compile_mpmd(partitioned_identity(), {"m1": range(4)},
                    in_tree=jax.tree.structure((0, 0)))


@error("callback-not-held", SHARDY, "A saved or imported program calls a Python callback",
       MultimeshValueError,
       r"Fragment `f` calls a Python host callback \(jax\.debug\.print, pure_callback or "
       r"io_callback\) that this process does not hold\. A program with host callbacks "
       r"compiles only through `mjit`",
       """A host callback is a Python object that jax hands to XLA when it compiles the
       program; the IR holds only its index. `mjit` carries the callbacks of a program it
       traced into every fragment that calls one; a module from `compile_mpmd` (or saved
       to a file) has none to carry. Compile the jax function with `mjit`, or remove the
       callback before partitioning.""")
def _():
    mm.compile_mpmd(calling_back(
        "stablehlo.custom_call @xla_ffi_python_cpu_callback(%a) {has_side_effect = true, "
        "mhlo.backend_config = {index = 0 : ui64}} : (tensor<8xf32>) -> ()"), {"m1": range(4)})


@error("callback-host-transfer", SHARDY, "A Python callback lowered to host send/recv (TPU)",
       MultimeshValueError,
       r"Fragment `f` calls a Python host callback through a host transfer "
       r"\(`stablehlo\.send`, as jax lowers jax\.debug\.print, pure_callback and "
       r"io_callback on TPU\)",
       """On TPU, jax lowers host callbacks to `stablehlo.send`/`recv` on channels of the
       whole program, which cannot be split into fragments compiled on their own.
       multimesh runs host callbacks where jax lowers them to FFI calls (CPU and GPU).
       Remove the callback, or run that program with `jax.jit`.""")
def _():
    mm.compile_mpmd(calling_back(
        "%t = stablehlo.after_all : !stablehlo.token\n  %s = \"stablehlo.send\"(%a, %t) "
        "{channel_handle = #stablehlo.channel_handle<handle = 1, type = 2>, "
        "is_host_transfer = true} : (tensor<8xf32>, !stablehlo.token) -> !stablehlo.token"),
        {"m1": range(4)})


@warning("compile-mpmd-unnumbered-call", SHARDY,
         "An imported call whose microbatch the program does not record", MultimeshWarning,
         r"1 fragment call of the imported program carries no microbatch number \(g\): "
         r"neither a call_counter attribute nor a '_call<N>', '_calls<a>to<b>' or "
         r"'_calls<b>from<a>' fragment name\. The recovered schedule leaves them unnumbered",
         """`compile_mpmd` recovers the schedule of a pipelined program from its calls: the
         partitioner names a fragment used by microbatch N `..._call<N>` and one shared by
         microbatches a to b `..._calls<a>to<b>` (`..._calls<b>from<a>` when it runs them
         in descending order). A call of a pipelined task whose fragment
         lost that name (renamed after partitioning) gets no number rather than a guessed
         one: `compiled.schedule` and its chart show it as `F*`. Warned once per program;
         keep the partitioner's fragment names.""")
def _():
    t = '!mpmd.mesh_tensor<"m1", tensor<8xf32>>'
    fn = ('func.func @{}(%a: tensor<8xf32>) -> tensor<8xf32> attributes '
          '{{mesh_shape = #sdy.mesh<["x"=4]>}} {{\n  %b = stablehlo.add %a, %a : tensor<8xf32>\n'
          '  return %b : tensor<8xf32>\n}}\n')  # computes: a pass-through is never called
    mm.compile_mpmd(
        f"func.func public @main(%x: {t}) -> {t} attributes "
        f'{{topology = #mpmd.topology<<"m1" : <["x"=4]>>>}} {{\n'
        f'  %0 = mpmd.fragment_call<mesh="m1", origin=["a"]> @f_call0(%x) : ({t}) -> {t}\n'
        f'  %1 = mpmd.fragment_call<mesh="m1", origin=["a"]> @g(%0) : ({t}) -> {t}\n'
        f"  return %1 : {t}\n}}\n" + fn.format("f_call0") + fn.format("g"), {"m1": range(4)})


@error("compile-mpmd-bad-topology", SHARDY, "`compile_mpmd` given a `topology` of the wrong type",
       MultimeshValueError,
       r"`compile_mpmd` cannot read the program: 'topology' must be an #mpmd\.topology, got "
       r"\"m1\"; jaxlib's mpmd dialect reads it from the function that holds mpmd ops without "
       r"a check \(line 1, column 122\)\.",
       """`@main`'s `topology` lists the program's meshes as `#mpmd.topology<<"m1" :
       <["x"=4]>>, ...>`. Any other attribute there used to kill the process while jaxlib
       parsed the program (its verifier casts it blindly); multimesh checks it first.""")
def _():
    mm.compile_mpmd(transfer_program('"m1"'), {"m1": range(4), "m2": range(4, 8)})


@error("compile-mpmd-not-utf8", SHARDY, "`compile_mpmd` given bytes that are neither text nor bytecode",
       MultimeshValueError,
       r"`compile_mpmd` cannot read the program: input is not valid UTF-8: byte 0xe9 "
       r"\(invalid continuation byte\); MLIR files are UTF-8 text or MLIR bytecode "
       r"\(line 1, column 7\)\.",
       """Programs given as `bytes` are MLIR bytecode (told apart by its first bytes,
       `ML\\xefR`) or UTF-8 text. A `str` must not hold lone surrogates (e.g. from
       `errors="surrogateescape"`), which UTF-8 cannot encode.""")
def _():
    mm.compile_mpmd(b"// caf\xe9 au lait\n" + partitioned_identity().encode(),
                    {"m1": range(4)})


@error("compile-mpmd-bytecode-not-utf8", SHARDY, "`compile_mpmd` given bytecode with a name that is not UTF-8",
       MultimeshValueError,
       r"`compile_mpmd` cannot read the program: the bytecode holds a string that is not "
       r"valid UTF-8: \"#mpmd\.topology<<\"\\xff1\" : <\[\"x\"=4\]>>>\"; names and strings "
       r"in MLIR are UTF-8\.",
       """Bytecode is checked as text is: every name (here the mesh `m1`, its first byte
       changed) is UTF-8. Such a name used to abort the process inside jaxlib's bindings.""")
def _():
    data = bytecode(partitioned_identity()).replace(b'"m1"', b'"\xff1"')
    mm.compile_mpmd(data, {"m1": range(4)})


@error("compile-mpmd-stray-module", SHARDY, "`compile_mpmd` given a program with a stray nested module",
       PassFailure,
       r"multimesh pass 'mm-import-mpmd' failed: 'builtin\.module' at the top level of the "
       r"module: the output of Shardy's MPMD partitioner holds only functions and sdy\.mesh "
       r"symbols",
       """Shardy's partitioner emits functions and meshes only; a nested module at the top
       level (here an unnamed one) is not part of the program. Remove it.""",
       check=_repro_check("mm-import-mpmd"))
def _():
    mm.compile_mpmd("module {\n" + partitioned_identity() + "module {\n}\n}\n",
                    {"m1": range(4)})


@error("mpmd-module-breaks-contract", SHARDY,
       "The runtime given an MPMD module without an attribute it needs",
       IRContractError,
       r"The 'mm.fragment_call' has no 'mm.fragment' attribute; in MPMD form every one "
       r"carries it \(docs/ir.md, section 4\)",
       "The runtime (`build_plan`, `compile_mpmd`) reads the MPMD form's `mm.*` attributes "
       "checked, by the names of docs/ir.md: a module edited by hand or cut short of "
       "`mm-extract-fragments` may lack one. Run the whole pipeline, or add the attribute.")
def _():
    from multimesh.runtime import build_plan

    build_plan('module attributes {mm.num_devices = 1 : i64} {\n'
               '  func.func @main(%x: tensor<2xf32>) -> tensor<2xf32> {\n'
               '    %y = stablehlo.custom_call @mm.fragment_call(%x) : '
               '(tensor<2xf32>) -> tensor<2xf32>\n'
               '    return %y : tensor<2xf32>\n  }\n}')


# =========================================================================== multi-process


@error("cross-move-not-an-array", MULTI, "`cross_move` given host data", MultimeshTypeError,
       r"cross_move moves a jax.Array, got list; place host data with "
       r"jax.device_put\(value, sharding\) instead",
       """`multimesh.runtime.distributed.cross_move` moves a global `jax.Array` (possibly
       between processes). Host data is the same in every process: `jax.device_put` it.""")
def _():
    from jax.sharding import NamedSharding

    from multimesh.runtime.distributed import cross_move

    cross_move([1.0, 2.0], NamedSharding(Mesh(jax.devices()[:2], ("x",)), P()))


@error("peer-timeout-not-a-number", MULTI, "`MULTIMESH_PEER_TIMEOUT` is not a duration",
       MultimeshValueError,
       r"MULTIMESH_PEER_TIMEOUT must be a positive number of seconds, got 'soon'; for example "
       r"MULTIMESH_PEER_TIMEOUT=60",
       """The peer watchdog of a multi-process run reads it when the first program
       compiles: give seconds, e.g. `MULTIMESH_PEER_TIMEOUT=60`.""")
def _():
    from multimesh.runtime.distributed import peer_timeout

    os.environ["MULTIMESH_PEER_TIMEOUT"] = "soon"
    try:
        peer_timeout()
    finally:
        del os.environ["MULTIMESH_PEER_TIMEOUT"]


launch("launch-bad-process-count", "`multimesh.launch -n` out of range",
       ["-n", "0", "train.py"],
       r"argument -n/--num-processes: must be between 1 and 256, got 0",
       """Every process runs on this machine: give 1 to 256 (a cluster's own launcher
       starts more, see docs/multiprocess.md).""")

launch("launch-bad-port", "`multimesh.launch --port` that is not a TCP port",
       ["-n", "2", "--port", "99999", "train.py"],
       r"argument --port: must be a TCP port number from 1 to 65535 \(or 0 for a free one\), "
       r"got '99999'",
       """Give a port from 1 to 65535 that nothing else uses, or leave `--port` out (0, the
       default, takes a free one). A port that is in use is refused too, by number.""")

launch("launch-bad-timeout", "`multimesh.launch --timeout` that is not positive",
       ["-n", "2", "--timeout", "-1", "train.py"],
       r"argument --timeout: must be a positive number of seconds, got '-1'",
       """`--timeout S` stops every process after S seconds (exit code 124); leave it out
       for no limit.""")

launch("launch-bad-grace-period", "`multimesh.launch --grace-period` below 0",
       ["-n", "2", "--grace-period", "-3", "train.py"],
       r"argument --grace-period: must be a number of seconds, 0 or more, got '-3'",
       """The seconds stopped processes get between SIGTERM and SIGKILL (default 3; 0 kills
       at once).""")

launch("launch-missing-script", "`multimesh.launch` of a script that is not there",
       ["-n", "2", "train.py"], r"no such script: train\.py",
       """The script path is read from the launcher's directory; for a module, use `-m
       package.module`.""")


# =========================================================================== CLI misuse

OK_MLIR = """\
func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = stablehlo.add %arg0, %arg0 : tensor<8xf32>
  return %0 : tensor<8xf32>
}
"""

MPMD_MLIR = """\
module attributes {mm.tasks = {t = {axis_names = ["x"], axis_sizes = [2], devices = [0, 1], logical_axes = []}}} {
  sdy.mesh @mesh_t = <["x"=2]>
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = call @t_fwd(%arg0) {mm.fragment} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func private @t_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {mm.devices = [0, 1], mm.mesh = @mesh_t, mm.task = {name = "t", transpose_count = 0 : i64}} {
    %0 = stablehlo.sine %arg0 : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
"""

BAD_TASK_MLIR = """\
func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = func.call @b(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1, 2], axis_names = ["x", "y"], axis_sizes = [4, 1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @b(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}
"""

cli("cli-unknown-pass", "An `mm-*` pass that does not exist",
    ["in.mlir", "-p", "builtin.module(mm-no-such-pass)"], 1,
    r"^mm-opt: error: 'mm-no-such-pass' does not refer to a registered multimesh pass\. "
    r"Registered passes: mm-assign-tasks, ",
    """Pipeline elements starting with `mm-` are multimesh passes; the message lists them
    (as does `mm-opt --list-passes`).""",
    input_text=OK_MLIR)

cli("cli-misspelt-pass", "A misspelt pass name",
    ["in.mlir", "-p", "builtin.module(mm-asign-tasks)"], 1,
    r"^mm-opt: error: 'mm-asign-tasks' does not refer to a registered multimesh pass\. "
    r"Registered passes: .*\. Did you mean 'mm-assign-tasks'\?",
    """The closest registered name is suggested (also for native passes, for
    `--<pass>` flags and for `--mlir-print-ir-after=<pass>`).""",
    input_text=OK_MLIR)

cli("cli-pass-flags-and-pipeline", "Passes given both as `-p` and as `--<pass>` flags",
    ["in.mlir", "--mm-verify", "-p", "builtin.module(cse)"], 2,
    r"^mm-opt: error: give the passes either as -p PIPELINE or as --<pass> flags, not both "
    r"\(got -p and --mm-verify\)",
    """As in mlir-opt, a pipeline is either one `-p` text or `--<pass>[=options]` flags in
    order (`--mm-verify --mm-assign-tasks=num-devices=8 --cse`), not a mix.""",
    input_text=OK_MLIR)

cli("cli-print-ir-after-unknown", "`--mlir-print-ir-after` naming no pass",
    ["in.mlir", "--mm-verify", "--mlir-print-ir-after=mm-verfy"], 1,
    r"^mm-opt: error: --mlir-print-ir-after: 'mm-verfy' is not a registered pass\. Did you "
    r"mean 'mm-verify'\?",
    """`--mlir-print-ir-after=<pass>` (and `--mlir-print-ir-before`) print the IR around
    each step that runs that pass; the name must be a pass (`mm-opt --list-passes`).""",
    input_text=OK_MLIR)

cli("cli-unknown-native-pass", "A native pass that does not exist",
    ["in.mlir", "-p", "builtin.module(not-a-pass)"], 1,
    r"^mm-opt: error: 'not-a-pass' does not refer to a registered pass or pass pipeline",
    """Other elements go to jaxlib's native PassManager, which knows only the passes
    registered in jaxlib (canonicalize, cse, sdy-*, ...).""",
    input_text=OK_MLIR)

cli("cli-malformed-pipeline", "A pipeline with unbalanced parentheses",
    ["in.mlir", "-p", "builtin.module(mm-verify"], 1,
    r"^mm-opt: error: Malformed pass pipeline 'builtin\.module\(mm-verify': expected "
    r"'builtin\.module\(\.\.\.\)'",
    """Pipelines look like `builtin.module(pass1,pass2{opt=1})`.""",
    input_text=OK_MLIR)

cli("cli-empty-pipeline-element", "A pipeline with an empty element",
    ["in.mlir", "-p", "builtin.module(mm-verify,,mm-verify)"], 1,
    r"^mm-opt: error: Empty element in pass pipeline 'builtin\.module\(mm-verify,,mm-verify\)'",
    """Remove the doubled comma.""",
    input_text=OK_MLIR)

cli("cli-unbalanced-options", "Pass options with an unclosed brace",
    ["in.mlir", "-p", "builtin.module(mm-schedule-fragments{schedule=gpipe)"], 1,
    r"^mm-opt: error: Unbalanced brackets or quotes in pass pipeline "
    r"'mm-schedule-fragments\{schedule=gpipe'",
    """Options go in braces after the pass: `mm-schedule-fragments{schedule=1f1b}`.""",
    input_text=OK_MLIR)

cli("cli-unknown-option", "A pass option that does not exist",
    ["in.mlir", "-p", "builtin.module(mm-schedule-fragments{no-such=1})"], 1,
    r"^mm-opt: error: Pass 'mm-schedule-fragments' has no option 'no-such'\. Valid options: "
    r"schedule, num-stages, interleave, unrolling, custom-schedule-file",
    """Options are spelled in kebab-case; `mm-opt --list-passes` lists each pass's options
    and defaults.""",
    input_text=OK_MLIR)

cli("cli-bad-option-value", "A pass option value of the wrong type",
    ["in.mlir", "-p", "builtin.module(mm-schedule-fragments{num-stages=abc})"], 1,
    r"^mm-opt: error: Pass 'mm-schedule-fragments' option 'num-stages' expects a value of type "
    r"int, got 'abc'",
    """Give a value of the option's type (see `mm-opt --list-passes`).""",
    input_text=OK_MLIR)

cli("cli-unknown-schedule", "An unknown schedule name in a pass option",
    ["in.mlir", "-p", "builtin.module(mm-schedule-fragments{schedule=round-robin})"], 1,
    r"^mm-opt: error: Pass 'mm-schedule-fragments' option 'schedule': unknown schedule "
    r"'round-robin'; valid schedules: 1f1b, circular-reversed-backward, custom, dualpipe-v, "
    r"eager-1f1b, gpipe, gpipe-1f1b-last, interleaved-1f1b, interleaved-gpipe, kimi-k2, "
    r"zero-bubble-h1, zero-bubble-h2, zero-bubble-v",
    """Pick one of the listed schedules or aliases. Options given on the command line are
    checked before the input is read.""",
    input_text=OK_MLIR)

cli("cli-parse-error", "A malformed input file",
    ["in.mlir"], 1,
    r"^in\.mlir:2:8: error: custom op 'foo' is unknown.*\n  %0 = foo\n       \^",
    """The input is not valid MLIR; the diagnostic gives `file:line:col` and a caret under
    the offending token. Pass `--allow-unregistered-dialect` for ops of unknown
    dialects.""",
    input_text="func.func @f() {\n  %0 = foo\n}\n")

cli("cli-truncated-input", "A truncated input file",
    ["in.mlir"], 1,
    r"^in\.mlir:3:28: error: expected operation name in quotes",
    """The file ends before the function's closing brace (an interrupted dump?); the parser
    reports the end of the input. Regenerate the file.""",
    input_text=OK_MLIR.rsplit("}", 1)[0])

cli("cli-missing-input-file", "An input file that does not exist",
    ["missing.mlir"], 1,
    r"^mm-opt: error: could not open input file 'missing\.mlir': No such file or directory",
    """Check the path; `-` (or no input) reads stdin.""")

cli("cli-usage-error", "An unknown command-line flag",
    ["in.mlir", "--no-such-flag"], 2,
    r"^usage: mm-opt .*mm-opt: error: unrecognized arguments: --no-such-flag",
    """Exit code 2 means the command line itself is wrong; `mm-opt --help` lists the
    flags.""",
    input_text=OK_MLIR)

cli("cli-pass-error-at-op", "A pass rejects an op (diagnostic with location)",
    ["in.mlir", "-p", "builtin.module(mm-verify)"], 1,
    r"^in\.mlir:2:8: error: 'mm\.task' axis_sizes \[4, 1\] multiply to 4 but devices has 3 "
    r"entries",
    """Pass errors point at the offending op, `file:line:col`, with a caret. Here the
    task's `axis_sizes` describe 4 devices but it lists 3.""",
    input_text=BAD_TASK_MLIR)

cli("cli-verify-diagnostics-mismatch", "`--verify-diagnostics` expectations not met",
    ["in.mlir", "-p", "builtin.module(mm-verify)", "--verify-diagnostics"], 1,
    r"(?m)(?=.*^in\.mlir:2:6: error: expected error \"something else\" was not produced$)"
    r"(?=.*^in\.mlir:3:8: error: unexpected error: 'mm\.task' axis_sizes)",
    """Each `expected-error` comment must match a diagnostic on its line, and every
    diagnostic must be expected. Fix the expectation or the input.""",
    input_text=BAD_TASK_MLIR.replace(
        "  %0 = func.call", "  // expected-error@+1 {{something else}}\n  %0 = func.call", 1))

cli("cli-unwritable-output", "An output file that cannot be written",
    ["in.mlir", "-o", "no-such-dir/out.mlir"], 1,
    r"^mm-opt: error: cannot write 'no-such-dir/out\.mlir': No such file or directory",
    """The output directory must exist and be writable; the output is written atomically
    and only on success.""",
    input_text=OK_MLIR)

cli("cli-unreadable-rules-file", "An `mm-match-tasks` rules file that cannot be read",
    ["in.mlir", "-p", "builtin.module(mm-match-tasks{rules-file=missing.json})"], 1,
    r"^mm-opt: error: Pass 'mm-match-tasks': rules-file 'missing\.json': cannot be read: "
    r"No such file or directory",
    """The rules file is JSON written by `mjit` (see docs/implicit-tasks.md); check the
    path.""",
    input_text=OK_MLIR)

cli("cli-option-out-of-range", "A pass option value outside its range",
    ["in.mlir", "-p", "builtin.module(mm-assign-tasks{num-devices=-3})"], 1,
    r"^mm-opt: error: Pass 'mm-assign-tasks' option 'num-devices' must be a device count "
    r"in 1\.\.1048576, or 0 to read it from the module, got -3\.",
    """Option values are checked when the pipeline is parsed, before the input is read
    (`mm-opt --list-passes` lists each option and its default).""",
    input_text=OK_MLIR)

cli("cli-module-past-the-pipeline", "A pipeline given a module that is already past it",
    ["in.mlir", "-p", "builtin.module(mm-inline-tasks,mm-assign-tasks,"
                      "mm-resolve-logical-shardings,mm-outline-fragments)"], 1,
    r"^in\.mlir:4:10: error: mm-inline-tasks expects a module in front-end form or flat "
    r"form, but this one is in MPMD form \(fragment functions called from @main, docs/ir\.md "
    r"section 4\); it has already been through mm-outline-fragments",
    """Each pass says which forms of the IR (docs/ir.md) it accepts, and refuses the others
    at the op that shows the form. This module is already past `mm-inline-tasks` (running
    the full pipeline on its own output used to collapse the program into one fragment):
    give the pipeline the traced program, or a `MULTIMESH_DUMP_IR_TO` dump from before the
    pass that made it.""",
    input_text=MPMD_MLIR)

cli("cli-pass-before-its-stage", "A pass given a module from an earlier stage",
    ["in.mlir", "-p", "builtin.module(mm-insert-transfers)"], 1,
    r"^in\.mlir:2:8: error: mm-insert-transfers expects a module in MPMD form, but this one "
    r"is in flat form .*; run mm-outline-fragments and mm-propagate-shardings first",
    """The error points at the first op that shows the module's form and names the passes
    to run first.""",
    input_text=OK_MLIR)

cli("cli-invalid-utf8", "An input file that is not UTF-8",
    ["in.mlir"], 1,
    r"^in\.mlir:2:6: error: input is not valid UTF-8: byte 0xff \(invalid start byte\)",
    """MLIR files are UTF-8 text or MLIR bytecode (which starts with the bytes
    `ML\\xefR`); the message points at the first invalid byte (here a Latin-1 byte in a
    comment). Re-encode the file.""",
    input_bytes=OK_MLIR.replace("%0 = ", "// \xff\n  %0 = ", 1).encode("latin-1"))

cli("cli-diagnostic-without-location", "A module-level diagnostic",
    ["in.mlir", "-p", "builtin.module(mm-inline-tasks)"], 1,
    r"^in\.mlir:1:1: error: module has no 'main' function",
    """Multimesh pipelines start from `@main`; the module must define it.""",
    input_text="func.func @f() {\n  return\n}\n")



cli("cli-import-mpmd-bad-meshes", "An `mm-import-mpmd` mesh map that cannot be read",
    ["in.mlir", "-p", "builtin.module(mm-import-mpmd{meshes=m1})"], 1,
    r"^mm-opt: error: Pass 'mm-import-mpmd' option 'meshes': entry 'm1' is not of the form "
    r"name=positions\. Expected 'name=positions;\.\.\.', e\.g\. 'm1=0-3;m2=4,5,6,7'\.",
    """Give each mesh its device positions: `meshes=m1=0-3;m2=4-7` (quote lists with
    commas: `meshes="m1=0,2,4,6;m2=1,3,5,7"`).""",
    input_text=OK_MLIR)

cli("cli-import-mpmd-no-meshes", "`mm-import-mpmd` without a mesh map",
    ["in.mlir", "-p", "builtin.module(mm-import-mpmd)"], 1,
    r"^in\.mlir:1:1: error: mm-import-mpmd needs the device positions of every mesh; set its "
    r"option 'meshes' \(or the module attribute 'mm\.meshes'\), e\.g\. meshes=m1=0-3",
    """The mpmd dialect has no device ids; the pass needs to know which devices each mesh
    is. `compile_mpmd` records the map it is given as `mm.meshes` on the module.""",
    input_text=partitioned_identity())

LOOP_MLIR = """\
module{attrs} {{
  func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {{
    %0 = stablehlo.custom_call @mm.microbatch_loop(%arg0, %arg0) {{mm.body = @body, mm.num_microbatches = {m} : i64}} : (tensor<8xf32>, tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }}
  func.func private @body(%i: tensor<i32>, %acc: tensor<8xf32>, %x: tensor<8xf32>) -> tensor<8xf32> {{
    %0 = call @a_fwd(%x) {{mm.fragment}} : (tensor<8xf32>) -> tensor<8xf32>
    return %0 : tensor<8xf32>
  }}
  func.func private @a_fwd(%arg0: tensor<8xf32>) -> tensor<8xf32> attributes {{mm.devices = [0, 1], mm.task = {{name = "a", transpose_count = 0 : i64, loop = 0 : i64}}}} {{
    return %arg0 : tensor<8xf32>
  }}
}}
"""

cli("cli-topology-wrong-type", "A `topology` of the wrong type in an mpmd module",
    ["in.mlir", "-p", "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7})"], 1,
    r"^in\.mlir:1:122: error: 'topology' must be an #mpmd\.topology, got 3 : i64; jaxlib's "
    r"mpmd dialect reads it from the function that holds mpmd ops without a check",
    """jaxlib's mpmd verifiers read `topology` without checking its type, so any other
    attribute there (a string, an integer) killed the process while the module parsed;
    mm-opt checks it before parsing. Write the meshes as `#mpmd.topology<<"m1" :
    <["x"=4]>>, ...>`.""",
    input_text=transfer_program("3 : i64"))

cli("cli-attribute-wrong-type", "An `mm.*` attribute entry of the wrong type",
    ["in.mlir", "-p", "builtin.module(mm-schedule-fragments)"], 1,
    r"^in\.mlir:1:1: error: 'mm\.schedule_config' num_stages must be an integer in "
    r"1\.\.65536, got \"4\"",
    """Every attribute multimesh reads is checked for type and range before use (one typed
    reader, shared by `mm-opt`, `compile_mpmd` and the passes); the message names the attribute, the value and what
    it must be. Here write `num_stages = 4`.""",
    input_text=LOOP_MLIR.format(
        attrs=' attributes {mm.schedule_config = {schedule = "1f1b", num_stages = "4"}}', m=2))

cli("cli-too-many-microbatches", "A microbatch count beyond the limit",
    ["in.mlir", "-p", "builtin.module(mm-schedule-fragments)"], 1,
    r"^in\.mlir:3:10: error: 'mm\.num_microbatches' on 'mm\.microbatch_loop' must be a "
    r"microbatch count in 1\.\.65536, got 1000000000",
    """Sizes that drive allocation are bounded (docs/ir.md, "Limits"): at most 65,536
    microbatches, device positions below 1,048,576. A larger count used to make mm-opt
    grow its memory without end.""",
    input_text=LOOP_MLIR.format(attrs="", m=1000000000))

cli("cli-import-mpmd-position-too-large", "An `mm-import-mpmd` device position beyond the limit",
    ["in.mlir", "-p", "builtin.module(mm-import-mpmd{meshes=m1=0-99999999999})"], 1,
    r"^mm-opt: error: Pass 'mm-import-mpmd' option 'meshes': mesh 'm1' has device position "
    r"99999999999, but positions are below 1048576 \(MAX_DEVICES\)",
    """Device positions are below 1,048,576 (docs/ir.md, "Limits"); a range is checked
    before it is spelled out.""",
    input_text=OK_MLIR)

cli("cli-import-mpmd-long-list", "A mesh map that gives a mesh far too many positions",
    ["in.mlir", "-p", "builtin.module(mm-import-mpmd{meshes=m1=0-100})"], 1,
    r"^in\.mlir:1:1: error: mesh \"m1\" \[\"x\"=4\] has 4 devices but option 'meshes' "
    r"gives it 101: \[0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(101 entries\)\]",
    """Messages that would list a long set print its first few entries and the count (a
    typo like `m2=4-1000000` printed 7.9 MB). Give each mesh as many positions as its
    axes multiply to.""",
    input_text=partitioned_identity())

cli("cli-bytecode-split-input", "`--split-input-file` on MLIR bytecode",
    ["in.mlir", "--split-input-file"], 1,
    r"^in\.mlir:1:1: error: --split-input-file needs text input, got MLIR bytecode",
    """Bytecode holds one module; split text files only.""",
    input_bytes=b"ML\xefR")

def bytecode(text: str) -> bytes:
    """``text`` as MLIR bytecode: what ``mm-opt in.mlir --emit-bytecode -o out.mlirbc``
    writes."""
    import tempfile

    from multimesh.tools.mm_opt import main as mm_opt

    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp, "in.mlir"), Path(tmp, "out.mlirbc")
        source.write_text(text, encoding="utf-8")
        if mm_opt([str(source), "--emit-bytecode", "-o", str(out)]) != 0:
            raise ValueError(f"mm-opt could not write {text!r} as bytecode")
        return out.read_bytes()


cli("cli-bytecode-not-utf8", "MLIR bytecode holding a name that is not UTF-8",
    ["in.mlir"], 1,
    r"^in\.mlir:1:1: error: the bytecode holds a string that is not valid UTF-8: "
    r"\"\\xffain\"; names and strings in MLIR are UTF-8",
    """Names, symbols and strings in MLIR are UTF-8, in text and in bytecode; a name that
    is not (here the symbol `@main`, its first byte changed) used to abort the process
    when it reached Python. The bytecode is corrupt: write it again.""",
    input_bytes=bytecode(OK_MLIR).replace(b"main\0", b"\xffain\0", 1),
    input_shown="// MLIR bytecode of this module, with the first byte of 'main' made 0xff\n"
                + OK_MLIR)

cli("cli-escape-not-utf8", "A string whose escapes spell bytes that are not UTF-8",
    ["in.mlir"], 1,
    r"^in\.mlir:1:12: error: the string \"\\xffain\" is not valid UTF-8 once its escapes "
    r"are read; names and strings in MLIR are UTF-8",
    """MLIR text may write any byte as `\\HH`; names and strings must still be UTF-8 once
    the escapes are read (here `@"\\FFain"`).""",
    input_text=OK_MLIR.replace("@main", '@"\\FFain"'))

cli("cli-emit-bytecode-split", "`--emit-bytecode` with `--split-input-file`",
    ["in.mlir", "--split-input-file", "--emit-bytecode"], 1,
    r"^mm-opt: error: --emit-bytecode writes one module; it does not combine with "
    r"--split-input-file",
    """Bytecode holds one module: write the chunks as text, or run mm-opt once per
    module.""",
    input_text=OK_MLIR)

cli("cli-empty-symbol", "A module with an empty symbol name",
    ["in.mlir"], 1,
    r"^in\.mlir:1:1: error: the result cannot be parsed again: an empty symbol name prints "
    r"as @<<INVALID EMPTY SYMBOL>>",
    """MLIR's generic form accepts `sym_name = ""` (or a custom call target `""`), but
    prints it as `@<<INVALID EMPTY SYMBOL>>`, which no parser reads back; mm-opt refuses to
    write such output (found by fuzzing attribute values).""",
    input_text='"func.func"() <{function_type = () -> (), sym_name = ""}> ({\n'
               '  "func.return"() : () -> ()\n}) : () -> ()\n')

# --------------------------------------------------------------------------- running


@dataclasses.dataclass
class Outcome:
    """What running an entry produced."""

    error: BaseException | None = None  # Python entries
    exit_code: int | None = None  # CLI entries
    stdout: str = ""
    message: str = ""  # str(error), or the CLI's stderr


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _cwd(path: Path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run(entry: Entry, workdir: Path) -> Outcome:
    """Run ``entry`` in the (empty, private) directory ``workdir``."""
    workdir = Path(workdir)
    if entry.is_cli:
        return _run_cli(entry, workdir)
    # A private dump directory: PassFailure repro files do not race with other runs.
    dump = workdir / "dump"
    mm.clear_tasks()
    try:
        with _env("MULTIMESH_DUMP_IR_TO", str(dump)), warnings.catch_warnings():
            if entry.is_warning:
                warnings.simplefilter("error", entry.exc)
            entry.trigger()
    except Exception as e:  # noqa: BLE001 - any exception is the outcome
        return Outcome(error=e, message=str(e))
    finally:
        mm.clear_tasks()
    return Outcome()


def _run_cli(entry: Entry, workdir: Path) -> Outcome:
    if entry.tool == LAUNCH:
        from multimesh.launch import main
    else:
        from multimesh.tools.mm_opt import main

    if entry.input_text is not None:
        (workdir / "in.mlir").write_text(entry.input_text, encoding="utf-8")
    if entry.input_bytes is not None:
        (workdir / "in.mlir").write_bytes(entry.input_bytes)
    out, err = io.StringIO(), io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        # COLUMNS: argparse wraps its usage text to the terminal width.
        with _cwd(workdir), _env("COLUMNS", "80"), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            try:
                code = main(list(entry.argv))
            except SystemExit as e:  # argparse
                code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdin = old_stdin
    return Outcome(exit_code=code, stdout=out.getvalue(), message=err.getvalue())


def reproduce(error: PassFailure) -> tuple[int, str]:
    """Run a PassFailure's ``mm-opt`` repro command in-process: ``(exit code, stderr)``."""
    from multimesh.tools.mm_opt import main

    argv = shlex.split(error.repro)
    assert argv[0] == "mm-opt", argv
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv[1:])
    return code, err.getvalue()


_NORMALIZE = (
    # repro files live in MULTIMESH_DUMP_IR_TO or the temp directory
    (re.compile(r"'?[^\s']*?([^\s'/]+-\d+/)?(multimesh-failed-input[\w-]*\.mlir)'?"),
     r"$MULTIMESH_DUMP_IR_TO/\1\2"),
    (re.compile(r"[^\s']*multimesh-rules-[0-9a-f]+\.json"),
     "$MULTIMESH_DUMP_IR_TO/multimesh-rules-HASH.json"),
    # source locations move whenever the file is edited
    (re.compile(r"(\(at [^()\s]+?):\d+:\d+\)"), r"\1:LINE:COL)"),
    (re.compile(r"(\(at [^()\s]+?\.(?:py|md)):\d+\)"), r"\1:LINE)"),
    (re.compile(r"\b0x[0-9a-f]{6,}\b"), "0x..."),
)


def normalize(message: str) -> str:
    """``message`` with machine- and edit-dependent parts replaced (for the docs)."""
    message = message.replace(str(ROOT) + os.sep, "")
    for pattern, repl in _NORMALIZE:
        message = pattern.sub(repl, message)
    return message.rstrip()


def validate_catalogue() -> list[str]:
    """Problems with the catalogue itself (ids, categories, classes); empty when fine."""
    problems = []
    seen = set()
    for e in ENTRIES:
        if not _ID_RE.match(e.id):
            problems.append(f"{e.id}: id is not kebab-case")
        if e.id in seen:
            problems.append(f"{e.id}: duplicate id")
        seen.add(e.id)
        if e.category not in CATEGORIES:
            problems.append(f"{e.id}: unknown category {e.category!r}")
        if not e.fix.strip() or not e.title.strip():
            problems.append(f"{e.id}: needs a title and a fix text")
        try:
            re.compile(e.match)
        except re.error as err:
            problems.append(f"{e.id}: bad regex: {err}")
        if e.is_cli:
            if e.exit_code not in (1, 2):
                problems.append(f"{e.id}: CLI errors exit with 1 or 2")
        else:
            if e.trigger is None or e.exc is None:
                problems.append(f"{e.id}: needs a trigger and an exception class")
            elif e.is_warning:
                if not issubclass(e.exc, MultimeshWarning):
                    problems.append(f"{e.id}: {e.exc.__name__} must be a MultimeshWarning")
            elif not issubclass(e.exc, MultimeshError) or e.builtin not in (
                    ValueError, TypeError, AttributeError):
                problems.append(f"{e.id}: {e.exc.__name__} must be a MultimeshError and a "
                                f"ValueError, TypeError or AttributeError")
    for cat in CATEGORIES:
        if not any(e.category == cat for e in ENTRIES):
            problems.append(f"category {cat!r} has no entry")
    return problems


# ------------------------------------------- issue 31, item 5: probed as a new user would


@error("plan-microbatch-not-callable", IMPLICIT, "`PipelinePlan.microbatch` of something not callable",
       MultimeshTypeError,
       r"`PipelinePlan.microbatch` takes the step's gradient function \(such as "
       r"`jax.value_and_grad\(loss\)`\), got int 3",
       """`plan.microbatch(grad_fn)` wraps the step's gradient function; it used to return
       a wrapper that failed only when called. Pass the function, not its result.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, num_microbatches=2)
    plan.microbatch(3)


@error("plan-compare-unreadable-trace", IMPLICIT, "`PipelinePlan.compare` of a trace file that is not there",
       MultimeshValueError,
       r"`PipelinePlan.compare` cannot read the trace 'no-such-trace.json' \(No such file or "
       r"directory\)",
       """A string is read as the path of the Perfetto JSON that
       `compiled.profile(..., trace_path=)` wrote; give that path, the loaded dict, or the
       profiled program or its StepProfile.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    plan.compare("no-such-trace.json")


@error("compare-schedules-bad-comm", SCHEDULES, "`compare_schedules` with a negative transfer time",
       ScheduleError,
       r"comm \(seconds per transfer between submeshes\) must be a finite number >= 0, "
       r"got -1",
       """`comm` is the seconds one transfer between submeshes takes: a finite number, 0 or
       more. It is checked once; it used to come back as every schedule's reason not to
       apply, an empty table.""")
def _():
    mm.compare_schedules(pipelined(), comm=-1)


@error("simulate-cost-not-a-number", SCHEDULES, "A schedule simulated with costs that are not numbers",
       ScheduleError,
       r"cost of unit 0 \(s0_fwd on submesh 0\) must be a number of seconds, got str '1'",
       """A cost function returns each unit's duration as a number (seconds, or units of
       time); a string used to be read as its number.""")
def _():
    pipelined().schedule.simulate(lambda unit: "1")


@error("visualize-bad-path", SCHEDULES, "`visualize_schedule` with a path that is not a file name",
       MultimeshTypeError,
       r"visualize_schedule's `path` must be a file name \(str or os.PathLike\) or None "
       r"\(no PNG\), got int 123",
       """`path` names the PNG to write (`.png` is added when it has no extension); leave
       it out for the text chart alone.""")
def _():
    mm.visualize_schedule(pipelined(), 123, print=False)


@error("visualize-missing-directory", SCHEDULES, "`visualize_schedule` into a directory that does not exist",
       MultimeshValueError,
       r"visualize_schedule cannot write '/nonexistent-dir/gantt.png': the directory "
       r"'/nonexistent-dir' does not exist",
       """The PNG is written into an existing directory; it used to fail inside the image
       library after the chart was drawn. Create the directory first.""")
def _():
    mm.visualize_schedule(pipelined(), "/nonexistent-dir/gantt.png", print=False)


@error("visualize-print-not-bool", SCHEDULES, "`visualize_schedule(print=...)` that is not True or False",
       MultimeshTypeError,
       r"visualize_schedule's `print` must be True \(print the text chart\) or False, got "
       r"str 'no'",
       """`print=False` leaves the text chart out; a string used to be read as True.""")
def _():
    mm.visualize_schedule(pipelined(), print="no")


def _two_dense():
    import flax.linen as nn

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(nn.Dense(16, name="l1")(nn.Dense(16, name="l0")(x)) ** 2)

    return Two()


@error("parallelize-num-stages-negative", FLAX, "`parallelize_step(num_stages=-1)`",
       MultimeshValueError,
       r"parallelize_step `num_stages` must be a positive integer, 'auto' \(the planner "
       r"chooses, see `multimesh.jax.plan_pipeline`\) or None, got -1",
       """`num_stages` is checked itself; a negative count used to be blamed on a missing
       `num_microbatches`.""", requires=("flax", "optax"))
def _():
    import optax

    from multimesh.jax import flax as mmf

    mmf.parallelize_step(_two_dense(), optax.sgd(0.1), global_batch=jnp.ones((8, 16)),
                         num_stages=-1)


@error("parallelize-auto-microbatch-size-not-dividing", FLAX,
       "`parallelize_step(num_stages='auto', microbatch_size=...)` that does not divide the batch",
       MultimeshValueError,
       r"parallelize_step microbatch_size=3 does not divide the batch of 8 rows",
       """With `num_stages="auto"` the microbatch size used to be rounded (3 rows of 8 ran
       as two microbatches of 4) without a word. Give a size that divides the batch, or
       `num_microbatches=`.""", requires=("flax", "optax"))
def _():
    import optax

    from multimesh.jax import flax as mmf

    mmf.parallelize_step(_two_dense(), optax.sgd(0.1), global_batch=jnp.ones((8, 16)),
                         num_stages="auto", microbatch_size=3)


@error("xla-costs-bad-device-model", SCHEDULES, "`xla_costs` with a device model that is not a DeviceModel",
       MultimeshTypeError,
       r"`device_model` must be a multimesh.jax.DeviceModel \(for example "
       r"DeviceModel.for_device\(jax.devices\(\)\[0\]\), or DeviceModel\(peak_flops=..., "
       r"memory_bandwidth=...\)\) or None, got str 'gpu'",
       """A device model turns XLA's flops and bytes into seconds; a name used to fail
       inside the cost code with an AttributeError.""")
def _():
    mm.xla_costs(pipelined(), device_model="gpu")


@error("visualize-cost-not-callable", SCHEDULES, "`visualize_schedule(cost=...)` that is not a function",
       MultimeshTypeError,
       r"visualize_schedule's `cost` must be a function of a unit \(its duration in units of "
       r"time\) or None; for seconds per fragment use `costs=`; got int 3",
       """`cost` maps a unit to its duration; `costs` takes `'xla'`, a StepProfile or a
       `{fragment: seconds}` mapping.""")
def _():
    mm.visualize_schedule(pipelined(), cost=3, print=False)


@error("plan-shard-not-callable", IMPLICIT, "`PipelinePlan.shard` of something not callable",
       MultimeshTypeError,
       r"`PipelinePlan.shard` takes the step's gradient function \(such as "
       r"`jax.value_and_grad\(loss\)`\), got int 3",
       """`plan.shard(grad_fn)` wraps the step's gradient function, as `plan.microbatch`
       does.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2)
    plan.shard(3)


@error("plan-json-overlapping-stages", IMPLICIT, "`PipelinePlan.from_json` with stages that share devices",
       MultimeshValueError,
       r"`PipelinePlan.from_json`: the stages' `devices` must be 2 disjoint submesh\(es\) for "
       r"2 stage\(s\) at interleave=1, got \[\[0, 1, 2, 3\], \[0, 1, 2, 3\]\]",
       """Stages share a submesh only as the plan's `interleave` says (two stages per
       submesh for an interleaved or V-shape schedule); other device sets are disjoint.
       Load the JSON `plan.to_json()` wrote, unedited, or plan again.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, num_microbatches=2)
    saved = json.loads(plan.to_json())
    saved["stages"][1]["devices"] = saved["stages"][0]["devices"]
    mm.PipelinePlan.from_json(json.dumps(saved))


@error("plan-json-devices-not-here", IMPLICIT, "`PipelinePlan.from_json` of a plan made on other devices",
       MultimeshValueError,
       r"`PipelinePlan.from_json`: the plan places its stages on devices \[8, 9, 10, 11\], "
       r"which this process does not have \(its devices are \[0, 1, 2, 3, 4, 5, 6, 7\]\)",
       """A plan names the device ids it was made for. Loaded in a process without them
       (a plan saved on a 16-device machine, read on 8), it is refused at load rather than
       run on whatever devices its positions fall on. Load it where its devices are, or
       plan again there.""")
def _():
    plan = mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, num_microbatches=2)
    saved = json.loads(plan.to_json())
    saved["stages"][1]["devices"] = [8, 9, 10, 11]
    mm.PipelinePlan.from_json(json.dumps(saved))


@error("plan-loss-not-scalar", IMPLICIT, "`plan_pipeline` of a function that returns no scalar loss",
       MultimeshValueError,
       r"`plan_pipeline` plans the training step of a loss: `fun` must return one "
       r"floating-point scalar \(the loss it differentiates\), got float32\[8\]",
       """The planner differentiates the loss to cost each unit's backward; it used to
       fail in `jax.grad`. Reduce the loss to a scalar (a mean or a sum).""")
def _():
    mm.plan_pipeline(lambda ws, x: jnp.tanh(x @ ws[0]).sum(1), *layered_args())


@error("plan-batch-not-an-array", IMPLICIT, "`plan_pipeline` with an example batch that is not an array",
       MultimeshValueError,
       r"`plan_pipeline` cuts the batch \(argument 1\) along dimension 0, but it has no "
       r"array with that dimension \(3\)",
       """The example batch is what the step gets: arrays (or a pytree of them) with the
       rows along `dim`. A number used to fail with an AttributeError.""")
def _():
    mm.plan_pipeline(layered_model, layered_args()[0], 3)


@error("plan-fsdp-not-bool", IMPLICIT, "`plan_pipeline(fsdp=...)` that is not True, False or None",
       MultimeshTypeError,
       r"`plan_pipeline`: `fsdp` must be True \(shard each stage's parameters over its "
       r"devices\), False or None \(the planner chooses\), got str 'yes'",
       """A string used to be read as True.""")
def _():
    mm.plan_pipeline(layered_model, *layered_args(), num_stages=2, fsdp="yes")


@error("compare-schedules-costs-missing-fragment", SCHEDULES,
       "`compare_schedules` with costs that name none of the program's fragments",
       ScheduleError,
       r"no schedule can be simulated with these costs: no cost for fragment 's0_fwd' "
       r"\(given costs know: none\)",
       """GPipe takes any program, so when it cannot be simulated the costs are at fault,
       and the table would be empty, every schedule listed with the same reason. Give a
       cost for every fragment (`mm.xla_costs(compiled)`, a StepProfile), or `'unit'`.""")
def _():
    mm.compare_schedules(pipelined(), costs={})
