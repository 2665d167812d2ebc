"""Pool calls to time, built from real pools: what the autotuner measures and what the
benchmark times is the pools' own call, the one engines make.

A `PoolShape` (layers, components, row dims, dtype, page size, host and device layouts)
becomes `Pools`: a `kvtier.pool` device pool adopting random tensors (one per layer and
component, CUDA style, or one stacked buffer, Ascend style) and a `HostPool` in the named
host layout over random host memory (pinned on an accelerator, and registered where the
platform's kernels need it, as an engine's pool would be), with scattered device pages
and host slots, as a hierarchical cache allocates them.

`Pools.call(op)` (a `TimedCall`) is one operation of `kvtier.kernels.ops.LABELS`. Its
``runner(config)`` runs the pools' call for it (`HostPool` backup and loads, through
the kernel or the dma path with its runtime copies; `DevicePool` gather and scatter)
with ``config`` fixed on both pools (their ``config``), or under the pools' own lookup
when ``config`` is None. `RowCopy` says what a call moves, as
`copy_rows` takes it; its `mismatch` compares every destination row with its source row,
byte for byte.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

import kvtier.platforms as platforms
from kvtier.kernels import CopyConfig, RowMap
from kvtier.errors import fail
from kvtier.kernels.layouts import host_layout
from kvtier.autotune.shape import PoolShape
from kvtier.kernels.ops import Op
from kvtier.kernels.reference import layer_rows
from kvtier.kernels.validate import compute_device
from kvtier.pool import HostPool, MHADevicePool, MLADevicePool
from kvtier.pool.gather import contiguous_map, group_shape

POISON = 0xA5
# Components -> the device pool class an engine would adopt its tensors with.
_POOLS = {2: MHADevicePool, 1: MLADevicePool}


@dataclass(frozen=True)
class RowCopy:
    """One copy as `copy_rows` takes it: for every component and layer ``l < num_layers``,
    rows ``src_indices`` of layer ``src_layer + l`` of ``src`` go to rows ``dst_indices``
    of layer ``dst_layer + l`` of ``dst``."""
    src: RowMap
    src_indices: torch.Tensor
    dst: RowMap
    dst_indices: torch.Tensor
    src_layer: int
    dst_layer: int
    num_layers: int

    @property
    def nbytes(self) -> int:
        return self.src.num_components * self.num_layers * self.src_indices.numel() * self.src.row_bytes

    def mismatch(self, max_rows: Optional[int] = None) -> Optional[str]:
        """None when every destination row holds its source row, byte for byte, in every
        component and layer (at ``max_rows`` evenly spread indices; default: all), else
        where the first difference is. Waits for the device first: host rows are read
        directly."""
        platforms.synchronize(compute_device(self.src, self.dst))
        si, di = self.src_indices.cpu().long(), self.dst_indices.cpu().long()
        if max_rows is not None and si.numel() > max_rows:
            pick = torch.linspace(0, si.numel() - 1, max_rows).long()
            si, di = si[pick], di[pick]
        for c in range(self.src.num_components):
            for l in range(self.num_layers):
                got = rows_of(self.dst, c, self.dst_layer + l, di)
                want = rows_of(self.src, c, self.src_layer + l, si)
                if not torch.equal(got, want):
                    bad = int((got != want).any(1).nonzero()[0, 0])
                    return (f"component {c} layer {self.dst_layer + l} row {int(di[bad])}: "
                            f"destination differs from source row {int(si[bad])}")
        return None


def rows_of(m: RowMap, comp: int, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """The bytes of rows ``idx`` of one layer of one component, one row per line (a CPU copy)."""
    idx = idx.long().to(m.device)
    return layer_rows(m, comp, layer)[idx // m.page_size, idx % m.page_size].reshape(idx.numel(), -1).cpu()


def _plain(shape, device, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, device=device, pin_memory=pinned)


def scattered_slots(pool_pages: int, pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """The token slots of ``pages`` whole pages of a pool of ``pool_pages`` pages, the pages
    chosen and ordered at random (int64, CPU)."""
    chosen = torch.randperm(pool_pages, generator=gen)[:pages]
    return (chosen[:, None] * page_size + torch.arange(page_size)).flatten()


class Pools:
    """A device pool and a host pool of one `PoolShape`, filled with random bytes, and
    the slots every transfer moves: ``tokens`` (rounded up to whole pages) on each side,
    scattered over pools ``spare`` times as large.

    alloc: ``(shape, device, pinned) -> uint8 tensor`` supplies the pools' buffers and the
        gather destination (tests carve them out of guarded allocations).
    strategy, check: the HostPool's ("auto": the configuration's strategy; no index value
        checks, which cost a device sync per call).
    """

    def __init__(self, shape: PoolShape, tokens: int, device, *, seed: int = 0, spare: int = 2,
                 alloc=None, strategy: str = "auto", check: bool = False):
        for name, value in (("tokens", tokens), ("spare", spare)):
            if not isinstance(value, int) or value < 1:
                raise fail(name, value, "must be a positive int")
        self.pool_shape = shape
        self.device = torch.device(device)
        self.alloc = alloc or _plain
        P = shape.page_size
        pages = -(-tokens // P)
        self.tokens = pages * P
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self.device_pool = _device_pool(shape, spare * self.tokens, lambda s, d: self.random(s, d, self.device))
        self.host_pool = HostPool(self.device_pool, layout=shape.host_layout, size_tokens=spare * self.tokens,
                                  strategy=strategy, check=check, register=self.platform.register_host is not None,
                                  factory=lambda shape_, dtype, pin: self.random(shape_, dtype, "cpu", pin))
        if len(self.device_pool.groups) != 1 or len(self.host_pool.groups) != 1:
            raise fail("shape", shape.describe(), "components must share one launch")
        index_gen = torch.Generator().manual_seed(seed)
        self.device_slots = scattered_slots(spare * pages, pages, P, index_gen).to(self.device)
        self.host_slots = scattered_slots(spare * pages, pages, P, index_gen).to(self.device)
        self.rows = torch.arange(self.tokens, device=self.device)     # a contiguous buffer's rows
        self.by_page = P > 1          # gather and scatter take whole pages
        self._gather_buffer: Optional[torch.Tensor] = None
        self._scatter_source: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ buffers
    @property
    def platform(self):
        return platforms.of(self.device)

    def random(self, shape, dtype, device, pinned: bool = False) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` from ``alloc``, filled with random bytes."""
        t = self.empty(shape, dtype, device, pinned)
        self._randomize(t)
        return t

    def empty(self, shape, dtype, device, pinned: bool = False) -> torch.Tensor:
        """A ``shape`` tensor of ``dtype`` over a uint8 buffer from ``alloc``."""
        shape = tuple(shape)
        return self.alloc((*shape[:-1], shape[-1] * dtype.itemsize), device, pinned).view(dtype)

    def _randomize(self, t: torch.Tensor) -> None:
        """Random bytes made on the pools' device (fast on an accelerator), then copied
        where ``t`` lives."""
        b = t.view(torch.uint8)
        if b.device.type == self._gen.device.type:
            b.random_(0, 256, generator=self._gen)
        else:
            b.copy_(torch.empty(b.shape, dtype=torch.uint8, device=self._gen.device).random_(
                0, 256, generator=self._gen))

    @property
    def names(self) -> Tuple[str, ...]:
        return self.device_pool.groups[0][0]

    @property
    def device_map(self) -> RowMap:
        return self.device_pool.groups[0][1]

    @property
    def host_map(self) -> RowMap:
        return self.host_pool.groups[0][1]

    @property
    def host(self) -> torch.Tensor:
        """The host pool's buffer, ``(C, ...)`` in its layout."""
        return self.host_pool.groups[0][2]

    @property
    def device_layers(self) -> List[List[torch.Tensor]]:
        """Per component, one tensor per layer (views of a stacked buffer)."""
        bufs = self.device_pool.buffers
        return [[bufs[n][l] for l in range(self.pool_shape.num_layers)] for n in self.names]

    def _contiguous(self) -> Tuple[tuple, torch.dtype]:
        """Shape and dtype of a gather's result for this pool: ``(C, L, n, *row)``, or
        ``(C, L, n / P, P, *row)`` for whole pages."""
        return group_shape(self.device_pool, self.names, self.tokens, self.by_page), self.pool_shape.dtype

    @property
    def gather_buffer(self) -> torch.Tensor:
        """A fixed destination for gathers made by copies other than the pool's own (the
        pool returns a new buffer per call)."""
        if self._gather_buffer is None:
            shape, dtype = self._contiguous()
            self._gather_buffer = self.empty(shape, dtype, self.device)
        return self._gather_buffer

    @property
    def scatter_source(self) -> torch.Tensor:
        """Random rows to scatter, one tensor as `DevicePool.gather` returns it (so the pool
        scatters it without a copy, as it does a gather's result)."""
        if self._scatter_source is None:
            shape, dtype = self._contiguous()
            self._scatter_source = torch.empty(shape, dtype=dtype, device=self.device)
            self._randomize(self._scatter_source)
        return self._scatter_source

    def contiguous_map(self, t: torch.Tensor) -> RowMap:
        return contiguous_map(t, self.device_pool, self.by_page)

    # ------------------------------------------------------------------ operations
    def copy(self, op) -> RowCopy:
        """What ``op`` moves, as one copy between fixed buffers (a gather lands in
        `gather_buffer`); load_layer moves the last layer."""
        op = Op.parse(op)
        dev, host = (self.device_map, self.device_slots), (self.host_map, self.host_slots)
        src, dst = {"backup": (dev, host), "load": (host, dev),
                    "gather": (dev, (self.contiguous_map(self.gather_buffer), self.rows)),
                    "scatter": ((self.contiguous_map(self.scatter_source), self.rows), dev)}[op.name]
        L = self.pool_shape.num_layers
        first, count = (L - 1, 1) if op.scope == "layer" else (0, L)
        return RowCopy(*src, *dst, first, first, count)

    def tensors(self, op) -> Tuple[list, list]:
        """(source, destination) buffers of ``op``, whole."""
        dev = [t for layers in self.device_layers for t in layers]
        return {"backup": (dev, [self.host]), "load": ([self.host], dev), "gather": (dev, [self.gather_buffer]),
                "scatter": ([self.scatter_source], dev)}[Op.parse(op).name]

    def poison(self, op, outputs: Tuple[torch.Tensor, ...] = ()) -> None:
        """Fill every destination byte of ``op`` (and ``outputs``) with the poison byte and
        change every source byte (+1, wrapping): neither a destination a copy left alone
        nor bytes left over from an earlier run (a staging or result buffer the allocator
        hands out again) then passes verification. Waits for the device first, so that no
        copy still in flight lands after the poison."""
        platforms.synchronize(self.device)
        src, dst = self.tensors(op)
        for t in (*dst, *outputs):
            t.view(torch.uint8).fill_(POISON)
        for t in src:
            t.view(torch.uint8).add_(1)

    @property
    def kernels_reach(self) -> bool:
        """Whether kernels address the host pool's memory (where they do not, the pool
        moves every transfer with the dma strategy)."""
        return all(m.reachable_by(self.platform) for _, m, _ in self.host_pool.groups)

    def call(self, op) -> "TimedCall":
        return TimedCall(self, op)


