"""What a pool stores, as data: one `Component` per per-layer buffer kind.

MHA pools hold K and V, MLA pools one latent row (or latent and rope split), and a
DSA/NSA indexer adds index_k rows and their fp32 scales with its own layer count.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch

from kvtier.kernels.errors import fail


@dataclass(frozen=True)
class Component:
    """One buffer kind: ``num_layers`` layers of rows shaped ``row_shape`` of ``dtype``."""

    name: str
    num_layers: int
    row_shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return math.prod(self.row_shape) * torch.empty(0, dtype=self.dtype).element_size()

    def mismatch(self, other: "Component"):
        """None when ``other`` holds the same rows, else (field, other's value, ours) for
        the first differing field, named as engines name it (dtype, head_num, head_dim)."""
        a, b = other.row_shape, self.row_shape
        for field, theirs, ours in (("dtype", other.dtype, self.dtype),
                                    ("head_num", a[:-1], b[:-1]),
                                    ("head_dim", a[-1], b[-1])):
            if theirs != ours:
                return field, theirs, ours
        return None


@dataclass(frozen=True)
class IndexerSpec:
    """A DSA/NSA indexer: per token ``index_head_dim`` bytes of index_k (fp8 stored as
    uint8) and ``scale_dim`` fp32 scales, for ``num_layers`` layers (the stage's first
    ``num_layers`` layers; it may be fewer than the model's)."""

    num_layers: int
    index_head_dim: int = 128
    scale_dim: int = 1
    dtype: torch.dtype = torch.uint8

    def components(self):
        return [Component("index_k", self.num_layers, (self.index_head_dim,), self.dtype),
                Component("index_scale", self.num_layers, (self.scale_dim,), torch.float32)]


def check_positive(**values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or v <= 0:
            raise fail(name, v, "must be a positive int")
