"""Shared by the bench tests: import kvtier.bench (from the source tree if the installed
package list predates it), guarded workload buffers, and an independent plain-torch
model of every buffer's rows."""
from __future__ import annotations

import torch

from helpers import Guarded
from kvtier.cli.bench_cmd import load_bench

bench = load_bench()
from kvtier.bench.workload import Shape, Workload  # noqa: E402


class GuardedAlloc:
    """A Workload allocator whose every buffer sits between sentinel margins."""

    def __init__(self):
        self.guards = []

    def __call__(self, shape, device, pinned):
        g = Guarded(shape, torch.uint8, device=device, gen=torch.Generator().manual_seed(len(self.guards)))
        self.guards.append(g)
        return g.t

    def check(self):
        for g in self.guards:
            g.check()


def guarded_workload(shape: Shape, seed: int = 0):
    alloc = GuardedAlloc()
    return Workload(shape, torch.device("cpu"), seed=seed, alloc=alloc), alloc


def host_rows(host: torch.Tensor, layout: str) -> torch.Tensor:
    """The host buffer ``(C, ...)`` as ``(C, L, N, row)`` bytes, by dims alone (no RowMap)."""
    C = host.shape[0]
    if layout == "page_head":            # (C, pages, H, P, L, D)
        _, pages, H, P, L, D = host.shape
        return host.permute(0, 4, 1, 3, 2, 5).reshape(C, L, pages * P, H * D)
    host = host.flatten(-2)              # the row dims (H, D) as one row of bytes
    if layout == "layer_first":          # (C, L, N, R)
        return host.clone()
    if layout == "page_first":           # (C, N, L, R)
        return host.permute(0, 2, 1, 3).contiguous()
    _, pages, L, P, R = host.shape       # page_first_direct (C, pages, L, P, R)
    return host.permute(0, 2, 1, 3, 4).reshape(C, L, pages * P, R)


def device_rows(w: Workload) -> torch.Tensor:
    return torch.stack([torch.stack(list(layers)) for layers in w.device_layers]).flatten(-2)


def contiguous_rows(buf: torch.Tensor, w: Workload) -> torch.Tensor:
    """A gather or scatter buffer ``(C, L, tokens..., *row)`` as ``(C, L, N, row)`` bytes."""
    s = w.shape
    return buf.reshape(s.components, s.layers, s.tokens, s.row_bytes).clone()


def rows_of(w: Workload, side: str) -> torch.Tensor:
    """(C, L, N, row) bytes of ``side``: "host", "device", "gather" or "scatter"."""
    if side == "host":
        return host_rows(w.host, w.shape.layout)
    if side == "device":
        return device_rows(w)
    return contiguous_rows(w.gather_buffer if side == "gather" else w.scatter_source, w)


# op -> (source side, destination side)
SIDES = {"backup": ("device", "host"), "load_layer": ("host", "device"),
         "load": ("host", "device"), "gather": ("device", "gather"), "scatter": ("scatter", "device")}


def _slots(w: Workload, side: str) -> torch.Tensor:
    if side in ("gather", "scatter"):
        return torch.arange(w.shape.tokens)
    return (w.host_slots if side == "host" else w.device_slots).long().cpu()


def expected_after(w: Workload, op: str, before_src: torch.Tensor, before_dst: torch.Tensor) -> torch.Tensor:
    """The destination rows after ``op``: the plain-torch semantics on the snapshots."""
    L = w.shape.layers
    layers = [L - 1] if op == "load_layer" else range(L)
    src_idx, dst_idx = (_slots(w, side) for side in SIDES[op])
    want = before_dst.clone()
    for l in layers:
        want[:, l, dst_idx] = before_src[:, l, src_idx]
    return want
