"""MLA device pool: one latent row per layer (kv_lora_rank + qk_rope_head_dim), or the
latent and rope parts split into two buffers as Ascend keeps them, with an optional
DSA/NSA indexer."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .device import DevicePool, allocate
from .spec import Component, IndexerSpec, check_positive


class MLADevicePool(DevicePool):
    """Allocates ``size`` token slots of MLA rows for ``num_layers`` layers: component
    "kv" ``(1, kv_lora_rank + qk_rope_head_dim)``, or with ``split=True`` "latent"
    ``(1, kv_lora_rank)`` and "rope" ``(1, qk_rope_head_dim)``."""

    def __init__(self, size: int, page_size: int, num_layers: int, kv_lora_rank: int,
                 qk_rope_head_dim: int, *, split: bool = False, dtype: torch.dtype = torch.bfloat16,
                 device="cpu", storage: str = "layers", start_layer: int = 0,
                 indexer: Optional[IndexerSpec] = None, factory=None):
        check_positive(num_layers=num_layers, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim)
        if split:
            comps = [Component("latent", num_layers, (1, kv_lora_rank), dtype),
                     Component("rope", num_layers, (1, qk_rope_head_dim), dtype)]
        else:
            comps = [Component("kv", num_layers, (1, kv_lora_rank + qk_rope_head_dim), dtype)]
        comps += indexer.components() if indexer else []
        super().__init__(allocate(comps, size, page_size, storage, device, factory), page_size,
                         start_layer=start_layer, paged_dims=True)

    @classmethod
    def from_layers(cls, kv_layers: Sequence[torch.Tensor], page_size: int, *,
                    rope_layers: Optional[Sequence[torch.Tensor]] = None, start_layer: int = 0,
                    paged_dims: bool = False, indexer_buffers: Optional[dict] = None) -> "MLADevicePool":
        """Adopt per-layer tensors ``(N, 1, D)``; with ``rope_layers`` the first list is the
        latent part ("latent", "rope" components), else whole rows ("kv")."""
        return cls._adopt(_named(kv_layers, rope_layers, list, indexer_buffers), page_size,
                          start_layer, paged_dims)

    @classmethod
    def from_stacked(cls, kv: torch.Tensor, page_size: int, *, rope: Optional[torch.Tensor] = None,
                     start_layer: int = 0, paged_dims: bool = False,
                     indexer_buffers: Optional[dict] = None) -> "MLADevicePool":
        """Adopt multi-layer tensors ``(L, N, 1, D)`` (or ``(L, pages, P, 1, D)``); with
        ``rope`` the first tensor is the latent part."""
        return cls._adopt(_named(kv, rope, lambda t: t, indexer_buffers), page_size, start_layer, paged_dims)


def _named(main, rope, form, indexer_buffers):
    named = {"kv": form(main)} if rope is None else {"latent": form(main), "rope": form(rope)}
    return {**named, **(indexer_buffers or {})}
