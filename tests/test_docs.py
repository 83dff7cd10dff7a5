"""Run the documentation: every ``docs/**/*.md`` page with ```python blocks is a test.

A page's python blocks run in order, in one fresh namespace in this process (the root
conftest has already asked for 8 CPU devices). Each block keeps its line numbers from
the markdown file, so a traceback points at the right line of the page. A page whose
first line is ``<!-- no-exec -->`` is collected but skipped.

**Output blocks.** A ```text block that follows a ```python block with only blank
lines between them is that block's expected stdout, and the test compares them
(:func:`same_output`): trailing blanks, runs of spaces, memory addresses
(``0x7f...``) and the last printed digit of a float do not count, and ``...`` in the
expected text stands for any text (timings, paths). A text block that is not an
output (a command, a log excerpt) says so with ``<!-- not-output -->`` on the line
above its fence; so a page never shows output that its code no longer prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NO_EXEC = "<!-- no-exec -->"
NOT_OUTPUT = "<!-- not-output -->"
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")
_PYTHON = ("python", "py", "python3")


@dataclasses.dataclass
class Block:
    """One fenced block: its info string, the lines of its fences (0-based) and body."""

    info: str
    open: int
    close: int
    body: list[str]

    @property
    def is_python(self) -> bool:
        return self.info.lower() in _PYTHON


def blocks(text: str) -> list[Block]:
    """Every fenced block of a markdown page, in order."""
    out: list[Block] = []
    fence: str | None = None  # the open fence, if inside a block
    for i, line in enumerate(text.splitlines()):
        if fence is None:
            m = _FENCE_OPEN.match(line)
            if m:
                fence = m.group("fence")
                out.append(Block(m.group("info"), i, -1, []))
        elif line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = None
            out[-1].close = i
        else:
            out[-1].body.append(line)
    return out


def block_source(text: str, picked: list[Block]) -> str:
    """The ``picked`` blocks as one program; every other line of the page is blank."""
    lines = [""] * len(text.splitlines())
    for b in picked:
        lines[b.open + 1:b.open + 1 + len(b.body)] = b.body
    return "\n".join(lines) + "\n"


def python_source(text: str) -> str:
    """The page's ```python blocks as one program; other lines become blank lines."""
    return block_source(text, [b for b in blocks(text) if b.is_python])


def outputs(text: str) -> dict[int, Block]:
    """Python block (by its opening line) -> the text block that shows its stdout."""
    lines = text.splitlines()
    found = {}
    bs = blocks(text)
    for prev, b in zip(bs, bs[1:]):
        if b.info != "text" or not prev.is_python:
            continue
        between = [ln.strip() for ln in lines[prev.close + 1:b.open]]
        if NOT_OUTPUT in between or any(between):
            continue
        found[prev.open] = b
    return found


# ------------------------------------------------------------------ comparing outputs

_NUMBER = r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?"
_TOKEN = re.compile(rf"(\.\.\.)|(0x[0-9a-fA-F]+)|({_NUMBER})")


def _normal(text: str) -> str:
    lines = [" ".join(line.split()) for line in text.strip("\n").splitlines()]
    return "\n".join(lines).strip()


def _float_close(expected: str, got: str) -> bool:
    """Equal up to one unit in the last digit ``expected`` prints (or 1e-5 relative)."""
    try:
        e, g = float(expected), float(got)
    except ValueError:
        return False
    mantissa = expected.lower().split("e")[0]
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    exp10 = int(expected.lower().split("e")[1]) if "e" in expected.lower() else 0
    unit = 10.0 ** (exp10 - decimals)
    return abs(e - g) <= max(unit, 1e-5 * abs(e))


def same_output(expected: str, got: str) -> bool:
    """Whether ``got`` (what the code printed) shows what ``expected`` (the page) does."""
    expected, got = _normal(expected), _normal(got)
    pattern, floats = [], []
    pos = 0
    for m in _TOKEN.finditer(expected):
        pattern.append(re.escape(expected[pos:m.start()]))
        pos = m.end()
        if m.group(1):                       # ... : anything
            pattern.append(r".*?")
        elif m.group(2):                     # an address
            pattern.append(r"0x[0-9a-fA-F]+")
        elif re.fullmatch(r"[-+]?\d+", m.group(3)):   # integers are exact
            pattern.append(re.escape(m.group(3)))
        else:
            pattern.append(f"({_NUMBER})")
            floats.append(m.group(3))
    pattern.append(re.escape(expected[pos:]))
    match = re.fullmatch("".join(pattern), got, re.S)
    return match is not None and all(_float_close(e, g) for e, g in zip(floats, match.groups()))


def _diff(expected: str, got: str) -> str:
    return "\n".join(difflib.unified_diff(expected.strip("\n").splitlines(),
                                          got.strip("\n").splitlines(),
                                          "the page", "what the code printed", lineterm=""))


# ------------------------------------------------------------------ the page tests

def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if python_source(p.read_text()).strip())


