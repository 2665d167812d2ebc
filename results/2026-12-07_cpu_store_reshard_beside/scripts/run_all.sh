#!/usr/bin/env bash
# Every figure of this folder's README, in the order they were taken. Needs the Redis
# node and cluster of `.ci/redis.sh start DIR` (their URLs in the environment: `. DIR/env`)
# and, for the before/after rows, the tree of 17fcd95 laid out as installed in $AT.
set -u
cd "$(dirname "$0")"
PY=${PY:-python}
AT=${AT:-/tmp/at-17fcd95}
out=..
: > $out/beside.txt; : > $out/one-batch.txt; : > $out/before-after.txt; : > $out/latency-file.txt
for url in file:///tmp/rb-store "$KVTIER_TEST_REDIS_URL" "$KVTIER_TEST_REDIS_CLUSTER_URL"; do
  for kib in 256 1024; do for layout in page_first_direct page_first; do
    $PY reshard_vs_one.py "$url" $kib $layout 21 --after >> $out/beside.txt
  done; done
done
for args in "file:///tmp/rb-store 256 64" "file:///tmp/rb-store 1024 16" "$KVTIER_TEST_REDIS_URL 1024 64" "$KVTIER_TEST_REDIS_URL 256 128"; do
  set -- $args
  for layout in page_first_direct page_first; do
    $PY reshard_vs_one.py "$1" $2 $layout 41 $3 --after >> $out/one-batch.txt
  done
done
for rep in 1 2; do
  for url in file:///tmp/rb-store "$KVTIER_TEST_REDIS_URL"; do for kib in 256 1024; do for layout in page_first_direct page_first; do
    echo -n "17fcd95  " >> $out/before-after.txt; KVTIER_AT=$AT $PY reshard_vs_one.py "$url" $kib $layout 15 >> $out/before-after.txt
    echo -n "this     " >> $out/before-after.txt; $PY reshard_vs_one.py "$url" $kib $layout 15 >> $out/before-after.txt
  done; done; done
done
for rep in 1 2; do
  for at in "$AT" ""; do
    echo "${at:+17fcd95}${at:-this}:" >> $out/latency-file.txt
    KVTIER_AT=$at $PY -c "import at_commit, sys; from kvtier.cli.main import main; sys.argv = ['kvtier', 'bench', '--store', 'file:///tmp/rb-lat', '--latency']; main()" \
      | grep -E '^ +[0-9]|^pages' >> $out/latency-file.txt
  done
done
