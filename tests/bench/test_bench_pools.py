"""The transfers the tuner times are the pools' own calls and move exactly the right
bytes, under both strategies, for every host layout and both device layouts; the
configuration a tuner forces is the one every launch gets, and the dma candidate goes
through the pools' dma path (staging, plan, runtime copies)."""
import dataclasses
import importlib

import pytest
import torch

import kvtier.platforms as platforms
from autotune_support import spy_launches
from kvtier.autotune.search import tune_transfer
from kvtier.autotune.shape import PoolShape
from kvtier.bench.pools import POISON, Pools, build_call, rows_of
from kvtier.config import CopyConfig
from kvtier.kernels.ops import LABELS
from kvtier.kernels.reference import layer_rows

dma_module = importlib.import_module("kvtier.pool.dma")
link_copy = importlib.import_module("kvtier.pool.link_copy")

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
KERNEL = CopyConfig(num_programs=2, rows=4, block_bytes=64, num_warps=1)
DMA = CopyConfig(num_programs=2, rows=4, block_bytes=64, num_warps=1, strategy="dma")
CPU = torch.device("cpu")


def _bytes(tensors):
    return [t.view(torch.uint8).clone() for t in tensors]


def _check_moved_exactly(t, src_before):
    """Every destination row holds its source row; every other destination byte is still
    poison; the source is untouched."""
    w = t.written()
    for c in range(w.src.num_components):
        for layer in range(w.num_layers):
            assert torch.equal(rows_of(w.dst, c, w.dst_layer + layer, w.dst_indices),
                               rows_of(w.src, c, w.src_layer + layer, w.src_indices)), (c, layer)
    dst = t.dst_tensors
    if t.op.name == "gather":          # the pool's result: re-map it in place
        dst = [torch.stack(dst)]
        w = dataclasses.replace(w, dst=t.pools.contiguous_map(dst[0]))
    for c in range(w.dst.num_components):
        for layer in range(w.num_layers):
            idx, P = w.dst_indices.long(), w.dst.page_size
            layer_rows(w.dst, c, w.dst_layer + layer)[idx // P, idx % P] = POISON   # the copied rows, re-poisoned
    for d in dst:
        assert bool((d.view(torch.uint8) == POISON).all()), "a byte outside the copied rows changed"
    for before, now in zip(src_before, _bytes(t.src_tensors), strict=True):
        assert torch.equal(before, now), "the source changed"


@pytest.mark.parametrize("device_layout", ["layers", "stacked"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", LABELS)
def test_transfer_moves_exactly_its_rows(op, layout, device_layout):
    shape = PoolShape.mha(2, 2, 8, torch.float16, page_size=2, host_layout=layout, device_layout=device_layout)
    t = build_call(shape, op, num_rows=6, device=CPU, seed=1)
    assert t.num_layers == (1 if op == "load_layer" else 2)
    assert t.num_rows == 6 and t.nbytes == 6 * 32 * t.num_layers * 2
    assert t.crosses_link == (op in ("backup", "load", "load_layer"))
    for cfg in ((KERNEL, DMA) if t.crosses_link else (KERNEL,)):
        t.poison()
        assert not t.verify()                       # poison is not the source
        before = _bytes(t.src_tensors)
        t.runner(cfg)()
        assert t.verify()
        _check_moved_exactly(t, before)


def test_source_rows_are_random_and_device_slots_scattered():
    shape = PoolShape.mla(1, 32, 8, torch.bfloat16, page_size=4)
    t = build_call(shape, "backup", num_rows=10, device=CPU)
    assert t.num_rows == 12                         # whole pages
    assert t.copy.src.row_bytes == 80 and t.copy.src.num_components == 1
    for idx in (t.copy.src_indices, t.copy.dst_indices):        # device pages, host slots
        pages = idx.view(-1, 4)
        assert torch.equal(pages - pages[:, :1], torch.arange(4).expand(3, 4))   # whole pages
        assert pages[:, 0].unique().numel() == 3 and not torch.equal(pages[:, 0], torch.arange(0, 12, 4))
    data = layer_rows(t.copy.src, 0, 0).flatten()
    assert data.unique().numel() > 100              # random bytes, not a constant


def test_unknown_op_and_layout_are_rejected():
    shape = PoolShape.mha(1, 1, 8, torch.float16)
    with pytest.raises(ValueError, match="op='swap'"):
        build_call(shape, "swap", 4, CPU)
    with pytest.raises(ValueError, match="device_layout='paged'"):
        PoolShape.mha(1, 1, 8, torch.float16, device_layout="paged")
    with pytest.raises(ValueError, match="host_layout='diagonal'"):
        PoolShape.mha(1, 1, 8, torch.float16, host_layout="diagonal")
    with pytest.raises(ValueError, match="page_size=0"):
        PoolShape.mha(1, 1, 8, torch.float16, page_size=0)
    with pytest.raises(ValueError, match="row_dims"):
        PoolShape.mha(1, 0, 8, torch.float16)
    with pytest.raises(ValueError, match="num_components=3"):
        PoolShape(1, (1, 8), 3, torch.float16)
    with pytest.raises(ValueError, match="tokens=0"):
        Pools(shape, 0, CPU)


@pytest.mark.parametrize("op", LABELS)
def test_a_forced_configuration_reaches_every_launch(monkeypatch, op):
    shape = PoolShape.mha(2, 2, 8, torch.float16, page_size=2, host_layout="page_first")
    t = build_call(shape, op, 6, CPU)
    for cfg in ((KERNEL, DMA) if t.crosses_link else (KERNEL,)):
        launched = spy_launches(monkeypatch)
        t.poison()
        t.runner(cfg)()
        if cfg.strategy == "dma":   # the staging gather (scatter) keeps its own device-local config
            assert launched and cfg not in launched and t.verify()
        else:
            assert launched == [cfg] and t.verify()


def test_the_dma_candidate_runs_through_the_pools_dma_path(monkeypatch):
    shape = PoolShape.mha(2, 2, 8, torch.float16, page_size=2)
    calls = {"backup": 0, "issue": 0}
    real_backup, real_issue = dma_module.backup, link_copy.issue

    def backup(*a, **k):
        calls["backup"] += 1
        return real_backup(*a, **k)

    def issue(plan, host, stage, to_host):
        calls["issue"] += 1
        assert to_host and len(plan) > 0 and host.data_ptr() == t.pools.host.data_ptr()
        return real_issue(plan, host, stage, to_host)

    monkeypatch.setattr(dma_module, "backup", backup)
    monkeypatch.setattr(link_copy, "issue", issue)
    t = build_call(shape, "backup", 8, CPU)

    def timer(fn, *, config):
        fn()
        return 1e-3

    ms = tune_transfer(t, [KERNEL], timer)
    assert ms[0].ok and calls == {"backup": 0, "issue": 0}       # the kernel path copies directly
    ms = tune_transfer(t, [DMA], timer)
    assert ms[0].ok and calls == {"backup": 1, "issue": 1}


def test_kernel_candidates_need_host_memory_kernels_reach(monkeypatch):
    t = build_call(PoolShape.mha(1, 1, 8, torch.float16), "load", 4, CPU)
    monkeypatch.setattr(Pools, "kernels_reach", property(lambda self: False))
    with pytest.raises(ValueError, match="config.strategy='kernel'"):
        t.runner(KERNEL)
    t.poison()
    t.runner(DMA)()
    assert t.verify()


def test_host_memory_is_registered_where_the_platform_needs_it(monkeypatch):
    registered = []
    record = dataclasses.replace(platforms.get("cpu"), register_host=lambda buf: registered.append(buf))
    monkeypatch.setitem(platforms._RECORDS, "cpu", record)
    t = build_call(PoolShape.mha(1, 1, 8, torch.float16), "backup", 4, CPU)
    assert t.pools.host_pool.registered
    assert [b.data_ptr() for b in registered] == [t.pools.host.data_ptr()]


def test_bytes_left_over_from_an_earlier_run_do_not_pass(monkeypatch):
    """A gather result is a new buffer per call: one that holds an earlier run's rows (as a
    buffer the allocator hands out again would) fails, since poison changed the source."""
    from kvtier.pool import DevicePool
    t = build_call(PoolShape.mha(2, 2, 8, torch.float16, page_size=2), "gather", 6, CPU)
    t.poison()
    t.runner(KERNEL)()
    assert t.verify()
    stale = {n: v.clone() for n, v in t.output.items()}
    monkeypatch.setattr(DevicePool, "gather", lambda self, indices, pages=False: stale)
    t.poison()
    t.runner(KERNEL)()
    assert t.output is stale and not t.verify()
