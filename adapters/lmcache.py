"""LMCache's multi-layer KV transfer (``lmcache.c_ops.multi_layer_kv_transfer``), CUDA
and Ascend forms, on kvtier's row copy (docs/engines/lmcache.md: the call, the address
of every row in each form, what does not move through kvtier).

LMCache moves one chunk of tokens between the engine's paged KV cache and one of its
memory objects, every layer in one call: ``key_value`` is the memory object,
``[2, num_layers, num_tokens, hidden]`` (K then V; ``[1, ...]`` with ``use_mla``);
``key_value_ptrs`` the paged side as an int64 table of per-layer base addresses;
``slot_mapping[t]`` token ``t``'s slot in every layer (negative: skipped);
``page_buffer_size`` the slots in one layer; ``direction`` True moves paged ->
``key_value`` (a store), False the reverse. Slot ``s`` of plane ``k`` in layer ``l`` is
at ``ptrs[l] + (k * page_buffer_size + s) * row`` (CUDA and Ascend ``MERGED_KV``),
``ptrs[l] + s * row`` (MLA); Ascend's ``SEPARATE_KV`` and ``MLA_KV`` take two table
entries per layer, and as a kvtier extension ``key_value_ptrs`` may list contiguous
multi-layer tensors, addressed by base and strides without a table.

Each call ends in one `EngineCall` (one launch per group of components that can share
one). Where the memory objects and the paged cache belong to a registered buffer set
(`kvtier.adapters.registry.register`), each call kind's is prepared once and kept by the
registration; elsewhere it is prepared for the call. Differences from LMCache, all on
inputs it leaves undefined: ``slot_mapping`` may be int32 and may live on another device
(it is moved); its slots are range-checked against ``page_buffer_size`` without a device
sync; its length must equal the chunk's ``num_tokens``; rows move whole even where they
are not a multiple of 8 bytes.
"""
from __future__ import annotations

from enum import Enum
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from kvtier.errors import as_arg, fail
from kvtier.kernels.iota import iota
from kvtier.kernels.ops import BACKUP, GATHER, LOAD, SCATTER
from kvtier.kernels.rowmap import RowMap
from kvtier.kernels.validate import compute_device

from . import registry
from .maps import EngineCall, plain

__all__ = ["KVCacheFormat", "multi_layer_kv_transfer"]


class KVCacheFormat(Enum):
    """LMCache-Ascend's ``KVCacheFormat`` values (``kvcache_format_raw``) kvtier moves."""

    MERGED_KV = 1
    SEPARATE_KV = 2
    MLA_KV = 3


class _Comp(NamedTuple):
    """One component of a transfer: ``plane`` of ``key_value`` at byte ``col`` of its row,
    ``width`` bytes; on the paged side table entry ``entry`` of a layer, slots from byte
    ``offset`` of that entry."""

    plane: int
    col: int
    width: int
    entry: int
    offset: int


def _paged_to_lmcache(direction) -> bool:
    """LMCache's flag (True: paged -> key_value), or a ``TransferDirection`` member by name
    (D2H: paged -> key_value, H2D: key_value -> paged) as newer LMCache passes it."""
    name = getattr(direction, "name", None)
    if isinstance(direction, bool):
        return direction
    if name in ("D2H", "H2D"):
        return name == "D2H"
    raise fail("direction", direction, "must be a bool (True: paged -> key_value) or TransferDirection.H2D/D2H")


def _format(raw) -> Optional[KVCacheFormat]:
    if raw is None:
        return None
    v = getattr(raw, "value", raw)
    if isinstance(v, bool) or v not in {f.value for f in KVCacheFormat}:
        raise fail("kvcache_format_raw", raw, "kvtier moves MERGED_KV (1), SEPARATE_KV (2) and MLA_KV (3)")
    return KVCacheFormat(v)


