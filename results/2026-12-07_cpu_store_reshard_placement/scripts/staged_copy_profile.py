"""Where a reshard read's time goes on the file store with one thread: cProfile of three
64 MiB reads of 4 MiB rank pages (TP 8 -> TP 2, page_first_direct), in one batch on the
calling thread, beside the same bytes stored as one object per page.

    python staged_copy_profile.py /tmp/staged-copy-profile
"""
import cProfile
import pstats
import sys

import torch

from kvtier.store import bench
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

engine = open_store(f"file://{sys.argv[1]}?threads=1")
heads, wtp, rtp, hd, size = 8, 8, 2, 128, 4 << 20
pages = (64 << 20) // size
host = bench.bench_host(size, pages, "page_first_direct", heads=heads // rtp, head_dim=hd)
P = host.page_size
idx, keys = torch.arange(pages * P), [f"profile-{i}" for i in range(pages)]
writers = [StoreTier(bench.bench_host(size, pages, "page_first_direct", heads=heads // wtp, page_size=P, head_dim=hd),
                     engine, model="profile", tp=(r, wtp), heads=heads) for r in range(wtp // rtp)]
for w in writers:
    assert all(w.backup(keys, idx))
one = bench.one_object_tier(host, engine)
assert all(one.backup(keys, idx))
for name, tier in (("reshard", StoreTier(host, engine, model="profile", tp=(0, rtp), heads=heads)), ("one object", one)):
    tier.batch_pages = pages            # one batch: every call on this thread
    assert tier.prefetch(keys, idx) == pages
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        assert tier.prefetch(keys, idx) == pages
    profile.disable()
    print(f"--- {name}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(6)
