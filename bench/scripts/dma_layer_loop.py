"""Host time of a HiCache layer loop on the `dma` strategy (Ascend's path with plain
pinned memory): per-layer loads of all layers with one new host/device index pair per
loop, as each batch brings, through `HostPool(strategy="dma")`, kernels recorded, not run
(`LaunchProbe`). Prints microseconds per layer call, and for the loop's first layer
(which plans the list's copies) apart from the others (which find the plans).

    python bench/scripts/dma_layer_loop.py [LOOPS]

LOOPS (default 50) per layout. On the CPU the bulk copies are torch copies of the bytes
(no copy engine), so the figures include moving them; on a GPU or NPU they are the
runtime's copy calls.
"""
from __future__ import annotations

import itertools
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from kvtier.bench.probe import LaunchProbe  # noqa: E402
from kvtier.platforms import default_device  # noqa: E402
from kvtier.pool import HostPool, MHADevicePool  # noqa: E402

P, LAYERS, HEADS, HEAD_DIM, PAGES = 16, 16, 8, 64, 16      # 256 tokens of 1 KiB K and V rows


def main(argv) -> int:
    loops = int(argv[1]) if len(argv) > 1 else 50
    torch.set_num_threads(1)
    device = default_device()
    gen = torch.Generator().manual_seed(0)

    def pages(n):
        return (torch.randperm(n, generator=gen)[:PAGES][:, None] * P + torch.arange(P)).reshape(-1)
    for layout in ("layer_first", "page_first_direct"):
        dev = MHADevicePool(4096, P, LAYERS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
        host = HostPool(dev, layout=layout, size_tokens=8192, strategy="dma")
        pairs = itertools.cycle([(pages(512), pages(256).to(device)) for _ in range(loops + 8)]).__next__
        first, rest = [], []
        with LaunchProbe():
            for loop in range(loops + 8):
                h, d = pairs()
                for layer in range(LAYERS):
                    t0 = time.perf_counter_ns()
                    host.load_to_device_per_layer(dev, h, d, layer)
                    if loop >= 8:               # after a warm-up of new lists
                        (first if layer == 0 else rest).append(time.perf_counter_ns() - t0)
        mean = lambda ns: sum(ns) / len(ns) / 1e3  # noqa: E731
        print(f"{layout:<18} {mean(first + rest):8.1f} us per layer call; first layer {mean(first):8.1f} us, "
              f"the other {LAYERS - 1} {mean(rest):8.1f} us ({device}, {PAGES * P} tokens, dma)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
