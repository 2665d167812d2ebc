# Sourced by the hardware scripts: make `import kvtier` work on a machine where it is not
# installed, by mapping the repository's package folders (as pyproject.toml does) into a
# temporary kvtier/ on PYTHONPATH. Uses $PY (default python3) and $ROOT (default: the
# repository this file is in). An installed kvtier that imports is used as it is.
ROOT=${ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
PY=${PY:-python3}
if ! "$PY" -c "import kvtier.kernels, kvtier.platforms, kvtier.pool, kvtier.autotune, kvtier.adapters, kvtier.cli" >/dev/null 2>&1; then
  SHIM=$(mktemp -d)
  mkdir -p "$SHIM/kvtier"
  ln -s "$ROOT"/kvtier/*.py "$SHIM/kvtier/"
  for pkg in kernels platforms pool autotune adapters cli bench; do
    if [ -d "$ROOT/$pkg" ]; then ln -s "$ROOT/$pkg" "$SHIM/kvtier/$pkg"; fi
  done
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  echo "== kvtier not installed: using the source tree through $SHIM"
fi
