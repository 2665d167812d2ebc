"""Whole-page copies (``by_page``) read page numbers in the kernel: the launch receives
the caller's slot indices as they are (no page list is made on the host) and each row of
the copy is a page whose first slot the kernel reads (``IDX_STEP``). A page whose slots
are negative is skipped where negatives are (the engines' convention)."""
import importlib

import pytest
import torch

from copy_rows_support import Side, oracle, run_and_check
from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from helpers import assert_bytes_equal
from kvtier.kernels import copy_rows

core = importlib.import_module("kvtier.kernels.launcher")
P = 4


def _pages(*pages):
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


@pytest.fixture
def launched(monkeypatch):
    """The index tensors and IDX_STEP every kernel launch receives."""
    seen, real = [], core._kernel()

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                a = core.launch_arguments(args, kw)
                seen.append((a["src_idx"], a["dst_idx"], a["IDX_STEP"], a["n_rows"]))
                return real[grid](*args, **kw)
            return run
    monkeypatch.setattr(core, "_kernel", lambda: Spy())
    return seen


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pages_are_read_from_the_slot_indices_in_the_kernel(launched, dtype):
    src = Side("stacked_paged", L=2, N=8 * P, P=P, row=(2, 8), seed=1)
    dst = Side("page_first_direct", L=2, N=8 * P, P=P, row=(2, 8), fill="poison", seed=2)
    si, di = _pages(5, 0, 3).to(dtype), _pages(1, 6, 2).to(dtype)
    run_and_check(src, si, dst, di, by_page=True)
    (s_idx, d_idx, step, n), = launched
    assert s_idx is si and d_idx is di and step == P and n == 3     # three pages, the caller's lists


def test_a_negative_page_is_skipped_where_negatives_are(launched):
    src = Side("stacked_paged", L=1, N=8 * P, P=P, row=(2, 8), seed=3)
    dst = Side("stacked_paged", L=1, N=8 * P, P=P, row=(2, 8), fill="poison", seed=4)
    si = torch.cat([_pages(2), torch.full((P,), -1), _pages(7)])
    di = _pages(0, 5, 3)
    want, _ = oracle(src, _pages(2, 7), dst, _pages(0, 3))
    copy_rows(src.map, si, dst.map, di, by_page=True, skip_negative=True, check=False)
    assert_bytes_equal(dst.logical(), want, "destination")
    src.check_margins()
    dst.check_margins()
    assert launched[0][2] == P
