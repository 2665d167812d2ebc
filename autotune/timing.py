"""Device timing for the autotuner and the benchmark, in one place.

- `default_timer(platform)`: ``timer(fn, config=...) -> seconds`` for one call of ``fn``,
  from the platform's record (`kvtier.platforms.get(name).timer`): CUDA events through
  triton.testing.do_bench on CUDA and ROCm, torch.npu events on Ascend, the wall clock on
  the CPU. The tuner ranks configurations by it; tests pass their own timer, and
  ``config`` tells it what is being timed.
- `time_calls(fn, device)`: the benchmark's figures for a loop of back-to-back calls,
  kernel-only device time per call and host time per call as separate fields, each as a
  median with its spread. On CUDA and ROCm a device sleep (`DeviceBusy`) is queued
  first and every call is bracketed by stream events: while the sleep runs the host
  queues all calls, so the device runs them back to back and the events between calls
  count device work only (``kernel_only``). A call that synchronizes inside defeats
  this: the run is retried with a longer sleep, then reported with ``kernel_only``
  False. Ascend has no sleep op (events on an otherwise idle stream); on the CPU
  (interpreter smoke runs) device time is the wall clock.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, List, Optional

import torch

import kvtier.platforms as platforms
from kvtier.platforms.events import DeviceBusy, busy_keeper, device_module

Timer = Callable[..., float]

# Kernel-only timing methods, as `Timing.method` names them.
BUSY_EVENTS = "busy-stream events"     # sleep queued first, events between calls
IDLE_EVENTS = "idle-stream events"     # events between calls, host time may leak in
WALL_CLOCK = "wall clock"              # CPU: calls run synchronously
# Device sleep queued before a timed loop: enough to cover the loop's host time.
MIN_BUSY_S, MAX_BUSY_S, BUSY_TRIES = 2e-3, 1.0, 3


def default_timer(platform: str, warmup: int = 0, repeats: int = 0) -> Timer:
    """The timer for ``platform``. ``warmup``/``repeats`` are call counts (0: the
    timer's default); on CUDA/ROCm do_bench sizes its runs from time budgets instead."""
    return platforms.get(platform).timer(warmup, repeats)


@dataclass(frozen=True)
class Timing:
    """Per-call figures of one timed loop (seconds). ``device_s`` is the median
    kernel-only device time; ``host_s`` the median time the caller spent inside a call."""
    device_s: float
    host_s: float
    iters: int = 1
    device_p10_s: float = 0.0
    device_p90_s: float = 0.0
    device_min_s: float = 0.0
    host_p10_s: float = 0.0
    host_p90_s: float = 0.0
    method: str = WALL_CLOCK
    kernel_only: bool = False     # True: the device never waited for the host inside the loop

    def to_dict(self) -> dict:
        return asdict(self)


def time_calls(fn: Callable[[], None], device: torch.device, *, warmup: int = 2,
               iters: int = 10) -> Timing:
    """Run ``fn`` ``warmup`` times (compilation and first-touch costs land there), then
    time ``iters`` back-to-back calls: kernel-only device time and host time per call."""
    device = torch.device(device)
    host_est = None
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        host_est = took if host_est is None else min(host_est, took)
    platforms.synchronize(device)
    mod = device_module(device)
    if mod is None or not hasattr(mod, "Event"):
        return _wall_clock(fn, device, iters)
    keeper = busy_keeper(device)
    if keeper is None:
        dev, host = _event_loop(fn, mod, iters, None, 0.0)
        return _timing(dev, host, IDLE_EVENTS, False)
    sleep = min(MAX_BUSY_S, max(MIN_BUSY_S, 2.0 * iters * (host_est or 0.0)))
    for _ in range(BUSY_TRIES):
        dev, host = _event_loop(fn, mod, iters, keeper, sleep)
        if dev is not None:
            return _timing(dev, host, BUSY_EVENTS, True)
        if max(host) >= 0.5 * sleep:
            break            # a call waited for the device: no sleep keeps this loop ahead
        sleep = min(MAX_BUSY_S, max(sleep * 4, 2.0 * sum(host)))
    dev, host = _event_loop(fn, mod, iters, None, 0.0)   # the call waits for the device itself
    return _timing(dev, host, IDLE_EVENTS, False)


def _event_loop(fn, mod, iters: int, keeper: Optional[DeviceBusy], sleep: float):
    """(device seconds per call, host seconds per call); device None when the sleep ran
    out before the last call was queued (a gap of host time may be in the figures)."""
    events = [mod.Event(enable_timing=True) for _ in range(iters + 1)]
    host = []
    if keeper is not None:
        keeper.start(sleep)
    events[0].record()
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        events[i + 1].record()
    busy = keeper is None or keeper.still_busy()
    events[-1].synchronize()
    if not busy:
        return None, host
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)], host


def _wall_clock(fn, device: torch.device, iters: int) -> Timing:
    """The CPU: each call runs to completion before it returns; device time is its wall time."""
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        platforms.synchronize(device)
        samples.append(time.perf_counter() - t0)
    return _timing(samples, samples, WALL_CLOCK, False)


def spread(samples: List[float]) -> tuple:
    """(median, p10, p90, min) of ``samples``."""
    if len(samples) > 1:
        dec = statistics.quantiles(samples, n=10, method="inclusive")
        p10, p90 = dec[0], dec[8]
    else:
        p10 = p90 = samples[0]
    return statistics.median(samples), p10, p90, min(samples)


def _timing(dev: List[float], host: List[float], method: str, kernel_only: bool) -> Timing:
    d_med, d_p10, d_p90, d_min = spread(dev)
    h_med, h_p10, h_p90, _ = spread(host)
    return Timing(device_s=d_med, host_s=h_med, iters=len(dev), device_p10_s=d_p10, device_p90_s=d_p90,
                  device_min_s=d_min, host_p10_s=h_p10, host_p90_s=h_p90, method=method,
                  kernel_only=kernel_only)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")
