"""Where a one-page prefetch on a Redis node spends its time: a timestamp at the entry
and the exit of each step (each wrapper costs about 1 us), medians over N calls, each
call after a backup of fresh keys as in the bench, and a raw GET of the same bytes.

    KVTIER_TEST_REDIS_URL=redis://127.0.0.1:26379 python timeline.py [LAYOUT] [N]
"""
import functools
import os
import statistics
import sys
import time
import uuid

import torch

from kvtier.store import bench, page, redis, resp
from kvtier.store import engine as engine_module
from kvtier.store import tier as tier_module
from kvtier.store.engine import open_store

layout = sys.argv[1] if len(sys.argv) > 1 else "page_first_direct"
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
WARMUP = 20
engine = open_store(os.environ["KVTIER_TEST_REDIS_URL"])
host = bench.bench_host(256 << 10, 8, layout)
tier = bench.one_object_tier(host, engine)
idx = torch.arange(host.page_size)
ns = time.perf_counter_ns
marks, on = [], [False]


def wrap(owner, attr, name):
    f = getattr(owner, attr)

    @functools.wraps(f)
    def timed(*a, **k):
        if on[0]:
            marks.append((name + ">", ns()))
        try:
            return f(*a, **k)
        finally:
            if on[0]:
                marks.append((name + "<", ns()))
    setattr(owner, attr, timed)


for attr in ("_keys", "_pages", "_receivers", "_get", "_verified"):
    wrap(tier_module.StoreTier, attr, attr)
wrap(engine, "get_ahead", "engine.get_ahead")
wrap(engine_module.PendingGet, "into", "PendingGet.into")
wrap(redis._RedisEngine, "_send_ahead", "_send_ahead")
wrap(redis._RedisEngine, "_task", "task")
wrap(resp.Connection, "send", "send")
wrap(resp.Connection, "read_line", "read_line")
wrap(resp.Connection, "read_into", "read_into")
wrap(page.PageFormat, "verify", "verify")

raw = engine.raw_calls(tier.canonical.payload_bytes + tier.format.header_size(tier.key("x")), 1)
steps, raw_get = {}, []
for r in range(N + WARMUP):
    keys = [f"timeline-{uuid.uuid4().hex}"]
    assert tier.backup(keys, idx) == [True]
    marks.clear()
    on[0] = True
    t0 = ns()
    assert tier.prefetch(keys, idx) == 1
    t1 = ns()
    on[0] = False
    raw.set()
    g0 = ns()
    raw.get()
    g1 = ns()
    engine.delete([tier.key(k) for k in keys])
    raw.clear()
    if r < WARMUP:
        continue
    raw_get.append(g1 - g0)
    prev = t0
    for i, (name, t) in enumerate(marks + [("return", t1)]):
        steps.setdefault((i, name), []).append(t - prev)
        prev = t
total = 0.0
print(f"one-page prefetch, {layout}, Redis node: medians of {N} calls, us")
for (i, name), ds in sorted(steps.items()):
    m = statistics.median(ds) / 1e3
    total += m
    print(f"{i:2d} until {name:22s} {m:7.1f}")
print(f"sum of the medians {total:.1f} us; raw GET of the same bytes {statistics.median(raw_get) / 1e3:.1f} us")
raw.close()
tier.close()
engine.close()
