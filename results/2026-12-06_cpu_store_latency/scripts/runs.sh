#!/bin/bash
# before (1cb9b23, /tmp/venv-base) and after (/tmp/venv-latency), alternating, 3 rounds per store
. /tmp/lat-redis/env
out=/tmp/lat/runs
declare -A URL=([file]="file:///tmp/lat/fs" [node]="$KVTIER_TEST_REDIS_URL" [cluster]="$KVTIER_TEST_REDIS_CLUSTER_URL")
for store in file node cluster; do
  for r in 1 2 3; do
    for v in base latency; do
      name=$([ $v = base ] && echo before || echo after)
      /tmp/venv-$v/bin/kvtier bench --store "${URL[$store]}" --latency --quiet --json $out/$name-$store-$r.json > $out/$name-$store-$r.txt 2>&1 || echo "FAILED $name $store $r"
    done
  done
done
echo done
