"""GB/s of the Mooncake engine's put_from / get_into beside Mooncake's own batch_put_from
/ batch_get_into on registered buffers (`MooncakeEngine.raw_throughput`), in one run, for
64 KiB, 256 KiB and 1 MiB values, in batches of up to 128 keys (HiCache's largest call).

    python bench/scripts/mooncake_engine.py URL [MIB_PER_POINT] [REPEATS]

URL is a mooncake:// URL (the transfer= option is set here: staged and direct are both
measured). Each point moves MIB_PER_POINT MiB (default 64); the figures are medians of
REPEATS (default 5) rounds, raw and engine interleaved in each round. "1 piece" moves
each value from / into one buffer; "2 pieces" splits it as a page object is split
(a 64-byte header, the payload). Prints figures; asserts nothing.
"""
from __future__ import annotations

import statistics
import sys
import time
import uuid

import numpy as np

from kvtier.store import Status, open_store

SIZES = (64 << 10, 256 << 10, 1 << 20)
BATCH = 128


def _engine_round(engine, size: int, count: int, pieces: int):
    src = np.random.randint(0, 256, count * size, dtype=np.uint8)
    dst = np.zeros(count * size, dtype=np.uint8)
    keys = [f"kvtier-bench-{uuid.uuid4().hex}-{i}" for i in range(count)]

    def views(a, i):
        v = memoryview(a)[i * size:(i + 1) * size]
        return [v] if pieces == 1 else [v[:64], v[64:]]
    seconds = []
    for call, buf in ((engine.put_from, src), (engine.get_into, dst)):     # every put, then every get
        spent = 0.0
        for lo in range(0, count, BATCH):
            ks = keys[lo:lo + BATCH]
            t = time.perf_counter()
            st = call(ks, [views(buf, lo + j) for j in range(len(ks))])
            spent += time.perf_counter() - t
            assert all(s == Status.HIT for s in st), st
        seconds.append(spent)
    assert np.array_equal(src, dst)
    engine.delete(keys)
    gb = count * size / 1e9
    return gb / seconds[0], gb / seconds[1]


def main(argv) -> int:
    if not argv or not argv[0].startswith("mooncake://"):
        print(__doc__.strip().splitlines()[-6], file=sys.stderr)
        print("usage: python bench/scripts/mooncake_engine.py URL [MIB_PER_POINT] [REPEATS]",
              file=sys.stderr)
        return 2
    url = argv[0]
    mib = int(argv[1]) if len(argv) > 1 else 64
    repeats = int(argv[2]) if len(argv) > 2 else 5
    sep = "&" if "?" in url else "?"
    engines = {mode: open_store(f"{url}{sep}transfer={mode}", timeout_ms=10000)
               for mode in ("staged", "direct")}
    print(f"{url}: MiB/point={mib} repeats={repeats} (medians, GB/s)")
    print(f"{'value':>8} {'path':<18} {'put':>7} {'get':>7} {'put/raw':>8} {'get/raw':>8}")
    for size in SIZES:
        count = max(1, (mib << 20) // size)
        rows = {"raw": []}
        for rnd in range(repeats):
            raw = engines["staged"].raw_throughput(size, count)
            rows["raw"].append((raw["set_gbps"], raw["get_gbps"]))
            for mode, engine in engines.items():
                for pieces in (1, 2):
                    rows.setdefault(f"{mode}, {pieces} piece{'s' * (pieces > 1)}", []).append(
                        _engine_round(engine, size, count, pieces))
        raw_put = statistics.median(p for p, _ in rows["raw"])
        raw_get = statistics.median(g for _, g in rows["raw"])
        for name, figs in rows.items():
            put = statistics.median(p for p, _ in figs)
            get = statistics.median(g for _, g in figs)
            print(f"{size >> 10:>6}Ki {name:<18} {put:7.2f} {get:7.2f} {put / raw_put:8.2f} "
                  f"{get / raw_get:8.2f}")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
