import json, glob, statistics, sys, os
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{d}/*.json")):
    name = os.path.basename(f)[:-5]
    ver, store, r = name.split("-")
    for row in json.load(open(f))["latency"]["rows"]:
        key = (store, row["layout"], row["pages"])
        rows.setdefault(key, {}).setdefault(ver, []).append(row)
def med(rs, k): return statistics.median(r[k] for r in rs)
print("| store | layout | pages | | backup p50 / p99 | raw SET p50 / p99 | ratio | prefetch p50 / p99 | raw GET p50 / p99 | ratio |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (store, layout, pages), vs in rows.items():
    for ver in ("before", "after"):
        rs = vs[ver]
        f = lambda k: f"{med(rs, k + '_p50_us'):.0f} / {med(rs, k + '_p99_us'):.0f}"
        print(f"| {store} | {layout} | {pages} | {ver} | {f('backup')} | {f('raw_set')} | {med(rs, 'backup_vs_raw_set_p50'):.2f} "
              f"| {f('prefetch')} | {f('raw_get')} | {med(rs, 'prefetch_vs_raw_get_p50'):.2f} |")
