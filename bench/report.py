"""Outputs of a run: a terminal table, JSON, and a PNG of GB/s against transfer size per
strategy and baseline (matplotlib, the `bench` extra, imported only to plot)."""
from __future__ import annotations

import datetime
import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

from kvtier.kernels.ops import Op

from .goals import evaluate

COLUMNS = (("op", "op", "{}"), ("layout", "layout", "{}"), ("row", "row_bytes", "{}"),
           ("P", "page_size", "{}"), ("tokens", "tokens", "{}"), ("L", "layers", "{}"),
           ("engine", "series", "{}"), ("progs", "programs", "{}"), ("MiB", "mib", "{:.2f}"),
           ("GB/s", "gbps", "{:.2f}"), ("%ceil", "pct_ceiling", "{:.0f}"), ("dev us", "device_us", "{:.1f}"),
           ("p10-p90", "device_spread", "{}"), ("host us", "host_us", "{:.1f}"), ("n", "iters", "{}"))


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
        if "device_p10_us" in p:
            d["device_spread"] = f"{p['device_p10_us']:.1f}-{p['device_p90_us']:.1f}" + \
                ("" if p.get("kernel_only", True) or p.get("timing") == "wall clock" else "*")
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
    m = run.get("method")
    if m:
        lines.append(f"timing: device {m['device_time']}; host {m['host_time']}; "
                     f"{m['min_iters']}-{m['max_iters']} timed calls per point after {m['warmup_calls']} "
                     f"warm-up calls; '*' after p10-p90: the device waited for the host (not kernel-only)")
    for name, state in run.get("baselines", {}).items():
        lines.append(f"baseline {name}: {state}")
    if not env.get("hardware_figures"):
        lines.append("NOTE: " + env.get("note", "not a hardware run") + "; goals are not graded.")
    else:
        lines += [f"goal: {g}: {v}" for g, v in evaluate(run)]
    errors = sum("error" in p for p in run["points"])
    lines.append(f"{len(run['points'])} points, {errors} errors, {run['elapsed_s']} s"
                 + (" (TRUNCATED by the time budget)" if run.get("truncated") else ""))
    if "overhead" in run:
        lines.append(f"host overhead per call: {run['overhead']['summary']}")
    return "\n".join(lines)


def versions() -> dict:
    """When a run was made and with which torch and Triton."""
    import torch
    from kvtier.kernels.launcher import interpreter_active, triton_available
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton_available": triton_available(), "interpreter": interpreter_active()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def write_json(run: dict, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return path


# One colour per series in every panel and every run; the ceiling is black and dashed,
# a colour no series takes.
SERIES_COLOURS = {"kvtier pool kernel": "tab:blue", "kvtier pool dma": "tab:orange",
                  "kvtier pool": "tab:blue", "torch": "tab:red", "torch copy_": "tab:brown",
                  "sgl_kernel": "tab:purple", "vllm": "tab:pink", "kvtier pool kernel capped": "tab:green"}
CAP_COLOURS = ("tab:green", "tab:olive", "tab:cyan", "teal", "navy", "darkgoldenrod", "lime", "magenta")
CEILING_STYLE = {"label": "ceiling (same run)", "color": "black", "linestyle": "--"}
_GROUPS = ("kvtier pool", "kvtier copy_rows", "torch", "torch copy_", "sgl_kernel", "vllm")


def series_key(name: str):
    """Legend order: kvtier's pools, copy_rows by program cap in numeric order, then the
    baselines; unknown names last, alphabetically."""
    if name.startswith("kvtier copy_rows p<="):
        return (1, int(name.rsplit("=", 1)[1]), name)
    if name.startswith("kvtier pool"):
        return (0, ("kvtier pool kernel", "kvtier pool dma", "kvtier pool").index(name)
                if name in ("kvtier pool kernel", "kvtier pool dma", "kvtier pool") else 9, name)
    return (2 + _GROUPS.index(name), 0, name) if name in _GROUPS else (len(_GROUPS) + 2, 0, name)


def colour(name: str) -> str:
    """The series' colour, the same in every panel and run."""
    if name in SERIES_COLOURS:
        return SERIES_COLOURS[name]
    if name.startswith("kvtier copy_rows p<="):
        cap = max(int(name.rsplit("=", 1)[1]), 1)
        return CAP_COLOURS[(cap.bit_length() - 1) % len(CAP_COLOURS)]
    return "tab:gray"


def plot_spec(run: dict) -> dict:
    """What `plot` draws, as data: one panel per operation, its lines in legend order
    (label, colour, points) and its ceiling. Points of the most common row size / page
    size / layout only, so that every line is one sweep over size."""
    from .ceiling import CEILING_OF
    pts = [p for p in run["points"] if "gbps" in p]
    counts = defaultdict(int)
    for p in pts:
        counts[(p["row_bytes"], p["page_size"], p["layout"])] += 1
    ops = sorted({p["op"] for p in pts}, key=list(CEILING_OF).index)
    panels = []
    title = "kvtier bench: no measured points"
    if counts:
        row, page, layout = max(counts, key=counts.get)
        for op in ops:
            lines = defaultdict(list)
            for p in pts:
                if p["op"] == op and (p["row_bytes"], p["page_size"]) == (row, page) and \
                        (p["layout"] == layout or not Op.parse(op).crosses_link):
                    lines[series(p)].append((p["bytes"], p["gbps"]))
            panels.append({
                "op": op, "title": f"{op} ({layout if Op.parse(op).crosses_link else 'device'})",
                "lines": [{"label": name, "color": colour(name), "xy": sorted(lines[name])}
                          for name in sorted(lines, key=series_key)],
                "ceiling": {**CEILING_STYLE, "y": run["ceilings"][CEILING_OF[op]]}})
        title = f"kvtier bench: {run['environment']['device']}, row {row} B, page {page}, kernel-only time"
    if not run["environment"].get("hardware_figures"):
        title += " (CPU smoke run: NOT hardware figures)"
    return {"title": title, "panels": panels}


def draw(spec: dict, size=(4.5, 4), xlabel: str = "bytes per call", ylabel: Optional[str] = "GB/s",
         base: int = 10):
    """A matplotlib figure of ``spec`` (`plot_spec`; the interference's too): per panel its
    lines, its dotted ``levels`` and its ceiling or goal line, against a log x axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(spec["panels"]), 1)
    fig, axes = plt.subplots(1, n, figsize=(size[0] * n, size[1]), squeeze=False)
    for ax, panel in zip(axes[0], spec["panels"]):
        for line in panel["lines"]:
            ax.plot([x for x, _ in line["xy"]], [y for _, y in line["xy"]], marker="o",
                    color=line["color"], label=line["label"])
        for level in panel.get("levels", ()):
            ax.axhline(level["y"], color=level["color"], linestyle=":", label=level["label"])
        c = panel.get("ceiling") or panel.get("goal")
        if c:
            ax.axhline(c["y"], linestyle=c["linestyle"], color=c["color"], label=c["label"])
        ax.set_xscale("log", base=base)
        ax.set_title(panel["title"])
        ax.set_xlabel(xlabel)
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(spec["title"], fontsize=10)
    fig.tight_layout()
    return fig


def plot(run: dict, path) -> Path:
    """GB/s against transfer size (`plot_spec`), written as a PNG."""
    import matplotlib.pyplot as plt
    fig = draw(plot_spec(run))
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
