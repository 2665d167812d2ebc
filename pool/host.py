"""Host KV pool (HiCache's host tier): pinned host memory in a named layout, packing a
target model's device pool and its draft models' pools, with a page allocator and
backup / load methods named as in SGLang's HiCache.

Ordering rules (CUDA/ROCm/NPU): every method enqueues its work on the caller's current
stream and returns before the bytes have moved. See docs/pools.md, ordering rules.
"""
from __future__ import annotations

import math
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

import kvtier.platforms as platforms
from kvtier.config import STRATEGIES as LINK_STRATEGIES
from kvtier.errors import fail
from kvtier.kernels import RowMap, faults
from kvtier.kernels.index_check import Checks
from kvtier.kernels.layouts import host_layout
from kvtier.kernels.ops import BACKUP, LOAD, LOAD_LAYER, Op
from kvtier.kernels.staging import stage
from kvtier.kernels.transfer import Copy, Transfer
from kvtier.kernels.validate import check_index, index_ok, is_int

from . import tuning
from .allocator import PageAllocator
from .device import DevicePool
from .dma import DmaMove
from .spec import Component

_CPU = torch.device("cpu")

STRATEGIES = ("auto",) + LINK_STRATEGIES   # "auto": the tuned configuration decides


class GroupPair(NamedTuple):
    """One host buffer group paired with the device pool's matching map: what one copy of
    a transfer moves (K and V share one where both sides hold them together)."""

    names: Tuple[str, ...]
    dev_map: RowMap
    host_map: RowMap
    host_buf: torch.Tensor      # (C, ...) in the host layout, the components of this pair
    num_layers: int             # the device pool's layers of these components
    host_layer: int             # where the device pool's layer 0 sits in the host buffer


class PoolTransfers:
    """Everything a host pool moves between itself and one device pool, prepared once
    (`HostPool.transfers`, for the packed pools, made with the host pool): the backup and
    the load of every layer (the target pool's packed drafts included) and the load of
    each layer, by the device pool's own layer index. Each is a `Transfer` whose steps
    are resolved per size class of the index lists and kept in it."""

    __slots__ = ("device_pool", "start_layer", "backup", "load", "layers")

    def __init__(self, host: "HostPool", device_pool: DevicePool, every: Sequence[Tuple[int, DevicePool]],
                 own: Tuple[int, DevicePool]):
        self.device_pool, self.start_layer = device_pool, device_pool.start_layer
        self.backup = host._prepare(BACKUP, every, None)
        self.load = host._prepare(LOAD, every, None)
        self.layers = [host._prepare(LOAD_LAYER, (own,), layer) for layer in range(device_pool.num_layers)]


