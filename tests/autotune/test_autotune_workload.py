"""The transfers the tuner times move exactly the right bytes, under both strategies,
for every host layout and both device layouts."""
import pytest
import torch

from kvtier.autotune.workload import POISON, PoolShape, build_transfer, rows_of
from kvtier.kernels.config import CopyConfig
from kvtier.kernels.reference import layer_rows

OPS = ("backup", "load", "gather", "scatter")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
KERNEL = CopyConfig(num_programs=2, rows=4, block_bytes=64, num_warps=1)
DMA = CopyConfig(num_programs=2, rows=4, block_bytes=64, num_warps=1, strategy="dma")


def _bytes(tensors):
    return [t.view(torch.uint8).clone() for t in tensors]


def _check_moved_exactly(t, src_before):
    """Every destination row holds its source row; every other destination byte is still
    poison; the source is untouched."""
    for c in range(t.src.num_components):
        for layer in range(t.src.num_layers):
            assert torch.equal(rows_of(t.dst, c, layer, t.dst_idx),
                               rows_of(t.src, c, layer, t.src_idx)), (c, layer)
    for c in range(t.dst.num_components):
        for layer in range(t.dst.num_layers):
            idx, P = t.dst_idx.long(), t.dst.page_size
            layer_rows(t.dst, c, layer)[idx // P, idx % P] = POISON   # the copied rows, re-poisoned
    for d in t.dst_tensors:
        assert bool((d.view(torch.uint8) == POISON).all()), "a byte outside the copied rows changed"
    for before, now in zip(src_before, _bytes(t.src_tensors), strict=True):
        assert torch.equal(before, now), "the source changed"


@pytest.mark.parametrize("device_layout", ["layers", "stacked"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_transfer_moves_exactly_its_rows(op, layout, device_layout):
    shape = PoolShape.mha(2, 2, 8, torch.float16, page_size=2, host_layout=layout, device_layout=device_layout)
    t = build_transfer(shape, op, num_rows=6, device=torch.device("cpu"), seed=1)
    assert t.num_rows == 6 and t.nbytes == 6 * 32 * 2 * 2
    assert t.crosses_link == (op in ("backup", "load"))
    for cfg in ((KERNEL, DMA) if t.crosses_link else (KERNEL,)):
        t.poison()
        assert not t.verify()                       # poison is not the source
        before = _bytes(t.src_tensors)
        t.runner(cfg)()
        assert t.verify()
        _check_moved_exactly(t, before)


def test_source_rows_are_random_and_device_slots_scattered():
    shape = PoolShape.mla(1, 32, 8, torch.bfloat16, page_size=4)
    t = build_transfer(shape, "backup", num_rows=10, device=torch.device("cpu"))
    assert t.num_rows == 12                         # whole pages
    assert t.src.row_bytes == 80 and t.src.num_components == 1
    pages = t.src_idx.view(-1, 4)
    assert torch.equal(pages - pages[:, :1], torch.arange(4).expand(3, 4))   # whole pages
    assert pages[:, 0].unique().numel() == 3 and not torch.equal(pages[:, 0], torch.arange(0, 12, 4))
    data = layer_rows(t.src, 0, 0).flatten()
    assert data.unique().numel() > 100              # random bytes, not a constant


def test_unknown_op_and_layout_are_rejected():
    shape = PoolShape.mha(1, 1, 8, torch.float16)
    with pytest.raises(ValueError, match="op='swap'"):
        build_transfer(shape, "swap", 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="device_layout='paged'"):
        PoolShape.mha(1, 1, 8, torch.float16, device_layout="paged")
    with pytest.raises(ValueError, match="host_layout='diagonal'"):
        PoolShape.mha(1, 1, 8, torch.float16, host_layout="diagonal")
    with pytest.raises(ValueError, match="page_size=0"):
        PoolShape.mha(1, 1, 8, torch.float16, page_size=0)
    with pytest.raises(ValueError, match="row_dims"):
        PoolShape.mha(1, 0, 8, torch.float16)
