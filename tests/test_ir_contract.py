"""The IR contract is spelled once (``multimesh/_src/ir_contract.py``) and read checked.

No library module writes an ``mm.*`` name as a string literal; the front end, the passes
and the runtime share one task-mesh record; the runtime rejects a malformed MPMD module
with an :class:`IRContractError` naming the attribute instead of a ``KeyError``.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import jax.numpy as jnp
import pytest

import multimesh.jax as mm
from multimesh._src import ir_contract
from multimesh._src.errors import DiagnosticError, MultimeshError
from multimesh._src.ir_contract import IRContractError, MeshRecord
from multimesh._src.mlir import attr_to_py, make_context
from multimesh.jax._primitives import TaskInfo
from multimesh.runtime import build_plan

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "multimesh" / "_src" / "ir_contract.py"


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _mm_literals(path: pathlib.Path) -> list[str]:
    """``line: value`` of every string constant in ``path`` (f-string parts included,
    docstrings not: they are prose) that starts with ``mm.``."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    return [f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and node.value.startswith("mm.")]


LIBRARY = sorted(p for top in ("multimesh",)
                 for p in ROOT.joinpath(top).rglob("*.py") if "__pycache__" not in p.parts)


def test_no_mm_literal_outside_the_contract_module():
    """A renamed key is one edit: every ``mm.*`` name comes from the contract module.
    (Comments and docstrings may mention names; messages may quote them mid-sentence.)"""
    assert CONTRACT in LIBRARY
    hits = [h for p in LIBRARY if p != CONTRACT for h in _mm_literals(p)]
    assert not hits, "spell these with multimesh._src.ir_contract's names:\n" + "\n".join(hits)


def test_the_scan_sees_f_string_parts():
    tree = ast.parse('x = f"mm.{name}"\ny = "not mm.task"\n')
    found = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and n.value.startswith("mm.")]
    assert found == ["mm."]


def test_every_name_is_distinct_and_prefixed():
    names = {k: v for k, v in vars(ir_contract).items()
             if k.isupper() and isinstance(v, str) and v.startswith(ir_contract.PREFIX)}
    assert len(names) >= 25
    assert len(set(names.values())) == len(names), names


def test_task_mesh_round_trips_through_an_attribute():
    mesh = MeshRecord((4, 5, 6, 7), ("x", "y"), (2, 2), (("batch", "x"),), ("_a", "_w"),
                    ((4, 5, 6, 7), (0, 1, 2, 3)), "fwd")
    with make_context():
        assert MeshRecord.from_attr(mesh.to_attr()) == mesh


def test_the_front_ends_task_record_is_a_task_mesh():
    """One record: the front end's task call is a :class:`MeshRecord` with a tag, and the
    passes read its ``mm.task`` back into the same mesh."""
    info = TaskInfo(name="s0", devices=(0, 1), axis_names=("x",), axis_sizes=(2,),
                    logical_axes=(("batch", "x"),), transpose_count=1)
    assert isinstance(info, MeshRecord)
    with make_context():
        d = attr_to_py(info.attribute())
        assert (d["name"], d["transpose_count"]) == ("s0", 1)
        assert MeshRecord.from_attr(info.attribute()) == MeshRecord(
            (0, 1), ("x",), (2,), (("batch", "x"),))


def test_a_malformed_task_mesh_is_a_diagnostic():
    with make_context():
        bad = MeshRecord((0, 1, 2), ("x",), (2,), ()).to_attr()
        with pytest.raises(DiagnosticError, match=r"axis_sizes \[2\] multiply to 2 but devices"):
            MeshRecord.from_attr(bad)


def _program_text() -> str:
    def stage(k):
        mesh = mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))
        return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"stage{k}", mesh=mesh)

    stages = [stage(0), stage(1)]

    def f(ws, x):
        for s, w in zip(stages, ws):
            x = s(w, x)
        return x.sum()

    ws, x = [jnp.eye(16)] * 2, jnp.ones((8, 16))
    return mm.mjit(f).lower(ws, x).compile().as_text()


@pytest.fixture(scope="module")
def mpmd_text() -> str:
    return _program_text()


def test_the_runtime_reads_a_well_formed_module(mpmd_text):
    plan = build_plan(mpmd_text)
    assert {n: f.devices for n, f in plan.fragments.items()} == {
        "stage0_fwd": (0, 1, 2, 3), "stage1_fwd": (4, 5, 6, 7)}
    assert {f.task for f in plan.fragments.values()} == {"stage0", "stage1"}


@pytest.mark.parametrize("pattern,replacement,message", [
    (r" \{mm\.fragment = @stage1_fwd\}", "",
     r"'mm.fragment_call' has no 'mm.fragment' attribute"),
    (r"mm\.fragment = @stage1_fwd", 'mm.fragment = "stage1_fwd"',
     r"'mm.fragment' on 'mm.fragment_call' must be a symbol reference"),
    (r"(@mm\.transfer\(%0\)) \{mm\.devices = \[4, 5, 6, 7\], ", r"\1 {",
     r"'mm.transfer' has no 'mm.devices' attribute"),
    (r'mm\.task = \{name = "stage1", transpose_count = 0 : i64\}', 'mm.task = "stage1"',
     r"fragment module '@stage1_fwd' 'mm.task' must be a dictionary attribute"),
    (r'mm\.devices = \[4, 5, 6, 7\], mm\.task = \{name = "stage1"', 'mm.task = {name = "stage1"',
     r"fragment module '@stage1_fwd' has no 'mm.devices' attribute"),
    (r"mm\.num_devices = 8 : i64", 'mm.num_devices = "8"', r"'mm.num_devices' must be"),
])
def test_the_runtime_rejects_a_malformed_module(mpmd_text, pattern, replacement, message):
    text, n = re.subn(pattern, replacement, mpmd_text, count=1)
    assert n == 1, f"the test's pattern {pattern!r} no longer matches the program"
    with pytest.raises(DiagnosticError, match=message) as e:
        build_plan(text)
    assert isinstance(e.value, MultimeshError) and isinstance(e.value, ValueError)
    assert e.value.location is not None


