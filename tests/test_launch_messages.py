"""Every line the launcher writes is documented, word for word (issue 31, item 2).

docs/multiprocess.md ("What the launcher says") lists each message with ``<...>`` for
its values. Two checks: every message the launcher's source can write (read from
``multimesh/launch.py``'s syntax tree) is in that list, and in real runs (small
programs without jax) every ``multimesh.launch:`` line matches one entry.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "multimesh.launch: "


def _documented() -> list[str]:
    """The messages and reasons of the doc's two tables (first column, unquoted)."""
    text = (ROOT / "docs" / "multiprocess.md").read_text(encoding="utf-8")
    section = text.split("### What the launcher says", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `(.+?)` \|", section, re.M)]


def _shape(template: str) -> str:
    """A message with every value (``{...}`` in code, ``<...>`` in docs) as ``<>``."""
    return re.sub(r"<[^<>]*>", "<>", re.sub(r"\{[^{}]*\}", "<>", template))


def _template(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _template(node.left) + _template(node.right)
    raise AssertionError(f"a message the test cannot read: {ast.unparse(node)}")


def _source_messages() -> tuple[list[str], list[str]]:
    """What ``launch.py`` writes (``say``, on whichever object, ``sys.stderr.write``) and
    the reasons it gives (``why = ...``, the ``failed`` records of its workers, and
    ``strand(worker, message, why)``, which says the one and records the other)."""
    tree = ast.parse((ROOT / "multimesh" / "launch.py").read_text(encoding="utf-8"))
    said, reasons = [], []
    for node in ast.walk(tree):
        func = ast.unparse(node.func) if isinstance(node, ast.Call) else ""
        writes = func == "sys.stderr.write" or func.endswith((".say", ".strand"))
        text = node.args[1 if func.endswith(".strand") else 0] if writes else None
        if writes and not isinstance(text, ast.Name):  # a Name: a message passed on
            t = _template(text)
            if t != "multimesh.launch: {}\n":  # say() itself
                said.append(t.removeprefix(PREFIX).rstrip("\n"))
            if func.endswith(".strand"):
                reasons.append(_template(node.args[2]))
        elif isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) in ("why", "w.failed"):
            value = node.value.elts[1] if isinstance(node.value, ast.Tuple) else node.value
            if not isinstance(value, (ast.IfExp, ast.Name)):  # passed on, or " (<why>)"
                reasons.append(_template(value))
    return said, reasons


def test_every_message_of_the_launcher_is_documented():
    said, reasons = _source_messages()
    assert len(said) >= 10 and len(reasons) >= 3, (said, reasons)
    documented = {_shape(d) for d in _documented()}
    missing = [m for m in said + reasons if _shape(m) not in documented]
    assert not missing, f"not in docs/multiprocess.md's tables: {missing}"


def _matches_a_documented_message(line: str) -> bool:
    for doc in _documented():
        parts = re.split(r"<[^<>]*>", doc)
        if re.fullmatch(".*?".join(re.escape(p) for p in parts), line):
            return True
    return False


def _launch(tmp_path, code: str, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "multimesh.launch", *flags, str(script)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def _said(proc) -> list[str]:
    lines = [ln[len(PREFIX):] for ln in proc.stderr.splitlines() if ln.startswith(PREFIX)]
    assert lines, proc.stderr
    unknown = [ln for ln in lines if not _matches_a_documented_message(ln)]
    assert not unknown, f"undocumented launcher lines: {unknown}\n{proc.stderr}"
    return lines


ME = "k = int(__import__('os').environ['MULTIMESH_LAUNCH_PROCESS_ID'])\nimport sys, time\n"


def test_a_failure_its_stop_and_the_cause_say_what_the_docs_say(tmp_path):
    proc = _launch(tmp_path, ME + "if k == 1:\n    time.sleep(0.3)\n    sys.exit(3)\n"
                   "time.sleep(120)\n", "-n", "2")
    assert proc.returncode == 3
    assert _said(proc) == ["process 1 failed (sys.exit(3)); stopping processes [0].",
                           "process 0 exited with code 143 (stopped by the launcher)",
                           "the cause: process 1 (sys.exit(3)), which exited with code 3; "
                           "exit code 3."]


def test_no_fail_fast_and_a_raise_say_what_the_docs_say(tmp_path):
    proc = _launch(tmp_path, ME + "if k == 1:\n    raise ValueError('bad batch\\nmore')\n",
                   "-n", "2", "--no-fail-fast")
    assert proc.returncode == 1
    lines = _said(proc)
    assert lines[0] == ("process 1 failed (ValueError: bad batch); the others run on "
                        "(--no-fail-fast).")
    assert lines[-1] == ("the cause: process 1 (ValueError: bad batch), which exited with "
                         "code 1; exit code 1.")


def test_a_timeout_and_the_grace_period_say_what_the_docs_say(tmp_path):
    start = time.monotonic()
    proc = _launch(tmp_path, ME + "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   "print('ready', flush=True)\ntime.sleep(120)\n",
                   "-n", "1", "--timeout", "3", "--grace-period", "0.5")
    assert proc.returncode == 124 and time.monotonic() - start < 120
    assert _said(proc) == ["timed out after 3 s; stopping every process.",
                           "processes [0] still run 0.5 s after SIGTERM; killing them (SIGKILL).",
                           "process 0 exited with code 137 (stopped by the launcher)"]
