"""Hardware sweep behind the shipped CUDA defaults (platforms/cuda.py): GB/s of the pools'
backup and load (across the link) and gather (on the device) for a grid of launch
configurations, each forced on the pools' own call as the autotuner forces it
(kvtier.bench.pools) and timed by the platform's timer (kvtier.autotune.timing).
Usage: python bench/scripts/defaults_sweep.py OUT.json [ROWS,..] [BLOCK_BYTES,..] [WARPS,..]"""
import itertools
import json
import sys
import time

import torch

from kvtier.autotune.timing import default_timer
from kvtier.autotune.shape import PoolShape
from kvtier.bench.pools import Pools
from kvtier.kernels import CopyConfig
from kvtier.platforms import platform_of

dev = torch.device("cuda")
SHAPE = PoolShape.mha(8, 8, 64, torch.bfloat16, page_size=16)   # bf16 rows of 1 KiB
n = 8192                                        # tokens per transfer (8 MiB per layer pair)
pools = Pools(SHAPE, n, dev, spare=4)           # out of 32768 slots on each side
timer = default_timer(platform_of(dev))
PROGRAMS = {"backup": [2, 4, 8, 16, 32], "load": [2, 4, 8, 16, 32],
            "gather": [132, 264, 528, 1056, 2112, 4224]}
GRID = [int(a) for a in (sys.argv[2] if len(sys.argv) > 2 else "4,16").split(",")]
BLOCKS = [int(a) for a in (sys.argv[3] if len(sys.argv) > 3 else "1024,2048").split(",")]
WARPS = [int(a) for a in (sys.argv[4] if len(sys.argv) > 4 else "4,8").split(",")]

out = []
t0 = time.time()
for op, progs in PROGRAMS.items():
    t = pools.call(op)
    for p, rows, blk, w in itertools.product(progs, GRID, BLOCKS, WARPS):
        if time.time() - t0 > 200:
            break
        c = CopyConfig(num_programs=p, rows=rows, block_bytes=blk, num_warps=w)
        try:
            gbs = t.nbytes / timer(t.runner(c), config=c) / 1e9
        except Exception as e:
            gbs = None
            print(op, c, "ERROR", e)
        out.append(dict(op=op, config=c.to_dict(), gbps=gbs))
        print(f"{op:7s} progs={p:5d} rows={rows:3d} block={blk:5d} warps={w} {gbs and round(gbs, 1)} GB/s", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
