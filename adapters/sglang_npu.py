"""SGLang's Ascend call ``sgl_kernel_npu.kvcacheio.transfer_kv_dim_exchange``, on
kvtier's row copy.

The Ascend pools keep one contiguous multi-layer tensor per component:

- device ``(layers, pages, page_size, heads, head_dim)`` (layer first),
- host   ``(pages, layers, page_size, heads, head_dim)`` (``page_first_direct``),

and exchange the two leading dims while copying whole pages. Same names, keywords and
defaults as sgl_kernel_npu: token indices of whole pages, ``direction`` H2D (1, host to
device) or D2H (2), ``layer_start``/``layer_num`` (negative: all layers) over the K and V
layer space, and the optional DSA/NSA indexer cache (``index_k`` and its fp32 scales, a
4-D device scale tensor being padded to 5-D) in its own layer space
(``index_k_layer_start``/``index_k_layer_num``). Where sgl_kernel_npu issues one 2-D DMA
per page run, kvtier runs one row-copy launch per group of components; host memory must
be addressable by the device kernel (registered), as the core requires.

Stricter than sgl_kernel_npu on inputs it leaves undefined: every page's indices must be
a whole page (it reads only the first), a V or indexer pair must be given on both sides
or on neither (it silently skips a half-given pair), and both sides must hold one dtype.
"""
from __future__ import annotations

from enum import Enum
from typing import Optional

import torch

from kvtier.kernels.ops import Op

from .maps import copy_jobs, page_count
from kvtier.errors import as_arg, fail
from kvtier.kernels.rowmap import RowMap

__all__ = ["TransferDirection", "TransferFlag", "transfer_kv_dim_exchange",
           "transfer_kv_per_layer_dim_exchange"]


class TransferDirection(Enum):
    H2D = 1
    D2H = 2


class TransferFlag(Enum):
    FAST2D = 2


def _given(t) -> bool:
    return t is not None and not (isinstance(t, torch.Tensor) and t.numel() == 0)


def _pair(name: str, device, host, page_size: int):
    """(device map, host map) of one component, checked as sgl_kernel_npu checks them."""
    for side, t in (("device", device), ("host", host)):
        if not isinstance(t, torch.Tensor) or t.dim() != 5:
            raise fail(f"{side}_{name}", tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__,
                       "must be a 5-D tensor (device: layers, pages, page_size, heads, head_dim; "
                       "host: pages, layers, page_size, heads, head_dim)")
    if device.shape[0] != host.shape[1]:
        raise fail(f"host_{name}.shape", tuple(host.shape),
                   f"has {host.shape[1]} layers, device_{name} has {device.shape[0]}")
    if device.dtype != host.dtype:
        raise fail(f"host_{name}.dtype", host.dtype, f"differs from device_{name}.dtype={device.dtype}")
    if device.shape[3:] != host.shape[3:]:
        raise fail(f"host_{name}.shape", tuple(host.shape),
                   f"heads x head_dim differ from device_{name}'s {tuple(device.shape[3:])}")
    return (as_arg(f"device_{name}", RowMap.from_stacked, device, page_size=page_size, paged_dims=True),
            as_arg(f"host_{name}", RowMap.from_host_layout, host, "page_first_direct", page_size))


def _layer_range(start_arg: str, start, num, layers: int):
    """(start, count) of ``[start, start + num)``, ``num < 0`` meaning all layers."""
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise fail(start_arg, start, "must be a non-negative int")
    if not isinstance(num, int) or isinstance(num, bool) or num == 0:
        raise fail(start_arg.replace("start", "num"), num, "must be positive, or negative for all layers")
    count = layers if num < 0 else num
    if start + count > layers:
        raise fail(start_arg, start, f"layers {start}..{start + count - 1} exceed the {layers} layers held")
    return start, count


