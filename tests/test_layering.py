"""The architecture's import rules, checked on the source (docs/architecture.md).

front end (multimesh.jax, multimesh.tools) -> passes (mlir_passes) -> runtime
(multimesh.runtime) -> binding surface (multimesh._src). Imports only point down, and
only ``multimesh/_src/mlir.py`` imports jaxlib's MLIR bindings.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {  # package prefix -> prefixes it must never import
    "multimesh._src": ("multimesh.jax", "multimesh.runtime", "multimesh.tools", "mlir_passes"),
    "multimesh.runtime": ("multimesh.jax", "multimesh.tools", "mlir_passes"),
    "mlir_passes": ("multimesh.jax", "multimesh.runtime", "multimesh.tools"),
}
BINDINGS = ("jaxlib.mlir", "jax._src.lib.mlir", "jax.extend.mlir")


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
