"""One 16 MiB file in the page cache read by one preadv against two threads reading half
each (medians of 20 reads, GB/s): what `kvtier.store.file.RANGE_BYTES` rests on.

    python ranged_read.py /tmp/ranged-read.bin
"""
import concurrent.futures
import os
import statistics
import sys
import time

path, n = sys.argv[1], 16 << 20
with open(path, "wb") as f:
    f.write(os.urandom(n))
view = memoryview(bytearray(n))
pool = concurrent.futures.ThreadPoolExecutor(1)


def one():
    fd = os.open(path, os.O_RDONLY)
    os.preadv(fd, [view], 0)
    os.close(fd)


def two():
    fd = os.open(path, os.O_RDONLY)
    half = pool.submit(os.preadv, fd, [view[n // 2:]], n // 2)
    os.preadv(fd, [view[:n // 2]], 0)
    half.result()
    os.close(fd)


for name, read in (("one preadv", one), ("two threads, half each", two)) * 2:
    times = []
    for _ in range(20):
        t = time.perf_counter()
        read()
        times.append(time.perf_counter() - t)
    print(f"{name:24s} {n / statistics.median(times) / 1e9:5.2f} GB/s")
os.unlink(path)
