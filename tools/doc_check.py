"""The command line every docs generator shares (``tools/gen_*_doc.py``): rewrite the
page, or with ``--check`` exit 1 when it is stale."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_cpu_devices(count: int = 8) -> None:
    """Before jax is imported: ``count`` simulated CPU devices, as the tests have."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
