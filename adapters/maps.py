"""Engine arguments as row maps, and the prepared call every engine adapter ends in.

The engine adapters (`kvtier.adapters`) take an engine's own arguments: tensors
addressed by byte arithmetic from ``item_size`` and ``layout_dim``, per-layer pointer
tables, lists of per-layer tensors, token indices wherever they live. This module turns
each of those into a `RowMap` (the layouts stay data: strides, not branches), and an
`EngineCall` validates every component of a transfer before the first byte moves and
prepares its `Transfer`, one launch for the components that can share one.

An `EngineCall` is made for one call and kept nowhere (`copy_jobs`: the path of buffers
kvtier has not seen), or kept by the buffer set an engine registered
(`kvtier.adapters.registry`), whose later calls only launch.
"""
from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

import torch

from kvtier.config import CopyConfig
from kvtier.errors import KvtierError, as_arg, fail
from kvtier.kernels.index_check import Checks
from kvtier.kernels.launcher import interpreter_active, triton_available
from kvtier.kernels.ops import BACKUP, LOAD, Op
from kvtier.kernels.rowmap import RowMap
from kvtier.kernels.staging import stage
from kvtier.kernels.transfer import Copy, Transfer
from kvtier.kernels.validate import INDEX_DTYPES, check_copy, check_dense, check_index, compute_device, index_ok
from kvtier.pool import tuning

# Rows assumed behind a raw address table: it carries no size, so indices into a table
# side are checked for sign only (as the engines' own kernels do not check them at all).
UNSIZED_ROWS = 1 << 40


# ---------------------------------------------------------------- tensors by byte arithmetic
def _dense_bytes(arg: str, t, outer: int) -> int:
    """Bytes of dense tensor ``t`` (`check_dense`), which an engine kernel addresses as
    ``base + i * outer + ...``: it must be contiguous (byte arithmetic ignores strides)
    and hold at least one ``outer`` run; where it has a leading dim, that dim's stride
    must be ``outer`` (which catches an ``item_size`` given in elements rather than
    bytes), or, for a page-major buffer of 4 or more dims (see `_page_of`), a whole
    number of ``outer`` runs."""
    if not t.is_contiguous():
        raise fail(arg, tuple(t.stride()), "must be contiguous: the call addresses it by byte offsets")
    nbytes = t.numel() * t.element_size()
    if nbytes < outer:
        raise fail(arg, tuple(t.shape), f"holds {nbytes} bytes, less than one {outer}-byte row run")
    step = t.stride(0) * t.element_size() if t.dim() >= 2 and t.shape[0] > 1 else outer
    if step != outer and (t.dim() < 4 or step % outer):
        raise fail(arg, tuple(t.shape), f"rows {t.stride(0) * t.element_size()} bytes apart along dim 0; "
                   f"the call implies {outer} (item_size and layout_dim are in bytes)")
    return nbytes


def _page_of(t: torch.Tensor, item_size: int) -> int:
    """Token slots per dim-0 step of a one-layer buffer: 1 for token-major ``(N, ...)``;
    P for a page-major one whose dim 0 is the page, with the page's tokens inside it in
    another order (SGLang's HND ``(pages, H, P, D)``, ROCm's vectorized 5-D layout).
    Row ``i`` is still the bytes at ``base + i * item_size`` (SGLang's semantics), which
    move a whole page byte-exact, so such a buffer takes whole pages only."""
    return 1 if t.dim() < 4 or t.shape[0] <= 1 else t.stride(0) * t.element_size() // item_size


