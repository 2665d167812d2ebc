"""Where a TP 8 -> TP 2 reshard read's time goes, beside the one-object read of the
same bytes (the bench's reshard rows, `kvtier.store.bench`), on the file store.

    python reshard_breakdown.py URL PAGE_BYTES LAYOUT

Prints, per read (mean of 5 prefetches of 64 MiB of pages), the wall time and the time
summed over all threads inside the file engine's reads, the checksum verification and
the staged copy (`kvtier.store.canonical.copy_pages`).
"""
import collections
import sys
import time

import torch

from kvtier.store import bench, canonical, file as file_engine, page
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

spent = collections.Counter()


def timed(fn, label):
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[label] += time.perf_counter() - t
    return call


canonical.copy_pages = timed(canonical.copy_pages, "copy")
file_engine.FileEngine._read = staticmethod(timed(file_engine.FileEngine._read, "read"))
page.PageFormat.verify = timed(page.PageFormat.verify, "verify")

url, size, layout = sys.argv[1], int(sys.argv[2]), sys.argv[3]
engine = open_store(url)
pages = max(16, min(1024, (64 << 20) // size))
host = bench.bench_host(size, pages, layout, heads=4)
P = host.page_size
reader = StoreTier(host, engine, model="breakdown", tp=(0, 2), heads=8)
writers = [StoreTier(bench.bench_host(size, pages, layout, heads=1, page_size=P), engine, model="breakdown",
                     tp=(r, 8), heads=8) for r in range(4)]
one = bench.one_object_tier(host, engine)
idx = torch.arange(pages * P)
keys = [f"breakdown-{i}" for i in range(pages)]
for t in writers + [one]:
    assert all(t.backup(keys, idx))
try:
    for name, tier in (("reshard", reader), ("one object", one)) * 2:
        spent.clear()
        t0 = time.perf_counter()
        for _ in range(5):
            assert tier.prefetch(keys, idx) == pages
        wall = (time.perf_counter() - t0) / 5
        print(f"{url} {layout} {size >> 10} KiB {name:10}: wall {wall * 1e3:5.1f} ms; "
              + ", ".join(f"{k} {v / 5 * 1e3:.1f} ms" for k, v in sorted(spent.items())))
finally:
    engine.delete([k for w in writers + [one] for p in keys for k in w.written_keys(p)])
    engine.close()