class HostPool:
    """Host memory for ``device_pools`` (target first, then drafts: their layers are
    packed after the target's), sized in tokens or in GB (10^9 bytes).

    layout: "layer_first" | "page_first" | "page_first_direct" | "page_head".
    strategy: "kernel", "dma" or "auto" (per transfer, as the tuned configuration says;
        "dma" wherever kernels cannot address the buffers: unpinned memory, or unregistered
        memory on Ascend).
    pin_memory: default True when the device pools live on an accelerator.
    check: validate index values (ranges, whole pages) without waiting for the device:
        host indices at once, device indices by a check kernel whose verdict the copies
        read (a bad call moves nothing; the error is raised at the next call or at
        `synchronize()`, see `kvtier.kernels.index_check`). None: ``KVTIER_CHECK`` (on).
    factory: ``(shape, dtype, pin) -> tensor`` to supply host memory (registered memory,
        shared memory); default ``torch.empty``.
    register: make the host buffers reachable by kernels where the platform needs it
        (Ascend: ``aclrtHostRegister``, mapped; unregistered when freed), so that "auto"
        may pick the kernel strategy. Elsewhere a no-op: pinned memory is device-addressable.
    """

    def __init__(self, device_pools: Union[DevicePool, Sequence[DevicePool]], *,
                 layout: str = "layer_first", size_tokens: Optional[int] = None,
                 size_gb: Optional[float] = None, pin_memory: Optional[bool] = None,
                 strategy: str = "auto", check: Optional[bool] = None, factory=None,
                 register: bool = False):
        # Every argument is checked here, before any host memory is allocated.
        pools = [device_pools] if isinstance(device_pools, DevicePool) else (
            list(device_pools) if isinstance(device_pools, (list, tuple)) else [])
        if not pools or not all(isinstance(p, DevicePool) for p in pools):
            raise fail("device_pools", device_pools, "must be a DevicePool or a list of them (target first)")
        for i, p in enumerate(pools):
            if any(p is q for q in pools[:i]):
                raise fail(f"device_pools[{i}]", p, "is listed twice (each pool's layers are packed once)")
        if not isinstance(layout, str):
            raise fail("layout", layout, "must be a layout name (str): layer_first, page_first, "
                       "page_first_direct or page_head")
        self._layout = host_layout(layout)
        if not isinstance(strategy, str) or strategy not in STRATEGIES:
            raise fail("strategy", strategy, f"must be one of {STRATEGIES}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise fail("pin_memory", pin_memory, "must be True, False or None (the default)")
        if check is not None and not isinstance(check, bool):
            raise fail("check", check, "must be True, False or None (follow KVTIER_CHECK)")
        if not isinstance(register, bool):
            raise fail("register", register, "must be True or False")
        if factory is not None and not callable(factory):
            raise fail("factory", factory, "must be a callable (shape, dtype, pin) -> tensor, or None")
        target = pools[0]
        for i, p in enumerate(pools[1:], 1):
            _check_rows(f"device_pools[{i}]", p, target)
        self.pools, self.layout, self.strategy, self._check = pools, layout, strategy, check
        self.page_size = target.page_size
        self.device = target.device
        # Host layers per component: each pool's layers, target first.
        self.offsets: List[Dict[str, int]] = []
        totals = {n: 0 for n in target.components}
        for p in pools:
            self.offsets.append(dict(totals))
            for n, c in p.components.items():
                totals[n] += c.num_layers
        self.components = {n: Component(n, totals[n], c.row_shape, c.dtype) for n, c in target.components.items()}
        self.size = self._size(size_tokens, size_gb)
        self._size_given = ("size_gb", size_gb) if size_gb is not None else ("size_tokens", size_tokens)
        if pin_memory is None:
            pin_memory = self.device.type != "cpu"
        elif pin_memory and factory is None and not platforms.accelerator_present():
            raise fail("pin_memory", pin_memory, "pinning host memory needs an accelerator runtime; "
                       "none is present (pass False, or None for the default)")
        self.pin_memory = pin_memory
        factory = factory or (lambda shape, dtype, pin: torch.empty(shape, dtype=dtype, pin_memory=pin))
        self._build_buffers(pools, factory)
        self._platform = platforms.of(self.device)
        self.registered = bool(register and self._platform.register_host)
        if self.registered:
            for _, _, buf in self.groups:
                self._platform.register_host(buf)
        # Whether kernels reach these buffers (pinned under UVA; registered on Ascend):
        # where they do not, "auto" takes the dma strategy.
        self._kernel_reaches = all(m.reachable_by(self._platform) for _, m, _ in self.groups)
        self.allocator = PageAllocator(self.size, self.page_size)
        self._cpu_pool = self.device.type == "cpu"
        self._by_page = self._layout.paged and self.page_size > 1   # page layouts move whole pages
        self._index_page = self.page_size if self._layout.paged else 1   # indices come in whole pages
        # The transfers with each packed pool, prepared now (target first: an all-layer call
        # with the target moves every packed pool; each draft alone moves only itself).
        every = tuple(enumerate(pools))
        self.transfers: Tuple[PoolTransfers, ...] = tuple(
            PoolTransfers(self, p, every if i == 0 else ((i, p),), (i, p)) for i, p in every)

    # ------------------------------------------------------------------ construction
    def _size(self, size_tokens, size_gb) -> int:
        """Token slots from exactly one of ``size_tokens`` and ``size_gb`` (10^9 bytes),
        rounded down to whole pages; errors name the argument the caller passed."""
        if (size_tokens is None) == (size_gb is None):
            raise fail("size_tokens, size_gb", (size_tokens, size_gb), "give exactly one of the two")
        page_bytes = self.bytes_per_token * self.page_size
        if size_gb is not None:
            if isinstance(size_gb, bool) or not isinstance(size_gb, (int, float)) \
                    or not math.isfinite(size_gb) or size_gb <= 0:
                raise fail("size_gb", size_gb, "must be a finite positive number (10^9 bytes)")
            tokens = int(size_gb * 1e9) // self.bytes_per_token
            _fits_in_memory("size_gb", size_gb, tokens * self.bytes_per_token)
            if tokens < self.page_size:
                raise fail("size_gb", size_gb, f"holds {tokens} tokens; one page of {self.page_size} "
                           f"tokens needs {page_bytes} bytes ({page_bytes / 1e9:.3g} GB)")
            return tokens // self.page_size * self.page_size
        if not is_int(size_tokens) or size_tokens < self.page_size:
            raise fail("size_tokens", size_tokens, f"must be an int holding at least one page of "
                       f"{self.page_size} tokens")
        _fits_in_memory("size_tokens", size_tokens, size_tokens * self.bytes_per_token)
        return size_tokens // self.page_size * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return sum(c.row_bytes * c.num_layers for c in self.components.values())

    def _build_buffers(self, pools, factory) -> None:
        """One host tensor per group of components with equal rows and equal layer counts
        in every packed pool (K and V: one ``(2, ...)`` tensor, one host map)."""
        buckets: Dict[tuple, List[str]] = {}
        for n, c in self.components.items():
            per_pool = tuple(p.components[n].num_layers for p in pools)
            buckets.setdefault((c.row_shape, c.dtype, per_pool), []).append(n)
        self.groups: List[Tuple[Tuple[str, ...], RowMap, torch.Tensor]] = []
        self.maps: Dict[str, RowMap] = {}
        self.buffers: Dict[str, torch.Tensor] = {}
        for (row, dtype, _), names in buckets.items():
            c = self.components[names[0]]
            shape = (len(names), *self._layout.shape(layers=c.num_layers, slots=self.size,
                                                      page_size=self.page_size, row_shape=row))
            try:
                buf = factory(shape, dtype, self.pin_memory)
            except (RuntimeError, MemoryError) as e:     # the allocator's own refusal, named
                arg, value = self._size_given
                raise fail(arg, value, f"allocating {shape} {dtype} host memory failed: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            if tuple(buf.shape) != shape or buf.dtype != dtype or not buf.is_contiguous():
                raise fail("factory", (tuple(buf.shape), buf.dtype), f"must return a contiguous {shape} {dtype} tensor")
            maps = [RowMap.from_host_layout(buf[i], self.layout, self.page_size) for i in range(len(names))]
            self.maps.update(zip(names, maps))
            self.buffers.update({n: buf[i] for i, n in enumerate(names)})
            self.groups.append((tuple(names), RowMap.stack(maps), buf))

    # The configuration every transfer of this pool launches with (None: the tuned one).
    config = tuning.FixedConfig()

    @property
    def check(self) -> Optional[bool]:
        """Whether calls check their index values (None: ``KVTIER_CHECK``, on)."""
        return self._check

    @check.setter
    def check(self, check: Optional[bool]) -> None:
        if check is not None and not isinstance(check, bool):
            raise fail("check", check, "must be True, False or None (follow KVTIER_CHECK)")
        self._check = check
        for t in self.transfers:
            for transfer in (t.backup, t.load, *t.layers):
                transfer.check = check

    def __repr__(self) -> str:
        return (f"HostPool({self.layout}, size={self.size}, page_size={self.page_size}, "
                f"{len(self.pools)} device pool(s), strategy={self.strategy}, pinned={self.pin_memory})")

    # ------------------------------------------------------------------ allocator
    def alloc(self, need_size: int, owner=None) -> Optional[torch.Tensor]:
        """Host slots of whole pages (see `PageAllocator.alloc`; ``owner`` guards `free`)."""
        return self.allocator.alloc(need_size, owner=owner)

    def free(self, indices: torch.Tensor, owner=None) -> int:
        return self.allocator.free(indices, owner=owner)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def clear(self) -> None:
        self.allocator.clear()

    # ------------------------------------------------------------------ transfers
    def backup_from_device_all_layer(self, device_pool, host_indices: torch.Tensor,
                                     device_indices: torch.Tensor) -> None:
        """Device -> host, every layer of every component. Passing the target pool moves
        the packed draft pools' layers too (they share the target's token slots)."""
        t, h = self._prepared(device_pool, host_indices, device_indices, BACKUP)
        t.backup.launch(device_indices, h, host_indices)

    def load_to_device_all_layer(self, device_pool, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor) -> None:
        """Host -> device, every layer (target pool: drafts too)."""
        t, h = self._prepared(device_pool, host_indices, device_indices, LOAD)
        t.load.launch(h, device_indices, host_indices)

    def load_to_device_per_layer(self, device_pool, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, layer_id: int) -> None:
        """Host -> device for model layer ``layer_id`` of ``device_pool`` only (layer-wise
        overlap with the forward pass). Indexer rows move for layers that have them."""
        t, h = self._prepared(device_pool, host_indices, device_indices, LOAD_LAYER)
        local = layer_id - t.start_layer if type(layer_id) is int else -1
        if not 0 <= local < len(t.layers):
            t.device_pool.local_layer(layer_id)         # (names what is wrong)
        t.layers[local].launch(h, device_indices, host_indices)

    def _prepared(self, device_pool, host_indices, device_indices, op: Op) -> Tuple[PoolTransfers, torch.Tensor]:
        """``device_pool``'s prepared transfers (`transfers_for`, as an identity scan) and the
        host list where the copy runs: both lists' shapes checked first (`_check_shapes`),
        a CPU list staged on the device without waiting (inside the graph while one is
        captured: `_captured`)."""
        for t in self.transfers:
            if t.device_pool is device_pool:
                break
        else:
            t = self._stand_in(device_pool)
        dev = self.device
        if self._cpu_pool:
            if not (type(host_indices) is torch.Tensor and type(device_indices) is torch.Tensor
                    and index_ok(host_indices, dev) and index_ok(device_indices, dev)
                    and host_indices.numel() == device_indices.numel() and self._index_page == 1):
                self._check_shapes(t.device_pool, host_indices, device_indices)
            return t, host_indices
        if platforms.capturing():       # a CPU host list staged by a copy the graph captures
            return t, self._captured(t, host_indices, device_indices, op)
        self._check_shapes(t.device_pool, host_indices, device_indices)
        return t, (host_indices if host_indices.device == dev else stage(host_indices, dev, "host_indices"))

    def _captured(self, t: PoolTransfers, host_indices, device_indices, op: Op) -> torch.Tensor:
        """`_prepared` while a CUDA graph is captured: a CPU host list is staged on the device
        by a copy the graph captures (from pinned memory only: `stage`), so that each replay
        checks and moves the values it stages then; the dma strategy cannot be captured."""
        if type(host_indices) is torch.Tensor and host_indices.is_cpu:
            if not index_ok(host_indices, _CPU):
                check_index("host_indices", host_indices, _CPU)
            host_indices = stage(host_indices, self.device, "host_indices")
        self._check_shapes(t.device_pool, host_indices, device_indices)
        n = device_indices.numel()
        transfer = t.backup if op is BACKUP else t.load if op is LOAD else None
        transfers = [transfer] if transfer is not None else t.layers
        if n and any(s.launch is None for tr in transfers for s in tr.steps(n).all):
            raise fail("strategy", "dma", "cannot be captured in a CUDA graph: it plans its copies from the "
                       "host indices' values on the host, which a replay would not see; use strategy='kernel'")
        return host_indices

    def _stand_in(self, device_pool) -> PoolTransfers:
        """The transfers with a device pool this host pool does not pack, standing in for
        the target (the same components, rows, layers and page size): prepared for this
        call, kept nowhere."""
        if not isinstance(device_pool, DevicePool):
            raise fail("device_pool", type(device_pool).__name__, "must be a DevicePool")
        _check_rows("device_pool", device_pool, self.pools[0], layers=True)
        return PoolTransfers(self, device_pool, ((0, device_pool),), (0, device_pool))

    # ------------------------------------------------------------------ preparation
    def _prepare(self, op: Op, slots: Sequence[Tuple[int, DevicePool]], local: Optional[int]) -> Transfer:
        """The `Transfer` of ``op`` between this pool and the device pools ``slots`` names
        ((packed index, pool) pairs; another pool standing in for the target takes index
        0), over every layer or, with ``local``, that layer of the device pool: one copy
        per host group and device map (`_pairs`), every copy's configuration and strategy
        resolved per size class (`_resolve_for`)."""
        copies, moved = [], []      # (each copy's host group pair and device layer, for its dma mover)
        for slot, pool in slots:
            for pair in self._pairs(slot, pool):
                if local is None:
                    dev_layer, count = 0, pair.num_layers
                elif local < pair.num_layers:
                    dev_layer, count = local, 1
                else:
                    continue    # an indexer with fewer layers than the model
                host_layer = pair.host_layer + dev_layer
                if op.from_device:
                    copies.append(Copy(pair.dev_map, pair.host_map, dev_layer, host_layer, count, self._by_page))
                else:
                    copies.append(Copy(pair.host_map, pair.dev_map, host_layer, dev_layer, count, self._by_page))
                moved.append((pair, dev_layer, host_layer, count))
        limit = min(pool.size for _, pool in slots)
        host, dev = ("host_indices", self.size, self._index_page), ("device_indices", limit, self._index_page)
        checks = Checks(dev, host) if op.from_device else Checks(host, dev)

        def dma_move(i: int, config, strategy: str) -> DmaMove:
            pair, dev_layer, host_layer, count = moved[i]
            return DmaMove(op, pair.dev_map, pair.host_buf, self.layout, self.page_size, dev_layer, host_layer,
                           count, self._by_page, config, self.size)
        return Transfer(copies, device=self.device, checks=checks, check=self.check,
                        resolve=tuning.resolver(op, lambda: self.config, self._strategy), bulk=dma_move,
                        epoch=tuning.EPOCH, op=op)

    def _pairs(self, slot: int, pool: DevicePool) -> List[GroupPair]:
        """Per host group: one pair with the pool's matching group map, else one pair per
        component (the pool keeps those components in separate allocations)."""
        dev_groups = {names: m for names, m in pool.groups}
        pairs = []
        for names, host_map, buf in self.groups:
            layers = pool.components[names[0]].num_layers
            off = self.offsets[slot][names[0]]
            if names in dev_groups:
                pairs.append(GroupPair(names, dev_groups[names], host_map, buf, layers, off))
            else:
                pairs.extend(GroupPair((n,), pool.maps[n], self.maps[n], buf[i:i + 1], layers, off)
                             for i, n in enumerate(names))
        return pairs

    # ------------------------------------------------------------------ batch plans
    def plan(self, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor) -> "TransferPlan":
        """One batch's transfers between this pool and ``device_pool`` at these index lists,
        planned once (flashinfer's plan/run): the lists are copied (later writes to the
        caller's tensors cannot reach the plan) and checked once, then
        `TransferPlan.load_layer`, `load` and `backup` only launch. See `TransferPlan`."""
        from .plan import TransferPlan
        return TransferPlan(self, device_pool, host_indices, device_indices)

    def transfers_for(self, device_pool) -> PoolTransfers:
        """The prepared transfers with ``device_pool``: a packed pool's, else ones prepared
        for a pool standing in for the target (kept by the caller only)."""
        for t in self.transfers:
            if t.device_pool is device_pool:
                return t
        return self._stand_in(device_pool)

    def _strategy(self, config) -> str:
        return self.strategy if self.strategy != "auto" else (config.strategy if self._kernel_reaches else "dma")

    # ------------------------------------------------------------------ checks
    def _check_shapes(self, device_pool, host_indices, device_indices) -> None:
        """Both lists' shapes, at once: int32/int64, 1-D, strided, host indices on the CPU
        or the pool's device, device indices on the pool's device, equal counts."""
        # Host indices live on the host or where the copy runs; device indices where it runs.
        if not (type(host_indices) is torch.Tensor
                and index_ok(host_indices, _CPU if host_indices.is_cpu else self.device)):
            check_index("host_indices", host_indices, host_indices.device
                        if isinstance(host_indices, torch.Tensor) and host_indices.is_cpu else self.device)
        if not index_ok(device_indices, device_pool.index_device):
            check_index("device_indices", device_indices, device_pool.index_device)
        n = host_indices.numel()
        if n != device_indices.numel():
            raise fail("device_indices", f"{device_indices.numel()} indices",
                       f"host_indices has {n}; counts must match")
        if self._index_page > 1 and n % self._index_page:
            raise fail("len(host_indices)", n, f"page-granular copy needs a multiple of page_size={self._index_page}")

    def synchronize(self) -> None:
        """Wait for the device and raise the first index failure a device-side check of
        this thread's calls found (the check point after the last call)."""
        faults.synchronize(self.device)

    # ------------------------------------------------------------------ pages
    def get_page(self, index: int) -> torch.Tensor:
        """The bytes of the page starting at host slot ``index``, all layers and
        components, as one flat uint8 tensor (in the host layout's order)."""
        from .pages import get_page
        return get_page(self, index)

    def set_page(self, index: int, data: torch.Tensor) -> None:
        """Write a `get_page` result into the page starting at host slot ``index``."""
        from .pages import set_page
        set_page(self, index, data)

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    def get_page_buffer_meta(self, indices: torch.Tensor):
        """(addresses, sizes) of every contiguous region of the pages at ``indices``
        (page-aligned host slots, page_size per page), page by page."""
        from .pages import get_page_buffer_meta
        return get_page_buffer_meta(self, indices)


def _fits_in_memory(arg: str, value, nbytes: int) -> None:
    """Refuse a pool larger than this machine's physical memory before allocating it
    (pinned memory cannot exceed it, and an overcommitted pageable buffer would fail only
    when touched)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):    # not known here: the allocator decides
        return
    if nbytes > total:
        raise fail(arg, value, f"needs {nbytes / 1e9:.3g} GB of host memory; this machine has "
                   f"{total / 1e9:.3g} GB")


def _check_rows(arg: str, pool: DevicePool, target: DevicePool, layers: bool = False) -> None:
    """``pool`` must hold the target's components with the same rows (and, standing in
    for the target, the same layer counts and page size)."""
    if set(pool.components) != set(target.components):
        raise fail(f"{arg}.components", sorted(pool.components), f"the host pool holds {sorted(target.components)}")
    if pool.page_size != target.page_size:
        raise fail(f"{arg}.page_size", pool.page_size, f"the host pool uses {target.page_size}")
    for n, c in target.components.items():
        bad = c.mismatch(pool.components[n])
        if bad:
            raise fail(f"{arg}.{n}.{bad[0]}", bad[1], f"the host pool holds {bad[2]}")
        if layers and pool.components[n].num_layers != c.num_layers:
            raise fail(f"{arg}.{n}.layer_num", pool.components[n].num_layers,
                       f"the host pool holds {c.num_layers} layers for this pool")
