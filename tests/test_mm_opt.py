"""In-process tests of the ``mm-opt`` driver: flags, exit codes, diagnostics, output."""

from __future__ import annotations

import io
import os

import pytest

from multimesh.tools.mm_opt import main

OK = """func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = stablehlo.add %arg0, %arg0 : tensor<8xf32>
  return %0 : tensor<8xf32>
}
"""

BAD_TASK = """func.func @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  %0 = func.call @b(%arg0) {mm.task = {name = "a", transpose_count = 0 : i64, devices = [0, 1, 2], axis_names = ["x", "y"], axis_sizes = [4, 1]}} : (tensor<8xf32>) -> tensor<8xf32>
  return %0 : tensor<8xf32>
}
func.func private @b(%arg0: tensor<8xf32>) -> tensor<8xf32> {
  return %arg0 : tensor<8xf32>
}
"""

VERIFY = ["-p", "builtin.module(mm-verify)"]


def _write(tmp_path, text, name="in.mlir"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_roundtrip(tmp_path, capsys):
    assert main([_write(tmp_path, OK)]) == 0
    out = capsys.readouterr().out
    assert "stablehlo.add %arg0, %arg0" in out


def test_parse_error_has_location_and_caret(tmp_path, capsys):
    path = _write(tmp_path, "func.func @f() {\n  %0 = foo\n}\n")
    assert main([path]) == 1
    captured = capsys.readouterr()
    assert f"{path}:2:8: error: custom op 'foo' is unknown" in captured.err
    assert "  %0 = foo\n       ^" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""


def test_pass_error_points_at_op(tmp_path, capsys):
    path = _write(tmp_path, BAD_TASK)
    assert main([path, *VERIFY]) == 1
    err = capsys.readouterr().err
    assert (f"{path}:2:8: error: 'mm.task' axis_sizes [4, 1] multiply to 4 but devices "
            f"has 3 entries") in err


def test_unknown_pass_is_named(tmp_path, capsys):
    path = _write(tmp_path, OK)
    assert main([path, "-p", "builtin.module(mm-no-such-pass)"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mm-opt: error:")
    assert "mm-no-such-pass" in err


def test_unknown_native_pass_is_named(tmp_path, capsys):
    assert main([_write(tmp_path, OK), "-p", "builtin.module(not-a-pass)"]) == 1
    assert "not-a-pass" in capsys.readouterr().err


def test_bad_usage_exits_2(capsys):
    assert main(["--no-such-flag"]) == 2
    assert "usage:" in capsys.readouterr().err


def test_missing_input_file(tmp_path, capsys):
    assert main([str(tmp_path / "nope.mlir")]) == 1
    assert "could not open input file" in capsys.readouterr().err


def test_output_not_written_on_failure(tmp_path, capsys):
    out = tmp_path / "out.mlir"
    out.write_text("previous contents")
    assert main([_write(tmp_path, BAD_TASK), *VERIFY, "-o", str(out)]) == 1
    assert out.read_text() == "previous contents"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mm-opt-")] == []


def test_output_written_atomically_on_success(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out.mlir"
    out.write_text("previous contents")
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((src, dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert main([_write(tmp_path, OK), *VERIFY, "-o", str(out)]) == 0
    assert "stablehlo.add" in out.read_text()
    assert len(replaced) == 1 and replaced[0][1] == str(out)
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.mlir", "out.mlir"]


def test_split_input_file_joins_with_marker(tmp_path, capsys):
    text = "func.func @a() {\n  return\n}\n// -----\nfunc.func @b() {\n  return\n}\n"
    assert main([_write(tmp_path, text), "--split-input-file"]) == 0
    out = capsys.readouterr().out
    a, b = out.split("// -----\n")
    assert "@a" in a and "@b" in b


def test_split_input_file_keeps_original_line_numbers(tmp_path, capsys):
    text = "func.func @a() {\n  return\n}\n// -----\nfunc.func @b() {\n  %0 = foo\n}\n"
    path = _write(tmp_path, text)
    assert main([path, "--split-input-file"]) == 1
    captured = capsys.readouterr()
    assert f"{path}:6:8: error:" in captured.err
    assert "@a" in captured.out  # chunks that succeeded are still printed to stdout


def test_mlir_timing_lists_each_pass(tmp_path, capsys):
    pipeline = "builtin.module(mm-verify,canonicalize,mm-strip-markers)"
    assert main([_write(tmp_path, OK), "-p", pipeline, "--mlir-timing"]) == 0
    err = capsys.readouterr().err
    assert "Execution time report" in err
    for name in ("mm-verify", "canonicalize", "mm-strip-markers", "Total"):
        assert name in err


def test_list_passes(capsys):
    assert main(["--list-passes"]) == 0
    assert "mm-verify" in capsys.readouterr().out


def test_help_lists_passes_with_summaries(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "mm-verify" in out and "mm-strip-markers" in out
    assert "--split-input-file" in out


def test_version(capsys):
    import jaxlib.version

    import multimesh

    assert main(["--version"]) == 0
    out = capsys.readouterr().out
    assert multimesh.__version__ in out and jaxlib.version.__version__ in out


def test_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("func.func @f() {\n  %0 = foo\n}\n"))
    assert main(["-"]) == 1
    assert "<stdin>:2:8: error:" in capsys.readouterr().err
    monkeypatch.setattr("sys.stdin", io.StringIO(OK))
    assert main([]) == 0
    assert "stablehlo.add" in capsys.readouterr().out


def test_print_ir_after_all(tmp_path, capsys):
    assert main([_write(tmp_path, OK), *VERIFY, "--mlir-print-ir-after-all"]) == 0
    err = capsys.readouterr().err
    assert "// -----// IR Dump After mm-verify //----- //" in err
    assert "stablehlo.add" in err


def test_print_ir_before_all(tmp_path, capsys):
    assert main([_write(tmp_path, OK), *VERIFY, "--mlir-print-ir-before-all"]) == 0
    assert "// -----// IR Dump Before mm-verify //----- //" in capsys.readouterr().err


def test_print_debuginfo_uses_the_real_file_name(tmp_path, capsys):
    path = _write(tmp_path, OK)
    assert main([path, "--mlir-print-debuginfo"]) == 0
    assert f'loc("{path}":2:8)' in capsys.readouterr().out


def test_allow_unregistered_dialect(tmp_path, capsys):
    text = 'func.func @f() {\n  "foo.bar"() : () -> ()\n  return\n}\n'
    path = _write(tmp_path, text)
    assert main([path]) == 1
    capsys.readouterr()
    assert main([path, "--allow-unregistered-dialect"]) == 0
    assert '"foo.bar"()' in capsys.readouterr().out


@pytest.mark.parametrize("expected", [
    "expected-error@+1 {{axis_sizes [4, 1] multiply to 4 but devices has 3 entries}}",
    "expected-error-re@+1 {{axis_sizes [4, 1] multiply to {{[0-9]+}} but}}",  # a regex
], ids=["text", "regex"])
def test_verify_diagnostics_pass(tmp_path, expected):
    text = BAD_TASK.replace("  %0 = func.call", f"  // {expected}\n  %0 = func.call")
    assert main([_write(tmp_path, text), *VERIFY, "--verify-diagnostics"]) == 0


def test_verify_diagnostics_missing_and_unexpected(tmp_path, capsys):
    text = BAD_TASK.replace(
        "  %0 = func.call",
        "  // expected-error@+1 {{something else}}\n  %0 = func.call")
    path = _write(tmp_path, text)
    assert main([path, *VERIFY, "--verify-diagnostics"]) == 1
    err = capsys.readouterr().err
    assert f'{path}:2:6: error: expected error "something else" was not produced' in err
    assert f"{path}:3:8: error: unexpected error: 'mm.task' axis_sizes" in err


def test_verify_diagnostics_expected_but_nothing_happened(tmp_path, capsys):
    text = "// expected-error@+1 {{boom}}\n" + OK
    assert main([_write(tmp_path, text), *VERIFY, "--verify-diagnostics"]) == 1
    assert 'expected error "boom" was not produced' in capsys.readouterr().err




@pytest.mark.parametrize("where,offset", [("+1", 0), ("below", 0), ("above", 2), ("-1", 2)])
def test_verify_diagnostics_designators(tmp_path, capsys, where, offset):
    lines = ["func.func @f() {", "  %0 = foo", "}"]
    directive = f"  // expected-error@{where} {{{{custom op 'foo' is unknown}}}}"
    lines.insert(1 + (offset and 1), directive)
    assert main([_write(tmp_path, "\n".join(lines) + "\n"), "--verify-diagnostics"]) == 0, \
        capsys.readouterr().err


def test_internal_error_has_no_traceback(tmp_path, capsys, monkeypatch):
    from multimesh.passes import verify

    def boom(self, module):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(verify.VerifyPass, "apply", boom)
    assert main([_write(tmp_path, OK), *VERIFY]) == 1
    err = capsys.readouterr().err
    assert "mm-opt: internal error in 'mm-verify': RuntimeError: kaboom" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- mlir-opt habits
# (issue 31, item 6)

TWO_ADDS = OK.replace("  return", "  %1 = stablehlo.add %arg0, %arg0 : tensor<8xf32>\n  return")


def test_passes_as_flags_in_order(tmp_path, capsys):
    """``--<pass>[=options]`` flags, as mlir-opt takes them, make the pipeline in order."""
    path = _write(tmp_path, TWO_ADDS)
    assert main([path, "--mm-verify", "--cse", "--mm-assign-tasks=num-devices=8",
                 "--dump-pass-pipeline"]) == 0
    captured = capsys.readouterr()
    assert "stablehlo.add" in captured.out and "%1" not in captured.out  # cse ran
    assert "mm-verify" in captured.err and "mm-assign-tasks{num-devices=8}" in captured.err
    assert main([path, "--mm-verify", "-p", "builtin.module(cse)"]) == 2
    assert "either as -p PIPELINE or as --<pass> flags, not both" in capsys.readouterr().err


def test_print_ir_after_and_before_one_pass(tmp_path, capsys):
    path = _write(tmp_path, TWO_ADDS)
    assert main([path, "-p", "builtin.module(mm-verify,cse,mm-strip-markers)",
                 "--mlir-print-ir-after=cse", "--mlir-print-ir-before=mm-strip-markers"]) == 0
    err = capsys.readouterr().err
    assert err.count("// -----// IR Dump") == 2, err
    assert "IR Dump After cse //" in err and "IR Dump Before mm-strip-markers //" in err
    assert main([path, "--mm-verify", "--mlir-print-ir-after=mm-verfy"]) == 1
    assert ("--mlir-print-ir-after: 'mm-verfy' is not a registered pass. Did you mean "
            "'mm-verify'?") in capsys.readouterr().err


def test_list_passes_shows_option_types(capsys):
    assert main(["--list-passes"]) == 0
    out = capsys.readouterr().out
    assert "num-devices=<int> (default: 0)" in out
    assert "tasks=<string,...> (default: ())" in out


def test_misspelt_pass_gets_a_suggestion(tmp_path, capsys):
    path = _write(tmp_path, OK)
    assert main([path, "-p", "builtin.module(mm-asign-tasks)"]) == 1
    assert "Did you mean 'mm-assign-tasks'?" in capsys.readouterr().err
    assert main([path, "-p", "builtin.module(canonicalise)"]) == 1
    assert "Did you mean 'canonicalize'?" in capsys.readouterr().err
    assert main([path, "--mm-asign-tasks"]) == 2
    assert "Did you mean '--mm-assign-tasks'?" in capsys.readouterr().err
