#!/usr/bin/env bash
# Redis servers for the store tests, on 127.0.0.1 only, each with a pidfile, stopped by pid.
#
#   bash .ci/redis.sh install                  redis-server + redis-tools from Debian, when missing
#   bash .ci/redis.sh start DIR                one node and a 3-master + 3-replica cluster under DIR,
#                                              and (where redis-server has TLS) two TLS nodes and a
#                                              3-master TLS cluster; writes DIR/env (export
#                                              KVTIER_TEST_REDIS_URL=..., see `start`) and prints it
#   bash .ci/redis.sh node DIR PORT [ARG...]   one node (ARG: more redis-server options)
#   bash .ci/redis.sh cluster DIR BASE [MASTERS [REPLICAS]]
#                                              a cluster on ports BASE.. (bus ports +10000)
#   bash .ci/redis.sh certs DIR                a test CA, a server and a client certificate in DIR/tls
#   bash .ci/redis.sh tls-node DIR PORT [ARG...]
#   bash .ci/redis.sh tls-cluster DIR BASE [MASTERS [REPLICAS]]
#                                              the same over TLS only (certificates: DIR/tls, made
#                                              when missing); client certificates optional
#   bash .ci/redis.sh stop DIR                 stop every server started under DIR, then remove DIR
#
# Ports for `start`: KVTIER_REDIS_PORT (26379), KVTIER_REDIS_CLUSTER_PORT (26380..26385),
# KVTIER_REDIS_TLS_PORT (26390: TLS, client certificates optional), KVTIER_REDIS_TLS_AUTH_PORT
# (26391: TLS, a client certificate required) and KVTIER_REDIS_TLS_CLUSTER_PORT (26392..26394).
# Nothing is persisted (no RDB, no AOF); data, logs, certificates and pidfiles live under DIR.
set -euo pipefail

die() { echo "redis.sh: $*" >&2; exit 1; }

install() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
     && command -v redis-benchmark >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "redis-server is missing and installing it needs root (apt-get install redis-server)"
  command -v apt-get >/dev/null || die "redis-server is missing and there is no apt-get to install it"
  echo "redis.sh: installing redis-server (Debian)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
  command -v redis-server >/dev/null || die "apt-get did not install redis-server"
}

# redis-cli as the servers want it: over TLS (with the client certificate) once `tls` ran.
cli=(redis-cli)
tls_args=()
ping() { "${cli[@]}" -h 127.0.0.1 -p "$1" ping 2>/dev/null | grep -Eq 'PONG|NOAUTH'; }   # NOAUTH: up, with a password

# certs DIR: under DIR/tls a CA (ca.crt), a server certificate signed by it for 127.0.0.1
# and localhost (server.crt, server.key; also usable as a client's, as the cluster bus
# needs), a server certificate for another name only (wrong-host.crt, .key: DNS
# elsewhere.invalid), a client certificate (client.crt, client.key), and a second CA that
# signed none of them (other-ca.crt). EC P-256 keys, valid 30 days. Kept where there.
certs() {
  local d=$1/tls
  [ -s "$d/other-ca.crt" ] && return 0
  command -v openssl >/dev/null || die "openssl is not installed (it makes the TLS test certificates)"
  mkdir -p "$d"
  touch "$1/.kvtier-redis"
  local key=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
  ca() {      # ca NAME SUBJECT
    openssl req -x509 "${key[@]}" -keyout "$d/$1.key" -out "$d/$1.crt" -days 30 -subj "$2" \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign
  }
  leaf() {    # leaf NAME SUBJECT EXTENSIONS: a certificate signed by ca.crt
    openssl req -new "${key[@]}" -keyout "$d/$1.key" -out "$d/$1.csr" -subj "$2"
    printf '%s\n' "basicConstraints=critical,CA:FALSE" "keyUsage=critical,digitalSignature" \
      "subjectKeyIdentifier=hash" "authorityKeyIdentifier=keyid" "$3" >"$d/$1.ext"
    openssl x509 -req -in "$d/$1.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
      -out "$d/$1.crt" -days 30 -extfile "$d/$1.ext"
  }
  {
    ca ca "/CN=kvtier test CA"
    leaf server "/CN=localhost" "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth,clientAuth"
    leaf wrong-host "/CN=elsewhere.invalid" "subjectAltName=DNS:elsewhere.invalid
extendedKeyUsage=serverAuth"
    leaf client "/CN=kvtier test client" "extendedKeyUsage=clientAuth"
    ca other-ca "/CN=kvtier other CA"
  } >"$d/openssl.log" 2>&1 || die "openssl could not make the test certificates (see $d/openssl.log)"
}

