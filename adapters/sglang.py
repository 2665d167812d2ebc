"""SGLang's ``sgl_kernel.kvcacheio`` transfer calls, on kvtier's row copy.

Same names, argument order and meaning as SGLang's functions, so a host pool swaps its
io backend by changing one import. Each call describes both sides as row maps and ends
in one `copy_rows` launch per group of components that can share one.

Conventions (as in SGLang's ``transfer.cu``):

- indices are token slots; ``item_size`` is the bytes of one token's row in one layer;
- ``lf`` (layer first): one layer's rows packed, row ``i`` at ``base + i * item_size``;
- ``pf`` (page first): a token's layers together, row ``(i, l)`` at
  ``base + i * layout_dim + l * item_size`` (``layout_dim`` = layers x item_size);
- ``ph`` (page head): ``(pages, heads, page_size, layers, head_bytes)``;
- ``*_layers`` arguments of the all-layer calls are pointer tables (uint64/int64, one
  address per layer, on the device, as in ``k_data_ptrs``; target and draft tables may
  be concatenated), or, as a kvtier extension, lists of per-layer tensors;
- the kernel variants (not ``ph``) skip every index pair holding a negative index;
- ``direct`` variants copy whole pages of ``page_size`` tokens from lists of tensors.

Differences, all on inputs SGLang leaves undefined: indices may also be int32 and live
on another device (they are moved); they are range-checked where a side has a size (a
pointer table has none); ``pf``/``ph`` indices and the direct calls' pages must be
whole pages where SGLang reads only each page's first index. ``block_quota`` caps the
programs (SGLang's thread blocks); ``num_warps_per_block`` is accepted and ignored (the
tuned configuration decides). Value checks never wait for the device (docs/adapters.md);
negative pairs are skipped in the kernel either way. Host memory must be
device-addressable (pinned or registered), as for SGLang's kernels.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvtier.errors import as_arg, fail
from kvtier.kernels.ops import BACKUP, LOAD, LOAD_LAYER
from kvtier.kernels.rowmap import RowMap
from kvtier.kernels.validate import is_int

from . import registry
from .maps import (copy_pairs, direction, layer_table, lf_buffer, page_count, per_layer_list, pf_buffer, ph_buffer,
                   plain)

__all__ = [
    "transfer_kv_per_layer", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer", "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
]


# The caller's argument names per component: (src name, dst name) pairs.
_KV = (("src_k", "dst_k"), ("src_v", "dst_v"))
_MLA = (("src", "dst"),)
_KV_TABLES = (("src_k_layers", "dst_k_layers"), ("src_v_layers", "dst_v_layers"))
_MLA_TABLES = (("src_layers", "dst_layers"),)
_KV_TO_HOST = (("src_k_layers", "dst_k"), ("src_v_layers", "dst_v"))
_MLA_TO_HOST = (("src_layers", "dst"),)


def _comps(names, tensors):
    """(src name, src, dst name, dst) per component, from ``names`` and the tensors in
    argument order (src, dst of each component in turn)."""
    return [(sn, tensors[2 * c], dn, tensors[2 * c + 1]) for c, (sn, dn) in enumerate(names)]


def _layer_id(layer_id, m: RowMap, arg: str = "layer_id") -> int:
    if not isinstance(layer_id, int) or isinstance(layer_id, bool) or not 0 <= layer_id < m.num_layers:
        raise fail(arg, layer_id, f"outside the {m.num_layers} layers the buffer holds")
    return layer_id


# ------------------------------------------------------------------ one layer, per component
# Each call names its kind and scalars; on registered buffers its prepared transfer is
# kept and found again by them and its tensors' addresses (`kvtier.adapters.registry`).
def _lf_lf(kind, names, tensors, src_indices, dst_indices, item_size, block_quota, config, check):
    if type(item_size) is int and block_quota is None and config is None:      # (`plain`, the usual call)
        scalars = (item_size, None, None)
    else:
        scalars = plain(item_size, block_quota, config)

    def build():
        pairs = [(lf_buffer(sn, s, item_size), lf_buffer(dn, d, item_size)) for sn, s, dn, d in _comps(names, tensors)]
        return _prepared(pairs, src_indices, dst_indices, op=LOAD_LAYER, skip_negative=True,
                         block_quota=block_quota, config=config)
    registry.call(kind, scalars, tensors, src_indices, dst_indices, check, build)


def _pf_lf(names, tensors, src_indices, dst_indices, layer_id, item_size, src_layout_dim, block_quota,
           config, check):
    def build():
        pairs = [(pf_buffer(sn, s, item_size, src_layout_dim), lf_buffer(dn, d, item_size))
                 for sn, s, dn, d in _comps(names, tensors)]
        return _prepared(pairs, src_indices, dst_indices, src_layer=_layer_id(layer_id, pairs[0][0]), num_layers=1,
                         op=LOAD_LAYER, skip_negative=True, block_quota=block_quota, config=config)
    registry.call(("pf_lf", names), plain(layer_id, item_size, src_layout_dim, block_quota, config), tensors,
                  src_indices, dst_indices, check, build)


def _prepared(pairs, src_indices, dst_indices, *, src_layer: int = 0, dst_layer: int = 0, num_layers=None, **kw):
    """The `EngineCall` of one layer map over component ``pairs`` (not launched)."""
    from .maps import EngineCall
    return EngineCall([(pairs, src_layer, dst_layer, num_layers)], src_indices, dst_indices, **kw)


def transfer_kv_per_layer(src_k, dst_k, src_v, dst_v, src_indices, dst_indices, item_size: int,
                          block_quota: Optional[int] = None, num_warps_per_block: Optional[int] = None,
                          *, config=None, check: Optional[bool] = None) -> None:
    """K and V of one layer, ``lf`` -> ``lf``: ``dst[d[j]] = src[s[j]]`` for each pair."""
    _lf_lf("lf_lf", _KV, (src_k, dst_k, src_v, dst_v), src_indices, dst_indices, item_size, block_quota, config,
           check)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size: int,
                              block_quota: Optional[int] = None,
                              num_warps_per_block: Optional[int] = None,
                              *, config=None, check: Optional[bool] = None) -> None:
    """The MLA latent of one layer, ``lf`` -> ``lf``."""
    _lf_lf("lf_lf_mla", _MLA, (src, dst), src_indices, dst_indices, item_size, block_quota, config, check)


def transfer_kv_per_layer_pf_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
                                layer_id: int, item_size: int, src_layout_dim: int,
                                block_quota: Optional[int] = None,
                                num_warps_per_block: Optional[int] = None,
                                *, config=None, check: Optional[bool] = None) -> None:
    """Layer ``layer_id`` of a ``pf`` host buffer into a per-layer device buffer (a load)."""
    _pf_lf(_KV, (src_k, dst_k, src_v, dst_v), src_indices, dst_indices, layer_id, item_size,
           src_layout_dim, block_quota, config, check)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id: int,
                                    item_size: int, src_layout_dim: int,
                                    block_quota: Optional[int] = None,
                                    num_warps_per_block: Optional[int] = None,
                                    *, config=None, check: Optional[bool] = None) -> None:
    """The MLA form of `transfer_kv_per_layer_pf_lf`."""
    _pf_lf(_MLA, (src, dst), src_indices, dst_indices, layer_id, item_size, src_layout_dim,
           block_quota, config, check)


def transfer_kv_per_layer_ph_lf(src_k, dst_k, src_v, dst_v, src_indices, dst_indices,
                                layer_id: int, item_size: int, src_layout_dim: int,
                                page_size: int, head_num: int,
                                block_quota: Optional[int] = None,
                                num_warps_per_block: Optional[int] = None,
                                *, config=None, check: Optional[bool] = None) -> None:
    """Layer ``layer_id`` of a ``ph`` host buffer (each row gathered from ``head_num``
    head pieces) into a per-layer device buffer. Negative indices are errors here, as
    SGLang's page-head kernel does not skip them."""
    tensors = (src_k, dst_k, src_v, dst_v)

    def build():
        pairs = [(ph_buffer(sn, s, item_size, src_layout_dim, page_size, head_num), lf_buffer(dn, d, item_size))
                 for sn, s, dn, d in _comps(_KV, tensors)]
        return _prepared(pairs, src_indices, dst_indices, src_layer=_layer_id(layer_id, pairs[0][0]), num_layers=1,
                         op=LOAD_LAYER, block_quota=block_quota, config=config)
    registry.call("ph_lf", plain(layer_id, item_size, src_layout_dim, page_size, head_num, block_quota, config),
                  tensors, src_indices, dst_indices, check, build)


