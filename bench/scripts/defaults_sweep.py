"""Hardware sweep behind the shipped CUDA defaults (kernels/config.py): GB/s of
copy_rows across the link (backup, load) and on the device (gather) for a grid of
launch configurations. Usage: python bench/scripts/defaults_sweep.py OUT.json [ROWS,..] [BLOCK_BYTES,..] [WARPS,..]"""
import itertools, json, sys, time
import torch
from kvtier.kernels import RowMap, copy_rows, CopyConfig

torch.manual_seed(0)
dev = torch.device("cuda")
L, N, H, D, P = 8, 32768, 8, 64, 16            # bf16 rows of 1 KiB
n = 8192                                        # tokens per transfer (8 MiB per layer pair)
k = [torch.randn(N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
v = [torch.randn(N, H, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
dmap = RowMap.stack([RowMap.from_layers(k, P), RowMap.from_layers(v, P)])
host = torch.empty(2, L, N, H, D, dtype=torch.bfloat16).pin_memory()
hmap = RowMap.stack([RowMap.from_host_layout(host[0], "layer_first", P),
                     RowMap.from_host_layout(host[1], "layer_first", P)])
stage = torch.empty(2, L, n, H, D, device=dev, dtype=torch.bfloat16)
smap = RowMap.stack([RowMap.from_stacked(stage[0], P), RowMap.from_stacked(stage[1], P)])
didx = torch.randperm(N, device=dev)[:n]
hidx = torch.randperm(N, device=dev)[:n]
sidx = torch.arange(n, device=dev)
moved = 2 * L * n * H * D * 2


def bench(fn, reps=10):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return moved / sorted(ts)[len(ts) // 2] / 1e9


out = []
t0 = time.time()
ops = {
    "backup": (lambda c: copy_rows(dmap, didx, hmap, hidx, config=c, check=False), [2, 4, 8, 16, 32]),
    "load": (lambda c: copy_rows(hmap, hidx, dmap, didx, config=c, check=False), [2, 4, 8, 16, 32]),
    "gather": (lambda c: copy_rows(dmap, didx, smap, sidx, config=c, check=False), [132, 264, 528, 1056, 2112, 4224]),
}
GRID = [int(a) for a in (sys.argv[2] if len(sys.argv) > 2 else "4,16").split(",")]
BLOCKS = [int(a) for a in (sys.argv[3] if len(sys.argv) > 3 else "1024,2048").split(",")]
WARPS = [int(a) for a in (sys.argv[4] if len(sys.argv) > 4 else "4,8").split(",")]
for op, (fn, progs) in ops.items():
    for p, rows, blk, w in itertools.product(progs, GRID, BLOCKS, WARPS):
        if time.time() - t0 > 200:
            break
        c = CopyConfig(num_programs=p, rows=rows, block_bytes=blk, num_warps=w)
        try:
            gbs = bench(lambda: fn(c))
        except Exception as e:
            gbs = None
            print(op, c, "ERROR", e)
        out.append(dict(op=op, config=c.to_dict(), gbps=gbs))
        print(f"{op:7s} progs={p:5d} rows={rows:3d} block={blk:5d} warps={w} {gbs and round(gbs, 1)} GB/s", flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
