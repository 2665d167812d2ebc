"""Could a reshard read skip its staged copy? 1024 files of 64 KiB (a TP 8 object of a
TP 2 rank's 256 KiB page: 256 B of each of 256 host rows of 1 KiB), one thread, the
page cache warm, best of 5 (us per file):

  staged:          one preadv into a staging slot, xxh3 of the slot, then each page's
                   four objects placed in one strided copy (what the tier does)
  scatter:         one preadv of 256 buffers straight into the host rows, then the
                   rows gathered into a scratch buffer for the checksum
  scatter, xxh3 streamed: the same, the checksum fed row by row
  scatter only:    the preadv of 256 buffers, nothing else
  contiguous only: one preadv of one buffer, nothing else

    python scatter_read.py /tmp/scatter-read
"""
import os
import sys
import time

import numpy as np
import xxhash

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp/scatter-read"
N, OBJ, PIECE, G = 1024, 64 << 10, 256, 4
ROWS = OBJ // PIECE
os.makedirs(root, exist_ok=True)
rng = np.random.default_rng(0)
for i in range(N):
    with open(f"{root}/{i}", "wb") as f:
        f.write(rng.integers(0, 256, OBJ, dtype=np.uint8).tobytes())
host = np.zeros((N // G, ROWS, G * PIECE), np.uint8)
staging = np.zeros((N, OBJ), np.uint8)
scratch = np.zeros(OBJ, np.uint8)
rows = [[memoryview(host[i // G, r, (i % G) * PIECE:(i % G + 1) * PIECE]) for r in range(ROWS)] for i in range(N)]


def read(i, views):
    fd = os.open(f"{root}/{i}", os.O_RDONLY)
    os.preadv(fd, views, 0)
    os.close(fd)


def staged():
    for i in range(N):
        read(i, [memoryview(staging[i])])
        xxhash.xxh3_64_intdigest(memoryview(staging[i]))
    for p in range(N // G):
        host[p].reshape(ROWS, G, PIECE)[:] = staging[p * G:(p + 1) * G].reshape(G, ROWS, PIECE).transpose(1, 0, 2)


def scatter():
    for i in range(N):
        read(i, rows[i])
        p, g = divmod(i, G)
        scratch.reshape(ROWS, PIECE)[:] = host[p, :, g * PIECE:(g + 1) * PIECE]
        xxhash.xxh3_64_intdigest(memoryview(scratch))


def scatter_streamed():
    for i in range(N):
        read(i, rows[i])
        h = xxhash.xxh3_64()
        for v in rows[i]:
            h.update(v)
        h.intdigest()


def scatter_only():
    for i in range(N):
        read(i, rows[i])


def contiguous_only():
    for i in range(N):
        read(i, [memoryview(staging[i])])


for fn in (staged, scatter, scatter_streamed, scatter_only, contiguous_only):
    fn()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    print(f"{fn.__name__.replace('_', ' '):18s} {best * 1e3:6.1f} ms ({best / N * 1e6:5.1f} us a file)")
