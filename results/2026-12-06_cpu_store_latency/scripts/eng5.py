import sys, time, uuid, functools, statistics
from kvtier.store.engine import open_store, Status
from kvtier.store import redis_ops as ops
from kvtier.store.redis import _stripes, MAX_ROUNDS
e = open_store(sys.argv[1])
hdr = memoryview(bytearray(176)); pay = memoryview(bytearray(262144))
k = "kvtier1:probe:p32-bfloat16-abcdef012345:" + uuid.uuid4().hex
e.put_from([k], [[hdr, pay]])
pc = time.perf_counter_ns
T = {n: [] for n in "abcdef"}
def run(self, op, items, replicated=False):
    t0 = pc()
    deadline = time.monotonic() + self.timeout
    out = [None] * len(items)
    pending = list(range(len(items)))
    asked = {}
    for _ in range(MAX_ROUNDS):
        if self._closed: break
        groups = self._route(items, pending, asked, deadline)
        if None in groups:
            for i in groups.pop(None): out[i] = Status.ERROR
        tasks = []
        for node, stripes in _stripes(groups, self._conf.connections, items).items():
            idxs = groups[node]
            tasks += [(node, idxs[s::stripes]) for s in range(stripes)]
        t1 = pc()
        self._dispatch(op, tasks, items, out, deadline, replicated)
        t2 = pc()
        pending, asked = [], {}
        for i, r in enumerate(out):
            if isinstance(r, ops.Redirect): pass
        if not pending: break
    r = [Status.ERROR if not isinstance(s, Status) else s for s in out]
    t3 = pc()
    T["a"].append(t1 - t0); T["b"].append(t2 - t1); T["c"].append(t3 - t2)
    return r
import types
e._run = types.MethodType(run, e)
real_task = e._task
def task(op, node, idxs, items, out, deadline, replicated):
    t0 = pc()
    conn = node.acquire(deadline)
    t1 = pc()
    res = [None]; errors = ops.ServerErrors()
    op(conn, [items[i] for i in idxs], res, deadline, errors)
    t2 = pc()
    node.release(conn)
    for j, i in enumerate(idxs): out[i] = res[j]
    t3 = pc()
    T["d"].append(t1 - t0); T["e"].append(t2 - t1); T["f"].append(t3 - t2)
e._task = task
for _ in range(200): e.get_into([k], [[hdr, pay]])
for v in T.values(): v.clear()
tot = []
for _ in range(4000):
    a = pc(); e.get_into([k], [[hdr, pay]]); tot.append(pc() - a)
print("total", statistics.median(tot) / 1e3)
for n, label in zip("abcdef", ["run pre", "dispatch(task)", "run post", "acquire", "op", "release+out"]):
    print(label, statistics.median(T[n]) / 1e3)
from kvtier.store import engine as E
T2 = {n: [] for n in "abcd"}
def get_into(self, keys, targets, landed=None):
    t0 = pc()
    keys = E._keys(keys)
    targets = E._buffers("targets", targets, len(keys), writable=True)
    landed = landed or E._unheard
    t1 = pc()
    r = self._guarded("get", len(keys), lambda: self._get_into(keys, targets, landed))
    t2 = pc()
    T2["a"].append(t1 - t0); T2["b"].append(t2 - t1)
    return r
def gi(self, keys, targets, landed):
    t0 = pc()
    items = [ops.Item(k.encode(), t, sum(v.nbytes for v in t), landed=functools.partial(landed, i)) for i, (k, t) in enumerate(zip(keys, targets))]
    t1 = pc()
    r = self._run(ops.get_into, items)
    t2 = pc()
    T2["c"].append(t1 - t0); T2["d"].append(t2 - t1)
    return r
e.get_into = types.MethodType(get_into, e); e._get_into = types.MethodType(gi, e)
for v in T2.values(): v.clear()
tot = []
for _ in range(4000):
    a = pc(); e.get_into([k], [[hdr, pay]]); tot.append(pc() - a)
print("total", statistics.median(tot) / 1e3)
for n, label in zip("abcd", ["validate", "guarded", "items", "run"]):
    print(label, statistics.median(T2[n]) / 1e3)
