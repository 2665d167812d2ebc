"""Host KV pool (HiCache's host tier): pinned host memory in a named layout, packing a
target model's device pool and its draft models' pools, with a page allocator and
backup / load methods named as in SGLang's HiCache.

Ordering rules (CUDA/ROCm/NPU): every method enqueues its work on the caller's current
stream and returns before the bytes have moved. See docs/pools.md, ordering rules.
"""
from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

import kvtier.platforms as platforms
from kvtier.autotune.key import rows_bucket
from kvtier.kernels import RowMap
from kvtier.kernels.config import STRATEGIES as LINK_STRATEGIES
from kvtier.kernels.errors import fail
from kvtier.kernels.layouts import host_layout
from kvtier.kernels.ops import BACKUP, LOAD, LOAD_LAYER, Op
from kvtier.kernels import faults
from kvtier.bounded import Bounded
from kvtier.kernels.copy_rows import BY_VERDICT, UNCHECKED, direct_launches, run
from kvtier.kernels.index_check import Checks, check_launch, checks_on
from kvtier.kernels.staging import on_device
from kvtier.kernels.storage_watch import check_storage, watch
from kvtier.kernels.validate import check_index, index_ok, is_int

from . import dma
from .allocator import PageAllocator
from .device import DevicePool
from . import launch as launcher
from .launch import DEBUG, bind_launch, lookup, lookup_state
from .spec import Component

if TYPE_CHECKING:
    from .plan import TransferPlan

_CPU = torch.device("cpu")

STRATEGIES = ("auto",) + LINK_STRATEGIES   # "auto": the tuned configuration decides


@dataclass(frozen=True)
class Move:
    """One launch of a transfer: a device map and the host map (and buffer) it pairs with."""

    names: Tuple[str, ...]
    dev_map: RowMap
    host_map: RowMap
    host_buf: torch.Tensor      # (C, ...) in the host layout, the components of this move
    num_layers: int             # the device pool's layers of these components
    host_layer: int             # where the device pool's layer 0 sits in the host buffer


@dataclass(frozen=True)
class Step:
    """One launch of a call shape's steps: a move over a layer range, with its
    configuration and strategy; ``bound`` is the kernel strategy's bound copy (None for
    dma)."""

    move: Move
    dev_layer: int
    host_layer: int
    count: int
    config: object
    strategy: str
    bound: object
    watch: object       # what `check_storage` compares before the call's first launch
    sides: tuple        # the addresses each call passes the bound copy (`BoundCopy.sides`)
    maps: tuple         # (source, destination) maps, for the torch reference


_SHAPES_PER_POOL = 256      # call shapes whose steps a host pool keeps per device pool


