import sys, time, uuid, statistics
from kvtier.store.engine import open_store
from kvtier.store import redis_ops as ops, resp
e = open_store(sys.argv[1])
hdr = memoryview(bytearray(176)); pay = memoryview(bytearray(262144)); one = memoryview(bytearray(262320))
k = "kvtier1:probe:p32-bfloat16-abcdef012345:" + uuid.uuid4().hex
e.put_from([k], [[hdr, pay]])
kb = k.encode()
c = e._server.acquire(time.monotonic() + 1)
pc = time.perf_counter_ns
def bare(bufs):
    dl = time.monotonic() + 1
    c.send([b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(kb), kb)], dl)
    c.read_line(dl, 16); c.read_into(bufs, dl); c.expect_crlf(dl)
def op(bufs):
    out = [None]; ops.get_into(c, [ops.Item(kb, bufs, 262320)], out, time.monotonic() + 1, ops.ServerErrors())
fns = {"bare 2": lambda: bare([hdr, pay]), "bare 1": lambda: bare([one]), "op 2": lambda: op([hdr, pay]), "op 1": lambda: op([one])}
T = {n: [] for n in fns}
for r in range(6000):
    for n, f in fns.items():
        a = pc(); f(); T[n].append(pc() - a)
for n, v in T.items(): print(n, statistics.median(v[500:]) / 1e3)
