"""Calls of a TP 8 -> TP 2 read of 64 MiB and of a read of the same bytes stored as one
object per page, interleaved call by call in one process: the mean and median wall and
CPU (this process) time per call, and the garbage collector's passes of each generation
and the time in them (`gc.callbacks`), per call, after 10 warm-up calls of each.

    python gc_calls.py URL PAGE_KIB LAYOUT [CALLS]
    KVTIER_AT=/tmp/at-b1c8ed0 python gc_calls.py ...     # another commit (at_commit.py)
"""
import at_commit  # noqa: F401
import collections
import gc
import statistics
import sys
import time
import uuid

import torch

from kvtier.store import bench
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

url, size, layout = sys.argv[1], int(sys.argv[2]) << 10, sys.argv[3]
calls = int(sys.argv[4]) if len(sys.argv) > 4 else 60
pages = max(4, min(1024, (64 << 20) // size))
engine = open_store(url)
host = bench.bench_host(size, pages, layout, heads=4, head_dim=128)
P = host.page_size
reader = StoreTier(host, engine, model="gc", tp=(0, 2), heads=8)
writers = [StoreTier(bench.bench_host(size, pages, layout, heads=1, page_size=P, head_dim=128),
                     engine, model="gc", tp=(r, 8), heads=8) for r in range(4)]
one = bench.one_object_tier(host, engine)
idx = torch.arange(pages * P, dtype=torch.int64)
keys = [uuid.uuid4().hex for _ in range(pages)]
for t in writers + [one]:
    assert all(t.backup(keys, idx))
arms = {"reshard": reader, "one": one}
times = {a: [] for a in arms}
passes = {a: collections.Counter() for a in arms}
in_gc = {a: 0.0 for a in arms}
now = {"arm": None, "t": 0.0}


def watch(phase, info):
    if now["arm"] is None:
        return
    if phase == "start":
        now["t"] = time.perf_counter()
    else:
        passes[now["arm"]][info["generation"]] += 1
        in_gc[now["arm"]] += time.perf_counter() - now["t"]


gc.callbacks.append(watch)
for i in range(10 + calls):
    for a, tier in arms.items():
        now["arm"] = a if i >= 10 else None
        c, t = time.process_time(), time.perf_counter()
        assert tier.prefetch(keys, idx) == pages
        if i >= 10:
            times[a].append((time.perf_counter() - t, time.process_time() - c))
        now["arm"] = None
gc.callbacks.remove(watch)
engine.delete([k for t in writers + [one] for p in keys for k in t.written_keys(p)])
for a in arms:
    w = [x * 1e3 for x, _ in times[a]]
    c = [x * 1e3 for _, x in times[a]]
    g = passes[a]
    print(f"{url.split(':')[0]:6} {size >> 10:>5} KiB {layout:18} {a:8} wall mean {statistics.mean(w):6.1f} "
          f"median {statistics.median(w):6.1f}  CPU mean {statistics.mean(c):6.1f} ms  "
          f"gc passes per call {g[0] / calls:5.2f} {g[1] / calls:5.2f} {g[2] / calls:5.3f}  "
          f"in gc {in_gc[a] * 1e3 / calls:5.2f} ms/call  ({calls} calls, {len(gc.get_objects())} tracked objects)")
