import os, time
from kvtier.store.engine import open_store
e = open_store(os.environ["KVTIER_TEST_REDIS_URL"])
for size in (1<<20, 4<<20, 16<<20):
    n = max(4, (64<<20)//size)
    r = e.raw_throughput(size, n)
    print(size>>10, "KiB", {k: (round(v,2) if isinstance(v,float) else v) for k,v in r.items()})
