"""What the benchmark measures: a point's `Shape` as real pools of random bytes, built by
the autotuner's transfer builder (`kvtier.bench.pools.Pools`), and what one engine
prepared for one point.

A shape is a device pool (one tensor per layer and component, the CUDA pools' form)
and a host pool in one of the named host layouts; every slot of both moves, in
scattered page order. Each operation of `kvtier.kernels.ops.LABELS` is then a row copy
between two maps (`Workload.copy`), or the pools' own call (`Workload.transfer`):

- backup: device pool -> host pool, all layers
- load_layer: host pool -> device pool, the last layer
- load:   host pool -> device pool, all layers
- gather: device pool -> one contiguous device buffer, all layers
- scatter: one contiguous device buffer -> device pool, all layers
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from kvtier.autotune.shape import PoolShape
from kvtier.bench.pools import Pools
from kvtier.errors import fail
from kvtier.kernels.ops import LABELS

OPS = LABELS
HEAD_BYTES = 128      # one head's row in the page_head layout (64 bf16 elements)


@dataclass(frozen=True)
class Shape:
    components: int   # 2 for MHA (K and V), 1 for MLA
    layers: int
    row_bytes: int
    page_size: int
    tokens: int       # token slots moved per layer (the whole pool, in scattered page order)
    layout: str       # host layout (kvtier.kernels.layouts)

    def supported(self) -> Optional[str]:
        """None, or why this shape cannot be built."""
        if self.layout == "page_head" and self.row_bytes % HEAD_BYTES:
            return f"page_head needs rows made of {HEAD_BYTES}-byte heads"
        return "tokens must be whole pages" if self.tokens % self.page_size else None

    @property
    def row_dims(self) -> tuple:
        """(heads, head bytes): 128-byte heads where the row splits into them (page_head
        needs heads), else one head of the whole row (MLA's 576 and 656 B)."""
        return (self.row_bytes // HEAD_BYTES, HEAD_BYTES) if self.row_bytes % HEAD_BYTES == 0 else (1, self.row_bytes)

    def pool_shape(self) -> PoolShape:
        """The pools of this shape: byte rows, one tensor per layer on the device."""
        return PoolShape(self.layers, self.row_dims, self.components, torch.uint8, self.page_size, self.layout)


class Workload(Pools):
    """Random device and host pools for ``shape`` on ``device`` (CPU for smoke runs), every
    slot moved. ``alloc(shape, device, pinned) -> uint8 tensor`` supplies every buffer
    (tests carve them out of guarded allocations); ``strategy`` and ``check`` are the
    host pool's."""

    def __init__(self, shape: Shape, device: torch.device, seed: int = 0, alloc=None, *,
                 strategy: str = "auto", check: bool = False):
        why = shape.supported()
        if why:
            raise fail("shape", shape, why)
        super().__init__(shape.pool_shape(), shape.tokens, device, seed=seed, spare=1, alloc=alloc,
                         strategy=strategy, check=check)
        self.shape = shape


class Unsupported(Exception):
    """An engine cannot run this point (the message says why); the point is skipped."""


@dataclass
class Prepared:
    """A ready-to-time call of one engine on one point."""
    fn: object            # () -> None, enqueues one transfer
    programs: Optional[int] = None   # compute units the transfer occupies, where known
    # () -> RowCopy whose destination holds the last call's output, for engines that
    # write somewhere other than the workload's own destination (a pool's gather result)
    written: Optional[object] = None
