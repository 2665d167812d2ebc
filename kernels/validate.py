"""Argument checks shared by the kernel launcher and the reference: every check runs
before any byte moves, and every error names the argument and the bad value."""
from __future__ import annotations

from typing import Optional

import torch

import kvtier.platforms as platforms

from kvtier.errors import KvtierError, fail
from .iota import iota
from .rowmap import RowMap, owned_span

INDEX_DTYPES = (torch.int32, torch.int64)
_CPU = torch.device("cpu")


def compute_device(*maps: RowMap) -> torch.device:
    """Where a copy between ``maps`` runs: the one accelerator they touch, else the CPU."""
    found = None
    for m in maps:
        d = m.device
        if d.type != "cpu":
            if found is not None and d != found:
                raise fail("maps", sorted({str(found), str(d)}), "a copy can touch only one accelerator")
            found = d
    return found if found is not None else _CPU


def check_dense(arg: str, t, holds: str, tensor_of: str = "") -> None:
    """``t`` must be a dense (strided) tensor with memory (not meta) holding all its
    elements (`owned_span`); ``holds`` names what it holds and ``tensor_of`` the dtypes
    wanted, for the errors."""
    if not isinstance(t, torch.Tensor):
        raise fail(arg, type(t).__name__, f"must be a torch.Tensor{tensor_of}")
    if t.layout != torch.strided:
        raise fail(f"{arg}.layout", t.layout, "must be a dense (strided) tensor")
    if t.is_meta:
        raise fail(f"{arg}.device", str(t.device), f"a meta tensor holds no {holds}")
    owned_span(t, arg)


def check_index(arg: str, idx, device: torch.device) -> None:
    check_dense(arg, idx, "indices", " of int32 or int64")
    if idx.dtype not in INDEX_DTYPES:
        raise fail(f"{arg}.dtype", idx.dtype, "must be torch.int32 or torch.int64")
    if idx.dim() != 1:
        raise fail(f"{arg}.shape", tuple(idx.shape), "must be 1-D")
    if idx.device != device and not (idx.device.type == device.type and idx.device.index is None):
        raise fail(f"{arg}.device", str(idx.device), f"must be on {device}, where the copy runs")


def index_ok(idx, device: torch.device) -> bool:
    """Whether `check_index` passes ``idx`` for a copy on ``device``, answered fast for the
    usual case (a plain tensor on ``device`` itself); False sends the caller to
    `check_index`, which passes the rest it accepts or names what is wrong. ``device``
    must be where a copy runs: given a meta device it would pass a meta tensor, which
    `check_index` refuses (so `check_index` does not start with it)."""
    return (type(idx) is torch.Tensor and idx.dtype in INDEX_DTYPES and idx.dim() == 1
            and idx.layout is _STRIDED and idx.device == device)


_STRIDED = torch.strided


def check_range(arg: str, idx: torch.Tensor, limit: int) -> None:
    """0 <= idx < limit; one reduction (a device sync when idx lives on a GPU)."""
    if idx.numel() == 0:
        return
    lo, hi = torch.aminmax(idx)
    lo, hi = int(lo), int(hi)
    if lo < 0:
        raise fail(arg, lo, "negative index")
    if hi >= limit:
        raise fail(arg, hi, f"index out of range for {limit} rows")


def check_page_aligned(arg: str, idx: torch.Tensor, page_size: int) -> None:
    """idx is whole pages: runs of page_size consecutive slots starting at a page boundary."""
    n = idx.numel()
    if n % page_size:
        raise fail(f"len({arg})", n, f"page-granular copy needs a multiple of page_size={page_size}")
    if page_size == 1 or n == 0:
        return
    pages = idx.view(-1, page_size)
    starts = pages[:, :1]
    rows = ((starts[:, 0] % page_size != 0)
            | (pages - starts != torch.arange(page_size, device=idx.device, dtype=idx.dtype)).any(1))
    if bool(rows.any()):
        first = int(rows.nonzero()[0, 0])
        raise fail(arg, pages[first].tolist(), f"page {first} is not {page_size} consecutive slots "
                   "starting at a page boundary")


