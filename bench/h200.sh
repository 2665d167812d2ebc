#!/usr/bin/env bash
# Hardware validation on an NVIDIA H200 (any CUDA GPU works): the `cuda`-marked tests,
# then `kvtier bench`, within 8 minutes; every output lands in the directory given.
#
#   bash bench/h200.sh RESULTS_DIR
#
# RESULTS_DIR gets h200.log (everything printed), env.txt (GPU, driver, versions,
# commit), steps.txt (exit status per step), cuda-tests.xml, and the benchmark's
# bench.txt / bench.json / bench.png / points.jsonl. Commit it as
# results/<YYYY-MM-DD>_<device>/ with a README (results/README.md, docs/benchmarks.md).
#
# Needs python3 with a CUDA build of torch, Triton, pytest (and matplotlib for the plot).
# kvtier need not be installed: the repository's packages are put on the path.
# Time limits (seconds) can be changed through the environment:
#   KVTIER_TEST_TIMEOUT (180)  KVTIER_BENCH_BUDGET (150: measuring; the run then ends
#   with the overhead benchmark and the outputs)  KVTIER_BENCH_TIMEOUT (budget + 80)
#   KVTIER_LAYOUTS_BUDGET (60: the second sweep, the page-major host layouts with both
#   strategies, written to RESULTS_DIR/layouts/; 0 skips it)
set -euo pipefail

OUT=${1:?usage: bash bench/h200.sh RESULTS_DIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
TEST_TIMEOUT=${KVTIER_TEST_TIMEOUT:-180}
BENCH_BUDGET=${KVTIER_BENCH_BUDGET:-150}
LAYOUTS_BUDGET=${KVTIER_LAYOUTS_BUDGET:-60}
BENCH_TIMEOUT=${KVTIER_BENCH_TIMEOUT:-$((BENCH_BUDGET + 80))}

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
step cuda-tests "0 5" timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -m cuda -q -p no:cacheprovider \
  -o addopts="" --junitxml "$OUT/cuda-tests.xml" tests
# Host time per call beside torch ops, with the device kept busy.
step overhead 0 timeout -k 10 120 "$PY" -m kvtier.cli.main bench --overhead --json "$OUT/overhead.json"
step bench 0 timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m kvtier.cli.main bench --out "$OUT" \
  --time-budget "$BENCH_BUDGET" --no-overhead
if [ "$LAYOUTS_BUDGET" -gt 0 ]; then
  step bench-layouts 0 timeout -k 10 "$((LAYOUTS_BUDGET + 60))" "$PY" -m kvtier.cli.main bench \
    --out "$OUT/layouts" --ops backup,load_layer,load \
    --layouts page_first,page_first_direct,page_head --rows 1024 --pages 64 \
    --tokens 1024,16384 --strategies kernel,dma --caps 4 --no-overhead \
    --time-budget "$LAYOUTS_BUDGET"
fi

echo "== $(date -u +%FT%TZ) done (status $status); steps:"
cat "$OUT/steps.txt"
exit "$status"