# tls DIR: from now on servers listen on TLS only (their port the TLS port, plain port 0)
# with the certificates of DIR/tls, and redis-cli reaches them over TLS.
tls() {
  local d=$1/tls
  certs "$1"
  tls_args=(--port 0 --tls-cert-file "$d/server.crt" --tls-key-file "$d/server.key"
            --tls-ca-cert-file "$d/ca.crt" --tls-auth-clients optional)
  cli=(redis-cli --tls --cacert "$d/ca.crt" --cert "$d/client.crt" --key "$d/client.key")
}

# Whether redis-server was built with TLS (without, it rejects tls-port as a bad directive).
tls_supported() {
  local out
  out=$(redis-server --port 0 --tls-port 0 --save '' --logfile '' 2>&1 </dev/null) || true   # exits either way
  ! grep -q 'Bad directive' <<<"$out"
}

# node DIR PORT [ARG...]: start one daemonized redis-server and wait until it answers.
node() {
  local dir=$1 port=$2; shift 2
  command -v redis-server >/dev/null || die "redis-server is not installed (bash .ci/redis.sh install)"
  [[ $port =~ ^[0-9]+$ ]] || die "bad port '$port'"
  mkdir -p "$dir/$port"
  touch "$dir/.kvtier-redis"
  ! ping "$port" || die "port $port already has a Redis server"
  local listen=(--port "$port")
  [ ${#tls_args[@]} = 0 ] || listen=(--tls-port "$port" "${tls_args[@]}")
  redis-server "${listen[@]}" --bind 127.0.0.1 --protected-mode yes \
    --daemonize yes --pidfile "$dir/$port/redis.pid" --dir "$dir/$port" \
    --logfile "$dir/$port/redis.log" --save '' --appendonly no "$@" \
    || die "redis-server on port $port did not start (see $dir/$port/redis.log)"
  for _ in $(seq 100); do
    if [ -s "$dir/$port/redis.pid" ] && ping "$port"; then return 0; fi
    sleep 0.05
  done
  die "redis-server on port $port does not answer (see $dir/$port/redis.log)"
}

# cluster DIR BASE [MASTERS [REPLICAS]]: MASTERS*(1+REPLICAS) nodes on BASE.., created and
# waited for: the cluster state is ok on every node and every replica's link is up.
cluster() {
  local dir=$1 base=$2 masters=${3:-3} replicas=${4:-1}
  local n=$((masters * (1 + replicas))) addrs=() port bus=()
  # Over TLS the cluster bus and replication are TLS too, and nodes announce TLS ports.
  [ ${#tls_args[@]} = 0 ] || bus=(--tls-cluster yes --tls-replication yes)
  for ((i = 0; i < n; i++)); do
    port=$((base + i))
    # A node fails over after 1 s without its master; its replica may always take over; a
    # shard's loss does not stop the others; replicas sync over the socket at once.
    node "$dir" "$port" --cluster-enabled yes --cluster-config-file nodes.conf \
      --cluster-node-timeout 1000 --cluster-replica-validity-factor 0 \
      --cluster-require-full-coverage no --repl-diskless-sync yes --repl-diskless-sync-delay 0 "${bus[@]}"
    addrs+=("127.0.0.1:$port")
  done
  "${cli[@]}" --cluster create "${addrs[@]}" --cluster-replicas "$replicas" --cluster-yes >"$dir/create.log" 2>&1 \
    || die ""${cli[@]}" --cluster create failed (see $dir/create.log)"
  # Ready: every node sees MASTERS masters and MASTERS*REPLICAS replicas, all connected and none
  # failing, the state is ok, and every replica's link to its master is up.
  local ok view
  for _ in $(seq 300); do
    ok=1
    for ((i = 0; i < n; i++)); do
      port=$((base + i))
      "${cli[@]}" -p "$port" cluster info | grep -q 'cluster_state:ok' || { ok=0; break; }
      view=$("${cli[@]}" -p "$port" cluster nodes)
      [ "$(grep -c ' connected' <<<"$view")" = "$n" ] || { ok=0; break; }
      [ "$(grep -Ec 'master|slave' <<<"$view")" = "$n" ] || { ok=0; break; }
      [ "$(grep -c 'slave' <<<"$view")" = "$((masters * replicas))" ] || { ok=0; break; }
      ! grep -Eq 'fail|handshake|noaddr' <<<"$view" || { ok=0; break; }
      if grep -q 'myself,slave' <<<"$view"; then
        "${cli[@]}" -p "$port" info replication | grep -q 'master_link_status:up' || { ok=0; break; }
      fi
    done
    [ "$ok" = 1 ] && return 0
    sleep 0.1
  done
  die "the cluster on ports $base.. is not ready after 30 s"
}

start() {
  local dir=$1 port=${KVTIER_REDIS_PORT:-26379} base=${KVTIER_REDIS_CLUSTER_PORT:-26380}
  node "$dir" "$port"
  cluster "$dir" "$base" 3 1
  local seeds=""
  for ((i = 0; i < 6; i++)); do seeds+="${seeds:+,}127.0.0.1:$((base + i))"; done
  {
    echo "export KVTIER_TEST_REDIS_URL=redis://127.0.0.1:$port"
    echo "export KVTIER_TEST_REDIS_CLUSTER_URL=redis+cluster://$seeds"
  } >"$dir/env"
  start_tls "$dir"
  cat "$dir/env"
}

# start_tls DIR: TLS servers beside the plain ones, and their variables in DIR/env:
#   KVTIER_TEST_REDIS_TLS_DIR          the certificates (ca.crt, client.crt/.key, other-ca.crt)
#   KVTIER_TEST_REDIS_TLS_URL          a node, client certificates optional (rediss://...?ca=...)
#   KVTIER_TEST_REDIS_TLS_AUTH_URL     a node that requires a client certificate (the URL names
#                                      the CA only: a test adds cert= and key=)
#   KVTIER_TEST_REDIS_TLS_CLUSTER_URL  a 3-master cluster, TLS on its bus too (rediss+cluster://)
# Without TLS in redis-server or without openssl, one line says so and none is set.
start_tls() {
  local dir=$1 port=${KVTIER_REDIS_TLS_PORT:-26390} auth=${KVTIER_REDIS_TLS_AUTH_PORT:-26391}
  local base=${KVTIER_REDIS_TLS_CLUSTER_PORT:-26392}
  if ! tls_supported; then
    echo "redis.sh: redis-server has no TLS support; the TLS servers are not started" >&2
    return 0
  fi
  if ! command -v openssl >/dev/null; then
    echo "redis.sh: openssl is not installed; the TLS servers are not started" >&2
    return 0
  fi
  tls "$dir"
  node "$dir" "$port"
  node "$dir" "$auth" --tls-auth-clients yes
  cluster "$dir" "$base" 3 0
  local d=$dir/tls
  {
    echo "export KVTIER_TEST_REDIS_TLS_DIR=$d"
    echo "export KVTIER_TEST_REDIS_TLS_URL='rediss://127.0.0.1:$port?ca=$d/ca.crt'"
    echo "export KVTIER_TEST_REDIS_TLS_AUTH_URL='rediss://127.0.0.1:$auth?ca=$d/ca.crt'"
    echo "export KVTIER_TEST_REDIS_TLS_CLUSTER_URL='rediss+cluster://127.0.0.1:$base,127.0.0.1:$((base + 1))?ca=$d/ca.crt'"
  } >>"$dir/env"
}

# stop DIR: TERM each server by its pidfile (CONT too, in case a test stopped it); once it
# has shut down (it removes its pidfile; its exit takes seconds more) or after 5 s, KILL it;
# then remove DIR. Only redis-server processes are signalled.
stop() {
  local dir=$1 pid pids=() files=()
  [ -d "$dir" ] || return 0
  if [ ! -e "$dir/.kvtier-redis" ]; then
    rmdir "$dir" 2>/dev/null && return 0          # empty: nothing was started there
    die "$dir was not made by redis.sh; not touching it"
  fi
  for f in "$dir"/*/redis.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    [[ $pid =~ ^[0-9]+$ ]] || continue
    grep -q redis-server "/proc/$pid/comm" 2>/dev/null || continue
    kill -TERM "$pid" 2>/dev/null || true
    kill -CONT "$pid" 2>/dev/null || true
    pids+=("$pid")
    files+=("$f")
  done
  for i in "${!pids[@]}"; do
    for _ in $(seq 100); do
      [ -e "${files[$i]}" ] && kill -0 "${pids[$i]}" 2>/dev/null || break
      sleep 0.05
    done
    kill -KILL "${pids[$i]}" 2>/dev/null || true
  done
  rm -rf "$dir"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  install) install ;;
  start) [ $# = 1 ] || die "usage: redis.sh start DIR"; start "$1" ;;
  node) [ $# -ge 2 ] || die "usage: redis.sh node DIR PORT [ARG...]"; node "$@" ;;
  cluster) [ $# -ge 2 ] || die "usage: redis.sh cluster DIR BASE [MASTERS [REPLICAS]]"; cluster "$@" ;;
  certs) [ $# = 1 ] || die "usage: redis.sh certs DIR"; certs "$1" ;;
  tls-node) [ $# -ge 2 ] || die "usage: redis.sh tls-node DIR PORT [ARG...]"; tls "$1"; node "$@" ;;
  tls-cluster) [ $# -ge 2 ] || die "usage: redis.sh tls-cluster DIR BASE [MASTERS [REPLICAS]]"; tls "$1"; cluster "$@" ;;
  stop) [ $# = 1 ] || die "usage: redis.sh stop DIR"; stop "$1" ;;
  *) die "usage: redis.sh install | start DIR | node DIR PORT [ARG...] | cluster DIR BASE [MASTERS [REPLICAS]] | certs DIR | tls-node DIR PORT [ARG...] | tls-cluster DIR BASE [MASTERS [REPLICAS]] | stop DIR" ;;
esac
