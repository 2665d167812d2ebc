import json, glob, statistics, sys, os
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{d}/*.json")):
    ver, store, r = os.path.basename(f)[:-5].split("-")
    for p in json.load(open(f))["points"]:
        rows.setdefault((store, p["page_bytes"] >> 10, p["layout"]), {}).setdefault(ver, []).append(p)
print("| store | page KiB | layout | prefetch GB/s before → after (ratio to raw GET) | backup GB/s before → after (ratio to raw SET) |")
print("|---|---|---|---|---|")
for (store, kib, layout), vs in rows.items():
    def f(k, rk):
        b = vs["before"]; a = vs["after"]
        return (f"{' '.join(f'{p[k]:.2f}' for p in b)} ({' '.join(f'{p[rk]:.2f}' for p in b)}) → "
                f"{' '.join(f'{p[k]:.2f}' for p in a)} ({' '.join(f'{p[rk]:.2f}' for p in a)})")
    print(f"| {store} | {kib} | {layout} | {f('prefetch_gbps', 'prefetch_vs_raw_get')} | {f('backup_gbps', 'backup_vs_raw_set')} |")
