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

A page that is missing, timed out, refused, of another length, geometry, dtype or key,
or whose checksum fails reads as a miss: never as an exception, never as bytes the
engine uses. A store fault never raises (the backup thread survives anything); bad
arguments raise `KvtierError` naming the argument before any byte moves. Each failure
mode logs one WARNING and is counted (`stats`). One tier serves several threads at
once (HiCache's backup and prefetch threads).
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import List, Optional, Sequence, Tuple, Union

import torch

from kvtier.kernels.errors import fail
from kvtier.kernels.validate import check_index, check_pages_in_range

from .canonical import LAYER_PIECE_MIN, CanonicalPages
from .engine import DEFAULT_TIMEOUT_MS, Engine, Status, open_store
from .page import PageFormat, namespace, store_key

log = logging.getLogger("kvtier")

BATCH_PAGES = 128               # pages per engine call at most (HiCache passes up to 128)
STAGING_BYTES = 64 << 20        # and at most this much staging memory per call


class StoreTier:
    """Backup and prefetch of ``host``'s pages through ``store`` (a URL for
    `open_store`, or an open `Engine`, which the tier then does not close).

    model: names the model in the namespace (e.g. its path or hub name).
    tp: (rank, size) of this tensor-parallel rank; kept in the namespace for pools
        whose pages differ per rank (MHA: a "k" component), dropped for MLA pools (one
        copy shared by every rank).
    pp: (rank, size) of this pipeline stage, or None.
    batch_pages: pages per engine call at most (fewer where staging memory would pass
        `STAGING_BYTES`, or where the engine prefers calls of ``engine.batch_bytes``).
    """

    def __init__(self, host, store: Union[str, Engine], *, model: str,
                 tp: Optional[Tuple[int, int]] = None, pp: Optional[Tuple[int, int]] = None,
                 timeout_ms: int = DEFAULT_TIMEOUT_MS, batch_pages: int = BATCH_PAGES,
                 layer_piece_min: int = LAYER_PIECE_MIN):
        from kvtier.pool import HostPool
        if not isinstance(host, HostPool):
            raise fail("host", type(host).__name__, "must be a kvtier.pool.HostPool")
        if isinstance(batch_pages, bool) or not isinstance(batch_pages, int) or batch_pages < 1:
            raise fail("batch_pages", batch_pages, "must be a positive int")
        self.host = host
        self.plan = CanonicalPages(host, layer_piece_min)
        self.format = PageFormat(self.plan.geometry)
        per_rank = "k" in host.components
        self.namespace = namespace(model, self.plan.geometry, tp if per_rank else None, pp)
        if isinstance(store, Engine):
            self.engine, self._owns = store, False
        else:
            self.engine, self._owns = open_store(store, timeout_ms=timeout_ms), True
        staged = max(self.plan.staged_bytes, 1)
        self.batch_pages = max(1, min(batch_pages, STAGING_BYTES // staged)) if self.plan.staged else batch_pages
        hint = getattr(self.engine, "batch_bytes", None)     # an engine's preferred call size
        if hint:
            self.batch_pages = max(1, min(self.batch_pages, hint // self.plan.payload_bytes))
        self.stats: Counter = Counter()
        self._lock = threading.Lock()
        self._warned: set = set()

    def __repr__(self) -> str:
        return f"StoreTier({self.namespace!r}, {self.engine!r})"

    @property
    def page_size(self) -> int:
        return self.host.page_size

    def key(self, page_key: str) -> str:
        """The key ``page_key``'s object is stored under."""
        return store_key(self.namespace, page_key)

    def close(self) -> None:
        """Close the engine where the tier opened it."""
        if self._owns:
            self.engine.close()

    # ------------------------------------------------------------------ calls
    def backup(self, page_keys: Sequence[str], host_indices: torch.Tensor) -> List[bool]:
        """Store the pages at ``host_indices`` under ``page_keys``; True where stored."""
        keys = self._keys(page_keys)
        pages = self._pages(host_indices, len(keys), distinct=False)
        out: List[bool] = []
        for a in range(0, len(keys), self.batch_pages):
            ks, ps = keys[a:a + self.batch_pages], pages[a:a + self.batch_pages]
            try:
                statuses = self._backup(ks, ps)
            except Exception as e:      # never into the caller's thread
                self._warn("backup.exception", "backup failed (%s: %s); pages reported not stored",
                           type(e).__name__, e)
                statuses = [Status.ERROR] * len(ks)
            stored = [s == Status.HIT for s in statuses]
            self._count(stored=sum(stored), store_failed=len(stored) - sum(stored))
            out.extend(stored)
        return out

    def prefetch(self, page_keys: Sequence[str], host_indices: torch.Tensor) -> int:
        """Read the pages of ``page_keys`` into the host pages at ``host_indices``;
        returns how many leading pages were read and verified (the rest are misses and
        their host pages hold undefined bytes)."""
        keys = self._keys(page_keys)
        pages = self._pages(host_indices, len(keys), distinct=True)
        done = 0
        for a in range(0, len(keys), self.batch_pages):
            ks, ps = keys[a:a + self.batch_pages], pages[a:a + self.batch_pages]
            try:
                got = self._prefetch(ks, ps)
            except Exception as e:
                self._warn("prefetch.exception", "prefetch failed (%s: %s); pages reported missing",
                           type(e).__name__, e)
                self._count(errors=1, skipped=len(ks) - 1)
                got = 0
            done += got
            if got < len(ks):
                self._count(skipped=len(keys) - a - len(ks))
                break
        return done

    def exists(self, page_keys: Sequence[str]) -> int:
        """How many leading keys of ``page_keys`` are stored."""
        keys = self._keys(page_keys)
        done = 0
        for a in range(0, len(keys), self.batch_pages):
            ks = keys[a:a + self.batch_pages]
            statuses = self.engine.exists(ks)       # a fault is a status, never an exception
            run = next((j for j, s in enumerate(statuses) if s != Status.HIT), len(ks))
            done += run
            self._count(exists_hits=run, exists_misses=int(run < len(ks)))
            if run < len(ks):
                break
        return done

    # ------------------------------------------------------------------ one batch
    def _backup(self, keys: List[str], pages: List[int]) -> List[Status]:
        plan = self.plan
        staging = plan.take_staging(len(keys))
        try:
            plan.to_staging(pages, staging)
            sources = []
            for j, (k, p) in enumerate(zip(keys, pages)):
                pieces = plan.pieces(p, staging, j)
                sources.append([self.format.seal(k, pieces), *pieces])
            return self.engine.put_from(keys, sources)
        finally:
            plan.give_staging(staging)

    def _prefetch(self, keys: List[str], pages: List[int]) -> int:
        plan, fmt = self.plan, self.format
        staging = plan.take_staging(len(keys))
        try:
            headers = [bytearray(fmt.header_size(k)) for k in keys]
            pieces = [plan.pieces(p, staging, j) for j, p in enumerate(pages)]
            statuses = self.engine.get_into(keys, [[h, *ps] for h, ps in zip(headers, pieces)])
            run = 0
            for j, (k, s) in enumerate(zip(keys, statuses)):
                if s != Status.HIT:
                    self._count(**{_MISS_KIND[s]: 1})
                    break
                why = fmt.verify(k, headers[j], pieces[j])
                if why is not None:
                    self._failed_verification(k, why)
                    break
                run += 1
            self._count(hits=run, skipped=len(keys) - run - (run < len(keys)))
            plan.from_staging(staging, pages[:run])
            return run
        finally:
            plan.give_staging(staging)

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
    def _keys(self, page_keys) -> List[str]:
        if isinstance(page_keys, (str, bytes)) or not isinstance(page_keys, (list, tuple)):
            raise fail("page_keys", type(page_keys).__name__, "must be a list of str keys")
        for i, k in enumerate(page_keys):
            if not isinstance(k, str) or not k:
                raise fail(f"page_keys[{i}]", k, "must be a non-empty str")
        return [self.key(k) for k in page_keys]

    def _pages(self, host_indices, n: int, distinct: bool) -> List[int]:
        """Host page numbers of token-granular ``host_indices``: ``n`` whole pages in range."""
        check_index("host_indices", host_indices, torch.device("cpu"))
        P = self.page_size
        if host_indices.numel() != n * P:
            raise fail("host_indices", f"{host_indices.numel()} indices",
                       f"must be {n} pages of {P} slots, one page per key ({n * P} indices)")
        check_pages_in_range("host_indices", host_indices, self.host.size, P)
        pages = (host_indices.reshape(-1, P)[:, 0] // P).tolist() if n else []
        if distinct and len(set(pages)) != len(pages):
            seen = set()
            dup = next(p for p in pages if p in seen or seen.add(p))
            raise fail("host_indices", f"page at slot {dup * P} given twice",
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
