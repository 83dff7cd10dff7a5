"""Every entry of the error catalogue raises what docs/errors.md says it raises.

The catalogue is data (``tests/error_catalogue.py``): one entry per user-facing
error with a trigger, the expected class (or ``mm-opt`` exit code) and a message
regex. Entries with a known issue (missing error, unclear message, wrong class)
are strict xfails: fixing the library turns them into failures until the
``issue`` is removed from the entry.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from multimesh._src.errors import MultimeshError, MultimeshWarning, PassFailure
from tests import error_catalogue as cat
from tests.tools import load_tool

ROOT = Path(__file__).resolve().parent.parent
OUTCOMES: dict[str, cat.Outcome] = {}
"""entry id -> what :func:`test_error` got running it in this session: the docs check
renders the page from these rather than running every entry a second time."""


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
    out = OUTCOMES[entry.id] = cat.run(entry, tmp_path)
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


def test_errors_doc_up_to_date(monkeypatch):
    """The page is what ``tools/gen_errors_doc.py`` renders. Each entry's outcome is the
    one :func:`test_error` got in this session (the same code run once, in the same
    process); an entry that test did not run (deselected, skipped) runs here."""
    for module in ("flax", "optax"):  # the doc shows the Flax entries' messages
        pytest.importorskip(module)
    gen = load_tool("gen_errors_doc")
    catalogue = gen.load_catalogue()  # the tool's own copy of tests/error_catalogue.py
    run = catalogue.run
    monkeypatch.setattr(catalogue, "run", lambda e, workdir: OUTCOMES.get(e.id) or run(e, workdir))
    current = (ROOT / "docs" / "errors.md").read_text(encoding="utf-8")
    assert current == gen.render(), "docs/errors.md is stale: run `python tools/gen_errors_doc.py`"


# ------------------------------------------------- docs/errors.md's examples, as pasted


def test_errors_doc_examples_run_as_pasted():
    """Every example of docs/errors.md, pasted into a fresh session after the page's
    preamble, raises the class (and the message) its entry documents.

    One child process runs them all (``tools/check_errors_doc.py``: the preamble once,
    each example in a copy of its namespace), so the examples share one import of jax
    and multimesh; it reads only the page, so a new catalogue entry is checked as soon
    as ``tools/gen_errors_doc.py`` has regenerated it.
    """
    for module in ("flax", "optax"):  # the Flax entries' examples import them
        pytest.importorskip(module)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # it asks for 8 devices
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "check_errors_doc.py")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-20000:] + proc.stdout[-2000:]
    n_python = sum(1 for e in cat.ENTRIES if not e.is_cli)
    assert f"{n_python} of {n_python} examples" in proc.stdout, proc.stdout


_PAGE = '''\
## Preamble

```python
def helper():
    raise ValueError("from the helper")
```

### `fine`

**A.** Raised as `ValueError`.

```python
helper()
```

```text
from the helper
```

### `needs-an-undefined-helper`

**B.** Raised as `ValueError`.

```python
undefined_helper()
```

### `wrong-class`

**C.** Raised as `TypeError` (a `MultimeshError` and a `TypeError`).

```python
helper()
```

### `a-warning`

**D.** Warned as `UserWarning`.

```python
import warnings
warnings.warn("careful")
```

### `known-issue-silent`

**E.** Should be raised as `ValueError`.

```python
x = 1
```

> **Known issue:** it says nothing.

Today it raises no error.

### `other-message`

**F.** Raised as `ValueError`.

```python
helper()
```

```text
from somewhere else
```

### `cli`

**G.** `mm-opt` exits with status 1.

```console
$ mm-opt in.mlir
```
'''


def test_check_errors_doc_finds_what_a_reader_would_hit(tmp_path):
    """The checker reports an example that needs a name the page does not define, one
    that raises another class, and one whose message is not the page's; it expects
    nothing where a known issue says "raises no error", and skips command lines."""
    checker = load_tool("check_errors_doc")
    page = tmp_path / "page.md"
    page.write_text(_PAGE, encoding="utf-8")
    assert [ex.id for ex in checker.parse(_PAGE).examples] == [
        "fine", "needs-an-undefined-helper", "wrong-class", "a-warning",
        "known-issue-silent", "other-message"]
    failures, ran = checker.check(page)
    assert ran == 6
    assert len(failures) == 3, failures
    assert "(needs-an-undefined-helper)" in failures[0] and "NameError" in failures[0]
    assert "(wrong-class)" in failures[1] and "should raise TypeError" in failures[1]
    assert "(other-message)" in failures[2] and "another message" in failures[2]


def test_gen_errors_doc_refuses_an_example_that_reads_an_undefined_name():
    """The generator puts every helper an example uses in the preamble; a name that
    neither the example nor the catalogue defines stops it, naming both."""
    gen = load_tool("gen_errors_doc")
    defs = gen.catalogue_definitions()
    assert gen.needed("pipelined()", defs, "x") >= {"pipelined", "two_stage", "mesh4", "mm"}
    with pytest.raises(SystemExit, match="example 'new-entry' reads 'no_such_helper'"):
        gen.needed("no_such_helper(mesh4())", defs, "example 'new-entry'")
