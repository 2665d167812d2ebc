"""A TP 2 rank's prefetch of 64 MiB (four head-group objects per page, written by its
own backup just before) with its staged copies made object by object against folded
into one copy per page run (`kvtier.store.canonical._fused`), interleaved in one
process: medians of 15 calls of this process's CPU time and of wall time.

    python fold_ab.py file:///tmp/fold-ab
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
heads, rtp, hd = 8, 2, 128
real_fused = canonical._fused
ARMS = ("per object", "folded")
for size in [int(x) << 10 for x in os.environ.get("SIZES", "256 1024 4096").split()]:
    for layout in os.environ.get("LAYOUTS", "page_first_direct page_first").split():
        pages = max(4, min(1024, (64 << 20) // size))
        host = bench.bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd)
        tiers = {}
        for arm in ARMS:
            canonical._fused = real_fused if arm == "folded" else (lambda views, groups: list(views))
            t = tiers[arm] = StoreTier(host, engine, model="fold-ab", tp=(0, rtp), heads=heads)
            made = [t.canonical.take_staging(t.batch_pages) for _ in range(3)]
            for s in made:          # the staging buffers a call keeps in use, made as the arm says
                t.canonical.give_staging(s)
        canonical._fused = real_fused
        idx = torch.arange(pages * host.page_size)
        OPS = ("prefetch CPU", "prefetch")
        res = {(arm, op): [] for arm in ARMS for op in OPS}
        for r in range(16):
            keys = [f"fold-ab-{size}-{layout}-{r}-{i}" for i in range(pages)]
            for arm in ARMS[::1 if r % 2 else -1]:
                t = tiers[arm]
                assert all(t.backup(keys, idx))
                b, bc = time.perf_counter(), time.process_time()
                assert t.prefetch(keys, idx) == pages
                c, cc = time.perf_counter(), time.process_time()
                if r:
                    res[arm, "prefetch CPU"].append(cc - bc)
                    res[arm, "prefetch"].append(c - b)
                engine.delete([k for p in keys for k in t.written_keys(p)])
        print(f"{size >> 10:6} KiB {layout:18} " + ", ".join(
            f"{op} {arm} {statistics.median(res[arm, op]) * 1e3:6.2f} ms" for op in OPS for arm in ARMS),
            flush=True)
        for t in tiers.values():
            t.close()
engine.close()
