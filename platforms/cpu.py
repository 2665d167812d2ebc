"""The CPU: no accelerator; kernels run under Triton's interpreter (or the torch
reference), one program after another, reading host memory directly."""
from __future__ import annotations

import statistics
import time

from kvtier.config import CopyConfig, Space

from .record import Platform

# The interpreter runs programs in turn: few, wide programs are fastest.
DEFAULT = CopyConfig(num_programs=1, rows=64, block_bytes=4096, num_warps=1)


def wall_timer(warmup: int = 0, repeats: int = 0):
    """Wall-clock median (the interpreter runs synchronously)."""
    warmup, repeats = warmup or 1, repeats or 3

    def timer(fn, **_):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    return timer


CPU = Platform(
    name="cpu", device_type="cpu", link_config=DEFAULT, device_config=DEFAULT,
    space=Space((16, 64), (1024, 4096), (1,), 1 << 20, 0),
    quick_space=Space((16, 64), (1024, 4096), (1,), 1 << 20, 0),
    max_programs=lambda units, crosses_link: 2,    # more programs only add Python overhead
    timer=wall_timer, kernel_reaches=lambda m: True, host_address=lambda t: t.data_ptr(),
    properties=lambda device, p: {},
    inline_check_programs=1 << 30)     # programs run in turn: a check launch would cost as much
