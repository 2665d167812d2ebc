"""Where a one-page prefetch's time goes on a Redis node: the raw GET, the engine's
get_into with the tier's buffers, the verification, and the whole prefetch (us per call).

    KVTIER_TEST_REDIS_URL=redis://127.0.0.1:26379 python latency_breakdown.py
"""
import os, time, torch
from kvtier.store import bench
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier
e = open_store(os.environ["KVTIER_TEST_REDIS_URL"])
host = bench.bench_host(256<<10, 8, "page_first_direct")
t = bench.one_object_tier(host, e)
P = host.page_size; idx = torch.arange(P); keys = ["lat-prof"]
assert t.backup(keys, idx) == [True]
cp = t.read.canonical; fmt = t.read.formats[0]
k = t.keys("lat-prof")
pieces = cp.pieces(0, None, 0, 0)
hdr = bytearray(fmt.header_size(k[0]))
bufs = [[hdr, *pieces]]
raw = e.raw_calls(262416, 1); raw.set()
def tm(f, n=3000):
    for _ in range(100): f()
    a=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-a)/n*1e6
for rnd in range(2):
    print("raw get", tm(raw.get))
    print("engine.get_into", tm(lambda: e.get_into(k, bufs, None)))
    print("engine.get_into+landed", tm(lambda: e.get_into(k, bufs, lambda j: None)))
    print("verify", tm(lambda: fmt.verify(k[0], hdr, pieces)))
    print("prefetch", tm(lambda: t.prefetch(keys, idx)))
raw.close()
