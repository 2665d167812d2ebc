"""The plain-torch baselines: what engines fall back to without a transfer kernel
(`prepare`), and one contiguous ``copy_`` of the same bytes (`prepare_copy`: the bound
at this transfer size, where the ceilings are measured on one large copy).

Per component and layer: index_select the source rows into a staging tensor on the
source's side (pinned when it is the host), one non_blocking copy of the staging
tensor across the link, then index_copy_ into the destination rows. A device -> host
copy must wait for the link before the host can scatter, so it synchronises once per
call. A same-device copy into rows 0..n-1 of a contiguous buffer (gather) selects
straight into the destination, and one out of rows 0..n-1 (scatter) copies straight from
the source, as an engine would write them.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvtier.bench.pools import POISON, RowCopy
from kvtier.kernels.reference import layer_rows
from kvtier.platforms import synchronize

from .workload import Prepared, Workload


class _Rows:
    """One layer's rows, read and written by slot index. Layouts whose slots sit at one
    stride (layer_first, page_first, device pools) get a (slots, ...) view and use
    index_select / index_copy_; the others index (page, slot-in-page) pairs."""

    def __init__(self, m, comp: int, layer: int, slots: torch.Tensor):
        v = layer_rows(m, comp, layer)
        self.row_shape = (m.n_chunks, m.chunk_bytes)
        try:
            self.flat, self.slots = v.view(m.num_rows, m.n_chunks, m.chunk_bytes), slots
        except RuntimeError:
            self.flat, self.view = None, v
            self.pair = (slots // m.page_size, slots % m.page_size)

    def select_into(self, out: torch.Tensor) -> None:
        out = out.view(-1, *self.row_shape)
        if self.flat is not None:
            torch.index_select(self.flat, 0, self.slots, out=out)
        else:
            out.copy_(self.view[self.pair])

    def prefix(self, n: int):
        """The first n rows as one tensor, when the indices are exactly 0..n-1."""
        if self.flat is None or not torch.equal(self.slots.cpu(), torch.arange(n)):
            return None
        return self.flat[:n]

    def copy_from(self, rows: torch.Tensor) -> None:
        rows = rows.view(-1, *self.row_shape)
        if self.flat is not None:
            self.flat.index_copy_(0, self.slots, rows)
        else:
            self.view.index_put_(self.pair, rows)


def prepare(w: Workload, op: str) -> Prepared:
    t: RowCopy = w.copy(op)
    layers = range(t.num_layers)
    C, n = t.src.num_components, t.src_indices.numel()
    si = t.src_indices.to(t.src.device)
    di = t.dst_indices.to(t.dst.device)
    src = [[_Rows(t.src, c, t.src_layer + l, si) for l in layers] for c in range(C)]
    dst = [[_Rows(t.dst, c, t.dst_layer + l, di) for l in layers] for c in range(C)]
    cross = t.src.device != t.dst.device
    into, out_of = _prefixes(dst, n, cross), _prefixes(src, n, cross)
    if into is not None:
        return Prepared(_per_layer(C, layers, lambda c, l: src[c][l].select_into(into[c][l])), programs=None)
    if out_of is not None:
        return Prepared(_per_layer(C, layers, lambda c, l: dst[c][l].copy_from(out_of[c][l])), programs=None)

    shape = (C, t.num_layers, n, t.src.row_bytes)
    stage_src = _staging(shape, t.src.device, pin=cross)
    stage_dst = _staging(shape, t.dst.device, pin=True) if cross else stage_src
    select = _per_layer(C, layers, lambda c, l: src[c][l].select_into(stage_src[c, l]))
    put = _per_layer(C, layers, lambda c, l: dst[c][l].copy_from(stage_dst[c, l]))

    def run():
        select()
        if cross:
            stage_dst.copy_(stage_src, non_blocking=True)
            if t.dst.device.type == "cpu":
                synchronize(w.device)
        put()

    return Prepared(run, programs=None)


class _SameBytes:
    """Verification of a contiguous copy: the destination equals the source, byte for byte."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, device: torch.device):
        self.src, self.dst, self.device = src, dst, device

    def mismatch(self) -> Optional[str]:
        synchronize(self.device)
        if torch.equal(self.src.cpu(), self.dst.cpu()):
            return None
        bad = int((self.src.cpu() != self.dst.cpu()).nonzero()[0, 0])
        return f"byte {bad} of the contiguous copy differs"


def prepare_copy(w: Workload, op: str) -> Prepared:
    """One ``copy_`` of as many bytes as the operation moves, between contiguous buffers on
    the operation's two sides (pinned where host memory): the same-size bound."""
    t: RowCopy = w.copy(op)
    n = t.nbytes
    src = _staging((n,), t.src.device, pin=t.src.device.type == "cpu" and w.device.type != "cpu")
    dst = _staging((n,), t.dst.device, pin=t.dst.device.type == "cpu" and w.device.type != "cpu")
    src.random_(0, 256)
    dst.fill_(POISON)
    check = _SameBytes(src, dst, w.device)
    return Prepared(lambda: dst.copy_(src, non_blocking=True), programs=None, written=lambda: check)


def _per_layer(C: int, layers, step):
    """A call running ``step(component, layer)`` for every component and layer."""
    def run():
        for c in range(C):
            for l in layers:
                step(c, l)
    return run


def _prefixes(rows, n: int, cross: bool):
    """Per component and layer the first n rows, where a same-device copy's side is
    exactly rows 0..n-1 of every layer; else None."""
    if cross:
        return None
    out = [[r.prefix(n) for r in row] for row in rows]
    return out if all(x is not None for row in out for x in row) else None


def _staging(shape, device: torch.device, pin: bool) -> torch.Tensor:
    """A staging tensor; pinned when it is host memory on the far side of a link."""
    return torch.empty(shape, dtype=torch.uint8, device=device,
                       pin_memory=pin and device.type == "cpu")
