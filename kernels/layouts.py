"""Host layouts, defined once, as data: the dim order of one component's host buffer.

Symbols: ``L`` layers, ``N`` token slots, ``pages`` (N / P), ``P`` page_size, ``row`` the
row's own dims; ``page_head`` splits a row into ``H`` heads of ``D`` elements, which puts
the page's tokens between the heads.

    layer_first        (L, N, *row)
    page_first         (N, L, *row)
    page_first_direct  (pages, L, P, *row)
    page_head          (pages, H, P, L, D)

Everything else is derived from the dims: the shape of a buffer, which dim a host index
steps along (a slot, or a page for page-major layouts), which dim is the layer, and the
strides a `RowMap` reads (`row_strides`). Pools, the dma path, autotune, the benchmark,
the CLI and the tests take layouts from here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

from kvtier.errors import fail


@dataclass(frozen=True)
class HostLayout:
    name: str
    dims: Tuple[str, ...]

    @property
    def paged(self) -> bool:
        """Page-major layouts index a page, not a slot: they move whole pages."""
        return "pages" in self.dims

    @property
    def unit_dim(self) -> int:
        """Dim of a component's buffer indexed by a host unit (slot, or page)."""
        return self.dims.index("pages" if self.paged else "N")

    @property
    def layer_dim(self) -> int:
        return self.dims.index("L")

    def shape(self, *, layers: int, slots: int, page_size: int, row_shape: Sequence[int]) -> Tuple[int, ...]:
        """Shape of one component's buffer: ``slots`` token slots of ``row_shape`` rows."""
        sizes = {"L": layers, "N": slots, "pages": slots // page_size, "P": page_size,
                 "H": math.prod(row_shape[:-1]), "D": row_shape[-1]}
        out = []
        for d in self.dims:
            out.extend(row_shape if d == "row" else [sizes[d]])
        return tuple(out)

    def row_shape(self, component_shape: Sequence[int]) -> Tuple[int, ...]:
        """The row dims of a component buffer of this layout (page_head: ``(H, D)``)."""
        if "H" in self.dims:
            return (component_shape[self.dims.index("H")], component_shape[self.dims.index("D")])
        return tuple(component_shape[len(self.dims) - 1:])


LAYOUTS: Dict[str, HostLayout] = {l.name: l for l in (
    HostLayout("layer_first", ("L", "N", "row")),
    HostLayout("page_first", ("N", "L", "row")),
    HostLayout("page_first_direct", ("pages", "L", "P", "row")),
    HostLayout("page_head", ("pages", "H", "P", "L", "D")),
)}
NAMES = tuple(LAYOUTS)


def host_layout(name, arg: str = "layout") -> HostLayout:
    """The layout called ``name``; a HostLayout passes through."""
    if isinstance(name, HostLayout):
        return name
    try:
        return LAYOUTS[name]
    except (KeyError, TypeError):
        raise fail(arg, name, f"must be one of {NAMES}") from None