# ------------------------------------------------------------------ all layers, tables
def _all_layer(kind, names, tensors, host_side, src_indices, dst_indices, item_size, num_layers, scalars,
               skip_negative, block_quota, config, check):
    """Every layer from per-layer source tables: to tables (``host_side`` None) or to the
    host buffers ``host_side(name, tensor)`` builds (``scalars``: what that depends on)."""
    def build():
        pairs = [(layer_table(sn, s, item_size, num_layers),
                  layer_table(dn, d, item_size, num_layers, exact=False) if host_side is None else host_side(dn, d))
                 for sn, s, dn, d in _comps(names, tensors)]
        return _prepared(pairs, src_indices, dst_indices, num_layers=num_layers, op=BACKUP,
                         skip_negative=skip_negative, block_quota=block_quota, config=config,
                         # (each side's tables as the caller names them, joined with +)
                         table_names=("+".join(sn for sn, _ in names),
                                      "+".join(dn for _, dn in names) if host_side is None else "dst table"))
    registry.call((kind, names), plain(item_size, num_layers, *scalars, block_quota, config), tensors,
                  src_indices, dst_indices, check, build)


def transfer_kv_all_layer(src_k_layers, dst_k_layers, src_v_layers, dst_v_layers, src_indices,
                          dst_indices, item_size: int, num_layers: int,
                          block_quota: Optional[int] = None, num_warps_per_block: Optional[int] = None,
                          *, config=None, check: Optional[bool] = None) -> None:
    """Every layer, table -> table (``lf`` both sides, per-layer bases)."""
    _all_layer("lf_lf_all", _KV_TABLES, (src_k_layers, dst_k_layers, src_v_layers, dst_v_layers), None,
               src_indices, dst_indices, item_size, num_layers, (), True, block_quota, config, check)


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size: int,
                              num_layers: int, block_quota: Optional[int] = None,
                              num_warps_per_block: Optional[int] = None,
                              *, config=None, check: Optional[bool] = None) -> None:
    """The MLA form of `transfer_kv_all_layer`."""
    _all_layer("lf_lf_all", _MLA_TABLES, (src_layers, dst_layers), None, src_indices, dst_indices,
               item_size, num_layers, (), True, block_quota, config, check)


