"""A reshard read's objects placed in their host pages as they land against after the
engine's call, interleaved in one process (medians of 12 reads of 64 MiB per row):
what `kvtier.store.tier.PLACE_ON_LANDING_MIN` is set from.

    python place_ab.py file:///tmp/place-ab
    python place_ab.py redis://127.0.0.1:26379
"""
import os
import statistics
import sys
import time

import torch

from kvtier.store import bench
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

engine = open_store(sys.argv[1])
heads, wtp, rtp, hd = 8, 8, 2, 128
for size in [int(x) << 10 for x in os.environ.get("SIZES", "256 512 1024 2048 4096 16384").split()]:
    for layout in ("page_first_direct", "page_first"):
        pages = max(4, min(1024, (64 << 20) // size))
        host = bench.bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd)
        P = host.page_size
        reader = StoreTier(host, engine, model="place-ab", tp=(0, rtp), heads=heads)
        writers = [StoreTier(bench.bench_host(size, pages, layout, heads=heads // wtp, page_size=P, head_dim=hd),
                             engine, model="place-ab", tp=(r, wtp), heads=heads) for r in range(wtp // rtp)]
        idx = torch.arange(pages * P)
        keys = [f"place-ab-{size}-{layout}-{i}" for i in range(pages)]
        for w in writers:
            assert all(w.backup(keys, idx))
        m, res = reader.read.m, {True: [], False: []}
        for r in range(12):
            for flag in (True, False)[::1 if r % 2 else -1]:
                reader.read.place_on_landing = [flag] * m
                t = time.perf_counter()
                assert reader.prefetch(keys, idx) == pages
                res[flag].append(time.perf_counter() - t)
        print(f"{size >> 10:6} KiB {layout:18} objects of {reader.canonical.objects[0].payload_bytes >> 10:5} KiB: "
              f"as they land {statistics.median(res[True]) * 1e3:6.1f} ms, after the call "
              f"{statistics.median(res[False]) * 1e3:6.1f} ms")
        engine.delete([k for w in writers for p in keys for k in w.written_keys(p)])
        for t in writers + [reader]:
            t.close()
engine.close()
