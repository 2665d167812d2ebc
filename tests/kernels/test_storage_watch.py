"""The storage watch (`kvtier.kernels.storage_watch`): a watch passes while every tensor
keeps its storage and names the first that moved; a long watch goes through torch's
one-call pointer comparison where the build has it, and what that call says is checked
again per tensor before anything is refused. Pools and copies refusing a moved tensor:
test_rowmap_storage.py."""
from __future__ import annotations

import pytest
import torch

from kvtier.kernels import KvtierError, RowMap
from kvtier.kernels import storage_watch as sw


def _table_watch(n_layers: int):
    layers = [torch.zeros(4, 8) for _ in range(n_layers)]
    m = RowMap.from_layers(layers, page_size=1)
    return layers, sw.watch(m, 0, n_layers)


@pytest.fixture
def batched(monkeypatch):
    """A stand-in for torch's batched comparison with its contract (py::list arguments:
    a tuple is refused), counting its calls, on a build that lacks it (the CPU's)."""
    calls = []

    def same(tensors, ptrs, indices):
        if not (type(tensors) is list and type(ptrs) is list and type(indices) is list):
            raise TypeError("incompatible function arguments")
        calls.append(len(indices))
        return all(tensors[i].data_ptr() == ptrs[i] for i in indices)
    monkeypatch.setattr(sw, "_SAME_PTRS", same)
    return calls


@pytest.mark.parametrize("n_layers", [1, 3, 16])
def test_unchanged_tensors_pass_and_a_moved_one_is_named(n_layers):
    layers, w = _table_watch(n_layers)
    assert len(w.tensors) == n_layers
    sw.check_storage(w)
    layers[-1].set_(torch.zeros(4, 8))
    with pytest.raises(KvtierError, match=rf"layers\[{n_layers - 1}\].*no longer has the storage"):
        sw.check_storage(w)


def test_a_long_watch_uses_the_batched_comparison(batched):
    layers, w = _table_watch(2 * sw.BATCH_FROM)
    assert w.lists is not None
    sw.check_storage(w)
    assert batched == [2 * sw.BATCH_FROM]
    layers[5].resize_(1 << 16)
    with pytest.raises(KvtierError, match=r"layers\[5\]"):
        sw.check_storage(w)
    assert len(batched) == 2


def test_a_short_watch_and_a_joined_one(batched):
    _, short = _table_watch(sw.BATCH_FROM - 1)
    assert short.lists is None
    sw.check_storage(short)
    assert batched == []
    joined = short + short          # two sides of one copy
    assert joined.lists is not None and len(joined.lists[0]) == 2 * (sw.BATCH_FROM - 1)
    sw.check_storage(joined)
    assert batched == [2 * (sw.BATCH_FROM - 1)]


@pytest.mark.parametrize("answer", ["wrong", "raises"])
def test_the_per_tensor_comparison_judges(monkeypatch, answer):
    """A batched answer of "changed" (or an error) that the tensors do not bear out
    refuses nothing: the per-tensor comparison decides."""
    def same(*a):
        if answer == "raises":
            raise RuntimeError("tensor has no storage")
        return False
    monkeypatch.setattr(sw, "_SAME_PTRS", same)
    layers, w = _table_watch(sw.BATCH_FROM)
    sw.check_storage(w)
    layers[0].set_(torch.zeros(4, 8))
    with pytest.raises(KvtierError, match=r"layers\[0\]"):
        sw.check_storage(w)


@pytest.mark.cuda      # run by the hardware script: CUDA builds of torch have the call
@pytest.mark.skipif(getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None) is None,
                    reason="this torch build has no batched pointer comparison (CUDA builds do)")
def test_torchs_own_batched_comparison():
    layers, w = _table_watch(2 * sw.BATCH_FROM)
    assert w.lists is not None
    sw.check_storage(w)
    layers[3].set_(torch.zeros(4, 8))
    with pytest.raises(KvtierError, match=r"layers\[3\]"):
        sw.check_storage(w)