def _positive(arg: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise fail(arg, v, "must be a positive int")
    return v


def _layers_in(layout_dim: int, item_size: int, arg: str = "layout_dim") -> int:
    _positive(arg, layout_dim)
    if layout_dim % item_size:
        raise fail(arg, layout_dim, f"must be a whole number of item_size={item_size}-byte rows")
    return layout_dim // item_size


def lf_buffer(arg: str, t: torch.Tensor, item_size: int) -> RowMap:
    """One layer, rows packed: row i at ``base + i * item_size`` (SGLang's ``lf``)."""
    _positive("item_size", item_size)
    check_dense(arg, t, "bytes")
    rows = _dense_bytes(arg, t, item_size) // item_size
    page = _page_of(t, item_size)
    rows -= rows % page
    return RowMap.from_strides(t, num_layers=1, num_rows=rows, page_size=page, row_bytes=item_size,
                               token_stride=item_size, page_stride=item_size * page, layer_stride=0)


def pf_buffer(arg: str, t: torch.Tensor, item_size: int, layout_dim: int) -> RowMap:
    """All layers of a token together: row (i, l) at ``base + i * layout_dim + l * item_size``
    (SGLang's ``pf``; ``layout_dim`` = layers x item_size bytes)."""
    _positive("item_size", item_size)
    layers = _layers_in(layout_dim, item_size)
    check_dense(arg, t, "bytes")
    rows = _dense_bytes(arg, t, layout_dim) // layout_dim
    return RowMap.from_strides(t, num_layers=layers, num_rows=rows, page_size=1, row_bytes=item_size,
                               token_stride=layout_dim, page_stride=layout_dim, layer_stride=item_size)


def ph_buffer(arg: str, t: torch.Tensor, item_size: int, layout_dim: int, page_size: int,
              head_num: int) -> RowMap:
    """The page_head layout (pages, heads, page_size, layers, head bytes): a row is
    ``head_num`` chunks, one per head (SGLang's ``ph``)."""
    _positive("item_size", item_size)
    _positive("page_size", page_size)
    _positive("head_num", head_num)
    check_dense(arg, t, "bytes")
    if item_size % head_num:
        raise fail("head_num", head_num, f"must divide item_size={item_size}")
    layers = _layers_in(layout_dim, item_size)
    head_bytes, page_bytes = item_size // head_num, page_size * layout_dim
    pages = _dense_bytes(arg, t, page_bytes) // page_bytes
    return RowMap.from_strides(t, num_layers=layers, num_rows=pages * page_size, page_size=page_size,
                               row_bytes=item_size, token_stride=layout_dim // head_num,
                               page_stride=page_bytes, layer_stride=head_bytes, n_chunks=head_num,
                               chunk_stride=page_size * layout_dim // head_num)


def layer_table(arg: str, layers, item_size: int, num_layers: int, exact: bool = True) -> RowMap:
    """Per-layer bases: a uint64/int64 address table (rows packed, ``item_size`` apart, no
    size known) or, as an extension, a list of per-layer tensors (sizes checked). The
    source table must list exactly ``num_layers`` layers (SGLang checks that too); a
    destination (``exact=False``) may list more.

    What a table is trusted with (docs/adapters.md, "What kvtier trusts about pointer
    tables"): every address stays a live buffer of at least (largest index + 1) x
    ``item_size`` bytes until the call's copies have run (kvtier holds the table, not the
    buffers). Every launch reads the table as it is then (kvtier keeps no copy of it) and
    refuses a null or misaligned entry before it moves a byte."""
    _positive("item_size", item_size)
    _positive("num_layers", num_layers)
    count = layers.numel() if isinstance(layers, torch.Tensor) and layers.dim() == 1 else (
        len(layers) if isinstance(layers, (list, tuple)) else None)
    if count is not None and (count < num_layers or (exact and count != num_layers)):
        raise fail(f"{arg}.size(0)", count, f"does not match num_layers={num_layers}")
    if isinstance(layers, torch.Tensor):
        return as_arg(arg, RowMap.engine_table, layers, row_bytes=item_size, num_rows=UNSIZED_ROWS)
    m = per_layer_list(arg, layers)
    if m.row_bytes != item_size:
        raise fail("item_size", item_size, f"the rows of {arg} are {m.row_bytes} bytes")
    return m


def per_layer_list(arg: str, layers: Sequence[torch.Tensor], page_size: int = 1) -> RowMap:
    """A list of per-layer tensors ``(N, *row)``; with ``page_size`` > 1 only whole pages
    are mapped (a trailing partial page cannot hold a page)."""
    if isinstance(layers, torch.Tensor) or not isinstance(layers, (list, tuple)) or not layers:
        raise fail(arg, type(layers).__name__, "must be a non-empty list of per-layer tensors")
    if page_size > 1:
        layers = [t[: t.shape[0] // page_size * page_size] if isinstance(t, torch.Tensor) and t.dim() else t
                  for t in layers]
    return as_arg(arg, RowMap.from_layers, list(layers), page_size=page_size)


def page_count(indices_numel: int, page_size: int, arg: str = "src_indices") -> None:
    """The direct and Ascend calls move whole pages: the index count must be a multiple."""
    _positive("page_size", page_size)
    if indices_numel % page_size:
        raise fail(f"len({arg})", indices_numel, f"must be a multiple of page_size={page_size}")


# ---------------------------------------------------------------- indices
def _index(arg: str, idx, device: torch.device) -> torch.Tensor:
    """``idx`` checked for shape (a tensor, int32/int64, 1-D, strided) and on ``device``
    (staged there from another device without waiting, `kvtier.kernels.staging`)."""
    if index_ok(idx, device):
        return idx
    check_index(arg, idx, idx.device if isinstance(idx, torch.Tensor) else device)
    return stage(idx, device, arg)


def indices(src_indices, dst_indices, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both index lists checked for shape and on ``device`` (`_index`), of equal counts."""
    si, di = _index("src_indices", src_indices, device), _index("dst_indices", dst_indices, device)
    if si.numel() != di.numel():
        raise fail("dst_indices", f"{di.numel()} indices", f"src_indices has {si.numel()}; counts must match")
    return si, di


# ---------------------------------------------------------------- the prepared call
Pair = Tuple[RowMap, RowMap]
# One layer map over some component pairs: (pairs, src_layer, dst_layer, num_layers).
Job = Tuple[Sequence[Pair], int, int, Optional[int]]
_TENSOR = torch.Tensor
_STRIDED = torch.strided


class EngineCall:
    """One engine call's transfer, prepared: its jobs' component pairs stacked into
    copies and validated (layers, rows, reachability) with the call's index lists, the
    lists' checks (names as the engine names them, limits, whole pages, negatives), and
    the `Transfer` (`transfer`) with the configuration ``config`` fixes or the tuned one
    (``block_quota`` caps its programs). `launch` is each call."""

    def __init__(self, jobs: Sequence[Job], src_indices, dst_indices, *, op: Op, by_page: bool = False,
                 skip_negative: bool = False, config=None, block_quota: Optional[int] = None,
                 index_names: Tuple[str, str] = ("src_indices", "dst_indices"),
                 table_names: Tuple[str, str] = ("src table", "dst table")):
        if config is not None and not isinstance(config, CopyConfig):
            raise fail("config", type(config).__name__, "must be a kvtier CopyConfig (or None for the tuned one)")
        self.index_names = index_names
        try:
            maps = [m for pairs, *_ in jobs for p in pairs for m in p]
            self.device = device = compute_device(*maps)
            si, di = indices(src_indices, dst_indices, device)
            copies = []
            for pairs, src_layer, dst_layer, num_layers in jobs:
                for s, d in _stacked(list(pairs)):
                    _, n_layers = check_copy(s, si, d, di, src_layer, dst_layer, num_layers, by_page,
                                             check_values=False)
                    copies.append(Copy(s, d, src_layer, dst_layer, n_layers, by_page))
        except KvtierError as e:
            raise _renamed(e, index_names) from None
        whole = (_whole_pages(copies[0].src, by_page), _whole_pages(copies[0].dst, by_page))
        checks = Checks((index_names[0], min(c.src.num_rows for c in copies), whole[0]),
                        (index_names[1], min(c.dst.num_rows for c in copies), whole[1]), skip_negative, table_names)
        quota = None if block_quota is None else _positive("block_quota", block_quota)
        # A map built from a bare address table has no tensors for the torch reference to
        # read: say so (before any byte moves) where the reference would have to run.
        if (not (triton_available() and (device.type != "cpu" or interpreter_active()))
                and any(m.is_table and not m.segments for m in maps)):
            raise KvtierError("a pointer table side needs the Triton kernel (the torch reference "
                              "cannot read raw addresses); install Triton, or pass per-layer tensors")
        self.transfer = Transfer(copies, device=device, checks=checks, skip_negative=skip_negative,
                                 resolve=tuning.resolver(op, lambda: config, programs=quota), epoch=tuning.EPOCH,
                                 watched=False, op=op)

    def launch(self, src_indices, dst_indices, check: Optional[bool] = None) -> None:
        """One call: both lists checked for shape and put where the copy runs, then the
        transfer's launches, each checking the lists' values (``check``: None follows
        ``KVTIER_CHECK``, False skips the value checks)."""
        si, di, device = src_indices, dst_indices, self.device
        try:
            if not (type(si) is _TENSOR and type(di) is _TENSOR and si.device == device and di.device == device
                    and si.dtype in INDEX_DTYPES and di.dtype in INDEX_DTYPES and si.dim() == 1 and di.dim() == 1
                    and si.layout is _STRIDED and di.layout is _STRIDED and si.numel() == di.numel()):
                si, di = indices(si, di, device)
            self.transfer.launch(si, di, check=check)
        except KvtierError as e:
            raise _renamed(e, self.index_names) from None


def copy_jobs(jobs: Sequence[Job], src_indices, dst_indices, *, check: Optional[bool] = None, **kw) -> EngineCall:
    """Copy several jobs (each its own layer map, as the Ascend indexer cache has) at the
    same indices: an `EngineCall` prepared for this call, launched and returned (kept by
    no one unless the caller keeps it). ``kw``: `EngineCall`'s options."""
    call = EngineCall(jobs, src_indices, dst_indices, **kw)
    call.launch(src_indices, dst_indices, check)
    return call


def copy_pairs(pairs: Sequence[Pair], src_indices, dst_indices, *, src_layer: int = 0, dst_layer: int = 0,
               num_layers: Optional[int] = None, **kw) -> EngineCall:
    """Copy every (src, dst) component pair over one layer map at the same indices."""
    return copy_jobs([(pairs, src_layer, dst_layer, num_layers)], src_indices, dst_indices, **kw)


def _renamed(e: KvtierError, names: Tuple[str, str]) -> KvtierError:
    """``e`` with the index arguments named as the caller names them."""
    if names == ("src_indices", "dst_indices"):
        return e
    mapping = dict(zip(("src_indices", "dst_indices"), names))
    return KvtierError(re.sub(r"\b(src|dst)_indices\b", lambda m: mapping[m.group(0)], str(e)))


UNCACHED = object()     # in a key: an argument that cannot be keyed; the call is not kept
_PLAIN = (int, type(None), CopyConfig)


def plain(*values) -> tuple:
    """``values`` for a key where each is an exact int, None or a `CopyConfig`; else a
    key part that is never kept (True == 1 and 1.0 == 1 must not find an int's shape)."""
    for v in values:
        if type(v) not in _PLAIN:
            return (UNCACHED,)
    return values


def _stacked(pairs: List[Pair]) -> List[Pair]:
    """One pair of maps for all components where both sides can be joined: in one
    allocation by a component stride, else by the step between their bases (stacked) or
    as two tables (an engine's), else by a table of their bases; else the pairs as
    they are."""
    if len(pairs) == 1:
        return pairs
    src, dst = (RowMap.stack(maps) or RowMap.join(maps) or RowMap.stack_as_table(maps)
                for maps in ([p[i] for p in pairs] for i in (0, 1)))
    return [(src, dst)] if src is not None and dst is not None else pairs


def _whole_pages(m: RowMap, by_page: bool) -> int:
    """The page size a side's indices must come in whole runs of: the map's where the call
    moves pages, or where the side is a one-layer packed-rows map over a page-major buffer
    (its page's tokens in another order, see `_page_of`); else 1."""
    paged_lf = m.num_layers == 1 and m.n_chunks == 1 and m.page_size > 1 and m.token_stride == m.row_bytes
    return m.page_size if by_page or paged_lf else 1


def direction(pairs: Sequence[Pair]) -> Op:
    """A call that moves either way (the direct calls): backup when the destination is
    host memory and the source is not, else load."""
    src, dst = pairs[0]
    return BACKUP if dst.device.type == "cpu" and src.device.type != "cpu" else LOAD

