"""The command line every docs generator shares (``tools/gen_*_doc.py``): rewrite the
page, or with ``--check`` exit 1 when it is stale."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(argv, description: str, doc: Path, render: Callable[[str], str]) -> int:
    """Write ``render(current page)`` to ``doc``; with ``--check``, say whether it would
    change it (exit 1 and the command that regenerates it)."""
    rel = doc.relative_to(ROOT)
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--check", action="store_true", help=f"exit 1 if {rel} is stale")
    args = ap.parse_args(argv)
    current = doc.read_text(encoding="utf-8") if doc.exists() else ""
    text = render(current)
    if args.check:
        if current != text:
            print(f"{rel} is stale: run `python tools/{Path(sys.argv[0]).name}`",
                  file=sys.stderr)
            return 1
        return 0
    doc.write_text(text, encoding="utf-8")
    print(f"wrote {rel}")
    return 0
