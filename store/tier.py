"""A store tier over a `HostPool`: host pages backed up to a store by key, and read
back into host pages (HiCache's L3 over its L2).

Keys are the engine's page keys (SGLang: a hash of the page's tokens and its prefix),
namespaced by model, geometry and shard (`kvtier.store.page.namespace`). Calls take
token-granular host indices, whole pages, one page per key, as HiCache passes them.

- `backup(page_keys, host_indices)`: store each page; a list of booleans (stored).
- `prefetch(page_keys, host_indices)`: read the pages into the host pages given and
  return the leading run of hits: pages after the first miss are not used (a prefix
  cache needs every page before the one it uses), and their host pages may have been
  written (undefined bytes).
- `exists(page_keys)`: the leading run of keys stored.

Each page's staging copy and checksum run on the engine's thread as the engine moves
the page, where the engine says when (`Engine.put_from`'s ``fill``, `Engine.get_into`'s
``landed``; `StoreTier._sealer`, `StoreTier._get`); what the engine does not report
runs on the calling thread, page by page, beside the next batch's engine call
(`StoreTier._run`).

A page that is missing, timed out, refused, of another length, geometry, dtype or key,
or whose checksum fails reads as a miss: never as an exception, never as bytes the
engine uses. A store fault never raises (the backup thread survives anything); bad
arguments raise `KvtierError` naming the argument before any byte moves. Each failure
mode logs one WARNING and is counted (`stats`). One tier serves several threads at
once (HiCache's backup and prefetch threads).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from kvtier.errors import fail
from kvtier.kernels.validate import check_index, check_pages_in_range, index_ok

from .canonical import LAYER_PIECE_MIN, CanonicalPages, Staging
from .engine import DEFAULT_TIMEOUT_MS, Engine, PendingGet, Status, open_store
from .page import PageFormat, namespace, object_key
from .split import split_of

log = logging.getLogger("kvtier")

BATCH_PAGES = 128               # pages per engine call at most (HiCache passes up to 128)
STAGING_BYTES = 64 << 20        # and at most this much staged page data per call (slots add header room)
SMALL_INDICES = 256             # index lists up to this long are checked as Python ints (numpy: from about 400)
# An object of a page of several is placed in its host page as it lands (on the engine's
# thread, from the CPU's cache) where it stages at least this; smaller ones are placed
# after the call, in one copy per run of pages (beside the next batch's engine call): a
# copy per object costs more than it saves. Reshard reads (TP 8 -> TP 2, 2-core CPU,
# medians, ms per 64 MiB as they land / after the call): file store, objects of 64 KiB
# 38 / 30, 256 KiB 16-23 / 17-21, 512 KiB 15 / 16, 1 MiB 13 / 16, 4 MiB 11 / 13; Redis
# node, 64 KiB 69 / 54, 256 KiB 40 / 37, 512 KiB 30 / 35, 1 MiB 25 / 31
# (results/2026-12-07_cpu_store_reshard_placement).
PLACE_ON_LANDING_MIN = 512 << 10
# A prefetch of one batch of at least this much staged page data, of pages whose objects
# are all placed after landing (a reshard read's small head-group objects), hands its
# engine call to the tier's worker thread and places each page on the calling thread
# as the page's last object lands (`StoreTier._placing`): the copy runs beside the
# store's transfer instead of after it. Calls of several batches already place each
# batch beside the next one's engine call; placing within the batch too only added
# CPU there; smaller calls would pay more for the hand-off than the copy takes. Reshard
# reads of one batch (TP 8 -> TP 2, 2-core CPU, medians, ms beside / after): Redis node,
# 64 MiB of 1 MiB pages 18.8 / 22.7 (page_first_direct), 18.9 / 22.6 (page_first); file
# store, 16 MiB calls of 256 KiB and 1 MiB pages, within 0.4 ms either way
# (results/2026-12-07_cpu_store_reshard_beside).
PLACE_BESIDE_MIN = 4 << 20
PLACE_BESIDE_RUN = 1 << 20      # the calling thread wakes to place pages once this much of them is ready
_CPU = torch.device("cpu")


class StoreTier:
    """Backup and prefetch of ``host``'s pages through ``store`` (a URL for
    `open_store`, or an open `Engine`, which the tier then does not close).

    model: names the model (its path or hub name, or an id of the caller's);
        ``revision``, where given, is appended as ``model@revision``.
    tp: (rank, size) of this tensor-parallel rank, None for (0, 1). heads: the model's
        KV heads (default: the host rows' heads times the TP size). layers: (first,
        total) where the pool holds a pipeline stage's layers. layer_split: the layer
        boundaries ``(0, ..., total)`` the store's objects are cut at (an int n: every n
        layers), shared by every server (it must refine each one's stages), so that
        stages of any split read each other's pages; None: the pool's own range.
        scales: the quantisation scale layout. kv_dtype: the KV cache dtype's name
        where the rows' dtype does not tell it (SGLang keeps fp8 e4m3 and e5m2 alike as
        uint8). These make the objects' identity (`kvtier.store.split`): a page is
        stored as objects by layer range and KV head group that a rank of any TP size
        reads, each rank writing only the objects no rank before it holds.
    batch_pages: pages per engine call at most (fewer where staging memory would pass
        `STAGING_BYTES`, or where the engine prefers calls of ``engine.batch_bytes``).
    """

    def __init__(self, host, store: Union[str, Engine], *, model: str, revision: Optional[str] = None,
                 tp: Optional[Tuple[int, int]] = None, heads: Optional[int] = None,
                 layers: Optional[Tuple[int, int]] = None, layer_split: Union[int, Sequence[int], None] = None,
                 scales: str = "none", kv_dtype: Optional[str] = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, batch_pages: int = BATCH_PAGES,
                 layer_piece_min: int = LAYER_PIECE_MIN):
        from kvtier.pool import HostPool
        if not isinstance(host, HostPool):
            raise fail("host", type(host).__name__, "must be a kvtier.pool.HostPool")
        if isinstance(batch_pages, bool) or not isinstance(batch_pages, int) or batch_pages < 1:
            raise fail("batch_pages", batch_pages, "must be a positive int")
        if revision is not None and (not isinstance(revision, str) or not revision):
            raise fail("revision", revision, "must be a non-empty str, or None")
        if not isinstance(model, str) or not model:
            raise fail("model", model, "must be a non-empty str naming the model")
        self.host = host
        self.split = split_of(host, model=model if revision is None else f"{model}@{revision}",
                              tp=tp, heads=heads, layers=layers, layer_split=layer_split,
                              scales=scales, kv_dtype=kv_dtype)
        self.namespace = namespace(self.split.identity)
        scope, parts = self.split.identity.text, self.split.parts
        self.read = _Objects(CanonicalPages(host, layer_piece_min, parts, scope))
        written = tuple(p for p in parts if p.writes)
        self.write = (self.read if written == parts else
                      _Objects(CanonicalPages(host, layer_piece_min, written, scope)) if written else None)
        if isinstance(store, Engine):
            self.engine, self._owns = store, False
        else:
            self.engine, self._owns = open_store(store, timeout_ms=timeout_ms), True
        cp = self.read.canonical
        staged = max(cp.slot_bytes - sum(o.header_room for o in cp.objects), 1)
        self.batch_pages = max(1, min(batch_pages, STAGING_BYTES // staged)) if cp.staged else batch_pages
        hint = getattr(self.engine, "batch_bytes", None)     # an engine's preferred call size
        if hint:
            self.batch_pages = max(1, min(self.batch_pages, hint // cp.payload_bytes))
        self.stats: Counter = Counter()
        self._lock = threading.Lock()
        self._warned: set = set()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def __repr__(self) -> str:
        return f"StoreTier({self.namespace!r}, {self.engine!r})"

    @property
    def page_size(self) -> int:
        return self.host.page_size

    @property
    def format(self) -> PageFormat:
        """The page format of a tier of one object per page."""
        if self.read.m != 1:
            raise fail("format", self.read.m, "this tier reads several objects per page (read.formats)")
        return self.read.formats[0]

    @property
    def canonical(self) -> CanonicalPages:
        """How this rank's pages become the objects it reads."""
        return self.read.canonical

    def keys(self, page_key: str) -> List[str]:
        """The keys of ``page_key``'s objects this rank reads (`read`)."""
        return self._keys([page_key], self.read)

    def key(self, page_key: str) -> str:
        """The key of ``page_key``'s object, for a tier of one object per page."""
        keys = self.keys(page_key)
        if len(keys) != 1:
            raise fail("page_key", page_key, f"is stored as {len(keys)} objects here (keys)")
        return keys[0]

    def written_keys(self, page_key: str) -> List[str]:
        """The keys of ``page_key``'s objects this rank writes (`write`; none where
        other ranks write every object it holds: `kvtier.store.split`)."""
        return self._keys([page_key], self.write) if self.write is not None else []

    def close(self) -> None:
        """Close the engine where the tier opened it."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._owns:
            self.engine.close()

    # ------------------------------------------------------------------ calls
    def backup(self, page_keys: Sequence[str], host_indices: torch.Tensor) -> List[bool]:
        """Store the pages at ``host_indices`` under ``page_keys``; True where stored."""
        side = self.write
        keys = self._keys(page_keys, side)
        n = len(page_keys)
        pages = self._pages(host_indices, n, distinct=False)
        if side is None:        # ranks before this one write every object it holds
            self._count(left_to_writer=n)
            return [True] * n
        out: List[bool] = []

        def finish(batch: _Batch, statuses: List[Status]) -> bool:
            stored = [all(s == Status.HIT for s in ss) for ss in _per_page(statuses, side.m)]
            self._count(stored=sum(stored), store_failed=len(stored) - sum(stored))
            out.extend(stored)
            return True

        try:
            self._run(side, keys, pages, self._sealed, self._put, None, finish)
        except Exception as e:          # never into the caller's thread
            self._warn("backup.exception", "backup failed (%s: %s); pages reported not stored",
                       type(e).__name__, e)
            self._count(store_failed=n - len(out))
        return out + [False] * (n - len(out))

    def prefetch(self, page_keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Read the pages of ``page_keys`` into the host pages at ``host_indices``;
        returns how many leading pages were read and verified (the rest are misses and
        their host pages hold undefined bytes)."""
        side = self.read
        keys = self._keys(page_keys, side)
        n = len(page_keys)
        # A call of one batch asks the store for its objects first, where the engine
        # sends requests ahead: the store's round trip overlaps the index check and the
        # making of the buffers below.
        ahead = (self.engine.get_ahead(keys, side.sizes(keys))
                 if self.engine.sends_ahead and 0 < n <= self.batch_pages else None)
        try:
            pages = self._pages(host_indices, n, distinct=True)
            done = self._read_pages(side, keys, pages, ahead)
        finally:
            if ahead is not None:
                ahead.cancel()          # where the call raised, or ended before its engine call
        if n - done > 1:
            self._count(skipped=n - done - 1)     # after the first miss, counted as what it was
        return done

    def _read_pages(self, side: "_Objects", keys: List[str], pages: List[int],
                    ahead: Optional[PendingGet]) -> int:
        """`prefetch`'s batches (its keys and checked pages): the leading pages read and
        verified; an exception is a WARNING and ends the call (what was read counts)."""
        done = [0]

        def finish(batch: _Batch, statuses: List[Status]) -> bool:
            run = self._verified(batch, statuses)
            self._place_after(batch, run)
            done[0] += run
            return run == len(batch.pages)

        beside = len(pages) <= self.batch_pages       # one batch: nothing else to place beside its call

        def prepare(side, keys, pages, staging):
            return self._receivers(side, keys, pages, staging, beside)

        try:
            self._run(side, keys, pages, prepare,
                      self._get if ahead is None else lambda batch: self._get(batch, ahead),
                      _all_hits, finish)
        except Exception as e:
            self._warn("prefetch.exception", "prefetch failed (%s: %s); pages reported missing",
                       type(e).__name__, e)
            self._count(errors=1)
        return done[0]

    @staticmethod
    def _place_after(batch: "_Batch", run: int) -> None:
        """The staged objects of ``batch``'s first ``run`` pages that were not placed as
        they landed, placed now: pages none of whose objects were placed in one copy
        per run of them (`CanonicalPages.from_staging` folds their head groups); the
        other pages' unplaced objects object by object, in runs."""
        cp, m, placed = batch.side.canonical, batch.side.m, batch.placed
        whole = [not any(placed[p * m:p * m + m]) for p in range(run)]
        for fold, a, b in _runs(whole):
            if fold:
                cp.from_staging(batch.staging, batch.pages[a:b], a)
        for o in range(m):
            for unplaced, a, b in _runs([not (whole[p] or placed[p * m + o]) for p in range(run)]):
                if unplaced:
                    cp.from_staging(batch.staging, batch.pages[a:b], a, o)

    def exists(self, page_keys: Sequence[str]) -> int:
        """How many leading keys of ``page_keys`` are stored."""
        m = self.read.m
        keys = self._keys(page_keys, self.read)
        step, done = self.batch_pages * m, 0
        for a in range(0, len(keys), step):
            ks = keys[a:a + step]
            statuses = self.engine.exists(ks)       # a fault is a status, never an exception
            hits = [all(s == Status.HIT for s in ss) for ss in _per_page(statuses, m)]
            run = next((j for j, hit in enumerate(hits) if not hit), len(hits))
            done += run
            self._count(exists_hits=run, exists_misses=int(run < len(hits)))
            if run < len(hits):
                break
        return done

    # ------------------------------------------------------------------ batches
    def _run(self, side: "_Objects", keys: List[str], pages: List[int], prepare, move, go_on, finish) -> None:
        """A call in batches of `batch_pages` pages (``side.m`` objects each), each
        through three steps: ``prepare(side, keys, pages, staging)`` makes its `_Batch` (CPU: staging copy, checksums), ``move(batch)``
        is its engine call, ``finish(batch, statuses)`` uses the result (CPU;
        False ends the call). While one batch's engine call runs on the tier's worker
        thread, this thread finishes the batch before it and prepares the one after: the
        checksum and the staging copy overlap the store's transfer. The next engine call
        starts only once ``go_on(statuses)`` of the one before holds (None: always), so a
        miss the engine reports ends a prefetch before anything after it is read. When
        this returns or raises, no engine call of it is running and every staging
        buffer it took is given back. A call of one batch runs wholly on this thread
        (nothing to overlap: no hand-off to a worker), but for a batch whose pages this
        thread places as they land (`_placing`)."""
        if not pages:
            return
        cp, m = side.canonical, side.m
        if len(pages) <= self.batch_pages:
            staging = cp.take_staging(len(pages))
            try:
                batch = prepare(side, keys, pages, staging)
                if batch.landings is None:
                    finish(batch, move(batch))
                    return
                flight = self._workers().submit(move, batch)
                try:
                    statuses = self._placing(flight, batch)
                finally:
                    concurrent.futures.wait([flight])
                finish(batch, statuses)
            finally:
                cp.give_staging(staging)
            return
        spans = [(a, a + self.batch_pages) for a in range(0, len(pages), self.batch_pages)]
        pool = self._workers()
        held: List[_Batch] = []     # prepared, not finished (staging out); held[0]'s engine call is `flight`
        flight = None
        try:
            for a, b in spans:
                staging = cp.take_staging(len(pages[a:b]))
                try:
                    held.append(prepare(side, keys[a * m:b * m], pages[a:b], staging))    # overlaps `flight`
                except BaseException:
                    cp.give_staging(staging)
                    if flight is not None:      # what was moved still counts
                        statuses, flight = flight.result(), None
                        finish(held[0], statuses)
                    raise
                if flight is None:
                    if pool is not None:
                        flight = pool.submit(move, held[0])
                    continue
                statuses, flight = flight.result(), None
                if go_on is not None and not go_on(statuses):
                    finish(held[0], statuses)
                    return
                flight = pool.submit(move, held[1])
                going = finish(held[0], statuses)                   # overlaps the new `flight`
                cp.give_staging(held.pop(0).staging)
                if not going:
                    return
            if held:
                statuses = flight.result() if flight is not None else move(held[0])
                flight = None
                finish(held[0], statuses)
        finally:
            if flight is not None:          # ended early or raised: let its engine call end first
                concurrent.futures.wait([flight])
            for batch in held:
                cp.give_staging(batch.staging)

    def _workers(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that run engine calls (two: a backup and a prefetch thread each
        keep one running); made at the first call of more than one batch."""
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvtier-store")
            return self._pool

    @staticmethod
    def _placing(flight: concurrent.futures.Future, batch: "_Batch") -> List[Status]:
        """``flight``'s statuses (the engine call of ``batch``, which has
        `_Batch.landings`); meanwhile its pages whose objects have all landed and been
        verified are placed in their host pages by this thread, in one folded copy per
        run of them (`CanonicalPages.from_staging`), as they come."""
        landings = batch.landings
        flight.add_done_callback(landings.end)
        cp, m, placed, staging, pages = batch.side.canonical, batch.side.m, batch.placed, batch.staging, batch.pages
        done = False
        while not done:
            ready, done = landings.take()
            if not ready:
                continue
            lo, got = min(ready), set(ready)
            for flag, a, b in _runs([p in got for p in range(lo, max(ready) + 1)]):
                if flag:            # a run of ready pages: one copy
                    cp.from_staging(staging, pages[lo + a:lo + b], lo + a)
                    placed[(lo + a) * m:(lo + b) * m] = [True] * ((b - a) * m)
        return flight.result()

    def _sealed(self, side: "_Objects", keys: List[str], pages: List[int], staging: Optional[Staging]) -> "_Batch":
        """A backup batch: its pages are staged and sealed one by one by `_sealer`, as
        the engine sends them where it sends values one by one (`Engine.fills_as_sent`),
        else now (this thread, beside the engine call of the batch before)."""
        pieces = self._pieces(side, pages, staging)
        headers, buffers = self._framed(side, keys, pieces, staging, PageFormat.header)
        batch = _Batch(side, keys, pages, staging, headers, buffers, pieces, sealed=[None] * len(keys))
        if side.m > 1:       # a page's staging copy serves several objects: made here, once
            try:
                side.canonical.to_staging(pages, staging)
            except Exception as e:
                self._warn("backup.seal", "pages could not be staged (%s: %s); they are not "
                           "stored", type(e).__name__, e)
                batch.sealed[:] = [False] * len(keys)
        if not self.engine.fills_as_sent:
            fill = self._sealer(batch)
            for j in range(len(keys)):
                fill(j)
        return batch

    def _receivers(self, side: "_Objects", keys: List[str], pages: List[int], staging: Optional[Staging],
                   beside: bool = False) -> "_Batch":
        """A prefetch batch: a header buffer and the payload pieces (host memory or
        staging) per page, for the engine to read into; ``beside``: its pages are placed
        as they land, by the thread that waits for its engine call, where they qualify
        (`PLACE_BESIDE_MIN`)."""
        pieces = self._pieces(side, pages, staging)
        headers, buffers = self._framed(side, keys, pieces, staging, PageFormat.header_size)
        slot = side.canonical.slot_bytes
        beside = beside and side.places_beside and len(pages) * slot >= PLACE_BESIDE_MIN     # all staged: staging is there
        return _Batch(side, keys, pages, staging, headers, buffers, pieces, [_UNHEARD] * len(keys),
                      placed=[staging is None] * len(keys),
                      landings=_Landings(len(pages), side.m, -(-PLACE_BESIDE_RUN // slot)) if beside else None)

    def _pieces(self, side: "_Objects", pages: List[int], staging: Optional[Staging]) -> List[List[memoryview]]:
        """Each object's payload pieces, page by page (`CanonicalPages.pieces`)."""
        cp = side.canonical
        return [cp.pieces(p, staging, j, o) for j, p in enumerate(pages) for o in range(side.m)]

    @staticmethod
    def _framed(side: "_Objects", keys: List[str], pieces: List[List[memoryview]],
                staging: Optional[Staging], header) -> Tuple[list, List[list]]:
        """Each object's header buffer, and the buffers the engine moves: the header then
        the payload pieces, or one buffer where the object's staging slot holds its
        header just before its payload (an object staged whole,
        `CanonicalPages.framed`). ``header(format, key)`` is the header to send
        (`PageFormat.header`: copied into the slot there) or the length of the one to
        receive (`PageFormat.header_size`: read into the slot there, else into a new
        buffer)."""
        out_headers, buffers, m, framed = [], [], side.m, side.canonical.framed
        for i, (k, ps) in enumerate(zip(keys, pieces)):
            h = header(side.formats[i % m], k)
            n = h if type(h) is int else len(h)
            frame = framed(staging, i // m, n, i % m)
            if frame is None:       # a byte view, as the engine takes it (no list of its own made)
                h = memoryview(bytearray(h) if type(h) is int else h)
                out_headers.append(h)
                buffers.append([h, *ps])
            else:
                if type(h) is not int:
                    frame[0][:] = h
                out_headers.append(frame[0])
                buffers.append(frame[1])
        return out_headers, buffers

    def _put(self, batch: "_Batch") -> List[Status]:
        """The engine call of a backup batch. A page whose staging copy or seal failed
        is not sent (reported not stored; its header keeps algorithm 0, which no reader
        accepts)."""
        statuses = self.engine.put_from(batch.keys, batch.buffers, self._sealer(batch))
        return [s if ok else Status.ERROR for s, ok in zip(statuses, batch.sealed)]

    def _sealer(self, batch: "_Batch"):
        """``fill(j)`` for `Engine.put_from`: page j's staged components copied into its
        staging slot and its header sealed, once, just before the page is read (the
        checksum then reads the page from the CPU's cache); False where that failed."""
        cp, formats, m = batch.side.canonical, batch.side.formats, batch.side.m
        headers, pieces = batch.headers, batch.pieces
        pages, staging, sealed = batch.pages, batch.staging, batch.sealed

        def fill(j: int) -> bool:
            if sealed[j] is None:
                try:
                    if m == 1:
                        cp.to_staging(pages[j:j + 1], staging, j)
                    formats[j % m].seal_into(headers[j], pieces[j])
                    sealed[j] = True
                except Exception as e:
                    self._warn("backup.seal", "a page could not be sealed (%s: %s); it is not "
                               "stored", type(e).__name__, e)
                    sealed[j] = False
            return sealed[j]
        return fill

    def _get(self, batch: "_Batch", ahead: Optional[PendingGet] = None) -> List[Status]:
        """The engine call of a prefetch batch (``ahead``: the call's, begun by
        `Engine.get_ahead`). Each object the engine reports whole in
        its buffers (`Engine.get_into`'s ``landed``) is verified there, on the engine's
        thread, and its staged components placed in its host page, while the CPU's
        cache still holds it (a page's objects hold disjoint bytes of it: each is placed
        as it lands, on whichever engine thread got it, where it is the page's only one
        or stages at least `PLACE_ON_LANDING_MIN`); objects the engine did not report
        (Mooncake reports none), and small objects of a page of several, are placed
        after the call (`_verified`, then ``finish``), but for a batch with `_Batch.landings`,
        whose pages the waiting thread places as their last object lands (`_placing`). A page whose objects were placed but that turns
        out to lie after a miss, or to have an object missing or corrupt, is outside
        the leading run: its host page holds undefined bytes, as `prefetch` says."""
        cp, formats, m = batch.side.canonical, batch.side.formats, batch.side.m
        keys, headers, pieces, verdicts = batch.keys, batch.headers, batch.pieces, batch.verdicts
        pages, staging, placed = batch.pages, batch.staging, batch.placed
        on_landing, landings = batch.side.place_on_landing, batch.landings

        def landed(j: int) -> None:
            try:
                verdicts[j] = why = formats[j % m].verify(keys[j], headers[j], pieces[j])
                if why is not None or placed[j]:
                    return
                if on_landing[j % m]:
                    page = j // m
                    cp.from_staging(staging, pages[page:page + 1], page, j % m)
                    placed[j] = True
                elif landings is not None:
                    landings.landed(j)      # placed by the thread that waits (`_placing`)
            except Exception:       # verified and placed again after the call
                verdicts[j] = _UNHEARD

        if ahead is not None:
            return ahead.into(batch.buffers, landed)
        return self.engine.get_into(keys, batch.buffers, landed)

    def _verified(self, batch: "_Batch", statuses: List[Status]) -> int:
        """The leading run of ``batch``'s pages read whole and verified; the first page
        after it is counted as what it was (miss, timeout, corrupt, ...)."""
        m, formats, verdicts = batch.side.m, batch.side.formats, batch.verdicts
        for j, (k, s) in enumerate(zip(batch.keys, statuses)):
            if s != Status.HIT:
                self._count(**{_MISS_KIND[s]: 1})
                break
            why = verdicts[j]
            if why is _UNHEARD:
                why = formats[j % m].verify(k, batch.headers[j], batch.pieces[j])
            if why is not None:
                self._failed_verification(k, why)
                break
        else:
            j = len(batch.keys)
        run = j // m            # pages whose every object was read and verified
        self._count(hits=run)
        return run

    def _failed_verification(self, key: str, why: str) -> None:
        if why == "unverifiable":
            self._warn("verify.unverifiable", "a page's checksum algorithm is not installed here "
                       "(pip install 'kvtier[store]'); such pages read as misses (first: %s)", key)
            self._count(unverifiable=1)
            return
        self._warn(f"verify.{why}", "a page failed verification (%s) and reads as a miss: %s "
                   "(counted in stats['corrupt'] from now on)", why, key)
        self._count(corrupt=1)

    # ------------------------------------------------------------------ arguments
    def _keys(self, page_keys, side: Optional["_Objects"]) -> List[str]:
        """The keys of ``side``'s objects of each page key (none where ``side`` is None),
        page by page; ``page_keys`` checked."""
        if isinstance(page_keys, (str, bytes)) or not isinstance(page_keys, (list, tuple)):
            raise fail("page_keys", type(page_keys).__name__, "must be a list of str keys")
        for i, k in enumerate(page_keys):
            if not isinstance(k, str) or not k:
                raise fail(f"page_keys[{i}]", k, "must be a non-empty str")
        if side is None:
            return []
        return [object_key(self.namespace, k, name) for k in page_keys for name in side.names]

    def _pages(self, host_indices, n: int, distinct: bool) -> List[int]:
        """Host page numbers of token-granular ``host_indices``: ``n`` whole pages in range.
        They are checked on a private copy of the indices, and that copy is what the call
        uses: indices rewritten while the call runs (an engine's own kernel, a numpy view)
        cannot change a page number after its check."""
        if not index_ok(host_indices, _CPU):
            check_index("host_indices", host_indices, _CPU)
        P = self.page_size
        if host_indices.numel() != n * P:
            raise fail("host_indices", f"{host_indices.numel()} indices",
                       f"must be {n} pages of {P} slots, one page per key ({n * P} indices)")
        if not n:
            return []
        if n * P <= SMALL_INDICES:
            pages = self._whole_pages(host_indices.tolist(), n)        # the copy, as Python ints
            if pages is not None:
                return self._distinct(pages, distinct)
            # not whole pages in range: the check below names what is wrong
        idx = np.array(host_indices.detach().numpy(), dtype=np.int64)      # the copy
        rows = idx.reshape(n, P)
        first = rows[:, 0]
        # in range before any sum (no int64 overflow), then whole pages
        if not (first.min() >= 0 and first.max() <= self.host.size - P and not (first % P).any()
                and np.array_equal(rows, first[:, None] + np.arange(P))):
            check_pages_in_range("host_indices", torch.from_numpy(idx), self.host.size, P)   # names it
            raise fail("host_indices", idx.tolist()[:P], "must be whole pages in range")
        return self._distinct((first // P).tolist(), distinct)

    def _whole_pages(self, idx: List[int], n: int) -> Optional[List[int]]:
        """The page numbers of ``n`` whole pages in range given as slots ``idx``; None
        where they are not that (`_pages` then says why)."""
        P, last = self.page_size, self.host.size - self.page_size
        pages = idx[::P]
        for j, first in enumerate(pages):
            if not 0 <= first <= last or first % P or idx[j * P:(j + 1) * P] != list(range(first, first + P)):
                return None
        return [first // P for first in pages]

    def _distinct(self, pages: List[int], distinct: bool) -> List[int]:
        if distinct and len(set(pages)) != len(pages):
            seen = set()
            dup = next(p for p in pages if p in seen or seen.add(p))
            raise fail("host_indices", f"page at slot {dup * self.page_size} given twice",
                       "a prefetch reads each key into its own host page")
        return pages

    # ------------------------------------------------------------------ counters
    def _count(self, **counts) -> None:
        with self._lock:
            for k, v in counts.items():
                if v:
                    self.stats[k] += v

    def _warn(self, mode: str, message: str, *args) -> None:
        with self._lock:
            if mode in self._warned:
                return
            self._warned.add(mode)
        log.warning("kvtier store tier %s: " + message, self.namespace, *args)


_MISS_KIND = {Status.MISS: "misses", Status.TIMEOUT: "timeouts", Status.CORRUPT: "corrupt",
              Status.ERROR: "errors"}


class _Objects:
    """The objects of each page a call moves (the ones this rank reads, or the ones it
    writes): how host pages become them (`CanonicalPages`), their formats, key
    suffixes and count."""

    def __init__(self, canonical: CanonicalPages):
        self.canonical = canonical
        self.formats = [PageFormat(o.geometry) for o in canonical.objects]
        self.names = [o.name for o in canonical.objects]
        self.m = len(self.names)
        # whether each object is placed as it lands (`PLACE_ON_LANDING_MIN`; a page's only object: always)
        self.place_on_landing = [self.m == 1 or o.staged_bytes >= PLACE_ON_LANDING_MIN for o in canonical.objects]
        # whether a page is placed once its objects have all landed (`StoreTier._placing`):
        # several objects, all staged whole, none placed as it lands
        self.places_beside = self.m > 1 and not any(self.place_on_landing) and \
            all(o.header_room for o in canonical.objects)

    def sizes(self, keys: List[str]) -> List[int]:
        """Each object's length in the store (header and payload), key by key."""
        objects, m = self.canonical.objects, self.m
        return [self.formats[i % m].header_size(k) + objects[i % m].payload_bytes for i, k in enumerate(keys)]


def _per_page(statuses: List[Status], m: int) -> List[List[Status]]:
    """Statuses of a batch's objects, page by page (``m`` objects each)."""
    return [statuses[j:j + m] for j in range(0, len(statuses), m)]


@dataclass
class _Batch:
    """One engine call's pages: ``buffers`` per key are what the engine writes from or
    reads into (``headers``, then the payload ``pieces``: in one buffer where the
    staging slot holds both, `StoreTier._framed`), ``staging`` holds staged pieces."""

    side: _Objects
    keys: List[str]
    pages: List[int]
    staging: Optional[Staging]
    headers: list
    buffers: List[list]
    pieces: List[List[memoryview]]
    verdicts: Optional[list] = None     # prefetch: `PageFormat.verify` per page, once landed
    placed: Optional[list] = None       # prefetch: True per object whose host page holds it
    sealed: Optional[list] = None       # backup: per page None until staged and sealed, then whether that worked
    landings: Optional["_Landings"] = None          # prefetch: pages whose objects all landed (`StoreTier._placing`)


_UNHEARD = object()     # a page's verdict before its engine reported it landed


class _Landings:
    """A prefetch batch's pages whose objects have all landed and verified, from the
    engine's threads (`landed`) to the thread that places them (`take`), which wakes
    once ``least`` pages are ready (a copy of at least `PLACE_BESIDE_RUN`) or the engine
    call has ended (`end`)."""

    def __init__(self, pages: int, m: int, least: int):
        self._m, self._least = m, max(1, least)
        self._count = [0] * pages
        self._ready: List[int] = []
        self._done = False
        self._cond = threading.Condition(threading.Lock())

    def landed(self, j: int) -> None:
        with self._cond:
            p = j // self._m
            self._count[p] += 1
            if self._count[p] == self._m:
                self._ready.append(p)
                if len(self._ready) >= self._least:
                    self._cond.notify()

    def end(self, _future=None) -> None:
        """The engine call has returned, or will never run: no object lands after this."""
        with self._cond:
            self._done = True
            self._cond.notify()

    def take(self) -> Tuple[List[int], bool]:
        """The pages ready since the last take (at least ``least``, or what there is once
        the call has ended), and whether it has."""
        with self._cond:
            while not self._done and len(self._ready) < self._least:
                self._cond.wait()
            ready, self._ready = self._ready, []
            return ready, self._done


def _runs(flags: List[bool]):
    """``(flag, a, b)`` for each run ``flags[a:b]`` of equal flags, in order."""
    a = 0
    for flag, same in itertools.groupby(flags):
        b = a + len(list(same))
        yield flag, a, b
        a = b


def _all_hits(statuses: List[Status]) -> bool:
    return all(s == Status.HIT for s in statuses)