class _LastCall(NamedTuple):
    """The last call's shape (op, device pool, row count, lookup state), the steps of
    that shape found so far by layer, and its lists' checks: a layer loop's next layer
    and the next all-layer call of that shape find theirs here in one comparison."""

    op: Op
    pool: object
    n: int
    state: tuple
    steps_by_layer: dict
    checks: Checks


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
        self.pools, self.layout, self.strategy, self.check = pools, layout, strategy, check
        # What _resolve answers: every (slot, pool), and each alone.
        self._every = tuple(enumerate(pools))
        self._each = tuple(((i, p),) for i, p in self._every)
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
        self._moves: Dict[int, List[Move]] = {}
        # Steps per call shape (see _steps_of): for the packed pools, and per other pool
        # that stands in for the target (dropped with that pool).
        self._shape_steps = Bounded(_SHAPES_PER_POOL)
        self._other_shape_steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._last_call: Optional[_LastCall] = None
        self._dma_host_maps: Dict[tuple, RowMap] = {}
        self._cpu_pool = self.device.type == "cpu"
        self._by_page = self._layout.paged and self.page_size > 1   # page layouts move whole pages
        self._index_page = self.page_size if self._layout.paged else 1   # indices come in whole pages

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
        self._transfer(BACKUP, device_pool, host_indices, device_indices, None)

    def load_to_device_all_layer(self, device_pool, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor) -> None:
        """Host -> device, every layer (target pool: drafts too)."""
        self._transfer(LOAD, device_pool, host_indices, device_indices, None)

    def load_to_device_per_layer(self, device_pool, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, layer_id: int) -> None:
        """Host -> device for model layer ``layer_id`` of ``device_pool`` only (layer-wise
        overlap with the forward pass). Indexer rows move for layers that have them."""
        self._transfer(LOAD_LAYER, device_pool, host_indices, device_indices, layer_id)

    def _transfer(self, op: Op, device_pool, host_indices, device_indices, layer_id) -> None:
        whole = op.scope == "all"
        slots = self._resolve(device_pool, whole=whole)
        local = None if whole else slots[0][1].local_layer(layer_id)   # checked before anything moves
        capturing = not self._cpu_pool and platforms.capturing()
        if capturing:
            host_indices = self._staged_for_capture(host_indices)
        self._check_shapes(slots, host_indices, device_indices)
        n = device_indices.numel()
        if n == 0:
            faults.raise_pending()
            return
        steps, checks = self._steps(op, device_pool, local, n, slots)
        if capturing and any(step.bound is None for step in steps):
            raise fail("strategy", "dma", "cannot be captured in a CUDA graph: it plans its copies from the "
                       "host indices' values on the host, which a replay would not see; use strategy='kernel'")
        checks = checks if checks_on(self.check) else None
        h = host_indices if self._cpu_pool else on_device(host_indices, self.device, "host_indices")
        si, di = (device_indices, h) if op.from_device else (h, device_indices)
        if all(step.bound is not None for step in steps):
            self._log(op, steps, n)
            run([step.bound for step in steps], [step.sides for step in steps], si, di, checks, self.device,
                lambda: [step.maps for step in steps])
            return
        faults.raise_pending()
        verdict = None
        if checks is not None:
            # (the bulk copies' runs are planned from the values: checked with them, once per values)
            self._runs(host_indices, True)
            kernel = [step for step in steps if step.bound is not None]
            verdict = check_launch(self.device, checks, si, di, [s.bound for s in kernel], [s.sides for s in kernel],
                                   direct=direct_launches())
            if self._cpu_pool:
                faults.raise_pending(this_call=True)
        self._launch(op, steps, host_indices, device_indices, si, di, verdict, n, checks is not None)

    def _steps(self, op: Op, device_pool, local, n: int, slots):
        """(the steps of this call shape, its lists' checks), every tensor they rest on
        checked to be where it was (`check_storage`) before the first byte moves. The
        steps of the last call's op, pool, count and lookup state are kept by layer: the
        next all-layer call of that shape, or the layer loop's next layer, finds its own."""
        state, last = lookup_state(), self._last_call
        if not (last is not None and last.op is op and last.pool is device_pool and last.n == n
                and last.state == state):
            last = self._last_call = _LastCall(op, device_pool, n, state, {}, self._checks_for(op, slots))
        steps = last.steps_by_layer.get(local)
        if steps is None:
            steps = last.steps_by_layer[local] = self._steps_of(op, device_pool, local, n, slots, state)
        for step in steps:
            check_storage(step.watch)
        return steps, last.checks

    def _runs(self, host_indices, checked: bool):
        """The runs of consecutive host units the dma path plans its bulk copies from (the
        values checked first: ``checked``), kept by the values (`dma.runs`)."""
        return dma.runs(host_indices.cpu(), self.page_size if self._layout.paged else 1,
                        (self.size, self._index_page) if checked else None)

    def _launch(self, op: Op, steps, host_indices, device_indices, si, di, verdict, n: int,
                checked: bool) -> None:
        """Every step of a call whose lists were checked (``verdict``: the words of the
        check launch every step reads; None: checked on the host, or checks off): kernel
        steps at ``si``, ``di``, dma steps at the device list and the host list's runs
        (``checked``: the runs found with the host list's values checked)."""
        self._log(op, steps, n)
        run_list = None
        for step in steps:
            if step.bound is not None:
                step.bound(si, di, step.sides, BY_VERDICT if verdict is not None else UNCHECKED,
                           verdict if verdict is not None else si)
                continue
            if run_list is None:
                run_list = self._runs(host_indices, checked)
            move = dma.backup if op.from_device else dma.load
            mv = step.move
            move(op, mv.dev_map, device_indices, mv.host_buf, self.layout, self.page_size, step.dev_layer,
                 step.host_layer, step.count, run_list, self._by_page, step.config, verdict, self._host_map(mv))

    # ------------------------------------------------------------------ batch plans
    def plan(self, device_pool, host_indices: torch.Tensor, device_indices: torch.Tensor) -> "TransferPlan":
        """One batch's transfers between this pool and ``device_pool`` at these index lists,
        planned once (flashinfer's plan/run): the lists are copied (later writes to the
        caller's tensors cannot reach the plan) and checked once, then
        `TransferPlan.load_layer`, `load` and `backup` only launch. See `TransferPlan`."""
        from .plan import TransferPlan
        return TransferPlan(self, device_pool, host_indices, device_indices)

    def _log(self, op: Op, steps, n: int) -> None:
        """One DEBUG line per kernel step (the dma path's staging copies log their own)."""
        if launcher.log.isEnabledFor(DEBUG):
            for step in steps:
                if step.bound is not None:
                    launcher.log_launch(op, step.strategy, step.config, n, n * step.bound.op_bytes)

    def _checks_for(self, op: Op, slots) -> Checks:
        """The value checks of this pool's lists for ``op`` on the pools ``slots`` names:
        device indices below the smallest pool's slots, host indices below the host
        pool's, both in whole pages where the layout moves pages."""
        limit = slots[0][1].size if len(slots) == 1 else min(pool.size for _, pool in slots)
        host, dev = ("host_indices", self.size, self._index_page), ("device_indices", limit, self._index_page)
        return Checks.of(dev, host) if op.from_device else Checks.of(host, dev)

    def _staged_for_capture(self, host_indices):
        """While a CUDA graph is captured, host indices on the CPU are staged on the device
        first (a copy the graph captures, from pinned memory only: `on_device`), so that
        each replay checks and moves the values it stages then."""
        if type(host_indices) is not torch.Tensor or not host_indices.is_cpu:
            return host_indices
        if not index_ok(host_indices, _CPU):
            check_index("host_indices", host_indices, _CPU)
        return on_device(host_indices, self.device, "host_indices")

    def _steps_of(self, op: Op, device_pool, local, n: int, slots, state) -> List["Step"]:
        """The steps of one call shape (op, device pool, layer, rows bucket, lookup
        ``state``): kept by the host pool for its packed pools, under the device pool's
        weak reference for any other (nothing here keeps a device pool alive)."""
        if any(device_pool is p for p in self.pools):
            by_shape = self._shape_steps
        else:
            by_shape = self._other_shape_steps.get(device_pool)
            if by_shape is None:
                by_shape = self._other_shape_steps[device_pool] = Bounded(_SHAPES_PER_POOL)
        return by_shape.get_or_make((op, local, rows_bucket(n), state), lambda: self._make_steps(op, local, n, slots))

    def _make_steps(self, op: Op, local, n: int, slots) -> List["Step"]:
        """The launches of one call shape, worked out once: each move's layer range, tuned
        configuration and strategy, and for the kernel strategy its bound copy and the
        addresses each call passes it."""
        steps = []
        whole = (self._index_page, self._index_page)
        for slot, pool in slots:
            for mv in self._moves_for(slot, pool):
                if local is None:
                    dev_layer, count = 0, mv.num_layers
                elif local < mv.num_layers:
                    dev_layer, count = local, 1
                else:
                    continue    # an indexer with fewer layers than the model
                host_layer = mv.host_layer + dev_layer
                config = lookup(op, mv.dev_map, mv.host_map, n, count)
                strategy = self._strategy(config)
                src, dst = (mv.dev_map, mv.host_map) if op.from_device else (mv.host_map, mv.dev_map)
                sl, dl = (dev_layer, host_layer) if op.from_device else (host_layer, dev_layer)
                bound = sides = None
                if strategy == "kernel":
                    bound = bind_launch(op, src, dst, src_layer=sl, dst_layer=dl, num_layers=count, n_rows=n,
                                        by_page=self._by_page, config=config, whole=whole)
                    sides = bound.sides(src, dst)
                watched = watch(mv.dev_map, dev_layer, count) + watch(mv.host_map, host_layer, count)
                steps.append(Step(mv, dev_layer, host_layer, count, config, strategy, bound, watched, sides,
                                  (src, dst)))
        return steps

    def _strategy(self, config) -> str:
        if self.strategy != "auto":
            return self.strategy
        return config.strategy if self._kernel_reaches else "dma"

    def _host_map(self, mv: Move) -> RowMap:
        """The move's host buffer as one map of unit rows (the dma path's bad-verdict fill
        reads the host rows through it)."""
        key = (mv.names, self._layout.paged)
        m = self._dma_host_maps.get(key)
        if m is None:
            unit = self.page_size if self._layout.paged else 1
            m = self._dma_host_maps[key] = RowMap.stack(
                [RowMap.from_host_layout(mv.host_buf[c], self.layout, unit) for c in range(mv.host_buf.shape[0])])
        return m

    # ------------------------------------------------------------------ resolution and checks
    def _resolve(self, device_pool, whole: bool) -> Sequence[Tuple[int, DevicePool]]:
        """(packed slot, pool) pairs a call moves: the target moves every packed pool
        for all-layer calls; another pool with the target's rows stands in for it."""
        for i, p in self._every:
            if p is device_pool:
                return self._every if i == 0 and whole else self._each[i]
        if not isinstance(device_pool, DevicePool):
            raise fail("device_pool", type(device_pool).__name__, "must be a DevicePool")
        _check_rows("device_pool", device_pool, self.pools[0], layers=True)
        return ((0, device_pool),)

    def _check_shapes(self, slots, host_indices, device_indices) -> None:
        """Both lists' shapes, at once: int32/int64, 1-D, strided, host indices on the CPU
        or the pool's device, device indices on the pool's device, equal counts."""
        # Host indices live on the host or where the copy runs; device indices where it runs.
        if not (type(host_indices) is torch.Tensor
                and index_ok(host_indices, _CPU if host_indices.is_cpu else self.device)):
            check_index("host_indices", host_indices, host_indices.device
                        if isinstance(host_indices, torch.Tensor) and host_indices.is_cpu else self.device)
        for _, pool in slots:
            if not index_ok(device_indices, pool.index_device):
                check_index("device_indices", device_indices, pool.index_device)
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

    def _moves_for(self, slot: int, pool: DevicePool) -> List[Move]:
        """Per host group: one move with the pool's matching group map, else one move per
        component (the pool keeps those components in separate allocations). Kept for
        the packed pools (a pool standing in for the target gets its steps kept weakly)."""
        packed = any(pool is p for p in self.pools)
        moves = self._moves.get(slot) if packed else None
        if moves is not None:
            return moves
        dev_groups = {names: m for names, m in pool.groups}
        moves = []
        for names, host_map, buf in self.groups:
            layers = pool.components[names[0]].num_layers
            off = self.offsets[slot][names[0]]
            if names in dev_groups:
                moves.append(Move(names, dev_groups[names], host_map, buf, layers, off))
            else:
                moves.extend(Move((n,), pool.maps[n], self.maps[n], buf[i:i + 1], layers, off)
                             for i, n in enumerate(names))
        if packed:
            self._moves[slot] = moves
        return moves

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
