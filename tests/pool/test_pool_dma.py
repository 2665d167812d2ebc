"""The dma strategy's bulk copies: runs of host units <-> staging as 2-D copies
(pool/dma_copies.py) and their issue through a runtime's 2-D copy (pool/link_copy.py).

The plans are executed into poisoned, guarded buffers and compared with plain torch
``narrow`` copies of each run; the number of copies is checked too, since one copy per run
(not per layer and component) is the point of the 2-D copies.
"""
import ctypes
import random

import pytest

import kvtier.warn_once
import torch

from helpers import POISON, Guarded, assert_bytes_equal
from kvtier.kernels import LAYOUTS
from kvtier.kernels.layouts import host_layout
from kvtier.pool import link_copy
from kvtier.pool.dma_copies import Copies2D, copies_2d, runs, shape_2d

L, SLOTS, P, ROW = 4, 16, 4, (2, 3)      # layers, host slots, page size, row (heads, dim)


def buffer_shape(layout, comps, **dims):
    """A (C, ...) host buffer of ``comps`` components in ``layout``."""
    return (comps, *host_layout(layout).shape(**dims))


def buffers(layout, C, n_units, layers, gen):
    """A random host buffer and a poisoned staging buffer (guarded), shaped by the layout."""
    P_ = P if host_layout(layout).paged else 1
    host = Guarded(buffer_shape(layout, comps=C, layers=L, slots=SLOTS, page_size=P, row_shape=ROW),
                   torch.float16, gen=gen)
    stage = Guarded(buffer_shape(layout, comps=C, layers=layers, slots=n_units * P_, page_size=P,
                                  row_shape=ROW), torch.float16, fill="poison", gen=gen)
    return host, stage


