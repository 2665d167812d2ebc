"""Compute interference: a transfer's throughput beside a concurrent GEMM's slowdown.

HiCache moves KV while the forward pass runs, so what a transfer costs the model is the
compute it takes away. Per link operation (``backup``, ``load``), the pools' kernel
transfer runs on one stream, once with the configuration the pools look up (the
default) and once per program cap the autotuner searches (`autotune.space.program_counts`
up to the platform's cap), while square bf16 GEMMs run on a second stream. References:
the pools' ``dma`` strategy and one torch ``copy_`` of the same bytes (copy engines).

Per engine: the GEMM's and the transfer's kernel-only time alone (`time_calls`, each on
its own stream), then both together: a device sleep holds the GEMM stream while the host
queues ``gemms`` GEMMs there and enough transfers on the other stream (which waits for
the sleep's end) to span them, so both start together. The GEMM's slowdown is its
per-GEMM time beside the transfer over its time alone; the transfer's GB/s beside the
GEMM is its loop's bytes over its loop's time; ``overlap`` is the share of the GEMM loop
during which the transfer loop ran.

CUDA (and ROCm through torch.cuda) only: `measure` returns ``{"skipped": ...}`` elsewhere.
With ``allow_cpu`` (tests) the two streams run one after the other on the CPU, which gives
the structure of the result and no interference figure.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

import torch

import kvtier.platforms as platforms
from kvtier.autotune.space import program_counts
from kvtier.autotune.timing import gbps, time_calls
from kvtier.platforms.events import busy_keeper, can_sleep

from . import pool_engine, torch_baseline
from .report import CEILING_STYLE, colour, draw
from .runner import WrongBytes, environment, timing_fields, verified_run
from .sweep import Sweep
from .workload import Shape, Workload

GOAL_PCT = 5.0           # a concurrent GEMM slows by at most this with the default cap
MAX_CALLS = 20000        # transfers queued in one concurrent run, at most
CAPPED = "kvtier pool kernel capped"   # the pools' kernel transfer, grid capped at N programs
SKIP = "kvtier bench --interference: needs a CUDA or ROCm device; skipped on {}"


@dataclass(frozen=True)
class Setup:
    """What one interference run measures."""
    ops: tuple = ("backup", "load")
    layout: str = "layer_first"
    row_bytes: int = 1024
    page_size: int = 64
    tokens: int = 16384
    max_bytes: int = 64 << 20     # one transfer: layers lowered to fit
    caps: tuple = ()              # () = the autotuner's program counts on this device
    gemm_n: int = 8192            # square GEMM side
    gemms: int = 20               # GEMMs in the concurrent run
    warmup: int = 3
    iters: int = 20               # timed calls alone, per engine and for the GEMM
    dtype: str = "bfloat16"

    def shape(self) -> Shape:
        sweep = Sweep(grids=(), max_bytes=self.max_bytes)
        return sweep.shape(self.layout, self.row_bytes, self.page_size, self.tokens)


# A configuration small enough for the interpreter (tests, CPU).
TINY = Setup(row_bytes=128, page_size=4, tokens=16, max_bytes=4096, caps=(1, 2), gemm_n=32, gemms=2,
             warmup=0, iters=20, dtype="float32")


def default_caps(device: torch.device) -> tuple:
    """The program counts the autotuner times across the link on ``device``."""
    units = int(platforms.device_properties(device).get("compute_units") or 0)
    return tuple(program_counts(platforms.of(device).max_programs(units, True)))


class _Streams:
    """Two streams where the device has a sleep op to start them together (CUDA, ROCm); on
    the CPU one loop runs after the other."""

    def __init__(self, device: torch.device):
        self.device = device
        self.overlap = can_sleep(device)
        self.compute = torch.Stream(device) if self.overlap else None
        self.copy = torch.Stream(device) if self.overlap else None

    def on(self, stream):
        return stream if self.overlap else contextlib.nullcontext()

    def together(self, gemm: Callable, gemms: int, fn: Callable, calls: int, host_s: float) -> dict:
        """Seconds per GEMM and per transfer with both loops running, the share of the
        GEMM loop the transfer loop covered, and whether both were queued before either
        started (``kernel_only``)."""
        if not self.overlap:
            t0 = time.perf_counter()
            for _ in range(gemms):
                gemm()
            t1 = time.perf_counter()
            for _ in range(calls):
                fn()
            t2 = time.perf_counter()
            return {"gemm_s": (t1 - t0) / gemms, "transfer_s": (t2 - t1) / calls, "overlap": 0.0,
                    "kernel_only": False}
        ev = lambda: torch.Event(self.device, enable_timing=True)   # noqa: E731
        go, a0, a1, b0, b1 = ev(), ev(), ev(), ev(), ev()
        keeper = busy_keeper(self.device)
        with self.on(self.compute):
            keeper.start(min(1.0, max(2e-3, 2.0 * host_s)))
            go.record()
        self.copy.wait_event(go)
        with self.on(self.compute):
            a0.record()
            for _ in range(gemms):
                gemm()
            a1.record()
        with self.on(self.copy):
            b0.record()
            for _ in range(calls):
                fn()
            b1.record()
        held = keeper.still_busy()
        platforms.synchronize(self.device)
        at = {name: go.elapsed_time(e) / 1e3 for name, e in (("a0", a0), ("a1", a1), ("b0", b0), ("b1", b1))}
        span = at["a1"] - at["a0"]
        both = max(0.0, min(at["a1"], at["b1"]) - max(at["a0"], at["b0"]))
        return {"gemm_s": span / gemms, "transfer_s": (at["b1"] - at["b0"]) / calls,
                "overlap": both / span if span > 0 else 0.0, "kernel_only": held}


def _engines(device: torch.device, setup: Setup):
    """(series, cap, prepare) per engine: the pools' kernel transfer with the looked-up
    configuration (cap 0) and capped at each program count, then the copy engines."""
    caps = setup.caps or default_caps(device)
    out = [("kvtier pool kernel", 0, lambda w, op: pool_engine.prepare(w, op, strategy="kernel"))]
    out += [(f"{CAPPED} p<={c}", c,
             lambda w, op, c=c: pool_engine.prepare(w, op, strategy="kernel", num_programs=c)) for c in caps]
    out += [("kvtier pool dma", 0, lambda w, op: pool_engine.prepare(w, op, strategy="dma")),
            ("torch copy_", 0, torch_baseline.prepare_copy)]
    return out


def measure(device, setup: Setup = Setup(), *, allow_cpu: bool = False,
            log: Optional[Callable[[str], None]] = print) -> dict:
    """The interference run (JSON-ready), or ``{"skipped": why}`` off CUDA."""
    device = torch.device(device)
    log = log or (lambda s: None)
    if not can_sleep(device) and not (allow_cpu and device.type == "cpu"):
        return {"skipped": SKIP.format(platforms.platform_of(device))}
    start = time.monotonic()
    streams = _Streams(device)
    dtype = getattr(torch, setup.dtype)
    a = torch.randn(setup.gemm_n, setup.gemm_n, device=device).to(dtype)
    b = torch.randn(setup.gemm_n, setup.gemm_n, device=device).to(dtype)
    c = torch.empty(setup.gemm_n, setup.gemm_n, device=device, dtype=dtype)
    gemm = lambda: torch.matmul(a, b, out=c)   # noqa: E731
    with streams.on(streams.compute):
        g_alone = time_calls(gemm, device, warmup=max(setup.warmup, 1), iters=setup.iters)
    flop = 2 * setup.gemm_n ** 3
    log(f"GEMM {setup.gemm_n}^3 {setup.dtype} alone: {g_alone.device_s * 1e6:.1f} us "
        f"({flop / g_alone.device_s / 1e12:.1f} TFLOP/s)")
    shape = setup.shape()
    w = Workload(shape, device, seed=1)
    rows = []
    for op in setup.ops:
        for series, cap, prepare in _engines(device, setup):
            rec = {"op": op, "series": series, "cap": cap, "bytes": w.copy(op).nbytes}
            try:
                rec.update(_measure_engine(w, op, prepare, streams, gemm, g_alone, setup))
            except Exception as e:      # one failing engine must not end the run
                rec["error"] = str(e) if isinstance(e, WrongBytes) else f"{type(e).__name__}: {e}"
            rows.append(rec)
            log(_line(rec))
    out = {"environment": environment(device, Sweep(grids=(), hardware=device.type != "cpu")),
           "setup": {**asdict(setup), "caps": list(setup.caps or default_caps(device)),
                     "layers": shape.layers, "components": shape.components},
           "gemm": {"n": setup.gemm_n, "dtype": setup.dtype, **timing_fields(g_alone),
                    "tflops": flop / g_alone.device_s / 1e12},
           "rows": rows, "goal": goal(rows, graded=device.type != "cpu"),
           "elapsed_s": round(time.monotonic() - start, 1)}
    if device.type == "cpu":
        out["note"] = ("CPU: the two streams run one after the other; these figures show the "
                       "structure only, NOT interference")
    return out


def _measure_engine(w: Workload, op: str, prepare, streams: _Streams, gemm, g_alone, setup: Setup) -> dict:
    p = prepare(w, op)
    with streams.on(streams.copy):
        verified_run(w, op, p)
        t_alone = time_calls(p.fn, w.device, warmup=setup.warmup, iters=setup.iters)
    calls = max(1, min(MAX_CALLS, math.ceil(setup.gemms * g_alone.device_s / max(t_alone.device_s, 1e-9))))
    host_s = setup.gemms * g_alone.host_s + calls * t_alone.host_s
    both = streams.together(gemm, setup.gemms, p.fn, calls, host_s)
    nbytes = w.copy(op).nbytes
    return {"programs": p.programs, "alone": timing_fields(t_alone),
            "gbps_alone": gbps(nbytes, t_alone.device_s), "gbps_concurrent": gbps(nbytes, both["transfer_s"]),
            "transfer_us_concurrent": both["transfer_s"] * 1e6, "calls": calls, "gemms": setup.gemms,
            "gemm_us_alone": g_alone.device_s * 1e6, "gemm_us_concurrent": both["gemm_s"] * 1e6,
            "gemm_slowdown_pct": 100.0 * (both["gemm_s"] / g_alone.device_s - 1.0),
            "overlap": both["overlap"], "kernel_only": both["kernel_only"]}


def goal(rows: list, graded: bool = True) -> dict:
    """The issue's goal, per operation: the GEMM's slowdown beside the default transfer
    (not graded on the CPU, where nothing runs concurrently)."""
    out = {}
    for r in rows if graded else ():
        if r["series"] == "kvtier pool kernel" and "gemm_slowdown_pct" in r:
            out[r["op"]] = {"slowdown_pct": r["gemm_slowdown_pct"], "met": r["gemm_slowdown_pct"] <= GOAL_PCT}
    return {"text": f"a concurrent GEMM slows by <= {GOAL_PCT:g}% beside the default transfer",
            "graded": graded, "ops": out}


def _line(r: dict) -> str:
    head = f"{r['op']:<7} {r['series']:<24}"
    if "error" in r:
        return f"{head} ERROR: {r['error']}"
    return (f"{head} progs {r['programs'] if r['programs'] is not None else '-':>4}  "
            f"{r['gbps_alone']:8.2f} GB/s alone  {r['gbps_concurrent']:8.2f} GB/s beside GEMM  "
            f"GEMM {r['gemm_slowdown_pct']:+6.1f}%  overlap {100 * r['overlap']:3.0f}%")


def format_text(result: dict) -> str:
    """The table and the goal, or the one-line skip."""
    if "skipped" in result:
        return result["skipped"]
    g = result["gemm"]
    lines = [f"interference on {result['environment']['device']}: GEMM {g['n']}^3 {g['dtype']} alone "
             f"{g['device_us']:.1f} us ({g['tflops']:.1f} TFLOP/s); transfer "
             f"{result['setup']['layout']} row {result['setup']['row_bytes']} B P {result['setup']['page_size']} "
             f"n {result['setup']['tokens']} L {result['setup']['layers']}"]
    lines += [_line(r) for r in result["rows"]]
    verdicts = ", ".join(f"{op} {v['slowdown_pct']:+.1f}% ({'met' if v['met'] else 'not met'})"
                         for op, v in result["goal"]["ops"].items())
    if result["goal"]["graded"]:
        lines.append(f"goal: {result['goal']['text']}: {verdicts or 'no default point'}")
    if "note" in result:
        lines.append("NOTE: " + result["note"])
    return "\n".join(lines)


def plot_spec(result: dict) -> dict:
    """Per operation two panels against the program cap: the GEMM's slowdown and the
    transfer's GB/s beside it (alone dotted); the copy engines and the default as
    horizontal lines; the goal line black and dashed. Colours are the benchmark's."""
    panels = []
    for op in result["setup"]["ops"]:
        rows = [r for r in result["rows"] if r["op"] == op and "error" not in r]
        capped = sorted((r for r in rows if r["series"].startswith(CAPPED)), key=lambda r: r["cap"])
        flat = [r for r in rows if r not in capped]
        for metric, label in (("gemm_slowdown_pct", "GEMM slowdown %"), ("gbps_concurrent", "transfer GB/s")):
            lines = [{"label": f"{CAPPED} p<=N", "color": colour(CAPPED),
                      "xy": [(r["cap"], r[metric]) for r in capped]}] if capped else []
            panels.append({"op": op, "metric": metric, "title": f"{op}: {label}", "lines": lines,
                           "levels": [{"label": r["series"], "color": colour(r["series"]), "y": r[metric]}
                                      for r in flat],
                           "goal": {**CEILING_STYLE, "label": f"goal {GOAL_PCT:g}%", "y": GOAL_PCT}
                           if metric == "gemm_slowdown_pct" else None})
    return {"title": f"kvtier bench --interference: {result['environment']['device']}"
            + (" (CPU: NOT interference)" if "note" in result else ""), "panels": panels}


def plot(result: dict, path):
    """`plot_spec` drawn as the benchmark draws its panels, against the program cap."""
    import matplotlib.pyplot as plt
    fig = draw(plot_spec(result), size=(4.2, 3.8), xlabel="programs (cap)", ylabel=None, base=2)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def with_caps(setup: Setup, caps, ops) -> Setup:
    """``setup`` with the CLI's --caps / --ops, where given."""
    return replace(setup, **({"caps": tuple(caps)} if caps else {}), **({"ops": tuple(ops)} if ops else {}))
