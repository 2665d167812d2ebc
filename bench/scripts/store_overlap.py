"""What the store tier's overlap buys: `StoreTier` backup and prefetch as shipped (each
page staged and sealed on the engine's thread as the engine sends it, verified and
placed in its host page as it lands; a call of several batches runs each batch's
engine call on the tier's worker thread beside its neighbours') beside the same calls
run one step after another (engine calls on the calling thread, each batch staged and
sealed before its engine call, verified and placed after it), beside the shipped calls
with pages verified and placed after each engine call instead of as they land, and
beside the shipped calls without the checksum, interleaved in one process on one store.

Pages of 256 KiB and 1 MiB (the bench's MHA bf16 pools), host layouts
``page_first_direct`` (in place) and ``page_first`` (staged), 64 MiB of pages per point,
GB/s of page payload, best of ``--rounds`` after a warm-up round::

    .venv/bin/python bench/scripts/store_overlap.py file:///dev/shm/kvtier-overlap [--rounds 5]

The file store spreads each call over its threads either way (``?threads=1`` for one).
Figures, not assertions: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import time
import uuid

import torch

from kvtier.store.bench import Unchecked, bench_host
from kvtier.store.engine import Engine, open_store
from kvtier.store.tier import StoreTier

PAGE_BYTES = (256 << 10, 1 << 20)
LAYOUTS = ("page_first_direct", "page_first")
TOTAL_BYTES = 64 << 20


class _InOrder:
    """An executor that runs each call at once on the calling thread: no overlap."""

    def submit(self, fn, *args):
        done = concurrent.futures.Future()
        done.set_result(fn(*args))
        return done


class _WholeBatches(Engine):
    """``inner`` as an engine whose client takes a batch at once: every source filled
    before the call, no page reported landed (the tier then stages and seals a batch
    before its engine call, and verifies and places it after)."""

    def __init__(self, inner: Engine):
        super().__init__(f"whole-batches+{inner.url}")
        self.inner = inner

    def _exists(self, keys):
        return self.inner.exists(keys)

    def _get_into(self, keys, targets, landed):
        return self.inner.get_into(keys, targets)

    def _put_from(self, keys, sources, fill):
        return self.inner.put_from(keys, sources, fill)

    def _delete(self, keys):
        return self.inner.delete(keys)


class _Unreported(_WholeBatches):
    """``inner`` reporting no page landed, its puts as ``inner`` makes them: the tier
    then verifies and places each batch after its engine call."""

    def __init__(self, inner: Engine):
        super().__init__(inner)
        self.fills_as_sent = inner.fills_as_sent


def _tiers(host, engine):
    shipped = StoreTier(host, engine, model="overlap-bench", tp=(0, 8))
    in_order = StoreTier(host, _WholeBatches(engine), model="overlap-bench", tp=(0, 8))
    in_order._workers = _InOrder
    after = StoreTier(host, _Unreported(engine), model="overlap-bench", tp=(0, 8))
    unchecked = StoreTier(host, engine, model="overlap-bench", tp=(0, 8))
    unchecked.format.checksum = Unchecked()
    return {"in order": in_order, "as shipped": shipped, "checked after each call": after,
            "as shipped, no checksum": unchecked}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url", help="the store, as for kvtier bench --store")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per point (default 5)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be at least 1")
    engine = open_store(args.url)
    try:
        modes = ("in order", "as shipped", "checked after each call", "as shipped, no checksum")
        print(f"{'page':>8} {'layout':18} " + "  ".join(f"{m:>24}" for m in modes))
        print(f"{'':>8} {'':18} " + "  ".join(f"{'backup / prefetch GB/s':>24}" for _ in modes))
        for size in PAGE_BYTES:
            pages = TOTAL_BYTES // size
            for layout in LAYOUTS:
                host = bench_host(size, pages, layout)
                tiers = _tiers(host, engine)
                idx = torch.arange(pages * host.page_size, dtype=torch.int64)
                best = {m: [1e9, 1e9] for m in tiers}
                for r in range(args.rounds + 1):           # round 0 warms up
                    for mode, tier in tiers.items():
                        keys = [uuid.uuid4().hex for _ in range(pages)]
                        t0 = time.perf_counter()
                        tier.backup(keys, idx)
                        t1 = time.perf_counter()
                        got = tier.prefetch(keys, idx)
                        t2 = time.perf_counter()
                        engine.delete([tier.key(k) for k in keys])
                        if got != pages:
                            raise SystemExit(f"{mode}: prefetch read {got} of {pages} pages ({tier.stats})")
                        if r:
                            best[mode] = [min(best[mode][0], t1 - t0), min(best[mode][1], t2 - t1)]
                total = pages * size / 1e9
                print(f"{size >> 10:>4} KiB {layout:18} " + "  ".join(
                    f"{total / b:>11.2f} / {total / p:<10.2f}" for b, p in best.values()))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
