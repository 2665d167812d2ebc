"""Run a sweep: measure the ceilings, then every point of every engine, each one
verified byte for byte before it is timed."""
from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch

from kvtier.autotune.timing import gbps, time_calls
from kvtier.platforms.events import can_sleep
from kvtier.kernels.ops import Op
from kvtier.platforms import device_name, platform_of, synchronize

from . import kvtier_engine, pool_engine, sgl_baseline, torch_baseline, vllm_baseline
from .ceiling import measure_ceilings
from .report import series, versions
from .sweep import Sweep
from .workload import Prepared, Unsupported, Workload

# Seconds of timed calls a point aims for: fewer iterations for slow points.
POINT_BUDGET_S = 0.25


def environment(device: torch.device, sweep: Sweep) -> dict:
    """Where and how the run was made; ``hardware_figures`` is False for CPU runs."""
    env = dict(versions(), device=device_name(device) or "cpu", platform=platform_of(device),
               hardware_figures=device.type != "cpu" and sweep.hardware)
    if device.type == "cpu":
        env["note"] = ("CPU smoke run: kernels run under Triton's interpreter (or the torch "
                       "reference); these figures are NOT hardware figures")
    return env


def method(sweep: Sweep, device: torch.device) -> dict:
    """How every figure of the run was timed (the same for kvtier, baselines and ceilings)."""
    return {"timer": "kvtier.autotune.timing.time_calls", "warmup_calls": sweep.warmup,
            "min_iters": sweep.min_iters, "max_iters": sweep.iters, "point_budget_s": POINT_BUDGET_S,
            "device_time": "median of per-call stream events on a pre-busied stream (kernel only)"
                           if can_sleep(device) else "wall clock per call" if device.type == "cpu"
                           else "median of per-call stream events (idle stream)",
            "host_time": "median perf_counter time inside each call, reported separately",
            "verification": "one verified call before timing (JIT compilation lands there)"}


def baselines_status(sweep: Sweep, device: torch.device) -> dict:
    """Per baseline the run asked for: "runs", or why it does not run here."""
    out = {}
    for name in sweep.baselines:
        if name in ("torch", "torch copy_"):
            out[name] = "runs"
        elif name == "sgl_kernel":
            out[name] = "runs" if sgl_baseline.load_kvcacheio() is not None else sgl_baseline.ABSENT
        elif name == "vllm":
            out[name] = vllm_baseline.status(device)
    return out


def _engines(sweep: Sweep, op: str, strategies: tuple, caps: tuple):
    """(engine, strategy, cap, prepare(workload, op)) for every engine at one point."""
    out = [("pool", st, 0, functools.partial(pool_engine.prepare, strategy=st))
           for st in (strategies if Op.parse(op).crosses_link else ("-",))]
    out += [("copy_rows", "kernel", cap, functools.partial(kvtier_engine.prepare, num_programs=cap))
            for cap in caps]
    if "torch" in sweep.baselines:
        out.append(("torch", "-", 0, torch_baseline.prepare))
    if "torch copy_" in sweep.baselines:
        out.append(("torch copy_", "-", 0, torch_baseline.prepare_copy))
    if "vllm" in sweep.baselines and vllm_baseline.applies(op):
        swap = vllm_baseline.load_swap()
        if swap is not None:
            out.append(("vllm", "-", 0, functools.partial(vllm_baseline.prepare, swap=swap)))
    kvio = sgl_baseline.load_kvcacheio() if "sgl_kernel" in sweep.baselines else None
    if kvio is not None:
        out.append(("sgl_kernel", "-", 0, functools.partial(sgl_baseline.prepare, kvio=kvio)))
    return out


class WrongBytes(RuntimeError):
    """An engine's verified run left a destination row different from its source row."""


def verified_run(w: Workload, op: str, p: Prepared) -> float:
    """Poison the destination, run ``p`` once (its first call: compilation lands here) and
    compare every destination row with its source row; the wall seconds of that run.
    Raises `WrongBytes` naming the first difference."""
    w.poison(op)
    synchronize(w.device)
    t0 = time.perf_counter()
    p.fn()
    synchronize(w.device)
    once = time.perf_counter() - t0
    t = p.written() if p.written else w.copy(op)
    wrong = "nothing written" if t is None else t.mismatch()
    if wrong:
        raise WrongBytes(f"wrong bytes: {wrong}")
    return once


def point_iters(sweep: Sweep, once: float) -> int:
    """Timed calls for a call that took ``once`` seconds: what fits in the point budget,
    within the sweep's bounds (so a large --iters cannot make a slow copy run for hours)."""
    return max(sweep.min_iters, min(sweep.iters, int(POINT_BUDGET_S / max(once, 1e-9))))


