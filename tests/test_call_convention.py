"""One calling convention (issue 39, items 1 and 2): a compiled program's call,
``profile``, ``step_profile`` and ``memory_profile`` turn arguments into the
executor's inputs and its outputs into results the same way, typed PRNG keys
included; the conversion is written once (an AST scan finds a second copy), and no
module outside a stage's own assigns to the stage."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = sorted(p for p in ROOT.joinpath("multimesh").rglob("*.py")
                 if "__pycache__" not in p.parts)


def _stage(k):
    mesh = mm.TaskMesh(devices=range(2 * k, 2 * k + 2), axis_names=("x",), axis_sizes=(2,))
    return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"stage{k}", mesh=mesh)


def _noisy(k, ws, x):
    """Two stages; the key feeds one of them and comes back split."""
    k1, k2 = jax.random.split(k)
    x = _stage(0)(ws[0], x + 0.01 * jax.random.normal(k1, x.shape))
    return (_stage(1)(ws[1], x) ** 2).mean(), k2


def _plain(k, ws, x):
    k1, k2 = jax.random.split(k)
    x = jnp.tanh((x + 0.01 * jax.random.normal(k1, x.shape)) @ ws[0])
    return (jnp.tanh(x @ ws[1]) ** 2).mean(), k2


WS = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.7]
X = jnp.linspace(-1, 1, 64).reshape(8, 8)


def _same(got, want):
    (loss, key), (want_loss, want_key) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert key.dtype == want_key.dtype  # a typed key, not its raw data
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(want_key))


def test_profile_takes_and_returns_typed_keys_as_the_call_does():
    k = jax.random.key(0)
    compiled = mm.mjit(_noisy).lower(k, WS, X).compile()
    assert not compiled.fast_path and compiled.record.key_inputs
    want = _plain(k, WS, X)
    _same(compiled(k, WS, X), want)
    _same(compiled.profile(k, WS, X), want)
    assert compiled.last_trace is not None
    mp = compiled.memory_profile(k, WS, X)
    ids = sorted(tuple(s.devices) for s in mp.submeshes)
    assert (0, 1) in ids and (2, 3) in ids, ids
    assert all(s.peak > 0 for s in mp.submeshes)


def _pipelined():
    def loss(ws, x, k):
        x = _stage(0)(ws[0], x + 0.01 * jax.random.normal(k, x.shape))
        return (_stage(1)(ws[1], x) ** 2).mean()

    grads = mm.microbatch(jax.value_and_grad(loss), dim=0, size=2, argnum=1,
                          schedule="1f1b", reduction="mean")

    def step(ws, x, k):
        k1, k2 = jax.random.split(k)
        return grads(ws, x, k1), k2
    return step


def test_step_profile_of_a_pipelined_program_with_typed_keys():
    k = jax.random.key(3)
    compiled = mm.mjit(_pipelined()).lower(WS, X, k).compile()
    assert compiled.schedule is not None
    (value, g), key = compiled(WS, X, k)
    (pv, pg), pkey = compiled.profile(WS, X, k)
    np.testing.assert_allclose(pv, value, rtol=1e-5)
    for a, b in zip(pg, g):
        np.testing.assert_allclose(a, b, rtol=1e-5)
    assert pkey.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(pkey), jax.random.key_data(key))
    prof = compiled.step_profile(WS, X, k, steps=1)
    assert prof.steps == 1 and len(prof.durations) == len(compiled.schedule.units)
    assert compiled.last_profile is not None and compiled.last_profile.steps == 1
    mp = compiled.memory_profile(WS, X, k)
    assert mp.schedule == "1f1b" and len(mp.submeshes) == 2


# ------------------------------------------------------------- written once (AST scans)

CONVENTION = ROOT / "multimesh" / "jax" / "_stages" / "call_convention.py"
ONCE = {"key_data", "wrap_key_data", "key_impl", "check_call", "place_outputs",
        "retype_outputs", "_retype_outputs", "explicit_placements", "_explicit_placements",
        "make_array_from_single_device_arrays"}
"""What the conversion is made of: typed keys to and from their data, the call's check,
outputs placed and retyped (``make_array_from_single_device_arrays``: also the
runtime's, for arrays that cross processes; see ``ALSO``)."""
ALSO = {("distributed.py", "make_array_from_single_device_arrays")}


def _called(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every call of, or reference to, a name in ``ONCE``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ONCE:
            out.append((node.attr, node.lineno))
        elif isinstance(node, ast.Name) and node.id in ONCE:
            out.append((node.id, node.lineno))
    return out


def test_the_calling_convention_is_written_once():
    """Flattening and checking a call, typed keys, output placement and explicit retyping
    appear only in ``call_convention.py`` (``call_checks.py`` defines ``check_call``)."""
    assert {n for n, _ in _called(ast.parse(CONVENTION.read_text()))} >= {
        "key_data", "wrap_key_data", "key_impl", "check_call", "_retype_outputs",
        "_explicit_placements", "make_array_from_single_device_arrays"}
    hits = [f"{p.relative_to(ROOT)}:{line} uses {name}" for p in LIBRARY
            if p != CONVENTION for name, line in _called(ast.parse(p.read_text()))
            if (p.name, name) not in ALSO | {("call_checks.py", "check_call")}]
    assert not hits, "a second copy of the calling convention:\n" + "\n".join(hits)


def test_the_convention_scan_finds_a_copy():
    tree = ast.parse("def f(x):\n    return jax.random.key_data(x)\n")
    assert _called(tree) == [("key_data", 2)]


EXECUTOR_PRIVATE = {"_exec", "_steps", "_start", "_outputs", "_program", "_runs"}
OWNERS = {"_exec": "compiled.py"}


def test_no_module_reaches_into_the_executor():
    """What profiling needs of the executor it asks through public methods
    (``run_timed``, ``measure``, ``steps``), not through its private fields; only
    ``MpmdCompiled`` holds its executor (``_exec``)."""
    hits = []
    for p in LIBRARY:
        if p.name == "executor.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in EXECUTOR_PRIVATE \
                    and OWNERS.get(node.attr) != p.name and not (
                        isinstance(node.value, ast.Name) and node.value.id == "self"):
                hits.append(f"{p.relative_to(ROOT)}:{node.lineno} reads .{node.attr}")
    assert not hits, "\n".join(hits)


# ------------------------------------------------------------------ stages built whole

STAGE_NAMES = {"traced", "lowered", "compiled", "inner"}
"""Names a stage object goes by outside its class (``inner``: the stage an NNX stage
wraps); names ending so (``fast_compiled``) too."""
JAX_DOOR = ROOT / "multimesh" / "_src" / "jax_compat.py"  # jax's own stages, not ours


def _stage_classes() -> dict[str, pathlib.Path]:
    """Every Traced/Lowered/Compiled class of the library -> its defining module."""
    out = {}
    for p in LIBRARY:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith(
                    ("Traced", "Lowered", "Compiled")):
                out[node.name] = p
    return out


def stage_assignments(path: pathlib.Path, own: set[str]) -> list[str]:
    """Assignments to an attribute of a stage object in ``path`` (``compiled.x = ...``,
    ``setattr(lowered, ...)``); ``self.x`` inside a class of ``own`` is the stage's own."""
    tree = ast.parse(path.read_text())
    hits = []

    def visit(node, cls):
        for child in ast.iter_child_nodes(node):
            visit(child, child.name if isinstance(child, ast.ClassDef) else cls)
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                        and _is_stage(sub.value.id, cls, own):
                    hits.append(f"{path.name}:{sub.lineno} {sub.value.id}.{sub.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr") and node.args and \
                isinstance(node.args[0], ast.Name) and _is_stage(node.args[0].id, cls, own):
            hits.append(f"{path.name}:{node.lineno} {node.func.id}({node.args[0].id}, ...)")

    visit(tree, None)
    return hits


def _is_stage(name: str, cls: str | None, own: set[str]) -> bool:
    if name == "self":
        return cls is not None and cls.endswith(("Traced", "Lowered", "Compiled")) \
            and cls not in own
    return name in STAGE_NAMES or name.endswith(("traced", "lowered", "compiled"))


def test_no_module_assigns_to_a_stage_from_outside():
    classes = _stage_classes()
    assert {"MpmdTraced", "MpmdLowered", "MpmdCompiled", "FastCompiled",
            "NnxCompiled"} <= set(classes)
    hits = []
    for p in LIBRARY:
        if p == JAX_DOOR:
            continue
        own = {c for c, where in classes.items() if where == p}
        hits += [f"{p.relative_to(ROOT)}: {h}" for h in stage_assignments(p, own)]
    assert not hits, "stages patched from outside:\n" + "\n".join(hits)


def test_the_stage_scan_finds_a_patch(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("def f(lowered):\n    c = lowered.compile()\n    compiled = c\n"
                    "    compiled.input_shardings = None\n    setattr(lowered, 'x', 1)\n"
                    "class MpmdCompiled:\n    def __init__(self):\n        self.y = 1\n")
    assert stage_assignments(path, {"MpmdCompiled"}) == [
        "mod.py:4 compiled.input_shardings", "mod.py:5 setattr(lowered, ...)"]
    assert stage_assignments(path, set()) == ["mod.py:4 compiled.input_shardings",
                                              "mod.py:5 setattr(lowered, ...)",
                                              "mod.py:8 self.y"]


@pytest.mark.parametrize("attr", ["record", "input_shardings", "output_shardings",
                                  "last_trace", "last_profile", "schedule"])
def test_a_compiled_stage_has_every_field_when_built(attr):
    compiled = mm.mjit(_noisy).lower(jax.random.key(0), WS, X).compile()
    assert attr in vars(compiled) or hasattr(type(compiled), attr), attr


# ------------------------------------------------------------- NNX objects, same door

def test_nnx_profiles_take_the_objects_a_call_takes():
    """``profile``/``step_profile``/``memory_profile`` of a compiled NNX program take the
    NNX objects its call takes; ``profile`` writes their updates back (the Rngs' typed
    key state advances as after a call)."""
    from flax import nnx

    class Noisy(nnx.Module):
        def __init__(self, stage):
            self.w = nnx.Param(jnp.eye(8) * 0.5)
            self.rngs = nnx.Rngs(0)
            self.stage = stage

        def __call__(self, x):
            x = x + 0.01 * self.rngs.default.normal(x.shape)
            return self.stage(self.w[...], x)

    first = _stage(0)  # one task: a static field of both modules
    called, profiled = Noisy(first), Noisy(first)
    plain = Noisy(lambda w, x: jnp.tanh(x @ w))
    compiled = mm.mjit(lambda m, x: m(x)).lower(called, X).compile()
    want = plain(X)
    np.testing.assert_allclose(compiled(called, X), want, rtol=1e-5)
    np.testing.assert_allclose(compiled.profile(profiled, X), want, rtol=1e-5)
    assert compiled.last_trace is not None
    for m in (called, profiled):
        np.testing.assert_array_equal(jax.random.key_data(m.rngs.default.key[...]),
                                      jax.random.key_data(plain.rngs.default.key[...]))
        assert int(m.rngs.default.count[...]) == int(plain.rngs.default.count[...]) == 1
    mp = compiled.memory_profile(profiled, X)
    assert [tuple(s.devices) for s in mp.submeshes][0] == (0, 1)
    assert int(profiled.rngs.default.count[...]) == 1  # a measure writes nothing back
