"""No test has a wall-clock limit a loaded 2-core machine can miss (issue 31, item 8).

The README's test command runs while other CPU-bound jobs keep every core busy; a
subprocess given 6 s to start Python and import jaxlib failed there at load 12. Limits
in tests exist to end real hangs, so they are generous: at least ``MIN_LIMIT_S``.
Promptness that a guarantee states (the launcher stops the others "within 10 s") is
checked with bounds that a slow machine does not reach but the old behaviour did.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_LIMIT_S = 120
_LIMIT = re.compile(r"(?:(?<![\w.])timeout=|\.wait\(|\.join\(|dump_traceback_later\()"
                    r"\s*(?:timeout=)?(\d+(?:\.\d+)?)\b")


def test_no_short_wall_clock_limits_in_tests():
    short = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "test_time_limits.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in _LIMIT.finditer(line):
                if float(m.group(1)) < MIN_LIMIT_S:
                    short.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not short, "wall-clock limits a loaded machine can miss:\n" + "\n".join(short)


def test_the_pattern_finds_limits():
    assert _LIMIT.search("subprocess.run(cmd, timeout=6)")
    assert _LIMIT.search("done.wait(60)") and _LIMIT.search("t.join(30)")
    assert not _LIMIT.search("jax.distributed.initialize(initialization_timeout=3)")
