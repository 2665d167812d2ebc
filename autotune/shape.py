"""The KV pool shape a tuning run stands for (`PoolShape`), and what pools of it cost.

A description only: the pools themselves are built by whoever times them
(`kvtier.bench.pools.Pools`, the benchmark's and the `kvtier autotune` command's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from kvtier.errors import fail
from kvtier.kernels.layouts import host_layout

DEVICE_LAYOUTS = ("layers", "stacked")
COMPONENTS = (1, 2)     # MLA: one latent component; MHA: K and V


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
        host_layout(self.host_layout, "host_layout")
        if self.device_layout not in DEVICE_LAYOUTS:
            raise fail("device_layout", self.device_layout, f"must be one of {DEVICE_LAYOUTS}")
        if self.num_components not in COMPONENTS:
            raise fail("num_components", self.num_components, "must be 2 (MHA: K and V) or 1 (MLA)")
        for name in ("num_layers", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise fail(name, value, "must be a positive int")
        if len(self.row_dims) != 2 or min(self.row_dims) < 1:
            raise fail("row_dims", self.row_dims, "must be (heads, head_dim), both positive")

    @classmethod
    def mha(cls, layers: int, heads: int, head_dim: int, dtype=torch.bfloat16, **kw) -> "PoolShape":
        return cls(layers, (heads, head_dim), 2, dtype, **kw)

    @classmethod
    def mla(cls, layers: int, kv_lora_rank: int, rope_dim: int, dtype=torch.bfloat16, **kw) -> "PoolShape":
        return cls(layers, (1, kv_lora_rank + rope_dim), 1, dtype, **kw)

    @property
    def row_bytes(self) -> int:
        return self.row_dims[0] * self.row_dims[1] * self.dtype.itemsize

    def describe(self) -> str:
        kind = "MHA" if self.num_components == 2 else "MLA"
        return (f"{kind} L={self.num_layers} row={self.row_dims} {str(self.dtype).replace('torch.', '')} "
                f"({self.row_bytes} B) P={self.page_size} host={self.host_layout} device={self.device_layout}")


def pool_bytes(shape: PoolShape, tokens: int, *, layers: Optional[int] = None, spare: int = 2) -> int:
    """Bytes of each of the two pools `kvtier.bench.pools.Pools` builds for ``tokens`` (whole pages, ``spare``
    times over) of ``shape`` with ``layers`` (default its own): what a tool checks against
    the memory there is before building them."""
    P = shape.page_size
    slots = spare * -(-tokens // P) * P
    return (layers or shape.num_layers) * shape.num_components * slots * shape.row_bytes
