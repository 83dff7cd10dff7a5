"""The conformance matrix (issue 37, item 11), its page checked against this run.

Every cell of ``tests/conformance.py`` (model x placement x schedule) runs its training
step and checks values and gradients against ``jax.jit`` (rtol 1e-5), every gradient's
devices and partition spec against ``jax.jit``'s, and per-device flops (at most 1.1x
``jax.jit``'s on one stage's devices). A cell known to fail is an ``xfail(strict=True)``
with its reason, so the page's ✗ goes stale when it starts passing. The last test checks
that ``docs/conformance.md`` (``tools/gen_conformance_doc.py``) shows the flops ratios
this run measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import conformance

ROOT = Path(__file__).resolve().parent.parent
MEASURED: dict[tuple[str, str, str], float] = {}


def _cells():
    for cell in conformance.CELLS:
        marks = ()
        if cell in conformance.KNOWN:
            marks = (pytest.mark.xfail(strict=True, reason=conformance.KNOWN[cell]),)
        yield pytest.param(*cell, marks=marks, id="-".join(cell))


@pytest.mark.parametrize(("model", "placement", "schedule"), list(_cells()))
def test_cell(model, placement, schedule):
    MEASURED[model, placement, schedule] = conformance.run_cell(model, placement, schedule)


def test_the_page_shows_this_runs_matrix():
    """Runs last (pytest keeps the file's order): the page is what :func:`render` makes
    of the flops ratios the cells above measured."""
    wanted = [c for c in conformance.CELLS if c not in conformance.KNOWN]
    missing = [c for c in wanted if c not in MEASURED]
    if missing:
        pytest.skip(f"{len(missing)} of {len(wanted)} passing cells did not run in this session "
                    f"(deselected or failed), so the page cannot be compared: {missing[:3]}")
    page = (ROOT / "docs" / "conformance.md").read_text(encoding="utf-8")
    assert page == conformance.render(MEASURED), (
        "docs/conformance.md is stale: run `python tools/gen_conformance_doc.py`")


def test_the_page_is_linked():
    """The stage-sharding tutorial and the README's feature list point to the page."""
    for doc in ("README.md", "docs/tutorials/stage-sharding.md"):
        assert "conformance.md" in (ROOT / doc).read_text(encoding="utf-8"), doc
