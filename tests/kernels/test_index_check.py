"""`IndexGuard.check_pair` (`kvtier.kernels.index_check`): a pair plan made once checks
two lists exactly as `check` does (same verdict word, same errors naming the argument
and the value, the same reuse of a word that already holds the lists' verdict), for
every kind of bad list, an empty list and a count that is not whole pages. On the CPU the
check kernel runs under the interpreter, so a failure is raised in the call itself."""
import importlib

import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.kernels.index_check import IndexGuard
from kvtier.kernels.index_memo import facts

check_kernel = importlib.import_module("kvtier.kernels.index_check_kernel")

CPU = torch.device("cpu")
A, B = ("host_indices", 64, 4), ("device_indices", 32, 4)     # (name, limit, page)


def lists(a, b, fa=None, fb=None):
    return [(A[0], a, A[1], A[2], fa), (B[0], b, B[1], B[2], fb)]


def pages(*starts):
    return torch.cat([torch.arange(s, s + 4) for s in starts])


def error_of(fn):
    with pytest.raises(KvtierError) as e:
        fn()
    return str(e.value)


def test_a_good_pair_gets_the_word_check_gives():
    guard = IndexGuard()
    plan = guard.pair(A, B)
    a, b = pages(8, 60, 0), pages(28, 4, 12)
    word = guard.check_pair(CPU, plan, a, b)
    assert word is not None and int(word[0]) == 0
    assert guard.check(CPU, lists(a, b)) is word


@pytest.mark.parametrize("a, b, arg, value", [
    (pages(8, 0) - 9, pages(0, 4), "host_indices", "-1"),             # negative
    (pages(8, 0), pages(0, 32), "device_indices", "32"),             # out of range
    (pages(8, 0), torch.tensor([1, 2, 3, 4, 4, 5, 6, 7]), "device_indices", "1"),   # not a page
])
def test_bad_lists_raise_as_check_does(a, b, arg, value):
    msgs = []
    for run in (lambda g: g.check_pair(CPU, g.pair(A, B), a, b), lambda g: g.check(CPU, lists(a, b))):
        msgs.append(error_of(lambda: run(IndexGuard())))
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith(f"{arg}={value}"), msgs[0]


def test_a_count_that_is_not_whole_pages_is_named():
    guard = IndexGuard()
    msg = error_of(lambda: guard.check_pair(CPU, guard.pair(A, B), pages(0), torch.arange(6)))
    assert msg.startswith("len(device_indices)=6"), msg


def test_an_empty_list_leaves_the_other_to_check():
    guard = IndexGuard()
    plan = guard.pair(A, B)
    empty = torch.empty(0, dtype=torch.int64)
    assert guard.check_pair(CPU, plan, empty, empty) is None
    assert "device_indices=40" in error_of(lambda: guard.check_pair(CPU, plan, empty, pages(40)))
    assert int(guard.check_pair(CPU, plan, empty, pages(4))[0]) == 0


def test_unchanged_lists_reuse_the_word_and_a_failure_is_never_reused(monkeypatch):
    """With their facts, the same unchanged lists are checked once; a bad pair raises on
    every call, and a good pair after it is checked afresh and passes."""
    launches = []
    real = check_kernel._check_indices_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(check_kernel, "_check_indices_kernel", Counting())
    guard = IndexGuard()
    plan = guard.pair(A, B)
    a, b = pages(8, 0), pages(0, 4)
    ticket = []
    w1 = guard.check_pair(CPU, plan, a, b, facts(a), facts(b), ticket)
    w2 = guard.check_pair(CPU, plan, a, b, facts(a), facts(b))
    assert w1 is w2 and len(launches) == 1 and guard.holds(ticket[0])
    bad = pages(8, 0) + 100
    for _ in range(2):
        assert "host_indices=108" in error_of(lambda: guard.check_pair(CPU, plan, bad, b, facts(bad), facts(b)))
    assert len(launches) == 3 and not guard.holds(ticket[0])
    assert int(guard.check_pair(CPU, plan, a, b, facts(a), facts(b))[0]) == 0
    assert len(launches) == 4


def test_a_plan_of_one_list_checks_it_as_check_does():
    guard = IndexGuard()
    plan = guard.pair(("indices", 16, 1))
    good, bad = torch.tensor([3, 0, 15]), torch.tensor([3, 16, 0])
    word = guard.check_pair(CPU, plan, good, good)
    assert int(word[0]) == 0 and guard.check(CPU, [("indices", good, 16, 1)]) is word
    msgs = [error_of(lambda: guard.check_pair(CPU, plan, bad, bad)),
            error_of(lambda: IndexGuard().check(CPU, [("indices", bad, 16, 1)]))]
    assert msgs[0] == msgs[1] and msgs[0].startswith("indices=16"), msgs
    empty = torch.empty(0, dtype=torch.int64)
    assert guard.check_pair(CPU, plan, empty, empty) is None


def test_a_kept_plan_is_found_under_its_key():
    guard = IndexGuard()
    plan = guard.keep_plan(64, A, B)
    assert guard.plans[64] is plan and plan == guard.pair(A, B)
    assert int(guard.check_pair(CPU, guard.plans[64], pages(8), pages(4))[0]) == 0
