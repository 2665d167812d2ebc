#!/usr/bin/env bash
# The Ascend checks, on CPU, in a second venv with triton-ascend (it installs a module also
# named `triton`, so it cannot share the main venv):
#   1. lower every launcher configuration for Ascend910B3 and read the linalg/HIVM form
#      (tests/ascend/test_lowering.py), plus the interpreter checks in tests/ascend;
#   2. run the kernel and pool suites (tests/kernels/test_copy_rows*.py, tests/pool/test_pool_*.py) under
#      triton-ascend's own interpreter.
# Idempotent: the venv is kept in .venv-ascend (git-ignored) and reused while its marker
# matches the pinned versions below. KVTIER_ASCEND_VENV overrides its place.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVTIER_ASCEND_VENV:-.venv-ascend}
PINS=(torch==2.13.0 triton-ascend==3.2.0 pybind11 "numpy<2.3" pytest hypothesis)
MARK="$VENV/.kvtier-pins"

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$MARK" 2>/dev/null)" != "${PINS[*]}" ]; then
  echo "ascend: building $VENV (${PINS[*]})"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "${PINS[@]}"
  echo "${PINS[*]}" > "$MARK"
fi
# The editable install is cheap and follows the checkout (pyproject changes included).
"$VENV/bin/python" -m pip install -q --no-deps -e . >/dev/null

"$VENV/bin/python" - <<'EOF'
import triton, importlib.util
assert importlib.util.find_spec("triton.backends.ascend"), "the ascend venv lacks triton-ascend"
print(f"ascend: triton {triton.__version__} (triton-ascend)")
EOF

shopt -s nullglob
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning)
# 1. Lowering, in its own process: once triton-ascend 3.2's interpreter has run, it leaves
#    triton.language patched and nothing compiles in that process any more.
echo "ascend: lowering (tests/ascend/test_lowering.py)"
"${PYTEST[@]}" tests/ascend/test_lowering.py "$@"
# 2. The kernel and pool suites under triton-ascend's interpreter (TRITON_INTERPRET=1 is set
#    by tests/conftest.py).
SUITES=(tests/ascend/test_interpreter.py tests/kernels/test_copy_rows*.py tests/pool/test_pool_*.py)
echo "ascend: interpreter (${SUITES[*]})"
"${PYTEST[@]}" "${SUITES[@]}" "$@"
