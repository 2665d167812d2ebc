"""The baselines beside kvtier: the vLLM swap kernel's jobs (contiguous runs) move exactly
the transfer's bytes on every host layout, vLLM's own kernel does too under the
interpreter where its source has been fetched, the contiguous torch copy_ is verified,
and every baseline that cannot run here says why."""
import ctypes
import sys

import pytest
import torch

from bench_support import SIDES, expected_after, guarded_workload, rows_of
from kvtier.bench.pools import POISON
from kvtier.bench import sgl_baseline, torch_baseline, vllm_baseline
from kvtier.bench.workload import Shape, Unsupported

SHAPES = [
    Shape(components=2, layers=2, row_bytes=256, page_size=4, tokens=16, layout="layer_first"),
    Shape(components=2, layers=3, row_bytes=128, page_size=4, tokens=16, layout="page_first"),
    Shape(components=1, layers=2, row_bytes=656, page_size=2, tokens=8, layout="page_first_direct"),
    Shape(components=2, layers=2, row_bytes=256, page_size=4, tokens=16, layout="page_head"),
]
IDS = [f"{s.layout}-{s.row_bytes}B" for s in SHAPES]
OPS = ("load", "load_layer", "backup")


def _run_jobs(src, dst, sizes):
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)


def _check(w, op, mover):
    w.poison(op)
    before_src, before_dst = rows_of(w, SIDES[op][0]), rows_of(w, SIDES[op][1])
    mover()
    assert torch.equal(rows_of(w, SIDES[op][1]), expected_after(w, op, before_src, before_dst))
    assert torch.equal(rows_of(w, SIDES[op][0]), before_src)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("op", OPS)
def test_jobs_move_exactly_the_rows(shape, op):
    w, alloc = guarded_workload(shape, seed=4)
    src, dst, sizes = vllm_baseline.jobs(w.copy(op))
    assert src.dtype == dst.dtype == sizes.dtype == torch.int64
    assert int(sizes.sum()) == w.copy(op).nbytes
    _check(w, op, lambda: _run_jobs(src, dst, sizes))
    alloc.check()


def test_jobs_are_whole_pages_where_both_sides_hold_pages_contiguously():
    s = SHAPES[0]
    w, _ = guarded_workload(s)
    _, _, sizes = vllm_baseline.jobs(w.copy("load"))
    pages = s.tokens // s.page_size
    assert sizes.numel() <= s.components * s.layers * pages
    assert bool((sizes % (s.page_size * s.row_bytes) == 0).all())


@pytest.mark.skipif(not vllm_baseline.DEFAULT_PATH.is_file(),
                    reason="vLLM's swap source not fetched (bench/scripts/fetch_baselines.sh)")
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_vllm_kernel_moves_exactly_the_rows_under_the_interpreter(shape):
    mod = vllm_baseline._load_file(vllm_baseline.DEFAULT_PATH)
    assert not any(n == "vllm" or n.startswith("vllm.") for n in sys.modules)   # stand-ins removed
    w, alloc = guarded_workload(shape, seed=6)
    for op in ("load", "load_layer"):
        src, dst, sizes = vllm_baseline.jobs(w.copy(op))
        n = sizes.numel()
        _check(w, op, lambda: mod._swap_blocks_kernel[(min(12, n),)](src, dst, sizes, n, BYTES_PER_CHUNK=256))
    alloc.check()


def test_vllm_baseline_says_why_it_does_not_run_here():
    w, _ = guarded_workload(SHAPES[0])
    assert "CUDA only" in vllm_baseline.status(torch.device("cpu"))
    assert vllm_baseline.load_swap() is None          # no CUDA device here
    with pytest.raises(Unsupported, match="host -> device only"):
        vllm_baseline.prepare(w, "backup", swap=object())
    with pytest.raises(Unsupported, match="CUDA only"):
        vllm_baseline.prepare(w, "load", swap=object())
    assert [op for op in ("backup", "load_layer", "load", "gather", "scatter") if vllm_baseline.applies(op)] == \
        ["load_layer", "load"]


def test_sgl_kernel_absence_names_the_reason():
    assert sgl_baseline.load_kvcacheio() is None
    assert "536 MB" in sgl_baseline.ABSENT and "torch 2.9.1" in sgl_baseline.ABSENT


@pytest.mark.parametrize("op", ["backup", "load", "gather"])
def test_torch_copy_moves_the_same_bytes_and_is_verified(op):
    w, alloc = guarded_workload(SHAPES[0], seed=2)
    p = torch_baseline.prepare_copy(w, op)
    check = p.written()
    assert check.dst.numel() == w.copy(op).nbytes and (check.dst == POISON).all()
    assert "differs" in check.mismatch()
    p.fn()
    assert check.mismatch() is None
    alloc.check()
