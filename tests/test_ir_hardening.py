"""IR from outside a Python program (issue 21): no input crashes ``mm-opt``,
``mm-import-mpmd`` or ``compile_mpmd``; bytecode is read and written like mlir-opt;
a lowered program replays exactly under ``mm-opt``.

Former crashes (segfaults, unbounded memory) run in a child process under a timeout,
so a regression fails the test instead of killing pytest.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import multimesh.jax as mm
from multimesh._src import ir_attrs as _attrs
from multimesh._src.errors import MultimeshValueError
from multimesh._src.mlir import make_context, module_bytecode, parse_module, print_module
from multimesh.runtime import build_plan
from multimesh.tools import mm_opt
from tests.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
TWO_STAGE = ROOT / "tests" / "filecheck" / "Inputs" / "import_mpmd_2stage.mlir"
MESHES = {"m1": range(4), "m2": range(4, 8)}
_ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
            JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def _with_topology(value: str) -> str:
    text = TWO_STAGE.read_text()
    start = text.index("topology = #mpmd.topology<")
    end = text.index(">>>", start) + 3
    return text[:start] + f"topology = {value}" + text[end:]


def _child(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=_ENV)


def _mm_opt_cli(args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multimesh.tools.mm_opt", *args],
                          capture_output=True, timeout=timeout, cwd=ROOT, env=_ENV)


def _mm_opt(args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mm_opt.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------- former crashes


@pytest.mark.parametrize("value,shown", [('"m1"', '"m1"'), ("3 : i64", "3 : i64")])
def test_wrong_typed_topology_in_a_child(tmp_path, value, shown):
    """Used to segfault both mm-opt and compile_mpmd while jaxlib parsed the module."""
    path = tmp_path / "topology.mlir"
    path.write_text(_with_topology(value))
    p = _mm_opt_cli([str(path), "-p", "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7})"])
    line = 1 + TWO_STAGE.read_text()[:TWO_STAGE.read_text().index("topology =")].count("\n")
    assert p.returncode == 1 and p.stdout == b"", (p.returncode, p.stderr[-500:])
    assert p.stderr.decode().startswith(
        f"{path}:{line}:") and f"error: 'topology' must be an #mpmd.topology, got {shown}" \
        in p.stderr.decode(), p.stderr
    c = _child("import multimesh.jax as mm\n"
               f"try: mm.compile_mpmd(open({str(path)!r}).read(), "
               "{'m1': range(4), 'm2': range(4, 8)})\n"
               "except ValueError as e: print(e)\n")
    assert c.returncode == 0, (c.returncode, c.stderr[-800:])
    assert f"'topology' must be an #mpmd.topology, got {shown}" in c.stdout, c.stdout


def test_compile_mpmd_deeply_nested_in_a_child():
    """6,000 nested modules used to segfault compile_mpmd (parsed on the caller's stack);
    now it parses on a big stack and reports the stray module. Deeper than mm-opt's
    limit is refused before parsing, as mm-opt refuses it."""
    code = ("import multimesh.jax as mm\n"
            f"src = open({str(TWO_STAGE)!r}).read()\n"
            "i = src.rindex('}')\n"
            "for depth in (6000, 10005):\n"
            "    deep = src[:i] + 'module {' * depth + '}' * depth + '\\n}\\n'\n"
            "    try: mm.compile_mpmd(deep, {'m1': range(4), 'm2': range(4, 8)})\n"
            "    except ValueError as e: print(depth, str(e).splitlines()[0])\n")
    c = _child(code)
    assert c.returncode == 0, (c.returncode, c.stderr[-800:])
    lines = c.stdout.splitlines()
    assert lines[0].startswith("6000 multimesh pass 'mm-import-mpmd' failed: 'builtin.module' "
                               "at the top level of the module"), lines
    assert lines[1].startswith("10005 `compile_mpmd` cannot read the program: the input nests "
                               "brackets more than 10000 levels deep"), lines


def test_huge_microbatch_count_in_a_child(tmp_path):
    """num_microbatches = 1e9 made mm-opt grow ~50 MB/s without end; now a bound."""
    seed = (ROOT / "tests" / "filecheck" / "schedule_fragments.mlir").read_text()
    chunk = "\n".join(ln for ln in seed.split("// -----")[0].splitlines()
                      if not ln.startswith("//"))
    path = tmp_path / "mb.mlir"
    path.write_text(chunk.replace("mm.num_microbatches = 2", "mm.num_microbatches = 1000000000"))
    p = _mm_opt_cli([str(path), "-p", "builtin.module(mm-schedule-fragments)"])
    assert p.returncode == 1, p.stderr[-500:]
    assert b"error: 'mm.num_microbatches' on 'mm.microbatch_loop' must be a microbatch count " \
           b"in 1..65536, got 1000000000" in p.stderr, p.stderr


# ----------------------------------------------------------------------------- diagnostics


def _schedule_chunk(config: str) -> str:
    seed = (ROOT / "tests" / "filecheck" / "schedule_fragments.mlir").read_text()
    chunk = "\n".join(ln for ln in seed.split("// -----")[0].splitlines()
                      if not ln.startswith("//"))
    return chunk.replace('{mm.schedule_config = {schedule = "gpipe"}}',
                         f"{{mm.schedule_config = {config}}}")


@pytest.mark.parametrize("config,message", [
    ('{schedule = "1f1b", num_stages = "4"}',
     "'mm.schedule_config' num_stages must be an integer in 1..65536, got \"4\""),
    ("{unrolling = 2.5}",
     "'mm.schedule_config' unrolling must be an integer in 1..65536, got 2.5"),
    ("{schedule = 3}", "'mm.schedule_config' schedule must be a non-empty string, got 3"),
    ('{custom_schedule = [["a", [true, "b"]]]}',
     "'mm.schedule_config' custom_schedule must be a list of lists of task names or "
     '[microbatch, "name"] pairs, got [["a", [true, "b"]]]'),
    ("{speed = 2}", "'mm.schedule_config' has unknown key 'speed'"),
    ('"1f1b"', "'mm.schedule_config' must be a dictionary with keys among schedule, "
               'num_stages, interleave, custom_schedule, unrolling, got "1f1b"'),
])
def test_schedule_config_of_the_wrong_type(tmp_path, config, message):
    """Used to be a TypeError inside mm-schedule-fragments (an internal error)."""
    path = tmp_path / "cfg.mlir"
    path.write_text(_schedule_chunk(config))
    code, out, err = _mm_opt([path, "-p", "builtin.module(mm-schedule-fragments)"])
    assert code == 1 and out == "" and "internal error" not in err, err
    line = 1 + path.read_text()[:path.read_text().index("module attributes")].count("\n")
    assert err.startswith(f"{path}:{line}:1: error: {message}"), err


def test_huge_device_positions_are_diagnostics(tmp_path):
    """Used to be std::bad_cast (mm.num_devices) or an OverflowError."""
    text = TWO_STAGE.read_text().replace(
        "module @jit_loss attributes {",
        "module @jit_loss attributes {mm.meshes = {m1 = [0, 1, 2, 3], "
        "m2 = [4, 5, 6, 9223372036854775807]}, ", 1)
    path = tmp_path / "pos.mlir"
    path.write_text(text)
    code, _, err = _mm_opt([path, "-p", "builtin.module(mm-import-mpmd)"])
    assert code == 1 and "internal error" not in err, err
    assert "error: 'mm.meshes' must be a dictionary from mesh names to non-empty lists of " \
           "device positions in 0..1048575, got {m1 = [0, 1, 2, 3], m2 = [4, 5, 6, " \
           "9223372036854775807]}" in err, err
    code, _, err = _mm_opt([TWO_STAGE, "-p",
                            "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-99999999999999999999})"])
    assert code == 1 and "positions are below 1048576" in err and "internal" not in err, err


def test_long_position_lists_print_a_count(tmp_path):
    """A 'm2=4-1000000' typo printed a 7.9 MB message listing every position."""
    code, _, err = _mm_opt([TWO_STAGE, "-p",
                            "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-1000000})"])
    assert code == 1
    first = err.splitlines()[0]
    assert first.endswith('error: mesh "m2" ["x"=2, "y"=2] has 4 devices but option '
                          "'meshes' gives it 999997: [4, 5, 6, 7, 8, 9, 10, 11, ... "
                          "(999997 entries)]"), first
    assert len(err) < 4000


def test_compile_mpmd_text_that_is_not_unicode():
    """UnicodeDecodeError / TypeError from compile_mpmd before; now its source guard."""
    src = TWO_STAGE.read_text()
    with pytest.raises(MultimeshValueError, match=r"input is not valid UTF-8: byte 0xe9 "
                       r"\(invalid continuation byte\).*\(line 53, column 7\)"):
        mm.compile_mpmd(src.encode() + b"// caf\xe9\n", MESHES)
    with pytest.raises(MultimeshValueError, match=r"lone surrogate U\+DC80.*\(line 53, "
                       r"column 4\)"):
        mm.compile_mpmd(src + "// \udc80\n", MESHES)


def test_stray_nested_module_is_rejected():
    """An unnamed nested module was a KeyError in runtime/plan.py."""
    src = TWO_STAGE.read_text()
    i = src.rindex("}")
    with pytest.raises(MultimeshValueError, match="'builtin.module' at the top level"):
        mm.compile_mpmd(src[:i] + "module {\n}\n}\n", MESHES)
    # the runtime plan, given such a module directly, says what is wrong
    mpmd = ROOT / "tests" / "goldens" / "e2_mpmd_autosharding.mlir"
    text = mpmd.read_text()
    j = text.rindex("}")
    module = parse_module(text[:j] + "module {\n}\n}\n", make_context())
    with pytest.raises(MultimeshValueError, match="nested module without a name"):
        build_plan(module)


def test_typed_reader_messages():
    spec = _attrs.dict_of(n=_attrs.int_in(1, 4), s=_attrs.list_of(_attrs.NAME))
    assert _attrs.read({"n": 2, "s": ["a"]}, spec, "'x'") == {"n": 2, "s": ["a"]}
    for value, message in [
            ({"n": True}, "'x' n must be an integer in 1..4, got true"),
            ({"n": 5}, "'x' n must be an integer in 1..4, got 5"),
            ({"s": ["a", ""]}, "'x' s must be a list of non-empty strings, got [\"a\", \"\"]"),
            ({"s": list(range(100))}, "'x' s must be a list of non-empty strings, got "
                                      "[0, 1, 2, 3, 4, 5, 6, 7, ... (100 entries)]"),
            ([1], "'x' must be a dictionary with keys among n, s, got [1]")]:
        with pytest.raises(MultimeshValueError) as e:
            _attrs.read(value, spec, "'x'")
        assert str(e.value) == message


# ----------------------------------------------------------------------------- bytecode


def test_bytecode_round_trip_gives_the_same_module(tmp_path):
    bc = tmp_path / "two.mlirbc"
    code, out, err = _mm_opt([TWO_STAGE, "--emit-bytecode", "-o", bc])
    assert code == 0 and out == "", err
    data = bc.read_bytes()
    assert data[:4] == _attrs.BYTECODE_MAGIC
    code, from_bc, err = _mm_opt([bc])
    assert code == 0, err
    code, from_text, err = _mm_opt([TWO_STAGE])
    assert code == 0, err
    assert from_bc == from_text and "mpmd.fragment_call" in from_text
    # a pipeline on bytecode input, written as bytecode again, reads back the same
    pipe = "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7},mm-verify)"
    code, _, err = _mm_opt([bc, "-p", pipe, "--emit-bytecode", "-o", tmp_path / "out.bc"])
    assert code == 0, err
    code, text_out, err = _mm_opt([TWO_STAGE, "-p", pipe])
    assert code == 0, err
    with make_context() as ctx:
        again = print_module(parse_module((tmp_path / "out.bc").read_bytes(), ctx))
    assert again == text_out


def test_bytecode_on_stdout_and_stdin():
    p = _mm_opt_cli([str(TWO_STAGE), "--emit-bytecode"])
    assert p.returncode == 0 and p.stdout[:4] == _attrs.BYTECODE_MAGIC, p.stderr
    q = subprocess.run([sys.executable, "-m", "multimesh.tools.mm_opt", "-"], input=p.stdout,
                       capture_output=True, timeout=600, cwd=ROOT, env=_ENV)
    assert q.returncode == 0, q.stderr
    assert q.stdout.decode() == _mm_opt([TWO_STAGE])[1]


def test_bytecode_with_a_wrong_topology_is_refused():
    """Bytecode cannot be scanned as text; mpmd's attributes are stored as text in it."""
    with make_context():
        module = parse_module(_with_topology('#mpmd.topology<<"m1" : <["x"=4]>>, '
                                             '<"m2" : <["x"=2, "y"=2]>>>'))
    data = module_bytecode(module).replace(b"#mpmd.topology<", b"#mpmd.topolog0<")
    with pytest.raises(_attrs.SourceError, match="'topology' must be an #mpmd.topology"):
        _attrs.decode_source(data)


def test_compile_mpmd_reads_bytecode():
    S = load_tool("sdy_mpmd")
    program = S.TwoStage(1, width=16, batch=8, m1=(("x", 4),), m2=(("x", 2), ("y", 2)))
    params, xs = program.args()
    text = program.partitioned(None)
    with make_context():
        data = module_bytecode(parse_module(text))
    trees = dict(in_tree=jax.tree.structure((params, xs)), out_tree=jax.tree.structure((0, (0, 0))))
    from_bc = mm.compile_mpmd(data, program.positions, **trees)
    from_text = mm.compile_mpmd(text, program.positions, **trees)
    want = jax.jit(program.plain())(params, xs)
    got, ref = from_bc(params, xs), from_text(params, xs)
    for a, b, c in zip(jax.tree.leaves(got), jax.tree.leaves(ref), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-5)
        assert a.sharding.devices_indices_map(a.shape) == b.sharding.devices_indices_map(b.shape)
    assert {d.id for d in jax.tree.leaves(got)[0].devices()} == set(program.positions["m2"])


# ----------------------------------------------------------------------------- replay


def _mesh(k: int) -> mm.TaskMesh:
    return mm.TaskMesh(devices=range(4 * k, 4 * k + 4), axis_names=("x",), axis_sizes=(4,))


def _replay_program(schedule: str):
    """Two submeshes; interleaved-1f1b places four layers round-robin on them."""
    n = 4 if schedule == "interleaved-1f1b" else 2
    layers = [mm.task(lambda w, x: jnp.tanh(x @ w), name=f"s{k}", mesh=_mesh(k % 2))
              for k in range(n)]

    def loss(ws, x):
        for layer, w in zip(layers, ws):
            x = layer(w, x)
        return (x ** 2).sum()

    ws = [jnp.eye(16) * (1 + 0.1 * k) for k in range(n)]
    x = jnp.linspace(-1, 1, 32 * 16).reshape(32, 16)
    kwargs: dict = {"schedule": schedule}
    if schedule == "custom":
        kwargs = {"custom_schedule": [
            ["s0", "s0", "s0_bwd", "s0", "s0_bwd", "s0", "s0_bwd", "s0_bwd"],
            ["s1", "s1_bwd", "s1", "s1_bwd", "s1", "s1_bwd", "s1", "s1_bwd"]]}
    step = mm.microbatch(jax.value_and_grad(loss), dim=0, size=8, argnum=1, **kwargs)
    return step, jax.value_and_grad(loss), ws, x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble-h1",
                                      "zero-bubble-h2", "custom"])
