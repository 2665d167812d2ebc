"""A reshard read's placement three ways, interleaved in one process (medians of 12
reads of 64 MiB per row): objects placed as they land, one at a time ("landing");
after the engine's call, object by object ("after, per object"); after the call, all
of a page's objects in one copy per run of pages ("after, folded": `canonical._fused`).

    python fused_ab.py file:///tmp/fused-ab
    python fused_ab.py redis://127.0.0.1:26379
"""
import os
import statistics
import sys
import time

import torch

from kvtier.store import bench, canonical
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

engine = open_store(sys.argv[1])
heads, wtp, rtp, hd = 8, 8, 2, 128
real_fused = canonical._fused
ARMS = ("landing", "after, per object", "after, folded")
for size in [int(x) << 10 for x in os.environ.get("SIZES", "256 1024 4096 16384").split()]:
    for layout in ("page_first_direct", "page_first"):
        pages = max(4, min(1024, (64 << 20) // size))
        host = bench.bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd)
        P = host.page_size
        readers = {}
        for arm in ARMS:        # each arm its own tier (its own staging buffers, built as the arm says)
            canonical._fused = real_fused if arm == "after, folded" else (lambda views, groups: list(views))
            readers[arm] = StoreTier(host, engine, model="fused-ab", tp=(0, rtp), heads=heads)
            readers[arm].read.place_on_landing = [arm == "landing"] * readers[arm].read.m
            made = [readers[arm].canonical.take_staging(readers[arm].batch_pages) for _ in range(3)]
            for s in made:          # the staging buffers a call keeps in use, made as the arm says
                readers[arm].canonical.give_staging(s)
        canonical._fused = real_fused
        writers = [StoreTier(bench.bench_host(size, pages, layout, heads=heads // wtp, page_size=P, head_dim=hd),
                             engine, model="fused-ab", tp=(r, wtp), heads=heads) for r in range(wtp // rtp)]
        idx = torch.arange(pages * P)
        keys = [f"fused-ab-{size}-{layout}-{i}" for i in range(pages)]
        for w in writers:
            assert all(w.backup(keys, idx))
        res = {arm: [] for arm in ARMS}
        for r in range(13):
            for arm in (ARMS[r % 3:] + ARMS[:r % 3]):
                t = time.perf_counter()
                assert readers[arm].prefetch(keys, idx) == pages
                if r:
                    res[arm].append(time.perf_counter() - t)
        obj = readers[ARMS[0]].canonical.objects[0].payload_bytes >> 10
        print(f"{size >> 10:6} KiB {layout:18} objects of {obj:5} KiB: "
              + ", ".join(f"{arm} {statistics.median(v) * 1e3:6.2f} ms" for arm, v in res.items()), flush=True)
        engine.delete([k for w in writers for p in keys for k in w.written_keys(p)])
        for t in (*writers, *readers.values()):
            t.close()
engine.close()
