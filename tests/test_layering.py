"""The architecture's import rules, checked on the source (docs/architecture.md).

front end (multimesh.jax, multimesh.tools) -> passes (multimesh.passes) -> runtime
(multimesh.runtime) -> binding surface (multimesh._src). The schedule library
(multimesh.schedules) sits beside the runtime, below the front end and the passes:
it imports only multimesh._src and never the MLIR bindings. Imports only point down,
only ``multimesh/_src/mlir.py`` imports jaxlib's MLIR bindings, and only
``multimesh/_src/jax_compat.py`` touches jax's internals (``jax._src``, ``jaxlib._*``).
Within a layer too, no two library modules import each other, directly or around a
cycle, function-local imports included (``import_graph``).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {  # package prefix -> prefixes it must never import
    "multimesh._src": ("multimesh.jax", "multimesh.runtime", "multimesh.tools", "multimesh.passes",
                       "multimesh.schedules"),
    "multimesh.schedules": ("multimesh.jax", "multimesh.runtime", "multimesh.tools",
                            "multimesh.passes", "multimesh._src.mlir", "multimesh._src.jax_compat",
                            "jax", "jaxlib"),
    "multimesh.runtime": ("multimesh.jax", "multimesh.tools", "multimesh.passes",
                          "multimesh.schedules"),
    "multimesh.passes": ("multimesh.jax", "multimesh.runtime", "multimesh.tools"),
}
BINDINGS = ("jaxlib.mlir", "jax._src.lib.mlir", "jax.extend.mlir")
COMPAT = "multimesh._src.jax_compat"
INTERNALS = re.compile(r"^(jax\._src|jaxlib\._)")


def _modules():
    for path in sorted(ROOT.joinpath("multimesh").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(p for p in rel.parts if p != "__init__"), path


def _imports(path: pathlib.Path, name: str = ""):
    """Absolute names of what ``path`` (module ``name``) imports; relative imports resolved."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - node.level + 1]
            yield ".".join([*base, *([node.module] if node.module else [])]), node.lineno


MODULES = list(_modules())


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(name, path):
    for layer, banned in LAYERS.items():
        if name == layer or name.startswith(layer + "."):
            for imported, line in _imports(path, name):
                assert not imported.startswith(banned), (
                    f"{path.relative_to(ROOT)}:{line} imports {imported}, which is above "
                    f"{layer} in the layering")


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_only_the_binding_surface_imports_mlir(name, path):
    if name == "multimesh._src.mlir":
        return
    for imported, line in _imports(path):
        assert not imported.startswith(BINDINGS), (
            f"{path.relative_to(ROOT)}:{line} imports {imported}; use multimesh._src.mlir")


