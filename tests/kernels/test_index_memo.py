"""What kvtier keeps per index tensor (`kvtier.kernels.index_memo`): kept while the
tensor is the same object at the same version, worked out again after an in-place write,
never kept for inference tensors or while a graph is being captured."""
import importlib

import torch

from kvtier.kernels.index_check import IndexGuard
from kvtier.kernels.index_memo import facts, page_starts

memo = importlib.import_module("kvtier.kernels.index_memo")
check_kernel = importlib.import_module("kvtier.kernels.index_check_kernel")


def test_kept_while_unchanged_and_afresh_after_a_write():
    t = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    f = facts(t)
    assert f is not None and facts(t) is f
    assert torch.equal(page_starts(t, 4), torch.tensor([1, 3]))
    assert page_starts(t, 4) is page_starts(t, 4)
    t[4:] = torch.tensor([0, 1, 2, 3])              # an in-place write bumps the version
    assert facts(t) is not f
    assert torch.equal(page_starts(t, 4), torch.tensor([1, 0]))


def test_data_rebound_is_a_change_though_the_version_stays():
    t = torch.arange(8)
    f = facts(t)
    version = t._version
    t.data = torch.arange(8, 16)                    # other memory
    assert t._version == version and facts(t) is not f
    f = facts(t)
    t.data = t.data.view(torch.int32)               # the same first byte, twice the elements
    assert t._version == version and facts(t) is not f


def test_a_view_is_its_own_tensor_and_a_dead_tensor_is_forgotten():
    t = torch.arange(8)
    f = facts(t)
    assert facts(t[:4]) is not f
    key = id(t)
    del t
    assert key not in memo._MEMO


def test_nothing_is_kept_for_inference_tensors_or_while_capturing(monkeypatch):
    with torch.inference_mode():
        t = torch.arange(8)
    assert facts(t) is None
    assert torch.equal(page_starts(t, 4), torch.tensor([0, 1]))
    u = torch.arange(8)
    monkeypatch.setattr(memo.platforms, "capturing", lambda: True)
    assert facts(u) is None


def test_a_guard_checks_again_while_capturing(monkeypatch):
    """The same unchanged lists are checked once; while a graph is captured, every call
    launches the check (a replay must check the values it finds)."""
    launches = []

    class Counting:
        def __getitem__(self, grid):
            return lambda *a, **k: launches.append(grid)
    monkeypatch.setattr(check_kernel, "_check_indices_kernel", Counting())
    guard, idx = IndexGuard(), torch.arange(8)
    lists = [("indices", idx, 16, 1)]
    for _ in range(3):
        guard.check(torch.device("cpu"), lists)
    assert len(launches) == 1
    monkeypatch.setattr(memo.platforms, "capturing", lambda: True)
    for _ in range(3):
        guard.check(torch.device("cpu"), lists)
    assert len(launches) == 4


def test_a_bad_list_passed_again_unchanged_is_refused_again():
    """A failed check is never reused: the same bad tensor, unchanged, raises every time."""
    import pytest
    from kvtier.kernels import KvtierError
    guard, bad = IndexGuard(), torch.tensor([0, 1, 99])
    for _ in range(3):
        with pytest.raises(KvtierError, match="indices=99"):
            guard.check(torch.device("cpu"), [("indices", bad, 16, 1)])
    good = torch.arange(4)
    assert guard.check(torch.device("cpu"), [("indices", good, 16, 1)]) is not None


def test_a_source_map_keeps_its_last_bound_copies_only():
    """Bound copies are kept per source map, the last KEEP_BOUND of them: destinations
    that come and go (new buffers) cannot pile up behind a long-lived map."""
    from kvtier.kernels import RowMap, copy_rows
    core = importlib.import_module("kvtier.kernels.copy_rows")
    src = RowMap.from_stacked(torch.arange(2 * 8 * 4, dtype=torch.float32).view(2, 8, 4))
    for _ in range(core.KEEP_BOUND + 5):
        dst = RowMap.from_stacked(torch.zeros(2, 8, 4))
        copy_rows(src, torch.tensor([1, 2]), dst, torch.tensor([0, 3]))
    assert len(src.derived.plans) == core.KEEP_BOUND


def test_a_pageable_list_is_not_staged_while_a_graph_is_captured(monkeypatch):
    """A capture would copy it once into a staging block that replays read after its
    release: refused, naming the argument, before anything is staged."""
    import pytest
    from kvtier.kernels import KvtierError
    from kvtier.kernels.index_memo import on_device
    idx, elsewhere = torch.tensor([3, 1]), torch.device("meta")
    monkeypatch.setattr(memo.platforms, "capturing", lambda: True)
    with pytest.raises(KvtierError, match="host_indices='pageable cpu tensor': cannot be staged"):
        on_device(idx, elsewhere, arg="host_indices")
    assert on_device(idx, torch.device("cpu"), arg="host_indices") is idx     # nothing to stage
