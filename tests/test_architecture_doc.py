"""docs/architecture.md cannot drift: every path and name its tables point at exists.

The tables "Where to change what", "Import rules" and the folder table of
``multimesh/jax/`` are what a newcomer follows; a renamed module or test that they
still name sends the reader nowhere (issue 32, item 5).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SEARCHED = ("multimesh", "tests", "tools")


def _table_rows(text: str) -> list[tuple[int, str]]:
    """Every row of every Markdown table in the page, with its line number."""
    return [(i, line) for i, line in enumerate(text.splitlines(), 1)
            if line.startswith("|") and not re.fullmatch(r"[|\s:-]+", line)]


def _names(text: str) -> list[tuple[int, str]]:
    return [(i, tok) for i, row in _table_rows(text) for tok in re.findall(r"`([^`]+)`", row)]


def _defined_names() -> set[str]:
    """Every function, class, module-level name and attribute assigned in the library,
    the tests and the tools."""
    names: set[str] = set()
    for top in SEARCHED:
        for path in ROOT.joinpath(top).rglob("*.py"):
            names.add(path.stem)
            names.update(path.relative_to(ROOT).parts[:-1])   # folders: `_src`, `flax`
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return names


def _file_exists(token: str) -> bool:
    if (ROOT / token).exists():
        return True
    name = pathlib.PurePath(token).name   # a bare file name, in the table's folder
    return any(p.name == name or p.match(token) for top in SEARCHED
               for p in ROOT.joinpath(top).rglob(name))


def _module_or_attribute(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def _problems() -> list[str]:
    defined = _defined_names()
    problems = []
    for line, token in _names(DOC.read_text()):
        token = token.split("{")[0].rstrip("(").strip()
        where = f"architecture.md:{line}: `{token}`"
        if "::" in token:
            path, test = token.split("::", 1)
            if not (ROOT / path).is_file() or f"def {test}" not in (ROOT / path).read_text():
                problems.append(where)
        elif re.fullmatch(r"[\w./-]+\.(py|md|mlir|toml)|[\w./-]+/", token):
            if "<" not in token and not _file_exists(token):
                problems.append(where)
        elif re.fullmatch(r"multimesh(\.\w+)+", token):
            if not _module_or_attribute(token):
                problems.append(where)
        elif re.fullmatch(r"[A-Za-z_]\w*", token) and not token.isupper():
            if token not in defined and not re.fullmatch(r"[a-z]+", token):
                problems.append(where)
    return problems


def test_every_path_and_name_in_the_architecture_tables_exists():
    problems = _problems()
    assert not problems, "architecture.md names what is not there:\n" + "\n".join(problems)


@pytest.mark.parametrize("token", ["`multimesh/jax/_gone.py`", "`tests/test_layering.py::test_gone`",
                                   "`NoSuchClassAnywhere`", "`multimesh.passes.no_such_module`"])
def test_the_check_finds_a_stale_name(token, tmp_path):
    page = tmp_path / "architecture.md"
    page.write_text(f"| a | b |\n|---|---|\n| x | {token} |\n")
    global DOC
    saved, DOC = DOC, page
    try:
        assert _problems(), token
    finally:
        DOC = saved