def fragmented_units(total, gen):
    """Units in a shuffled order with some consecutive runs (what an allocator hands out)."""
    units = list(range(total))
    random.Random(gen.initial_seed()).shuffle(units)
    picked = sorted(units[: total * 2 // 3])
    k = len(picked) // 2
    return torch.tensor(picked[k:] + picked[:k])       # two ascending blocks: runs break


def expected(host_view, stage, unit_dim, units, to_host):
    want = (host_view if to_host else stage).clone()
    for j, u in enumerate(units.tolist()):
        if to_host:
            want.narrow(unit_dim, u, 1).copy_(stage.narrow(unit_dim, j, 1))
        else:
            want.narrow(unit_dim, j, 1).copy_(host_view.narrow(unit_dim, u, 1))
    return want


# (first layer, layer count): all layers, one layer (per-layer load), a middle slice (drafts)
LAYER_RANGES = [(0, L), (2, 1), (1, 2)]


@pytest.mark.parametrize("to_host", [True, False], ids=["backup", "load"])
@pytest.mark.parametrize("layers", LAYER_RANGES, ids=lambda r: f"layers{r[0]}+{r[1]}")
@pytest.mark.parametrize("C", [1, 2])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_moves_exactly_the_runs(layout, C, layers, to_host):
    gen = torch.Generator().manual_seed(hash((layout, C, layers, to_host)) % 2**31)
    first, count = layers
    n_host_units = SLOTS // P if host_layout(layout).paged else SLOTS
    units = fragmented_units(n_host_units, gen)
    host, stage = buffers(layout, C, units.numel(), count, gen)
    if not to_host:
        host.bytes().copy_(torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8, generator=gen))
    else:
        stage.bytes().copy_(torch.randint(0, 256, (stage.nbytes,), dtype=torch.uint8, generator=gen))
        host.bytes().fill_(POISON)
    ld, ud = 1 + host_layout(layout).layer_dim, 1 + host_layout(layout).unit_dim
    view = host.t.narrow(ld, first, count)
    want = expected(view, stage.t, ud, units, to_host)
    host_before = host.snapshot()

    shape = shape_2d(view, stage.t, ud)
    p = copies_2d(shape, *runs(units), host_base=first * host.t.stride(ld) * host.t.element_size())
    link_copy.torch_copies(p, host.t, stage.t, to_host)

    got = view if to_host else stage.t
    assert_bytes_equal(got, want, "moved bytes")
    assert p.nbytes == units.numel() * stage.nbytes // stage.t.shape[ud]
    if to_host:   # host bytes outside the layer range untouched
        outside = torch.ones_like(host.t, dtype=torch.bool)
        outside.narrow(ld, first, count).fill_(False)
        before = host_before.view(torch.float16).view(host.t.shape)
        assert_bytes_equal(host.t[outside], before[outside], "host outside the layer range")
    else:
        assert torch.equal(host.snapshot(), host_before), "a load wrote the host buffer"
    host.check()
    stage.check()


def n_runs(units):
    return runs(units)[0].numel()


def test_one_copy_per_run_for_whole_layer_ranges():
    """layer_first and page_first: every layer and component of a run in one 2-D copy."""
    gen = torch.Generator().manual_seed(7)
    units = fragmented_units(SLOTS, gen)
    for layout in ("layer_first", "page_first"):
        host, stage = buffers(layout, 2, units.numel(), L, gen)
        shape = shape_2d(host.t, stage.t, 1 + host_layout(layout).unit_dim)
        assert len(copies_2d(shape, *runs(units))) == n_runs(units), layout
    # page_first_direct (pages, L, P, row): a run of pages is one block per component.
    pages = fragmented_units(SLOTS // P, gen)
    host, stage = buffers("page_first_direct", 2, pages.numel(), L, gen)
    shape = shape_2d(host.t, stage.t, 1 + host_layout("page_first_direct").unit_dim)
    p = copies_2d(shape, *runs(pages))
    assert len(p) == n_runs(pages) and p.height.tolist() == [2] * len(p)


def test_per_layer_copies_are_one_per_run_and_component():
    gen = torch.Generator().manual_seed(8)
    units = fragmented_units(SLOTS, gen)
    host, stage = buffers("page_first", 2, units.numel(), 1, gen)
    view = host.t.narrow(2, 1, 1)
    p = copies_2d(shape_2d(view, stage.t, 1), *runs(units))
    assert len(p) == 2 * n_runs(units)                   # rows of a run: one 2-D copy each


def test_runs():
    h, s, k = runs(torch.tensor([4, 5, 6, 9, 1, 2, 3, 3], dtype=torch.int32))
    assert (h.tolist(), s.tolist(), k.tolist()) == ([4, 9, 1, 3], [0, 3, 4, 7], [3, 1, 3, 1])
    assert [t.numel() for t in runs(torch.tensor([], dtype=torch.int64))] == [0, 0, 0]


def _memmove_2d(dst, dpitch, src, spitch, width, height, kind, stream):
    """A 2-D copy on host pointers with the runtimes' rules (width <= pitches)."""
    if width > dpitch or width > spitch or height < 1:
        return 1
    for i in range(height):
        ctypes.memmove(dst + i * dpitch, src + i * spitch, width)
    return 0


@pytest.mark.parametrize("limits", [(1 << 40, 1 << 40), (64, 1 << 40), (1 << 40, 2)],
                         ids=["unlimited", "small-pitch", "short-height"])
@pytest.mark.parametrize("to_host", [True, False], ids=["backup", "load"])
@pytest.mark.parametrize("layout,C", [("layer_first", 2), ("page_first_direct", 1)])
def test_runtime_issue_splits_within_limits(layout, C, limits, to_host):
    """`Runtime.issue` (the path CUDA and Ascend take) on host pointers: the same bytes as
    the torch copies, also when pitches or heights exceed the runtime's limits, and for
    one-row copies (page_first_direct, one component: a run is one dense block)."""
    gen = torch.Generator().manual_seed(9)
    units = fragmented_units(SLOTS // P if host_layout(layout).paged else SLOTS, gen)
    calls = []

    def fake(*args):
        calls.append(args)
        return _memmove_2d(*args)

    rt = link_copy.Runtime("fake", fake, lambda d: 0, max_pitch=limits[0], max_height=limits[1])
    results = []
    for issue in (rt.issue, link_copy.torch_copies):
        g = torch.Generator().manual_seed(10)
        host, stage = buffers(layout, C, units.numel(), L, g)
        (stage if to_host else host).bytes().copy_(
            torch.randint(0, 256, ((stage if to_host else host).nbytes,), dtype=torch.uint8, generator=g))
        p = copies_2d(shape_2d(host.t, stage.t, 1 + host_layout(layout).unit_dim), *runs(units))
        issue(p, host.t, stage.t, to_host)
        host.check()
        stage.check()
        results.append((host.snapshot(), stage.snapshot()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert all(c[4] <= min(c[1], c[3]) for c in calls), "a copy wider than its pitch"
    assert max(c[5] for c in calls) <= limits[1]
    if limits[0] == 64 and C > 1:                         # pitch over the limit: one row per copy
        assert all(c[5] == 1 for c in calls)
    else:
        assert len(calls) >= n_runs(units)


def _memmove_batch(dsts, srcs, sizes, count, stream):
    """A batch of 1-D copies on host pointers, read from the three u64 arrays."""
    arr = lambda p: (ctypes.c_uint64 * count).from_address(p)
    for d, s, n in zip(arr(dsts), arr(srcs), arr(sizes)):
        ctypes.memmove(d, s, n)
    return 0


@pytest.mark.parametrize("to_host", [True, False], ids=["backup", "load"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_runtime_batch_moves_every_piece(layout, to_host, monkeypatch):
    """The batch call (CUDA 12.8+) gets every row of every 2-D copy as one 1-D piece;
    the default stream (0) and KVTIER_DMA_COPY=2d keep the 2-D calls."""
    gen = torch.Generator().manual_seed(11)
    units = fragmented_units(SLOTS // P if host_layout(layout).paged else SLOTS, gen)
    used = []

    def batch(*args):
        used.append("batch")
        return _memmove_batch(*args)

    def copy_2d(*args):
        used.append("2d")
        return _memmove_2d(*args)

    results = {}
    for case, stream, mode in [("batch", 7, "batch"), ("default-stream", 0, "batch"), ("2d", 7, "2d"),
                               ("default-stream-batched", 0, "batch"),
                               ("torch", None, None)]:
        monkeypatch.setenv("KVTIER_DMA_COPY", mode or "auto")
        g = torch.Generator().manual_seed(12)
        host, stage = buffers(layout, 2, units.numel(), 2, g)
        (stage if to_host else host).bytes().copy_(
            torch.randint(0, 256, ((stage if to_host else host).nbytes,), dtype=torch.uint8, generator=g))
        ld = 1 + host_layout(layout).layer_dim
        view = host.t.narrow(ld, 1, 2)
        p = copies_2d(shape_2d(view, stage.t, 1 + host_layout(layout).unit_dim), *runs(units),
                 host_base=host.t.stride(ld) * host.t.element_size())
        used.clear()
        if stream is None:
            link_copy.torch_copies(p, host.t, stage.t, to_host)
        else:
            batched = case in ("batch", "default-stream-batched")
            rt = link_copy.Runtime("fake", copy_2d, lambda d, s=stream: s, 1 << 40, 1 << 40, batch=batch,
                                   batch_default_stream=2 if case == "default-stream-batched" else None)
            rt.issue(p, host.t, stage.t, to_host)
            assert set(used) == {"batch" if batched else "2d"}, case
            if batched:
                assert len(used) == 1
        host.check()
        stage.check()
        results[case] = (host.snapshot(), stage.snapshot())
    for case in ("batch", "default-stream", "2d", "default-stream-batched"):
        assert all(torch.equal(a, b) for a, b in zip(results[case], results["torch"])), case


def test_auto_batches_short_copies_only(monkeypatch):
    monkeypatch.setenv("KVTIER_DMA_COPY", "auto")
    rt = link_copy.Runtime("fake", None, lambda d: 7, 1 << 40, 1 << 40, batch=lambda *a: 0)
    t = lambda *v: torch.tensor(v, dtype=torch.int64)
    short = Copies2D(t(0, 9), t(0, 9), t(8, 8), t(3, 4), host_pitch=100, stage_pitch=8)
    tall = Copies2D(t(0, 9), t(0, 9), t(8, 8), t(4, 4), host_pitch=100, stage_pitch=8)
    assert rt._batched(short) and not rt._batched(tall)
    monkeypatch.setenv("KVTIER_DMA_COPY", "batch")
    assert rt._batched(tall)
    monkeypatch.setenv("KVTIER_DMA_COPY", "2d")
    assert not rt._batched(short)


def test_pieces_expand_every_row():
    t = lambda *v: torch.tensor(v, dtype=torch.int64)
    plan_ = Copies2D(t(0, 100), t(0, 10), t(4, 2), t(3, 1), host_pitch=20, stage_pitch=5)
    h, s, w = plan_.pieces()
    assert (h.tolist(), s.tolist(), w.tolist()) == ([0, 20, 40, 100], [0, 5, 10, 10], [4, 4, 4, 2])


def test_dma_copy_mode_is_checked(monkeypatch):
    monkeypatch.setenv("KVTIER_DMA_COPY", "fast")
    with pytest.raises(ValueError, match="KVTIER_DMA_COPY='fast'"):
        link_copy.runtime_for(torch.device("cpu"), torch.empty(1))
    monkeypatch.setenv("KVTIER_DMA_COPY", "torch")
    assert link_copy.runtime_for(torch.device("cuda"), torch.empty(1)) is None


def test_runtime_error_names_the_copy():
    rt = link_copy.Runtime("fake", lambda *a: 11, lambda d: 0, 1 << 40, 1 << 40, error=lambda rc: "bad")
    host, stage = buffers("layer_first", 1, 2, L, torch.Generator().manual_seed(1))
    p = copies_2d(shape_2d(host.t, stage.t, 2), *runs(torch.tensor([3, 4])))
    with pytest.raises(RuntimeError, match=r"fake 2-D copy of 4 x 24 bytes failed: bad \(11\)"):
        rt.issue(p, host.t, stage.t, True)


def test_cpu_and_pageable_memory_take_torch_copies():
    assert link_copy.runtime_for(torch.device("cpu"), torch.empty(4)) is None
    assert link_copy.runtime_for(torch.device("cuda"), torch.empty(4)) is None       # not pinned


@pytest.mark.cuda
@pytest.mark.parametrize("mode,side_stream", [("batch", True), ("batch", False), ("auto", True), ("auto", False),
                                              ("2d", True)])
def test_cuda_runtime_moves_plans(mode, side_stream, monkeypatch):
    """On the GPU: the batch call (CUDA 12.8+) on a side stream or, for the default
    stream, on the per-thread stream; 2-D calls when asked for. Bytes moved in stream order:
    the staging fill before the upload, the upload before the read-back."""
    assert torch.cuda.is_available()
    monkeypatch.setenv("KVTIER_DMA_COPY", mode)
    gen = torch.Generator().manual_seed(3)
    units = fragmented_units(SLOTS, gen)
    host = torch.randint(0, 256, (2, L, SLOTS, 48), dtype=torch.uint8, generator=gen).pin_memory()
    rt = link_copy.runtime_for(torch.device("cuda"), host)
    assert rt is not None and rt.name in ("cuda", "hip")
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        stage = torch.empty((2, L, units.numel(), 48), dtype=torch.uint8, device="cuda")
        p = copies_2d(shape_2d(host, stage, 2), *runs(units))
        torch.cuda._sleep(20_000_000)          # a late writer: the upload must wait for it
        stage.fill_(POISON)
        rt.issue(p, host, stage, to_host=False)
        torch.cuda._sleep(20_000_000)          # a late change: the read-back must see it
        stage.bitwise_xor_(0x5A)
        back = torch.full_like(host, POISON).pin_memory()
        rt.issue(p, back, stage, to_host=True)
    stream.synchronize()
    rows = host[:, :, units] ^ 0x5A
    assert torch.equal(stage.cpu(), rows)
    want = torch.full_like(host, POISON)
    want[:, :, units] = rows
    assert torch.equal(back, want)


def test_a_fallback_to_torch_copies_is_a_warning_once(monkeypatch, caplog):
    """On an accelerator, dma without the runtime's bulk copies is slow: one WARNING on the
    kvtier logger per reason, naming it (and nothing where the user asked for torch copies)."""
    import dataclasses
    from types import SimpleNamespace
    import kvtier.platforms as platforms
    monkeypatch.setattr(kvtier.warn_once, "_warned", set())
    why = "set TASK_QUEUE_ENABLE=0 for aclrtMemcpy2dAsync"
    no_runtime = dataclasses.replace(platforms.get("cuda"), dma_runtime=lambda: (None, why))
    monkeypatch.setattr(link_copy.platforms, "of", lambda device: no_runtime)
    pinned = SimpleNamespace(is_pinned=lambda: True)
    with caplog.at_level("WARNING", logger="kvtier"):
        for _ in range(3):
            assert link_copy.runtime_for(torch.device("cuda"), pinned) is None
            assert link_copy.runtime_for(torch.device("cuda"), torch.empty(4)) is None     # pageable
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and why in warnings[0] and "not pinned" in warnings[1], warnings
    caplog.clear()
    monkeypatch.setenv("KVTIER_DMA_COPY", "torch")
    monkeypatch.setattr(kvtier.warn_once, "_warned", set())
    with caplog.at_level("WARNING", logger="kvtier"):
        assert link_copy.runtime_for(torch.device("cuda"), pinned) is None
    assert not caplog.records
