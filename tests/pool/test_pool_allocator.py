"""The host page allocator: page-aligned slots, errors for double and foreign frees,
consistency under threads."""
import threading

import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.pool import PageAllocator


def test_alloc_returns_whole_pages_and_free_returns_them():
    a = PageAllocator(32, 4)
    x = a.alloc(12)
    assert x.dtype == torch.int64 and x.numel() == 12
    assert torch.equal(x.view(-1, 4) - x.view(-1, 4)[:, :1], torch.arange(4).expand(3, 4))
    assert bool((x[::4] % 4 == 0).all())
    assert a.available_size() == 20
    assert a.alloc(24) is None and a.available_size() == 20       # too few: nothing taken
    y = a.alloc(20)
    assert set(x.tolist()).isdisjoint(y.tolist()) and a.available_size() == 0
    assert a.free(x) == 12 and a.available_size() == 12
    assert a.alloc(0).numel() == 0


@pytest.mark.parametrize("bad,match", [
    (lambda a, x: a.free(x[4:]), "not allocated"),                   # double free
    (lambda a, x: a.free(torch.arange(28, 32)), "not allocated"),    # never handed out
    (lambda a, x: a.free(torch.arange(32, 36)), "not slots of this allocator"),
    (lambda a, x: a.free(torch.arange(1, 5)), "page boundary"),
    (lambda a, x: a.free(torch.cat([x[:4], x[:4]])), "twice"),
    (lambda a, x: a.free(x[:3]), "multiple of page_size"),
    (lambda a, x: a.alloc(6), "need_size=6"),
    (lambda a, x: a.free([0, 1, 2, 3]), "indices"),
], ids=["double", "never-allocated", "foreign", "misaligned", "twice-in-one", "partial", "alloc", "list"])
def test_bad_calls_raise_and_change_nothing(bad, match):
    a = PageAllocator(32, 4)
    x = a.alloc(8)
    a.free(x[4:])                       # page 1 is free again; page 0 is held
    avail = a.available_size()
    with pytest.raises(KvtierError, match=match):
        bad(a, x)
    assert a.available_size() == avail
    a.free(x[:4])                       # the held page is still held
    assert a.available_size() == 32


def test_allocator_under_threads():
    a = PageAllocator(4 * 64, 4)
    held, lock, errors = [], threading.Lock(), []

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        mine = []
        try:
            for _ in range(200):
                if mine and torch.rand(1, generator=g).item() < 0.5:
                    a.free(mine.pop(int(torch.randint(len(mine), (1,), generator=g))))
                else:
                    x = a.alloc(4 * int(torch.randint(1, 4, (1,), generator=g)))
                    if x is not None:
                        mine.append(x)
            with lock:
                held.extend(mine)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    slots = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
    assert slots.unique().numel() == slots.numel()                  # nothing handed out twice
    assert a.available_size() + slots.numel() == 4 * 64             # nothing lost
    for x in held:
        a.free(x)
    assert a.available_size() == 4 * 64
