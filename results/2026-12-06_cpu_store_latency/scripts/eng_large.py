import os, sys, time, uuid, statistics
from kvtier.store.engine import open_store
e = open_store(sys.argv[1])
res = []
for size in (256 << 10, 1 << 20):
    n = (64 << 20) // size
    bufs = [[memoryview(bytearray(os.urandom(size)))] for _ in range(n)]
    g, p = [], []
    for r in range(12):
        keys = [uuid.uuid4().hex for _ in range(n)]
        t = time.perf_counter(); e.put_from(keys, bufs); p.append(time.perf_counter() - t)
        t = time.perf_counter(); e.get_into(keys, bufs); g.append(time.perf_counter() - t)
        e.delete(keys)
    res.append(f"{size>>10}K put {64*1.048576/1024/statistics.median(p[2:]):.2f} get {64*1.048576/1024/statistics.median(g[2:]):.2f}")
print(" | ".join(res))
