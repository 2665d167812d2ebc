"""How the dma strategy's copy calls compare on a GPU: HostPool backup / per-layer load /
all-layer load with strategy="dma" under each KVTIER_DMA_COPY mode (auto, batch, 2d, torch),
on a side stream and on the default stream, for host layouts x page sizes, against the
kernel strategy. Prints one line per point (GB/s of KV bytes, host us per call) and
writes them as JSON.

    python bench/scripts/dma_modes.py OUT.json [SECONDS]
"""
import itertools
import json
import os
import sys
import time

import torch

from kvtier.pool import HostPool, MHADevicePool

L, H, D = 16, 8, 64                 # 16 layers of bf16 K and V rows of 1 KiB
TOKENS = 8192
budget = float(sys.argv[2]) if len(sys.argv) > 2 else 90
out_path = sys.argv[1] if len(sys.argv) > 1 else "dma_modes.json"
dev = torch.device("cuda")
torch.manual_seed(0)


def setup(layout, P):
    pool = MHADevicePool(4 * TOKENS, P, L, H, D, dtype=torch.bfloat16, device=dev)
    for t in pool.buffers["k"] + pool.buffers["v"]:
        t.copy_(torch.randn_like(t))
    pages = TOKENS // P
    didx = (torch.randperm(4 * TOKENS // P)[:pages, None] * P + torch.arange(P)).flatten().to(dev)
    hidx = (torch.randperm(2 * TOKENS // P)[:pages, None] * P + torch.arange(P)).flatten()
    return pool, didx, hidx


def timed(fn, stream, reps=5):
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        best, host = float("inf"), float("inf")
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            fn()
            host = min(host, time.perf_counter() - t0)
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
    return best, host


rows = []
t_start = time.time()
side = torch.cuda.Stream()
for layout, P in itertools.product(("layer_first", "page_first", "page_first_direct"), (1, 16, 64)):
    if layout == "page_first_direct" and P == 1:
        continue
    pool, didx, hidx = setup(layout, P)
    for strategy, mode, stream_name in [("kernel", "auto", "side"), ("dma", "auto", "side"),
                                         ("dma", "batch", "side"), ("dma", "2d", "side"),
                                         ("dma", "auto", "default"), ("dma", "torch", "side")]:
        if time.time() - t_start > budget:
            break
        if mode == "torch" and P == 1:
            continue        # one torch copy per slot and layer: minutes
        os.environ["KVTIER_DMA_COPY"] = mode
        host = HostPool(pool, layout=layout, size_tokens=2 * TOKENS, strategy=strategy, check=False)
        stream = side if stream_name == "side" else torch.cuda.default_stream()
        ops = {"backup": (lambda: host.backup_from_device_all_layer(pool, hidx, didx), L),
               "load_layer": (lambda: host.load_to_device_per_layer(pool, hidx, didx, L // 2), 1),
               "load": (lambda: host.load_to_device_all_layer(pool, hidx, didx), L)}
        for op, (fn, layers) in ops.items():
            sec, host_s = timed(fn, stream)
            nbytes = 2 * layers * TOKENS * H * D * 2
            row = dict(layout=layout, page_size=P, strategy=strategy, mode=mode, stream=stream_name, op=op,
                       gbps=round(nbytes / sec / 1e9, 2), host_us=round(host_s * 1e6, 1))
            rows.append(row)
            print(f"{layout:18s} P={P:3d} {strategy:6s} {mode:6s} {stream_name:8s} {op:10s} "
                  f"{row['gbps']:7.2f} GB/s  host {row['host_us']:9.1f} us", flush=True)
        del host
with open(out_path, "w") as f:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   cuda=torch.version.cuda, tokens=TOKENS, layers=L, row_bytes=H * D * 2, points=rows), f, indent=1)
print(f"{len(rows)} points in {time.time() - t_start:.0f} s -> {out_path}")
