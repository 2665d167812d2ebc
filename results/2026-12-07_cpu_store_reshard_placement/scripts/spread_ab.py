"""The file store's reads of a reshard's objects on one thread against two (every call
spread, `READ_SPREAD_VALUE` set to 0), interleaved in one process (medians of 12 reads
of 64 MiB per row): what `kvtier.store.file.READ_SPREAD_VALUE` is set from.

    python spread_ab.py /tmp/spread-ab
    ONE=1 python spread_ab.py /tmp/spread-ab      # pages stored as one object each
"""
import os
import statistics
import sys
import time

import torch

from kvtier.store import bench
from kvtier.store import file as file_module
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

root = sys.argv[1]
file_module.READ_SPREAD_VALUE = 0
engines = {n: open_store(f"file://{root}?threads={n}") for n in (1, 2)}
heads, wtp, rtp, hd = 8, 8, 2, 128
for size in [int(x) << 10 for x in os.environ.get("SIZES", "256 512 1024 2048").split()]:
    layout = "page_first_direct"
    pages = max(4, min(1024, (64 << 20) // size))
    host = bench.bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd)
    P = host.page_size
    if os.environ.get("ONE"):
        readers = {n: bench.one_object_tier(host, e) for n, e in engines.items()}
        writers = [readers[2]]
    else:
        readers = {n: StoreTier(host, e, model="spread-ab", tp=(0, rtp), heads=heads) for n, e in engines.items()}
        writers = [StoreTier(bench.bench_host(size, pages, layout, heads=heads // wtp, page_size=P, head_dim=hd),
                             engines[2], model="spread-ab", tp=(r, wtp), heads=heads) for r in range(wtp // rtp)]
    idx = torch.arange(pages * P)
    keys = [f"spread-ab-{size}-{i}" for i in range(pages)]
    for w in writers:
        assert all(w.backup(keys, idx))
    res = {1: [], 2: []}
    for r in range(12):
        for n in (1, 2)[::1 if r % 2 else -1]:
            t = time.perf_counter()
            assert readers[n].prefetch(keys, idx) == pages
            res[n].append(time.perf_counter() - t)
    print(f"objects of {readers[1].canonical.objects[0].payload_bytes >> 10:5} KiB: one thread "
          f"{statistics.median(res[1]) * 1e3:6.1f} ms, two {statistics.median(res[2]) * 1e3:6.1f} ms")
    engines[2].delete([k for w in writers for p in keys for k in w.written_keys(p)])
    for t in set(writers + list(readers.values())):
        t.close()
for e in engines.values():
    e.close()
