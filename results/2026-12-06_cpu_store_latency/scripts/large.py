import os, sys, time, uuid, statistics
import torch
from kvtier.store.bench import bench_host
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier
url = sys.argv[1]
e = open_store(url)
out = []
for size, layout in ((256 << 10, "page_first_direct"), (1 << 20, "page_first_direct"), (1 << 20, "page_first")):
    pages = (64 << 20) // size
    host = bench_host(size, pages, layout)
    tier = StoreTier(host, e, model="large")
    idx = torch.arange(pages * host.page_size, dtype=torch.int64)
    b, p = [], []
    for r in range(8):
        keys = [uuid.uuid4().hex for _ in range(pages)]
        t = time.perf_counter(); tier.backup(keys, idx); b.append(time.perf_counter() - t)
        t = time.perf_counter(); assert tier.prefetch(keys, idx) == pages; p.append(time.perf_counter() - t)
        e.delete([tier.key(k) for k in keys])
    tier.close()
    out.append(f"{size>>10}K {layout[:12]} backup {64/1024/statistics.median(b[1:]) * 1.048576:.2f} prefetch {64/1024/statistics.median(p[1:]) * 1.048576:.2f}")
print(" | ".join(out))
