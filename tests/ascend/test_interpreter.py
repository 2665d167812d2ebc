"""The kernel computes the right bytes under triton-ascend's own interpreter, with the
launch shape an NPU gets (one program per vector core, at least two rows per tile, tiles
from the Unified Buffer). Runs only where triton-ascend is the installed Triton
(.ci/ascend.sh, which also runs the kernel and pool suites under this interpreter)."""
import importlib

import pytest

pytest.importorskip("triton.backends.ascend", reason="needs triton-ascend (run .ci/ascend.sh)")

import torch  # noqa: E402

from helpers import POISON, Guarded, assert_bytes_equal  # noqa: E402
from kvtier.kernels import CopyConfig, RowMap, copy_rows, copy_rows_reference  # noqa: E402
from kvtier.platforms import npu_launch_limits  # noqa: E402

launcher = importlib.import_module("kvtier.kernels.launcher")
LIMITS = npu_launch_limits(props={"name": "Ascend910B4", "num_vectorcore": 40})
NPU = CopyConfig(num_programs=LIMITS["grid"], rows=LIMITS["min_rows"],
                 block_bytes=min(16384, LIMITS["max_tile_bytes"] // LIMITS["min_rows"]), num_warps=1)


def test_triton_is_ascend_interpreter():
    import triton
    assert triton.__version__.startswith("3.2"), triton.__version__
    assert launcher.interpreter_active()


@pytest.fixture
def kernel_only(monkeypatch):
    """Fail if a copy falls back to the torch reference: the kernel itself must run."""
    def refuse(*a, **k):
        raise AssertionError("copy_rows fell back to the torch reference")
    monkeypatch.setattr(launcher, "reference_copy", refuse)


L, N, P = 3, 12, 4


@pytest.mark.parametrize("dtype,row,layout", [
    (torch.float8_e4m3fn, (656,), "page_first"),        # fp8 MLA, moved as bytes
    (torch.bfloat16, (2, 64), "page_head"),             # MHA rows split per head on the host
    (torch.bfloat16, (2, 64), "page_first_direct"),
])
def test_backup_and_load_bit_exact(kernel_only, dtype, row, layout):
    gen = torch.Generator().manual_seed(7)
    dev = Guarded((L, N) + row, dtype, gen=gen)                       # random source
    if layout == "page_head":
        shape = (N // P, row[0], P, L, row[1])
    elif layout == "page_first_direct":
        shape = (N // P, L, P) + row
    else:
        shape = (N,) + (L,) + row
    host = Guarded(shape, dtype, fill="poison", gen=gen)
    want = Guarded(shape, dtype, fill="poison", gen=gen)
    d_map = RowMap.from_stacked(dev.t, page_size=P)
    h_map = RowMap.from_host_layout(host.t, layout, P)
    w_map = RowMap.from_host_layout(want.t, layout, P)
    si = torch.tensor([9, 0, 5, 11, 2], dtype=torch.int64)
    di = torch.tensor([1, 10, 3, 4, 8], dtype=torch.int32)
    before = host.snapshot()
    copy_rows(d_map, si, h_map, di, config=NPU)
    copy_rows_reference(d_map, si, w_map, di)
    assert_bytes_equal(host.bytes(), want.bytes(), "backup")
    changed = (host.bytes() != before)
    assert changed.any() and not (host.bytes()[~changed] != POISON).any(), "only written rows change"
    host.check()
    dev.check()

    # load back into a poisoned device buffer
    back = Guarded((L, N) + row, dtype, fill="poison", gen=gen)
    b_map = RowMap.from_stacked(back.t, page_size=P)
    copy_rows(h_map, di, b_map, si, config=NPU)
    for l in range(L):
        assert_bytes_equal(back.t[l, si.long()], dev.t[l, si.long()], f"load layer {l}")
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[si.long()] = False
    assert not (back.t[:, untouched].contiguous().view(torch.uint8) != POISON).any()
    back.check()


def test_single_row_uses_repeated_tile(kernel_only):
    """One index with a two-row NPU tile: the tile repeats the row, nothing else moves."""
    gen = torch.Generator().manual_seed(3)
    src = Guarded((2, 6, 40), torch.uint8, gen=gen)
    dst = Guarded((2, 6, 40), torch.uint8, fill="poison", gen=gen)
    copy_rows(RowMap.from_stacked(src.t), torch.tensor([4]), RowMap.from_stacked(dst.t),
              torch.tensor([1]), config=NPU)
    assert_bytes_equal(dst.t[:, 1], src.t[:, 4])
    assert not (dst.t[:, [0, 2, 3, 4, 5]] != POISON).any()
    dst.check()
