"""Steps of a one-page prefetch on a Redis node, each timed alone right after a raw GET
of the page's bytes (so it runs with the caches a 256 KiB transfer leaves) and warm, in
a loop of its own (medians, us).

    KVTIER_TEST_REDIS_URL=redis://127.0.0.1:26379 python cold_steps.py
"""
import os
import statistics
import time
import timeit

import torch

from kvtier.store import bench
from kvtier.store.engine import _buffers, _keys, open_store

engine = open_store(os.environ["KVTIER_TEST_REDIS_URL"])
host = bench.bench_host(256 << 10, 8, "page_first_direct")
tier = bench.one_object_tier(host, engine)
P = host.page_size
idx, keys = torch.arange(P), ["cold-steps"]
assert tier.backup(keys, idx) == [True]
side = tier.read
ks, pages = tier._keys(keys, side), tier._pages(idx, 1, True)
batch = tier._receivers(side, ks, pages, None)
assert [int(s) for s in engine.get_into(ks, batch.buffers)] == [0]      # the page's object, for verify
raw = engine.raw_calls(sum(memoryview(b).nbytes for b in batch.buffers[0]), 1)
raw.set()
steps = {
    "index check (_pages)": lambda: tier._pages(idx, 1, True),
    "keys": lambda: tier._keys(keys, side),
    "receive buffers (_receivers)": lambda: tier._receivers(side, ks, pages, None),
    "header check and checksum (verify)": lambda: side.formats[0].verify(ks[0], batch.headers[0], batch.pieces[0]),
    "engine argument checks": lambda: (_keys(ks), _buffers("targets", batch.buffers, 1, True)),
}
cold = {n: [] for n in steps}
for _ in range(2000):
    for name, step in steps.items():
        raw.get()
        t = time.perf_counter_ns()
        step()
        cold[name].append(time.perf_counter_ns() - t)
for name, step in steps.items():
    warm = timeit.timeit(step, number=20000) / 20000 * 1e6
    print(f"{name:36s} after a raw GET {statistics.median(cold[name]) / 1e3:6.1f} us, warm {warm:5.1f} us")
raw.close()
tier.close()
engine.close()
