#!/usr/bin/env bash
# Set up and run kvtier's whole test suite on a fresh machine (CPU: Triton's interpreter).
#   bash tests/run.sh            # from the repository root or anywhere
# Creates .venv (torch CPU build, community Triton, pytest, hypothesis, matplotlib, the
# store extra), starts the store servers the tests use on 127.0.0.1 (a Redis node and a
# 3+3 cluster, and TLS ones where redis-server has TLS: .ci/redis.sh; stopped by pid on exit), runs pytest, then Mooncake Store's
# tests beside a master and a store node of their own (.ci/mooncake.sh), SGLang's pools
# on kvtier (.ci/sglang.sh) and the direct launches under the oldest supported Triton
# (.ci/triton_min.sh). The Ascend checks (a second venv with
# triton-ascend, see .ci/ascend.sh) run beside all of that, in a second process: each
# suite runs its kernels in one interpreter thread, so two use a 2-core machine twice as
# well; their output follows the rest. KVTIER_SERIAL=1 runs them after the rest instead.
# Exits non-zero if any part failed (every part runs either way).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}   # the CPU build; on a GPU machine install the matching build first

[ -x .venv/bin/python ] || "$PY" -m venv .venv || exit 1
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "$TORCH_SPEC" || exit 1
.venv/bin/python -m pip install -q -e '.[cpu,test,bench,store]' || exit 1

ascend_pid=""
redis_dir=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-redis.XXXXXX")
cleanup() {
  [ -z "$ascend_pid" ] || kill "$ascend_pid" 2>/dev/null
  bash .ci/redis.sh stop "$redis_dir" >/dev/null 2>&1
}
trap cleanup EXIT
if [ "${KVTIER_SKIP_REDIS:-0}" != 1 ]; then
  if bash .ci/redis.sh install && bash .ci/redis.sh start "$redis_dir" >/dev/null; then
    . "$redis_dir/env"        # KVTIER_TEST_REDIS_URL, KVTIER_TEST_REDIS_CLUSTER_URL, KVTIER_TEST_REDIS_TLS_*
  else
    echo "tests/run.sh: the shared Redis servers did not start (above); the node and cluster tests" \
         "start their own, the TLS tests skip (and fail in CI)" >&2
  fi
fi

status=0
ascend=""
if [ -f .ci/ascend.sh ] && [ "${KVTIER_SKIP_ASCEND:-0}" != 1 ]; then ascend=1; fi
if [ -n "$ascend" ] && [ "${KVTIER_SERIAL:-0}" != 1 ]; then
  ascend_log=$(mktemp "${TMPDIR:-/tmp}/kvtier-ascend.XXXXXX")
  bash .ci/ascend.sh >"$ascend_log" 2>&1 &
  ascend_pid=$!
  echo "ascend: running beside the main suite (its output follows it)"
fi
# (Mooncake's tests run in .ci/mooncake.sh, beside servers of their own)
.venv/bin/python -m pytest -q -p no:cacheprovider --ignore-glob='tests/store/test_mooncake*' "$@" || status=1
[ "${KVTIER_SKIP_MOONCAKE:-0}" = 1 ] || bash .ci/mooncake.sh || status=1    # Mooncake Store
[ "${KVTIER_SKIP_SGLANG:-0}" = 1 ] || bash .ci/sglang.sh || status=1        # SGLang's own pools on kvtier
[ "${KVTIER_SKIP_TRITON_MIN:-0}" = 1 ] || bash .ci/triton_min.sh || status=1   # direct launches, oldest Triton
if [ -n "$ascend" ]; then
  if [ -n "$ascend_pid" ]; then
    wait "$ascend_pid" || status=1
    ascend_pid=""
    cat "$ascend_log"
    rm -f "$ascend_log"
  else
    bash .ci/ascend.sh || status=1
  fi
fi
[ "$status" = 0 ] || echo "tests/run.sh: a part failed (see above)"
exit "$status"
