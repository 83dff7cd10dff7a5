#!/usr/bin/env bash
# Run this checkout's test suite under another Python environment's jax.
#
#   tools/test_under.sh VENV [pytest args...]
#   tools/test_under.sh /work/venvs/j011                    # the whole suite, jax 0.11.2
#   tools/test_under.sh /work/venvs/j012 -x tests/test_e2_mpmd.py
#
# VENV needs jax/jaxlib, flax and optax (for the Flax tests) and the test extras
# (pytest, filecheck, lit, hypothesis, matplotlib). multimesh itself always comes from
# this checkout (PYTHONPATH, which also reaches the suite's subprocesses: mm-opt,
# python -m multimesh.launch), never from VENV, so nothing is installed there. The CPU
# backend with 8 simulated devices (the root conftest.py) is used unless JAX_PLATFORMS
# says otherwise. README.md, "Compatibility", records what passed where.
set -euo pipefail
venv=${1:?usage: tools/test_under.sh VENV [pytest args...]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
py="$venv/bin/python"
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
"$py" - "$root" <<'PY'
import os, sys
import jax, jaxlib, multimesh, multimesh.passes
root = sys.argv[1]
where = os.path.dirname(os.path.dirname(os.path.abspath(multimesh.__file__)))
passes = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(multimesh.passes.__file__))))  # multimesh/passes/__init__.py
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
      f"multimesh from {where}")
for what, got in (("multimesh", where), ("multimesh.passes", passes)):
    if os.path.realpath(got) != os.path.realpath(root):
        sys.exit(f"error: {what} is imported from {got}, not from this checkout ({root})")
PY
exec "$py" -m pytest -q -p no:cacheprovider "$@"
