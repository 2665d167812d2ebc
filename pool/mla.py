"""MLA device pool: one latent row per layer (kv_lora_rank + qk_rope_head_dim), or the
latent and rope parts split into two buffers as Ascend keeps them, with an optional
DSA/NSA indexer."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvtier.errors import fail

from .device import DevicePool, allocate
from .mha import checked_indexer_buffers, layer_list, stacked_layers
from .spec import (Component, IndexerSpec, check_bool, check_device, check_dtype, check_indexer,
                   check_non_negative, check_positive)


class MLADevicePool(DevicePool):
    """Allocates ``size`` token slots of MLA rows for ``num_layers`` layers: component
    "kv" ``(1, kv_lora_rank + qk_rope_head_dim)``, or with ``split=True`` "latent"
    ``(1, kv_lora_rank)`` and "rope" ``(1, qk_rope_head_dim)``."""

    def __init__(self, size: int, page_size: int, num_layers: int, kv_lora_rank: int,
                 qk_rope_head_dim: int, *, split: bool = False, dtype: torch.dtype = torch.bfloat16,
                 device="cpu", storage: str = "layers", start_layer: int = 0,
                 indexer: Optional[IndexerSpec] = None, factory=None):
        check_positive(size=size, page_size=page_size, num_layers=num_layers, kv_lora_rank=kv_lora_rank,
                       qk_rope_head_dim=qk_rope_head_dim)
        check_bool("split", split)
        check_non_negative(start_layer=start_layer)
        check_dtype("dtype", dtype)
        check_indexer(indexer, num_layers)
        check_device("device", device, factory)
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
        kv_layers = layer_list("kv_layers", kv_layers)
        if rope_layers is not None:
            rope_layers = layer_list("rope_layers", rope_layers)
            if len(rope_layers) != len(kv_layers):
                raise fail("rope_layers", f"{len(rope_layers)} layers",
                           f"kv_layers has {len(kv_layers)}; latent and rope need one tensor per layer each")
        ind, args = checked_indexer_buffers(indexer_buffers, len(kv_layers), per_layer=True)
        return cls._adopt(_named(kv_layers, rope_layers, ind), page_size, start_layer, paged_dims,
                          {"kv": "kv_layers", "latent": "kv_layers", "rope": "rope_layers", **args})

    @classmethod
    def from_stacked(cls, kv: torch.Tensor, page_size: int, *, rope: Optional[torch.Tensor] = None,
                     start_layer: int = 0, paged_dims: bool = False,
                     indexer_buffers: Optional[dict] = None) -> "MLADevicePool":
        """Adopt multi-layer tensors ``(L, N, 1, D)`` (or ``(L, pages, P, 1, D)``); with
        ``rope`` the first tensor is the latent part."""
        layers = stacked_layers("kv", kv)
        if rope is not None and stacked_layers("rope", rope) != layers:
            raise fail("rope", tuple(rope.shape), f"kv has {layers} layers ({tuple(kv.shape)}); latent "
                       "and rope need the same layer count")
        ind, args = checked_indexer_buffers(indexer_buffers, layers, per_layer=False)
        return cls._adopt(_named(kv, rope, ind), page_size, start_layer, paged_dims,
                          {"kv": "kv", "latent": "kv", "rope": "rope", **args})


def _named(main, rope, indexer):
    named = {"kv": main} if rope is None else {"latent": main, "rope": rope}
    return {**named, **indexer}