def _python_files():
    for top in ("multimesh", "tools", "tests", "examples"):
        for path in sorted(ROOT.joinpath(top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                yield path
    yield ROOT / "conftest.py"


PY_FILES = list(_python_files())


@pytest.mark.parametrize("path", PY_FILES, ids=[str(p.relative_to(ROOT)) for p in PY_FILES])
def test_only_the_compat_module_imports_jax_internals(path):
    if path == ROOT / "multimesh" / "_src" / "jax_compat.py":
        return
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in ("jax", "jaxlib")):
            names = [f"{node.value.id}.{node.attr}"]  # jax._src.core without an import
        for name in names:
            assert not INTERNALS.match(name), (
                f"{path.relative_to(ROOT)}:{node.lineno} uses {name}; jax's internals go "
                f"through {COMPAT} (add a shim there, or use a public jax name)")


def test_no_other_library_file_mentions_jax_internals():
    r"""The acceptance check of issue 15, as written: ``grep -rn "jax._src\|jaxlib\._"
    multimesh`` finds the compat module only (docstrings included, so no
    other module even describes an internal as something to reach for)."""
    pattern = re.compile(r"jax._src|jaxlib\._")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in PY_FILES
            if p.parts[len(ROOT.parts)] == "multimesh"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert {h.split(":")[0] for h in hits} <= {"multimesh/_src/jax_compat.py"}, hits


def test_the_passes_are_an_ordinary_subpackage():
    """``multimesh/passes/`` is a plain folder of the package: no import finder, no
    folder mapped onto another name, so tools and mypy see the front end's door into it."""
    import sys

    import multimesh.passes

    assert pathlib.Path(multimesh.passes.__file__).resolve() == (
        ROOT / "multimesh" / "passes" / "__init__.py")
    assert not ROOT.joinpath("mlir_passes").exists()
    finders = [f for f in sys.meta_path if type(f).__module__.startswith("multimesh")]
    assert not finders, finders


def import_graph(modules) -> dict[str, dict[str, tuple[pathlib.Path, int]]]:
    """Module -> {library module it imports: (file, line)}, over ``modules`` (name, path).

    Every import statement counts, at any depth of the code: function-local imports
    and ``if TYPE_CHECKING:`` ones too (a dependency hidden in a function body is still
    a dependency). Relative imports are resolved. ``import a.b.c`` is an edge to
    ``a.b.c``; ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else
    to ``a.b`` (a name defined by the package's ``__init__``). A package's ``__init__``
    importing its submodules is an edge like any other, so a submodule that imports its
    own package (``import multimesh.jax as mm`` under ``multimesh/jax/``) closes a cycle.
    Not counted: the parent packages Python initialises before a submodule
    (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first); with them every
    package that re-exports its submodules would be a cycle (docs/architecture.md).
    """
    modules = dict(modules)
    graph: dict[str, dict[str, tuple[pathlib.Path, int]]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package[:len(package) - node.level + 1],
                                     *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, (path, node.lineno))
    return graph


def import_cycles(graph) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph, group: set[str]) -> list[str]:
    """A shortest cycle through the first module of ``group`` (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return [*paths[v], start]
                if w in group and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover


def _describe(graph, cycle: list[str]) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        path, line = graph[a][b]
        steps.append(f"{a} -> {b} ({path.relative_to(ROOT)}:{line})")
    return "import cycle: " + "; ".join(steps)


def test_no_import_cycle_in_the_library():
    """The library's modules (multimesh/ and multimesh/passes/) import each other in one
    direction only: no mutual imports, not even hidden in function bodies."""
    graph = import_graph(MODULES)
    assert {"multimesh.runtime.executor", "multimesh.jax._stages.mjit"} <= set(graph)
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)


def test_the_cycle_check_finds_a_hidden_cycle(tmp_path):
    """The check itself: a mutual import hidden in a function body (and written
    relatively), and a submodule that imports its own package, are each found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {
        "__init__.py": "from pkg.a import f\nfrom pkg import d\n",
        "a.py": "def f():\n    from pkg import b\n    return b\n",
        "b.py": "from .a import f\n",
        "c.py": "import pkg\n",
        "d.py": "from pkg import c\n",
        "e.py": "import pkg.a\n",  # imports a; pkg/__init__ runs first, not counted
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules = [("pkg" if n == "__init__.py" else f"pkg.{n[:-3]}", pkg / n) for n in files]
    graph = import_graph(modules)
    assert graph["pkg.a"] == {"pkg.b": (pkg / "a.py", 2)}
    assert set(graph["pkg"]) == {"pkg.a", "pkg.d"} and set(graph["pkg.e"]) == {"pkg.a"}
    assert sorted(import_cycles(graph)) == [["pkg", "pkg.d", "pkg.c", "pkg"],
                                            ["pkg.a", "pkg.b", "pkg.a"]]


DOOR = "multimesh.passes.api"


@pytest.mark.parametrize("name,path", [m for m in MODULES if m[0].startswith("multimesh.jax")],
                         ids=[m for m, _ in MODULES if m.startswith("multimesh.jax")])
def test_the_front_end_enters_the_passes_by_their_door(name, path):
    """``multimesh.jax`` imports the pass layer only through ``multimesh.passes.api``
    (typed :class:`PipelineOptions` in, passes out), at any depth of its code."""
    for imported, line in _imports(path, name):
        if imported == "multimesh.passes" or imported.startswith("multimesh.passes."):
            assert imported == DOOR, (
                f"{path.relative_to(ROOT)}:{line} imports {imported}; the front end uses "
                f"{DOOR} (add what it needs there)")


def test_the_front_end_is_grouped_in_wings():
    """``multimesh/jax/`` keeps at most 20 modules at its top level; the rest live in
    folders by role (``_stages``, ``_analysis``, ``_planner``, ``flax``), so a newcomer
    knows the room from the folder (docs/architecture.md, "Layers")."""
    top = sorted(p.name for p in ROOT.joinpath("multimesh", "jax").glob("*.py"))
    assert len(top) <= 20, top
    wings = {p.name for p in ROOT.joinpath("multimesh", "jax").iterdir()
             if p.is_dir() and (p / "__init__.py").is_file()}
    assert {"_stages", "_analysis", "_planner", "flax"} <= wings, wings


WING = "multimesh.jax.flax"
ROOT_PACKAGE = "multimesh.jax"  # the composition root: it alone wires the wing's handler


def wing_imports(path: pathlib.Path, name: str) -> list[tuple[str, int]]:
    """What ``path`` imports of the flax wing, at any depth of its code: ``import``
    statements (``from multimesh.jax import flax`` too) and ``importlib.import_module``
    or ``__import__`` calls naming it."""
    found = [(m, line) for m, line in _imports(path, name)
             if m == WING or m.startswith(WING + ".")]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "multimesh.jax" and \
                any(a.name == "flax" for a in node.names):
            found.append((WING, node.lineno))
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and \
                node.args[0].value.startswith(WING) and \
                getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__"):
            found.append((node.args[0].value, node.lineno))
    return found


@pytest.mark.parametrize(
    "name,path", [m for m in MODULES if m[0].startswith("multimesh.jax")
                  and not m[0].startswith(WING) and m[0] != ROOT_PACKAGE],
    ids=[m for m, _ in MODULES if m.startswith("multimesh.jax")
         and not m.startswith(WING) and m != ROOT_PACKAGE])
def test_no_module_imports_up_into_the_flax_wing(name, path):
    """``multimesh.jax`` reaches the flax wing only through the argument handlers
    (``_stages/handlers.py``), which ``multimesh/jax/__init__.py`` wires: no other
    module names the wing, function-local imports included (docs/architecture.md)."""
    hits = wing_imports(path, name)
    assert not hits, [f"{path.relative_to(ROOT)}:{line} imports {m}" for m, line in hits]


def test_the_wing_import_check_finds_hidden_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("import importlib\n\ndef f():\n    from multimesh.jax.flax import _nnx\n"
                    "    from multimesh.jax import flax\n"
                    "    return importlib.import_module('multimesh.jax.flax._nnx')\n")
    assert [line for _, line in wing_imports(path, "multimesh.jax.mod")] == [4, 5, 6]


def _program_members() -> set[str]:
    """The part of an ``mjit`` function made for argument handlers."""
    tree = ast.parse((ROOT / "multimesh/jax/_stages/handlers.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MjitProgram")
    return {n.target.id if isinstance(n, ast.AnnAssign) else n.name for n in cls.body
            if isinstance(n, ast.FunctionDef) or
            (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))}


@pytest.mark.parametrize("name,path", [m for m in MODULES if m[0].startswith(WING)],
                         ids=[m for m, _ in MODULES if m.startswith(WING)])
def test_the_flax_wing_uses_only_the_handler_api_of_mjit(name, path):
    """The flax wing sees an ``mjit`` function (``owner``, as the handlers hand it)
    only through ``handlers.MjitProgram``: nothing private (no ``owner._cache``)."""
    allowed = _program_members()
    assert {"fun", "trace_flat", "compiled_for", "options"} <= allowed
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if (isinstance(value, ast.Name) and value.id == "owner") or \
                (isinstance(value, ast.Attribute) and value.attr == "owner"):
            assert node.attr in allowed, (
                f"{path.relative_to(ROOT)}:{node.lineno} reads `owner.{node.attr}` of an "
                f"`mjit` function; the flax wing uses only handlers.MjitProgram "
                f"({sorted(allowed)})")
