"""The issue's goals, read off a run and printed (never asserted: they are hardware
figures, and a CPU run says so instead of grading itself)."""
from __future__ import annotations

from collections import defaultdict

LINK_OPS = ("backup", "load_layer", "load")
KVTIER = ("pool", "copy_rows")
BATCHED_DMA_GBPS = 7.0   # vLLM's batched-DMA rate for small pages on H100 (upper end of 5-7 GB/s)


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


def evaluate(run: dict) -> list:
    """[(goal, verdict line)] for the goals the run has points for."""
    pts, out = run["points"], []
    # 1. backup / load >= 1 MiB, rows >= 256 B: >= 95% of the pinned copy, <= 4 programs.
    link = _best(pts, lambda p: p["op"] in LINK_OPS and p["bytes"] >= 1 << 20 and p["row_bytes"] >= 256
                 and p.get("programs") is not None and p["programs"] <= 4)
    if link:
        worst = min(link.values(), key=lambda p: p["pct_ceiling"])
        ok = sum(p["pct_ceiling"] >= 95 for p in link.values())
        out.append(("link >= 95% of pinned copy with <= 4 programs",
                    f"{ok}/{len(link)} points; worst {worst['pct_ceiling']:.0f}% ({_name(worst)})"))
    # 2. 4-24 KiB pages: >= 5x batched DMA: this run's pool dma point (bulk copies of
    #    page runs) where there is one, else vLLM's figure.
    in_range = lambda p: p["op"] in LINK_OPS and 4096 <= p["page_size"] * p["row_bytes"] <= 24576
    pages = _best(pts, lambda p: in_range(p) and p["strategy"] != "dma")
    dma = {_key(p): p["gbps"] for p in pts if in_range(p) and p["strategy"] == "dma" and "gbps" in p}
    if pages:
        ratio = {k: p["gbps"] / dma.get(k, BATCHED_DMA_GBPS) for k, p in pages.items()}
        worst = min(ratio, key=ratio.get)
        ok = sum(r >= 5 for r in ratio.values())
        out.append((f"4-24 KiB pages >= 5x batched DMA (same-run dma, else {BATCHED_DMA_GBPS} GB/s)",
                    f"{ok}/{len(pages)} points; worst {ratio[worst]:.1f}x ({_name(pages[worst])})"))
    # 3. gather >= 85% of the device copy.
    gather = _best(pts, lambda p: p["op"] == "gather" and p["bytes"] >= 1 << 20)
    if gather:
        worst = min(gather.values(), key=lambda p: p["pct_ceiling"])
        ok = sum(p["pct_ceiling"] >= 85 for p in gather.values())
        out.append(("gather >= 85% of device copy (>= 1 MiB)",
                    f"{ok}/{len(gather)} points; worst {worst['pct_ceiling']:.0f}% ({_name(worst)})"))
    # 4. never slower than plain torch.
    torch_rate = defaultdict(float)
    for p in pts:
        if p["engine"] == "torch" and "gbps" in p:
            torch_rate[_key(p)] = p["gbps"]
    best = _best(pts, lambda p: True)
    pairs = [(best[k], torch_rate[k]) for k in best if k in torch_rate]
    if pairs:
        slower = [(p, t) for p, t in pairs if p["gbps"] < t]
        line = f"{len(pairs) - len(slower)}/{len(pairs)} points"
        if slower:
            p, t = min(slower, key=lambda pt: pt[0]["gbps"] / pt[1])
            line += f"; worst {p['gbps'] / t:.2f}x torch ({_name(p)})"
        out.append(("never slower than plain torch", line))
    return out


def _name(p) -> str:
    return f"{p['op']} {p['layout']} row {p['row_bytes']} P {p['page_size']} n {p['tokens']}"
