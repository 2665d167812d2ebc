"""Where a TP 8 -> TP 2 read of 64 MiB spends its time, step by step: the tier's
steps (prepare, engine call, placement, verification, waits) and the file reads, on
the calling thread and on worker threads, per call (the mean of 20 calls after one that warms up).

    python steps.py 256 page_first_direct reshard      # or: one (one object a page)
    python steps.py 256 page_first_direct reshard 16   # batch_pages 16
"""
import sys, time, torch, uuid, threading, collections
from kvtier.store import bench
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier

size=int(sys.argv[1])<<10; layout=sys.argv[2]; which=sys.argv[3]
engine = open_store("file:///tmp/tl")
heads, wtp, rtp, hd = 8, 8, 2, 128
pages = max(16, min(1024, (64 << 20) // size))
host = bench.bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd); P = host.page_size
reader = StoreTier(host, engine, model="m", tp=(0, rtp), heads=heads, **({"batch_pages": int(sys.argv[4])} if len(sys.argv) > 4 else {}))
writers = [StoreTier(bench.bench_host(size, pages, layout, heads=heads // wtp, page_size=P, head_dim=hd), engine, model="m", tp=(r, wtp), heads=heads) for r in range(wtp // rtp)]
one = bench.one_object_tier(host, engine)
idx = torch.arange(pages * P, dtype=torch.int64)
keys = [uuid.uuid4().hex for _ in range(pages)]
for t in writers + [one]: t.backup(keys, idx)
tier = reader if which == "reshard" else one
acc = collections.defaultdict(float)
def wrap(obj, name, label):
    real = getattr(obj, name)
    def f(*a, **k):
        s = time.perf_counter()
        try: return real(*a, **k)
        finally: acc[label + ("@main" if threading.current_thread() is threading.main_thread() else "@worker")] += time.perf_counter() - s
    setattr(obj, name, f)
wrap(tier, "_receivers", "prepare"); wrap(tier, "_get", "engine call")
wrap(tier.canonical, "from_staging", "place")
wrap(tier, "_verified", "verified")
wrap(tier.engine, "_read", "file read")
import concurrent.futures
wrap(concurrent.futures.Future, "result", "wait")
N=20; tot=0
for i in range(N+1):
    if i == 1: acc.clear(); tot = 0
    s=time.perf_counter(); assert tier.prefetch(keys, idx) == pages; tot += time.perf_counter()-s
print(which, size>>10, layout, f"wall {tot/N*1e3:.2f} ms per call, batch_pages {tier.batch_pages}")
for k,v in sorted(acc.items()): print(f"  {k:22s} {v/N*1e3:7.2f} ms")
engine.delete([k for w in writers + [one] for p in keys for k in w.written_keys(p)])
