"""Plain-torch implementation of the row copy: the test oracle, and the fallback where
Triton cannot run. Same signature and checks as `kvtier.kernels.copy_rows` (the function)."""
from __future__ import annotations

from typing import Optional

import torch

from .rowmap import RowMap
from .validate import check_copy


def layer_rows(m: RowMap, comp: int, layer: int) -> torch.Tensor:
    """A uint8 view ``(pages, P, n_chunks, chunk_bytes)`` of one layer of one component."""
    if m.is_table:
        owner, start = m.segments[comp * m.num_layers + layer]
    else:
        owner = m.segments[0][0]
        start = m.base + comp * m.comp_stride + layer * m.layer_stride
    st = owner.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(st)
    return flat.as_strided((m.num_pages, m.page_size, m.n_chunks, m.chunk_bytes),
                           (m.page_stride, m.token_stride, m.chunk_stride, 1), start - st.data_ptr())


def copy_rows_reference(src: RowMap, src_indices: torch.Tensor, dst: RowMap, dst_indices: torch.Tensor,
                        *, src_layer: int = 0, dst_layer: int = 0, num_layers: Optional[int] = None,
                        by_page: bool = False, config=None, check: bool = True) -> None:
    """For every component c and layer l < num_layers:
    ``dst[c, dst_layer + l, dst_indices[j]] = src[c, src_layer + l, src_indices[j]]`` (bytes)."""
    _, num_layers = check_copy(src, src_indices, dst, dst_indices, src_layer, dst_layer,
                               num_layers, by_page, check_values=check)
    if src_indices.numel() == 0:
        return
    si, di = src_indices.long(), dst_indices.long()
    for c in range(src.num_components):
        for l in range(num_layers):
            sv = layer_rows(src, c, src_layer + l)
            dv = layer_rows(dst, c, dst_layer + l)
            s, d = si.to(sv.device), di.to(dv.device)
            # Both sides hold row_bytes per row, possibly split into different chunks.
            rows = sv[s // src.page_size, s % src.page_size].reshape(-1, dst.n_chunks, dst.chunk_bytes)
            dv[d // dst.page_size, d % dst.page_size] = rows.to(dv.device)