def test_a_missing_attribute_is_an_ir_contract_error(mpmd_text):
    text = mpmd_text.replace(" {mm.fragment = @stage1_fwd}", "", 1)
    with pytest.raises(IRContractError, match="docs/ir.md"):
        build_plan(text)


def test_the_contract_module_sits_at_the_bottom():
    tree = ast.parse(CONTRACT.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert all(m == "multimesh._src" or m.startswith("multimesh._src.")
               or m.split(".")[0] in sys.stdlib_module_names for m in imported), imported


def test_the_runtime_checks_the_microbatch_loop():
    """The loop's body, count and recorded order are read checked as well."""
    def stage(k):
        mesh = mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))
        return mm.task(lambda w, x: jnp.tanh(x @ w), name=f"s{k}", mesh=mesh)

    s0, s1 = stage(0), stage(1)
    step = mm.microbatch(lambda ws, x: (s1(ws[1], s0(ws[0], x)) ** 2).sum(), dim=0, size=4,
                         argnum=1, schedule="1f1b")
    text = mm.mjit(step).lower([jnp.eye(16)] * 2, jnp.ones((8, 16))).compile().as_text()
    assert build_plan(text).num_microbatches == 2
    cases = [
        (r"mm\.body = @[\w.]+, ", "", "'mm.microbatch_loop' has no 'mm.body' attribute"),
        (r"mm\.num_microbatches = 2 : i64", "mm.num_microbatches = 0 : i64",
         "'mm.num_microbatches' on 'mm.microbatch_loop' must be"),
        (r"order = array<i64:[^>]*>", "order = 1 : i64",
         "'mm.schedule' on 'mm.microbatch_loop' must be a dictionary with 'order'"),
    ]
    for pattern, replacement, message in cases:
        bad, n = re.subn(pattern, replacement, text, count=1)
        assert n == 1, f"the test's pattern {pattern!r} no longer matches the program"
        with pytest.raises(DiagnosticError, match=message):
            build_plan(bad)


PASSES = ROOT / "multimesh" / "passes"
PARSED_TEXT_OK = {"import_mpmd.py": "mpmd types and their shardings have no Python "
                                    "accessors in jaxlib 0.10.2; the importer reads them "
                                    "from the Shardy:MPMD program's text"}


def _attribute_parses(path: pathlib.Path) -> list[str]:
    """``line`` of every ``ir.Attribute.parse(...)`` call in ``path``."""
    return [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(ast.parse(
        path.read_text())) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "parse" and ast.unparse(node.func.value).endswith("Attribute")]


def test_no_pass_rewrites_an_attribute_from_its_printed_text():
    """Passes rewrite attributes through the bindings' API or the IR contract's typed
    helpers (``Sharding``, ``map_shardings``, ``MeshAxesGroups``), never by editing
    printed text and parsing it back; the one reader of text the bindings cannot read
    is in ``multimesh/_src/ir_contract.py``."""
    hits = [h for p in sorted(PASSES.glob("*.py")) if p.name not in PARSED_TEXT_OK
            for h in _attribute_parses(p)]
    assert not hits, "build these with the bindings or ir_contract's helpers:\n" + "\n".join(hits)
    assert _attribute_parses(CONTRACT), "the scan finds the contract's own parse"


def test_a_sharding_round_trips_through_the_typed_view():
    """Every field of a ``#sdy.sharding`` survives :class:`Sharding` (open and closed
    dimensions, priorities, sub-axes, replicated and unreduced axes, a symbol or an
    inline mesh), and a per-value list or function argument attributes are mapped
    sharding by sharding."""
    texts = ['#sdy.sharding<@mesh, [{"data", ?}, {?}, {"x":(1)2}p1], replicated={"stage"}, '
             'unreduced={"m"}>',
             '#sdy.sharding_per_value<[<@mesh, [{"data"}, {"model"}]>, <@m2, []>]>',
             '#sdy.sharding<mesh<["stage"=2, "data"=2]>, [{"stage"}, {}]>',
             '[{sdy.sharding = #sdy.sharding<@mesh, [{}, {"model"}]>}, {}]']
    with make_context():
        for text in texts:
            a = ir_contract.ir.Attribute.parse(text)
            assert str(ir_contract.map_shardings(a, lambda s: s)) == str(a)
            assert ir_contract.map_shardings(a, lambda s: None) is None
        a = ir_contract.ir.Attribute.parse(texts[1])
        moved = ir_contract.map_shardings(a, lambda s: ir_contract.Sharding(
            "t", s.dims).keep_axes(lambda x: x.name != "data") if s.mesh == "mesh" else None)
        assert str(moved) == '#sdy.sharding_per_value<[<@t, [{}, {"model"}]>, <@m2, []>]>'
