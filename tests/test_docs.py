"""Run the documentation: every ``docs/**/*.md`` page with ```python blocks is a test.

A page's python blocks are concatenated, in order, into one program that runs in a
fresh namespace in this process (the root conftest has already asked for 8 CPU
devices). Each block keeps its line numbers from the markdown file, so a traceback
points at the right line of the page. A page whose first line is ``<!-- no-exec -->``
is collected but skipped.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
NO_EXEC = "<!-- no-exec -->"
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)")


def python_source(text: str) -> str:
    """The page's ```python blocks as one program; other lines become blank lines."""
    out: list[str] = []
    fence: str | None = None  # the open fence, if inside a block
    is_python = False
    for line in text.splitlines():
        if fence is None:
            m = _FENCE_OPEN.match(line)
            if m:
                fence = m.group("fence")
                is_python = m.group("info").lower() in ("python", "py", "python3")
            out.append("")
        elif line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            fence = None
            is_python = False
            out.append("")
        else:
            out.append(line if is_python else "")
    return "\n".join(out) + "\n"


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if python_source(p.read_text()).strip())


def _id(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


@pytest.mark.parametrize("page", _pages(), ids=_id)
def test_doc_page(page: Path):
    text = page.read_text()
    first = text.lstrip("\ufeff").splitlines()[0].strip() if text.strip() else ""
    if first == NO_EXEC:
        pytest.skip(f"{_id(page)} opts out of execution ({NO_EXEC})")
    # dont_inherit: the page must not see this file's `from __future__` imports.
    code = compile(python_source(text), str(page), "exec", dont_inherit=True)
    name = f"docs.{_id(page)}"
    module = types.ModuleType(name)
    module.__file__ = str(page)
    sys.modules[name] = module  # dataclasses (e.g. linen fields) look their module up
    try:
        exec(code, module.__dict__)
    finally:
        sys.modules.pop(name, None)


def test_python_source_keeps_line_numbers():
    text = "# t\n\n```python\nx = 1\n```\n\n```text\nnot code\n```\n````python\ny = x\n````\n"
    src = python_source(text).splitlines()
    assert src[3] == "x = 1"
    assert src[7] == ""
    assert src[10] == "y = x"
    assert len(src) == len(text.splitlines())
