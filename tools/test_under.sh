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
# python -m multimesh.launch). The pass library (folder mlir_passes/) is the package
# multimesh.passes only through the install's package-dir mapping, so the checkout is
# installed into VENV in editable mode, without dependencies (VENV keeps its jax), unless
# VENV already imports it from here. The CPU
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
if ! "$py" - "$root" <<'PY' 2>/dev/null
import os, sys
import multimesh.passes
sys.exit(os.path.realpath(os.path.dirname(multimesh.passes.__file__))
         != os.path.join(os.path.realpath(sys.argv[1]), "mlir_passes"))
PY
then
  echo "installing $root into $venv (editable, --no-deps)"
  "$py" -m pip install -q --no-deps -e "$root"
fi
"$py" - "$root" <<'PY'
import os, sys
import jax, jaxlib, multimesh
root = sys.argv[1]
where = os.path.dirname(os.path.dirname(os.path.abspath(multimesh.__file__)))
print(f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
      f"multimesh from {where}")
if os.path.realpath(where) != os.path.realpath(root):
    sys.exit(f"error: multimesh is imported from {where}, not from this checkout ({root})")
PY
exec "$py" -m pytest -q -p no:cacheprovider "$@"
