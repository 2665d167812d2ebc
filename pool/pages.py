"""Page access for storage tiers: one host page's bytes across all layers and
components, and the address/size of each contiguous region of a page (zero copy)."""
from __future__ import annotations

import itertools
from typing import Iterator, List, Tuple

import torch

from kvtier.errors import fail
from kvtier.kernels.validate import check_dense, check_index, check_pages_in_range

from kvtier.kernels.layouts import host_layout


def _check_page_index(host, index) -> None:
    if not isinstance(index, int) or isinstance(index, bool):
        raise fail("index", index, "must be an int (the page's first host slot)")
    if not 0 <= index < host.size or index % host.page_size:
        raise fail("index", index, f"must be a page start (multiple of {host.page_size}) below {host.size}")


def page_views(host, index: int) -> Iterator[torch.Tensor]:
    """One view per host group of the page starting at slot ``index`` (layout order)."""
    lay = host_layout(host.layout)
    ud, paged = 1 + lay.unit_dim, lay.paged      # host buffers are (C, ...)
    start, length = (index // host.page_size, 1) if paged else (index, host.page_size)
    for _, _, buf in host.groups:
        yield buf.narrow(ud, start, length)


def get_page(host, index: int) -> torch.Tensor:
    _check_page_index(host, index)
    return torch.cat([v.view(torch.uint8).reshape(-1) for v in page_views(host, index)])


def set_page(host, index: int, data: torch.Tensor) -> None:
    _check_page_index(host, index)
    check_dense("data", data, "page bytes", " of uint8")
    if data.dtype != torch.uint8 or data.shape != (host.page_bytes,):
        raise fail("data", (tuple(data.shape), data.dtype),
                   f"must be a flat uint8 tensor of {host.page_bytes} bytes (get_page's form)")
    data = data.contiguous()        # (every part below is a view of it: none can fail half-way)
    off = 0
    for v in page_views(host, index):
        b = v.view(torch.uint8)
        b.copy_(data[off:off + b.numel()].view(b.shape))
        off += b.numel()


def get_page_buffer_meta(host, indices: torch.Tensor) -> Tuple[List[int], List[int]]:
    check_index("indices", indices, indices.device if isinstance(indices, torch.Tensor) else None)
    indices = indices.cpu()
    check_pages_in_range("indices", indices, host.size, host.page_size)
    ptrs, sizes = [], []
    for index in indices[::host.page_size].tolist():
        for v in page_views(host, index):
            for piece in contiguous_pieces(v):
                ptrs.append(piece.data_ptr())
                sizes.append(piece.numel() * piece.element_size())
    return ptrs, sizes


def contiguous_pieces(view: torch.Tensor) -> Iterator[torch.Tensor]:
    """Split ``view`` into the fewest contiguous pieces: the leading dims are iterated,
    the dense tail is kept."""
    split = next(s for s in range(view.dim() + 1) if _dense_from(view, s))
    for idx in itertools.product(*(range(n) for n in view.shape[:split])):
        yield view[idx]


def _dense_from(t: torch.Tensor, s: int) -> bool:
    expect = 1
    for size, stride in zip(reversed(t.shape[s:]), reversed(t.stride()[s:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True
