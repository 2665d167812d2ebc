#!/usr/bin/env bash
# The prepared hardware run on an NVIDIA H200 (any CUDA GPU works): the `cuda`-marked
# tests, then the full measurement, within 8 minutes; every output lands in one folder.
#
#   bash bench/h200.sh [RESULTS_DIR]      # default: results/<YYYY-MM-DD>_<device>/
#
# Steps, each with its own time limit and all within one deadline (KVTIER_TOTAL_BUDGET,
# 470 s; a step starts only with the time it needs left):
#   cuda-tests     pytest -m cuda                        -> cuda-tests.xml
#   overhead       kvtier bench --overhead --json        -> overhead.json
#   binding        bench/scripts/launch_binding.py       -> launch_binding.txt (Triton's binding
#                  of the same launches, timed on the host CPU)
#   bench          kvtier bench (kernel-only times, ceilings and baselines in the same run)
#                                                        -> bench.txt / .json / .png, points.jsonl
#   interference   kvtier bench --interference           -> interference.txt / .json / .png
#   bench-layouts  the page-major host layouts, both strategies -> layouts/
#   readme         python -m kvtier.bench.results_readme -> README.md (steps, ceilings, goals
#                  marked met or not, figures beside the baselines)
# plus h200.log (everything printed), env.txt (GPU, driver, versions, commit) and
# steps.txt (exit status per step). Commit the folder (results/README.md).
#
# Needs python3 with a CUDA build of torch, Triton, pytest (and matplotlib for the plots).
# kvtier need not be installed: the repository's packages are put on the path. vLLM's
# swap kernel is a baseline when bench/scripts/fetch_baselines.sh has put its source in
# .baselines/ (carry that folder to an offline machine).
# Time limits (seconds) can be changed through the environment:
#   KVTIER_TOTAL_BUDGET (470)  KVTIER_TEST_TIMEOUT (150)  KVTIER_OVERHEAD_TIMEOUT (90)
#   KVTIER_BENCH_BUDGET (140: measuring; the run then writes its outputs)
#   KVTIER_INTERFERENCE_TIMEOUT (75)  KVTIER_LAYOUTS_BUDGET (40; 0 skips the layouts sweep)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DEADLINE=$((SECONDS + ${KVTIER_TOTAL_BUDGET:-470}))
TEST_TIMEOUT=${KVTIER_TEST_TIMEOUT:-150}
OVERHEAD_TIMEOUT=${KVTIER_OVERHEAD_TIMEOUT:-90}
BENCH_BUDGET=${KVTIER_BENCH_BUDGET:-140}
INTERFERENCE_TIMEOUT=${KVTIER_INTERFERENCE_TIMEOUT:-75}
LAYOUTS_BUDGET=${KVTIER_LAYOUTS_BUDGET:-40}
if [ $# -ge 1 ]; then
  OUT=$1
else
  SLUG=$("$PY" -c "import torch; n = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'; \
print(n.lower().replace('nvidia', '').strip().replace(' ', '-'))" 2>/dev/null || echo unknown)
  OUT="$ROOT/results/$(date -u +%F)_${SLUG:-unknown}"
fi
# left RESERVE: seconds until the deadline, less what later steps need.
left() { echo $((DEADLINE - SECONDS - $1)); }
# within WANT RESERVE: WANT, or less so that RESERVE seconds stay for later steps (at least
# 5: `timeout 0` would mean no limit).
within() {
  local l; l=$(left "$2")
  if [ "$l" -lt 5 ]; then echo 5; elif [ "$l" -lt "$1" ]; then echo "$l"; else echo "$1"; fi
}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/steps.txt"
exec > >(tee -a "$OUT/h200.log") 2>&1
cd "$ROOT"
echo "== $(date -u +%FT%TZ) kvtier hardware run: $ROOT -> $OUT"

# shellcheck source=bench/source_tree.sh
source "$ROOT/bench/source_tree.sh"

status=0
step() {  # step NAME OKCODES COMMAND...: run, record the exit status, never abort the script
  local name=$1 ok=$2 rc
  shift 2
  echo "== $name: $*"
  set +e
  "$@"
  rc=$?
  set -e
  echo "$name $rc" >> "$OUT/steps.txt"
  echo "== $name: exit $rc"
  case " $ok " in *" $rc "*) ;; *) status=1 ;; esac
}

environment() {
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "dirty: $(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) files"
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 || echo "nvidia-smi failed"
  "$PY" - <<'PY'
import sys, torch
print("python:", sys.version.split()[0])
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, "SMs:", p.multi_processor_count, "memory GiB:", round(p.total_memory / 2**30, 1))
try:
    import triton
    print("triton:", triton.__version__)
except Exception as e:
    print("triton: unavailable:", e)
try:
    import matplotlib
    print("matplotlib:", matplotlib.__version__)
except Exception:
    print("matplotlib: unavailable (no PNG)")
PY
}

write_env() { environment > "$OUT/env.txt" 2>&1; cat "$OUT/env.txt"; }

step env 0 write_env
# Exit 5: no test carries the mark (not a failure of this script).
step cuda-tests "0 5" timeout -k 10 "$(within "$TEST_TIMEOUT" 300)" "$PY" -m pytest -m cuda -q \
  -p no:cacheprovider -o addopts="" --junitxml "$OUT/cuda-tests.xml" tests
# Host time per call beside torch ops, with the device kept busy.
step overhead 0 timeout -k 10 "$(within "$OVERHEAD_TIMEOUT" 250)" "$PY" -m kvtier.cli.main bench \
  --overhead --json "$OUT/overhead.json"
# Triton's own launch binding of the same calls' launches, on this host's CPU (no GPU use):
# beside overhead.json it splits a call's host time into kvtier's, Triton's and the driver's.
step binding "0 3" timeout -k 10 "$(within 30 230)" bash -c \
  "\"$PY\" bench/scripts/launch_binding.py 500 > \"$OUT/launch_binding.txt\""
budget=$(within "$BENCH_BUDGET" 180)
step bench 0 timeout -k 10 "$((budget + 60))" "$PY" -m kvtier.cli.main bench --out "$OUT" \
  --time-budget "$budget" --no-overhead
step interference 0 timeout -k 10 "$(within "$INTERFERENCE_TIMEOUT" 60)" "$PY" -m kvtier.cli.main bench \
  --interference --out "$OUT"
layouts=$(within "$LAYOUTS_BUDGET" 50)
if [ "$LAYOUTS_BUDGET" -gt 0 ] && [ "$layouts" -ge 10 ]; then
  step bench-layouts 0 timeout -k 10 "$((layouts + 40))" "$PY" -m kvtier.cli.main bench \
    --out "$OUT/layouts" --ops backup,load_layer,load \
    --layouts page_first,page_first_direct,page_head --rows 1024 --pages 64 \
    --tokens 1024,16384 --strategies kernel,dma --caps 4 --no-overhead --no-plot \
    --time-budget "$layouts"
fi
step readme 0 "$PY" -m kvtier.bench.results_readme "$OUT"

echo "== $(date -u +%FT%TZ) done (status $status); steps:"
cat "$OUT/steps.txt"
exit "$status"
