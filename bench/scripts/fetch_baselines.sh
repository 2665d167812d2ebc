#!/usr/bin/env bash
# Bring the engines' own transfer kernels within reach of an offline device, without
# committing their code: downloads vLLM's published wheel (no dependencies) and extracts
# the one file the vLLM baseline runs (bench/vllm_baseline.py) into .baselines/vllm/,
# which git ignores (.git/info/exclude) and which travels with the working tree.
#
#   bash bench/scripts/fetch_baselines.sh            # vLLM 0.33.0
#   VLLM_VERSION=0.34.0 bash bench/scripts/fetch_baselines.sh
#
# sgl_kernel is not fetched: its wheel (sgl-kernel 0.3.21) is 536 MB, the sm_90 library
# holding kvcacheio alone 361 MB, and it is built against torch 2.9.1 only
# (docs/benchmarks.md, "Baselines").
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
VERSION=${VLLM_VERSION:-0.33.0}
FILE=vllm/v1/kv_offload/cpu/swap_blocks_triton.py
DEST="$ROOT/.baselines/vllm"

if ! git -C "$ROOT" check-ignore -q .baselines/x 2>/dev/null; then
  echo "/.baselines/" >> "$ROOT/.git/info/exclude"
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$TMP" "vllm==$VERSION"
WHEEL=$(ls "$TMP"/vllm-*.whl)
mkdir -p "$DEST"
"$PY" - "$WHEEL" "$FILE" "$DEST" <<'PY'
import hashlib, pathlib, sys, zipfile
wheel, name, dest = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])
data = zipfile.ZipFile(wheel).read(name)
(dest / pathlib.Path(name).name).write_bytes(data)
digest = hashlib.sha256(pathlib.Path(wheel).read_bytes()).hexdigest()
(dest / "SOURCE.txt").write_text(f"{pathlib.Path(wheel).name} sha256 {digest}\n{name}\n")
print(f"extracted {name} ({len(data)} bytes) from {pathlib.Path(wheel).name} into {dest}")
PY
