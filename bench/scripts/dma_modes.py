"""How the dma strategy's copy calls compare on a GPU: the pools' backup / per-layer load /
all-layer load with the dma strategy under each KVTIER_DMA_COPY mode (auto, batch, 2d,
torch), on a side stream and on the default stream, for host layouts x page sizes,
against the kernel strategy. The pools are the autotuner's (kvtier.bench.pools),
with the configuration the pools look up and the strategy forced; the timing is the
benchmark's (kvtier.autotune.timing.time_calls). Prints one line per point (GB/s of KV
bytes, host us per call) and writes them as JSON.

    python bench/scripts/dma_modes.py OUT.json [SECONDS]
"""
import itertools
import json
import os
import sys
import time

import torch

import kvtier.platforms as platforms  # noqa: E402

from kvtier.autotune.timing import gbps, time_calls
from kvtier.autotune.shape import PoolShape
from kvtier.bench.pools import Pools
from kvtier.bench.kvtier_engine import config_for

L, H, D = 16, 8, 64                 # 16 layers of bf16 K and V rows of 1 KiB
TOKENS = 8192
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 90
out_path = sys.argv[1] if len(sys.argv) > 1 else "dma_modes.json"
dev = torch.device("cuda")


def timed(fn, stream):
    """(device seconds, host seconds) per call on ``stream``."""
    with stream:
        t = time_calls(fn, dev, warmup=2, iters=20)
    return t.device_s, t.host_s


rows = []
t_start = time.time()
side = torch.Stream(dev)
for layout, P in itertools.product(("layer_first", "page_first", "page_first_direct"), (1, 16, 64)):
    if layout == "page_first_direct" and P == 1:
        continue
    pools = Pools(PoolShape.mha(L, H, D, torch.bfloat16, page_size=P, host_layout=layout), TOKENS, dev)
    for strategy, mode, stream_name in [("kernel", "auto", "side"), ("dma", "auto", "side"),
                                         ("dma", "batch", "side"), ("dma", "2d", "side"),
                                         ("dma", "auto", "default"), ("dma", "torch", "side")]:
        if time.time() - t_start > budget:
            break
        if mode == "torch" and P == 1:
            continue        # one torch copy per slot and layer: minutes
        os.environ["KVTIER_DMA_COPY"] = mode
        stream = side if stream_name == "side" else platforms.current_stream(dev)
        for op in ("backup", "load_layer", "load"):
            t = pools.call(op)
            sec, host_s = timed(t.runner(config_for(pools, op, strategy=strategy)), stream)
            row = dict(layout=layout, page_size=P, strategy=strategy, mode=mode, stream=stream_name, op=op,
                       gbps=round(gbps(t.nbytes, sec), 2), host_us=round(host_s * 1e6, 1))
            rows.append(row)
            print(f"{layout:18s} P={P:3d} {strategy:6s} {mode:6s} {stream_name:8s} {op:10s} "
                  f"{row['gbps']:7.2f} GB/s  host {row['host_us']:9.1f} us", flush=True)
    del pools
with open(out_path, "w") as f:
    json.dump(dict(device=platforms.device_name(dev), torch=torch.__version__,
                   cuda=torch.version.cuda, tokens=TOKENS, layers=L, row_bytes=H * D * 2, points=rows), f, indent=1)
print(f"{len(rows)} points in {time.time() - t_start:.0f} s -> {out_path}")
