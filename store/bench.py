"""`kvtier bench --store URL`: the store tier's throughput beside the store's own.

For pages of 64 KiB, 256 KiB and 1 MiB (MHA, bf16) and two host layouts
(``page_first_direct``: pages move in place; ``page_first``: through the staged copy),
it measures in one run, best of a few rounds, interleaved:

- backup: `StoreTier.backup` of fresh keys (conversion, checksum, header, engine write);
- prefetch: `StoreTier.prefetch` of those pages (engine read, verification with the
  checksum, conversion): the hit path;
- raw: the engine's own `raw_throughput` for as many values of the page's size;
- checksum: its share of the hit path: what it adds to the prefetch time, against the
  same prefetch with verification skipping only the checksum, run right after or before
  it (`PAIRS` pairs a round, in turn first), as the median of ``1 - unchecked /
  checked``. The tier overlaps the checksum with the store's transfer of the next
  batch, so the time spent inside it is not what it costs.

Goal, printed, never asserted: hit path >= 0.8x raw GET and backup >= 0.8x raw SET for
pages of 256 KiB and more; the checksum <= 10% of the hit path.

Latency (HiCache's calls are often a few pages, and a prefill waits on them): for calls
of one and of four pages of `LATENCY_PAGE_BYTES`, in both layouts, the p50 and p99 of
`LATENCY_REPEATS` calls each, interleaved call by call in one run:

- backup: `StoreTier.backup` of fresh keys;
- prefetch: `StoreTier.prefetch` of the keys just backed up;
- raw SET / raw GET: the engine's `raw_calls` of as many values of the page object's
  size (header and payload), one per page, fresh keys for every SET: the store's own
  client call where the engine has one (`Engine.raw_calls`).

Reshard (pages written at one TP size and read at another): for rank pages of
`RESHARD_PAGE_BYTES` (256 KiB to 16 MiB: a TP 2 rank's page of a 70B-class model of 8
KV heads, 80 layers and head dim 128 at 64 tokens a page is 10 MiB), in both layouts,
rank 0 of TP 2 of a model of 8 KV heads of 128 (`RESHARD`) reads pages that ranks 0-3
of TP 8 wrote (four head-group objects per page), against a read of the same bytes stored as one object
per page, interleaved, best of the rounds, and beside both the engine alone: its
`get_into` of as many values of each side's object length (`RawCalls`), in the same
rounds. Goal, printed, never asserted: the reshard read >= 0.8x the one-object read.

Every key written is removed after its repeat (outside the timed calls). Latency goal,
printed, never asserted: a one-page prefetch <= 1.5x a raw GET and a one-page backup <=
2x a raw SET, at the p50.
"""
from __future__ import annotations

import time
import uuid
from typing import Callable, Dict, List, Optional

from .engine import RawCalls
from .page import Checksum

PAGE_BYTES = (64 << 10, 256 << 10, 1 << 20)
LAYOUTS = ("page_first_direct", "page_first")
LAYERS, HEADS, HEAD_DIM = 8, 4, 64          # bf16 rows of 512 B; K and V: 8 KiB per token
GOAL = {"min_page_bytes": 256 << 10, "prefetch_vs_raw_get": 0.8, "backup_vs_raw_set": 0.8,
        "checksum_share": 0.10}


