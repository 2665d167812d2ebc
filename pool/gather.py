"""Gather and scatter: all layers' rows of a device pool at given slots (or pages) into
one contiguous buffer per component, and back (prefill-decode transfer, storage
backends, CPU copies). One launch per group of components covers every layer."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from kvtier.kernels import RowMap
from kvtier.kernels.copy_rows import _runner, rebased
from kvtier.kernels.rowmap import kept, tensor_key
from kvtier.kernels.errors import fail
from kvtier.kernels.index_check import checks_on
from kvtier.kernels.iota import iota
from kvtier.kernels.validate import check_index, index_ok

from kvtier.kernels.ops import GATHER, SCATTER, Op

from . import launch as launcher
from .launch import bind_launch, launch, lookup, lookup_state


def slots_of(pool, indices: torch.Tensor, pages: bool):
    """(token slots, verdict) for slot or page ``indices`` whose shape the caller checked
    (`check_index`): the value checks by the pool's index guard (no device sync; the
    verdict word gates the copies)."""
    verdict = check_values(pool, indices, pages)
    if not pages:
        return indices, verdict
    p = pool.page_size
    return (indices[:, None] * p + iota(p, indices.dtype, indices.device)).reshape(-1), verdict


def check_values(pool, indices: torch.Tensor, pages: bool):
    """The pool guard's value check of slot or page ``indices`` (its verdict word, or
    None). A gather's or scatter's list comes once: nothing is kept about it."""
    if not checks_on(pool.check):
        return None
    guard = pool.guard
    plan = guard.plans.get(pages)
    if plan is None:
        plan = guard.keep_plan(pages, ("indices", pool.size // pool.page_size if pages else pool.size, 1))
    return guard.check_pair(pool.device, plan, indices, indices)


def group_shape(pool, names, n_slots: int, pages: bool):
    """Shape of one group's contiguous buffer: ``(C, L, n, *row)`` or ``(C, L, n/P, P, *row)``."""
    c = pool.components[names[0]]
    tok = (n_slots // pool.page_size, pool.page_size) if pages else (n_slots,)
    return (len(names), c.num_layers, *tok, *c.row_shape)


def contiguous_map(t: torch.Tensor, pool, pages: bool, keep: bool = True) -> RowMap:
    """Map over a ``(C, L, tokens..., *row)`` buffer, all its components in one map (kept
    for a buffer passed again, `gather(out=...)`; ``keep=False`` for a buffer that will
    not come again, which a kept map would keep alive)."""
    page = pool.page_size if pages else 1
    build = lambda: RowMap.stack([RowMap.from_stacked(t[i], page, paged_dims=pages)  # noqa: E731
                                  for i in range(t.shape[0])])
    return kept(("contiguous", page, pages, *tensor_key(t)), build) if keep else build()


def gather_groups(pool, slots: torch.Tensor, pages: bool, op: Op = GATHER,
                  verdict: Optional[torch.Tensor] = None, page_indices: bool = False) -> List[torch.Tensor]:
    """One new contiguous buffer per group in ``pool.groups``, filled from ``slots``
    (with ``page_indices``: page numbers, ``pages`` then being true)."""
    n = slots.numel()
    n_slots = n * (pool.page_size if page_indices else 1)
    key = (op, pages, page_indices, n_slots, *lookup_state())
    laid = pool._gather_layouts.get(key)
    shapes = laid.shapes if laid is not None else [
        (group_shape(pool, names, n_slots, pages), pool.components[names[0]].dtype) for names, _ in pool.groups]
    # (the shape as separate arguments: torch parses them faster than one tuple)
    into = [torch.empty(*shape, dtype=dtype, device=pool.device) for shape, dtype in shapes]
    if not n:
        return into
    if laid is None and _runner(pool.device.type) == "kernel":
        laid = _remember(pool._gather_layouts, key, _Layout(pool, op, into, pages, page_indices, n_slots, shapes))
    if laid is not None and laid.takes(into):
        launcher.run_all(op, laid.bounds, slots, _buffer_side(laid, n, slots), verdict, dst_buffers=laid.words(into))
    else:
        bounds = _bind_groups(pool, op, into, pages, page_indices, n_slots, keep=False)
        launcher.run_all(op, bounds, slots, iota(n, slots.dtype, slots.device), verdict)
    return into


class _Layout:
    """Buffers of one shape (per pool, operation, call shape and lookup state): the copies
    bound to the buffers' *layout* (a map without tensors,
    `kvtier.kernels.copy_rows.rebased`), so each call only hands over its buffers and no
    buffer is kept alive; the buffers' shapes, the alignment the layout assumes, how a
    buffer is viewed as the kernel's words, and the buffer side's indices. Made from the
    first call's buffers: a gather's new results, or (``into_pool``) a scatter's data."""

    def __init__(self, pool, op: Op, bufs: List[torch.Tensor], pages: bool, page_indices: bool, n_slots: int,
                 shapes: list, into_pool: bool = False):
        self.shapes = shapes
        self.bounds = _bind_groups(pool, op, bufs, pages, page_indices, n_slots, keep=False, layout=True,
                                   into_pool=into_pool)
        side = 0 if into_pool else 1
        self.align = min(b.origin[side].align for b in self.bounds)
        # Each buffer as the kernel's words: in one view where its last dim is whole
        # words, else through a flat view.
        self.direct = [b.shape[-1] * b.element_size() % bound.plan.dp_dtype.itemsize == 0
                       for b, bound in zip(bufs, self.bounds)]
        self.buffer_side = None     # see _buffer_side

    def takes(self, bufs: List[torch.Tensor]) -> bool:
        """Whether ``bufs`` are aligned as the layout assumes (fresh allocations are)."""
        align = self.align
        for b in bufs:
            if b.data_ptr() % align:
                return False
        return True

    def fits(self, bufs: List[torch.Tensor]) -> bool:
        """Whether ``bufs`` (a caller's, not allocated here) are contiguous in the layout's
        shapes and aligned as it assumes."""
        return _in_shapes(bufs, self.shapes) and self.takes(bufs)

    def words(self, bufs: List[torch.Tensor]) -> List[torch.Tensor]:
        return [b.view(bound.plan.dp_dtype) if direct else b.view(-1).view(bound.plan.dp_dtype)
                for b, bound, direct in zip(bufs, self.bounds, self.direct)]


def _in_shapes(bufs: List[torch.Tensor], shapes: list) -> bool:
    for b, (shape, _) in zip(bufs, shapes):
        if b.shape != shape or not b.is_contiguous():
            return False
    return True


def _buffer_side(holder, n: int, slots: torch.Tensor) -> torch.Tensor:
    """The contiguous side's indices (`iota`) for ``n`` slots, kept on ``holder`` (a
    `_Layout` or `_OutRoute`: one count each) for slots of this dtype."""
    kept = holder.buffer_side
    if kept is None or kept.dtype != slots.dtype:
        kept = holder.buffer_side = iota(n, slots.dtype, slots.device)
    return kept


def _bind_groups(pool, op: Op, bufs: List[torch.Tensor], pages: bool, page_indices: bool, n_slots: int,
                 keep: bool, layout: bool = False, into_pool: bool = False) -> list:
    """One bound copy per group between the pool and its buffer in ``bufs``, from the pool
    into the buffer (``into_pool``: the other way), with the configuration tuned for the
    pool's rows; ``layout``: bound to the buffer's layout only (`rebased`), each call then
    hands over its buffer."""
    bounds = []
    for (names, m), buf in zip(pool.groups, bufs):
        layers = pool.components[names[0]].num_layers
        cmap = contiguous_map(buf, pool, pages, keep=keep)
        pool_side, buf_side = _sides(m, cmap, page_indices)
        if layout:
            buf_side = rebased(buf_side)
        if into_pool:
            config = lookup(op, cmap, m, n_slots, layers)             # tuned for the pool's rows
            src, dst = buf_side, pool_side
        else:
            config = lookup(op, m, cmap, n_slots, layers)
            src, dst = pool_side, buf_side
        bounds.append(bind_launch(op, src, dst, num_layers=layers,
                                  n_rows=n_slots // (pool.page_size if page_indices else 1),
                                  by_page=pages and not page_indices, config=config, keep=keep))
    return bounds


def _remember(kept: dict, key, value):
    """Keep ``value`` under ``key`` in a per-pool dict of the last few shapes (cleared, not
    evicted one by one: buffers and shapes come and go)."""
    if len(kept) >= 16:
        kept.clear()
    kept[key] = value
    return value


def scatter_groups(pool, slots: torch.Tensor, bufs: List[torch.Tensor], pages: bool,
                   op: Op = SCATTER, verdict: Optional[torch.Tensor] = None, page_indices: bool = False) -> None:
    """Write group buffers (shapes as `gather_groups` makes them) back at ``slots``. A
    scatter's buffers are the caller's (often received once), so nothing keeps them: the
    copies are bound to their layout (`_Layout`, per call shape) where they are contiguous
    in the group shapes and aligned as the first ones were, else to maps of them made for
    the call."""
    n = slots.numel()
    if not n:
        return
    n_slots = n * (pool.page_size if page_indices else 1)
    key = (op, pages, page_indices, n_slots, *lookup_state())
    laid = pool._gather_layouts.get(key)
    if laid is None and _runner(pool.device.type) == "kernel":
        shapes = [(group_shape(pool, names, n_slots, pages), None) for names, _ in pool.groups]
        if _in_shapes(bufs, shapes):
            laid = _remember(pool._gather_layouts, key,
                             _Layout(pool, op, bufs, pages, page_indices, n_slots, shapes, into_pool=True))
    if laid is not None and laid.fits(bufs):
        launcher.run_all(op, laid.bounds, _buffer_side(laid, n, slots), slots, verdict, src_buffers=laid.words(bufs))
    else:
        bounds = _bind_groups(pool, op, bufs, pages, page_indices, n_slots, keep=False, into_pool=True)
        launcher.run_all(op, bounds, iota(n, slots.dtype, slots.device), slots, verdict)


def _sides(pool_map: RowMap, buf_map: RowMap, page_indices: bool):
    """The pool's and the buffer's maps as the copy addresses them: with page indices,
    whole pages as rows."""
    if page_indices:
        return pool_map.pages_as_rows(), buf_map.pages_as_rows()
    return pool_map, buf_map


def _pages_direct(pool, pages: bool) -> bool:
    """Whether page indices address the pool directly (every group stores a page as one
    contiguous run, `DevicePool.page_runs`): then no slot list is made from them."""
    return pages and pool.page_runs


def gather(pool, indices: torch.Tensor, *, pages: bool = False,
           out: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    if not index_ok(indices, pool.index_device):
        check_index("indices", indices, pool.index_device)
    if out is not None:
        return _gather_out(pool, indices, pages, out)
    if _pages_direct(pool, pages):
        bufs = gather_groups(pool, indices, pages, verdict=check_values(pool, indices, pages), page_indices=True)
    else:
        slots, verdict = slots_of(pool, indices, pages)
        bufs = gather_groups(pool, slots, pages, verdict=verdict)
    views = {}
    for (names, _), buf in zip(pool.groups, bufs):
        views.update(zip(names, buf.unbind()))      # (one call for a group's views: indexing costs twice)
    return views


def _gather_out(pool, indices: torch.Tensor, pages: bool, out: Dict[str, torch.Tensor]):
    """`gather` into ``out`` (an engine refills one ``out`` per call): while the same dict
    comes back holding the same tensors at the same addresses, for indices of the same
    count, nothing but the value check and the launches is done again."""
    n_slots = indices.numel() * (pool.page_size if pages else 1)
    kept = pool._gather_out
    if kept is None or not kept.serves(out, n_slots, pages):
        into = _out_buffers(pool, out, n_slots, pages)
        kept = pool._gather_out = _OutRoute(out, n_slots, pages, into)
    direct = _pages_direct(pool, pages)
    if direct:
        slots, verdict = indices, check_values(pool, indices, pages)
    else:
        slots, verdict = slots_of(pool, indices, pages)
    n = slots.numel()
    if n:
        state = lookup_state()
        if kept.state != state:
            kept.bounds = _bind_groups(pool, GATHER, kept.into, pages, direct, n_slots, keep=True)
            kept.state = state
        launcher.run_all(GATHER, kept.bounds, slots, _buffer_side(kept, n, slots), verdict)
    return out


class _OutRoute:
    """A checked ``out`` of `gather`: the dict, its tensors and their addresses when
    checked, the group buffers behind them, and the bound copies filling those (bound
    under ``state``, the lookup state; rebound when it changes)."""

    def __init__(self, out: dict, n_slots: int, pages: bool, into: List[torch.Tensor]):
        self.out, self.values = out, tuple(out.values())
        self.ptrs = tuple(t.data_ptr() for t in self.values)
        self.n_slots, self.pages, self.into = n_slots, pages, into
        self.state, self.bounds = None, None
        self.buffer_side = None     # see _buffer_side

    def serves(self, out, n_slots: int, pages: bool) -> bool:
        """Whether ``out`` is the checked dict, unchanged, for the same count and mode."""
        if out is not self.out or n_slots != self.n_slots or pages != self.pages or len(out) != len(self.values):
            return False
        for t, kept, ptr in zip(out.values(), self.values, self.ptrs):
            if t is not kept or t.data_ptr() != ptr:
                return False
        return True


def _out_buffers(pool, out, n_slots: int, pages: bool) -> List[torch.Tensor]:
    """The group buffers behind ``out`` (what an earlier gather of this shape returned),
    every tensor checked."""
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


def scatter(pool, indices: torch.Tensor, data: Dict[str, torch.Tensor], *, pages: bool = False) -> None:
    if not index_ok(indices, pool.index_device):
        check_index("indices", indices, pool.index_device)
    bufs = _buffers(pool, data, indices.numel() * (pool.page_size if pages else 1), pages, "data")
    if _pages_direct(pool, pages):
        scatter_groups(pool, indices, bufs, pages, verdict=check_values(pool, indices, pages), page_indices=True)
    else:
        slots, verdict = slots_of(pool, indices, pages)
        scatter_groups(pool, slots, bufs, pages, verdict=verdict)


def _buffers(pool, data, n_slots: int, pages: bool, arg: str) -> List[torch.Tensor]:
    """One contiguous buffer per group from a dict shaped as `gather` returns (``arg``
    names it in errors): the group buffer behind gather()'s views, else a stacked copy.
    Every tensor is checked before anything moves."""
    if not isinstance(data, dict) or data.keys() != pool.components.keys():
        raise fail(arg, sorted(data) if isinstance(data, dict) else type(data).__name__,
                   f"must be a dict with exactly the pool's components {sorted(pool.components)}")
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
