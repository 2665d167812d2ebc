#!/usr/bin/env bash
# kvtier's direct launches against the oldest Triton it supports (pyproject's `triton>=`,
# the version the H200 run used): tests/kernels/test_direct_launch.py compares, call by
# call, what Triton's launch path passes to a compiled kernel's launcher with what a
# direct launch passes, and test_kernel_specialization.py reads Triton's own launch
# binder. Both lean on Triton's internals, so they run under that Triton too.
#
# That Triton (and a numpy its interpreter runs with) is installed with --no-deps into a
# target directory put first on PYTHONPATH for this one pytest run, beside the main .venv
# (its torch is reused). Idempotent: kept in .triton-min (git-ignored) while its marker
# matches the pins; KVTIER_TRITON_MIN_TARGET moves it. Where the pins cannot be installed
# (no network), one line says so and the script exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${KVTIER_PYTHON:-.venv/bin/python}
TARGET=${KVTIER_TRITON_MIN_TARGET:-.triton-min}
MIN=$(grep -m1 -o '"triton>=[0-9.]*"' pyproject.toml | tr -d '"' | cut -d= -f2)
PINS=("triton==$MIN.*" "numpy<2.4")     # Triton < 3.7's interpreter cannot run with numpy 2.4

if [ ! -x "$PY" ]; then
  echo "triton-min: skipped: $PY not found (bash tests/run.sh builds it)"; exit 0
fi
if [ -z "$MIN" ]; then
  echo "triton-min: no 'triton>=' in pyproject.toml"; exit 1
fi
# shellcheck source=.ci/pinned_target.sh
source .ci/pinned_target.sh
pinned_target triton-min "$PY" "$TARGET" "${PINS[@]}" || exit 0
echo "triton-min: direct launches under Triton $("$PY" -c "import sys; sys.path.insert(0, '$TARGET'); import triton; print(triton.__version__)")"
PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/kernels/test_direct_launch.py tests/kernels/test_kernel_specialization.py "$@"
