# Sourced by .ci/sglang.sh and .ci/triton_min.sh: pinned packages installed with --no-deps
# into a target directory that the caller puts on PYTHONPATH for one pytest run (beside
# the main .venv, whose torch is reused), kept while its marker matches the pins.
#
# pinned_target NAME PYTHON TARGET PIN...: returns 0 when TARGET holds the pins (installed
# now or kept from before); 1, after one line naming NAME, where they cannot be installed
# (no network, another Python than a wheel's).
pinned_target() {
  local name=$1 py=$2 target=$3 log
  shift 3
  [ "$(cat "$target/.kvtier-pins" 2>/dev/null)" = "$*" ] && return 0
  echo "$name: installing $1 and $(($# - 1)) more pinned packages into $target"
  rm -rf "$target"
  log=$(mktemp)
  if ! "$py" -m pip install -q --no-deps --only-binary=:all: --target "$target" "$@" >"$log" 2>&1; then
    echo "$name: skipped: the pinned packages could not be installed ($(grep -m1 ERROR "$log" || tail -n1 "$log"))"
    rm -rf "$target" "$log"
    return 1
  fi
  rm -f "$log"
  echo "$*" > "$target/.kvtier-pins"
}
