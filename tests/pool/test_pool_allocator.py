"""The host page allocator: page-aligned slots, errors for double and foreign frees,
consistency under threads."""
import threading

import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.pool import PageAllocator


def run_threads(worker, n: int) -> None:
    """``worker(seed)`` on ``n`` threads at once, seeds 0..n-1; returns when all are done."""
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


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

    run_threads(worker, 4)
    assert not errors
    slots = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
    assert slots.unique().numel() == slots.numel()                  # nothing handed out twice
    assert a.available_size() + slots.numel() == 4 * 64             # nothing lost
    for x in held:
        a.free(x)
    assert a.available_size() == 4 * 64


def test_free_of_free_pages_raises_and_names_the_slot():
    a = PageAllocator(32, 4)
    x = a.alloc(8)
    assert a.free(x) == 8
    with pytest.raises(KvtierError, match=r"indices=0: slot is not allocated"):
        a.free(x)                                           # both pages are free now
    with pytest.raises(KvtierError, match=r"indices=8: slot is not allocated"):
        a.free(torch.arange(8, 12))                         # never handed out
    assert a.available_size() == 32


@pytest.mark.parametrize("indices,match", [
    (torch.tensor([-4, -3, -2, -1]), r"indices=-4: out of range: not slots of this allocator"),
    (torch.arange(32, 36), r"indices=32: out of range"),
    (torch.tensor([4, 5, 6, 8]), r"indices=\[4, 5, 6, 8\]: page 0 is not 4 consecutive"),
    (torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), r"indices=0: frees a page twice in one call"),
    (torch.tensor([0, 1]), r"len\(indices\)=2"),
    (torch.zeros(4), r"indices.dtype=torch.float32"),
    (torch.zeros(1, 4, dtype=torch.int64), r"indices.shape=\(1, 4\)"),
], ids=["negative", "past-the-end", "not-a-run", "duplicate", "partial", "float", "2-d"])
def test_each_documented_check_names_the_value(indices, match):
    a = PageAllocator(32, 4)
    x = a.alloc(32)
    with pytest.raises(KvtierError, match=match):
        a.free(indices)
    assert a.available_size() == 0                          # nothing freed
    assert a.free(x) == 32


def test_owner_token_catches_a_stale_free_after_reallocation():
    a = PageAllocator(16, 4)
    x = a.alloc(8, owner="req-1")
    assert a.owner_of(int(x[0])) == "req-1"
    assert a.free(x, owner="req-1") == 8
    y = a.alloc(16, owner="req-2")                          # the same pages, handed to someone else
    assert set(x.tolist()) <= set(y.tolist())
    with pytest.raises(KvtierError, match=r"owner='req-1': the page at slot \d+ was allocated by owner 'req-2'"):
        a.free(x, owner="req-1")                            # the stale free is refused
    with pytest.raises(KvtierError, match=r"owner=None: .* by owner 'req-2'"):
        a.free(x)                                           # and so is an anonymous one
    assert a.available_size() == 0                          # nothing was freed
    assert a.free(y, owner="req-2") == 16 and a.available_size() == 16


def test_owner_must_match_for_every_page_of_one_call():
    a = PageAllocator(16, 4)
    x = a.alloc(4, owner=1)
    y = a.alloc(4)                                          # no owner
    with pytest.raises(KvtierError, match=r"owner=1: the page at slot \d+ was allocated without an owner"):
        a.free(torch.cat([x, y]), owner=1)
    assert a.available_size() == 8                          # x was not freed either
    with pytest.raises(KvtierError, match=r"owner='list'"):
        a.alloc(4, owner=[1])                               # unhashable
    with pytest.raises(KvtierError, match=r"owner='dict'"):
        a.free(x, owner={})
    assert a.available_size() == 8
    assert a.free(y) == 4 and a.free(x, owner=1) == 4 and a.available_size() == 16
    a.alloc(16, owner=object())
    a.clear()                                               # clear forgets owners
    assert a.free(a.alloc(16)) == 16


def test_owner_of_and_bool_sizes():
    a = PageAllocator(8, 4)
    with pytest.raises(KvtierError, match="index=0: slot is not allocated"):
        a.owner_of(0)
    with pytest.raises(KvtierError, match="index=8"):
        a.owner_of(8)
    with pytest.raises(KvtierError, match="need_size=True"):
        a.alloc(True)
    with pytest.raises(KvtierError, match="page_size=True"):
        PageAllocator(8, True)
    with pytest.raises(KvtierError, match="size=8.0"):
        PageAllocator(8.0, 4)


def test_owned_allocations_under_threads_refuse_every_stale_free():
    a = PageAllocator(4 * 32, 4)
    held, lock, errors, refused = [], threading.Lock(), [], [0]

    def worker(seed):
        g = torch.Generator().manual_seed(seed)
        mine, freed = [], []
        try:
            for _ in range(150):
                r = torch.rand(1, generator=g).item()
                if freed and r < 0.2:            # a stale free: its pages are free or someone else's
                    try:
                        a.free(freed[int(torch.randint(len(freed), (1,), generator=g))], owner=seed)
                    except KvtierError:
                        with lock:
                            refused[0] += 1
                    else:
                        raise AssertionError("a stale free was accepted")
                elif mine and r < 0.6:
                    x = mine.pop(int(torch.randint(len(mine), (1,), generator=g)))
                    a.free(x, owner=seed)
                    freed.append(x)
                else:
                    x = a.alloc(4 * int(torch.randint(1, 4, (1,), generator=g)), owner=seed)
                    if x is not None:
                        mine.append(x)
                        # A page freed earlier and now held again by this worker: the old
                        # tensor is no longer stale for it; forget it.
                        freed = [f for f in freed if set(f.tolist()).isdisjoint(x.tolist())]
            with lock:
                held.extend((seed, x) for x in mine)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    run_threads(worker, 4)
    assert not errors, errors
    assert refused[0] > 0
    slots = torch.cat([x for _, x in held]) if held else torch.empty(0, dtype=torch.int64)
    assert slots.unique().numel() == slots.numel()
    assert a.available_size() + slots.numel() == 4 * 32
    for seed, x in held:
        a.free(x, owner=seed)
    assert a.available_size() == 4 * 32
