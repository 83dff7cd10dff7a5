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
import functools
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


# --------------------------------------------------------------------------- folders

def folder_graph(graph, modules, package: str) -> dict[str, dict[str, tuple[pathlib.Path, int]]]:
    """The import graph among ``package``'s folder-level parts: its ``__init__`` (the
    composition root, named ``package``) and each of its direct children, a module or a
    whole sub-folder (``multimesh.jax._stages`` stands for every module under it). A part
    imports another when any module in it imports any module in the other, at any depth
    of its code (``import_graph``: function-local imports count)."""
    is_package = {name: path.name == "__init__.py" for name, path in modules}

    def part(module: str) -> str | None:
        if module == package:
            return package
        if not module.startswith(package + "."):
            return None
        return f"{package}.{module[len(package) + 1:].split('.')[0]}"

    parts: dict[str, dict[str, tuple[pathlib.Path, int]]] = {}
    for a, edges in graph.items():
        pa = part(a)
        if pa is None or (pa == package and not is_package.get(a, False)):
            continue
        node = parts.setdefault(pa, {})
        for b, where in sorted(edges.items()):
            pb = part(b)
            if pb is not None and pb != pa:
                node.setdefault(pb, where)
                parts.setdefault(pb, {})
    return parts


PACKAGES = [name for name, path in MODULES if path.name == "__init__.py"]


@functools.cache
def _library_graph():
    return import_graph(MODULES)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_folder_level_import_loop(package):
    """Within each folder, its parts (the ``__init__``, each module, each sub-folder as a
    whole) import each other one way only, function-local imports included: a folder
    that imports a sibling folder is never imported back by it, and nothing under a
    package imports the package's own ``__init__`` (the composition root wires them)."""
    graph = folder_graph(_library_graph(), MODULES, package)
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)


