#!/usr/bin/env bash
# gc_calls.py at b1c8ed0 ($AT, laid out as installed: README) and at this folder's
# commit, alternated, twice per case; the Redis URLs from `. DIR/env` (.ci/redis.sh).
set -u
cd "$(dirname "$0")"
PY=${PY:-../../../.venv/bin/python}
AT=${AT:-/tmp/at-b1c8ed0}
for rep in 1 2; do
  for args in "file:///tmp/gc-file 256 page_first_direct" "$KVTIER_TEST_REDIS_URL 256 page_first_direct" \
              "$KVTIER_TEST_REDIS_URL 256 page_first" "$KVTIER_TEST_REDIS_URL 1024 page_first_direct" \
              "$KVTIER_TEST_REDIS_CLUSTER_URL 256 page_first_direct"; do
    set -- $args
    echo -n "b1c8ed0  "; KVTIER_AT=$AT $PY gc_calls.py "$@" 60 | tr '\n' '|' | sed 's/|$/\n/; s/|/\n         /'
    echo -n "this     "; $PY gc_calls.py "$@" 60 | tr '\n' '|' | sed 's/|$/\n/; s/|/\n         /'
  done
done
rm -rf /tmp/gc-file
