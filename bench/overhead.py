"""Host time per call of kvtier's hot-path calls, beside torch's own index ops in the same
run, on the same device and sizes (`kvtier bench --overhead`; docs/benchmarks.md, "Host
overhead", describes every series, the shape, the index lists and the goals).

Calls: the pools' backup and loads (all layers; per layer, every layer in turn), a batch
plan's ``load_layer``, ``DevicePool.gather`` into ``out=`` and into new buffers,
``DevicePool.scatter``, and the SGLang adapter's ``transfer_kv_per_layer`` and
``transfer_kv_all_layer`` on buffers registered as ``install()`` registers SGLang's pools;
each with its defaults (value checks on, no device sync). Baselines: one
``torch.index_select`` and one ``Tensor.index_copy_`` of the same rows of one device layer.

Index lists are new per all-layer call (made before timing), one pair per layer walk for
the per-layer calls, as an engine hands them over, so what kvtier keeps per index tensor
is reused exactly where an engine would reuse it. Each call is timed alone
(``perf_counter_ns``), the series interleaved in batches after a warm-up.

- CPU: kernels would run under Triton's interpreter, so the calls are timed up to the
  launch: inside `LaunchProbe` the row-copy and index-check kernels are recorded, not run
  (``CPU_NOTE``). The torch ops run (they are the copy), on one intra-op thread.
- GPU: the full call, launches included, with a long device op queued before each batch
  so that no call waits for the device.

Frames (`frames_per_call`): kvtier frames entered from the public method to the launch.

Goal: each call at most 2x each torch op's median; on an H200 also at most 20 us median.
Up to the launch, a call at most 1x ``torch.index_select``, a plan's ``load_layer`` at
most 0.5x. Printed as "meets" / "misses", never asserted.
"""
from __future__ import annotations

import itertools
import math
import time
from contextlib import ExitStack
from typing import Callable, Dict, List, Optional, Tuple

import torch

import kvtier.platforms as platforms
from kvtier.autotune.timing import spread

from kvtier.platforms.events import busy_keeper

from .probe import LaunchProbe
from .report import versions, write_json  # noqa: F401  (write_json: the overhead's JSON, as the sweep's)

CPU_NOTE = "cpu: host time up to the launch; kernels not run"
FULL_NOTE = ("full call wall time, launches included; on CUDA/ROCm the device is kept busy by a "
             "queued sleep so no call waits for it")
PRELAUNCH_NOTE = "host time up to the launch; kernels not run"
GOAL_RATIO = 2.0        # call / torch op, medians
GOAL_US = 20.0          # median host us per call, graded on an H200 only
# Up to the launch (the CPU's mode), a call should cost at most one torch.index_select,
# a planned layer load half of one.
PRELAUNCH_RATIO, PRELAUNCH_OP = 1.0, "torch.index_select"
PLAN_CALL, PLAN_RATIO = "TransferPlan.load_layer", 0.5
CALLS = ("HostPool.backup_from_device_all_layer", "HostPool.load_to_device_all_layer",
         "HostPool.load_to_device_per_layer", PLAN_CALL, "DevicePool.gather", "DevicePool.gather (new buffers)",
         "DevicePool.scatter", "sglang.transfer_kv_per_layer", "sglang.transfer_kv_all_layer")
TORCH_OPS = ("torch.index_select", "Tensor.index_copy_")
# K and V, 1 KiB rows (8 heads x 64 bf16), 16-token pages, 256 tokens.
SHAPE = dict(layers=16, heads=8, head_dim=64, dtype=torch.bfloat16, page_size=16, tokens=256,
             host_layout="layer_first")
# Timed calls per series, warm-up calls, calls per batch; by mode.
COUNTS = {"cpu": dict(calls=1000, warmup=20, batch=50), "gpu": dict(calls=1000, warmup=20, batch=50)}
MIN_BUSY_S, MAX_BUSY_S = 2e-3, 0.5
LISTS = 512             # new index lists per series before they come round (see build_calls)


# ------------------------------------------------------------------ the calls
def overhead_pools(device: torch.device, shape: Optional[dict] = None):
    """The `Pools` every call of the measurement moves (``SHAPE``, updated by ``shape``)."""
    from kvtier.autotune.shape import PoolShape
    from kvtier.bench.pools import Pools
    s = dict(SHAPE, **(shape or {}))
    ps = PoolShape.mha(s["layers"], s["heads"], s["head_dim"], s["dtype"], page_size=s["page_size"],
                       host_layout=s["host_layout"])
    return Pools(ps, s["tokens"], device, spare=2, strategy="kernel", check=None)


