"""The architecture's import rules, checked on the source (docs/architecture.md).

front end (multimesh.jax, multimesh.tools) -> passes (mlir_passes) -> runtime
(multimesh.runtime) -> binding surface (multimesh._src). Imports only point down,
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
    "multimesh._src": ("multimesh.jax", "multimesh.runtime", "multimesh.tools", "mlir_passes"),
    "multimesh.runtime": ("multimesh.jax", "multimesh.tools", "mlir_passes"),
    "mlir_passes": ("multimesh.jax", "multimesh.runtime", "multimesh.tools"),
}
BINDINGS = ("jaxlib.mlir", "jax._src.lib.mlir", "jax.extend.mlir")
COMPAT = "multimesh._src.jax_compat"
INTERNALS = re.compile(r"^(jax\._src|jaxlib\._)")


def _modules():
    for path in sorted([*ROOT.joinpath("multimesh").rglob("*.py"),
                        *ROOT.joinpath("mlir_passes").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(p for p in rel.parts if p != "__init__"), path


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno


MODULES = list(_modules())


@pytest.mark.parametrize("name,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_point_down(name, path):
    for layer, banned in LAYERS.items():
        if name == layer or name.startswith(layer + "."):
            for imported, line in _imports(path):
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
