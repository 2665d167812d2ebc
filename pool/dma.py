"""The "dma" way across the link: a gather kernel packs device rows into a contiguous
device staging buffer laid out in the host's order, and bulk asynchronous copies move
each contiguous run between staging and host memory (loads run it in reverse).

Staging has the host buffer's layout with only the moved slots (or pages) and layers,
so a run of consecutive host slots is a run of consecutive staging slots. Page-major
host layouts make one page's layers one piece; layer_first moves one piece per layer.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from kvtier.kernels import RowMap

from . import layouts
from .dispatch import run_copy


def runs(units: torch.Tensor) -> List[Tuple[int, int, int]]:
    """Maximal runs of consecutive host units as (host unit, staging unit, length)."""
    n = units.numel()
    if n == 0:
        return []
    brk = (torch.nonzero(units[1:] - units[:-1] != 1).flatten() + 1).tolist()
    starts, ends = [0] + brk, brk + [n]
    u = units.tolist()
    return [(u[s], s, e - s) for s, e in zip(starts, ends)]


class Staging:
    """A device staging buffer for one host component group and one transfer."""

    def __init__(self, host_buf: torch.Tensor, layout: str, page_size: int, n_slots: int,
                 layers: int, device: torch.device):
        paged = layouts.is_paged(layout)
        self.layout = layout
        row_shape = _row_shape(host_buf, layout)
        self.tensor = torch.empty(layouts.shape(layout, comps=host_buf.shape[0], layers=layers,
                                                slots=n_slots, page_size=page_size, row_shape=row_shape),
                                  dtype=host_buf.dtype, device=device)
        p = page_size if paged else 1
        self.map = RowMap.stack([RowMap.from_host_layout(self.tensor[c], layout, p)
                                 for c in range(self.tensor.shape[0])])
        self.index = torch.arange(n_slots, dtype=torch.int64, device=device)

    def pieces(self, host_view: torch.Tensor, run_list):
        """(host piece, staging piece) pairs covering every run, each contiguous."""
        ud = layouts.unit_dim(self.layout)
        for u0, j0, k in run_list:
            yield from layouts.contiguous_pieces(host_view.narrow(ud, u0, k), self.tensor.narrow(ud, j0, k))


def _row_shape(buf: torch.Tensor, layout: str):
    if layout == "page_head":     # (C, pages, H, P, L, D): rows are H x D
        return (buf.shape[2], buf.shape[5])
    return tuple(buf.shape[len(layouts.DIMS[layout]):])


def backup(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
           run_list, by_page, config) -> None:
    """Device rows ``didx`` of layers dev_layer.. -> host layers host_layer.. at the runs."""
    st = Staging(host_buf, layout, page_size, didx.numel(), num_layers, didx.device)
    run_copy(op, dev_map, didx, st.map, st.index.to(didx.dtype), src_layer=dev_layer, dst_layer=0,
             num_layers=num_layers, by_page=by_page, config=config)
    host_view = host_buf.narrow(layouts.layer_dim(layout), host_layer, num_layers)
    for h, s in st.pieces(host_view, run_list):
        h.copy_(s, non_blocking=True)


def load(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
         run_list, by_page, config) -> None:
    """Host layers host_layer.. at the runs -> device rows ``didx`` of layers dev_layer.."""
    st = Staging(host_buf, layout, page_size, didx.numel(), num_layers, didx.device)
    host_view = host_buf.narrow(layouts.layer_dim(layout), host_layer, num_layers)
    for h, s in st.pieces(host_view, run_list):
        s.copy_(h, non_blocking=True)
    run_copy(op, st.map, st.index.to(didx.dtype), dev_map, didx, src_layer=0, dst_layer=dev_layer,
             num_layers=num_layers, by_page=by_page, config=config)
