import sys, time, uuid
import torch
from kvtier.store.bench import bench_host
from kvtier.store.engine import open_store, Status
from kvtier.store.tier import StoreTier
e = open_store("file:///tmp/lat/fs")
host = bench_host(256 << 10, 8, sys.argv[1])
tier = StoreTier(host, e, model="probe")
idx = torch.arange(host.page_size, dtype=torch.int64)
key = [uuid.uuid4().hex]
tier.backup(key, idx)
nk = tier.key(key[0])
import os
from kvtier.store.file import object_name
blob = open(os.path.join(e.root, object_name(nk)), "rb").read()
def t(fn, n=5000):
    for _ in range(100): fn()
    xs = []
    for _ in range(n):
        a = time.perf_counter(); fn(); xs.append(time.perf_counter() - a)
    xs.sort(); return round(xs[len(xs)//2] * 1e6, 1)
def fake_get(keys, targets, landed=None):
    for i, tg in enumerate(targets):
        off = 0
        for b in tg:
            mv = memoryview(b).cast("B")
            mv[:] = blob[off:off + mv.nbytes]; off += mv.nbytes
        landed(i)
    return [Status.HIT] * len(keys)
def fake_put(keys, sources, fill=None):
    for i in range(len(keys)): fill(i)
    return [Status.HIT] * len(keys)
print("copy of blob alone", t(lambda: fake_get([nk], [[bytearray(len(blob))]], lambda i: None)))
e.get_into = fake_get; e.put_from = fake_put; e.fills_as_sent = True
print("prefetch, null engine", t(lambda: tier.prefetch(key, idx)))
print("backup, null engine", t(lambda: tier.backup(key, idx)))