def test_lowered_program_replays_exactly(tmp_path, schedule):
    """``mm-opt <lowered.as_text()> -p <lowered.pipeline>`` gives the fragments and call
    order of ``.compile()``: the schedule travels in the text (mm.schedule_config)."""
    step, plain, ws, x = _replay_program(schedule)
    lowered = mm.mjit(step).lower(ws, x)
    compiled = lowered.compile()
    with mm.ignore_transforms():
        got = compiled(ws, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(plain)(ws, x))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    text = lowered.as_text()
    assert "mm.schedule_config" in text
    path = tmp_path / "in.mlir"
    path.write_text(text)
    code, out, err = _mm_opt([path, "-p", str(lowered.pipeline)])
    assert code == 0, err
    plan = build_plan(parse_module(out, make_context()))
    assert plan.schedule_name == compiled.plan_data.schedule_name
    assert [(s.fragment, s.microbatch) for s in plan.calls()] == \
        [(c["fragment"], c["microbatch"]) for c in compiled.calls]
    assert {n: f.text for n, f in plan.fragments.items()} == \
        {f["name"]: f["module"] for f in compiled.fragments}


# ----------------------------------------------------------------------------- bytecode names


def _bytecode_with(old: bytes, new: bytes) -> bytes:
    with make_context():
        data = module_bytecode(parse_module(TWO_STAGE.read_text()))
    assert data.count(old) >= 1
    return data.replace(old, new, 1)


