"""`index_ok`, the fast shape test of an index list, against `check_index`, the full one:
whatever the fast test passes, the full check passes; what it sends on is passed or named
by the full check; the usual list (a plain 1-D int tensor where the copy runs) is passed
by the fast test itself."""
import pytest
import torch

from kvtier.kernels.errors import KvtierError
from kvtier.kernels.validate import check_index, index_ok

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
