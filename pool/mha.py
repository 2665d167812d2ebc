"""MHA device pool: K and V rows per layer (v_head_dim may differ from head_dim), with
an optional DSA/NSA indexer."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvtier.errors import fail

from .device import DevicePool, allocate
from .spec import (Component, IndexerSpec, check_device, check_dtype, check_indexer,
                   check_non_negative, check_positive)


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
        check_positive(size=size, page_size=page_size, num_layers=num_layers, head_num=head_num,
                       head_dim=head_dim)
        if v_head_dim is None:
            v_head_dim = head_dim
        else:
            check_positive(v_head_dim=v_head_dim)
        check_non_negative(start_layer=start_layer)
        check_dtype("dtype", dtype)
        check_indexer(indexer, num_layers)
        check_device("device", device, factory)
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
        k_layers = layer_list("k_layers", k_layers)
        v_layers = layer_list("v_layers", v_layers)
        if len(v_layers) != len(k_layers):
            raise fail("v_layers", f"{len(v_layers)} layers", f"k_layers has {len(k_layers)}; K and V "
                       "need one tensor per layer each")
        ind, args = checked_indexer_buffers(indexer_buffers, len(k_layers), per_layer=True)
        return cls._adopt({"k": k_layers, "v": v_layers, **ind}, page_size, start_layer, paged_dims,
                          {"k": "k_layers", "v": "v_layers", **args})

    @classmethod
    def from_stacked(cls, k: torch.Tensor, v: torch.Tensor, page_size: int, *, start_layer: int = 0,
                     paged_dims: bool = False, indexer_buffers: Optional[dict] = None) -> "MHADevicePool":
        """Adopt an engine's multi-layer tensors ``(L, N, H, D)`` (or ``(L, pages, P, H, D)``);
        K and V share a launch when they are two slices of one allocation."""
        layers = stacked_layers("k", k)
        if stacked_layers("v", v) != layers:
            raise fail("v", tuple(v.shape), f"k has {layers} layers ({tuple(k.shape)}); K and V need "
                       "the same layer count")
        ind, args = checked_indexer_buffers(indexer_buffers, layers, per_layer=False)
        return cls._adopt({"k": k, "v": v, **ind}, page_size, start_layer, paged_dims,
                          {"k": "k", "v": "v", **args})


INDEXER_NAMES = ("index_k", "index_scale")


def layer_list(arg: str, layers) -> list:
    """An engine's per-layer tensors as a list: a non-empty sequence of tensors."""
    out = None
    if not isinstance(layers, (torch.Tensor, str, bytes, dict)):
        try:
            out = list(layers)
        except TypeError:
            pass
    if not out:
        raise fail(arg, out if out is not None else type(layers).__name__,
                   "must be a non-empty list of per-layer tensors")
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor):
            raise fail(f"{arg}[{i}]", type(t).__name__, "must be a torch.Tensor")
    return out


def stacked_layers(arg: str, t) -> int:
    """The layer count of a stacked ``(L, ...)`` tensor."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1:
        raise fail(arg, type(t).__name__ if not isinstance(t, torch.Tensor) else tuple(t.shape),
                   "must be a multi-layer tensor (L, N, ...)")
    return t.shape[0]


def checked_indexer_buffers(buffers, num_layers: int, per_layer: bool):
    """``indexer_buffers`` checked: None, or a dict with exactly "index_k" and
    "index_scale", each for at most ``num_layers`` layers. Returns (buffers, arg names)."""
    if buffers is None:
        return {}, {}
    if not isinstance(buffers, dict) or set(buffers) != set(INDEXER_NAMES):
        got = sorted(map(str, buffers)) if isinstance(buffers, dict) else type(buffers).__name__
        raise fail("indexer_buffers", got, f"must be a dict with exactly the keys {list(INDEXER_NAMES)}")
    out, args, counts = {}, {}, {}
    for n in INDEXER_NAMES:
        arg = f"indexer_buffers[{n!r}]"
        out[n] = layer_list(arg, buffers[n]) if per_layer else buffers[n]
        counts[n] = len(out[n]) if per_layer else stacked_layers(arg, out[n])
        args[n] = arg
        if counts[n] > num_layers:
            raise fail(arg, f"{counts[n]} layers", f"an indexer covers at most the pool's {num_layers} layers")
    if counts["index_scale"] != counts["index_k"]:
        raise fail("indexer_buffers['index_scale']", f"{counts['index_scale']} layers",
                   f"index_k has {counts['index_k']}")
    return out, args
