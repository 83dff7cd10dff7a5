"""Host callbacks in MPMD programs: jax.debug.print, debug.callback, pure_callback and
io_callback inside tasks, in the default task, in microbatched bodies and under grad
(issue 20, item 1).

Each of these killed the process (a segfault: every fragment was compiled without the
program's callbacks), so every scenario runs in a child interpreter with a timeout. The
child checks values and gradients against plain jax and placement itself, and prints
what the callbacks saw; this file checks the captured lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import multimesh.jax as mm
from tests.tools import run_child

_PRELUDE = """
import json
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
import jax
import jax.numpy as jnp
from jax.experimental import io_callback
import multimesh.jax as mm

def mesh(devices):
    devices = tuple(devices)
    return mm.TaskMesh(devices=devices, axis_names=("x",), axis_sizes=(len(devices),))

def ids(a):
    return sorted(d.id for d in a.devices())

def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)

def emit(tag, obj):
    print(f"@@{tag} " + json.dumps(obj), flush=True)

@jax.custom_jvp
def host_sin(x):  # sin on the host, with its derivative on the host too
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

@host_sin.defjvp
def _(primals, tangents):
    (x,), (t,) = primals, tangents
    cos = jax.pure_callback(np.cos, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return host_sin(x), cos * t
"""


def _run_child(body: str) -> tuple[list[str], dict]:
    """Run ``body`` after the prelude in a fresh interpreter; returns its other stdout
    lines (what callbacks printed) and what it emitted, by tag."""
    stdout = run_child(_PRELUDE + textwrap.dedent(body))
    lines, emitted = [], {}
    for line in stdout.splitlines():
        if line.startswith("@@"):
            tag, _, obj = line[2:].partition(" ")
            emitted[tag] = json.loads(obj)
        elif line != "CHILD-OK":
            lines.append(line)
    return lines, emitted


def _values(lines: list[str], prefix: str) -> list[float]:
    return [float(m.group(1)) for line in lines
            if (m := re.fullmatch(re.escape(prefix) + r"(\S+)", line))]


def _close(a, b) -> None:
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)


def test_debug_print_and_callback_inside_a_task():
    """A task's debug.print and debug.callback run once per call, on the task's
    submesh, with the values plain jax prints."""
    lines, got = _run_child("""
    PRINT = True
    seen = []

    def f(w, x):
        y = jnp.tanh(x @ w)
        if PRINT:
            jax.debug.print("t1 sum={s}", s=y.sum())
            jax.debug.callback(lambda v: seen.append(float(v)), y.max())
        return y

    t1 = mm.task(f, name="t1", mesh=mesh(range(4)))
    t2 = mm.task(lambda w, x: x @ w, name="t2", mesh=mesh(range(4, 8)))

    def prog(ws, x):
        return t2(ws[1], t1(ws[0], x))

    ws = (jnp.eye(8) * 0.5, jnp.ones((8, 8)))
    x = jnp.linspace(-1, 1, 64).reshape(8, 8)
    step = mm.mjit(prog)
    out = step(ws, x)
    out2 = step(ws, x)  # a second call runs the callbacks again
    jax.effects_barrier()
    PRINT = False
    with mm.ignore_transforms():
        ref = jax.jit(prog)(ws, x)
    close(out, ref)
    close(out2, ref)
    y = jnp.tanh(x @ ws[0])
    emit("got", {"seen": seen, "ids": ids(out), "sum": float(y.sum()), "max": float(y.max())})
    """)
    sums = _values(lines, "t1 sum=")
    assert len(sums) == 2
    for s in sums:
        _close(s, got["got"]["sum"])
    assert len(got["got"]["seen"]) == 2
    for v in got["got"]["seen"]:
        _close(v, got["got"]["max"])
    assert got["got"]["ids"] == [4, 5, 6, 7]


def test_callbacks_in_the_default_task():
    """A flat program with one task: debug.print, pure_callback and io_callback in the
    ops outside it (the default task) run once and feed the task as in plain jax."""
    lines, got = _run_child("""
    log = []
    t = mm.task(lambda w, x: x @ w, name="t", mesh=mesh(range(4, 8)))

    def prog(w, x):
        y = jnp.sin(x) * 2
        jax.debug.print("default y={s}", s=y.sum())
        z = jax.pure_callback(lambda a: np.cos(a), jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        io_callback(lambda a: log.append(float(a)), None, z.sum())
        return t(w, z), z

    w = jnp.eye(8) * 3.0
    x = jnp.linspace(-1, 3, 64).reshape(8, 8)
    out, z = mm.mjit(prog)(w, x)
    jax.effects_barrier()
    y = np.sin(np.asarray(x)) * 2
    close(z, np.cos(y))
    close(out, np.cos(y) @ np.asarray(w))
    emit("got", {"log": log, "ids": ids(out), "y": float(y.sum()),
                 "z": float(np.cos(y).sum())})
    """)
    ys = _values(lines, "default y=")
    assert len(ys) == 1
    _close(ys[0], got["got"]["y"])
    assert len(got["got"]["log"]) == 1
    _close(got["got"]["log"][0], got["got"]["z"])
    assert got["got"]["ids"] == [4, 5, 6, 7]


def test_pure_and_io_callbacks_inside_tasks():
    """pure_callback results flow on to the next task (values and placement as in
    plain jax); io_callback runs once per call."""
    lines, got = _run_child("""
    log = []

    def f(w, x):
        y = x @ w
        z = jax.pure_callback(lambda a: np.asarray(a) * 2,
                              jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        io_callback(lambda a: log.append(float(a)), None, z.sum())
        return z

    t1 = mm.task(f, name="t1", mesh=mesh(range(4)))
    t2 = mm.task(lambda w, x: jnp.tanh(x @ w), name="t2", mesh=mesh(range(4, 8)))

    def prog(ws, x):
        mid = t1(ws[0], x)
        return t2(ws[1], mid), mid

    ws = (jnp.eye(8) * 0.25, jnp.ones((8, 8)) * 0.1)
    x = jnp.arange(64.0).reshape(8, 8) / 64
    out, mid = mm.mjit(prog)(ws, x)
    jax.effects_barrier()
    with mm.ignore_transforms():
        ref, ref_mid = jax.jit(prog)(ws, x)
    jax.effects_barrier()
    close(out, ref)
    close(mid, ref_mid)
    emit("got", {"log": log, "out": ids(out), "mid": ids(mid)})
    """)
    log = got["got"]["log"]
    assert len(log) == 2  # multimesh's call, then plain jax's
    _close(log[0], log[1])
    assert got["got"]["out"] == [4, 5, 6, 7]
    assert got["got"]["mid"] == [0, 1, 2, 3]


def test_callbacks_under_grad():
    """Under value_and_grad each forward print runs once per step, as in jax; a
    pure_callback with a custom_jvp differentiates; values, gradients and gradient
    placement equal plain jax."""
    lines, got = _run_child("""
    PRINT = True
    log = []

    def s0(w, x):
        y = host_sin(x @ w)
        if PRINT:
            jax.debug.print("s0 fwd={s}", s=y.sum())
            io_callback(lambda a: log.append(float(a)), None, jax.lax.stop_gradient(y).max())
        return y

    def s1(w, x):
        y = jnp.tanh(x @ w)
        if PRINT:
            jax.debug.callback(lambda a: log.append(float(a)), y.sum())
        return y

    t0 = mm.task(s0, name="s0", mesh=mesh(range(4)))
    t1 = mm.task(s1, name="s1", mesh=mesh(range(4, 8)))

    def loss(ws, x):
        return (t1(ws[1], t0(ws[0], x)) ** 2).sum()

    ws = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.3 + 0.01]
    x = jnp.linspace(-1, 1, 64).reshape(8, 8)
    v, g = mm.mjit(jax.value_and_grad(loss))(ws, x)
    jax.effects_barrier()
    PRINT = False

    def plain(ws, x):
        y0 = jnp.sin(x @ ws[0])
        return (jnp.tanh(y0 @ ws[1]) ** 2).sum(), y0

    (rv, y0), rg = jax.value_and_grad(plain, has_aux=True)(ws, x)
    close(v, rv)
    for a, b in zip(g, rg):
        close(a, b)
    y1 = jnp.tanh(y0 @ ws[1])
    emit("got", {"log": log, "g0": ids(g[0]), "g1": ids(g[1]), "s0": float(y0.sum()),
                 "max0": float(y0.max()), "s1": float(y1.sum())})
    """)
    fwd = _values(lines, "s0 fwd=")
    assert len(fwd) == 1
    _close(fwd[0], got["got"]["s0"])
    assert sorted(got["got"]["log"]) == pytest.approx(
        sorted([got["got"]["max0"], got["got"]["s1"]]), rel=1e-5)
    assert got["got"]["g0"] == [0, 1, 2, 3]
    assert got["got"]["g1"] == [4, 5, 6, 7]


_PIPELINE = """
PRINT, ORDERED, M, SIZE = True, {ordered}, {m}, 2

def stage(k):
    def body(w, x):
        y = jnp.tanh(x @ w)
        if PRINT:
            jax.debug.print("stage{{k}} mb={{s}}", k=k, s=y.sum(), ordered=ORDERED)
        return y
    return mm.task(body, name=f"s{{k}}", mesh=mesh(range(2 * k, 2 * k + 2)))

tasks = [stage(k) for k in range(4)]

def loss(ws, x):
    for t, w in zip(tasks, ws):
        x = t(w, x)
    return (x ** 2).sum()

ws = [jnp.eye(8) * 0.5 + 0.01 * k for k in range(4)]
x = jnp.linspace(-1, 1, M * SIZE * 8).reshape(M * SIZE, 8)
f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=SIZE, argnum=1, schedule="1f1b")
compiled = mm.mjit(f).lower(ws, x).compile()
assert compiled.schedule is not None
v, g = compiled(ws, x)
jax.effects_barrier()
PRINT = False
with mm.ignore_transforms():
    rv, rg = jax.value_and_grad(loss)(ws, x)
close(v, rv)
for a, b in zip(g, rg):
    close(a, b)
expected = [[] for _ in range(4)]  # stage -> per-microbatch sums, plain jax
for m in range(M):
    h = x[m * SIZE:(m + 1) * SIZE]
    for k in range(4):
        h = jnp.tanh(h @ ws[k])
        expected[k].append(float(h.sum()))
emit("got", {{"expected": expected, "ids": [ids(a) for a in g]}})
"""


def _stage_lines(lines: list[str]) -> list[tuple[int, float]]:
    out = []
    for line in lines:
        m = re.fullmatch(r"stage(\d) mb=(\S+)", line)
        if m:
            out.append((int(m.group(1)), float(m.group(2))))
    return out


@pytest.mark.parametrize("m", [4, 8])
def test_debug_print_in_a_1f1b_pipeline_prints_every_microbatch(m):
    """4 stages on 4 submeshes of 2 devices, 1F1B: each stage prints once per
    microbatch, the value plain jax computes for that microbatch; the step equals
    plain jax and every gradient lives on its stage."""
    lines, got = _run_child(_PIPELINE.format(ordered=False, m=m))
    printed = _stage_lines(lines)
    expected = got["got"]["expected"]
    assert len(printed) == 4 * m  # one line per microbatch per print site
    for k in range(4):
        values = sorted(v for s, v in printed if s == k)
        assert values == pytest.approx(sorted(expected[k]), rel=1e-5, abs=1e-6)
    assert got["got"]["ids"] == [[2 * k, 2 * k + 1] for k in range(4)]


def test_ordered_debug_print_in_a_1f1b_pipeline_runs_in_microbatch_order():
    """ordered=True: every stage prints its microbatches in order 0..M-1, each after
    the previous stage printed the same microbatch (the schedule's dispatch order)."""
    lines, got = _run_child(_PIPELINE.format(ordered=True, m=4))
    printed = _stage_lines(lines)
    expected = got["got"]["expected"]
    assert len(printed) == 16
    for k in range(4):
        assert [v for s, v in printed if s == k] == pytest.approx(expected[k], rel=1e-5,
                                                                   abs=1e-6)
    for k in range(1, 4):  # microbatch i reaches stage k after stage k-1
        pos = [i for i, (s, _) in enumerate(printed) if s == k]
        prev = [i for i, (s, _) in enumerate(printed) if s == k - 1]
        assert all(p > q for p, q in zip(pos, prev))


def test_ordered_callbacks_run_in_program_order():
    """ordered=True prints and ordered io_callbacks keep program order inside a task,
    across tasks on different submeshes and inside a loop, as under jax.jit."""
    lines, got = _run_child("""
    PRINT = True
    log = []

    def f(w, x):
        y = x @ w
        if PRINT:
            jax.debug.print("A1 {s}", s=y.sum(), ordered=True)
            io_callback(lambda a: log.append(("io", float(a))), None, y.max(), ordered=True)
            jax.debug.print("A2 {s}", s=y.sum() + 1, ordered=True)

        def body(i, c):
            if PRINT:
                jax.debug.print("loop {i}", i=i, ordered=True)
            return c * 0.5

        return jax.lax.fori_loop(0, 3, body, y)

    def g(w, x):
        y = x @ w
        if PRINT:
            jax.debug.print("B {s}", s=y.sum(), ordered=True)
        return y

    t1 = mm.task(f, name="t1", mesh=mesh(range(4)))
    t2 = mm.task(g, name="t2", mesh=mesh(range(4, 8)))

    def prog(ws, x):
        return t2(ws[1], t1(ws[0], x)).sum()

    ws = (jnp.eye(4) * 2.0, jnp.ones((4, 4)))
    x = jnp.arange(16.0).reshape(4, 4)
    out = mm.mjit(prog)(ws, x)
    jax.effects_barrier()
    PRINT = False
    with mm.ignore_transforms():
        close(out, jax.jit(prog)(ws, x))
    emit("got", {"log": log})
    """)
    y = [[2.0 * (4 * r + c) for c in range(4)] for r in range(4)]
    total = sum(map(sum, y))
    assert lines == [f"A1 {total}", f"A2 {total + 1}", "loop 0", "loop 1", "loop 2",
                     f"B {total * 0.125 * 4}"]
    assert got["got"]["log"] == [["io", max(map(max, y))]]


def test_programs_that_differ_only_in_their_callbacks_keep_their_own():
    """Fragments compile once per content; two programs whose fragments differ only in
    which Python callback they call each call their own (a callback's number is part of
    the fragment's text), and the same program compiled again reuses its executables."""
    lines, got = _run_child("""
    from multimesh.runtime import executor
    logs = {"a": [], "b": []}

    def program(name):
        def f(w, x):
            y = x @ w
            jax.debug.callback(lambda s: logs[name].append(float(s)), y.sum())
            return y
        t1 = mm.task(f, name="t1", mesh=mesh(range(4)))
        t2 = mm.task(lambda w, x: x @ w, name="t2", mesh=mesh(range(4, 8)))
        return lambda ws, x: t2(ws[1], t1(ws[0], x))

    ws = (jnp.eye(4) * 2.0, jnp.ones((4, 4)))
    x = jnp.ones((4, 4))
    out_a = mm.mjit(program("a"))(ws, x)
    before = executor.xla_compiles
    out_b = mm.mjit(program("b"))(ws, x)
    fresh_b = executor.xla_compiles - before  # t1's fragment again (its callback), not t2's
    again = mm.mjit(program("a"))(ws, x)      # a new callback object: compiles t1 again
    jax.effects_barrier()
    close(out_a, out_b)
    close(out_a, again)
    emit("got", {"a": logs["a"], "b": logs["b"], "fresh_b": fresh_b})
    """)
    assert got["got"]["a"] == [32.0, 32.0]
    assert got["got"]["b"] == [32.0]
    assert got["got"]["fresh_b"] == 1


def test_callbacks_in_registered_tasks():
    """Implicit tasks (register_task rules on name scopes) print from their stages,
    per microbatch under 1F1B, values and gradients equal plain jax."""
    lines, got = _run_child("""
    PRINT = True

    def loss(ws, x):
        with jax.named_scope("layer0"):
            x = jnp.tanh(x @ ws[0])
            if PRINT:
                jax.debug.print("layer0 {s}", s=x.sum(), ordered=True)
        with jax.named_scope("layer1"):
            x = jnp.tanh(x @ ws[1])
            if PRINT:
                jax.debug.print("layer1 {s}", s=x.sum(), ordered=True)
        return (x ** 2).sum()

    ws = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.3]
    x = jnp.linspace(0, 1, 64).reshape(8, 8)
    multi_mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    multi_mesh.register_task(
        r"layer\\d", callback=lambda name, bp: mm.Task(mesh_slice={"stage": int(name[-1])}))
    f = mm.microbatch(jax.value_and_grad(loss), dim=0, size=2, argnum=1, schedule="1f1b")
    with multi_mesh:
        v, g = mm.mjit(f)(ws, x)
    jax.effects_barrier()
    PRINT = False
    rv, rg = jax.value_and_grad(loss)(ws, x)
    close(v, rv)
    for a, b in zip(g, rg):
        close(a, b)
    want = {"layer0": [], "layer1": []}
    for m in range(4):
        h = jnp.tanh(x[2 * m:2 * m + 2] @ ws[0])
        want["layer0"].append(float(h.sum()))
        want["layer1"].append(float(jnp.tanh(h @ ws[1]).sum()))
    emit("got", {"want": want, "ids": [ids(a) for a in g]})
    """)
    want = got["got"]["want"]
    for layer in ("layer0", "layer1"):  # ordered: each stage prints microbatches in order
        assert _values(lines, f"{layer} ") == pytest.approx(want[layer], rel=1e-5)
    assert got["got"]["ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_callbacks_in_a_microbatched_body_under_grad():
    """microbatch(jax.grad(loss)) (GPipe): a custom_jvp pure_callback and an
    io_callback in a task and a debug.callback in the default task run once per
    microbatch with that microbatch's values; the summed gradients equal plain jax."""
    lines, got = _run_child("""
    log = []
    M, SIZE = 4, 2

    def s0(w, x):
        y = host_sin(x @ w)
        io_callback(lambda a: log.append(["io", float(a)]), None, jax.lax.stop_gradient(y).sum())
        return y

    t0 = mm.task(s0, name="s0", mesh=mesh(range(4)))
    t1 = mm.task(lambda w, x: jnp.tanh(x @ w), name="s1", mesh=mesh(range(4, 8)))

    def loss(ws, x):
        h = t1(ws[1], t0(ws[0], x))
        jax.debug.callback(lambda a: log.append(["cb", float(a)]), jax.lax.stop_gradient(h).sum())
        return (h ** 2).sum()

    ws = [jnp.eye(8) * 0.5 + 0.02, jnp.eye(8) * 0.3]
    x = jnp.linspace(0, 1, M * SIZE * 8).reshape(M * SIZE, 8)
    g = mm.mjit(mm.microbatch(jax.grad(loss), dim=0, size=SIZE, argnum=1))(ws, x)
    jax.effects_barrier()

    def plain(ws, x):
        return (jnp.tanh(jnp.sin(x @ ws[0]) @ ws[1]) ** 2).sum()

    for a, b in zip(g, jax.grad(plain)(ws, x)):
        close(a, b)
    want = []
    for m in range(M):
        y = jnp.sin(x[m * SIZE:(m + 1) * SIZE] @ ws[0])
        want += [["io", float(y.sum())], ["cb", float(jnp.tanh(y @ ws[1]).sum())]]
    emit("got", {"log": log, "want": want, "ids": [ids(a) for a in g]})
    """)
    log, want = got["got"]["log"], got["got"]["want"]
    assert len(log) == len(want) == 8  # each callback once per microbatch
    for kind in ("io", "cb"):
        assert sorted(v for k, v in log if k == kind) == pytest.approx(
            sorted(v for k, v in want if k == kind), rel=1e-5)
    assert got["got"]["ids"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_ordered_print_without_tasks_skips_the_fast_path():
    """jax.jit refuses an ordered debug.print on 8 devices; mjit of the same program
    (no task: the fast path's kind) runs it on the MPMD path, once, in order."""
    lines, got = _run_child("""
    def f(x):
        y = jnp.sin(x)
        jax.debug.print("first {s}", s=y.sum(), ordered=True)
        jax.debug.print("second {s}", s=y.max(), ordered=True)
        return y * 2

    x = jnp.arange(16.0)
    compiled = mm.mjit(f).lower(x).compile()
    out = compiled(x)
    jax.effects_barrier()
    close(out, np.sin(np.arange(16.0)) * 2)
    emit("got", {"fast": compiled.fast_path, "ids": ids(out),
                 "sum": float(jnp.sin(x).sum()), "max": float(jnp.sin(x).max())})
    """)
    assert got["got"]["fast"] is False
    assert got["got"]["ids"] == list(range(8))
    assert [line.split()[0] for line in lines] == ["first", "second"]
    _close(_values(lines, "first ")[0], got["got"]["sum"])
    _close(_values(lines, "second ")[0], got["got"]["max"])


def test_ordered_callbacks_keep_call_order_with_jax_jit():
    """Ordered prints of an mjit program and of a jax.jit function called in turn,
    without waiting, come out in call order (jax's runtime tokens go through both)."""
    lines, _ = _run_child("""
    def f(w, x):
        y = jnp.tanh(x @ w)
        for _ in range(10):  # some work, so that a race would show
            y = jnp.tanh(y @ w)
        jax.debug.print("mm {i}", i=x[0, 0], ordered=True)
        return y

    t1 = mm.task(f, name="t1", mesh=mesh(range(4)))
    t2 = mm.task(lambda w, x: x @ w, name="t2", mesh=mesh(range(4, 8)))
    prog = mm.mjit(lambda ws, x: t2(ws[1], t1(ws[0], x)))
    plain = jax.jit(lambda i: jax.debug.print("jit {i}", i=i, ordered=True))
    ws = (jnp.eye(128) * 0.5, jnp.eye(128))
    for i in range(4):
        prog(ws, jnp.full((128, 128), float(i)))
        plain(i)
    jax.effects_barrier()
    """)
    assert lines == [line for i in range(4) for line in (f"mm {float(i)}", f"jit {i}")]


def test_lowered_program_numbers_callbacks_and_cuts_tokens():
    """In process (nothing runs): after lowering, every callback op carries its process
    number beside jax's index, and no token crosses @main's signature or a task call;
    each task body keeps its callbacks (the IR the passes and fragments see)."""
    def body(w, x):
        y = x @ w
        jax.debug.print("a {s}", s=y.sum(), ordered=True)
        return y

    mesh = mm.TaskMesh(devices=range(4), axis_names=("x",), axis_sizes=(4,))
    t1 = mm.task(body, name="t1", mesh=mesh)
    t2 = mm.task(body, name="t2", mesh=mesh.place(range(4, 8)))
    text = mm.mjit(lambda ws, x: t2(ws[1], t1(ws[0], x))).lower(
        (jnp.eye(4), jnp.eye(4)), jnp.ones((4, 4))).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert "!stablehlo.token" not in main
    calls = [line for line in text.splitlines() if "call @mm_task_" in line]
    assert len(calls) == 2 and not any("token" in line for line in calls)
    numbers = re.findall(r"xla_ffi_python_cpu_callback.*mm\.callback = (\d+)", text)
    assert len(numbers) == 2 and len(set(numbers)) == 2


def test_callbacks_under_jax_distributed():
    """2 processes x 4 devices: each callback runs once, in the process that owns its
    fragment's first device; values and gradients equal plain jax in both."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "tests", "multiprocess", "host_callbacks.py")
    p = subprocess.run([sys.executable, "-m", "multimesh.launch", "-n", "2",
                        "--devices-per-process", "4", "--timeout", "200", script],
                       capture_output=True, text=True, timeout=600, cwd=root)
    out = "\n".join(line for line in p.stdout.splitlines() if "[Gloo]" not in line)
    assert p.returncode == 0, out + p.stderr[-3000:]
    for k in range(2):
        assert re.search(rf"^\[{k}\] OK process {k}: \d+ arrays checked", out, re.M), out
    printed = re.findall(r"^\[0\] t1 (\S+)$", out, re.M)
    assert len(printed) == 1, out
    assert not re.search(r"^\[1\] t1 ", out, re.M), out
    assert re.search(r"^\[0\] log \[\] want ", out, re.M), out
    logged = re.search(r"^\[1\] log \[(\S+)\] want (\S+) t1 want (\S+)$", out, re.M)
    assert logged is not None, out
    _close(float(logged.group(1)), float(logged.group(2)))
    _close(float(printed[0]), float(logged.group(3)))
