"""A/B of the tier's early GETs (`Engine.get_ahead`) in `kvtier bench --store --latency`'s
own rows, in one process: the engine with `sends_ahead` on (the default) and off (the
tier then calls `get_into` once its buffers are made), run after run, interleaved.

    python ahead_ab.py URL [RUNS]
"""
import statistics
import sys

from kvtier.store import bench
from kvtier.store.engine import open_store

url = sys.argv[1]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
engine = open_store(url)
cls = type(engine)
rows = {}
for r in range(runs):
    for ahead in (True, False):
        cls.sends_ahead = ahead
        lat = bench._latency(engine, bench.LAYOUTS, bench.LATENCY_REPEATS, None)
        for row in lat["rows"]:
            rows.setdefault((row["pages"], row["layout"], ahead), []).append(row)
cls.sends_ahead = True
print(f"{url}: {runs} runs of each, interleaved; medians of the runs' p50s, us")
print(f"{'pages':>5} {'layout':18} {'ahead':>5} {'prefetch':>9} {'raw GET':>8} {'ratio':>6} {'backup':>7} {'raw SET':>8} {'ratio':>6}")
for (pages, layout, ahead), rs in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], not kv[0][2])):
    med = lambda k: statistics.median(r[k] for r in rs)
    print(f"{pages:>5} {layout:18} {'on' if ahead else 'off':>5} {med('prefetch_p50_us'):9.0f} {med('raw_get_p50_us'):8.0f} "
          f"{med('prefetch_vs_raw_get_p50'):6.2f} {med('backup_p50_us'):7.0f} {med('raw_set_p50_us'):8.0f} "
          f"{med('backup_vs_raw_set_p50'):6.2f}")
engine.close()
