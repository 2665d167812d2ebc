"""The file store's floor for a reshard read, without the tier: 64 MiB as 1024 files
of 64 KiB (a TP 8 -> TP 2 read of 256 KiB rank pages: four objects a page) against
256 files of 256 KiB (the one-object read), each opened, its length checked, read
into one reused buffer, closed; then the same with the xxh3 checksum of each file.
Best of 15, one thread.

    python file_floor.py /tmp/file-floor
"""
import os
import sys
import time

import numpy as np
import xxhash

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/file-floor"
for n, size in [(1024, 64 << 10), (256, 256 << 10)]:
    d = f"{root}/{size}"
    os.makedirs(d, exist_ok=True)
    data = os.urandom(size)
    for i in range(n):
        with open(f"{d}/{i}", "wb") as f:
            f.write(data)
    buf = memoryview(np.empty(size, np.uint8))

    def run(checksum):
        for i in range(n):
            fd = os.open(f"{d}/{i}", os.O_RDONLY)
            os.fstat(fd)
            os.preadv(fd, [buf], 0)
            os.close(fd)
            if checksum:
                xxhash.xxh3_64_intdigest(buf)
    for checksum in (False, True):
        best = 1e9
        for _ in range(15):
            t = time.perf_counter()
            run(checksum)
            best = min(best, time.perf_counter() - t)
        print(f"{n:5} files of {size >> 10:3} KiB, {'read + xxh3' if checksum else 'read       '}: "
              f"{best * 1e3:6.2f} ms ({best / n * 1e6:5.1f} us a file)")
