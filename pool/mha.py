"""MHA device pool: K and V rows per layer (v_head_dim may differ from head_dim), with
an optional DSA/NSA indexer."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .device import DevicePool, allocate
from .spec import Component, IndexerSpec, check_positive


class MHADevicePool(DevicePool):
    """Allocates ``size`` token slots of K ``(head_num, head_dim)`` and V
    ``(head_num, v_head_dim)`` rows for ``num_layers`` layers.

    ``storage="layers"`` keeps one tensor per layer (tables); ``"stacked"`` one
    ``(2, L, pages, P, H, D)`` tensor so that K and V move in one launch.
    """

    def __init__(self, size: int, page_size: int, num_layers: int, head_num: int, head_dim: int, *,
                 v_head_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16,
                 device="cpu", storage: str = "layers", start_layer: int = 0,
                 indexer: Optional[IndexerSpec] = None, factory=None):
        check_positive(num_layers=num_layers, head_num=head_num, head_dim=head_dim)
        v_head_dim = v_head_dim or head_dim
        comps = [Component("k", num_layers, (head_num, head_dim), dtype),
                 Component("v", num_layers, (head_num, v_head_dim), dtype)]
        comps += indexer.components() if indexer else []
        super().__init__(allocate(comps, size, page_size, storage, device, factory), page_size,
                         start_layer=start_layer, paged_dims=True)

    @classmethod
    def from_layers(cls, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor],
                    page_size: int, *, start_layer: int = 0, paged_dims: bool = False,
                    indexer_buffers: Optional[dict] = None) -> "MHADevicePool":
        """Adopt an engine's per-layer tensors, each ``(N, H, D)`` (or ``(pages, P, H, D)``
        with ``paged_dims``); ``indexer_buffers``: ``{"index_k": [...], "index_scale": [...]}``."""
        return cls._adopt({"k": list(k_layers), "v": list(v_layers), **(indexer_buffers or {})},
                          page_size, start_layer, paged_dims)

    @classmethod
    def from_stacked(cls, k: torch.Tensor, v: torch.Tensor, page_size: int, *, start_layer: int = 0,
                     paged_dims: bool = False, indexer_buffers: Optional[dict] = None) -> "MHADevicePool":
        """Adopt an engine's multi-layer tensors ``(L, N, H, D)`` (or ``(L, pages, P, H, D)``);
        K and V share a launch when they are two slices of one allocation."""
        return cls._adopt({"k": k, "v": v, **(indexer_buffers or {})}, page_size, start_layer, paged_dims)
