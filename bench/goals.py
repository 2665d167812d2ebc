"""The issue's goals, read off a run and printed (never asserted: they are hardware
figures, and a CPU run says so instead of grading itself). Every figure is the same
run's: kvtier's best point per shape against the same-run ceiling or baseline."""
from __future__ import annotations

LINK_OPS = ("backup", "load_layer", "load")
KVTIER = ("pool", "copy_rows")
BATCHED_DMA_GBPS = 7.0   # vLLM's batched-DMA rate for small pages on H100 (upper end of 5-7 GB/s)
MIB = 1 << 20


def _best(points, pred):
    """Best kvtier GB/s per (op, shape) among measured points satisfying ``pred``."""
    best = {}
    for p in points:
        if "gbps" in p and p["engine"] in KVTIER and pred(p):
            k = _key(p)
            if k not in best or p["gbps"] > best[k]["gbps"]:
                best[k] = p
    return best


def _key(p):
    return (p["op"], p["layout"], p["row_bytes"], p["page_size"], p["tokens"])


def _share(goal: str, best: dict, pct: float):
    """A goal on %ceil: how many shapes reach ``pct``, and the worst."""
    if not best:
        return None
    worst = min(best.values(), key=lambda p: p["pct_ceiling"])
    ok = sum(p["pct_ceiling"] >= pct for p in best.values())
    return {"goal": goal, "verdict": f"{ok}/{len(best)} points; worst {worst['pct_ceiling']:.0f}% ({_name(worst)})",
            "met": ok == len(best)}


def _ratio(goal: str, pairs: dict, want: float, name):
    """A goal on a ratio per shape (kvtier over a same-run baseline)."""
    if not pairs:
        return None
    worst = min(pairs, key=pairs.get)
    ok = sum(r >= want for r in pairs.values())
    return {"goal": goal, "verdict": f"{ok}/{len(pairs)} points; worst {pairs[worst]:.2f}x ({name(worst)})",
            "met": ok == len(pairs)}


def grade(run: dict) -> list:
    """[{goal, verdict, met}] for the goals the run has points for."""
    pts, out = run["points"], []
    # Link backup and all-layer load >= 1 MiB, rows >= 128 B, any host layout, <= 4 programs.
    link = _best(pts, lambda p: p["op"] in ("backup", "load") and p["bytes"] >= MIB and p["row_bytes"] >= 128
                 and p.get("programs") is not None and p["programs"] <= 4 and p["strategy"] != "dma")
    out.append(_share("link >= 95% of pinned copy with <= 4 programs", link, 95))
    # Per-layer loads of >= 1 MiB.
    layer = _best(pts, lambda p: p["op"] == "load_layer" and p["bytes"] >= MIB and p["strategy"] != "dma")
    out.append(_share("per-layer load >= 1 MiB at >= 90% of pinned copy", layer, 90))
    # dma strategy, pages of >= 16 tokens.
    dma = _best(pts, lambda p: p["op"] in LINK_OPS and p["strategy"] == "dma" and p["page_size"] >= 16
                and p["bytes"] >= MIB)
    out.append(_share("dma strategy >= 85% of pinned copy (pages >= 16 tokens)", dma, 85))
    # 4-24 KiB pages: >= 5x batched DMA (this run's pool dma point, else vLLM's figure).
    in_range = lambda p: p["op"] in LINK_OPS and 4096 <= p["page_size"] * p["row_bytes"] <= 24576  # noqa: E731
    pages = _best(pts, lambda p: in_range(p) and p["strategy"] != "dma")
    dma_rate = {_key(p): p["gbps"] for p in pts if in_range(p) and p["strategy"] == "dma" and "gbps" in p}
    out.append(_ratio(f"4-24 KiB pages >= 5x batched DMA (same-run dma, else {BATCHED_DMA_GBPS} GB/s)",
                      {k: p["gbps"] / dma_rate.get(k, BATCHED_DMA_GBPS) for k, p in pages.items()}, 5.0,
                      lambda k: _name(pages[k])))
    # Device gather >= 1 MiB: >= 85% of the device copy and >= 1.1x torch index_select.
    gather = _best(pts, lambda p: p["op"] == "gather" and p["bytes"] >= MIB)
    out.append(_share("gather >= 85% of device copy (>= 1 MiB)", gather, 85))
    torch_rate = _baseline(pts, "torch")
    out.append(_ratio("gather >= 1.1x torch index_select (>= 1 MiB)",
                      {k: p["gbps"] / torch_rate[k] for k, p in gather.items() if k in torch_rate}, 1.1,
                      lambda k: _name(gather[k])))
    # Never slower than plain torch, any operation.
    best = _best(pts, lambda p: True)
    out.append(_ratio("never slower than plain torch",
                      {k: p["gbps"] / torch_rate[k] for k, p in best.items() if k in torch_rate}, 1.0,
                      lambda k: _name(best[k])))
    return [g for g in out if g is not None]


def evaluate(run: dict) -> list:
    """[(goal, verdict line)] for the goals the run has points for."""
    return [(g["goal"], g["verdict"]) for g in grade(run)]


def _baseline(points, engine: str) -> dict:
    return {_key(p): p["gbps"] for p in points if p["engine"] == engine and "gbps" in p}


def _name(p) -> str:
    return f"{p['op']} {p['layout']} row {p['row_bytes']} P {p['page_size']} n {p['tokens']}"
