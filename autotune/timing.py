"""Device timing for the autotuner and the benchmark, in one place.

- `default_timer(platform)`: ``timer(fn, config=...) -> seconds`` for one call of ``fn``,
  from the platform's record (`kvtier.platforms.get(name).timer`): CUDA events through
  triton.testing.do_bench on CUDA and ROCm, torch.npu events on Ascend, the wall clock on
  the CPU. The tuner ranks configurations by it; tests pass their own timer, and
  ``config`` tells it what is being timed.
- `time_calls(fn, device)`: device time per call of a loop of back-to-back calls and the
  host time each call takes (the benchmark's figures: GB/s from the first, the caller's
  cost from the second). On an accelerator the device time comes from stream events
  around the loop, so it counts the whole stream timeline, host-side work inside a call
  included; on the CPU (interpreter smoke runs) it is wall-clock time.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import kvtier.platforms as platforms

Timer = Callable[..., float]


def default_timer(platform: str, warmup: int = 0, repeats: int = 0) -> Timer:
    """The timer for ``platform``. ``warmup``/``repeats`` are call counts (0: the
    timer's default); on CUDA/ROCm do_bench sizes its runs from time budgets instead."""
    return platforms.get(platform).timer(warmup, repeats)


@dataclass(frozen=True)
class Timing:
    device_s: float   # seconds per call, start to completion
    host_s: float     # median seconds the caller spends inside one call


def device_module(device: torch.device):
    """torch.cuda / torch.npu (whichever backs ``device``), or None for the CPU."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type)


def time_calls(fn: Callable[[], None], device: torch.device, *, warmup: int = 2,
               iters: int = 10) -> Timing:
    """Run ``fn`` ``warmup`` times, then time ``iters`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    platforms.synchronize(device)
    mod = device_module(device)
    events = mod is not None and hasattr(mod, "Event")
    if events:
        start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        start.record()
    t_start = time.perf_counter()
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
    if events:
        end.record()
        end.synchronize()
        device_s = start.elapsed_time(end) / 1e3 / iters
    else:
        platforms.synchronize(device)
        device_s = (time.perf_counter() - t_start) / iters
    return Timing(device_s=device_s, host_s=statistics.median(host))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
