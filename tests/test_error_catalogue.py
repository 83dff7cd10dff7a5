"""Every entry of the error catalogue raises what docs/errors.md says it raises.

The catalogue is data (``tests/error_catalogue.py``): one entry per user-facing
error with a trigger, the expected class (or ``mm-opt`` exit code) and a message
regex. Entries with a known issue (missing error, unclear message, wrong class)
are strict xfails: fixing the library turns them into failures until the
``issue`` is removed from the entry.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from multimesh._src.errors import MultimeshError, MultimeshWarning, PassFailure
from tests import error_catalogue as cat
from tests.tools import load_tool

ROOT = Path(__file__).resolve().parent.parent


def _params():
    out = []
    for e in cat.ENTRIES:
        marks = [pytest.mark.xfail(strict=True, reason=e.issue)] if e.issue else []
        out.append(pytest.param(e, id=e.id, marks=marks))
    return out


def test_catalogue_is_well_formed():
    assert cat.validate_catalogue() == []
    assert len(cat.ENTRIES) >= 30


@pytest.mark.parametrize("entry", _params())
def test_error(entry, tmp_path):
    for module in entry.requires:
        pytest.importorskip(module)
    out = cat.run(entry, tmp_path)
    if entry.is_cli:
        assert out.exit_code == entry.exit_code, out.message
        assert out.stdout == "", "a failing mm-opt run must not print partial output"
        assert "Traceback" not in out.message and "internal error" not in out.message
        assert re.search(entry.match, out.message, re.DOTALL), out.message
        return
    err = out.error
    assert err is not None, "no error was raised"
    assert isinstance(err, entry.exc), \
        f"expected {entry.exc.__name__}, got {type(err).__module__}.{type(err).__name__}: {err}"
    if entry.is_warning:
        assert isinstance(err, MultimeshWarning), type(err).__mro__
    else:
        assert isinstance(err, MultimeshError), type(err).__mro__
        assert isinstance(err, entry.builtin), type(err).__mro__
    assert re.search(entry.match, str(err), re.DOTALL), str(err)
    if entry.check is not None:
        entry.check(err)
    if isinstance(err, PassFailure):
        # The printed mm-opt command replays the failure on the saved input.
        code, stderr = cat.reproduce(err)
        assert code == 1, stderr
        assert err.cause is not None and err.cause.message in stderr, stderr


def test_errors_doc_up_to_date():
    for module in ("flax", "optax"):  # the doc shows the Flax entries' messages
        pytest.importorskip(module)
    gen = load_tool("gen_errors_doc")
    current = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert current == gen.render(), "docs/errors.md is stale: run `python tools/gen_errors_doc.py`"
