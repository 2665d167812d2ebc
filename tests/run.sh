#!/usr/bin/env bash
# Set up and run kvtier's whole test suite on a fresh machine (CPU: Triton's interpreter).
#   bash tests/run.sh            # from the repository root or anywhere
# Creates .venv (torch CPU build, community Triton, pytest, hypothesis, matplotlib), runs
# pytest, then SGLang's pools on kvtier (.ci/sglang.sh), the direct launches under the
# oldest supported Triton (.ci/triton_min.sh), and the Ascend checks (a second venv with
# triton-ascend, see .ci/ascend.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # the CPU build; on a GPU machine install the matching build first

[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e '.[cpu,test,bench]'
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
[ "${KVTIER_SKIP_SGLANG:-0}" = 1 ] || bash .ci/sglang.sh   # SGLang's own pools on kvtier
[ "${KVTIER_SKIP_TRITON_MIN:-0}" = 1 ] || bash .ci/triton_min.sh   # direct launches, oldest Triton
if [ -f .ci/ascend.sh ] && [ "${KVTIER_SKIP_ASCEND:-0}" != 1 ]; then
  bash .ci/ascend.sh
fi
