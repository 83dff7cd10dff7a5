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


def _qualname_in_file(path: pathlib.Path, qual: str) -> bool:
    """Whether ``path`` defines ``qual`` (``f``, ``Cls`` or ``Cls.method``; a module-level
    name assigned counts too): the walk's ``file.py:name`` tokens."""
    if not path.is_file():
        return False
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in qual.split("."):
        found = None
        for node in scope:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name == part:
                    found = node
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def _problems() -> list[str]:
    defined = _defined_names()
    problems = []
    for line, token in _names(DOC.read_text()):
        token = token.split("{")[0].rstrip("(").strip()
        where = f"architecture.md:{line}: `{token}`"
        if re.fullmatch(r"[\w./-]+\.py:[A-Za-z_][\w.]*", token):
            path, qual = token.split(":", 1)
            if not _qualname_in_file(ROOT / path, qual):
                problems.append(where)
        elif "::" in token:
            path, test = token.split("::", 1)
            if not (ROOT / path).is_file() or f"def {test}" not in (ROOT / path).read_text():
                problems.append(where)
        elif re.fullmatch(r"[\w./-]+\.(py|md|mlir|toml)|[\w./-]+/", token) and not (
                re.fullmatch(r"multimesh(\.\w+)+", token)):   # `multimesh._src.mlir`: a module
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


@pytest.mark.parametrize("token", ["`multimesh/jax/_gone.py`",
                                   "`multimesh/jax/_stages/mjit.py:no_such_function`",
                                   "`multimesh/jax/_stages/compiled.py:MpmdCompiled.gone`", "`tests/test_layering.py::test_gone`",
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


def _floors() -> dict[str, set[str]]:
    """The floor table of architecture.md: package -> what it never imports."""
    rows = {}
    for _, row in _table_rows(DOC.read_text()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit() and re.fullmatch(r"`multimesh[\w.]*`", cells[1]):
            (package,) = re.findall(r"`([^`]+)`", cells[1])
            rows[package] = set(re.findall(r"`([^`]+)`", cells[2]))
    return rows


def test_the_floor_table_is_the_layering_the_tests_enforce():
    """Every package the layering test constrains has its row, with the same bans."""
    from tests.test_layering import LAYERS
    floors = _floors()
    for package, banned in LAYERS.items():
        assert floors.get(package) == set(banned), (
            f"architecture.md's floor table says {package} never imports "
            f"{sorted(floors.get(package, ()))}; tests/test_layering.py enforces "
            f"{sorted(banned)}")


def test_each_floor_keeps_to_its_row():
    """The rows the layering test does not hold (the front end under the tools) hold
    in the source too: no module of a floor imports what its row bans."""
    from tests.test_layering import MODULES, _imports
    problems = []
    for package, banned in _floors().items():
        for name, path in MODULES:
            if name == package or name.startswith(package + "."):
                problems += [f"{path.relative_to(ROOT)}:{line} imports {imported}"
                             for imported, line in _imports(path, name)
                             if any(imported == b or imported.startswith(b + ".") for b in banned)]
    assert not problems, "\n".join(problems)
