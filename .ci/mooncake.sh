#!/usr/bin/env bash
# Mooncake Store for kvtier's tests: installs the client wheel and libibverbs1, starts a
# Mooncake master and one store node (mooncake_client lending 512 MiB) on 127.0.0.1 with
# pidfiles, exports KVTIER_TEST_MOONCAKE_URL, runs a command, and stops both by pid.
#
#   bash .ci/mooncake.sh                 # the Mooncake tests (tests/store/test_mooncake*.py)
#   bash .ci/mooncake.sh CMD [ARG...]    # any command, with KVTIER_TEST_MOONCAKE_URL set
#
# Mooncake's transfer engine (in the store node and in every client, the test process
# included) listens on all interfaces for its data and handshake ports; it has no bind
# option. So where `unshare --net` works (root), everything runs in a private network
# namespace whose only interface is loopback; elsewhere one line says what listens where.
# KVTIER_MOONCAKE_NETNS=0 keeps the host's namespace.
#
# The wheel goes into .venv: mooncake-transfer-engine-non-cuda (CPU hosts) unless a
# `mooncake` module is already there (GPU hosts install mooncake-transfer-engine, the
# same module built with CUDA; KVTIER_MOONCAKE_WHEEL names another). Where the wheel or
# libibverbs1 cannot be had, one line says so and the script exits 0, or 1 in CI
# (CI=1 or KVTIER_CI=1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${KVTIER_PYTHON:-.venv/bin/python}
WHEEL=${KVTIER_MOONCAKE_WHEEL:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
SEGMENT=${KVTIER_MOONCAKE_SEGMENT:-512MB}
in_ci() { [ "${CI:-}" = 1 ] || [ "${CI:-}" = true ] || [ "${KVTIER_CI:-}" = 1 ]; }
give_up() {   # one line; a failure in CI, a skip elsewhere
  if in_ci; then echo "mooncake: FAILED: $*"; exit 1; fi
  echo "mooncake: skipped: $*"; exit 0
}
[ "$#" -gt 0 ] || set -- "$PY" -m pytest -q -p no:cacheprovider tests/store/test_mooncake*.py

if [ "${1:-}" != "--inside" ] && [ "${1:-}" != "--inside-netns" ]; then
  [ -x "$PY" ] || give_up "$PY not found (bash tests/run.sh builds it)"
  # libibverbs1: the wheel's engine.so links it even for TCP.
  if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) \
        >/dev/null 2>&1 || give_up "apt-get install libibverbs1 failed"
    else
      give_up "libibverbs1 is missing (apt-get install libibverbs1, as root)"
    fi
  fi
  if ! "$PY" -c "import mooncake.store" >/dev/null 2>&1; then
    "$PY" -m pip install -q "$WHEEL" >/dev/null 2>&1 || give_up "pip install $WHEEL failed"
    "$PY" -c "import mooncake.store" >/dev/null 2>&1 \
      || give_up "$("$PY" -c 'import mooncake.store' 2>&1 | tail -1)"
  fi
  if [ "${KVTIER_MOONCAKE_NETNS:-1}" = 1 ] && command -v ip >/dev/null \
     && unshare --net true >/dev/null 2>&1; then
    exec unshare --net bash "$0" --inside-netns "$@"
  fi
  echo "mooncake: not in a private network namespace (KVTIER_MOONCAKE_NETNS=0, or no root," \
       "unshare or ip); Mooncake's transfer engine listens on all interfaces meanwhile"
  set -- --inside "$@"
fi
netns=0
if [ "$1" = --inside-netns ]; then
  ip link set lo up || give_up "cannot bring loopback up in the network namespace"
  netns=1
fi
shift
BIN=$(dirname "$PY")
RUN=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-mooncake.XXXXXX")
free_port() {
  "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
stop() {
  for name in store master; do
    [ -f "$RUN/$name.pid" ] || continue
    pid=$(cat "$RUN/$name.pid")
    kill "$pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
  rm -rf "$RUN"
}
trap stop EXIT
MASTER_PORT=$(free_port); METRICS_PORT=$(free_port); STORE_PORT=$(free_port)

"$BIN/mooncake_master" --rpc_address=127.0.0.1 --rpc_port="$MASTER_PORT" \
  --metrics_host=127.0.0.1 --metrics_port="$METRICS_PORT" \
  --enable_http_metadata_server=false >"$RUN/master.log" 2>&1 &
echo $! >"$RUN/master.pid"
"$BIN/mooncake_client" --host=127.0.0.1 --port="$STORE_PORT" --global_segment_size="$SEGMENT" \
  --master_server_address="127.0.0.1:$MASTER_PORT" --metadata_server=P2PHANDSHAKE \
  --protocol=tcp >"$RUN/store.log" 2>&1 &
echo $! >"$RUN/store.pid"

# Ready: the master lists the store node's segment.
ready=0
for _ in $(seq 100); do
  if "$PY" - "$METRICS_PORT" <<'EOF' 2>/dev/null; then ready=1; break; fi
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/get_all_segments", timeout=1) as r:
    sys.exit(0 if r.read().strip() else 1)
EOF
  sleep 0.1
done
if [ "$ready" != 1 ]; then
  tail -5 "$RUN/master.log" "$RUN/store.log"
  give_up "the Mooncake master or store node did not come up"
fi

# Nothing reachable from off this host: the master's sockets are bound to 127.0.0.1;
# the transfer engine's wildcard ones are confined to this namespace where there is one.
pids="$(cat "$RUN/master.pid")|$(cat "$RUN/store.pid")"
command -v ss >/dev/null || echo "mooncake: ss not found; listening sockets not checked"
outside=$(ss -ltnpH 2>/dev/null | grep -E "pid=($pids)," | awk '{print $4}' \
          | grep -vE '^(127\.[0-9.]+|\[::1\]):[0-9]+$' || true)
if [ -n "$outside" ] && [ "$netns" != 1 ]; then
  echo "mooncake: listening beyond loopback: $(echo $outside | tr '\n' ' ')"
elif [ -n "$outside" ]; then
  echo "mooncake: master on 127.0.0.1:$MASTER_PORT; the transfer engine's wildcard ports" \
       "($(echo $outside | tr '\n' ' ')) are in a network namespace with loopback only"
else
  echo "mooncake: master on 127.0.0.1:$MASTER_PORT; nothing listens beyond loopback"
fi

export KVTIER_TEST_MOONCAKE_URL="mooncake://127.0.0.1:$MASTER_PORT"
"$@"