@pytest.mark.parametrize("old,new,shown", [
    (b"\0m1\0", b"\0\xff1\0", '"\\xff1"'),  # a mesh name in the string section
    (b"\0main\0", b"\0\xffain\0", '"\\xffain"'),  # a symbol
    (b'<<"m1"', b'<<"\xff1"', "#mpmd.topology<<"),  # the text of an mpmd attribute
])
def test_bytecode_name_that_is_not_utf8_is_diagnosed(tmp_path, old, new, shown):
    """Issue 31: such a name aborted the process (SIGABRT in nanobind) through mm-opt and
    compile_mpmd, or escaped as a bare RuntimeError; now the source guard names it."""
    path = tmp_path / "bad.mlirbc"
    path.write_bytes(_bytecode_with(old, new))
    p = _mm_opt_cli([str(path), "-p", "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-7})"])
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert "error: the bytecode holds a string that is not valid UTF-8: " in err, err
    assert shown in err and "internal error" not in err
    code = (f"import multimesh.jax as mm\n"
            f"from multimesh._src.errors import MultimeshValueError\n"
            f"data = open({str(path)!r}, 'rb').read()\n"
            f"try:\n    mm.compile_mpmd(data, {{'m1': range(4), 'm2': range(4, 8)}})\n"
            f"except MultimeshValueError as e:\n    print('refused:', e)\n")
    c = _child(code)
    assert c.returncode == 0, c.stderr
    assert "refused: `compile_mpmd` cannot read the program: the bytecode holds a string" \
        in c.stdout, c.stdout


def test_text_escape_that_is_not_utf8_is_diagnosed(tmp_path):
    """``"\\FF1"`` in text spells the same byte: it aborted the process as well."""
    path = tmp_path / "bad.mlir"
    path.write_text(TWO_STAGE.read_text().replace('"m1"', '"\\FF1"'))
    p = _mm_opt_cli([str(path)])
    err = p.stderr.decode()
    assert p.returncode == 1, err
    assert 'error: the string "\\xff1" is not valid UTF-8 once its escapes are read' in err
    with pytest.raises(_attrs.SourceError, match="not valid UTF-8"):
        _attrs.decode_source('func.func @"\\C3\\28"() {\n  return\n}\n')
    # escapes that spell UTF-8, and escaped backslashes, are fine
    _attrs.decode_source('func.func @"\\C3\\A9"() attributes {s = "\\\\FF"} {\n  return\n}\n')