def transfer_kv_all_layer_lf_pf(src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                dst_indices, item_size: int, dst_layout_dim: int, num_layers: int,
                                block_quota: Optional[int] = None,
                                num_warps_per_block: Optional[int] = None,
                                *, config=None, check: Optional[bool] = None) -> None:
    """Every layer, per-layer device tables -> a ``pf`` host buffer (a backup)."""
    host = lambda n, d: pf_buffer(n, d, item_size, dst_layout_dim)  # noqa: E731
    _all_layer("lf_pf", _KV_TO_HOST, (src_k_layers, dst_k, src_v_layers, dst_v), host, src_indices,
               dst_indices, item_size, num_layers, (dst_layout_dim,), True, block_quota, config, check)


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size: int,
                                    dst_layout_dim: int, num_layers: int,
                                    block_quota: Optional[int] = None,
                                    num_warps_per_block: Optional[int] = None,
                                    *, config=None, check: Optional[bool] = None) -> None:
    """The MLA form of `transfer_kv_all_layer_lf_pf`."""
    host = lambda n, d: pf_buffer(n, d, item_size, dst_layout_dim)  # noqa: E731
    _all_layer("lf_pf", _MLA_TO_HOST, (src_layers, dst), host, src_indices, dst_indices, item_size,
               num_layers, (dst_layout_dim,), True, block_quota, config, check)


def transfer_kv_all_layer_lf_ph(src_k_layers, dst_k, src_v_layers, dst_v, src_indices,
                                dst_indices, item_size: int, dst_layout_dim: int, num_layers: int,
                                page_size: int, head_num: int,
                                block_quota: Optional[int] = None,
                                num_warps_per_block: Optional[int] = None,
                                *, config=None, check: Optional[bool] = None) -> None:
    """Every layer, per-layer device tables -> a ``ph`` host buffer (each row scattered
    into ``head_num`` head pieces). Negative indices are errors, as in SGLang."""
    host = lambda n, d: ph_buffer(n, d, item_size, dst_layout_dim, page_size, head_num)  # noqa: E731
    _all_layer("lf_ph", _KV_TO_HOST, (src_k_layers, dst_k, src_v_layers, dst_v), host, src_indices,
               dst_indices, item_size, num_layers, (dst_layout_dim, page_size, head_num), False, block_quota,
               config, check)


