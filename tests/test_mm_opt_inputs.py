"""``mm-opt`` on hostile inputs: deep nesting, bytes that are not UTF-8, its own output.

The deep-nesting runs use the real CLI in a child process: MLIR's parser recursing
past the stack is a segfault, which must fail the test rather than kill pytest.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from multimesh.tools import mm_opt

ROOT = Path(__file__).resolve().parents[1]


def _nested(depth: int) -> str:
    inner = ("func.func @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {\n"
             "  %0 = stablehlo.sine %arg0 : tensor<4xf32>\n  return %0 : tensor<4xf32>\n}\n")
    return "module {\n" * depth + inner + "}\n" * depth


def _cli(args, stdin: bytes | None = None, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "multimesh.tools.mm_opt", *args],
                          input=stdin, capture_output=True, timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("depth", [3000, 6000])
def test_deeply_nested_module_in_a_child(tmp_path, depth):
    """3,000 deep used to segfault while re-parsing the generic form; 6,000 in the parser."""
    path = tmp_path / "deep.mlir"
    path.write_text(_nested(depth))
    p = _cli([str(path), "-p", "builtin.module(mm-verify,mm-strip-markers)",
              "-o", str(tmp_path / "out.mlir")])
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    out = (tmp_path / "out.mlir").read_text()
    assert out.count("module {") == depth and "stablehlo.sine" in out


def test_nesting_beyond_the_limit_is_refused_in_a_child(tmp_path):
    depth = mm_opt.MAX_NESTING + 5
    path = tmp_path / "deeper.mlir"
    path.write_text(_nested(depth))
    p = _cli([str(path), "-p", "builtin.module(mm-verify)"])
    assert p.returncode == 1 and p.stdout == b"", p.stderr[-2000:]
    line = mm_opt.MAX_NESTING + 1
    assert (f"{path}:{line}:8: error: the input nests brackets more than "
            f"{mm_opt.MAX_NESTING} levels deep").encode() in p.stderr


def test_debuginfo_names_the_input_file_without_reparsing(tmp_path):
    path = tmp_path / 'we"ird.mlir'
    path.write_text(_nested(2))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mm_opt.main([str(path), "--mlir-print-debuginfo"])
    assert code == 0, err.getvalue()
    escaped = str(path).replace('"', '\\"')
    assert f'loc("{escaped}":4:8)' in out.getvalue() and '"-":' not in out.getvalue()


def test_invalid_utf8_on_stdin_is_an_error_at_the_byte():
    text = b"module {\n  func.func @f() {\n    return // caf\xe9\n  }\n}\n"
    p = _cli(["-", "-p", "builtin.module(mm-verify)"], stdin=text)
    assert p.returncode == 1 and p.stdout == b""
    assert p.stderr.startswith(
        b"<stdin>:3:18: error: input is not valid UTF-8: byte 0xe9"), p.stderr
    assert b"internal error" not in p.stderr and b"Traceback" not in p.stderr


def test_full_pipeline_on_its_own_output_refuses(tmp_path):
    from multimesh.jax._stages.pipeline import default_pipeline

    golden = ROOT / "tests" / "goldens" / "e2_mpmd_autosharding.mlir"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(err):
        code = mm_opt.main([str(golden), "-p", default_pipeline(8)])
    assert code == 1 and out.getvalue() == ""
    msg = err.getvalue()
    assert "expects a module in front-end form or flat form, but this one is in extracted " \
           "MPMD form" in msg and "it has already been through mm-extract-fragments" in msg
    line = int(msg.split(":")[1])
    assert golden.read_text().splitlines()[line - 1].lstrip().startswith("module @"), msg


def test_zero_sized_sub_axis_in_an_mpmd_type_is_an_error_not_a_crash(tmp_path):
    """jaxlib's mpmd parser divides by a sub-axis size (SIGFPE); found by the IR fuzzer."""
    text = ('!m1 = !mpmd.mesh_tensor<"m1", tensor<8xf32>, sharding=<@mesh, [{"x":(1)0}]>>\n'
            '!m2 = !mpmd.mesh_tensor<"m2", tensor<8xf32>>\n'
            "module {\n  sdy.mesh @mesh = <[\"x\"=4]>\n"
            "  func.func public @main(%0: !m1) -> !m2 attributes {topology = #mpmd.topology<"
            '<"m1" : <["x"=4]>>, <"m2" : <["x"=2]>>>} {\n'
            "    %1 = mpmd.transfer %0 : (!m1) -> !m2\n    return %1 : !m2\n  }\n}\n")
    path = tmp_path / "sub_axis.mlir"
    path.write_text(text)
    p = _cli([str(path), "-p", "builtin.module(mm-import-mpmd{meshes=m1=0-3;m2=4-5})"])
    assert p.returncode == 1 and p.stdout == b"", (p.returncode, p.stderr)
    assert p.stderr.startswith(f"{path}:1:65: error: sub-axis sizes must be greater than 1, "
                               'got "x":(1)0;'.encode()), p.stderr
    from multimesh._src.mlir import parse_module

    with pytest.raises(ValueError, match=r"1:65: sub-axis sizes must be greater than 1"):
        parse_module(text)
