"""Timers: ``timer(fn, config=...) -> seconds`` for one call of ``fn`` (the median of
repeats after a warm-up).

The device's own clock is used where there is one: triton.testing.do_bench (CUDA
events) on CUDA and ROCm, torch.npu events on Ascend (imported only there), the wall
clock on CPU. Tests pass their own timer; ``config`` tells it what is being timed.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

Timer = Callable[..., float]


def wall_timer(warmup: int = 1, repeats: int = 3) -> Timer:
    """Wall-clock median (CPU: the interpreter runs synchronously)."""
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


def cuda_timer(warmup_ms: int = 25, rep_ms: int = 100) -> Timer:
    """Median of triton.testing.do_bench (CUDA events, L2 flushed between runs)."""
    def timer(fn, **_):
        from triton.testing import do_bench
        return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3
    return timer


def npu_timer(warmup: int = 5, repeats: int = 20) -> Timer:
    """Median over torch.npu events, one pair per repeat."""
    def timer(fn, **_):
        import torch
        for _ in range(warmup):
            fn()
        torch.npu.synchronize()
        samples = []
        for _ in range(repeats):
            start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        return statistics.median(samples)
    return timer


def default_timer(platform: str, warmup: int = 0, repeats: int = 0) -> Timer:
    """The timer for ``platform``. ``warmup``/``repeats`` are call counts (0: the
    timer's default); on CUDA/ROCm do_bench sizes its runs from time budgets instead."""
    if platform in ("cuda", "rocm"):
        return cuda_timer()
    if platform == "npu":
        return npu_timer(warmup or 5, repeats or 20)
    return wall_timer(warmup or 1, repeats or 3)
