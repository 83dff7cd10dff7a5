"""Run every example of docs/errors.md as a reader pastes it, and check what it raises.

    python tools/check_errors_doc.py              # docs/errors.md; exit 1 on any failure
    python tools/check_errors_doc.py PAGE.md      # another page of the same form

The page's preamble (the python block under ``## Preamble``) runs once in a fresh
namespace. Each entry's example (the python block under its ``### `id``` heading) then
runs in its own copy of that namespace, in an empty directory, as if pasted into a new
Python session right after the preamble, and must raise the class its entry names:
``Raised as `X```; ``Warned as `X``` (the warning is turned into an error, as
``warnings.simplefilter("error", X)`` would); for a known issue, what ``Today it raises
`Y``` or ``Today it raises no error`` says. The class is compared by name along the
raised exception's MRO, so the page is read as a reader reads it. The message is
compared too, with the page's text block, after the catalogue's normalisation of paths
and source lines. Entries whose example is a command line (``$ mm-opt ...``) are not
Python; tests/test_error_catalogue.py runs them.

It reads only the page: an entry added to tests/error_catalogue.py is checked once
``tools/gen_errors_doc.py`` has regenerated the page. jax gets 8 CPU devices, as in
the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"
sys.path.insert(0, str(ROOT))  # this tree's multimesh, and tests.error_catalogue

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
_CLASS = re.compile(r"(?:Should be )?(?:[Rr]aised|[Ww]arned) as `(\w+)`")
_AT = re.compile(r"\(at [^()\s]+?:(LINE(?::COL)?)\)")
_TODAY = re.compile(r"^Today it raises (?:`(\w+)`|(no error))")


@dataclasses.dataclass
class Example:
    """One entry's Python example and what the page says it raises."""

    id: str
    line: int  # 1-based line of the example's first line of code
    source: str
    expected: str | None  # the class name it must raise; None: it must raise nothing
    warning: str | None = None  # the documented class, when the entry is a warning
    message: str | None = None  # the page's text block after the example


@dataclasses.dataclass
class Page:
    preamble: str
    preamble_line: int
    examples: list[Example]


def _fenced(lines: list[str]):
    """(first body line, info, body) of every fenced block, 0-based."""
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        ticks, info, start = m.group(1), m.group(2), i + 1
        i = start
        while i < len(lines) and lines[i].rstrip() != ticks:
            i += 1
        yield start, info, "\n".join(lines[start:i])
        i += 1


def parse(text: str) -> Page:
    """The preamble and the Python examples of an errors page."""
    lines = text.splitlines()
    heading = {}  # line -> the heading in force there
    current = ""
    for n, line in enumerate(lines):
        if line.startswith("## ") or line.startswith("### "):
            current = line
        heading[n] = current
    preamble, pre_line, examples = None, 0, []
    by_id: dict[str, Example] = {}
    for start, info, body in _fenced(lines):
        title = heading[start - 1]
        if title.startswith("## Preamble") and info == "python" and preamble is None:
            preamble, pre_line = body, start + 1
        elif title.startswith("### `") and info == "python" and title not in by_id:
            ex = _example(title[5:-1], lines, start, body, heading)
            by_id[title] = ex
            examples.append(ex)
        elif title in by_id and info == "text" and by_id[title].message is None:
            by_id[title].message = body
    if preamble is None:
        raise ValueError("the page has no preamble: a python block under '## Preamble'")
    return Page(preamble, pre_line, examples)


def _example(eid: str, lines: list[str], start: int, body: str, heading) -> Example:
    """The example at ``start`` and the class the prose of its entry names."""
    section = [ln for n, ln in enumerate(lines) if heading[n] == heading[start - 1]]
    documented = next((m for ln in section if (m := _CLASS.search(ln))), None)
    if documented is None:
        raise ValueError(f"entry {eid!r} names no class ('Raised as `X`')")
    today = next((m for ln in section if (m := _TODAY.match(ln))), None)
    expected: str | None = documented.group(1)
    if today is not None:
        expected = None if today.group(2) else today.group(1)
    warned = "arned as" in documented.group(0)
    return Example(eid, start + 1, body, expected,
                   warning=documented.group(1) if warned else None)


