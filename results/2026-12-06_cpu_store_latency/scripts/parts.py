import sys, time, uuid, os
import torch, numpy as np
from kvtier.store.bench import bench_host
from kvtier.store.engine import open_store
from kvtier.store.tier import StoreTier
from kvtier.store import resp
url = sys.argv[1]; layout = sys.argv[2] if len(sys.argv) > 2 else "page_first_direct"
engine = open_store(url)
host = bench_host(256 << 10, 8, layout)
tier = StoreTier(host, engine, model="probe")
P = host.page_size
idx = torch.arange(P, dtype=torch.int64)
key = [uuid.uuid4().hex]
tier.backup(key, idx)
N = 2000
def t(fn, n=N):
    for _ in range(50): fn()
    xs = []
    for _ in range(n):
        a = time.perf_counter(); fn(); xs.append(time.perf_counter() - a)
    xs.sort(); return xs[len(xs)//2] * 1e6
print("tier._keys", t(lambda: tier._keys(key)))
print("tier._pages", t(lambda: tier._pages(idx, 1, True)))
nk = tier._keys(key); pages = tier._pages(idx, 1, True)
print("_receivers", t(lambda: tier._receivers(nk, pages, None)))
b = tier._receivers(nk, pages, None)
print("engine.get_into (tier buffers)", t(lambda: engine.get_into(b.keys, b.buffers)))
print("tier._get (with landed/verify)", t(lambda: tier._get(b)))
print("verify", t(lambda: tier.format.verify(nk[0], b.headers[0], b.pieces[0])))
print("prefetch", t(lambda: tier.prefetch(key, idx)))
nbytes = sum(v.nbytes for v in memoryview(x) for x in [])  if False else None
obj = bytearray(tier.plan.payload_bytes + len(b.headers[0]))
print("engine.get_into (1 bytearray)", t(lambda: engine.get_into(nk, [[obj]])))
host_, port = url[8:].split(":")
conn = resp.Connection(host_, int(port), time.monotonic() + 10)
k = nk[0].encode(); mv = memoryview(obj)
def bare():
    dl = time.monotonic() + 1
    conn.send([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)], dl)
    conn.read_line(dl, 16); conn.read_into([mv], dl); conn.expect_crlf(dl)
print("bare GET", t(bare))
def bare_split():
    dl = time.monotonic() + 1
    conn.send([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)], dl)
    conn.read_line(dl, 16); conn.read_into([memoryview(x).cast("B") for x in b.buffers[0]], dl); conn.expect_crlf(dl)
print("bare GET into tier buffers", t(bare_split))
src = [bytes(obj)]
def bare_set():
    dl = time.monotonic() + 1
    conn.send([b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(obj)), obj, b"\r\n"], dl)
    conn.read_reply(dl)
print("bare SET (overwrite)", t(bare_set, 500))
print("engine.put_from (overwrite)", t(lambda: engine.put_from(nk, [[obj]]), 500))
print("backup (overwrite)", t(lambda: tier.backup(key, idx), 500))
print("seal", t(lambda: tier.format.seal_into(tier.format.header(nk[0]), b.pieces[0])))
def role():
    dl = time.monotonic() + 1
    conn.call(dl, "ROLE")
print("ROLE round trip", t(role))
def ping():
    dl = time.monotonic() + 1
    conn.call(dl, "PING")
print("PING round trip", t(ping))
engine.delete(nk)
