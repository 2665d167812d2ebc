"""The after-call placement of one batch of a TP 2 reader's pages (four head-group
objects a page), folded (`kvtier.store.canonical._fused`: one strided copy per run of
pages) against object by object (one copy per object and run), and the backup's
staging copy the same two ways; best of 15 copies, in one process. No store involved.

    python fold_copy.py
"""
import time

from kvtier.store import bench
from kvtier.store.canonical import copy_pages
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier


def best(fn, n=15):
    out = 1e9
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


engine = open_store("file:///tmp/fold-copy")
for size in (256 << 10, 1 << 20, 4 << 20):
    for layout in ("page_first_direct", "page_first"):
        host = bench.bench_host(size, max(4, (64 << 20) // size), layout, heads=4, head_dim=128)
        tier = StoreTier(host, engine, model="fold-copy", tp=(0, 2), heads=8)
        n = tier.batch_pages
        s = tier.canonical.take_staging(n)
        pages, slots = list(range(n)), range(n)
        mib = n * tier.canonical.payload_bytes >> 20
        rows = []
        for what, pairs in (("folded", s.fused), ("object by object", s.views)):
            place = best(lambda: [copy_pages(st, slots, h, pages) for h, st in pairs])
            stage = best(lambda: [copy_pages(h, pages, st, slots) for h, st in pairs])
            rows.append(f"{what} place {place:6.2f} ms, stage {stage:6.2f} ms")
        print(f"{size >> 10:5} KiB {layout:18} {n:3} pages ({mib} MiB, {len(s.views)} copies unfolded, "
              f"{len(s.fused)} folded): " + "; ".join(rows), flush=True)
        tier.close()
engine.close()
