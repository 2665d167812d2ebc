"""The bulk copies of the dma strategy: host runs <-> staging as 2-D copies.

A run of ``k`` consecutive host units (slots, or pages in page-major layouts) is one block
of the host buffer per component and layer; the staging buffer holds the same block at
the run's staging position. Instead of one copy per contiguous piece (a copy per layer
per component in layer_first), a piece and its repetitions at one fixed stride in both
buffers form one 2-D copy (``height`` rows of ``width`` bytes, ``pitch`` apart), which
the copy engines move in one call (cudaMemcpy2DAsync, aclrtMemcpy2dAsync).

The shape of the copies is found once per (layout, layer range) from the strides, not per
run: the dense tail of both views gives the width, the innermost remaining dim the height,
and the dims left over are looped. All runs then become copies with a few tensor ops.

A transfer moves through a bounded staging ring in chunks of at most ``cap`` units
(`chunks_of`): runs are split at chunk boundaries and each chunk gets its own copies.
Runs and chunks depend only on host index values, which live on the CPU, so both are
kept and found again by value (`runs_of`, `chunks_of`): HiCache passes the same host
indices to every per-layer load of a batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Dict, List, Optional, Tuple

import torch

from kvtier import caches


@dataclass(frozen=True)
class Copies2D:
    """Copies as arrays (bytes, from each buffer's first byte): copy ``i`` moves
    ``height[i]`` rows of ``width[i]`` bytes, rows ``host_pitch`` / ``stage_pitch`` apart."""

    host_off: torch.Tensor
    stage_off: torch.Tensor
    width: torch.Tensor
    height: torch.Tensor
    host_pitch: int
    stage_pitch: int

    def __len__(self) -> int:
        return self.host_off.numel()

    # Worked out once per copies: a kept chunk is issued again without tensor work.
    _kept: Dict[tuple, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def rows(self) -> List[Tuple[int, int, int, int]]:
        """(host_off, stage_off, width, height) per copy, as Python ints."""
        return self._rows

    @cached_property
    def _rows(self) -> List[Tuple[int, int, int, int]]:
        return torch.stack([self.host_off, self.stage_off, self.width, self.height], 1).tolist()

    def pieces(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row of every copy as a 1-D piece: (host offsets, staging offsets, sizes)."""
        return self._pieces

    @cached_property
    def _pieces(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r, step = _expand(self.height)
        return (self.host_off[r] + step * self.host_pitch, self.stage_off[r] + step * self.stage_pitch,
                self.width[r])

    def addresses(self, host0: int, stage0: int, to_host: bool):
        """(destination addresses, source addresses, sizes) of every piece as int64 CPU
        tensors (the batch call's three arrays), kept per pair of buffer addresses."""
        key = (host0, stage0, to_host)
        hit = self._kept.get(key)
        if hit is None:
            h, s, w = self.pieces()
            h, s = h + host0, s + stage0
            hit = (h, s, w) if to_host else (s, h, w)
            if len(self._kept) >= 8:          # a chunk meets a few staging slots only
                self._kept.clear()
            self._kept[key] = hit
        return hit

    @cached_property
    def mean_height(self) -> float:
        """Rows per copy, on average (the runtimes' batch call wins for short copies)."""
        return int(self.height.sum()) / max(len(self), 1)

    @cached_property
    def nbytes(self) -> int:
        return int((self.width * self.height).sum())


@dataclass(frozen=True)
class Shape2D:
    """How one run's block splits into 2-D copies; strides in bytes.

    unit_in_width: the unit dim is the outermost dim of the dense tail (width = k * width).
    height_dim: (size, host stride, staging stride) of the dim copied as rows, or None;
        size None means the unit dim (height = k).
    loops: (size, host stride, staging stride) of the dims iterated per run.
    """

    width: int
    unit_in_width: bool
    height_dim: Optional[Tuple[Optional[int], int, int]]
    loops: Tuple[Tuple[int, int, int], ...]
    unit_strides: Tuple[int, int]       # host, staging bytes per unit


def shape_2d(host_view: torch.Tensor, staging: torch.Tensor, unit_dim: int) -> Shape2D:
    """The copy shape for runs along ``unit_dim`` between two views of equal shape except
    along ``unit_dim``. Never merges the unit dim with another: the result holds for runs
    of any length."""
    e = host_view.element_size()
    sizes = list(host_view.shape)
    hs = [s * e for s in host_view.stride()]
    ss = [s * e for s in staging.stride()]
    # Dense tail: dims contiguous in both views, innermost first; the unit dim may close it.
    width, unit_in_width, t = e, False, len(sizes)
    while t > 0:
        d = t - 1
        if d != unit_dim and sizes[d] == 1:
            t -= 1
            continue
        if hs[d] != width or ss[d] != width:
            break
        t -= 1
        if d == unit_dim:
            unit_in_width = True
            break
        width *= sizes[d]
    # Outer dims, innermost last, with size-1 dims dropped and adjacent dims merged where
    # one stride step spans the inner dim in both views.
    outer: List[list] = []
    for d in range(t):
        if d == unit_dim:
            outer.append([None, hs[d], ss[d]])
        elif sizes[d] != 1:
            outer.append([sizes[d], hs[d], ss[d]])
    merged: List[list] = []
    for dim in outer:
        prev = merged[-1] if merged else None
        if (prev is not None and prev[0] is not None and dim[0] is not None
                and prev[1] == dim[1] * dim[0] and prev[2] == dim[2] * dim[0]):
            prev[0] *= dim[0]
            prev[1], prev[2] = dim[1], dim[2]
        else:
            merged.append(dim)
    height = tuple(merged.pop()) if merged else None
    loops = tuple(tuple(m) for m in merged)
    return Shape2D(width, unit_in_width, height, loops, (hs[unit_dim], ss[unit_dim]))


def copies_2d(shape: Shape2D, host_units: torch.Tensor, stage_units: torch.Tensor,
         lengths: torch.Tensor, host_base: int = 0) -> Copies2D:
    """Copies for runs (host unit, staging unit, length), int64 CPU tensors;
    ``host_base`` is added to every host offset (the layer range's start)."""
    hu, su, k = host_units, stage_units, lengths
    if any(size is None for size, _, _ in shape.loops):
        # The unit dim is iterated: every unit of a run is a copy of its own.
        r, step = _expand(k)
        hu, su, k = hu[r] + step, su[r] + step, torch.ones_like(r)
    h_unit, s_unit = shape.unit_strides
    host = hu * h_unit + host_base
    stage = su * s_unit
    width = k * shape.width if shape.unit_in_width else torch.full_like(k, shape.width)
    if shape.height_dim is None:
        height, hp, sp = torch.ones_like(k), 0, 0
    else:
        size, hp, sp = shape.height_dim
        height = k.clone() if size is None else torch.full_like(k, size)
    for size, h_stride, s_stride in shape.loops:
        if size is None:
            continue            # the unit dim: runs were split into single units above
        steps = torch.arange(size, dtype=torch.int64)
        host = (host[:, None] + steps * h_stride).flatten()
        stage = (stage[:, None] + steps * s_stride).flatten()
        width, height = width.repeat_interleave(size), height.repeat_interleave(size)
    return Copies2D(host, stage, width, height, hp, sp)


def _expand(counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """For ``counts[i]`` items of each entry i: (entry of every item, its step within the entry)."""
    r = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    return r, torch.arange(r.numel()) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)


def runs(units: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Maximal runs of consecutive host units (in the given order) as int64 CPU tensors:
    (first host unit, first staging unit, length); staging unit j holds the j-th unit."""
    units = units.to("cpu", torch.int64)
    n = units.numel()
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty, empty
    starts = torch.cat([torch.zeros(1, dtype=torch.int64),
                        torch.nonzero(units[1:] - units[:-1] != 1).flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return units[starts], starts, lengths


def split_runs(runs_: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], cap: int):
    """Runs (host unit, staging unit, length) cut at every multiple of ``cap`` staging
    units, grouped by chunk: a list with one (host units, staging units within the chunk,
    lengths) triple per chunk of ``cap`` units."""
    hu, su, k = runs_
    if k.numel() == 0:
        return []
    n = int(su[-1] + k[-1])
    if n <= cap:                # one chunk (the usual transfer): the runs as they are
        return [runs_]
    starts = torch.unique(torch.cat([su, torch.arange(0, n, cap, dtype=torch.int64)]))   # sorted
    r = torch.searchsorted(su, starts, right=True) - 1
    host = hu[r] + (starts - su[r])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    bounds = torch.searchsorted(starts, torch.arange(0, n, cap, dtype=torch.int64)).tolist() + [starts.numel()]
    out = []
    for c in range(len(bounds) - 1):
        a, b = bounds[c], bounds[c + 1]
        out.append((host[a:b], starts[a:b] - c * cap, lengths[a:b]))
    return out


@dataclass(frozen=True)
class Chunk:
    """One chunk of a transfer: staging units ``first .. first + count`` of the transfer
    (so index positions ``first * unit ..``), its copies, and its host units."""

    first: int
    count: int
    copies: Copies2D
    host_units: torch.Tensor


def chunks_of(runs_: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], shape: Shape2D,
                cap: int) -> List[Chunk]:
    """The transfer's chunks of at most ``cap`` units with their copies, kept and found
    again for equal runs (compared by value: their bytes are the key) and the same copy
    shape. Host offsets are from the first byte of the layer range (the caller issues
    them from there), so every layer of a layer loop finds the chunks its first layer made."""
    return _CHUNKS.get_or_make((shape, cap, *(_value(t) for t in runs_)), lambda: _make_chunks(runs_, shape, cap))


def _make_chunks(runs_, shape: Shape2D, cap: int) -> List[Chunk]:
    chunks = []
    for c, (hu, su, k) in enumerate(split_runs(runs_, cap)):
        count = int(su[-1] + k[-1])
        units = torch.repeat_interleave(hu - su, k) + torch.arange(count)
        chunks.append(Chunk(c * cap, count, copies_2d(shape, hu, su, k), units))
    return chunks


def runs_of(host_indices: torch.Tensor, unit: int, check=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`runs` of the host units of ``host_indices`` (slots; ``unit`` slots per unit, a page
    in page-major layouts), kept and found again for equal indices (compared by value:
    their bytes are the key, so an index tensor changed in place is never mistaken for its
    old values). ``check``: ``(limit, page)`` the values are checked against first
    (`kvtier.kernels.index_check.check_list_on_host`, naming ``host_indices``), once per
    values and check (a pure function of both). Indices on a device are read back first,
    which waits for it: HiCache's host indices are CPU tensors."""
    idx = host_indices.to("cpu", torch.int64)

    def make():
        if check is not None:
            from kvtier.kernels.index_check import check_list_on_host
            check_list_on_host("host_indices", idx, check[0], check[1], False)
        return runs(idx[::unit] // unit if unit > 1 else idx)
    return _RUNS.get_or_make((unit, check, _value(idx)), make)


def _value(t: torch.Tensor) -> bytes:
    """A CPU int64 tensor's values as bytes (a dict key that compares by value)."""
    return t.numpy().tobytes()


# Runs and chunks by the values of their lists (docs/design.md, "Caches").
_RUNS = caches.bounded("pool.dma_copies._RUNS", 256, key="host list values, unit, check limits",
                       value="runs of consecutive host units (the values checked when made)",
                       stale="not happen: compared by value")
_CHUNKS = caches.bounded("pool.dma_copies._CHUNKS", 256, key="copy shape, chunk cap, runs' values",
                         value="chunks and their 2-D copies", stale="not happen: compared by value")