def transfer_kv_dim_exchange(
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    device_k: torch.Tensor,
    host_k: torch.Tensor,
    device_v: Optional[torch.Tensor],
    host_v: Optional[torch.Tensor],
    device_index_k: Optional[torch.Tensor] = None,
    host_index_k: Optional[torch.Tensor] = None,
    device_index_k_scale: Optional[torch.Tensor] = None,
    host_index_k_scale: Optional[torch.Tensor] = None,
    layer_start: int = 0,
    layer_num: int = -1,
    index_k_layer_start: Optional[int] = None,
    index_k_layer_num: Optional[int] = None,
    page_size: int = 128,
    direction=TransferDirection.H2D,
    flags=TransferFlag.FAST2D,
    *,
    config=None,
    check: Optional[bool] = None,
) -> None:
    """Copy whole pages between device ``(L, pages, P, H, D)`` and host
    ``(pages, L, P, H, D)`` buffers: for each page pair (``device_indices[i * P] // P``,
    ``host_indices[i * P] // P``) and each layer in the range, the page's ``P`` rows of
    K (and V, index_k, index_k_scale where given) move in ``direction``."""
    d = getattr(direction, "value", direction)     # an enum member (any with these values) or its int
    if not isinstance(d, int) or isinstance(d, bool) or d not in (1, 2):
        raise fail("direction", direction, "must be one of [1, 2] (or the enum member)")
    f = getattr(flags, "value", flags)
    if not isinstance(f, int) or isinstance(f, bool) or not f & TransferFlag.FAST2D.value:
        raise fail("flags", flags, "must include FAST2D (2), the only mode sgl_kernel_npu has")
    if not isinstance(page_size, int) or page_size <= 0:
        raise fail("page_size", page_size, "must be a positive int")
    for arg, idx in (("device_indices", device_indices), ("host_indices", host_indices)):
        if isinstance(idx, torch.Tensor):
            page_count(idx.numel(), page_size, arg)
    kv = [_pair("k", device_k, host_k, page_size)]
    if _given(device_v) != _given(host_v):
        raise fail("device_v" if not _given(device_v) else "host_v", None,
                   "V must be given on both sides or on neither")
    if _given(device_v):
        kv.append(_pair("v", device_v, host_v, page_size))
    jobs = [(kv, *_layer_range("layer_start", layer_start, layer_num, kv[0][0].num_layers))]
    indexer = []
    for name, dev, host in (("index_k", device_index_k, host_index_k),
                            ("index_k_scale", device_index_k_scale, host_index_k_scale)):
        if (dev is None) != (host is None):
            raise fail(f"device_{name}" if dev is None else f"host_{name}", None,
                       f"{name} must be given on both sides or on neither")
        if dev is not None:
            if name == "index_k_scale" and isinstance(dev, torch.Tensor) and dev.dim() == 4:
                dev = dev.unsqueeze(-1)   # (layers, pages, P, 1) as sgl_kernel_npu pads it
            indexer.append(_pair(name, dev, host, page_size))
    if indexer:
        start = 0 if index_k_layer_start is None else index_k_layer_start
        num = -1 if index_k_layer_num is None else index_k_layer_num
        jobs.append((indexer, *_layer_range("index_k_layer_start", start, num, indexer[0][0].num_layers)))
    # (pairs, start, count) -> (pairs oriented by direction, src_layer, dst_layer, num_layers)
    h2d = d == TransferDirection.H2D.value
    jobs = [([(h, dv) if h2d else (dv, h) for dv, h in pairs], start, start, count)
            for pairs, start, count in jobs]
    src_idx, dst_idx = (host_indices, device_indices) if h2d else (device_indices, host_indices)
    # A call that moves one layer is a per-layer transfer (HiCache's layer-wise load).
    op = Op("load" if h2d else "backup", "layer" if all(j[3] == 1 for j in jobs) else "all")
    copy_jobs(jobs, src_idx, dst_idx, op=op, by_page=True, config=config,
             check=check, index_names=("host_indices", "device_indices") if h2d
             else ("device_indices", "host_indices"))


def transfer_kv_per_layer_dim_exchange(
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    device_k: torch.Tensor,
    host_k: torch.Tensor,
    device_v: Optional[torch.Tensor],
    host_v: Optional[torch.Tensor],
    layer_id: int,
    device_index_k: Optional[torch.Tensor] = None,
    host_index_k: Optional[torch.Tensor] = None,
    device_index_k_scale: Optional[torch.Tensor] = None,
    host_index_k_scale: Optional[torch.Tensor] = None,
    index_k_layer_id: Optional[int] = None,
    page_size: int = 128,
    direction=TransferDirection.H2D,
    flags=TransferFlag.FAST2D,
    *,
    config=None,
    check: Optional[bool] = None,
) -> None:
    """One layer of `transfer_kv_dim_exchange`: K/V layer ``layer_id`` and, where
    ``index_k_layer_id`` is given, that indexer layer (skipped when it is None)."""
    with_indexer = index_k_layer_id is not None
    transfer_kv_dim_exchange(
        device_indices, host_indices, device_k, host_k, device_v, host_v,
        device_index_k if with_indexer else None, host_index_k if with_indexer else None,
        device_index_k_scale if with_indexer else None, host_index_k_scale if with_indexer else None,
        layer_start=layer_id, layer_num=1, index_k_layer_start=index_k_layer_id,
        index_k_layer_num=1, page_size=page_size, direction=direction, flags=flags,
        config=config, check=check)
