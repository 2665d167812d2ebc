"""The ceilings each point is compared with, measured in the same run: one large pinned
host -> device copy, one device -> host copy (the link), and one device -> device copy
(the bound for gather and scatter). Bytes counted are the bytes delivered, as for every point."""
from __future__ import annotations

import time
from dataclasses import dataclass, asdict

import torch

from kvtier.autotune.timing import gbps, time_calls
from kvtier.platforms import synchronize

# Which ceiling bounds which operation.
CEILING_OF = {"backup": "d2h", "load_layer": "h2d", "load": "h2d", "gather": "d2d", "scatter": "d2d"}


@dataclass(frozen=True)
class Ceilings:
    h2d: float   # GB/s
    d2h: float
    d2d: float
    nbytes: int

    def of(self, op: str) -> float:
        return getattr(self, CEILING_OF[op])

    def to_dict(self) -> dict:
        return asdict(self)


def measure_ceilings(device: torch.device, nbytes: int, *, warmup: int = 2, iters: int = 20,
                     iters_for=None) -> Ceilings:
    """Bulk-copy bandwidth each way with ``nbytes`` buffers (pinned host memory where the
    device has a link; on the CPU every copy is a memcpy), timed as every point is
    (`time_calls`: kernel-only median of ``iters`` calls after ``warmup``; where given,
    ``iters_for(seconds of one call)`` sets the count instead, as for points)."""
    pin = device.type != "cpu"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def rate(dst, src):
        n = iters
        if iters_for is not None:
            t0 = time.perf_counter()
            dst.copy_(src)
            synchronize(device)
            n = iters_for(time.perf_counter() - t0)
        t = time_calls(lambda: dst.copy_(src, non_blocking=True), device, warmup=warmup, iters=n)
        return gbps(nbytes, t.device_s)

    return Ceilings(h2d=rate(dev, host), d2h=rate(host, dev), d2d=rate(dev2, dev), nbytes=nbytes)