def _warning_class(name: str) -> type[Warning]:
    import builtins

    from multimesh.jax import errors

    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Warning)):
        raise ValueError(f"{name!r} is not a warning class of multimesh.jax.errors")
    return cls


@contextlib.contextmanager
def _session(workdir: Path):
    """An empty working directory and a private dump directory, as a fresh session."""
    old_cwd, old_dump = os.getcwd(), os.environ.get("MULTIMESH_DUMP_IR_TO")
    os.chdir(workdir)
    os.environ["MULTIMESH_DUMP_IR_TO"] = str(workdir / "dump")
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_dump is None:
            os.environ.pop("MULTIMESH_DUMP_IR_TO", None)
        else:
            os.environ["MULTIMESH_DUMP_IR_TO"] = old_dump


def run(source: str, filename: str, line: int, namespace: dict, workdir: Path,
        warning: str | None = None) -> BaseException | None:
    """Exec ``source`` (which starts at ``line`` of ``filename``) in ``namespace``; the
    exception it raised, or None."""
    import multimesh.jax as mm

    code = compile("\n" * (line - 1) + source, filename, "exec", dont_inherit=True)
    mm.clear_tasks()  # a fresh session has registered no task
    try:
        with _session(workdir), warnings.catch_warnings(), \
                contextlib.redirect_stdout(io.StringIO()):
            if warning is not None:
                warnings.simplefilter("error", _warning_class(warning))
            exec(code, namespace)
    except Exception as e:  # noqa: BLE001 - what it raises is the result
        return e
    finally:
        mm.clear_tasks()
    return None


def _message_differs(ex: Example, err: BaseException | None) -> str | None:
    if err is None or ex.message is None:
        return None
    from tests.error_catalogue import normalize

    got = normalize(str(err))
    # A location in the reader's code names the file it was pasted into: not compared.
    same = _AT.sub(r"(at \1)", got) == _AT.sub(r"(at \1)", ex.message.rstrip())
    return None if same else got


def check(page_path: Path, only: set[str] | None = None) -> tuple[list[str], int]:
    """Failures (one sentence each) of the page's examples, and how many ran."""
    page = parse(page_path.read_text(encoding="utf-8"))
    failures = []
    with tempfile.TemporaryDirectory(prefix="mm-errors-doc-") as tmp:
        base: dict = {"__name__": "__main__"}
        err = run(page.preamble, str(page_path), page.preamble_line, base, Path(tmp))
        if err is not None:
            return [f"the preamble raised {type(err).__name__}: {err}"], 0
        examples = [ex for ex in page.examples if only is None or ex.id in only]
        for k, ex in enumerate(examples):
            workdir = Path(tmp) / str(k)
            workdir.mkdir()
            err = run(ex.source, str(page_path), ex.line, dict(base), workdir, ex.warning)
            where = f"{page_path.name}:{ex.line} ({ex.id})"
            if not _raised(err, ex.expected):
                want = f"raise {ex.expected}" if ex.expected else "raise nothing"
                got = f"{type(err).__name__}: {err}" if err is not None else "nothing"
                failures.append(f"{where}: pasted after the preamble, the example should "
                                f"{want}, but raised {got}")
            elif (got_message := _message_differs(ex, err)) is not None:
                failures.append(f"{where}: raised {type(err).__name__} with another message "
                                f"than the page shows:\n  page: {ex.message}\n  got:  "
                                f"{got_message}")
    return failures, len(examples)


def _raised(err: BaseException | None, expected: str | None) -> bool:
    if expected is None:
        return err is None
    return err is not None and any(c.__name__ == expected for c in type(err).__mro__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("page", nargs="?", type=Path, default=DOC)
    ap.add_argument("--only", help="comma-separated entry ids to run (default: all)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    only = set(args.only.split(",")) if args.only else None
    failures, ran = check(args.page.resolve(), only)
    for f in failures:
        print(f, file=sys.stderr)
    print(f"{ran - len(failures)} of {ran} examples of {args.page.name} raised what the page "
          f"says, pasted after its preamble ({time.perf_counter() - start:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
