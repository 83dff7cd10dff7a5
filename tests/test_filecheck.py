"""Run every ``tests/filecheck/**/*.mlir`` golden as a pytest test (lit-style RUN lines).

pytest, not lit, drives the suite in CI so that its closing summary is the one
CI reads; ``lit tests/filecheck`` runs the same files via ``lit.cfg``.
"""

from __future__ import annotations

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
    for i, raw in enumerate(cmds):
        cmd = expand(raw, path, tmp_path / f"run{i}.tmp")
        proc = subprocess.run(["bash", "-c", "set -o pipefail\n" + cmd], env=env,
                              cwd=path.parent, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.fail(
                f"RUN line {i + 1} of {path.relative_to(ROOT)} failed with exit code "
                f"{proc.returncode}\n$ {cmd}\n--- stdout ---\n{proc.stdout}"
                f"--- stderr ---\n{proc.stderr}", pytrace=False)
