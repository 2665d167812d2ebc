"""Plain-text tables of tuning results and of what the cache holds."""
from __future__ import annotations

from typing import List

from kvtier.config import CopyConfig

from .search import TuneResult, describe_config


def format_results(results: List[TuneResult], top: int = 0) -> str:
    """One block per key: every timed configuration (or the ``top`` fastest) with its
    time, GB/s and % of the best; the winner is marked with '*'."""
    lines = []
    for r in results:
        k = r.key
        lines.append(f"{k.op} ({'across the link' if k.crosses_link else 'on device'}) "
                     f"rows={k.rows_bucket} layers={k.num_layers} row={k.row_bytes}B page={k.page_size} "
                     f"({r.nbytes / 1e6:.2f} MB/run, program cap {r.max_programs}, "
                     f"{len(r.pruned)} pruned for spills)")
        lines.append(f"  {'':1s} {'config':52s} {'time us':>10s} {'GB/s':>9s} {'% best':>7s}")
        best = r.best
        shown = r.measurements[:top] if top else r.measurements
        for m in shown:
            mark = "*" if m is best else " "
            if m.ok:
                pct = 100.0 * m.gbps / best.gbps if best else 0.0
                lines.append(f"  {mark} {describe_config(m.config):52s} {m.seconds * 1e6:10.1f} "
                             f"{m.gbps:9.4g} {pct:6.1f}%")
            else:
                lines.append(f"  {mark} {describe_config(m.config):52s} failed: {m.error}")
        if len(shown) < len(r.measurements):
            lines.append(f"    ... {len(r.measurements) - len(shown)} more")
        if best is None:
            lines.append("  no configuration succeeded; nothing recorded")
    return "\n".join(lines)


def format_cache(path, entries: dict) -> str:
    """The entries of one cache file, one line per key."""
    lines = [f"{path}: {len(entries)} entries"]
    for key, e in entries.items():
        try:
            cfg = describe_config(CopyConfig.from_dict(e["config"]))
        except Exception:
            cfg = f"malformed: {e!r}"[:60]
        lines.append(f"  {key:58s} {cfg:52s} {e.get('gbps', 0):9.4g} GB/s  "
                     f"triton {e.get('triton', '?')} kvtier {e.get('kvtier', '?')} {e.get('tuned_at', '')}")
    return "\n".join(lines)
