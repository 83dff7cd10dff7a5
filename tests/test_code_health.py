"""Size limits the linters do not cover: no library function over 80 lines.

ruff's C901 (pyproject.toml, max-complexity 10 as in xDSL) bounds branching; this bounds
length, so a multi-phase function gets split by phase rather than grow (issue 15).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAX_LINES = 80
LIBRARY = sorted(p for top in ("multimesh", "mlir_passes") for p in ROOT.joinpath(top).rglob("*.py")
                 if "__pycache__" not in p.parts)


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


@pytest.mark.parametrize("path", LIBRARY, ids=[str(p.relative_to(ROOT)) for p in LIBRARY])
def test_no_library_function_is_over_80_lines(path):
    too_long = [f"{path.relative_to(ROOT)}:{f.lineno} {f.name} ({f.end_lineno - f.lineno + 1} lines)"
                for f in _functions(ast.parse(path.read_text()))
                if f.end_lineno - f.lineno + 1 > MAX_LINES]
    assert not too_long, f"split these by phase (at most {MAX_LINES} lines each): {too_long}"
