"""What installing multimesh gives (issue 31, item 6): typed, with extras for each
optional feature and lower bounds where versions matter; the docs say how it installs."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_ships_its_type_hints():
    data = _project()["tool"]["setuptools"]["package-data"]
    assert (ROOT / "multimesh" / "py.typed").is_file() and "py.typed" in data["multimesh"]
    assert set(data) == {"multimesh"}, "one marker at the top covers every subpackage (PEP 561)"


def test_extras_for_flax_pictures_and_checkpoints():
    extras = _project()["project"]["optional-dependencies"]
    assert any(re.fullmatch(r"flax>=[\d.]+", r) for r in extras["flax"]), extras["flax"]
    assert any(r.startswith("matplotlib") for r in extras["pictures"])
    assert any(r.startswith("orbax-checkpoint") for r in extras["checkpoints"])


def test_docs_install_from_a_checkout():
    """multimesh is installed from its repository: no page says ``pip install
    multimesh[...]`` as if a package index served it."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    said = [str(p.relative_to(ROOT)) for p in pages
            if re.search(r"pip install multimesh\b", p.read_text())]
    assert not said, said
