#!/usr/bin/env bash
# Every figure of this folder's README: `kvtier bench --store URL --reshard` on each store,
# one after the other, nothing else running. Needs the Redis node and cluster of
# `.ci/redis.sh start DIR` (their URLs in the environment: `. DIR/env`); Mooncake Store
# runs under `.ci/mooncake.sh`. Run from the repository root with .venv built.
set -u
D=${OUT:-results/2026-12-08_cpu_store_reshard_engine_alone}
K=.venv/bin/kvtier
rm -rf /tmp/rea-file
$K bench --store file:///tmp/rea-file --reshard --json $D/reshard-file.json > $D/reshard-file.txt 2>&1
$K bench --store "$KVTIER_TEST_REDIS_URL" --reshard --json $D/reshard-redis.json > $D/reshard-redis.txt 2>&1
$K bench --store "$KVTIER_TEST_REDIS_CLUSTER_URL" --reshard --json $D/reshard-redis_cluster.json > $D/reshard-redis_cluster.txt 2>&1
bash .ci/mooncake.sh bash -c "$K bench --store \"\$KVTIER_TEST_MOONCAKE_URL\" --reshard --json $D/reshard-mooncake.json" > $D/reshard-mooncake.txt 2>&1
rm -rf /tmp/rea-file
