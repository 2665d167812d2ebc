"""Gather and scatter: all layers' rows of a device pool at given slots (or pages) into
one contiguous buffer per component group, and back (prefill-decode transfer, storage
backends, CPU copies). One launch per group of components covers every layer.

Each call shape (operation, page mode, slot count) has one prepared `Transfer` per pool
(`DevicePool.gathers`, the pool's own: a few shapes at a time) whose buffer side is a
template of the group buffers' geometry; a call passes its own buffers (a gather's new
or ``out`` buffers, a scatter's data), checked on every call, and no buffer is kept."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from kvtier import caches
from kvtier.errors import fail
from kvtier.kernels import RowMap
from kvtier.kernels.index_check import Checks
from kvtier.kernels.iota import iota
from kvtier.kernels.launcher import layout_of
from kvtier.kernels.ops import GATHER, SCATTER, Op
from kvtier.kernels.transfer import Copy, Transfer
from kvtier.kernels.validate import check_index, index_ok

from . import tuning


def group_shape(pool, names, n_slots: int, pages: bool):
    """Shape of one group's contiguous buffer: ``(C, L, n, *row)`` or ``(C, L, n/P, P, *row)``."""
    c = pool.components[names[0]]
    tok = (n_slots // pool.page_size, pool.page_size) if pages else (n_slots,)
    return (len(names), c.num_layers, *tok, *c.row_shape)


def contiguous_map(t: torch.Tensor, pool, pages: bool) -> RowMap:
    """Map over a ``(C, L, tokens..., *row)`` buffer, all its components in one map."""
    page = pool.page_size if pages else 1
    return RowMap.stack([RowMap.from_stacked(t[i], page, paged_dims=pages) for i in range(t.shape[0])])


caches.declare("pool.gather.GroupCopies.rows", key="index dtype", value="the buffer side's rows 0 .. n-1 (an "
               "iota view)", bound="index dtypes (2) per GroupCopies", stale="-")


class GroupCopies:
    """A pool's gathers or scatters of one call shape (operation, page mode, slot count):
    the `Transfer` between the pool's group maps and templates of group buffers of the
    shapes `group_shape` gives (made from the first call's buffers, holding none of them),
    the buffers' shapes and dtypes, the alignment each must have, and the buffer side's
    rows 0 .. n-1 per index dtype."""

    def __init__(self, pool, op: Op, bufs: List[torch.Tensor], pages: bool, page_indices: bool, n_slots: int,
                 into_pool: bool):
        self.shapes = [(group_shape(pool, names, n_slots, pages), pool.components[names[0]].dtype)
                       for names, _ in pool.groups]
        self.into_pool = into_pool
        copies, self.aligns, tuned_as = [], [], []
        for (names, m), buf in zip(pool.groups, bufs):
            layers = pool.components[names[0]].num_layers
            cmap = contiguous_map(buf, pool, pages)
            pool_side, buf_side = (m.pages_as_rows(), cmap.pages_as_rows()) if page_indices else (m, cmap)
            buf_side = layout_of(buf_side)
            src, dst = (buf_side, pool_side) if into_pool else (pool_side, buf_side)
            copies.append(Copy(src, dst, 0, 0, layers, pages and not page_indices))
            self.aligns.append(buf_side.align)
            tuned_as.append((m, layout_of(cmap), layers))   # (no buffer kept; a call of page indices is tuned by its slots)
        limit = pool.size // pool.page_size if page_indices else pool.size
        page = pool.page_size if pages and not page_indices else 1
        n = n_slots // (pool.page_size if page_indices else 1)
        listed, buffer = ("indices", limit, page), ("buffer rows", n, page)
        checks = Checks(buffer, listed) if into_pool else Checks(listed, buffer)

        def resolve(copy: Copy, rows: int):
            m, cmap, layers = tuned_as[copies.index(copy)]
            src, dst = (cmap, m) if into_pool else (m, cmap)
            return pool.config or tuning.tuned_for(op, src, dst, n_slots, layers), "kernel"
        self.transfer = Transfer(copies, device=pool.device, checks=checks, check=pool.check, resolve=resolve,
                                 epoch=tuning.EPOCH, call_side=0 if into_pool else 1, op=op)
        self.rows: Dict[torch.dtype, torch.Tensor] = {}     # (pool.gather.GroupCopies.rows: registered)

    def fits(self, bufs: List[torch.Tensor]) -> bool:
        """Whether ``bufs`` are contiguous in the shapes and aligned as the templates assume
        (fresh allocations are)."""
        for b, (shape, dtype), align in zip(bufs, self.shapes, self.aligns):
            if b.shape != shape or b.dtype != dtype or not b.is_contiguous() or b.data_ptr() % align:
                return False
        return True

    def move(self, pool, bufs: List[torch.Tensor], idx: torch.Tensor, verdict: Optional[torch.Tensor] = None) -> None:
        """Every group's copy between the pool at ``idx`` and its buffer (rows 0 .. n-1 of
        it), the lists checked by the transfer, or gated by the ``verdict`` words of a
        check launch this call made already (a call of several steps: `kvtier.pool.cpu_copy`)."""
        rows = self.rows.get(idx.dtype)
        if rows is None:
            rows = self.rows[idx.dtype] = iota(idx.numel(), idx.dtype, idx.device)
        si, di = (rows, idx) if self.into_pool else (idx, rows)
        t = self.transfer
        t.check = pool.check        # (the pool's setting as it is now)
        if verdict is None:
            t.launch(si, di, buffers=bufs)
        else:
            t.launch_checked(t.steps(idx.numel()), si, di, None, verdict, True, buffers=bufs)


def _copies(pool, op: Op, bufs, pages: bool, page_indices: bool, n_slots: int, into_pool: bool) -> GroupCopies:
    """The pool's `GroupCopies` for this call shape (kept by the pool: a few shapes at a time)."""
    key = (op, pages, page_indices, n_slots)
    found = pool.gathers.get(key)
    if found is None or not found.fits(bufs):
        found = GroupCopies(pool, op, bufs, pages, page_indices, n_slots, into_pool)
        if found.fits(bufs):
            pool.gathers.put(key, found)
    return found


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
    move_groups(pool, indices, bufs, pages, GATHER, into_pool=False)
    if out is not None:
        return out
    views = {}
    for (names, _), buf in zip(pool.groups, bufs):
        views.update(zip(names, buf.unbind()))      # (one call for a group's views: indexing costs twice)
    return views


def scatter(pool, indices: torch.Tensor, data: Dict[str, torch.Tensor], *, pages: bool = False) -> None:
    if not index_ok(indices, pool.index_device):
        check_index("indices", indices, pool.index_device)
    bufs = _buffers(pool, data, indices.numel() * (pool.page_size if pages else 1), pages, "data")
    move_groups(pool, indices, bufs, pages, SCATTER, into_pool=True)


def move_groups(pool, indices, bufs, pages: bool, op: Op, verdict: Optional[torch.Tensor] = None, *,
                into_pool: bool) -> None:
    """Fill group buffers ``bufs`` (shapes as `group_shape`) from slot (or page) ``indices``,
    or with ``into_pool`` write them back there (``verdict``: see `GroupCopies.move`)."""
    idx, page_indices = _slots(pool, indices, pages)
    n = idx.numel()
    if not n:
        return
    n_slots = n * (pool.page_size if page_indices else 1)
    _copies(pool, op, bufs, pages, page_indices, n_slots, into_pool).move(pool, bufs, idx, verdict)


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
    specs = pool.gather_specs.get(key)
    if specs is None:
        specs = pool.gather_specs.put(key, [(names, torch.Size(group_shape(pool, names, n_slots, pages)),
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