def _device_pool(shape: PoolShape, slots: int, random):
    """The device pool an engine would build over its own tensors; ``random(shape, dtype)``
    makes them."""
    C, L, row = shape.num_components, shape.num_layers, shape.row_dims
    pool = _POOLS[C]
    if shape.device_layout == "stacked":
        buf = random((C, L, slots, *row), shape.dtype)
        return pool.from_stacked(*buf.unbind(0), shape.page_size)
    return pool.from_layers(*[[random((slots, *row), shape.dtype) for _ in range(L)] for _ in range(C)],
                            shape.page_size)


class TimedCall:
    """One operation on `Pools`, ready to run under any configuration.

    by_page: as the pools launch it (host layouts that index pages move whole pages;
    gather and scatter are given page indices where a page holds several slots)."""

    def __init__(self, pools: Pools, op):
        self.pools = pools
        self.op = Op.parse(op)
        self.copy = pools.copy(self.op)
        paged = host_layout(pools.pool_shape.host_layout).paged if self.op.crosses_link else True
        self.by_page = paged and pools.pool_shape.page_size > 1
        self.output: Optional[Dict[str, torch.Tensor]] = None   # gather: the last call's result
        P = pools.pool_shape.page_size
        self._units = pools.device_slots[::P] // P if pools.by_page else pools.device_slots

    @property
    def crosses_link(self) -> bool:
        return self.op.crosses_link

    @property
    def num_layers(self) -> int:
        return self.copy.num_layers

    @property
    def num_rows(self) -> int:
        return self.pools.tokens

    @property
    def nbytes(self) -> int:
        """Bytes one run moves."""
        return self.copy.nbytes

    def call(self) -> Callable[[], None]:
        """The pools' own call for this operation (as an engine makes it)."""
        p, units = self.pools, self._units
        host, dev, hi, di = p.host_pool, p.device_pool, p.host_slots, p.device_slots
        if self.op.name == "backup":
            return lambda: host.backup_from_device_all_layer(dev, hi, di)
        if self.op.scope == "layer":
            layer = dev.start_layer + self.copy.dst_layer
            return lambda: host.load_to_device_per_layer(dev, hi, di, layer)
        if self.op.name == "load":
            return lambda: host.load_to_device_all_layer(dev, hi, di)
        if self.op.name == "scatter":
            data = {n: t for n, t in zip(p.names, p.scatter_source.unbind(0))}
            return lambda: dev.scatter(units, data, pages=p.by_page)

        def gather():
            self.output = dev.gather(units, pages=p.by_page)
        return gather

    def runner(self, config: Optional[CopyConfig] = None) -> Callable[[], None]:
        """A callable that performs the transfer once: the pools' own call with ``config``
        fixed on both pools for every launch it makes (None: the configuration the pools look up). A
        kernel configuration across the link needs host memory kernels reach; where they
        do not, the pool would move it with the dma strategy, so it is refused."""
        call = self.call()
        if config is not None and config.strategy == "kernel" and self.crosses_link and not self.pools.kernels_reach:
            raise fail("config.strategy", config.strategy, self.pools.platform.unreachable)
        host, dev = self.pools.host_pool, self.pools.device_pool

        def run():
            host.config = dev.config = config      # the pools re-resolve only when it changes
            call()
        return run

    def written(self) -> Optional[RowCopy]:
        """What the last call moved: for a gather, into the pool's result (None before a
        call); otherwise `copy`."""
        if self.op.name != "gather":
            return self.copy
        if self.output is None:
            return None
        out = torch.stack([self.output[n] for n in self.pools.names])
        return replace(self.copy, dst=self.pools.contiguous_map(out))

    @property
    def src_tensors(self) -> list:
        return self.pools.tensors(self.op)[0]

    @property
    def dst_tensors(self) -> list:
        if self.op.name == "gather":
            return list(self.output.values()) if self.output else []
        return self.pools.tensors(self.op)[1]

    def poison(self) -> None:
        """Poison the destination (a gather's last result too) and change the source."""
        self.pools.poison(self.op, tuple(self.output.values()) if self.output else ())

    def verify(self) -> bool:
        """Whether every destination row of the last call holds its source row, bit for bit."""
        w = self.written()
        return w is not None and w.mismatch() is None


def build_call(shape: PoolShape, op: str, num_rows: int, device: torch.device,
               seed: int = 0) -> TimedCall:
    """``op`` moving ``num_rows`` rows (rounded up to whole pages) of every layer (load_layer:
    the last layer) and component of ``shape``, on pools of their own."""
    op = Op.parse(op)
    return Pools(shape, num_rows, device, seed=seed).call(op)
