"""Write a hardware run's README.md from the files `bench/h200.sh` leaves in its folder:
what ran (steps and exit codes, test counts), the same-run ceilings, every goal marked met
or not, the best figure per operation beside the baselines, and how to reproduce it.

    python -m kvtier.bench.results_readme RESULTS_DIR
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Optional

from .goals import grade
from .report import series, series_key


def _json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tests(path: Path) -> str:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return "no test report"
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return "no test report"
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def best_per_op(run: dict) -> list:
    """Per operation, at the largest transfer of its most common row and page size
    (``layer_first``): every series' (GB/s, %ceil, kernel-only), in legend order."""
    pts = [p for p in run["points"] if "gbps" in p and p["layout"] == "layer_first"]
    out = []
    for op in ("backup", "load_layer", "load", "gather", "scatter"):
        mine = [p for p in pts if p["op"] == op]
        if not mine:
            continue
        counts = Counter((p["row_bytes"], p["page_size"]) for p in mine)
        shape = max(counts, key=counts.get)
        same = [p for p in mine if (p["row_bytes"], p["page_size"]) == shape]
        top = max(p["bytes"] for p in same)
        at = [p for p in same if p["bytes"] == top]
        rates = {series(p): (p["gbps"], p["pct_ceiling"],
                             None if p.get("timing") == "wall clock" else p.get("kernel_only")) for p in at}
        out.append((op, at[0], dict(sorted(rates.items(), key=lambda kv: series_key(kv[0])))))
    return out


def readme(folder: Path) -> str:
    folder = Path(folder)
    run = _json(folder / "bench.json")
    inter = _json(folder / "interference.json")
    overhead = _json(folder / "overhead.json")
    env = (run or {}).get("environment", {})
    lines = [f"# {folder.name}: {env.get('device', 'unknown device')}, torch {env.get('torch', '?')}, "
             f"Triton {env.get('triton', '?')}", "",
             "Written by `bench/h200.sh` (`python -m kvtier.bench.results_readme`). Device times are "
             "kernel-only (per-call stream events on a pre-busied stream, warm-up excluded, median of "
             ">= 20 calls); host time per call is a separate column; ceilings and baselines are "
             "measured the same way in the same run (docs/benchmarks.md).", ""]
    steps = (folder / "steps.txt").read_text().split("\n") if (folder / "steps.txt").exists() else []
    lines += ["## Steps", "", _row(["step", "exit"]), _row(["---", "---"])]
    lines += [_row(s.split(" ", 1)) for s in steps if s.strip()]
    lines += ["", f"`cuda` tests: {_tests(folder / 'cuda-tests.xml')}.", ""]
    if run:
        c = run["ceilings"]
        lines += ["## Ceilings (same run)", "", _row(["pinned host->device", "device->host", "device copy", "copy size"]),
                  _row(["---"] * 4),
                  _row([f"{c['h2d']:.1f} GB/s", f"{c['d2h']:.1f} GB/s", f"{c['d2d']:.1f} GB/s",
                        f"{c['nbytes'] >> 20} MiB"]), ""]
        lines += ["## Goals", "", _row(["goal", "met", "figures"]), _row(["---"] * 3)]
        hardware = env.get("hardware_figures")
        for g in grade(run):
            lines.append(_row([g["goal"], ("yes" if g["met"] else "**no**") if hardware else "not graded",
                               g["verdict"]]))
        if inter and "goal" in inter:
            for op, v in inter["goal"]["ops"].items():
                lines.append(_row([f"{inter['goal']['text']} ({op})", "yes" if v["met"] else "**no**",
                                   f"{v['slowdown_pct']:+.1f}%"]))
        lines += ["", "## Largest transfer per operation (`layer_first`, GB/s, %ceil)", ""]
        for op, shape, rates in best_per_op(run):
            lines.append(f"- **{op}** row {shape['row_bytes']} B, P {shape['page_size']}, n {shape['tokens']}, "
                         f"{shape['bytes'] / (1 << 20):.1f} MiB: " + "; ".join(
                             f"{name} {g:.3g} ({pct:.0f}%){'' if ko in (True, None) else ' (not kernel-only)'}"
                             for name, (g, pct, ko) in rates.items()))
        lines += ["", "Baselines: " + "; ".join(f"{k}: {v}" for k, v in run.get("baselines", {}).items()), ""]
    if inter and "rows" in inter:
        lines += ["## Compute interference (`interference.*`)", "", _row(["op", "engine", "programs",
                  "GB/s alone", "GB/s beside GEMM", "GEMM slowdown", "overlap"]), _row(["---"] * 7)]
        for r in inter["rows"]:
            if "error" in r:
                lines.append(_row([r["op"], r["series"], "-", "error", r["error"], "", ""]))
            else:
                lines.append(_row([r["op"], r["series"], r["programs"], f"{r['gbps_alone']:.1f}",
                                   f"{r['gbps_concurrent']:.1f}", f"{r['gemm_slowdown_pct']:+.1f}%",
                                   f"{100 * r['overlap']:.0f}%"]))
        lines.append("")
    else:
        lines += ["## Compute interference", "", (inter or {}).get(
            "skipped", "not measured (no interference.json: `kvtier bench --interference` runs on CUDA only)"), ""]
    if overhead:
        lines += ["## Host overhead (`overhead.json`)", "", str(overhead.get("summary", "")), ""]
    lines += ["## Files", "", "`bench.txt` / `bench.json` / `bench.png` / `points.jsonl` (the sweep), "
              "`interference.*`, `overhead.json`, `launch_binding.txt` (Triton's binding of the same launches), "
              "`layouts/` (page-major host layouts), `cuda-tests.xml`, "
              "`env.txt`, `steps.txt`, `h200.log`.", "",
              "## Reproduce", "", "```bash", "bash bench/scripts/fetch_baselines.sh   # vLLM's swap kernel source, "
              "where PyPI is reachable", "bash bench/h200.sh                       # results/<date>_<device>/",
              "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m kvtier.bench.results_readme RESULTS_DIR", file=sys.stderr)
        return 2
    path = Path(argv[0]) / "README.md"
    path.write_text(readme(Path(argv[0])))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
