"""Run every ``tests/filecheck/**/*.mlir`` golden as a pytest test (lit-style RUN lines).

pytest, not lit, drives the suite in CI so that its closing summary is the one
CI reads; ``lit tests/filecheck`` runs the same files via ``lit.cfg``.

A RUN line that is a plain pipeline of ``mm-opt`` and ``filecheck`` (words, single
quotes and ``|``; ``not`` allowed) runs in this interpreter: ``mm-opt``'s ``main`` and
the ``filecheck`` package's matcher on captured streams, with ``pipefail``'s exit
code. A process costs about a second, most of it importing jax, and the per-pass
goldens have about 30 such lines. Every other line (redirections, substitutions,
``%{mm-opt}``), and every line of ``mm_opt/`` (the CLI's own goldens: the real
console script, its streams and exit codes as a shell sees them), runs in ``bash``
as lit would.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent / "filecheck"
BIN = Path(sys.executable).parent
EXCLUDED_DIRS = {"Inputs"}
_RUN_RE = re.compile(r"^\s*//\s*RUN:\s?(.*)$")
_SUBST_RE = re.compile(r"%(\{mm-opt\}|s|S|t|%)")


def _files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.mlir")
                  if not EXCLUDED_DIRS.intersection(p.relative_to(ROOT).parts))


def run_lines(path: Path) -> list[str]:
    """The RUN commands of a file; a trailing backslash continues a command."""
    cmds, cur = [], ""
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _RUN_RE.match(line)
        if not m:
            continue
        text = m.group(1).rstrip()
        if text.endswith("\\"):
            cur += text[:-1] + " "
            continue
        cmds.append((cur + text).strip())
        cur = ""
    if cur:
        cmds.append(cur.strip())
    return cmds


def _mm_opt() -> str:
    exe = BIN / "mm-opt"
    if exe.exists():
        return shlex.quote(str(exe))
    return f"{shlex.quote(sys.executable)} -m multimesh.tools.mm_opt"


def expand(cmd: str, path: Path, tmp: Path) -> str:
    values = {
        "{mm-opt}": _mm_opt(),
        "s": shlex.quote(str(path)),
        "S": shlex.quote(str(path.parent)),
        "t": shlex.quote(str(tmp)),
        "%": "%",
    }
    return _SUBST_RE.sub(lambda m: values[m.group(1)], cmd)


FILES = _files()
# goldens of the mm-opt CLI itself: always through the real console script
SUBPROCESS_ONLY = {"mm_opt"}
_TOOLS = {"mm-opt", "filecheck"}
# outside single quotes, anything but words and `|` is left to bash
_SHELL_META = re.compile(r"[^\w\s|/.,=+:@%-]")


def plain_pipeline(cmd: str) -> list[list[str]] | None:
    """``cmd`` (expanded) as the argv of each stage, when it is a pipeline of mm-opt and
    filecheck that this interpreter can run (each optionally under ``not``); else None."""
    unquoted = re.sub(r"'[^']*'", "", cmd)
    if _SHELL_META.search(unquoted):
        return None
    lexer = shlex.shlex(cmd, posix=True, punctuation_chars="|")
    lexer.whitespace_split = True
    tokens = list(lexer)
    if tokens.count("|") != unquoted.count("|"):  # a quoted '|' word, or `||`
        return None
    stages: list[list[str]] = [[]]
    for token in tokens:
        if token == "|":
            stages.append([])
        else:
            stages[-1].append(token)
    for argv in stages:
        tool = argv[1:2] if argv[:1] == ["not"] else argv[:1]
        if not tool or tool[0] not in _TOOLS:
            return None
    return stages


def _stream(data: bytes = b"") -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline="", write_through=True)


def _run_tool(argv: list[str]) -> int:
    """One stage on the current ``sys.std*``: its exit code (argparse's exit on a bad
    flag included, as the console script would give it)."""
    try:
        if argv[0] == "mm-opt":
            from multimesh.tools.mm_opt import main  # fresh MLIR context per call
            return main(argv[1:])
        from filecheck.matcher import Matcher
        from filecheck.options import parse_argv_options
        try:
            return Matcher.from_opts(parse_argv_options(list(argv))).run()
        except Exception as e:  # what the console script would die of: a traceback, code 1
            sys.stderr.write(f"filecheck: {type(e).__name__}: {e}\n")
            return 1
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def run_in_process(stages: list[list[str]]) -> tuple[int, str, str]:
    """Run a :func:`plain_pipeline` here: the exit code under ``pipefail``, the last
    stage's stdout and every stage's stderr."""
    data, err, code = b"", [], 0
    for argv in stages:
        negate = argv[0] == "not"
        stdin, stdout, stderr = _stream(data), _stream(), _stream()
        saved = sys.stdin
        sys.stdin = stdin
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                rc = _run_tool(argv[1:] if negate else argv)
        finally:
            sys.stdin = saved
        if negate:
            rc = int(rc == 0)
        code = rc or code
        data = stdout.buffer.getvalue()
        err.append(stderr.buffer.getvalue().decode("utf-8", "replace"))
    return code, data.decode("utf-8", "replace"), "".join(err)


@pytest.fixture(scope="session")
def mm_opt_dir(tmp_path_factory) -> Path:
    """A directory whose ``mm-opt`` is this interpreter running this checkout's mm-opt,
    whether or not the environment installed the console script (or installed another
    checkout's)."""
    d = tmp_path_factory.mktemp("bin")
    script = d / "mm-opt"
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m multimesh.tools.mm_opt "$@"\n')
    script.chmod(0o755)
    return d


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_filecheck(path: Path, tmp_path: Path, mm_opt_dir: Path):
    cmds = run_lines(path)
    assert cmds, f"{path} has no '// RUN:' line"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(mm_opt_dir), str(BIN), env.get("PATH", "")])
    in_process = not SUBPROCESS_ONLY.intersection(path.relative_to(ROOT).parts)
    for i, raw in enumerate(cmds):
        cmd = expand(raw, path, tmp_path / f"run{i}.tmp")
        stages = plain_pipeline(cmd) if in_process and "%{" not in raw else None
        if stages is not None:
            with contextlib.chdir(path.parent):
                code, out, err = run_in_process(stages)
        else:
            proc = subprocess.run(["bash", "-c", "set -o pipefail\n" + cmd], env=env,
                                  cwd=path.parent, capture_output=True, text=True, timeout=600)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        if code != 0:
            pytest.fail(
                f"RUN line {i + 1} of {path.relative_to(ROOT)} failed with exit code "
                f"{code}{' (in process)' if stages else ''}\n$ {cmd}\n--- stdout ---\n{out}"
                f"--- stderr ---\n{err}", pytrace=False)


