"""The buffers and indices of one benchmark shape, described by kvtier row maps.

A shape is a device pool (one tensor per layer and component, the CUDA pools' form),
a host pool in one of the named host layouts, and scattered page indices on both
sides. Every operation is then a row copy between two of these maps:

- backup: device pool -> host pool, all layers
- load_layer: host pool -> device pool, one layer
- load:   host pool -> device pool, all layers
- gather:     device pool -> one contiguous device buffer (C, L, tokens, row), all layers
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvtier.kernels.ops import LABELS

from kvtier.kernels import RowMap
from kvtier.kernels.reference import layer_rows

OPS = tuple(op for op in LABELS if op != "scatter")   # kvtier.kernels.ops names
POISON = 0xA5
HEAD_BYTES = 128      # one head's row in the page_head layout (64 bf16 elements)


@dataclass(frozen=True)
class Shape:
    components: int   # 2 for MHA (K and V), 1 for MLA
    layers: int
    row_bytes: int
    page_size: int
    tokens: int       # token slots moved per layer (the whole pool, in scattered page order)
    layout: str       # host layout (kvtier.kernels.LAYOUTS)

    def supported(self) -> Optional[str]:
        """None, or why this shape cannot be built."""
        if self.layout == "page_head" and self.row_bytes % HEAD_BYTES:
            return f"page_head needs rows made of {HEAD_BYTES}-byte heads"
        if self.tokens % self.page_size:
            return "tokens must be whole pages"
        return None


@dataclass(frozen=True)
class Transfer:
    """One copy as copy_rows takes it."""
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


def _host_shape(s: Shape) -> tuple:
    n, L, P, R = s.tokens, s.layers, s.page_size, s.row_bytes
    return {
        "layer_first": (L, n, R),
        "page_first": (n, L, R),
        "page_first_direct": (n // P, L, P, R),
        "page_head": (n // P, R // HEAD_BYTES, P, L, HEAD_BYTES),
    }[s.layout]


def _plain(shape, device, pinned: bool) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.uint8, device=device, pin_memory=pinned)


def _random(shape, device, gen: torch.Generator, alloc, host_pinned: bool = False) -> torch.Tensor:
    """Random bytes made on ``device`` (fast on an accelerator); with ``host_pinned`` a
    pinned host copy of them."""
    t = alloc(shape, device, False) if not host_pinned else _plain(shape, device, False)
    t.random_(0, 256, generator=gen)
    if not host_pinned:
        return t
    host = alloc(shape, "cpu", True)
    host.copy_(t)
    return host


def scattered_slots(num_pages: int, page_size: int, gen: torch.Generator) -> torch.Tensor:
    """Every slot of the pool, whole pages in random order (int64, CPU)."""
    pages = torch.randperm(num_pages, generator=gen)
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


class Workload:
    """Random device and host pools for ``shape`` on ``device`` (CPU for smoke runs).
    ``alloc(shape, device, pinned) -> uint8 tensor`` supplies every buffer (tests carve
    them out of guarded allocations)."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0, alloc=_plain):
        why = shape.supported()
        if why:
            raise ValueError(f"{shape}: {why}")
        self.shape, self.device = shape, device
        gen = torch.Generator(device=device).manual_seed(seed)
        cpu_gen = torch.Generator().manual_seed(seed)
        C, L, P = shape.components, shape.layers, shape.page_size
        n, R = shape.tokens, shape.row_bytes
        self.alloc = alloc
        self.device_layers = [[_random((n, R), device, gen, alloc) for _ in range(L)] for _ in range(C)]
        self.device_map = RowMap.stack([RowMap.from_layers(ls, page_size=P) for ls in self.device_layers])
        self.host = _random((C,) + _host_shape(shape), device, gen, alloc, host_pinned=device.type != "cpu")
        self.host_map = RowMap.stack([RowMap.from_host_layout(self.host[c], shape.layout, P) for c in range(C)])
        if self.device_map is None or self.host_map is None:
            raise RuntimeError(f"{shape}: components cannot share a launch")
        self.device_slots = scattered_slots(n // P, P, cpu_gen).to(device)
        self.host_slots = scattered_slots(n // P, P, cpu_gen).to(device)
        self._gather = None

    @property
    def gather_buffer(self) -> torch.Tensor:
        if self._gather is None:
            s = self.shape
            self._gather = self.alloc((s.components, s.layers, s.tokens, s.row_bytes), self.device, False)
        return self._gather

    def transfer(self, op: str) -> Transfer:
        L = self.shape.layers
        if op == "backup":
            return Transfer(self.device_map, self.device_slots, self.host_map, self.host_slots, 0, 0, L)
        if op == "load_layer":
            layer = L - 1  # any layer; the last one has the largest offsets
            return Transfer(self.host_map, self.host_slots, self.device_map, self.device_slots, layer, layer, 1)
        if op == "load":
            return Transfer(self.host_map, self.host_slots, self.device_map, self.device_slots, 0, 0, L)
        if op == "gather":
            buf = self.gather_buffer
            dst = RowMap.stack([RowMap.from_stacked(buf[c], self.shape.page_size)
                                for c in range(self.shape.components)])
            out = torch.arange(self.shape.tokens, device=self.device)
            return Transfer(self.device_map, self.device_slots, dst, out, 0, 0, L)
        raise ValueError(f"op={op!r}: must be one of {OPS}")

    def destination_tensors(self, op: str):
        if op == "backup":
            return [self.host]
        if op == "gather":
            return [self.gather_buffer]
        return [t for ls in self.device_layers for t in ls]

    def poison(self, op: str) -> None:
        """Fill the destination of ``op`` with the poison byte, so that a copy that moves
        nothing (or the wrong rows) fails verification."""
        for t in self.destination_tensors(op):
            t.fill_(POISON)


def verify(t: Transfer, max_rows: int = 512) -> Optional[str]:
    """None if the destination rows equal the source rows (bytes) for every component and
    layer, at up to ``max_rows`` of the indices; else what differs."""
    n = t.src_indices.numel()
    pick = torch.linspace(0, n - 1, min(n, max_rows)).long()
    si, di = t.src_indices.cpu()[pick], t.dst_indices.cpu()[pick]
    for c in range(t.src.num_components):
        for l in range(t.num_layers):
            s = layer_rows(t.src, c, t.src_layer + l)
            d = layer_rows(t.dst, c, t.dst_layer + l)
            P, Q = t.src.page_size, t.dst.page_size
            got = d[(di // Q).to(d.device), (di % Q).to(d.device)].cpu().reshape(len(di), -1)
            want = s[(si // P).to(s.device), (si % P).to(s.device)].cpu().reshape(len(si), -1)
            if not torch.equal(got, want):
                bad = int((got != want).any(1).nonzero()[0, 0])
                return (f"component {c} layer {t.dst_layer + l} row {int(di[bad])}: "
                        f"destination differs from source row {int(si[bad])}")
    return None


class Unsupported(Exception):
    """An engine cannot run this point (the message says why); the point is skipped."""


@dataclass
class Prepared:
    """A ready-to-time call of one engine on one point."""
    fn: object            # () -> None, enqueues one transfer
    programs: Optional[int] = None   # compute units the transfer occupies, where known
    # () -> Transfer whose destination holds the last call's output, for engines that
    # write somewhere other than the workload's own destination (a pool's gather result)
    written: Optional[object] = None