def check_pages_in_range(arg: str, idx: torch.Tensor, limit: int, page_size: int) -> None:
    """`check_range`, then `check_page_aligned`, with the page check in a few torch ops
    where the list passes it (the usual case): a list of whole pages equals each page's
    first slot rounded down to its page boundary plus the page's offsets. Any other list
    takes `check_page_aligned`, which names what is wrong."""
    check_range(arg, idx, limit)
    n = idx.numel()
    if page_size > 1 and n and not n % page_size:
        rows = idx.view(-1, page_size) if idx.is_contiguous() else idx.reshape(-1, page_size)
        first = rows.narrow(1, 0, 1)
        # (a power of two rounds down with one AND, negative slots included)
        start = first & -page_size if not page_size & (page_size - 1) else first - first.remainder(page_size)
        if torch.equal(rows, start + iota(page_size, idx.dtype, idx.device)):
            return
    check_page_aligned(arg, idx, page_size)


def is_int(v) -> bool:
    """An int that is not a bool (True is no layer number)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_layers(arg: str, start: int, count: int, m: RowMap) -> None:
    """Layers start .. start+count-1 exist in ``m``; with count 0 (the default count),
    the start layer itself must exist, or the copy would silently move nothing."""
    if not is_int(start):
        raise fail(arg, start, "must be an int layer number")
    if start < 0 or start + max(count, 1) > m.num_layers:
        what = f"layers {start}..{start + count - 1} are" if count else f"start layer {start} is"
        raise fail(arg, start, f"{what} outside the map's {m.num_layers} layers")


def check_copy(src: RowMap, src_indices, dst: RowMap, dst_indices, src_layer: int, dst_layer: int,
               num_layers: Optional[int], by_page: bool, check_values: bool = True):
    """Validate one copy; returns (device, num_layers)."""
    for arg, m in (("src", src), ("dst", dst)):
        if not isinstance(m, RowMap):
            raise fail(arg, type(m).__name__, "must be a kvtier RowMap")
    device = compute_device(src, dst)
    if src.row_bytes != dst.row_bytes:
        raise fail("dst.row_bytes", dst.row_bytes, f"differs from src.row_bytes={src.row_bytes}")
    if src.num_components != dst.num_components:
        raise fail("dst.num_components", dst.num_components,
                   f"differs from src.num_components={src.num_components}")
    if num_layers is None:
        # Name a bad start layer here: the default count derived from it would be negative.
        check_layers("src_layer", src_layer, 0, src)
        check_layers("dst_layer", dst_layer, 0, dst)
        num_layers = min(src.num_layers - src_layer, dst.num_layers - dst_layer)
    if not is_int(num_layers) or num_layers < 0:
        raise fail("num_layers", num_layers, "must be a non-negative int")
    check_layers("src_layer", src_layer, num_layers, src)
    check_layers("dst_layer", dst_layer, num_layers, dst)
    check_index("src_indices", src_indices, device)
    check_index("dst_indices", dst_indices, device)
    if src_indices.numel() != dst_indices.numel():
        raise fail("dst_indices", f"{dst_indices.numel()} indices",
                   f"src_indices has {src_indices.numel()}; counts must match")
    if by_page and src.page_size != dst.page_size:
        raise fail("by_page", True, f"page sizes differ (src {src.page_size}, dst {dst.page_size})")
    plat = platforms.of(device)
    for m in (src, dst):
        if device.type != "cpu" and m.device.type == "cpu" and not m.reachable_by(plat):
            raise KvtierError(f"{m.describe()}: {plat.unreachable}")
    if check_values:
        check_range("src_indices", src_indices, src.num_rows)
        check_range("dst_indices", dst_indices, dst.num_rows)
        if by_page:
            check_page_aligned("src_indices", src_indices, src.page_size)
            check_page_aligned("dst_indices", dst_indices, dst.page_size)
    return device, num_layers