def build_calls(device: torch.device, shape: Optional[dict] = None,
                lists: int = LISTS) -> Tuple[Dict[str, Callable], dict]:
    """(name -> callable for every call of ``CALLS`` and ``TORCH_OPS``, what they move);
    ``lists``: the calls each series makes before its index lists come round again."""
    from kvtier.adapters import registry, transfer_kv_all_layer, transfer_kv_per_layer
    from kvtier.pool.gather import group_shape
    from kvtier.pool.plan import TransferPlan

    s = dict(SHAPE, **(shape or {}))
    pools = overhead_pools(device, shape)
    ps = pools.pool_shape
    hp, dp = pools.host_pool, pools.device_pool
    hi, di = pools.host_slots, pools.device_slots          # int64, on the device
    P, L = ps.page_size, ps.num_layers
    pages = di[::P] // P
    k, v = dp.buffers["k"], dp.buffers["v"]                 # per-layer device tensors
    host_k, host_v = pools.host[0], pools.host[1]           # SGLang's layer_first (L, size, H, D)

    def table(layers) -> torch.Tensor:                     # SGLang's k_data_ptrs
        return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64, device=device)

    dev_k, dev_v, host_kt, host_vt = table(k), table(v), table(host_k), table(host_v)
    # SGLang's buffers registered as install() registers its pools (owner: the pools, held
    # by the adapter series below), so its calls launch their prepared transfers.
    registry.register(pools, [host_k, host_v, k, v, dev_k, dev_v, host_kt, host_vt])
    item = ps.row_bytes
    src, dst = k[L - 1], v[L - 1]                           # one device layer
    rows = torch.index_select(src, 0, di)

    def fresh(n):                   # new index lists per batch (see the module doc: "Index lists")
        return [(hi.clone(), di.clone()) for _ in range(n)]

    sets = fresh(-(-lists // L))                            # per-layer walks: a pair per L calls

    def walking(steps, fn):         # a series walking its own arguments: fn(*step) per call
        walk = itertools.cycle(steps).__next__
        return lambda owner=pools: fn(*walk())              # (the owner of the registered buffers held)

    def per_layer(fn):
        return walking([(h, d, layer) for h, d in sets for layer in range(L)], fn)

    def all_layer(fn):
        return walking(fresh(lists), fn)

    # SGLang passes new views of its host buffer on every call (``self.k_buffer[layer]``).
    # They are the caller's arguments, so they are made before timing: a distinct pair
    # for every call of the walk (128 per cycle), and the time is the adapter call's own.
    sglang_per_layer = walking([(host_k[layer], k[layer], host_v[layer], v[layer], h, d, item)
                                for h, d in sets for layer in range(L)], transfer_kv_per_layer)
    plans = [hp.plan(dp, h, d) for h, d in sets]            # one plan per index pair (a batch), before timing
    planned_layers = walking([(plan, dp.start_layer + layer) for plan in plans for layer in range(L)],
                             TransferPlan.load_layer)

    def page_walk():
        return itertools.cycle([d[::P] // P for _, d in fresh(lists)]).__next__

    gather_walk, new_walk, scatter_walk = page_walk(), page_walk(), page_walk()

    def receive_buffers():          # what a receiver allocates: gather()'s layout, one buffer per group
        views = {}
        for names, _ in dp.groups:
            buf = torch.zeros(group_shape(dp, names, pools.tokens, True), dtype=dp.components[names[0]].dtype,
                              device=device)
            views.update((name, buf[i]) for i, name in enumerate(names))
        return views
    received = itertools.cycle([receive_buffers() for _ in range(4)]).__next__
    out = {}                                                # gather(out=) refills these
    # A gather's new result is held until the next one replaces it, as a caller holds it
    # while it sends it: freed at once, its 8 MiB would be handed back to the system and
    # the next series' allocations (index_select's) would fault their pages in again.
    held = [None]

    def gather_into():
        if not out:                                         # the first (warm-up) call makes them
            out.update(dp.gather(pages, pages=True))
        dp.gather(gather_walk(), pages=True, out=out)
    fns = {
        "HostPool.backup_from_device_all_layer": all_layer(lambda h, d: hp.backup_from_device_all_layer(dp, h, d)),
        "HostPool.load_to_device_all_layer": all_layer(lambda h, d: hp.load_to_device_all_layer(dp, h, d)),
        "HostPool.load_to_device_per_layer": per_layer(
            lambda h, d, layer: hp.load_to_device_per_layer(dp, h, d, dp.start_layer + layer)),
        PLAN_CALL: planned_layers,
        "DevicePool.gather": gather_into,
        "DevicePool.gather (new buffers)": lambda: held.__setitem__(0, dp.gather(new_walk(), pages=True)),
        "DevicePool.scatter": lambda: dp.scatter(scatter_walk(), received(), pages=True),
        "sglang.transfer_kv_per_layer": sglang_per_layer,
        "sglang.transfer_kv_all_layer": all_layer(lambda h, d, owner=pools: transfer_kv_all_layer(
            dev_k, host_kt, dev_v, host_vt, d, h, item, L)),
        "torch.index_select": all_layer(lambda h, d: torch.index_select(src, 0, d)),
        "Tensor.index_copy_": all_layer(lambda h, d: dst.index_copy_(0, d, rows)),
    }
    what = {"components": 2, "layers": L, "row_bytes": item, "row": [s["heads"], s["head_dim"]],
            "dtype": str(s["dtype"]).replace("torch.", ""), "page_size": P, "tokens": pools.tokens,
            "host_layout": s["host_layout"], "device_pool_slots": dp.size, "host_pool_slots": hp.size,
            "indices": f"int64 on the device, whole pages in scattered order; all-layer calls, gather "
                       f"and the torch ops take new index tensors for every call (up to {lists} per series, "
                       f"made before timing)",
            "per_layer_calls": f"each list for layers 0..{L - 1} in turn (HiCache's layer loop)",
            "torch_ops": f"one device layer: {pools.tokens} rows of {item} B",
            "sglang": "transfer_kv_per_layer: load, host layer_first buffer -> device layer tensors; "
                      "transfer_kv_all_layer: backup, uint64 pointer tables on the device"}
    return fns, what


def prelaunch_limit(call: str) -> float:
    """The most ``call`` may cost up to its launch, in ``torch.index_select``s."""
    return PLAN_RATIO if call == PLAN_CALL else PRELAUNCH_RATIO


# ------------------------------------------------------------------ frames
def _kvtier_dirs() -> tuple:
    """The folders of kvtier's library packages (the CLI and the benchmark apart)."""
    import os
    import kvtier
    import kvtier.adapters
    import kvtier.autotune
    import kvtier.kernels
    import kvtier.platforms
    import kvtier.pool
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (
        kvtier, kvtier.adapters, kvtier.autotune, kvtier.kernels, kvtier.platforms, kvtier.pool))


def frames_per_call(fn: Callable, calls: int = 32) -> float:
    """Frames entered in kvtier's library per call of ``fn`` (a ``sys.setprofile`` counter
    over ``calls`` calls; C functions not counted)."""
    import sys
    dirs, count = _kvtier_dirs(), [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(dirs):
            count[0] += 1
    sys.setprofile(profile)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return count[0] / calls


# ------------------------------------------------------------------ timing
def time_series(fns: Dict[str, Callable], device: torch.device, *, calls: int, warmup: int, batch: int,
                keeper=None, probe: Optional[LaunchProbe] = None) -> Dict[str, dict]:
    """Per series: nanoseconds of each timed call, launches recorded per call (under a
    probe), and how many batches kept the device busy to their end (with a keeper)."""
    sync = lambda: platforms.synchronize(device) if device.type != "cpu" else None  # noqa: E731
    sleep = {}          # seconds of device sleep queued before each batch, per series
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        sleep[name] = min(MAX_BUSY_S, max(MIN_BUSY_S, 4 * (time.perf_counter() - t0)))
        sync()
    out = {name: {"ns": [], "copy_launches": 0, "check_launches": 0, "batches": 0, "busy_batches": 0}
           for name in fns}
    for _ in range(math.ceil(calls / batch)):
        for name, fn in fns.items():
            rec = out[name]
            if keeper is not None:
                keeper.start(sleep[name])
            marks = (len(probe.grids), len(probe.check_grids)) if probe is not None else None
            ns = rec["ns"]
            for _ in range(batch):
                t0 = time.perf_counter_ns()
                fn()
                ns.append(time.perf_counter_ns() - t0)
            if probe is not None:
                rec["copy_launches"] += len(probe.grids) - marks[0]
                rec["check_launches"] += len(probe.check_grids) - marks[1]
            rec["batches"] += 1
            if keeper is not None:
                if keeper.still_busy():
                    rec["busy_batches"] += 1
                else:               # the next batch of this series sleeps longer
                    sleep[name] = min(MAX_BUSY_S, 2 * sleep[name])
            sync()
    return out


def stats_us(ns: List[int]) -> dict:
    """median, p10, p90, min and count of per-call nanoseconds, in microseconds."""
    med, p10, p90, low = (round(v, 3) for v in spread([x / 1e3 for x in ns]))
    return {"median_us": med, "p10_us": p10, "p90_us": p90, "min_us": low, "calls": len(ns)}


# ------------------------------------------------------------------ the measurement
def measure_overhead(device: Optional[torch.device] = None, *, calls: Optional[int] = None,
                     warmup: Optional[int] = None, batch: Optional[int] = None,
                     shape: Optional[dict] = None, prelaunch: Optional[bool] = None) -> dict:
    """Host us per call of every call of ``CALLS`` and ``TORCH_OPS`` on ``device`` (default:
    the detected one), their ratios and goal verdicts; see the module doc. ``prelaunch``:
    time up to the launch under `LaunchProbe` (default: on the CPU only); False runs the
    kernels (on the CPU: under Triton's interpreter, slowly; tests use it)."""
    device = torch.device(device) if device is not None else platforms.default_device()
    on_cpu = device.type == "cpu"
    prelaunch = on_cpu if prelaunch is None else bool(prelaunch)
    counts = dict(COUNTS["cpu" if on_cpu else "gpu"])
    counts.update({k: v for k, v in (("calls", calls), ("warmup", warmup), ("batch", batch)) if v})
    counts["batch"] = min(counts["batch"], counts["calls"])
    fns, what = build_calls(device, shape, lists=counts["warmup"] + counts["batch"] + counts["calls"])
    keeper = None if on_cpu or prelaunch else busy_keeper(device)
    threads = torch.get_num_threads()
    with ExitStack() as stack:
        probe = stack.enter_context(LaunchProbe()) if prelaunch else None
        if on_cpu:
            # Torch's intra-op pool adds thread wake-ups (milliseconds where CPUs are
            # throttled) to ops this small; one thread times the copy itself.
            torch.set_num_threads(1)
            stack.callback(torch.set_num_threads, threads)
        t0 = time.perf_counter()
        raw = time_series(fns, device, keeper=keeper, probe=probe, **counts)
        elapsed = time.perf_counter() - t0
        frames = {n: frames_per_call(fns[n]) for n in CALLS}
    name = platforms.device_name(device) or "cpu"
    h200 = "H200" in name.upper()
    series = {}
    for n, rec in raw.items():
        s = stats_us(rec["ns"])
        if probe is not None:
            s["launches_per_call"] = {"copy": rec["copy_launches"] / s["calls"],
                                      "check": rec["check_launches"] / s["calls"]}
        if keeper is not None:
            s["device_busy_batches"] = f"{rec['busy_batches']}/{rec['batches']}"
        series[n] = s
    torch_ops = {n: series[n] for n in TORCH_OPS}
    results = {}
    for n in CALLS:
        s = dict(series[n])
        s["frames"] = round(frames[n], 2)
        s["ratio"] = {t: round(s["median_us"] / max(torch_ops[t]["median_us"], 1e-9), 3) for t in TORCH_OPS}
        misses = [f"{r:.2f}x {t}" for t, r in s["ratio"].items() if r > GOAL_RATIO]
        if h200 and s["median_us"] > GOAL_US:
            misses.append(f"{s['median_us']:.1f} us > {GOAL_US:.0f} us")
        s["goal"] = "misses" if misses else "meets"
        if misses:
            s["misses"] = misses
        if prelaunch:
            s["prelaunch_limit"] = limit = prelaunch_limit(n)
            s["prelaunch_goal"] = "meets" if s["ratio"][PRELAUNCH_OP] <= limit else "misses"
        results[n] = s
    met = sum(r["goal"] == "meets" for r in results.values())
    hot = results["HostPool.load_to_device_per_layer"]
    mode = "pre-launch" if prelaunch else "full call"
    out = {
        "kind": "kvtier host overhead",
        "device": name, "platform": platforms.platform_of(device), "mode": mode,
        "note": (CPU_NOTE if on_cpu else PRELAUNCH_NOTE) if prelaunch else FULL_NOTE,
        "kernels_run": not prelaunch,
        "checks": "default (check=None: value checks on unless KVTIER_CHECK=0; no device sync)",
        "strategy": "kernel",
        "shape": what,
        "calls": results,
        "torch": torch_ops,
        "goal": {"ratio_max": GOAL_RATIO, "against": list(TORCH_OPS),
                 "host_us_max": GOAL_US, "host_us_graded": h200,
                 "text": f"call <= {GOAL_RATIO:g}x each torch op (medians)"
                         + (f" and <= {GOAL_US:g} us" if h200 else f"; <= {GOAL_US:g} us on an H200 only"),
                 **({"prelaunch": f"up to the launch: call <= {PRELAUNCH_RATIO:g}x {PRELAUNCH_OP}, "
                                  f"{PLAN_CALL} <= {PLAN_RATIO:g}x (medians)",
                     "prelaunch_met": sum(r["prelaunch_goal"] == "meets" for r in results.values())}
                    if prelaunch else {})},
        "timing": {**counts, "series_interleaved": True, "clock": "time.perf_counter_ns per call",
                   "device_busy": ("torch.cuda._sleep queued before each batch" if keeper is not None
                                   else "not needed (kernels not run)" if prelaunch
                                   else "not needed (cpu)" if on_cpu else "no sleep op on this platform"),
                   "torch_threads": 1 if on_cpu else threads, "elapsed_s": round(elapsed, 2)},
        "environment": versions(),
        "summary": (f"{met}/{len(results)} calls meet the goal ({mode}); load_to_device_per_layer "
                    f"{hot['median_us']:.1f} us, " + ", ".join(f"{r:.2f}x {t}" for t, r in hot["ratio"].items())
                    + (f" ({CPU_NOTE})" if on_cpu and prelaunch else "")),
    }
    if probe is not None:
        out["launches_recorded"] = {"copy": len(probe.grids), "check": len(probe.check_grids)}
    return out


# ------------------------------------------------------------------ output
def format_overhead(o: dict) -> str:
    s = o["shape"]
    lines = [f"host time per call, us ({o['device']}, {o['mode']}): {o['note']}",
             f"  K and V, {s['layers']} layers, {s['row_bytes']} B rows, {s['page_size']}-token pages, "
             f"{s['tokens']} tokens, {s['host_layout']} host; kernel strategy; checks {o['checks']}"]
    head = f"  {'call':<40} {'median':>8} {'p10':>8} {'p90':>8} {'frames':>7}" + "".join(
        f" {'x ' + t.split('.')[-1]:>14}" for t in TORCH_OPS) + "  goal" + (
        f"   up to the launch (limit x {PRELAUNCH_OP.split('.')[-1]})" if "prelaunch" in o["goal"] else "")
    lines.append(head)
    for n, r in o["calls"].items():
        lines.append(f"  {n:<40} {r['median_us']:8.1f} {r['p10_us']:8.1f} {r['p90_us']:8.1f} {r['frames']:7.1f}"
                     + "".join(f" {r['ratio'][t]:14.2f}" for t in TORCH_OPS) + f"  {r['goal']:<6}"
                     + (f"  {r['prelaunch_goal']} ({r['prelaunch_limit']:g}x)" if "prelaunch_goal" in r else ""))
    for n, r in o["torch"].items():
        lines.append(f"  {n:<40} {r['median_us']:8.1f} {r['p10_us']:8.1f} {r['p90_us']:8.1f}")
    lines.append(f"  goal: {o['goal']['text']} (printed, never asserted)")
    if "prelaunch" in o["goal"]:
        lines.append(f"  {o['goal']['prelaunch']}: {o['goal']['prelaunch_met']}/{len(o['calls'])} calls")
    if "launches_recorded" in o:
        lr = o["launches_recorded"]
        lines.append(f"  launches recorded, not run: {lr['copy']} row-copy, {lr['check']} index-check")
    return "\n".join(lines)

