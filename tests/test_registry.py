"""The pass registry is consistent: names, summaries, golden tests and generated docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from multimesh.passes import get_all_passes, pass_module_name
from multimesh.passes.base import ModulePass
from tests.tools import load_tool

ROOT = Path(__file__).resolve().parent.parent
FILECHECK = ROOT / "tests" / "filecheck"
PASSES = get_all_passes()


def _gen_doc_module():
    return load_tool("gen_passes_doc")


@pytest.mark.parametrize("argument", sorted(PASSES))
def test_pass_metadata(argument):
    cls = PASSES[argument]()
    assert issubclass(cls, ModulePass)
    assert cls.argument == argument
    assert argument.startswith("mm-")
    assert cls.summary.strip() and cls.summary.rstrip().endswith("."), cls.summary
    assert (cls.__doc__ or "").strip(), f"{cls.__name__} needs a docstring (docs/passes.md)"


@pytest.mark.parametrize("argument", sorted(PASSES))
def test_pass_has_golden_test(argument):
    golden = FILECHECK / f"{pass_module_name(argument)}.mlir"
    assert golden.exists(), f"missing golden test {golden.relative_to(ROOT)}"
    assert argument in golden.read_text(encoding="utf-8"), \
        f"{golden.relative_to(ROOT)} never runs '{argument}'"


def test_passes_doc_up_to_date():
    text, missing = _gen_doc_module().render()
    assert not missing, f"passes that cannot be imported: {missing}"
    current = (ROOT / "docs" / "passes.md").read_text(encoding="utf-8")
    assert current == text, "docs/passes.md is stale: run `python tools/gen_passes_doc.py`"
