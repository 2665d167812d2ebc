"""The "dma" way across the link: a gather kernel packs device rows into a contiguous
device staging buffer laid out in the host's order, and bulk asynchronous copies move
each contiguous run between staging and host memory (loads run it in reverse).

Staging has the host buffer's layout with only the moved slots (or pages) and layers,
so a run of consecutive host slots is a run of consecutive staging slots. A run's
pieces (one per layer and component in layer_first) repeat at one stride in both
buffers, so each run is one or a few 2-D copies (`dma_plan`), issued by the runtime's
2-D copy (`link_copy`).
"""
from __future__ import annotations

from typing import Tuple

import torch

from kvtier.kernels import RowMap

from kvtier.kernels.layouts import host_layout

from . import link_copy
from .launch import launch
from .dma_plan import plan, runs, shape_2d

Runs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Staging:
    """A device staging buffer for one host component group and one transfer."""

    def __init__(self, host_buf: torch.Tensor, layout: str, page_size: int, n_slots: int,
                 layers: int, device: torch.device):
        lay = self.layout = host_layout(layout)
        row_shape = lay.row_shape(host_buf.shape[1:])
        self.tensor = torch.empty((host_buf.shape[0], *lay.shape(layers=layers, slots=n_slots, page_size=page_size,
                                                                  row_shape=row_shape)),
                                  dtype=host_buf.dtype, device=device)
        p = page_size if lay.paged else 1
        self.map = RowMap.stack([RowMap.from_host_layout(self.tensor[c], layout, p)
                                 for c in range(self.tensor.shape[0])])
        self.index = torch.arange(n_slots, dtype=torch.int64, device=device)

    def copy_runs(self, host_buf: torch.Tensor, host_layer: int, run_arrays: Runs, to_host: bool) -> None:
        """Every run between the host buffer (from layer ``host_layer``) and staging."""
        ld = 1 + self.layout.layer_dim          # buffers are (C, ...)
        host_view = host_buf.narrow(ld, host_layer, self.tensor.shape[ld])
        shape = shape_2d(host_view, self.tensor, 1 + self.layout.unit_dim)
        base = host_layer * host_buf.stride(ld) * host_buf.element_size()
        link_copy.issue(plan(shape, *run_arrays, host_base=base), host_buf, self.tensor, to_host)


def backup(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
           run_list, by_page, config, verdict=None) -> None:
    """Device rows ``didx`` of layers dev_layer.. -> host layers host_layer.. at the runs."""
    st = Staging(host_buf, layout, page_size, didx.numel(), num_layers, didx.device)
    launch(op, dev_map, didx, st.map, st.index.to(didx.dtype), src_layer=dev_layer, dst_layer=0,
           num_layers=num_layers, by_page=by_page, config=config, strategy="dma",
           verdict=verdict)
    st.copy_runs(host_buf, host_layer, run_list, to_host=True)


def load(op, dev_map, didx, host_buf, layout, page_size, dev_layer, host_layer, num_layers,
         run_list, by_page, config, verdict=None) -> None:
    """Host layers host_layer.. at the runs -> device rows ``didx`` of layers dev_layer.."""
    st = Staging(host_buf, layout, page_size, didx.numel(), num_layers, didx.device)
    st.copy_runs(host_buf, host_layer, run_list, to_host=False)
    launch(op, st.map, st.index.to(didx.dtype), dev_map, didx, src_layer=0, dst_layer=dev_layer,
           num_layers=num_layers, by_page=by_page, config=config, strategy="dma",
           verdict=verdict)
