"""Timing one transfer: device time per call (what GB/s is computed from) and host time
per call (how long the calling thread is busy before the call returns).

On an accelerator the device time comes from stream events around a loop of calls, so
it counts the whole stream timeline, host-side work inside a call included; on the CPU
(interpreter smoke runs) it is wall-clock time.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from kvtier.platforms import synchronize


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
    synchronize(device)
    mod = device_module(device)
    host = []
    if mod is not None and hasattr(mod, "Event"):
        start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        device_s = start.elapsed_time(end) / 1e3 / iters
    else:
        t_start = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        synchronize(device)
        device_s = (time.perf_counter() - t_start) / iters
    return Timing(device_s=device_s, host_s=statistics.median(host))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
