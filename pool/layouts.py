"""Host layouts as data: the dim order of a host buffer ``(C, ...)`` per layout.

Symbols: L layers, N token slots, pages (N / P), P page_size, H heads and D head_dim
of a row (page_head splits a row into heads), row = the row's own dims.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence, Tuple

import torch

from kvtier.kernels import LAYOUTS
from kvtier.kernels.errors import fail

DIMS = {
    "layer_first": ("L", "N", "row"),
    "page_first": ("N", "L", "row"),
    "page_first_direct": ("pages", "L", "P", "row"),
    "page_head": ("pages", "H", "P", "L", "D"),
}
assert tuple(DIMS) == LAYOUTS


def check_layout(layout: str) -> None:
    if layout not in DIMS:
        raise fail("layout", layout, f"must be one of {LAYOUTS}")


def is_paged(layout: str) -> bool:
    """Page-major layouts hold a page, not a slot, as their unit: they move whole pages."""
    return "pages" in DIMS[layout]


def unit_dim(layout: str) -> int:
    """Dim of the ``(C, ...)`` buffer indexed by slot (or page, for page layouts)."""
    d = DIMS[layout]
    return 1 + d.index("pages" if is_paged(layout) else "N")


def layer_dim(layout: str) -> int:
    return 1 + DIMS[layout].index("L")


def shape(layout: str, *, comps: int, layers: int, slots: int, page_size: int,
          row_shape: Sequence[int]) -> Tuple[int, ...]:
    """Shape of a host buffer holding ``comps`` components with equal rows."""
    sizes = {"L": layers, "N": slots, "pages": slots // page_size, "P": page_size,
             "H": math.prod(row_shape[:-1]), "D": row_shape[-1]}
    out = [comps]
    for d in DIMS[layout]:
        out.extend(row_shape if d == "row" else [sizes[d]])
    return tuple(out)


def contiguous_pieces(*views: torch.Tensor) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Split equally shaped views into the fewest pieces that are contiguous in all of
    them (one bulk copy each): the leading dims are iterated, the dense tail is kept."""
    shape_ = views[0].shape
    split = next(s for s in range(len(shape_) + 1) if all(_dense_from(v, s) for v in views))
    for idx in _product(shape_[:split]):
        yield tuple(v[idx] for v in views)


def _dense_from(t: torch.Tensor, s: int) -> bool:
    expect = 1
    for size, stride in zip(reversed(t.shape[s:]), reversed(t.stride()[s:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


def _product(sizes) -> Iterator[tuple]:
    if not sizes:
        yield ()
        return
    for i in range(sizes[0]):
        for rest in _product(sizes[1:]):
            yield (i, *rest)
