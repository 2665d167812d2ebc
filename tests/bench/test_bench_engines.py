"""Every engine the benchmark times moves exactly the bytes of the operation: each
destination byte that should change does, every other byte (and the sentinel margins)
keeps its poison, compared with a plain-torch model built from the buffers' dims."""
import pytest
import torch

from bench_support import SIDES, expected_after, guarded_workload, rows_of
from kvtier.bench import kvtier_engine, pool_engine, torch_baseline
from kvtier.bench.pools import POISON
from kvtier.bench.workload import Shape, Unsupported

SHAPES = [
    Shape(components=2, layers=2, row_bytes=128, page_size=1, tokens=32, layout="layer_first"),
    Shape(components=2, layers=3, row_bytes=256, page_size=4, tokens=16, layout="page_first"),
    Shape(components=1, layers=2, row_bytes=656, page_size=4, tokens=16, layout="page_first_direct"),
    Shape(components=2, layers=2, row_bytes=256, page_size=4, tokens=16, layout="page_head"),
]
ENGINES = {
    "copy_rows": lambda w, op: kvtier_engine.prepare(w, op),
    "copy_rows p<=2": lambda w, op: kvtier_engine.prepare(w, op, num_programs=2),
    "pool kernel": lambda w, op: pool_engine.prepare(w, op, strategy="kernel"),
    "pool dma": lambda w, op: pool_engine.prepare(w, op, strategy="dma"),
    "torch": torch_baseline.prepare,
}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.layout}-{s.row_bytes}B-P{s.page_size}")
@pytest.mark.parametrize("op", list(SIDES))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_moves_exactly_the_rows(shape, op, engine):
    if op in ("gather", "scatter") and engine == "pool dma":
        pytest.skip(f"{op} has no strategy")
    w, alloc = guarded_workload(shape, seed=3)
    src_side, dst_side = SIDES[op]
    p = ENGINES[engine](w, op)
    w.poison(op)
    before_src, before_dst = rows_of(w, src_side), rows_of(w, dst_side)
    assert (before_dst == POISON).all() and not (before_src == POISON).all()
    p.fn()
    got_dst = p.written().dst if p.written else None
    if got_dst is None:
        after = rows_of(w, dst_side)
        want = expected_after(w, op, before_src, before_dst)
        assert torch.equal(after, want), f"{engine} {op}: destination differs from the torch model"
        assert not torch.equal(after, before_dst), "nothing moved"
    assert (p.written() if p.written else w.copy(op)).mismatch() is None
    assert torch.equal(rows_of(w, src_side), before_src), "the source changed"
    alloc.check()


def test_pool_gather_result_matches_model():
    w, alloc = guarded_workload(SHAPES[1], seed=5)
    p = pool_engine.prepare(w, "gather")
    p.fn()
    t = p.written()
    before = rows_of(w, "device")
    idx = w.device_slots.long()
    from kvtier.kernels.reference import layer_rows
    for c in range(2):
        for l in range(w.shape.layers):
            got = layer_rows(t.dst, c, l).reshape(w.shape.tokens, -1)
            assert torch.equal(got, before[c, l, idx])
    alloc.check()


def test_verify_reports_wrong_layer_and_untouched_destination():
    w, _ = guarded_workload(SHAPES[0], seed=1)
    t = w.copy("load")
    w.poison("load")
    msg = t.mismatch()
    assert msg and "differs" in msg
    # Right rows, wrong layer: layer 0's rows written into layer 1.
    from kvtier.kernels import copy_rows_reference
    copy_rows_reference(t.src, t.src_indices, t.dst, t.dst_indices, src_layer=0, dst_layer=0, num_layers=1)
    copy_rows_reference(t.src, t.src_indices, t.dst, t.dst_indices, src_layer=0, dst_layer=1, num_layers=1)
    assert "layer 1" in t.mismatch()
    copy_rows_reference(t.src, t.src_indices, t.dst, t.dst_indices)
    assert t.mismatch() is None


def test_strategies_other_than_kernel_are_not_copy_rows_points():
    w, _ = guarded_workload(SHAPES[0])
    with pytest.raises(Unsupported, match="dma"):
        kvtier_engine.prepare(w, "backup", strategy="dma")


def test_page_head_needs_head_sized_rows():
    s = Shape(components=1, layers=1, row_bytes=656, page_size=1, tokens=8, layout="page_head")
    assert "128-byte heads" in s.supported()
    with pytest.raises(ValueError, match="128-byte heads"):
        guarded_workload(s)
