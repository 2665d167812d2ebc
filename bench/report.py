"""Outputs of a run: a terminal table, JSON, and a PNG of GB/s against transfer size per
strategy and baseline (matplotlib, the `bench` extra, imported only to plot)."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from kvtier.kernels.ops import Op

from .goals import evaluate

COLUMNS = (("op", "op", "{}"), ("layout", "layout", "{}"), ("row", "row_bytes", "{}"),
           ("P", "page_size", "{}"), ("tokens", "tokens", "{}"), ("L", "layers", "{}"),
           ("engine", "series", "{}"), ("progs", "programs", "{}"), ("MiB", "mib", "{:.2f}"),
           ("GB/s", "gbps", "{:.2f}"), ("%ceil", "pct_ceiling", "{:.0f}"), ("host us", "host_us", "{:.1f}"))


def series(p: dict) -> str:
    """The line a point belongs to: kvtier's pools per strategy, copy_rows per program
    cap, and the baselines."""
    if p["engine"] == "pool":
        return "kvtier pool" + (f" {p['strategy']}" if p["strategy"] != "-" else "")
    if p["engine"] == "copy_rows":
        return f"kvtier copy_rows p<={p['cap']}"
    return p["engine"]


def format_table(run: dict) -> str:
    """One line per point; skipped and failed points say why in a last column."""
    head = [c for c, _, _ in COLUMNS] + ["note"]
    rows = []
    for p in run["points"]:
        d = dict(p, series=series(p), mib=p["bytes"] / (1 << 20))
        cells = [fmt.format(d[k]) if d.get(k) is not None else "-" for _, k, fmt in COLUMNS]
        note = ("skip: " + p["skipped"]) if "skipped" in p else ("ERROR: " + p["error"]) if "error" in p else ""
        rows.append(cells + [note])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(COLUMNS))] + [0]
    text = lambda cells: "  ".join(c.rjust(w) if 3 <= i < len(COLUMNS) and i != 6 else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([text(head), text(["-" * w for w in widths])] + [text(r) for r in rows])


def format_summary(run: dict) -> str:
    env, c = run["environment"], run["ceilings"]
    lines = [f"device: {env['device']} ({env['platform']}), {env['date']}",
             f"ceilings (same run, {c['nbytes'] >> 20} MiB copies): host->device {c['h2d']:.1f} GB/s, "
             f"device->host {c['d2h']:.1f} GB/s, device->device {c['d2d']:.1f} GB/s"]
    if not env.get("hardware_figures"):
        lines.append("NOTE: " + env.get("note", "not a hardware run") + "; goals are not graded.")
    else:
        lines += [f"goal: {g}: {v}" for g, v in evaluate(run)]
    errors = sum("error" in p for p in run["points"])
    lines.append(f"{len(run['points'])} points, {errors} errors, {run['elapsed_s']} s"
                 + (" (TRUNCATED by the time budget)" if run.get("truncated") else ""))
    if "overhead" in run:
        o = run["overhead"]
        lines.append(f"host overhead per call: {o['summary']}")
    return "\n".join(lines)


def write_json(run: dict, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return path


def plot(run: dict, path) -> Path:
    """GB/s against transfer size, one panel per operation, one line per series; the
    panel's ceiling dashed. Points of the most common row size / page size / layout only,
    so that every line is one sweep over size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in run["points"] if "gbps" in p]
    counts = defaultdict(int)
    for p in pts:
        counts[(p["row_bytes"], p["page_size"], p["layout"])] += 1
    from .ceiling import CEILING_OF
    ops = sorted({p["op"] for p in pts}, key=list(CEILING_OF).index)
    fig, axes = plt.subplots(1, max(len(ops), 1), figsize=(4.5 * max(len(ops), 1), 4), squeeze=False)
    if counts:
        row, page, layout = max(counts, key=counts.get)
        for ax, op in zip(axes[0], ops):
            lines = defaultdict(list)
            for p in pts:
                if p["op"] == op and (p["row_bytes"], p["page_size"]) == (row, page) and \
                        (p["layout"] == layout or not Op.parse(op).crosses_link):
                    lines[series(p)].append((p["bytes"], p["gbps"]))
            for name, xy in sorted(lines.items()):
                xy.sort()
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
            ax.axhline(run["ceilings"][CEILING_OF[op]], linestyle="--", color="gray", label="ceiling")
            ax.set_xscale("log")
            ax.set_title(f"{op} ({layout if Op.parse(op).crosses_link else 'device'})")
            ax.set_xlabel("bytes per call")
            ax.set_ylabel("GB/s")
            ax.legend(fontsize=7)
        title = f"kvtier bench: {run['environment']['device']}, row {row} B, page {page}"
    else:
        title = "kvtier bench: no measured points"
    if not run["environment"].get("hardware_figures"):
        title += " (CPU smoke run: NOT hardware figures)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
