"""What a benchmark run measures: grids of points, as data.

A grid is a cross product of operations, host layouts, row sizes, page sizes,
transfer sizes, strategies and program caps. A preset is a union of grids chosen to
answer the issue's questions within a time budget: how each operation scales with the
transfer size, how row size and page size move it, and what each host layout costs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace

from kvtier.kernels.layouts import NAMES
from kvtier.kernels.ops import Op

from .workload import OPS, Shape

ROW_SIZES = (128, 256, 576, 656, 1024, 4096)
PAGE_SIZES = (1, 16, 64, 128)
TOKENS = (64, 256, 1024, 4096, 16384, 65536)
LAYOUTS = NAMES
MLA_ROWS = (576, 656)   # MLA latent rows: one component; every other size is K and V
# torch: index_select / copy_ / index_copy_ of the rows; torch copy_: one contiguous copy
# of the same bytes; the engines' own kernels where they can run (bench/sgl_baseline.py,
# bench/vllm_baseline.py).
BASELINES = ("torch", "torch copy_", "sgl_kernel", "vllm")


@dataclass(frozen=True)
class Grid:
    ops: tuple = OPS
    layouts: tuple = ("layer_first",)
    row_bytes: tuple = (1024,)
    page_sizes: tuple = (64,)
    tokens: tuple = TOKENS
    strategies: tuple = ("kernel", "dma")   # the pools' ways across the link
    program_caps: tuple = ()      # copy_rows points with their grid capped to these counts

    def points(self):
        """(op, layout, row_bytes, page_size, tokens) for every point."""
        for op, layout, row, page, n in itertools.product(
                self.ops, self.layouts, self.row_bytes, self.page_sizes, self.tokens):
            if n % page:
                continue
            if not Op.parse(op).crosses_link and layout != self.layouts[0]:
                continue   # gather and scatter never touch the host: one layout is enough
            yield op, layout, row, page, n


@dataclass(frozen=True)
class Sweep:
    grids: tuple
    max_layers: int = 16
    max_bytes: int = 64 << 20      # per transfer: fewer layers for the largest rows
    ceiling_bytes: int = 256 << 20
    warmup: int = 3                # calls after the verified one, before timing
    iters: int = 50                # timed calls per point, at most
    min_iters: int = 20            # timed calls per point, at least (slow points too)
    baselines: tuple = BASELINES
    hardware: bool = True

    def shape(self, layout: str, row: int, page: int, tokens: int) -> Shape:
        comps = 1 if row in MLA_ROWS else 2
        per_layer = comps * tokens * row
        layers = max(1, min(self.max_layers, self.max_bytes // per_layer))
        return Shape(components=comps, layers=layers, row_bytes=row, page_size=page,
                     tokens=tokens, layout=layout)

    def points(self):
        """[(shape, op, strategies, caps)], each (shape, op) once with the strategies and
        caps of every grid that has it; in grid order (a time budget cuts the last grids),
        grouped by shape within a grid (buffers are built once per shape)."""
        merged = {}
        for gi, g in enumerate(self.grids):
            for op, layout, row, page, n in g.points():
                key = (self.shape(layout, row, page, n), op)
                first, strats, caps = merged.get(key, (gi, (), ()))
                merged[key] = (first, _union(strats, g.strategies), _union(caps, g.program_caps))
        order = sorted(merged, key=lambda k: (merged[k][0], k[0].layout, k[0].row_bytes, k[0].page_size,
                                              k[0].tokens, OPS.index(k[1])))
        return [(shape, op, merged[(shape, op)][1], merged[(shape, op)][2]) for shape, op in order]


def _union(a: tuple, b: tuple) -> tuple:
    return a + tuple(x for x in b if x not in a)


# The default on an accelerator: about 220 (shape, operation) points, a few minutes on an H200.
HARDWARE = Sweep(grids=(
    # GB/s against transfer size, per strategy and program cap (the plot).
    Grid(row_bytes=(1024,), page_sizes=(64,), program_caps=(1, 2, 4, 8, 32)),
    # Row sizes, token-granular and paged.
    Grid(row_bytes=ROW_SIZES, page_sizes=(1, 64), tokens=(1024, 16384)),
    # Host layouts against page sizes (256 B and 1 KiB rows: pages of 256 B to 128 KiB).
    Grid(ops=("backup", "load_layer", "load"), layouts=LAYOUTS, row_bytes=(256, 1024),
         page_sizes=PAGE_SIZES, tokens=(16384,)),
))

# Every combination the issue lists (hours on real hardware; for tuning sessions).
FULL = Sweep(grids=(Grid(layouts=LAYOUTS, row_bytes=ROW_SIZES, page_sizes=PAGE_SIZES,
                         program_caps=(1, 2, 4, 8, 16, 32)),))

# CPU smoke run: every operation and engine over two sizes (the plot), then both
# layouts, a power-of-two and a 656 B row, token and page granular; under the
# interpreter each call takes milliseconds.
SMOKE = Sweep(grids=(
    Grid(row_bytes=(128,), page_sizes=(16,), tokens=(32, 64), program_caps=(2,)),
    Grid(layouts=("layer_first", "page_head"), row_bytes=(128, 656), page_sizes=(1, 16), tokens=(32,)),
), max_layers=2, max_bytes=1 << 20, ceiling_bytes=16 << 20, warmup=0, iters=2, min_iters=2,
    baselines=("torch", "torch copy_"), hardware=False)


def with_overrides(base: Sweep, **dims) -> Sweep:
    """``base`` with some grid dimensions fixed (CLI flags): one grid over the given
    dimensions, the rest taken from the base's first grid."""
    dims = {k: tuple(v) for k, v in dims.items() if v}
    if not dims:
        return base
    names = {f.name for f in fields(Grid)}
    unknown = set(dims) - names
    if unknown:
        raise ValueError(f"unknown sweep dimensions {sorted(unknown)}; known: {sorted(names)}")
    return replace(base, grids=(replace(base.grids[0], **dims),))
