"""Generate docs/conformance.md by running the conformance matrix (never hand-edit it).

    python tools/gen_conformance_doc.py          # run every cell, rewrite the page
    python tools/gen_conformance_doc.py --check  # exit 1 if the page is stale

The cells, how each runs and checks itself, and the page's text are in
``tests/conformance.py``; ``tests/test_conformance.py`` runs the same cells and checks
that the page shows what they measured. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from doc_check import generate, use_cpu_devices  # noqa: E402

use_cpu_devices()  # before jax is imported: the cells run on 8 CPU devices

DOC = ROOT / "docs" / "conformance.md"


def measure() -> dict:
    """Every cell not known to fail, run and checked: its flops ratio."""
    from tests import conformance
    results = {}
    for cell in conformance.CELLS:
        if cell not in conformance.KNOWN:
            results[cell] = conformance.run_cell(*cell)
            print(" ".join(cell), f"{results[cell]:.2f}", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    from tests import conformance
    results = measure()
    return generate(argv, __doc__.splitlines()[0], DOC,
                    lambda _current: conformance.render(results))


if __name__ == "__main__":
    sys.exit(main())
