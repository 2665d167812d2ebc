"""Gather and scatter: all layers' rows of a device pool at given slots (or pages) into
one contiguous buffer per component group, and back (prefill-decode transfer, storage
backends, CPU copies). One launch per group of components covers every layer.

The copies are bound to the buffers' *layout* (`Layout`, per pool, operation and call
shape: a pure function of them), so a call only passes its buffers' addresses and no
buffer is kept alive; the caller's buffers (a scatter's data, a gather's ``out``) are
checked on every call."""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch

from kvtier.kernels import RowMap
from kvtier.kernels.copy_rows import BY_VERDICT, BoundCopy, _dummy, run
from kvtier.kernels.errors import fail
from kvtier.kernels.index_check import Checks, checks_on
from kvtier.kernels.iota import iota
from kvtier.kernels.storage_watch import Watch, check_storage, watch
from kvtier.kernels.validate import check_index, index_ok

from kvtier.kernels.ops import GATHER, SCATTER, Op

from .launch import DEBUG, bind_launch, log, log_launch, lookup, lookup_state


def group_shape(pool, names, n_slots: int, pages: bool):
    """Shape of one group's contiguous buffer: ``(C, L, n, *row)`` or ``(C, L, n/P, P, *row)``."""
    c = pool.components[names[0]]
    tok = (n_slots // pool.page_size, pool.page_size) if pages else (n_slots,)
    return (len(names), c.num_layers, *tok, *c.row_shape)


def contiguous_map(t: torch.Tensor, pool, pages: bool) -> RowMap:
    """Map over a ``(C, L, tokens..., *row)`` buffer, all its components in one map."""
    page = pool.page_size if pages else 1
    return RowMap.stack([RowMap.from_stacked(t[i], page, paged_dims=pages) for i in range(t.shape[0])])


class _Group(NamedTuple):
    """One group's copy of a `Layout`: the bound copy, the pool side's addresses, the
    buffer side's component stride in the copy's units, the pool's map (for the torch
    reference), the word alignment the buffers must have and the tensor that stands in
    for a stacked side's unused tables."""

    bound: BoundCopy
    pool_side: tuple
    comp_units: int
    pool_map: RowMap
    align: int
    dummy: torch.Tensor


class Layout:
    """The copies of one call shape (per pool, operation, page mode, slot count and
    lookup state) between the pool and contiguous group buffers of the shapes
    `group_shape` gives: made from the first call's buffers, used with any buffers of
    those shapes and alignment."""

    def __init__(self, pool, op: Op, bufs: List[torch.Tensor], pages: bool, page_indices: bool, n_slots: int,
                 into_pool: bool):
        self.shapes = [(group_shape(pool, names, n_slots, pages), pool.components[names[0]].dtype)
                       for names, _ in pool.groups]
        self.into_pool, self.op, self.pages, self.page_indices = into_pool, op, pages, page_indices
        self.groups, self.watch = [], Watch((), (), ())
        for (names, m), buf in zip(pool.groups, bufs):
            layers = pool.components[names[0]].num_layers
            cmap = contiguous_map(buf, pool, pages)
            pool_side, buf_side = (m.pages_as_rows(), cmap.pages_as_rows()) if page_indices else (m, cmap)
            src, dst = (buf_side, pool_side) if into_pool else (pool_side, buf_side)
            config = lookup(op, cmap, m, n_slots, layers) if into_pool else lookup(op, m, cmap, n_slots, layers)
            bound = bind_launch(op, src, dst, num_layers=layers,
                                n_rows=n_slots // (pool.page_size if page_indices else 1),
                                by_page=pages and not page_indices, config=config)
            sides = bound.sides(src, dst)
            half = sides[:4] if not into_pool else sides[4:]
            self.groups.append(_Group(bound, half, cmap.comp_stride // bound.unit, pool_side, buf_side.align,
                                      _dummy(pool.device)))
            self.watch = self.watch + watch(m, 0, layers)      # the pool's tensors its maps rest on
        self.bounds = [g.bound for g in self.groups]
        self.rows: Dict[torch.dtype, torch.Tensor] = {}     # the buffer side's rows 0 .. n-1, per index dtype

    def fits(self, bufs: List[torch.Tensor]) -> bool:
        """Whether ``bufs`` are contiguous in the layout's shapes and aligned as it assumes
        (fresh allocations are)."""
        for b, (shape, dtype), g in zip(bufs, self.shapes, self.groups):
            if b.shape != shape or b.dtype != dtype or not b.is_contiguous() or b.data_ptr() % g.align:
                return False
        return True

    def run(self, pool, bufs: List[torch.Tensor], idx: torch.Tensor, checks,
            verdict: Optional[torch.Tensor] = None) -> None:
        """The call: every group's copy between the pool at ``idx`` and its buffer (rows
        0 .. n-1 of it), the lists checked by ``checks``, or gated by the ``verdict`` words
        of a check launch this call made already (a call of several steps:
        `kvtier.pool.cpu_copy`)."""
        check_storage(self.watch)       # the pool's own tensors, where its maps were built
        bounds, sides = self.bounds, []
        for g, b in zip(self.groups, bufs):
            buf = (b.data_ptr(), g.dummy, g.dummy, g.comp_units)
            sides.append((*buf, *g.pool_side) if self.into_pool else (*g.pool_side, *buf))
        if log.isEnabledFor(DEBUG):
            for b in bounds:
                log_launch(self.op, b.config.strategy, b.config, idx.numel(), idx.numel() * b.op_bytes)
        rows = self.rows.get(idx.dtype)
        if rows is None:
            rows = self.rows[idx.dtype] = iota(idx.numel(), idx.dtype, idx.device)
        si, di = (rows, idx) if self.into_pool else (idx, rows)
        if verdict is None:
            run(bounds, sides, si, di, checks, pool.device, None if bounds[0].runner == "kernel" else
                self.maps(pool, bufs))
        elif bounds[0].runner != "kernel":
            run(bounds, sides, si, di, None, pool.device, self.maps(pool, bufs))
        else:
            for b, sd in zip(bounds, sides):
                b(si, di, sd, BY_VERDICT, verdict)

    def maps(self, pool, bufs: List[torch.Tensor]) -> list:
        """(source, destination) maps of each group's copy with ``bufs``: what the torch
        reference copies between."""
        out = []
        for g, b in zip(self.groups, bufs):
            cmap = contiguous_map(b, pool, self.pages)
            cmap = cmap.pages_as_rows() if self.page_indices else cmap
            out.append((cmap, g.pool_map) if self.into_pool else (g.pool_map, cmap))
        return out


def _layout(pool, op: Op, bufs, pages: bool, page_indices: bool, n_slots: int, into_pool: bool) -> Layout:
    """The pool's `Layout` for this call shape (kept per pool: a few shapes at a time)."""
    key = (op, pages, page_indices, n_slots, *lookup_state())
    laid = pool._gather_layouts.get(key)
    if laid is None or not laid.fits(bufs):
        laid = Layout(pool, op, bufs, pages, page_indices, n_slots, into_pool)
        if laid.fits(bufs):
            pool._gather_layouts.put(key, laid)
    return laid


def _checks(pool, pages: bool, page_indices: bool, n: int, into_pool: bool) -> Optional[Checks]:
    """The checks of a gather's or scatter's pool list (below the pool's slots, or pages
    with ``page_indices``) and of the buffer side's rows (kvtier's own, 0..n-1)."""
    if not checks_on(pool.check):
        return None
    limit = pool.size // pool.page_size if page_indices else pool.size
    page = pool.page_size if pages and not page_indices else 1
    listed, buffer = ("indices", limit, page), ("buffer rows", n, page)
    return Checks.of(buffer, listed) if into_pool else Checks.of(listed, buffer)


def _slots(pool, indices: torch.Tensor, pages: bool):
    """(the list the copy reads, whether it holds page numbers): page indices address the
    pool directly where every group stores a page as one contiguous run
    (`DevicePool.page_runs`), else they become the pages' slots."""
    if not pages:
        return indices, False
    if pool.page_runs:
        return indices, True
    p = pool.page_size
    return (indices[:, None] * p + iota(p, indices.dtype, indices.device)).reshape(-1), False


def gather(pool, indices: torch.Tensor, *, pages: bool = False,
           out: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    if not index_ok(indices, pool.index_device):
        check_index("indices", indices, pool.index_device)
    n_slots = indices.numel() * (pool.page_size if pages else 1)
    if out is not None:
        bufs = _out_buffers(pool, out, n_slots, pages)
    else:
        # (the shape as separate arguments: torch parses them faster than one tuple)
        bufs = [torch.empty(*shape, dtype=dtype, device=pool.device)
                for _, shape, dtype in _group_specs(pool, n_slots, pages)]
    _move_groups(pool, indices, bufs, pages, GATHER, None, into_pool=False)
    if out is not None:
        return out
    views = {}
    for (names, _), buf in zip(pool.groups, bufs):
        views.update(zip(names, buf.unbind()))      # (one call for a group's views: indexing costs twice)
    return views


def gather_groups(pool, indices: torch.Tensor, bufs: List[torch.Tensor], pages: bool, op: Op = GATHER,
                  verdict: Optional[torch.Tensor] = None) -> None:
    """Fill group buffers ``bufs`` (shapes as `group_shape`) from slot (or page) ``indices``
    (``verdict``: see `Layout.run`)."""
    _move_groups(pool, indices, bufs, pages, op, verdict, into_pool=False)


def scatter(pool, indices: torch.Tensor, data: Dict[str, torch.Tensor], *, pages: bool = False) -> None:
    if not index_ok(indices, pool.index_device):
        check_index("indices", indices, pool.index_device)
    bufs = _buffers(pool, data, indices.numel() * (pool.page_size if pages else 1), pages, "data")
    _move_groups(pool, indices, bufs, pages, SCATTER, None, into_pool=True)


def scatter_groups(pool, indices: torch.Tensor, bufs: List[torch.Tensor], pages: bool, op: Op = SCATTER,
                   verdict: Optional[torch.Tensor] = None) -> None:
    """Write group buffers (shapes as `group_shape`) back at slot (or page) ``indices``
    (``verdict``: see `Layout.run`)."""
    _move_groups(pool, indices, bufs, pages, op, verdict, into_pool=True)


def _move_groups(pool, indices, bufs, pages: bool, op: Op, verdict, into_pool: bool) -> None:
    idx, page_indices = _slots(pool, indices, pages)
    n = idx.numel()
    if not n:
        return
    n_slots = n * (pool.page_size if page_indices else 1)
    laid = _layout(pool, op, bufs, pages, page_indices, n_slots, into_pool)
    laid.run(pool, bufs, idx, _checks(pool, pages, page_indices, n, into_pool), verdict)


def _out_buffers(pool, out, n_slots: int, pages: bool) -> List[torch.Tensor]:
    """The group buffers behind ``out`` (what an earlier gather of this shape returned),
    every tensor checked on every call: the dict holds the pool's components in order,
    each the slice of its group buffer at its position (a group buffer of the shape,
    dtype and device a gather of ``n_slots`` makes, contiguous); else `_out_checked`
    names what is wrong."""
    specs = _group_specs(pool, n_slots, pages)
    if type(out) is dict and list(out) == pool._component_names:
        device, bufs = pool.device, []
        for names, shape, dtype in specs:
            base = out[names[0]]._base
            if (base is None or base.shape != shape or base.dtype is not dtype or base.device != device
                    or not base.is_contiguous()):
                break
            first, step, part = base.data_ptr(), base.stride(0) * base.element_size(), shape[1:]
            for i, name in enumerate(names):
                t = out[name]
                if t._base is not base or t.data_ptr() != first + i * step or t.shape != part:
                    break
            else:
                bufs.append(base)
                continue
            break
        else:
            return bufs
    return _out_checked(pool, out, n_slots, pages)


def _group_specs(pool, n_slots: int, pages: bool) -> list:
    """(names, group buffer shape, dtype) of each group for ``n_slots`` slots (kept per
    pool: a pure function of the count)."""
    key = (pages, n_slots)
    specs = pool._gather_specs.get(key)
    if specs is None:
        specs = pool._gather_specs.put(key, [(names, torch.Size(group_shape(pool, names, n_slots, pages)),
                                              pool.components[names[0]].dtype) for names, _ in pool.groups])
    return specs


def _out_checked(pool, out, n_slots: int, pages: bool) -> List[torch.Tensor]:
    """`_out_buffers`, naming the first argument that is wrong."""
    into = _buffers(pool, out, n_slots, pages, "out")
    why = "must be a tensor an earlier gather() of this shape returned (its group buffer)"
    for (names, _), buf in zip(pool.groups, into):
        base = out[names[0]]._base        # the group buffer the first one is a view of
        for i, name in enumerate(names):
            t = out[name]
            if base is None or t._base is not base or t.data_ptr() != base[i].data_ptr():
                raise fail(f"out[{name!r}]", tuple(t.shape), why)
        if buf is not base:               # views of a buffer no gather made (not contiguous)
            raise fail(f"out[{names[0]!r}]", tuple(out[names[0]].shape), why)
    return into


def _buffers(pool, data, n_slots: int, pages: bool, arg: str) -> List[torch.Tensor]:
    """One contiguous buffer per group from a dict shaped as `gather` returns (``arg``
    names it in errors): the group buffer behind gather()'s views, else a stacked copy.
    Every tensor is checked before anything moves."""
    if not isinstance(data, dict) or list(data) != list(pool.components):
        raise fail(arg, list(data) if isinstance(data, dict) else type(data).__name__,
                   f"must be a dict with exactly the pool's components {list(pool.components)}, in that order")
    bufs = []
    device = pool.device
    for names, _ in pool.groups:
        shape = group_shape(pool, names, n_slots, pages)[1:]
        for name in names:
            t, c = data[name], pool.components[name]
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != c.dtype or t.device != device:
                got = (tuple(t.shape), t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
                raise fail(f"{arg}[{name!r}]", got, f"must be {(shape, c.dtype, str(device))}")
        bufs.append(_group_of(data, names))
    return bufs


def _group_of(data, names) -> torch.Tensor:
    """The group buffer whose dim-0 slices, in order, are ``names``' tensors (what gather()
    returns), else a stacked copy of them."""
    parts = [data[n] for n in names]
    base = parts[0]._base
    if base is not None and base.shape[0] == len(names) and base.is_contiguous():
        start, step = base.data_ptr(), base.stride(0) * base.element_size()
        for i, p in enumerate(parts):
            if p._base is not base or p.data_ptr() != start + i * step or not p.is_contiguous():
                break
        else:
            return base
    return torch.stack([p.contiguous() for p in parts])
