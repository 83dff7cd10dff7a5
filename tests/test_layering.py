"""The architecture's import rules, checked on the source (docs/architecture.md).

front end (multimesh.jax, multimesh.tools) -> passes (multimesh.passes, folder
mlir_passes/) -> runtime
(multimesh.runtime) -> binding surface (multimesh._src). The schedule library
(multimesh.schedules) sits beside the runtime, below the front end and the passes:
it imports only multimesh._src and never the MLIR bindings. Imports only point down,
only ``multimesh/_src/mlir.py`` imports jaxlib's MLIR bindings, and only
``multimesh/_src/jax_compat.py`` touches jax's internals (``jax._src``, ``jaxlib._*``).
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
    for path in sorted([*ROOT.joinpath("multimesh").rglob("*.py"),
                        *ROOT.joinpath("mlir_passes").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = ["multimesh", "passes", *rel.parts[1:]] if rel.parts[0] == "mlir_passes" else rel.parts
        yield ".".join(p for p in parts if p != "__init__"), path


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
    for top in ("multimesh", "mlir_passes", "tools", "tests", "examples"):
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
    multimesh mlir_passes`` finds the compat module only (docstrings included, so no
    other module even describes an internal as something to reach for)."""
    pattern = re.compile(r"jax._src|jaxlib\._")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in PY_FILES
            if p.parts[len(ROOT.parts)] in ("multimesh", "mlir_passes")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert {h.split(":")[0] for h in hits} <= {"multimesh/_src/jax_compat.py"}, hits


@pytest.mark.parametrize("path", PY_FILES, ids=[str(p.relative_to(ROOT)) for p in PY_FILES])
def test_the_passes_are_imported_under_the_projects_namespace(path):
    """``mlir_passes/`` is a folder, installed as ``multimesh.passes``; importing it as a
    top-level ``mlir_passes`` would load every pass twice (two registries)."""
    for imported, line in _imports(path):
        assert imported.split(".")[0] != "mlir_passes", (
            f"{path.relative_to(ROOT)}:{line} imports {imported}; import multimesh.passes")


def test_the_pass_package_is_the_mlir_passes_folder():
    import multimesh.passes

    assert pathlib.Path(multimesh.passes.__file__).resolve() == ROOT / "mlir_passes" / "__init__.py"


def _runtime_graph() -> dict[str, set[str]]:
    """Module -> the ``multimesh.runtime`` modules it imports, at any depth of its code
    (function-local imports too); ``from pkg import sub`` counts as importing ``pkg.sub``."""
    names = {m for m, _ in MODULES if m.startswith("multimesh.runtime.")}
    graph: dict[str, set[str]] = {}
    for name, path in MODULES:
        if name not in names:
            continue
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                subs = {f"{node.module}.{a.name}" for a in node.names} & names
                edges.update(subs or ({node.module} & names))
    return graph


def test_no_import_cycle_in_the_runtime():
    """The runtime's modules import each other in one direction only (no mutual imports
    hidden in function bodies): steps <- distributed <- executor, for instance."""
    graph = _runtime_graph()
    assert {"multimesh.runtime.executor", "multimesh.runtime.steps"} <= set(graph)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            assert state.get(n) != 1, f"import cycle: {' -> '.join([*path, m, n])}"
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


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
