"""`index_ok`, the fast shape test of an index list, against `check_index`, the full one:
whatever the fast test passes, the full check passes; what it sends on is passed or named
by the full check; the usual list (a plain 1-D int tensor where the copy runs) is passed
by the fast test itself.

`check_pages_in_range`, the value check of a page-granular list on the host, against
`check_range` then `check_page_aligned`: the same verdict and the same error, argument
and value on random lists, good and bad."""
import pytest
import torch

from kvtier.errors import KvtierError
from kvtier.kernels.validate import (check_index, check_page_aligned, check_pages_in_range, check_range,
                                     index_ok)

CPU = torch.device("cpu")


class Sub(torch.Tensor):
    pass


def cases():
    base = torch.arange(8, dtype=torch.int64)
    yield "int64", base, True
    yield "int32", base.to(torch.int32), True
    yield "strided view", torch.arange(16)[::2], True          # the launcher makes it dense
    yield "empty", torch.empty(0, dtype=torch.int64), True
    for dt in (torch.int8, torch.int16, torch.uint8, torch.float32, torch.bool):
        yield f"dtype {dt}", base.to(dt), False
    yield "0-d", torch.tensor(3), False
    yield "2-d", base.view(2, 4), False
    yield "meta", torch.empty(8, dtype=torch.int64, device="meta"), False
    yield "sparse", base.to_sparse(), False
    yield "subclass", base.as_subclass(Sub), True
    yield "list", [0, 1, 2], False
    yield "None", None, False


@pytest.mark.parametrize("name,idx,valid", list(cases()), ids=[c[0] for c in cases()])
def test_fast_test_never_passes_what_the_full_check_refuses(name, idx, valid):
    fast = index_ok(idx, CPU)
    if valid:
        check_index("idx", idx, CPU)            # passes
    else:
        with pytest.raises(KvtierError, match=r"^idx"):
            check_index("idx", idx, CPU)
        assert not fast
    if name in ("int64", "int32", "strided view", "empty"):
        assert fast                            # the usual list takes the fast path


def test_a_device_given_with_an_index_goes_to_the_full_check():
    # torch.device("cpu", 0) is where a CPU tensor lives, though not equal to its device:
    # the fast test sends it on and the full check passes it.
    idx, dev = torch.arange(4), torch.device("cpu", 0)
    assert not index_ok(idx, dev)
    check_index("idx", idx, dev)


def test_another_device_is_refused_by_both():
    idx = torch.arange(4)
    meta = torch.device("meta")
    assert not index_ok(idx, meta)
    with pytest.raises(KvtierError, match=r"idx\.device='cpu': must be on meta"):
        check_index("idx", idx, meta)


# ------------------------------------------------------------------ page lists on the host
def _two_step(idx, limit, page):
    check_range("idx", idx, limit)
    check_page_aligned("idx", idx, page)


def _outcome(check, idx, limit, page):
    try:
        check("idx", idx, limit, page) if check is check_pages_in_range else check(idx, limit, page)
    except KvtierError as e:
        return str(e)
    return None


def _page_lists(gen, page, limit):
    """Whole pages in random order, then each way a list can go wrong (alone or with
    another fault), as int64 and int32, dense and strided."""
    pages = torch.randperm(limit // page, generator=gen)[:5]
    good = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    yield "good", good
    yield "one page", good[:page]
    yield "empty", good[:0]
    yield "last page", torch.arange(limit - page, limit)
    for name, at, value in (("negative", 3, -1), ("out of range", 2 * page, limit + 7),
                            ("not consecutive", page + 1, int(good[page + 2])),
                            ("past the limit", 0, limit)):
        bad = good.clone()
        bad[at] = value
        yield name, bad
    yield "shifted run", good + 1                        # consecutive, off the boundary
    yield "negative page", torch.cat([torch.arange(-page, 0), good])
    yield "page past the end", torch.cat([good, torch.arange(limit, limit + page)])
    yield "shifted and out of range", torch.cat([good + 1, torch.arange(limit + 1, limit + 1 + page)])
    yield "runs reversed", good.view(-1, page).flip(1).reshape(-1)
    yield "partial page", good[:-1]
    yield "near int64 max", torch.arange(page, dtype=torch.int64) + (2 ** 63 - page)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("page", [1, 2, 3, 16])
def test_the_page_check_on_the_host_answers_as_its_two_steps(seed, page):
    gen, limit = torch.Generator().manual_seed(seed), 48 * 16      # whole pages of each size
    for name, idx in _page_lists(gen, page, limit):
        for form in (idx, idx.to(torch.int32) if idx.numel() == 0 or idx.abs().max() < 2 ** 31 else idx,
                     torch.stack([idx, idx], 1).reshape(-1)[::2]):        # strided view
            want = _outcome(_two_step, form, limit, page)
            assert _outcome(check_pages_in_range, form, limit, page) == want, (name, form.dtype)
            if name in ("good", "one page", "empty", "last page"):
                assert want is None, name
            elif page > 1 or name in ("negative", "out of range", "past the limit", "negative page",
                                      "page past the end", "shifted and out of range", "near int64 max"):
                assert want is not None, name
