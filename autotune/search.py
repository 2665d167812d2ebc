"""The search: for each operation and transfer size of a pool shape, time the pools' own
call (`kvtier.bench.pools.TimedCall.runner`) under every candidate configuration, check that it
moved the right bytes, and record the fastest under the key the pools look up: the
operation's name (`Op.name`) and the layers one call moves (1 for load_layer).

`tune` is what `kvtier autotune` runs; `tune_transfer` times one transfer and is what
tests drive with a fake timer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional, Sequence

from kvtier.config import CopyConfig
from kvtier.errors import fail

from . import cache, select
from kvtier.kernels.ops import Op

from .key import DeviceId, TuneKey, device_identity, platform_device
from .prune import codegen_report, codegen_target, prune_spilling
from .space import candidates, default_max_programs
from .timing import Timer, default_timer
from .shape import PoolShape

Progress = Callable[[int, int, str], None]


@dataclass
class Measurement:
    config: CopyConfig
    seconds: float = math.inf
    gbps: float = 0.0
    error: Optional[str] = None     # the run raised, or moved wrong bytes

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class TuneResult:
    """Every measurement of one transfer key, fastest first (failures last)."""
    key: TuneKey
    shape: str
    nbytes: int
    max_programs: int
    measurements: List[Measurement]
    pruned: List[CopyConfig] = field(default_factory=list)

    @property
    def best(self) -> Optional[Measurement]:
        m = self.measurements[0] if self.measurements else None
        return m if m is not None and m.ok else None

    def entry(self, top: int = 5) -> dict:
        """What the cache records for this key."""
        best = self.best
        return {"config": best.config.to_dict(), "gbps": float(f"{best.gbps:.6g}"), "seconds": best.seconds,
                "max_programs": self.max_programs, "shape": self.shape, "timed": len(self.measurements),
                "pruned": len(self.pruned),
                "runners_up": [[m.config.to_dict(), float(f"{m.gbps:.6g}")] for m in self.measurements[1:top] if m.ok]}


def tune_transfer(transfer: "TimedCall", configs: Iterable[CopyConfig], timer: Timer, *,
                  verify: bool = True, progress: Optional[Callable[[str], None]] = None) -> List[Measurement]:
    """Time ``transfer`` under each configuration; fastest first, failures last.

    With ``verify`` the destination is poisoned before each configuration and checked
    bit for bit after it, so a configuration that moves wrong bytes cannot win."""
    out = []
    for cfg in configs:
        m = Measurement(cfg)
        if verify:
            transfer.poison()
        try:
            seconds = float(timer(transfer.runner(cfg), config=cfg))
            if not seconds > 0:
                raise ValueError(f"timer returned {seconds}")
            m.seconds, m.gbps = seconds, transfer.nbytes / seconds / 1e9
            if verify and not transfer.verify():
                m.error = "moved wrong bytes"
        except Exception as e:   # a configuration the device rejects is skipped, not fatal
            m.error = f"{type(e).__name__}: {e}"[:200]
        out.append(m)
        if progress:
            progress(f"{transfer.op} rows={transfer.num_rows} L={transfer.num_layers} {describe_config(cfg)}")
    return sorted(out, key=lambda m: (not m.ok, m.seconds))


def tune(shape: PoolShape, *, ops: Sequence[str] = ("backup", "load", "gather"),
         sizes: Sequence[int] = (4096,), layer_counts: Optional[Sequence[int]] = None,
         platform: Optional[str] = None, timer: Optional[Timer] = None,
         max_programs: Optional[int] = None, quick: bool = False,
         target: Optional[str] = "auto", report=codegen_report, verify: bool = True,
         write: bool = True, progress: Optional[Progress] = None,
         device: Optional[DeviceId] = None, pools: Optional[Callable] = None) -> List[TuneResult]:
    """Tune ``ops`` of ``shape`` for transfers of ``sizes`` rows (and of ``layer_counts``
    layers, default: all), write the winners to the device's cache file and make this
    process's `select_config` see them.

    ``target`` names the codegen target for spill pruning ("auto": the device's own;
    None: no pruning); ``report`` is the codegen report function (tests inject one).
    ``pools``: ``(shape, rows, device) -> pools`` whose ``call(op)`` is the call to time
    (`kvtier.bench.pools.Pools`, what ``kvtier autotune`` passes: the autotuner sits below
    the pools it times, so the caller brings them).
    A platform without its device here, or a cache directory that cannot be written (with
    ``write``), raises `KvtierError` before anything is timed."""
    if not callable(pools):
        raise fail("pools", pools, "must be a callable (shape, rows, device) -> pools, e.g. kvtier.bench.pools.Pools")
    ops = [Op.parse(op, "ops") for op in ops]
    if write:
        cache.writable_cache_dir()     # a cache that cannot be written is refused before timing
    from kvtier.platforms import detect_platform
    platform = platform or detect_platform()
    dev = platform_device(platform)
    device = device or device_identity(platform)
    timer = timer or default_timer(platform)
    target = codegen_target(device) if target == "auto" else target
    jobs, pools_of = [], {}
    for op in ops:
        cap = max_programs or default_max_programs(device, op.crosses_link)
        # A per-layer load moves one layer of the whole pool (its key: num_layers=1).
        counts = (shape.num_layers,) if op.scope == "layer" else (layer_counts or (shape.num_layers,))
        for layers in counts:
            for n in sizes:
                if (layers, n) not in pools_of:    # one pair of pools serves every operation
                    pools_of[layers, n] = pools(dataclasses.replace(shape, num_layers=layers), n, dev)
                t = pools_of[layers, n].call(op)
                shape_kw = _codegen_shape(t)
                cfgs = candidates(device, chunk_bytes=shape_kw["row_bytes"] // shape_kw["n_chunks"],
                                  crosses_link=op.crosses_link, max_programs=cap, quick=quick)
                kept, pruned = prune_spilling(cfgs, target=target, report=report, **shape_kw)
                jobs.append((t, kept, pruned, cap))
    total, done = sum(len(k) for _, k, _, _ in jobs), [0]

    def tick(label: str) -> None:
        done[0] += 1
        if progress:
            progress(done[0], total, label)

    results = []
    for t, kept, pruned, cap in jobs:
        ms = tune_transfer(t, kept, timer, verify=verify, progress=tick)
        key = TuneKey.of(t.op.name, row_bytes=shape.row_bytes, page_size=shape.page_size,
                         num_rows=t.num_rows, num_layers=t.num_layers, crosses_link=t.crosses_link)
        results.append(TuneResult(key, shape.describe(), t.nbytes, cap, ms, pruned))
    winners = {r.key: r.entry() for r in results if r.best is not None}
    if write and winners:
        cache.store(device, winners)
        select.invalidate()
    return results


def _codegen_shape(t) -> dict:
    """The compile-time shape the launcher will see for ``t`` (pages moved as rows where
    both sides store a page contiguously)."""
    src, dst = t.copy.src, t.copy.dst
    as_pages = t.by_page and src.page_contiguous and dst.page_contiguous
    return dict(row_bytes=src.row_bytes * (src.page_size if as_pages else 1),
                src_table=src.is_table, dst_table=dst.is_table,
                page_size=1 if as_pages else src.page_size,
                n_chunks=1 if as_pages else max(src.n_chunks, dst.n_chunks),
                num_components=src.num_components, align=min(src.align, dst.align))


def describe_config(c: CopyConfig) -> str:
    return f"{c.strategy} progs={c.num_programs} rows={c.rows} block={c.block_bytes} warps={c.num_warps}"
