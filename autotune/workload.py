"""Transfers to time: row maps built from tensors of a pool's shape, and one callable
per configuration that performs the operation once.

A pool shape (layers, components, row dims, dtype, page size, host and device layouts)
gives device tensors (one per layer, CUDA style, or one stacked buffer, Ascend style)
and a host buffer in a named host layout. Device slots are scattered pages, host slots
are consecutive pages, as a hierarchical cache allocates them.

- kernel strategy: one `copy_rows` launch between the two maps.
- dma strategy: `copy_rows` gathers the device rows into a device staging buffer laid out
  like the host slice, and contiguous runs of it are copied across with bulk
  asynchronous copies (the reverse for loads). This is a self-contained timing routine;
  the pools own their production dma path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from kvtier import platforms as platform
from kvtier.kernels import CopyConfig, RowMap, copy_rows
from kvtier.kernels.reference import layer_rows
from kvtier.kernels.validate import compute_device

from kvtier.kernels.ops import Op

POISON = 0xA5

# Host layouts as data: shape of one component for (L, N tokens, P, row dims), the dim
# that indexes slots, and how many tokens one step along it holds.
_HOST_SHAPES = {
    "layer_first": (lambda L, N, P, row: (L, N, *row), 1, False),
    "page_first": (lambda L, N, P, row: (N, L, *row), 0, False),
    "page_first_direct": (lambda L, N, P, row: (N // P, L, P, *row), 0, True),
    "page_head": (lambda L, N, P, row: (N // P, row[0], P, L, row[1]), 0, True),
}


@dataclass(frozen=True)
class PoolShape:
    """The KV pool a tuning run stands for. MHA: two components (K, V) of rows
    (heads, head_dim); MLA: one component of rows (1, kv_lora_rank + rope_dim)."""
    num_layers: int
    row_dims: Tuple[int, int]
    num_components: int
    dtype: torch.dtype
    page_size: int = 1
    host_layout: str = "layer_first"
    device_layout: str = "layers"      # "layers": a tensor per layer; "stacked": one buffer

    def __post_init__(self):
        if self.host_layout not in _HOST_SHAPES:
            raise ValueError(f"host_layout={self.host_layout!r}: must be one of {sorted(_HOST_SHAPES)}")
        if self.device_layout not in ("layers", "stacked"):
            raise ValueError(f"device_layout={self.device_layout!r}: must be 'layers' or 'stacked'")
        for name in ("num_layers", "num_components", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be positive")
        if len(self.row_dims) != 2 or min(self.row_dims) < 1:
            raise ValueError(f"row_dims={self.row_dims!r}: must be (heads, head_dim), both positive")

    @classmethod
    def mha(cls, layers: int, heads: int, head_dim: int, dtype=torch.bfloat16, **kw) -> "PoolShape":
        return cls(layers, (heads, head_dim), 2, dtype, **kw)

    @classmethod
    def mla(cls, layers: int, kv_lora_rank: int, rope_dim: int, dtype=torch.bfloat16, **kw) -> "PoolShape":
        return cls(layers, (1, kv_lora_rank + rope_dim), 1, dtype, **kw)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_dims) * torch.empty(0, dtype=self.dtype).element_size()

    def describe(self) -> str:
        kind = "MHA" if self.num_components == 2 else "MLA"
        return (f"{kind} L={self.num_layers} row={self.row_dims} {str(self.dtype).replace('torch.', '')} "
                f"({self.row_bytes} B) P={self.page_size} host={self.host_layout} device={self.device_layout}")


@dataclass
class Transfer:
    """One operation on one pool shape, ready to run under any configuration."""
    op: str
    src: RowMap
    src_idx: torch.Tensor
    dst: RowMap
    dst_idx: torch.Tensor
    by_page: bool
    nbytes: int                         # bytes one run moves
    num_rows: int
    src_tensors: List[torch.Tensor] = field(repr=False, default_factory=list)
    dst_tensors: List[torch.Tensor] = field(repr=False, default_factory=list)
    # dma: the staging map, its indices and (destination, source) bulk-copy runs
    stage: Optional[RowMap] = None
    stage_idx: Optional[torch.Tensor] = None
    runs: List[Tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=list)

    @property
    def crosses_link(self) -> bool:
        return self.op.crosses_link

    @property
    def num_layers(self) -> int:
        return self.src.num_layers

    def runner(self, config: CopyConfig) -> Callable[[], None]:
        """A callable that performs the transfer once under ``config``."""
        if config.strategy == "kernel" or self.stage is None:
            return lambda: copy_rows(self.src, self.src_idx, self.dst, self.dst_idx,
                                     by_page=self.by_page, config=config, check=False)
        if self.op.from_device:
            def backup():
                copy_rows(self.src, self.src_idx, self.stage, self.stage_idx, by_page=self.by_page,
                          config=config, check=False)
                for host, staged in self.runs:
                    host.copy_(staged, non_blocking=True)
            return backup

        def load():
            for host, staged in self.runs:
                staged.copy_(host, non_blocking=True)
            copy_rows(self.stage, self.stage_idx, self.dst, self.dst_idx, by_page=self.by_page,
                      config=config, check=False)
        return load

    def poison(self) -> None:
        """Fill every destination byte with the poison pattern."""
        for t in self.dst_tensors:
            t.view(torch.uint8).fill_(POISON)

    def verify(self) -> bool:
        """Whether every destination row holds its source row (bit for bit); waits for
        the device first, since host rows are read directly."""
        platform.synchronize(compute_device(self.src, self.dst))
        for c in range(self.src.num_components):
            for layer in range(self.src.num_layers):
                if not torch.equal(rows_of(self.src, c, layer, self.src_idx).cpu(),
                                   rows_of(self.dst, c, layer, self.dst_idx).cpu()):
                    return False
        return True


def rows_of(m: RowMap, comp: int, layer: int, idx: torch.Tensor) -> torch.Tensor:
    """The bytes of rows ``idx`` of one layer of one component, one row per line (a copy)."""
    idx = idx.long().to(m.device)
    return layer_rows(m, comp, layer)[idx // m.page_size, idx % m.page_size].reshape(idx.numel(), -1)


def build_transfer(shape: PoolShape, op: str, num_rows: int, device: torch.device,
                   seed: int = 0) -> Transfer:
    """Tensors and maps for ``op`` moving ``num_rows`` rows (rounded up to whole pages)
    of every layer and component of ``shape``, source filled with random bytes."""
    op = Op.parse(op)
    P = shape.page_size
    n = -(-max(num_rows, 1) // P) * P
    gen = torch.Generator().manual_seed(seed)
    pages_dev = 2 * (n // P)            # twice the transfer, so device pages scatter
    dev_maps, dev_tensors = _device_pool(shape, pages_dev * P, device, gen)
    pages = torch.randperm(pages_dev, generator=gen)[: n // P]
    dev_idx = (pages[:, None] * P + torch.arange(P)).flatten().to(device)
    slots = torch.arange(n, device=device)
    if not op.crosses_link:
        buf = _random((shape.num_components, shape.num_layers, n, *shape.row_dims), shape.dtype, device, gen)
        other = RowMap.stack([RowMap.from_stacked(buf[c], P) for c in range(shape.num_components)])
        other_tensors = [buf]
    else:
        host = _random((shape.num_components, *_host_shape(shape, n)), shape.dtype, torch.device("cpu"),
                       gen, pin=device.type != "cpu")
        other = RowMap.stack([RowMap.from_host_layout(host[c], shape.host_layout, P)
                              for c in range(shape.num_components)])
        other_tensors = [host]
    if other is None:
        raise ValueError(f"{shape.describe()}: components cannot share one launch")
    forward = op.from_device
    src, si, dst, di = (dev_maps, dev_idx, other, slots) if forward else (other, slots, dev_maps, dev_idx)
    t = Transfer(op=op, src=src, src_idx=si, dst=dst, dst_idx=di, by_page=P > 1,
                 nbytes=n * shape.row_bytes * shape.num_layers * shape.num_components, num_rows=n,
                 src_tensors=dev_tensors if forward else other_tensors,
                 dst_tensors=other_tensors if forward else dev_tensors)
    if op.crosses_link:
        _add_staging(t, shape, n, other_tensors[0], device)
    return t


def _host_shape(shape: PoolShape, n: int) -> tuple:
    return _HOST_SHAPES[shape.host_layout][0](shape.num_layers, n, shape.page_size, shape.row_dims)


def _device_pool(shape: PoolShape, slots: int, device, gen):
    """Device maps (all components stacked into one map) and the tensors behind them."""
    C, L, P = shape.num_components, shape.num_layers, shape.page_size
    if shape.device_layout == "stacked":
        buf = _random((C, L, slots, *shape.row_dims), shape.dtype, device, gen)
        return RowMap.stack([RowMap.from_stacked(buf[c], P) for c in range(C)]), [buf]
    layers = [_random((slots, *shape.row_dims), shape.dtype, device, gen) for _ in range(C * L)]
    maps = [RowMap.from_layers(layers[c * L:(c + 1) * L], P) for c in range(C)]
    return RowMap.stack(maps), layers


def _random(shape, dtype, device, gen, pin=False) -> torch.Tensor:
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * item,), dtype=torch.uint8, generator=gen)
    if pin:
        raw = platform.pin(raw)
    return raw.to(device).view(dtype).view(shape)


def _add_staging(t: Transfer, shape: PoolShape, n: int, host: torch.Tensor, device) -> None:
    """Staging buffer on the device shaped like the host slice the transfer touches
    (host slots 0..n-1), and the contiguous runs between the two."""
    _, dim, paged = _HOST_SHAPES[shape.host_layout]
    stage = torch.empty((shape.num_components, *_host_shape(shape, n)), dtype=shape.dtype, device=device)
    t.stage = RowMap.stack([RowMap.from_host_layout(stage[c], shape.host_layout, shape.page_size)
                            for c in range(shape.num_components)])
    t.stage_idx = torch.arange(n, device=device)
    host_slice = host.narrow(dim + 1, 0, n // shape.page_size if paged else n)
    t.runs = list(_runs(host_slice, stage))


def _runs(a: torch.Tensor, b: torch.Tensor):
    """Pairs of views of ``a`` and ``b`` that are each contiguous, splitting leading dims."""
    if a.is_contiguous() and b.is_contiguous():
        yield a, b
        return
    for i in range(a.shape[0]):
        yield from _runs(a[i], b[i])