def bench_host(page_bytes: int, pages: int, layout: str, heads: int = HEADS, page_size: Optional[int] = None,
               head_dim: int = HEAD_DIM):
    """A host pool of ``pages`` pages of about ``page_bytes`` (``page_size`` tokens,
    where given) of bf16 K and V rows of ``heads`` heads of ``head_dim``, random bytes."""
    import torch
    from kvtier.pool import HostPool, MHADevicePool
    token = 2 * LAYERS * heads * head_dim * 2
    P = page_size or max(1, page_bytes // token)
    dev = MHADevicePool(P, P, LAYERS, heads, head_dim, dtype=torch.bfloat16)
    host = HostPool(dev, layout=layout, size_tokens=pages * P, pin_memory=False)
    for b in host.buffers.values():
        b.view(-1).view(torch.int16).random_(-32768, 32767)
    return host


def one_object_tier(host, engine, **kw):
    """A tier over a bench host that stores each page as one object: the host's rows
    as rank 0 of TP 8 holds them (one head group per rank), so its figures compare
    with the store's own for values of one page."""
    from .tier import StoreTier
    return StoreTier(host, engine, model="kvtier-bench", tp=(0, 8), **kw)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


TOTAL_BYTES = 64 << 20     # of pages per point (at least 16 pages, at most 1024)
ROUNDS = 3
PAIRS = 4                  # checked and unchecked prefetches per round, for the checksum's share


LATENCY_PAGE_BYTES = 256 << 10
LATENCY_PAGES = (1, 4)
LATENCY_REPEATS = 1000     # timed calls of each kind per row
LATENCY_WARMUP = 20        # calls of each kind first, not timed
LATENCY_GOAL = {"pages": 1, "at": "p50", "prefetch_vs_raw_get": 1.5, "backup_vs_raw_set": 2.0}
# The reshard's model: 8 KV heads of 128 (Llama-3-70B's and Qwen2.5-72B's KV geometry),
# so that a head-group object's row slices are the 256 B a real one's are.
RESHARD = {"model_heads": 8, "head_dim": 128, "writer_tp": 8, "reader_tp": 2, "goal": 0.8}
RESHARD_PAGE_BYTES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
RESHARD_MIN_PAGES = 4       # a point's pages: TOTAL_BYTES of them, at least these


def measure(url: str, page_bytes=None, layouts=None, total_bytes: Optional[int] = None,
            rounds: Optional[int] = None, log: Optional[Callable[[str], None]] = None,
            throughput: bool = True, latency: bool = True, repeats: Optional[int] = None,
            reshard: bool = True) -> Dict:
    """The figures as a dict (`format_text` prints them): ``points`` (throughput, where
    ``throughput``), ``reshard`` (where ``reshard``) and ``latency`` (where
    ``latency``). Each argument left None takes the module's default (PAGE_BYTES,
    LAYOUTS, TOTAL_BYTES, ROUNDS, LATENCY_REPEATS); the reshard part reads pages of the
    ``page_bytes`` of 256 KiB and more where it is given, else of RESHARD_PAGE_BYTES.
    ``log`` is given each row as it is measured."""
    reshard_sizes = [s for s in page_bytes if s >= GOAL["min_page_bytes"]] if page_bytes else RESHARD_PAGE_BYTES
    page_bytes, layouts = page_bytes or PAGE_BYTES, layouts or LAYOUTS
    total_bytes, rounds = total_bytes or TOTAL_BYTES, rounds or ROUNDS
    from .engine import open_store
    engine = open_store(url)
    try:
        points = _throughput(engine, page_bytes, layouts, total_bytes, rounds, log) if throughput else []
        lat = _latency(engine, layouts, repeats or LATENCY_REPEATS, log) if latency else None
        rows = _reshard(engine, reshard_sizes, layouts, total_bytes, rounds, log) if reshard else []
    finally:
        engine.close()
    from .page import ALGORITHMS
    out = {"url": url, "engine": type(engine).__name__, "checksum": ALGORITHMS[Checksum().default],
           "rounds": rounds, "goal": GOAL, "points": points}
    if lat is not None:
        out["latency"] = lat
    if rows:
        out["reshard"] = rows
    return out


def _throughput(engine, page_bytes, layouts, total_bytes: int, rounds: int, log) -> List[Dict]:
    import torch
    from .tier import StoreTier
    points: List[Dict] = []
    for size in page_bytes:
        pages = max(16, min(1024, total_bytes // size))
        for layout in layouts:
            host = bench_host(size, pages, layout)
            tier = one_object_tier(host, engine)
            unchecked = one_object_tier(host, engine)
            unchecked.format.checksum = Unchecked()
            P = host.page_size
            idx = torch.arange(pages * P, dtype=torch.int64)
            payload = tier.canonical.payload_bytes * pages
            best = {"backup": 1e9, "prefetch": 1e9, "raw_get": 0.0, "raw_set": 0.0, "raw_get_one": 0.0,
                    "raw_get_threads": 0.0, "raw_set_threads": 0.0}
            shares: List[float] = []
            raw_how = ""
            for r in range(rounds + 1):             # round 0 warms up (directories, caches)
                keys = [f"bench-{uuid.uuid4().hex}" for _ in range(pages)]
                raw = engine.raw_throughput(tier.canonical.payload_bytes, pages)
                t_backup = _timed(lambda: tier.backup(keys, idx))
                t_prefetch = None           # the round's first checked read: one a round, as raw's
                for pair in range(PAIRS):
                    t = {}
                    for reader in (tier, unchecked)[::-1] if pair % 2 else (tier, unchecked):
                        hits = []
                        t[reader] = _timed(lambda: hits.append(reader.prefetch(keys, idx)))
                        if hits[0] != pages:
                            raise RuntimeError(f"prefetch read {hits[0]} of {pages} pages back ({reader.stats})")
                    t_prefetch = t_prefetch or t[tier]
                    if r:
                        shares.append(1 - t[unchecked] / t[tier])
                engine.delete([tier.key(k) for k in keys])
                if r == 0:
                    continue
                best["backup"] = min(best["backup"], t_backup)
                best["prefetch"] = min(best["prefetch"], t_prefetch)
                best["raw_get"] = max(best["raw_get"], raw["get_gbps"])
                best["raw_set"] = max(best["raw_set"], raw["set_gbps"])
                for k in ("raw_get_one", "raw_get_threads", "raw_set_threads"):
                    best[k] = max(best[k], raw.get(_RAW_EXTRA[k], 0.0))
                raw_how = raw.get("how", "")
            from .canonical import modes
            point = {
                "page_bytes": tier.canonical.payload_bytes, "layout": layout, "pages": pages,
                "moves": sorted(set(modes(tier.canonical).values())),
                "prefetch_gbps": payload / best["prefetch"] / 1e9,
                "backup_gbps": payload / best["backup"] / 1e9,
                "raw_get_gbps": best["raw_get"], "raw_set_gbps": best["raw_set"],
                "raw_get_one_buffer_gbps": best["raw_get_one"] or None,
                "raw_get_threads_gbps": best["raw_get_threads"] or None,
                "raw_set_threads_gbps": best["raw_set_threads"] or None,
                "checksum_share": max(0.0, sorted(shares)[len(shares) // 2]),
                "raw_how": raw_how,
            }
            point["prefetch_vs_raw_get"] = point["prefetch_gbps"] / point["raw_get_gbps"]
            point["backup_vs_raw_set"] = point["backup_gbps"] / point["raw_set_gbps"]
            points.append(point)
            if log:
                log(_row(point))
    return points


def _reshard(engine, page_bytes, layouts, total_bytes: int, rounds: int, log) -> List[Dict]:
    """The reshard rows (module doc): a TP 8 -> TP 2 read beside a read of the same
    bytes as one object per page."""
    import torch
    from .tier import StoreTier
    heads, wtp, rtp = RESHARD["model_heads"], RESHARD["writer_tp"], RESHARD["reader_tp"]
    hd = RESHARD["head_dim"]
    rows: List[Dict] = []
    for size in page_bytes:
        pages = max(RESHARD_MIN_PAGES, min(1024, total_bytes // size))
        for layout in layouts:
            host = bench_host(size, pages, layout, heads=heads // rtp, head_dim=hd)
            P = host.page_size
            reader = StoreTier(host, engine, model="kvtier-bench-reshard", tp=(0, rtp), heads=heads)
            writers = [StoreTier(bench_host(size, pages, layout, heads=heads // wtp, page_size=P, head_dim=hd), engine,
                                 model="kvtier-bench-reshard", tp=(r, wtp), heads=heads)
                       for r in range(wtp // rtp)]         # the ranks holding reader rank 0's heads
            one = one_object_tier(host, engine)
            idx = torch.arange(pages * P, dtype=torch.int64)
            m = reader.read.m
            # The engine alone: its own reads of as many values of each side's object length.
            raws = {"raw_reshard": RawCalls(engine, _object_bytes(writers[0]), pages * m),
                    "raw_one": RawCalls(engine, _object_bytes(one), pages)}
            best = {k: (1e9, 0.0) for k in ("reshard", "one", *raws)}   # (wall, this process's CPU) seconds
            try:
                for r in range(rounds + 1):                 # round 0 warms up
                    keys = [_fresh() for _ in range(pages)]
                    for t in writers + [one]:
                        _expect(t.backup(keys, idx), [True] * pages, "backup", t)
                    for raw in raws.values():
                        raw.set()
                    calls = [("reshard", lambda: _expect(reader.prefetch(keys, idx), pages, "prefetch", reader)),
                             ("one", lambda: _expect(one.prefetch(keys, idx), pages, "prefetch", one)),
                             *((name, raw.get) for name, raw in raws.items())]
                    t = {}
                    for name, call in calls[::1 if r % 2 else -1]:
                        cpu = time.process_time()
                        wall = _timed(call)
                        t[name] = (wall, time.process_time() - cpu)
                    engine.delete([k for w in writers + [one] for p in keys for k in w.written_keys(p)])
                    for raw in raws.values():
                        raw.clear()
                    if r:
                        best = {k: min(best[k], t[k]) for k in best}
            finally:
                for raw in raws.values():
                    raw.close()
            payload = reader.canonical.payload_bytes * pages
            row = {"page_bytes": reader.canonical.payload_bytes, "layout": layout, "pages": pages,
                   "objects_per_page": m, "moves": _moves(reader),
                   "reshard_gbps": payload / best["reshard"][0] / 1e9,
                   "one_object_gbps": payload / best["one"][0] / 1e9,
                   "reshard_cpu_s": best["reshard"][1], "one_object_cpu_s": best["one"][1],
                   "raw_reshard_gbps": payload / best["raw_reshard"][0] / 1e9,
                   "raw_one_object_gbps": payload / best["raw_one"][0] / 1e9}
            row["reshard_vs_one_object"] = row["reshard_gbps"] / row["one_object_gbps"]
            row["raw_reshard_vs_one_object"] = row["raw_reshard_gbps"] / row["raw_one_object_gbps"]
            rows.append(row)
            for tier in writers + [reader, one]:
                tier.close()
            if log:
                log(_reshard_row(row))
    return rows


def _object_bytes(tier) -> int:
    """The length in the store (header and payload) of the one object a page of
    ``tier``'s (a bench key's) is written as."""
    sizes = tier.write.sizes(tier.written_keys(_fresh()))
    if len(sizes) != 1:
        raise RuntimeError(f"a bench page is written as {len(sizes)} objects here, not one")
    return sizes[0]


def _reshard_row(r: Dict) -> str:
    ms = 1e3 / (r["pages"] * r["page_bytes"] / (64 << 20))     # CPU ms per 64 MiB
    return (f"{r['page_bytes'] >> 10:>5} KiB {r['layout']:18} {r['objects_per_page']:>7} {r['reshard_gbps']:>8.2f} GB/s "
            f"{r['one_object_gbps']:>8.2f} GB/s {r['reshard_vs_one_object']:>6.2f}  "
            f"{'met  ' if r['reshard_vs_one_object'] >= RESHARD['goal'] else 'below'} "
            f"{r['raw_reshard_gbps']:>6.2f} {r['raw_one_object_gbps']:>6.2f} {r['raw_reshard_vs_one_object']:>6.2f} "
            f"{r['reshard_cpu_s'] * ms:>8.1f} {r['one_object_cpu_s'] * ms:>8.1f}")


def format_reshard(rows: List[Dict]) -> List[str]:
    g = RESHARD
    return [f"reshard: TP {g['writer_tp']} -> TP {g['reader_tp']} read of a model of {g['model_heads']} KV heads "
            f"of {g['head_dim']} "
            "beside the same bytes as one object per page (GB/s of page payload, best of the rounds)",
            f"{'page':>8} {'layout':18} {'objects':>7} {'reshard':>13} {'one object':>13} {'ratio':>6}  goal  "
            f"{'engine alone: GB/s, ratio':>21}  {'CPU ms per 64 MiB read: reshard, one object (this process)'}",
            *[_reshard_row(r) for r in rows],
            "engine alone: the engine's get_into of as many values as each side's objects, of their lengths, "
            "one buffer each, timed beside the tier's reads: what the same object counts and sizes cost without the tier",
            f"reshard goal: >= {g['goal']}x the one-object read"]


def _latency(engine, layouts, repeats: int, log) -> Dict:
    """The latency rows (module doc), one per layout and page count."""
    import torch
    from .tier import StoreTier
    rows: List[Dict] = []
    how = ""
    for layout in layouts:
        host = bench_host(LATENCY_PAGE_BYTES, max(LATENCY_PAGES), layout)
        tier = one_object_tier(host, engine)
        P = host.page_size
        object_bytes = tier.canonical.payload_bytes + tier.format.header_size(tier.key(_fresh()))
        for n in LATENCY_PAGES:
            idx = torch.arange(n * P, dtype=torch.int64)
            raw = engine.raw_calls(object_bytes, n)
            how = raw.how
            times: Dict[str, List[float]] = {"backup": [], "prefetch": [], "raw_set": [], "raw_get": []}
            try:
                for r in range(LATENCY_WARMUP + repeats):
                    keys = [_fresh() for _ in range(n)]
                    t_backup = _timed(lambda: _expect(tier.backup(keys, idx), [True] * n, "backup", tier))
                    t_prefetch = _timed(lambda: _expect(tier.prefetch(keys, idx), n, "prefetch", tier))
                    t_set, t_get = _timed(raw.set), _timed(raw.get)
                    engine.delete([tier.key(k) for k in keys])
                    raw.clear()
                    if r >= LATENCY_WARMUP:
                        for k, t in zip(times, (t_backup, t_prefetch, t_set, t_get)):
                            times[k].append(t)
            finally:
                raw.close()
            row: Dict = {"layout": layout, "pages": n, "moves": _moves(tier), "repeats": repeats}
            for k, ts in times.items():
                row[f"{k}_p50_us"], row[f"{k}_p99_us"] = _percentile(ts, 0.50) * 1e6, _percentile(ts, 0.99) * 1e6
            for at in ("p50", "p99"):
                row[f"prefetch_vs_raw_get_{at}"] = row[f"prefetch_{at}_us"] / row[f"raw_get_{at}_us"]
                row[f"backup_vs_raw_set_{at}"] = row[f"backup_{at}_us"] / row[f"raw_set_{at}_us"]
            rows.append(row)
            if log:
                log(_latency_row(row))
    return {"page_bytes": LATENCY_PAGE_BYTES, "object_bytes": object_bytes, "repeats": repeats,
            "goal": LATENCY_GOAL, "raw_how": how, "rows": rows}


def _fresh() -> str:
    return f"bench-{uuid.uuid4().hex}"


def _moves(tier) -> List[str]:
    from .canonical import modes
    return sorted(set(modes(tier.canonical).values()))


def _expect(got, want, call: str, tier) -> None:
    if got != want:
        raise RuntimeError(f"{call} answered {got!r}, not {want!r} ({dict(tier.stats)})")


def _percentile(values: List[float], q: float) -> float:
    """The ``q`` quantile of ``values``: the value at rank ceil(q * n) (nearest rank)."""
    ordered = sorted(values)
    import math
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


_RAW_EXTRA = {"raw_get_one": "get_gbps_one_buffer", "raw_get_threads": "get_gbps_threads",
              "raw_set_threads": "set_gbps_threads"}     # optional figures of `raw_throughput`


class Unchecked(Checksum):
    """Verification without the checksum (every other header check still runs)."""

    def matches(self, algorithm, pieces, stored) -> bool:
        return True


HEADER = (f"{'page':>8} {'layout':18} {'moves':10} {'prefetch':>9} {'raw GET':>8} {'ratio':>6} "
          f"{'backup':>8} {'raw SET':>8} {'ratio':>6} {'checksum':>8}  goal")


def _row(p: Dict) -> str:
    goal = ""
    if p["page_bytes"] >= GOAL["min_page_bytes"]:
        ok = (p["prefetch_vs_raw_get"] >= GOAL["prefetch_vs_raw_get"] and p["backup_vs_raw_set"] >= GOAL["backup_vs_raw_set"]
              and p["checksum_share"] <= GOAL["checksum_share"])
        goal = "met" if ok else "below"
    return (f"{p['page_bytes'] >> 10:>5} KiB {p['layout']:18} {'+'.join(p['moves']):10} "
            f"{p['prefetch_gbps']:>6.2f} GB/s {p['raw_get_gbps']:>5.2f} {p['prefetch_vs_raw_get']:>6.2f} "
            f"{p['backup_gbps']:>5.2f} GB/s {p['raw_set_gbps']:>5.2f} {p['backup_vs_raw_set']:>6.2f} "
            f"{100 * p['checksum_share']:>7.1f}%  {goal}")


LATENCY_HEADER = (f"{'pages':>5} {'layout':18} {'moves':8} {'backup p50/p99':>15} {'raw SET':>13} {'ratio':>5} "
                  f"{'prefetch p50/p99':>16} {'raw GET':>13} {'ratio':>5}  goal")


def _latency_row(r: Dict) -> str:
    goal = ""
    if r["pages"] == LATENCY_GOAL["pages"]:
        at = LATENCY_GOAL["at"]
        ok = (r[f"prefetch_vs_raw_get_{at}"] <= LATENCY_GOAL["prefetch_vs_raw_get"]
              and r[f"backup_vs_raw_set_{at}"] <= LATENCY_GOAL["backup_vs_raw_set"])
        goal = "met" if ok else "below"

    def pair(k):
        return f"{r[k + '_p50_us']:>6.0f}/{r[k + '_p99_us']:<6.0f}"
    return (f"{r['pages']:>5} {r['layout']:18} {'+'.join(r['moves']):8} {pair('backup'):>15} "
            f"{pair('raw_set'):>13} {r['backup_vs_raw_set_p50']:>5.2f} {pair('prefetch'):>16} "
            f"{pair('raw_get'):>13} {r['prefetch_vs_raw_get_p50']:>5.2f}  {goal}")


def format_latency(lat: Dict) -> List[str]:
    g = LATENCY_GOAL
    lines = [f"latency: calls of {lat['page_bytes'] >> 10} KiB pages (objects of {lat['object_bytes']} B), "
             f"p50/p99 of {lat['repeats']} calls each, us; backups of fresh keys; ratios at the p50",
             LATENCY_HEADER]
    lines += [_latency_row(r) for r in lat["rows"]]
    lines.append(f"raw: {lat['raw_how']}")
    lines.append(f"latency goal ({g['pages']} page, {g['at']}): prefetch <= {g['prefetch_vs_raw_get']}x raw GET, "
                 f"backup <= {g['backup_vs_raw_set']}x raw SET")
    return lines


def format_text(result: Dict) -> str:
    lines = [f"kvtier store bench: {result['url']} ({result['engine']}, checksum {result['checksum']}"
             + (f", best of {result['rounds']} rounds; GB/s of page payload)" if result["points"] or "reshard" in result else ")")]
    if result["points"]:
        lines += _throughput_lines(result)
    if "reshard" in result:
        lines += format_reshard(result["reshard"])
    if "latency" in result:
        lines += format_latency(result["latency"])
    return "\n".join(lines)


def _throughput_lines(result: Dict) -> List[str]:
    lines = [HEADER]
    lines += [_row(p) for p in result["points"]]
    how = {p["raw_how"] for p in result["points"] if p["raw_how"]}
    lines += [f"raw: {h}" for h in sorted(how)]
    for p in result["points"]:
        if p.get("raw_get_threads_gbps") and p.get("raw_set_threads_gbps"):
            lines.append(
                f"raw on the engine's threads, {p['page_bytes'] >> 10} KiB {p['layout']}: GET "
                f"{p['raw_get_threads_gbps']:.2f} GB/s (prefetch {p['prefetch_gbps'] / p['raw_get_threads_gbps']:.2f}x), "
                f"SET {p['raw_set_threads_gbps']:.2f} GB/s (backup {p['backup_gbps'] / p['raw_set_threads_gbps']:.2f}x)")
    g = result["goal"]
    lines.append(f"goal (pages >= {g['min_page_bytes'] >> 10} KiB): prefetch >= {g['prefetch_vs_raw_get']}x raw GET, "
                 f"backup >= {g['backup_vs_raw_set']}x raw SET, checksum <= {100 * g['checksum_share']:.0f}% "
                 "of the hit path")
    return lines