def test_the_folder_check_finds_a_loop_between_folders(tmp_path):
    """Two sibling folders whose modules import each other (no two modules a cycle), and
    a sub-folder that imports its package's ``__init__`` which imports the sub-folder
    (the composition root, through other modules), are loops; a one-way import is not."""
    files = {
        "pkg/__init__.py": "def handler():\n    from pkg.d.w import H\n",
        "pkg/a/__init__.py": "",
        "pkg/a/x.py": "from pkg.b.y import f\n",
        "pkg/a/z.py": "",
        "pkg/b/__init__.py": "",
        "pkg/b/y.py": "def f():\n    from pkg.a import z\n",
        "pkg/c.py": "from pkg.a import x\n",
        "pkg/d/__init__.py": "from pkg import handler\n",
        "pkg/d/w.py": "H = 1\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    modules = []
    for rel in files:
        parts = pathlib.Path(rel).with_suffix("").parts
        modules.append((".".join(p for p in parts if p != "__init__"), tmp_path / rel))
    graph = import_graph(modules)
    assert not import_cycles(graph)  # no two modules import each other
    folders = folder_graph(graph, modules, "pkg")
    assert set(folders["pkg.c"]) == {"pkg.a"}
    assert sorted(import_cycles(folders)) == [["pkg", "pkg.d", "pkg"],
                                              ["pkg.a", "pkg.b", "pkg.a"]]
    assert folder_graph(graph, modules, "pkg.a") == {"pkg.a": {}} or \
        not import_cycles(folder_graph(graph, modules, "pkg.a"))


# --------------------------------------------------------------------------- local imports

LOCAL_IMPORT_CAP = 20
def local_imports(path: pathlib.Path) -> list[tuple[int, bool]]:
    """``(line, explained)`` for each import statement inside a function of ``path``;
    explained: a ``# local: why`` comment on its line or on the line above it (above
    the run of import lines it belongs to)."""
    lines = ["", *path.read_text().splitlines()]
    found: dict[int, bool] = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    above = node.lineno - 1
                    while lines[above].strip().startswith(("import ", "from ")):
                        above -= 1
                    found[node.lineno] = "# local:" in lines[node.lineno] + lines[above]
    return sorted(found.items())


LIBRARY = [p for _, p in MODULES]


def test_function_local_imports_are_few():
    """Imports sit at the top of their module, where a reader (and the folder check)
    sees them; at most 20 are deferred into a function, each for a reason it names."""
    counts = {str(p.relative_to(ROOT)): len(local_imports(p)) for p in LIBRARY}
    total = sum(counts.values())
    assert total <= LOCAL_IMPORT_CAP, {f: n for f, n in sorted(counts.items()) if n}


@pytest.mark.parametrize("path", LIBRARY, ids=[str(p.relative_to(ROOT)) for p in LIBRARY])
def test_a_function_local_import_says_why(path):
    """Each import left inside a function carries ``# local: why`` (an optional
    dependency, a light package kept light, a process that must not load jax)."""
    rel = str(path.relative_to(ROOT))
    silent = [line for line, explained in local_imports(path) if not explained]
    assert not silent, f"{rel}: function-local imports without `# local: why` at lines {silent}"


def test_the_local_import_count_sees_nested_functions(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    import re\n\n    def g():\n"
                    "        # local: optional\n        import json\n        import csv\n"
                    "        x = 1\n        import io\n    return g\n")
    assert local_imports(path) == [(4, False), (8, True), (9, True), (11, False)]


# --------------------------------------------------------------------------- private attributes

NOT_JAX = {  # private names of other libraries that multimesh reads, and whose
    "_exit": "os._exit: leave a process without its exit handlers",
    "_getframe": "sys._getframe: the caller's frame, for a warning's stack level",
    "_option_string_actions": "argparse: the flags a parser knows",
    "_pytree__is_pytree": "flax.nnx: whether a module class is a pytree",
}
_ACCESSORS = ("getattr", "hasattr")


def _owned_private_names(paths) -> set[str]:
    """Every ``_name`` multimesh itself defines: functions, classes, assigned names and
    attributes, parameters, imported names, ``setattr``'s and class-namespace keys."""
    owned: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                owned.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                owned.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                owned.add(node.attr)
            elif isinstance(node, ast.arg):
                owned.add(node.arg)
            elif isinstance(node, ast.alias):
                owned.add((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.Dict):
                owned.update(k.value for k in node.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                owned.add(node.args[1].value)
    return {n for n in owned if isinstance(n, str) and n.startswith("_")}


def private_reads(path: pathlib.Path) -> list[tuple[int, str, str]]:
    """``(line, name, of what)`` for each read of a private attribute (``x._name``,
    ``getattr(x, "_name", ...)``, ``hasattr``) on anything but ``self``/``cls``;
    dunder names are Python's, not private."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name, value = node.attr, node.value
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in _ACCESSORS \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            name, value = node.args[1].value, node.args[0]
        else:
            continue
        if not name.startswith("_") or name.startswith("__") or \
                (isinstance(value, ast.Name) and value.id in ("self", "cls")):
            continue
        found.append((node.lineno, name, ast.unparse(value)))
    return found


def test_private_jax_attributes_are_read_in_the_compat_module_only():
    """A private attribute multimesh does not define itself is jax's (or a library's
    named in ``NOT_JAX``): read only in ``multimesh/_src/jax_compat.py``, one named shim
    each (``is_committed``, ``device_assignment``, ``key_impl``, ...), so a jax upgrade
    that renames one is a change to that file."""
    compat = ROOT / "multimesh" / "_src" / "jax_compat.py"
    library = [p for p in LIBRARY if p != compat]
    owned = _owned_private_names(library)
    hits = [f"{p.relative_to(ROOT)}:{line} reads {of}.{name}"
            for p in library for line, name, of in private_reads(p)
            if name not in owned and name not in NOT_JAX]
    assert not hits, (f"private jax attributes read outside {COMPAT} (add a shim there): "
                      f"{hits}")


def test_the_private_read_check_sees_getattr_and_attributes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(x, s, self):\n    a = getattr(x, '_committed', False)\n"
                    "    b = s._device_assignment\n    c = self._own\n    d = x.__class__\n"
                    "    return hasattr(x, 'public')\n")
    assert private_reads(path) == [(2, "_committed", "x"), (3, "_device_assignment", "s")]
    assert "_own" not in _owned_private_names([path])
    assert {"_own", "_key"} <= _owned_private_names([path]) | _owned_private_names(
        [_write(tmp_path / "n.py", "class A:\n    _own = 1\n\nD = {'_key': 1}\n")])


def _write(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    return path