# ------------------------------------------------------------------ direct (lists of tensors)
def _signature(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else id(t)


def transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                       src_indices, dst_indices, page_size: int,
                       *, config=None, check: Optional[bool] = None) -> None:
    """``dst_layers[j][d[i]] = src_layers[j][s[i]]`` for every listed tensor j, a row being
    one slice along dim 0 (SGLang copies runs of consecutive slots; the bytes are the
    same). The index count must be a multiple of ``page_size``."""
    for arg, v in (("src_layers", src_layers), ("dst_layers", dst_layers)):
        if not isinstance(v, (list, tuple)) or not v:
            raise fail(arg, type(v).__name__, "must be a non-empty list of tensors")
    if len(src_layers) != len(dst_layers):
        raise fail("len(dst_layers)", len(dst_layers), f"differs from len(src_layers)={len(src_layers)}")
    if isinstance(src_indices, torch.Tensor):
        page_count(src_indices.numel(), page_size)
    # Layers of one geometry share a launch (K and V lists, target and draft layers).
    groups = {}
    for s, d in zip(src_layers, dst_layers):
        groups.setdefault((_signature(s), _signature(d)), []).append((s, d))
    pairs = [(per_layer_list("src_layers", [s for s, _ in g]),
              per_layer_list("dst_layers", [d for _, d in g])) for g in groups.values()]
    for s, d in pairs:
        if s.row_bytes != d.row_bytes:
            raise fail("dst_layers", f"rows of {d.row_bytes} bytes", f"the src_layers rows are {s.row_bytes} bytes")
    copy_pairs(pairs, src_indices, dst_indices, op=direction(pairs), config=config, check=check)


def _host_pages(arg: str, t, page_size: int) -> RowMap:
    """A ``page_first_direct`` host buffer ``(pages, layers, page_size, *row)``."""
    return as_arg(arg, RowMap.from_host_layout, t, "page_first_direct", page_size)


def _split(arg: str, layers, parts: int):
    if not isinstance(layers, (list, tuple)) or not layers or len(layers) % parts:
        raise fail(f"len({arg})", len(layers) if isinstance(layers, (list, tuple)) else type(layers).__name__,
                   f"must be a non-empty multiple of {parts} (one list of layers per component)")
    n = len(layers) // parts
    return [list(layers[c * n:(c + 1) * n]) for c in range(parts)]


def _components(arg: str, buffers) -> int:
    if not isinstance(buffers, (list, tuple)) or len(buffers) not in (1, 2):
        raise fail(arg, type(buffers).__name__ if not isinstance(buffers, (list, tuple)) else len(buffers),
                   "must list 1 (MLA) or 2 (K, V) page_first_direct host buffers")
    return len(buffers)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                       layer_id: int, page_size: int,
                                       *, config=None, check: Optional[bool] = None) -> None:
    """Whole pages of host ``page_first_direct`` buffers (``src_ptrs``: [K, V], or [KV] for
    MLA), layers ``layer_id ..``, into per-layer device tensors (``dst_ptrs``: the K
    layers then the V layers). Indices are token slots of whole pages."""
    parts = _components("src_ptrs", src_ptrs)
    if isinstance(src_indices, torch.Tensor):
        page_count(src_indices.numel(), page_size)
    pairs = [(_host_pages(f"src_ptrs[{c}]", src_ptrs[c], page_size),
              per_layer_list("dst_ptrs", group, page_size))
             for c, group in enumerate(_split("dst_ptrs", dst_ptrs, parts))]
    n = pairs[0][1].num_layers
    if not is_int(layer_id) or layer_id < 0 or layer_id + n > pairs[0][0].num_layers:
        raise fail("layer_id", layer_id, f"layers {layer_id}..+{n} are outside the host buffer's "
                   f"{pairs[0][0].num_layers}")
    copy_pairs(pairs, src_indices, dst_indices, src_layer=layer_id, num_layers=n, by_page=True,
               op=LOAD_LAYER if n == 1 else LOAD, config=config, check=check)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices,
                                       page_size: int, *, config=None, check: Optional[bool] = None) -> None:
    """Whole pages of per-layer device tensors (``src_ptrs``: the K layers then the V
    layers, target then draft) into host ``page_first_direct`` buffers (``dst_ptrs``:
    [K, V], or [KV] for MLA), host layers from 0."""
    parts = _components("dst_ptrs", dst_ptrs)
    if isinstance(src_indices, torch.Tensor):
        page_count(src_indices.numel(), page_size)
    pairs = [(per_layer_list("src_ptrs", group, page_size),
              _host_pages(f"dst_ptrs[{c}]", dst_ptrs[c], page_size))
             for c, group in enumerate(_split("src_ptrs", src_ptrs, parts))]
    if pairs[0][1].num_layers < pairs[0][0].num_layers:
        raise fail("dst_ptrs", f"{pairs[0][1].num_layers} host layers",
                   f"src_ptrs lists {pairs[0][0].num_layers} layers per component")
    copy_pairs(pairs, src_indices, dst_indices, num_layers=pairs[0][0].num_layers, by_page=True,
               op=BACKUP, config=config, check=check)