def _hidden_bytes(arg: str, v, item: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise fail(arg, v, "must be a positive int (elements) for MLA_KV")
    return v * item


def _components(key_value: torch.Tensor, use_mla: bool, fmt: Optional[KVCacheFormat],
                page_buffer_size: int, k_hidden_dims, v_hidden_dims) -> Tuple[_Comp, ...]:
    """What moves where, from the call's flags (see the module doc)."""
    item = key_value.element_size()
    row = key_value.shape[3] * item
    if fmt is KVCacheFormat.MLA_KV:
        kb, vb = (_hidden_bytes("k_hidden_dims", k_hidden_dims, item),
                  _hidden_bytes("v_hidden_dims", v_hidden_dims, item))
        if kb + vb != row:
            raise fail("k_hidden_dims", k_hidden_dims, f"+ v_hidden_dims={v_hidden_dims} must be "
                       f"key_value.shape[3]={key_value.shape[3]}")
        return _Comp(0, 0, kb, 0, 0), _Comp(0, kb, vb, 1, 0)
    if use_mla:
        return (_Comp(0, 0, row, 0, 0),)
    if fmt is KVCacheFormat.SEPARATE_KV:
        return _Comp(0, 0, row, 0, 0), _Comp(1, 0, row, 1, 0)
    return _Comp(0, 0, row, 0, 0), _Comp(1, 0, row, 0, page_buffer_size * row)


def _check_key_value(key_value, use_mla: bool) -> None:
    if not isinstance(key_value, torch.Tensor):
        raise fail("key_value", type(key_value).__name__, "must be a torch.Tensor")
    planes = 1 if use_mla else 2
    if key_value.dim() != 4 or key_value.shape[0] != planes:
        raise fail("key_value.shape", tuple(key_value.shape),
                   f"must be [{planes}, num_layers, num_tokens, hidden]" + (" (use_mla)" if use_mla else ""))
    if key_value.numel() == 0:
        raise fail("key_value.shape", tuple(key_value.shape), "is empty")
    if not key_value.is_contiguous():
        raise fail("key_value", tuple(key_value.stride()), "must be contiguous (addressed by offsets)")


def _lmcache_maps(key_value: torch.Tensor, comps: Sequence[_Comp]) -> List[RowMap]:
    """The memory object's side, one map per component."""
    _, layers, tokens, _ = key_value.shape
    row = key_value.shape[3] * key_value.element_size()
    return [RowMap.from_strides(key_value[c.plane], num_layers=layers, num_rows=tokens, page_size=1,
                                row_bytes=c.width, token_stride=row, page_stride=row,
                                layer_stride=tokens * row, offset=c.col) for c in comps]


def _paged_maps(ptrs, comps: Sequence[_Comp], layers: int, page_buffer_size: int) -> List[RowMap]:
    """The paged side, one map per component: over the engine's address table, read by
    every launch as it is then (a component's layer ``l`` at entry ``l * entries +
    entry``, plus its offset), or over contiguous multi-layer tensors."""
    entries = 1 + max(c.entry for c in comps)
    if isinstance(ptrs, torch.Tensor):
        if ptrs.dim() != 1 or ptrs.numel() != layers * entries:
            raise fail("key_value_ptrs.shape", tuple(ptrs.shape),
                       f"must list {entries} address(es) per layer for {layers} layers ({layers * entries})")
        return _table_maps(ptrs, comps, entries, page_buffer_size)
    if not isinstance(ptrs, (list, tuple)) or len(ptrs) != entries:
        raise fail("key_value_ptrs", type(ptrs).__name__ if not isinstance(ptrs, (list, tuple)) else len(ptrs),
                   f"must be an int64 address table, or a list of {entries} multi-layer tensor(s)")
    return _stacked_maps(ptrs, comps, layers, page_buffer_size)


def _table_maps(ptrs: torch.Tensor, comps, entries: int, page_buffer_size: int) -> List[RowMap]:
    out = []
    for c in comps:
        # (entry e of layer l is table[l * entries + e]: a view from entry e, read in steps)
        table = ptrs[c.entry:] if c.entry else ptrs
        out.append(as_arg("key_value_ptrs", RowMap.engine_table, table, row_bytes=c.width,
                          num_rows=page_buffer_size, num_layers=ptrs.numel() // entries, table_layer=entries,
                          offset=c.offset))
    return out


def _stacked_maps(tensors, comps, layers: int, page_buffer_size: int) -> List[RowMap]:
    out = []
    for c in comps:
        arg, t = f"key_value_ptrs[{c.entry}]", tensors[c.entry]
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != layers:
            raise fail(f"{arg}.shape", tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__,
                       f"must be a (layers={layers}, ...) tensor")
        if not t[0].is_contiguous():
            raise fail(arg, tuple(t.stride()), "each layer must be contiguous (slots addressed by offsets)")
        out.append(as_arg(arg, RowMap.from_strides, t, num_layers=layers, num_rows=page_buffer_size, page_size=1,
                          row_bytes=c.width, token_stride=c.width, page_stride=c.width,
                          layer_stride=t.stride(0) * t.element_size(), offset=c.offset))
    return out


def _check_device(paged_memory_device, maps: Sequence[RowMap]) -> None:
    """``paged_memory_device`` names the device the paged side lives on."""
    try:
        want = torch.device(paged_memory_device)
    except (TypeError, RuntimeError, ValueError):
        raise fail("paged_memory_device", paged_memory_device, "must be a torch.device") from None
    have = maps[0].device
    if want.type != have.type or (want.index is not None and have.index is not None and want.index != have.index):
        raise fail("paged_memory_device", str(want), f"the paged KV cache is on {have}")


def multi_layer_kv_transfer(key_value: torch.Tensor, key_value_ptrs, slot_mapping: torch.Tensor,
                            paged_memory_device, page_buffer_size: int, direction, use_mla: bool = False,
                            kvcache_format_raw=None, k_hidden_dims: int = 0, v_hidden_dims: int = 0,
                            dsa_hidden_dims: int = 0, *, config=None, check: Optional[bool] = None) -> None:
    """Every layer of one chunk between ``key_value`` and the paged KV cache: for each
    token ``t`` whose slot ``s = slot_mapping[t]`` is not negative, each layer and each of
    K and V (the latent row alone with ``use_mla``), ``key_value[k, l, t]`` <-> slot ``s``
    of layer ``l``; ``direction`` True fills ``key_value``, False fills the paged cache.
    Positional arguments as LMCache's CUDA op (seven) or LMCache-Ascend's (with
    ``kvcache_format_raw`` and the MLA hidden sizes); ``dsa_hidden_dims`` is accepted and
    unused (the DSA formats are refused by ``kvcache_format_raw``)."""
    del dsa_hidden_dims
    if not isinstance(use_mla, bool):
        raise fail("use_mla", use_mla, "must be a bool")
    to_lmcache = _paged_to_lmcache(direction)
    fmt = _format(kvcache_format_raw)
    if fmt is KVCacheFormat.MLA_KV and not use_mla:
        raise fail("use_mla", use_mla, "MLA_KV moves MLA rows ([1, ...] memory objects); pass use_mla=True")
    if not isinstance(page_buffer_size, int) or isinstance(page_buffer_size, bool) or page_buffer_size <= 0:
        raise fail("page_buffer_size", page_buffer_size, "must be a positive int (num_blocks * block_size)")
    _check_key_value(key_value, use_mla)
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 \
            and slot_mapping.numel() != key_value.shape[2]:
        raise fail("slot_mapping", f"{slot_mapping.numel()} slots",
                   f"must give one slot per token of key_value ({key_value.shape[2]})")
    comps = _components(key_value, use_mla, fmt, page_buffer_size, k_hidden_dims, v_hidden_dims)
    # The memory object's token list is kvtier's own (0 .. num_tokens - 1) on the paged side's device.
    tokens = _tokens(key_value, key_value_ptrs)
    si, di = (slot_mapping, tokens) if to_lmcache else (tokens, slot_mapping)

    def build():
        paged = _paged_maps(key_value_ptrs, comps, key_value.shape[1], page_buffer_size)
        _check_device(paged_memory_device, paged)
        lmc = _lmcache_maps(key_value, comps)
        tokens = iota(key_value.shape[2], torch.int64, compute_device(*paged, *lmc))
        host = key_value.device.type == "cpu"
        if to_lmcache:
            pairs, si, di, names = list(zip(paged, lmc)), slot_mapping, tokens, ("slot_mapping", "key_value tokens")
            op = BACKUP if host else GATHER
        else:
            pairs, si, di, names = list(zip(lmc, paged)), tokens, slot_mapping, ("key_value tokens", "slot_mapping")
            op = LOAD if host else SCATTER
        return EngineCall([(pairs, 0, 0, key_value.shape[1])], si, di, op=op, skip_negative=True, config=config,
                          index_names=names, table_names=("key_value_ptrs", "key_value_ptrs"))
    registry.call(("lmcache", comps, to_lmcache, str(paged_memory_device)), plain(page_buffer_size, config),
                  (key_value, key_value_ptrs), si, di, check, build)


def _tokens(key_value: torch.Tensor, ptrs) -> Optional[torch.Tensor]:
    """0 .. num_tokens - 1 on the device the copy runs on (the paged side's)."""
    device = ptrs.device if isinstance(ptrs, torch.Tensor) else (
        ptrs[0].device if isinstance(ptrs, (list, tuple)) and ptrs and isinstance(ptrs[0], torch.Tensor)
        else key_value.device)
    if device.type == "cpu":
        device = key_value.device
    return iota(key_value.shape[2], torch.int64, device)