def test_only_plain_pipelines_run_in_process():
    """What the in-process runner takes, and that it answers as bash with pipefail would:
    exit codes of either stage, ``not``, stdin between stages; anything else goes to bash."""
    assert plain_pipeline("mm-opt a.mlir -p 'builtin.module(x{a=1;b=2})' | filecheck a.mlir "
                          "--check-prefix=X") == [
        ["mm-opt", "a.mlir", "-p", "builtin.module(x{a=1;b=2})"],
        ["filecheck", "a.mlir", "--check-prefix=X"]]
    for cmd in ["mm-opt a.mlir 2>&1 | filecheck a.mlir", "mm-opt a.mlir > out",
                "mm-opt $X", "mm-opt a.mlir | grep x", "mm-opt a.mlir || true",
                "mm-opt a.mlir; filecheck a.mlir", "mm-opt '|' a.mlir", "cat a.mlir"]:
        assert plain_pipeline(cmd) is None, cmd
    golden = str(ROOT / "verify.mlir")
    with contextlib.chdir(ROOT):
        assert run_in_process([["mm-opt", golden, "--split-input-file"],
                               ["mm-opt", "--split-input-file"]])[0] == 0
        code, out, err = run_in_process([["mm-opt", "nope.mlir"], ["filecheck", golden]])
        assert code == 1 and "could not open input file" in err, err
        code, _, err = run_in_process([["mm-opt", golden, "--split-input-file"],
                                       ["filecheck", golden, "--check-prefix=NOPE"]])
        assert code == 2 and "No check strings found with prefix NOPE" in err, err
        code, _, _ = run_in_process([["mm-opt", golden, "--split-input-file"],
                                     ["not", "filecheck", golden, "--check-prefix=NOPE"]])
        assert code == 0
