"""Host overhead of a per-layer load: the time a call spends before its kernel launch
(argument checks, planning, configuration lookup), per call.

Runs anywhere, the CPU included: inside `LaunchProbe` the launch is replaced by a
recorder, so what is timed is exactly the host path up to the launch. Goal: at most
20 us per call (printed, never asserted).
"""
from __future__ import annotations

import statistics
import time

import torch

from kvtier.kernels import copy_rows

from .kvtier_engine import config_for
from .probe import LaunchProbe
from .workload import Shape, Workload

GOAL_US = 20.0
# A small per-layer load: K and V, 1 KiB rows, 16-token pages, 256 tokens.
SHAPE = Shape(components=2, layers=4, row_bytes=1024, page_size=16, tokens=256, layout="layer_first")


def _per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` batches of the mean time of ``calls`` calls."""
    for _ in range(min(calls, 50)):
        fn()
    batches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - t0) / calls)
    return statistics.median(batches) * 1e6


def measure_overhead(device: torch.device, calls: int = 500, shape: Shape = SHAPE) -> dict:
    """us per call before the launch, for the pool's per-layer load with the kernel
    strategy (without and with value checks) and for the bare copy_rows path the pool
    ends in."""
    variants = {}
    for check in (False, True):
        w = Workload(shape, device, strategy="kernel", check=check)
        variants[f"HostPool.load_to_device_per_layer(check={check})"] = w.transfer("load_layer").runner()
    t = w.copy("load_layer")

    def bare():
        cfg = config_for(w, "load_layer")
        copy_rows(t.src, t.src_indices, t.dst, t.dst_indices, src_layer=t.src_layer, dst_layer=t.dst_layer,
                  num_layers=1, by_page=shape.page_size > 1, config=cfg, check=False)

    variants["select_config + copy_rows(check=False)"] = bare
    results = {}
    with LaunchProbe() as probe:
        for name, fn in variants.items():
            results[name] = _per_call_us(fn, calls)
        launched = len(probe.grids)
    hot = results["HostPool.load_to_device_per_layer(check=False)"]
    verdict = "meets" if hot <= GOAL_US else "misses"
    return {"goal_us": GOAL_US, "device": str(device), "shape": shape.__dict__, "us_per_call": results,
            "launches_recorded": launched,
            "summary": f"{hot:.1f} us per call (pool, no value checks) {verdict} the {GOAL_US:.0f} us goal"}


def format_overhead(o: dict) -> str:
    lines = [f"host time before launch, per-layer load ({o['device']}; goal <= {o['goal_us']:.0f} us):"]
    lines += [f"  {us:8.1f} us  {name}" for name, us in o["us_per_call"].items()]
    return "\n".join(lines)