def measure_point(w: Workload, op: str, prepare: Callable, sweep: Sweep, ceiling: float) -> dict:
    """One engine at one point: prepare, poison the destination, run once, verify, time."""
    rec = {"bytes": w.copy(op).nbytes}
    try:
        p = prepare(w, op)
    except Unsupported as e:
        return {**rec, "skipped": str(e)}
    except Exception as e:   # a failing engine must not end the run; the record says why
        return {**rec, "error": f"{type(e).__name__}: {e}"}
    try:
        once = verified_run(w, op, p)
        tm = time_calls(p.fn, w.device, warmup=sweep.warmup, iters=point_iters(sweep, once))
    except Exception as e:
        return {**rec, "error": str(e) if isinstance(e, WrongBytes) else f"{type(e).__name__}: {e}"}
    rate = gbps(rec["bytes"], tm.device_s)
    return {**rec, "programs": p.programs, **timing_fields(tm), "gbps": rate,
            "pct_ceiling": 100.0 * rate / ceiling if ceiling > 0 else None}


def timing_fields(tm) -> dict:
    """A `Timing` as a point's fields: kernel-only device time and host time per call are
    separate, each a median with its spread (microseconds)."""
    us = lambda s: round(s * 1e6, 3)   # noqa: E731
    return {"iters": tm.iters, "timing": tm.method, "kernel_only": tm.kernel_only,
            "device_us": us(tm.device_s), "device_p10_us": us(tm.device_p10_s),
            "device_p90_us": us(tm.device_p90_s), "device_min_us": us(tm.device_min_s),
            "host_us": us(tm.host_s), "host_p10_us": us(tm.host_p10_s), "host_p90_us": us(tm.host_p90_s)}


def run_sweep(sweep: Sweep, device: torch.device, *, log: Optional[Callable[[str], None]] = print,
              time_budget_s: Optional[float] = None, on_point: Optional[Callable[[dict], None]] = None) -> dict:
    """Measure every point of ``sweep`` on ``device``; returns the run (JSON-ready).
    ``on_point`` sees each record as it is made (so a killed run leaves its points)."""
    log = log or (lambda s: None)
    start = time.monotonic()
    env = environment(device, sweep)
    log(f"kvtier bench on {env['device']} ({env['platform']})" + (f": {env['note']}" if "note" in env else ""))
    ceilings = measure_ceilings(device, sweep.ceiling_bytes, warmup=sweep.warmup, iters=sweep.iters,
                                iters_for=lambda once: point_iters(sweep, once))
    log(f"ceilings: h2d {ceilings.h2d:.1f} GB/s, d2h {ceilings.d2h:.1f} GB/s, d2d {ceilings.d2d:.1f} GB/s "
        f"({ceilings.nbytes >> 20} MiB copies)")
    points, skipped, truncated = [], 0, False
    w = None
    plan = list(sweep.points())
    total = sum(len(list(_engines(sweep, op, s, c))) for shape, op, s, c in plan if not shape.supported())
    measured_from = time.monotonic()
    for shape, op, strategies, caps in plan:
        if time_budget_s is not None and time.monotonic() - start > time_budget_s:
            truncated = True
            log(f"time budget of {time_budget_s:.0f} s spent: the remaining points are not measured")
            break
        if shape.supported():
            skipped += 1
            continue
        if w is None or w.shape != shape:
            w = None
            if device.type != "cpu":
                getattr(torch, device.type).empty_cache()
            w = Workload(shape, device, seed=len(points))
        for engine, strat, c, prepare in _engines(sweep, op, strategies, caps):
            rec = {"op": op, "layout": shape.layout, "row_bytes": shape.row_bytes,
                   "page_size": shape.page_size, "tokens": shape.tokens, "layers": w.copy(op).num_layers,
                   "components": shape.components, "engine": engine, "strategy": strat, "cap": c}
            rec.update(measure_point(w, op, prepare, sweep, ceilings.of(op)))
            points.append(rec)
            log(f"{_count(len(points), total, time.monotonic() - measured_from)} {_progress(rec)}")
            if on_point:
                on_point(rec)
    return {"environment": env, "ceilings": ceilings.to_dict(), "method": method(sweep, device),
            "baselines": baselines_status(sweep, device), "points": points,
            "skipped_shapes": skipped, "truncated": truncated,
            "elapsed_s": round(time.monotonic() - start, 1)}


def _count(done: int, total: int, elapsed: float) -> str:
    """``[done/total, ETA]``: the time left at the pace so far."""
    left = elapsed / done * (total - done) if done else 0.0
    return f"[{done}/{total}, ETA {left:.0f} s]"


def _progress(r: dict) -> str:
    head = (f"{r['op']:<10} {r['layout']:<17} row {r['row_bytes']:>4} P {r['page_size']:>3} "
            f"n {r['tokens']:>5} {series(r)}")
    if "gbps" in r:
        return f"{head}: {r['gbps']:.2f} GB/s"
    return f"{head}: {r.get('skipped') or r.get('error')}"