def _id(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


READS_COMPILES = ("xla_sources", "xla_compiles", "pipeline_cache")
"""A page that prints these runs with the suite's compilation cache off (root
``conftest.py``): it shows what a fresh process compiles."""


@pytest.mark.parametrize("page", _pages(), ids=_id)
def test_doc_page(page: Path, request):
    """The page's python blocks run, and print what its output blocks show."""
    text = page.read_text()
    first = text.lstrip("\ufeff").splitlines()[0].strip() if text.strip() else ""
    if first == NO_EXEC:
        pytest.skip(f"{_id(page)} opts out of execution ({NO_EXEC})")
    if any(name in text for name in READS_COMPILES):
        request.getfixturevalue("fresh_xla_compiles")  # it prints how programs compiled
    shown = outputs(text)
    name = f"docs.{_id(page)}"
    module = types.ModuleType(name)
    module.__file__ = str(page)
    sys.modules[name] = module  # dataclasses (e.g. linen fields) look their module up
    drifted = []
    try:
        for b in (b for b in blocks(text) if b.is_python):
            # dont_inherit: the page must not see this file's `from __future__` imports.
            code = compile(block_source(text, [b]), str(page), "exec", dont_inherit=True)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(code, module.__dict__)
            sys.stdout.write(out.getvalue())
            expected = shown.get(b.open)
            if expected is not None and not same_output("\n".join(expected.body),
                                                        out.getvalue()):
                drifted.append(f"{_id(page)}:{expected.open + 1}: the output block differs "
                               f"from what lines {b.open + 2}-{b.close} print:\n"
                               + _diff("\n".join(expected.body), out.getvalue()))
    finally:
        sys.modules.pop(name, None)
    assert not drifted, "\n\n".join(drifted)


def test_python_source_keeps_line_numbers():
    text = "# t\n\n```python\nx = 1\n```\n\n```text\nnot code\n```\n````python\ny = x\n````\n"
    src = python_source(text).splitlines()
    assert src[3] == "x = 1"
    assert src[7] == ""
    assert src[10] == "y = x"
    assert len(src) == len(text.splitlines())


def test_output_blocks_follow_their_python_block():
    text = ("```python\nprint(1)\n```\n\n```text\n1\n```\n"
            "```python\nprint(2)\n```\nIt prints:\n```text\n2\n```\n"
            "```python\nprint(3)\n```\n<!-- not-output -->\n```text\n$ cmd\n```\n")
    found = outputs(text)
    assert list(found) == [0] and found[0].body == ["1"]


@pytest.mark.parametrize(("expected", "got", "same"), [
    ("loss 0.9542 -> 0.0075", "loss 0.9542 -> 0.0075\n", True),
    ("Loss = 64.85133", "Loss = 64.851326", True),        # the last printed digit
    ("Loss = 64.85133", "Loss = 64.86133", False),
    ("devices [0, 1, 2, 3]", "devices [0, 1, 2, 4]", False),  # integers are exact
    ("<Foo at 0x7f00aa>", "<Foo at 0x55e1b2c3>", True),
    ("took ... s, done", "took 0.0123 s, done", True),
    ("a  b\n\n", "a b", True),
    ("one line", "one line\nand another", False),
    ("1e-06", "1.0000001e-06", True),
])
def test_same_output(expected, got, same):
    assert same_output(expected, got) is same


# ------------------------------------------------------------------ public names only

# A private multimesh name: a dotted path with a `_name` part (`multimesh.jax._stages.mjit`), or
# an attribute `x._name` of anything that is not jax's own (pages about jaxlib's MPMD
# partitioner must name its private module).
_PRIVATE = re.compile(r"\bmultimesh(?:\.\w+)*\._\w+|(?<![\w.])(?!jax\b|jaxlib\b)[\w)\]]+\._[A-Za-z]\w*")
_INLINE = re.compile(r"(`+)(.+?)\1")


def _public_text(path: Path) -> list[tuple[int, str]]:
    """(line, code) of every python block line and inline code span of a page."""
    text = path.read_text()
    out = [(b.open + 2 + i, line) for b in blocks(text) if b.is_python
           for i, line in enumerate(b.body)]
    in_block = {i for b in blocks(text) for i in range(b.open, b.close + 1)}
    for i, line in enumerate(text.splitlines()):
        if i not in in_block:
            out += [(i + 1, m.group(2)) for m in _INLINE.finditer(line)]
    return out


def _user_pages() -> list[Path]:
    # architecture.md and testing.md are about the code itself: they name modules.
    skip = {"architecture.md", "testing.md"}
    return [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if p.name not in skip)]


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: p.name)
def test_docs_use_only_public_names(page: Path):
    """No example or inline code sends users to a private name (``multimesh.jax._x``,
    ``f._cache``): what docs show is what stays stable."""
    bad = [f"{page.name}:{line}: {m.group(0)!r} in {code.strip()!r}"
           for line, code in _public_text(page) for m in _PRIVATE.finditer(code)]
    assert not bad, "private names in docs:\n" + "\n".join(bad)


def test_private_names_are_found():
    for code in ("from multimesh.jax._analysis.visualize import v", "len(f._cache)",
                 "executor._COMPILE_CACHE", "compiled._exec.process_plan"):
        assert _PRIVATE.search(code), code
    for code in ("import jaxlib._jax", "jax._src", "multimesh.jax.errors", "x.__name__",
                 "f.cache_info()"):
        assert not _PRIVATE.search(code), code


# ------------------------------------------------------------------ one word, one meaning

def _prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of a page outside fenced blocks, inline code and link targets."""
    in_block = {i for b in blocks(text) for i in range(b.open, b.close + 1)}
    return [(i + 1, re.sub(r"\]\([^)]*\)", "]", _INLINE.sub("", line)))
            for i, line in enumerate(text.splitlines()) if i not in in_block]


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: p.name)
def test_multimesh_the_class_is_never_the_original_library(page: Path):
    """``MultiMesh`` is a class: prose names it in backticks. The original library is
    "the original library" (NVIDIA's multimesh-jax), compared on one page."""
    if page.name == "compared.md":
        return
    bad = [f"{page.name}:{n}: {line.strip()}" for n, line in _prose(page.read_text())
           if re.search(r"\bMultiMesh\b", line)]
    assert not bad, ("bare 'MultiMesh' in prose: write `MultiMesh` for the class, or "
                     "'the original library' and link compared.md:\n" + "\n".join(bad))
