"""SGLang HiCache's L3 backend on kvtier's store tier: `KvtierStorage`.

Enable it (docs/engines/sglang.md)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.store.sglang", "class_name": "KvtierStorage",
        "interface_v1": 1, "url": "redis://10.0.0.5:6379", "timeout_ms": 1000}'

SGLang 0.5.23's backend factory builds it as ``KvtierStorage(storage_config, kwargs)``
(`HiCacheStorageConfig`: TP/PP ranks, model name, MLA or not, metrics flag, the extra
config above). The store is opened then: a bad key or value in the extra config, a
malformed URL or a store that cannot be reached raises `KvtierError` naming it, and
SGLang's attach fails. The host pool arrives later (``register_mem_pool_host``); it is
checked and adopted then (`kvtier.store.sglang_pools`: a kvtier `HostPool` over SGLang's
own ``kv_buffer``), and a `StoreTier` is built over it. An unsupported pool class or
layout raises `KvtierError` naming it.

The calls, with SGLang's semantics:

- ``batch_exists(keys)``: how many leading keys are stored (an int).
- ``batch_get_v1(keys, host_indices)``: read the pages into the host pages at the
  token-granular ``host_indices`` (one whole page per key); a bool per key, True for the
  leading run of pages read and verified, False from the first miss on (SGLang uses the
  leading run only).
- ``batch_set_v1(keys, host_indices)``: store the pages; a bool per key. Every call
  writes (puts are idempotent), so a page that once read as corrupt is replaced by the
  next backup of it instead of being skipped as present.
- the legacy calls (``get``, ``batch_get``, ``set``, ``batch_set``, ``exists``), which
  SGLang uses when ``interface_v1`` is 0: SGLang's flat pages (``get_data_page``) pass
  through a few staging pages of this thread, and the objects are the same ones.
- ``clear()`` removes nothing (the store is shared; see docs) and returns False.
- ``get_stats()``: SGLang's `StorageMetrics` (pages and GB/s per call, when SGLang
  collects storage metrics), with kvtier's counters as its ``kvtier`` attribute.

Pages are stored as topology-free objects (`kvtier.store.split`, docs/store.md): one
per layer range and KV head group of an MHA model, one per layer range of an MLA model,
named by the model (``model`` or SGLang's model name, and ``revision``), the KV dtype,
layer count, whole-model head geometry and scale layout (``kv_scales``). A server at any
TP size (1, 2, 4, 8, either dividing the other) reads the pages of one at another;
each rank writes only its own head groups (the first rank of a replica set where
``tp_size`` exceeds the KV heads, then ``kv_heads`` must be given), MLA pages are
written by TP rank 0 (as SGLang's controller also lets only rank 0 back them up). A
pipeline stage names its objects by its layers (SGLang's ``start_layer``) of
``num_layers``, which must then be given; ``layer_split`` (the boundaries every server
of the fleet cuts its objects at, or n for every n layers: docs/store.md) lets stages
of another split read them. ``tp_lcm_size`` is accepted and changes
nothing: no TP size needs it. A store fault (missing, timed out, refused, corrupt,
another identity) is a miss or a page not stored, never an exception in SGLang's
thread; each failure mode logs one WARNING and is counted. The controller's backup,
prefetch and prefetch-I/O threads may call one instance at once.

Not supported, refused at construction or registration with the reason: decode
context parallelism (SGLang refuses third-party L3 backends with it anyway), attention
context parallelism, SGLang's batch
v2 side pools (Mamba, SWA, indexer, draft pools of hybrid models), and host pools other
than `kvtier.store.sglang_pools.LAYOUTS`'s.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier.errors import KvtierError, fail

from . import sglang_pools
from .canonical import modes
from .engine import DEFAULT_TIMEOUT_MS, URL_FORMS, Engine, open_store
from .tier import StoreTier

log = logging.getLogger("kvtier")

OWN_KEYS = ("url", "timeout_ms", "model", "revision", "kv_heads", "num_layers", "layer_split", "kv_scales",
            "kv_cache_dtype")
# Keys of the extra config SGLang reads itself (the dynamic loader's, the controller's).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
LEGACY_PAGES = 8        # staging pages per thread for the legacy calls' flat pages


class KvtierStorage(HiCacheStorage):
    """SGLang's `HiCacheStorage` over a kvtier store (module doc)."""

    def __init__(self, storage_config, kwargs: Optional[dict] = None):
        """``storage_config``: SGLang's `HiCacheStorageConfig`; ``kwargs``: what SGLang's
        factory passes on to dynamic backends (nothing, in 0.5.23)."""
        cfg = _config(storage_config)
        self.storage_config = storage_config
        self.url: str = cfg["url"]
        self.timeout_ms = cfg["timeout_ms"]
        self.model: str = cfg["model"]
        self.tp = (storage_config.tp_rank, storage_config.tp_size)
        self.pp_size = storage_config.pp_size
        self.identity = {k: cfg[k] for k in ("revision", "kv_heads", "num_layers", "layer_split", "kv_scales",
                                             "kv_cache_dtype")}
        self._tier_args: Optional[dict] = None
        self.is_mla = bool(storage_config.is_mla_model)
        self.interface_v1 = cfg["interface_v1"]
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: List[int] = []
        self._backup_pgs: List[int] = []
        self._prefetch_bw: List[float] = []
        self._backup_bw: List[float] = []
        self._tier: Optional[StoreTier] = None
        self.host = None                # kvtier's HostPool over SGLang's, at registration
        self._legacy = threading.local()
        self._stages: List["_LegacyStage"] = []
        self._warned: set = set()
        self._warn_lock = threading.Lock()
        self.engine: Engine = open_store(self.url, timeout_ms=self.timeout_ms)     # reach it now
        if not self.interface_v1:
            self._warn("legacy", "interface_v1 is 0: SGLang uses the legacy calls, which copy every "
                       "page through staging pages; set \"interface_v1\": 1 in the extra config")

    def __repr__(self) -> str:
        where = self._tier.namespace if self._tier is not None else "no host pool yet"
        return f"KvtierStorage({self.url!r}, {where})"

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Check and adopt SGLang's host pool (`kvtier.store.sglang_pools`); an unsupported
        pool or layout raises `KvtierError` naming it."""
        kind = sglang_pools.pool_kind(mem_pool_host)
        pool_mla = kind == "MLATokenToKVPoolHost"
        if pool_mla != self.is_mla:
            raise fail("mem_pool_host", kind, f"storage_config.is_mla_model is {self.is_mla}; "
                       "the host pool must be of the same kind")
        host = sglang_pools.adopt(mem_pool_host)
        first, total = getattr(mem_pool_host, "start_layer", 0) or 0, self.identity["num_layers"]
        if (self.pp_size > 1 or self.identity["layer_split"] is not None) and total is None:
            raise fail("extra_config['num_layers']", None, "must be the model's layer count with pipeline "
                       "parallelism or a layer split (objects are named by their layers of the model's)")
        args = dict(model=self.model, revision=self.identity["revision"], tp=self.tp,
                    heads=self.identity["kv_heads"], scales=self.identity["kv_scales"],
                    kv_dtype=self.identity["kv_cache_dtype"],
                    layers=(first, total) if total is not None else None,
                    layer_split=self.identity["layer_split"], timeout_ms=self.timeout_ms)
        if self.identity["kv_cache_dtype"] is None and any(c.dtype == torch.uint8 for c in host.components.values()):
            self._warn("fp8", "the host pool keeps KV as uint8 (fp8), which does not say which fp8 format; "
                       "set \"kv_cache_dtype\" in the extra config (e.g. \"fp8_e4m3\") so that servers of "
                       "another fp8 format share no page")
        tier = StoreTier(host, self.engine, **args)
        super().register_mem_pool_host(mem_pool_host)
        self.host, self._tier, self._tier_args = host, tier, args
        self._legacy, self._stages = threading.local(), []
        log.info("kvtier HiCache storage: %s %s pages (%s) as %s on %s", kind, host.layout,
                 ", ".join(f"{n} {m}" for n, m in modes(tier.canonical).items()), tier.namespace, self.url)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """SGLang's batch v2 pools: the KV pool itself is accepted (it is the registered
        pool); any side pool (Mamba, SWA, indexer, draft) is refused by name, since this
        backend stores KV pages through the v1 calls only."""
        name = getattr(host_pool_name, "value", host_pool_name)
        if name == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            return
        raise fail("host_pool_name", name, "kvtier's HiCache backend stores the KV pool only (the "
                   "v1 interface); models with side pools need a backend with batch v2 calls")

    # ------------------------------------------------------------------ v1 calls
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        """How many leading ``keys`` are stored."""
        tier = self._need_tier()
        return self._safe("exists", 0, lambda: tier.exists(keys))

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        """Read pages into the host pages at ``host_indices``; True for the leading run
        read and verified."""
        tier = self._need_tier()
        start = time.perf_counter()
        n = self._safe("prefetch", 0, lambda: tier.prefetch(keys, host_indices))
        self._record(self._prefetch_pgs, self._prefetch_bw, len(keys), start)
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        """Store the host pages at ``host_indices`` under ``keys``; True where stored."""
        tier = self._need_tier()
        start = time.perf_counter()
        out = self._safe("backup", None, lambda: tier.backup(keys, host_indices))
        if out is None:
            out = [False] * len(keys)
        self._record(self._backup_pgs, self._backup_bw, len(keys), start)
        return out

    # ------------------------------------------------------------------ legacy calls
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        """Read ``key``'s page into ``target_location`` (a flat page as SGLang's
        ``get_dummy_flat_data_page`` makes it); the tensor, or None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """`get` of each key; None from the first miss on (the leading-run rule)."""
        stage = self._stage()
        keys, targets = _pairs("target_locations", keys, target_locations)
        targets = [stage.check(f"target_locations[{i}]", t, writable=True) for i, t in enumerate(targets)]
        out: List[Optional[torch.Tensor]] = [None] * len(keys)
        for a in range(0, len(keys), LEGACY_PAGES):
            ks = keys[a:a + LEGACY_PAGES]
            n = self._safe("prefetch", 0, lambda: stage.tier.prefetch(ks, stage.slots(len(ks))))
            for j in range(n):
                targets[a + j].copy_(stage.host.get_page(j * stage.host.page_size))
                out[a + j] = target_locations[a + j]
            if n < len(ks):
                break
        return out

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store ``value`` (a flat page as SGLang's ``get_data_page`` makes it) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """`set` of each key; True where every page was stored."""
        stage = self._stage()
        keys, values = _pairs("values", keys, values)
        pages = [stage.check(f"values[{i}]", v, writable=False) for i, v in enumerate(values)]
        ok = True
        for a in range(0, len(keys), LEGACY_PAGES):
            ks = keys[a:a + LEGACY_PAGES]
            for j, page in enumerate(pages[a:a + LEGACY_PAGES]):
                stage.host.set_page(j * stage.host.page_size, page)
            stored = self._safe("backup", None, lambda: stage.tier.backup(ks, stage.slots(len(ks))))
            ok = ok and stored is not None and all(stored)
        return ok

    # ------------------------------------------------------------------ the rest
    def clear(self) -> bool:
        """Removes nothing: the store holds the pages of every server and model sharing
        it, and engines have no "delete everything"; clear the store itself."""
        self._warn("clear", "clear() removes no pages: the store %s is shared; clear it with the "
                   "store's own tools (e.g. FLUSHDB, or delete the file store's directory)", self.url)
        return False

    def get_stats(self):
        """SGLang's `StorageMetrics` of the calls since the last get_stats (pages and GB/s
        per call, collected when SGLang enables storage metrics), with kvtier's counters
        (`counters`) as its ``kvtier`` attribute; None where SGLang's metrics module does
        not import."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception as e:
            self._warn("metrics", "SGLang's StorageMetrics does not import here (%s: %s); "
                       "get_stats returns None", type(e).__name__, e)
            return None
        m = StorageMetrics()
        with self._metrics_lock:
            m.prefetch_pgs.extend(self._prefetch_pgs)
            m.backup_pgs.extend(self._backup_pgs)
            m.prefetch_bandwidth.extend(self._prefetch_bw)
            m.backup_bandwidth.extend(self._backup_bw)
            for lst in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
                lst.clear()
        m.kvtier = self.counters()
        return m

    def counters(self) -> Dict[str, int]:
        """The tier's counters (hits, misses, timeouts, corrupt, stored, store_failed,
        ...; the legacy calls' included) and the engine's (``engine.get.hit``, ...)."""
        total: Counter = Counter()
        if self._tier is not None:
            total.update(self._tier.stats)
        with self._warn_lock:
            stages = list(self._stages)
        for stage in stages:
            total.update(stage.tier.stats)
        return {**total, **{f"engine.{k}": v for k, v in self.engine.stats.items()}}

    @property
    def tier(self) -> StoreTier:
        """The store tier over the registered host pool."""
        return self._need_tier()

    def store_keys(self, page_key: str) -> List[str]:
        """The keys of the objects of ``page_key`` this rank reads (`StoreTier.keys`)."""
        return self._need_tier().keys(page_key)

    def close(self) -> None:
        """Close the store's connections (later calls read as misses)."""
        self.engine.close()

    # ------------------------------------------------------------------ helpers
    def _need_tier(self) -> StoreTier:
        tier = self._tier
        if tier is None:
            raise fail("mem_pool_host", None, "register_mem_pool_host() must be called before any "
                       "storage call (SGLang does it when it attaches the backend)")
        return tier

    def _safe(self, op: str, default, call):
        """``call()``; bad arguments raise, anything else becomes ``default`` (a miss, a
        page not stored), logged once: no fault reaches SGLang's thread."""
        try:
            return call()
        except KvtierError:
            raise
        except Exception as e:
            self._warn(f"{op}.exception", "%s failed (%s: %s); reported as %s", op,
                       type(e).__name__, e, "misses" if op != "backup" else "not stored")
            return default

    def _record(self, pages: List[int], bandwidth: List[float], n: int, start: float) -> None:
        if not self._metrics or not n:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        gb = n * self._tier.host.page_bytes / (1 << 30)
        with self._metrics_lock:
            pages.append(n)
            bandwidth.append(gb / elapsed)

    def _stage(self) -> "_LegacyStage":
        tier = self._need_tier()
        stage = getattr(self._legacy, "stage", None)
        if stage is None:
            stage = self._legacy.stage = _LegacyStage(self, tier)
            with self._warn_lock:
                self._stages.append(stage)
        return stage

    def _warn(self, mode: str, message: str, *args) -> None:
        with self._warn_lock:
            if mode in self._warned:
                return
            self._warned.add(mode)
        log.warning("kvtier HiCache storage: " + message, *args)


class _LegacyStage:
    """One thread's staging pages for the legacy calls: a kvtier host pool of
    `LEGACY_PAGES` pages in the SGLang pool's layout and geometry (so SGLang's flat page
    is `HostPool.get_page`'s form), and a tier over it on the same engine and namespace."""

    def __init__(self, storage: KvtierStorage, tier: StoreTier):
        pool = storage.mem_pool_host
        if sglang_pools.pool_kind(pool) == "AsymmetricMHATokenToKVPoolHost":
            raise fail("mem_pool_host", "AsymmetricMHATokenToKVPoolHost",
                       "has no flat page (SGLang's get_data_page refuses it); use \"interface_v1\": 1")
        self.host = sglang_pools.scratch(pool, LEGACY_PAGES)
        self.tier = StoreTier(self.host, storage.engine, **storage._tier_args)
        assert self.tier.namespace == tier.namespace
        self._slots = torch.arange(LEGACY_PAGES * self.host.page_size, dtype=torch.int64)

    def slots(self, pages: int) -> torch.Tensor:
        return self._slots[:pages * self.host.page_size]

    def check(self, arg: str, t, writable: bool) -> torch.Tensor:
        """``t`` as a flat uint8 view of one page's bytes (a writable view for targets)."""
        nbytes = self.host.page_bytes
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" \
                or t.numel() * t.element_size() != nbytes:
            got = (tuple(t.shape), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise fail(arg, got, f"must be one flat page: a CPU tensor of {nbytes} bytes")
        if not t.is_contiguous():
            if writable:
                raise fail(arg, "non-contiguous tensor", "a page is read into it in place")
            t = t.contiguous()
        return t.reshape(-1).view(torch.uint8)


def _pairs(arg: str, keys, tensors):
    if isinstance(keys, (str, bytes)) or not isinstance(keys, (list, tuple)):
        raise fail("keys", type(keys).__name__, "must be a list of str keys")
    if not isinstance(tensors, (list, tuple)) or len(tensors) != len(keys):
        got = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise fail(arg, got, f"must be a list of {len(keys)} tensors, one per key")
    return list(keys), list(tensors)


def _config(storage_config) -> dict:
    """The extra config's own keys checked, and the storage config's shape refused
    where kvtier cannot serve it; every refusal names the field and its value."""
    fields = ("tp_rank", "tp_size", "pp_rank", "pp_size", "is_mla_model", "model_name", "extra_config")
    missing = [f for f in fields if not hasattr(storage_config, f)]
    if missing:
        raise fail("storage_config", type(storage_config).__name__,
                   f"must be SGLang's HiCacheStorageConfig (missing {missing})")
    if getattr(storage_config, "dcp_size", 1) != 1:
        raise fail("storage_config.dcp_size", storage_config.dcp_size,
                   "decode context parallelism is not supported (SGLang allows it for its file and "
                   "Mooncake backends only)")
    if getattr(storage_config, "attn_cp_size", 1) != 1:
        raise fail("storage_config.attn_cp_size", storage_config.attn_cp_size,
                   "attention context parallelism is not supported (each CP rank holds a slice of every page)")
    extra = storage_config.extra_config
    if not isinstance(extra, dict):
        raise fail("extra_config", extra, "must be a dict with at least \"url\" "
                   "(--hicache-storage-backend-extra-config)")
    unknown = sorted(k for k in extra if k not in OWN_KEYS + SGLANG_KEYS)
    if unknown:
        raise fail("extra_config", unknown, f"unknown key(s); kvtier reads {list(OWN_KEYS)}")
    url = extra.get("url")
    if not isinstance(url, str) or not url:
        raise fail("extra_config['url']", url, f"must be the store's URL: {URL_FORMS}")
    timeout = extra.get("timeout_ms", DEFAULT_TIMEOUT_MS)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise fail("extra_config['timeout_ms']", timeout, "must be a positive number of milliseconds")
    v1 = extra.get("interface_v1", 0)
    if v1 not in (0, 1) or isinstance(v1, float):
        raise fail("extra_config['interface_v1']", v1, "must be 1 (the zero-copy calls) or 0")
    model = extra.get("model", storage_config.model_name)
    if not isinstance(model, str) or not model:
        where = "extra_config['model']" if "model" in extra else "storage_config.model_name"
        raise fail(where, model, "must name the model (a non-empty str): pages are keyed by it; "
                   "set \"model\" in the extra config")
    out = {"url": url, "timeout_ms": timeout, "model": model, "interface_v1": bool(v1)}
    for key, kind, default, what in (("revision", str, None, "the model's revision (a non-empty str)"),
                                     ("kv_heads", int, None, "the model's KV heads (a positive int)"),
                                     ("num_layers", int, None, "the model's layer count (a positive int)"),
                                     ("kv_scales", str, "none", "the KV quantisation scale layout (a non-empty str)"),
                                     ("kv_cache_dtype", str, None, "SGLang's --kv-cache-dtype (a non-empty str)")):
        value = extra.get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, kind) or not value
                                     or (kind is int and value < 1)):
            raise fail(f"extra_config['{key}']", value, f"must be {what}")
        out[key] = value
    split = extra.get("layer_split")
    if split is not None and not ((type(split) is int and split > 0) or (
            isinstance(split, (list, tuple)) and split and all(type(x) is int for x in split))):
        raise fail("extra_config['layer_split']", split, "must be the store's layer boundaries (a list of "
                   "ints from 0 to num_layers) or a positive number of layers per object")
    out["layer_split"] = tuple(split) if isinstance(split, list) else split
    return out


__all__ = ["KvtierStorage"]
