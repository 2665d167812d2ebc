"""Builders and the torch oracle shared by the copy_rows tests (no tests here).

`Side` is one guarded KV buffer in one of the forms kvtier reads (per-layer tensors
through an address table, stacked multi-layer tensors, the four host layouts) and its
RowMap; `oracle` is a torch expression over the ORIGINAL tensors (permute and reshape
each form to a logical ``(C, L, N, row_bytes)`` byte view), so it shares no code with
the kernel or the reference; `run_and_check` copies and checks the whole destination,
the source and every margin; `make_indices` builds the index patterns.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from helpers import Guarded, assert_bytes_equal
from kvtier.kernels import RowMap

copy_rows_module = importlib.import_module("kvtier.kernels.launcher")
from kvtier.kernels import copy_rows  # noqa: E402

# Forms of one KV buffer: the tensor shape each allocates (C components, L layers,
# N = pages * P slots, rows of H x D elements) and how its map is built.
DEVICE_FORMS = ("table", "table_paged", "stacked", "stacked_paged")
HOST_FORMS = ("layer_first", "page_first", "page_first_direct", "page_head")
FORMS = DEVICE_FORMS + HOST_FORMS


class Side:
    """One guarded KV buffer in ``form`` and the RowMap that describes it.

    ``logical()`` is the buffer as uint8 ``(C, L, N, row_bytes)``, computed from the
    original tensors by permute/reshape only (a copy, never a view)."""

    def __init__(self, form, *, L, N, P=1, row=(1, 8), dtype=torch.float16, C=1,
                 fill="random", seed=0):
        assert form in FORMS and N % P == 0
        self.form, self.C, self.L, self.N, self.P = form, C, L, N, P
        H, D = row
        self.row_bytes = H * D * torch.empty(0, dtype=dtype).element_size()
        gen = torch.Generator().manual_seed(seed)
        pages = N // P
        if form.startswith("table"):
            shape = (pages, P, H, D) if form == "table_paged" else (N, H, D)
            self.guards = [Guarded(shape, dtype, fill=fill, gen=gen) for _ in range(C * L)]
            self.layers = [g.t for g in self.guards]
            maps = [RowMap.from_layers(self.layers[c * L:(c + 1) * L], page_size=P,
                                       paged_dims=form == "table_paged") for c in range(C)]
        else:
            shape = {"stacked": (C, L, N, H, D), "layer_first": (C, L, N, H, D),
                     "stacked_paged": (C, L, pages, P, H, D),
                     "page_first": (C, N, L, H, D),
                     "page_first_direct": (C, pages, L, P, H, D),
                     "page_head": (C, pages, H, P, L, D)}[form]
            self.guards = [Guarded(shape, dtype, fill=fill, gen=gen)]
            self.t = self.guards[0].t
            if form in ("stacked", "stacked_paged"):
                maps = [RowMap.from_stacked(self.t[c], P, paged_dims=form == "stacked_paged")
                        for c in range(C)]
            else:
                maps = [RowMap.from_host_layout(self.t[c], form, P) for c in range(C)]
        self.map = RowMap.stack(maps)
        assert self.map is not None and self.map.num_components == C

    def logical(self) -> torch.Tensor:
        C, L, N = self.C, self.L, self.N
        if self.form.startswith("table"):
            u = torch.stack([x.view(torch.uint8).reshape(N, -1) for x in self.layers])
            return u.reshape(C, L, N, self.row_bytes)
        u = self.t.view(torch.uint8)            # last dim becomes D * itemsize bytes
        u = {"stacked": lambda: u, "layer_first": lambda: u,
             "stacked_paged": lambda: u.flatten(2, 3),
             "page_first": lambda: u.transpose(1, 2),
             "page_first_direct": lambda: u.permute(0, 2, 1, 3, 4, 5).flatten(2, 3),
             "page_head": lambda: u.permute(0, 4, 1, 3, 2, 5).flatten(2, 3)}[self.form]()
        return u.reshape(C, L, N, self.row_bytes).clone()

    def raw(self) -> list:
        return [g.snapshot() for g in self.guards]

    def check_margins(self) -> None:
        for g in self.guards:
            g.check()


def oracle(src: Side, si, dst: Side, di, src_layer=0, dst_layer=0, num_layers=None):
    """The destination's logical bytes after the copy, by plain torch indexing, and
    the number of layers copied."""
    if num_layers is None:
        num_layers = min(src.L - src_layer, dst.L - dst_layer)
    want = dst.logical()
    want[:, dst_layer:dst_layer + num_layers, di.long()] = \
        src.logical()[:, src_layer:src_layer + num_layers, si.long()]
    return want, num_layers


def run_and_check(src: Side, si, dst: Side, di, fn=None, **kw) -> None:
    """Copy with ``fn`` (copy_rows) and check destination, source and margins."""
    fn = fn or copy_rows
    layer_kw = {k: kw[k] for k in ("src_layer", "dst_layer", "num_layers") if k in kw}
    want, num_layers = oracle(src, si, dst, di, **layer_kw)
    before, src_before = dst.logical(), src.logical()
    if si.numel() and num_layers and src.row_bytes >= 4:   # 4 random bytes never all poison
        assert not torch.equal(want, before), "test would pass without a copy"
    fn(src.map, si, dst.map, di, **kw)
    assert_bytes_equal(dst.logical(), want, "destination")
    assert_bytes_equal(src.logical(), src_before, "source")
    src.check_margins()
    dst.check_margins()


# ----------------------------------------------------------------------------- indices
PATTERNS = ("perm", "runs", "single", "empty", "repeat_src", "all")


def make_indices(pattern, n_src, n_dst, P=1, dtype=torch.int64, seed=0):
    """(src, dst) index tensors; destinations are always distinct slots."""
    g = torch.Generator().manual_seed(seed)
    perm = lambda n: torch.randperm(n, generator=g)
    if pattern == "perm":
        k = max(1, min(n_src, n_dst) // 2)
        si, di = perm(n_src)[:k], perm(n_dst)[:k]
    elif pattern == "runs":       # whole pages, in shuffled page order
        k = max(1, min(n_src, n_dst) // P // 2)
        run = torch.arange(P)
        si = (perm(n_src // P)[:k, None] * P + run).flatten()
        di = (perm(n_dst // P)[:k, None] * P + run).flatten()
    elif pattern == "single":
        si, di = perm(n_src)[:1], perm(n_dst)[:1]
    elif pattern == "empty":
        si, di = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    elif pattern == "repeat_src":
        k = max(2, min(n_src, n_dst) // 2)
        si = torch.randint(0, n_src, (k,), generator=g)
        si[k // 2:] = si[0]
        di = perm(n_dst)[:k]
    elif pattern == "all":
        k = min(n_src, n_dst)
        si, di = perm(n_src)[:k], perm(n_dst)[:k]
    else:
        raise AssertionError(pattern)
    return si.to(dtype), di.to(dtype)


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def kernel_really_runs(monkeypatch):
    """Every copy in these tests runs the Triton kernel: the interpreter is on and the
    torch-reference fallback is disabled."""
    assert copy_rows_module.interpreter_active(), "TRITON_INTERPRET=1 must be set before Triton loads"

    def no_fallback(*a, **k):
        raise AssertionError("copy_rows fell back to the torch reference")
    monkeypatch.setattr(copy_rows_module, "reference_copy", no_fallback)
