"""A TP 8 -> TP 2 read of 64 MiB (or PAGES pages) beside a read of the same bytes stored
as one object per page, interleaved call by call in one process; medians of the wall
and CPU (this process) time per call after 3 warm-up rounds. With --after, a third arm:
the reshard read with every page placed after its batch's engine call
(`PLACE_BESIDE_MIN` set out of reach for that arm's calls).

    python reshard_vs_one.py URL PAGE_KIB LAYOUT [ROUNDS [PAGES]] [--after]
    KVTIER_AT=/tmp/at-17fcd95 python reshard_vs_one.py ...     # another commit (at_commit.py)
"""
import at_commit  # noqa: F401
import statistics
import sys
import time
import uuid

import torch

import kvtier.store.tier as tier_module
from kvtier.store import bench
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

args = [a for a in sys.argv[1:] if a != "--after"]
url, size, layout = args[0], int(args[1]) << 10, args[2]
rounds = int(args[3]) if len(args) > 3 else 25
pages = int(args[4]) if len(args) > 4 else max(16, min(1024, (64 << 20) // size))
engine = open_store(url)
heads, wtp, rtp, hd = 8, 8, 2, 128
host = bench.bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd)
P = host.page_size
reader = StoreTier(host, engine, model="m", tp=(0, rtp), heads=heads)
writers = [StoreTier(bench.bench_host(size, pages, layout, heads=heads // wtp, page_size=P, head_dim=hd),
                     engine, model="m", tp=(r, wtp), heads=heads) for r in range(wtp // rtp)]
one = bench.one_object_tier(host, engine)
idx = torch.arange(pages * P, dtype=torch.int64)
keys = [uuid.uuid4().hex for _ in range(pages)]
for t in writers + [one]:
    assert all(t.backup(keys, idx))
shipped = getattr(tier_module, "PLACE_BESIDE_MIN", None)
arms = {"one": (one, shipped), "reshard": (reader, shipped)}
if "--after" in sys.argv:
    arms["reshard, after"] = (reader, 1 << 62)
res = {k: [] for k in arms}
for _ in range(rounds):
    for name, (tier, least) in arms.items():
        if shipped is not None:
            tier_module.PLACE_BESIDE_MIN = least
        s, c = time.perf_counter(), time.process_time()
        assert tier.prefetch(keys, idx) == pages
        res[name].append(((time.perf_counter() - s) * 1e3, (time.process_time() - c) * 1e3))
med = {k: (statistics.median(x[0] for x in v[3:]), statistics.median(x[1] for x in v[3:])) for k, v in res.items()}
print(f"{url.split('?')[0][:24]:24s} {size >> 10:5d} KiB x {pages:4d} {layout:17s} "
      + "  ".join(f"{k} {w:5.1f} ms (cpu {c:4.1f})" for k, (w, c) in med.items())
      + "  ratio " + " / ".join(f"{med['one'][0] / med[k][0]:.2f}" for k in arms if k != "one"))
engine.delete([k for w in writers + [one] for p in keys for k in w.written_keys(p)])
