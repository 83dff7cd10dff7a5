"""``python -m multimesh plan ...``: the ``multimesh`` console script."""

import sys

from multimesh.tools.plan_cli import main

if __name__ == "__main__":
    sys.exit(main())
