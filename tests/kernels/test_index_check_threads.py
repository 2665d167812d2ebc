"""Index checks and threads (`kvtier.kernels.faults`): a check's verdict belongs to the
thread and stream of the call that made it, and its failure to that thread.

The interleaving a GPU allows when two threads enqueue on one stream (check of A, check
of B, copies of A, copies of B) is forced here through a seam in the check launch: with
a verdict shared between threads, A's out-of-range copies would read B's good verdict
and write out of bounds, or B's good call would raise A's failure. Launches check their
lists by a check launch of the call's own (the platform's inline limit set to 0), the
path whose verdict crosses from one launch to the next."""
from __future__ import annotations

import dataclasses
import importlib
import threading

import pytest

from copy_rows_support import Side, make_indices, oracle
from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from helpers import assert_bytes_equal
from kvtier.kernels import KvtierError, copy_rows
from kvtier.bounded import Bounded
import kvtier.platforms as platforms

core = importlib.import_module("kvtier.kernels.launcher")
transfer = importlib.import_module("kvtier.kernels.transfer")


@pytest.fixture
def check_launches(monkeypatch):
    """Every launch checks its lists by a check launch of its own (as many programs,
    several launches or Ascend do)."""
    no_inline = dataclasses.replace(platforms.get("cpu"), inline_check_programs=0)
    monkeypatch.setattr(core, "_platform", lambda device: no_inline)
    monkeypatch.setattr(core, "_LAUNCHES", Bounded(core._LAUNCHES.bound))
    yield


def _sides(seed):
    src = Side("table", L=2, N=16, P=4, row=(2, 8), seed=seed)
    dst = Side("page_first_direct", L=2, N=16, P=4, row=(2, 8), fill="poison", seed=seed + 1)
    return src, dst


@pytest.mark.parametrize("bad_first", [True, False], ids=["bad-then-good", "good-then-bad"])
def test_two_threads_interleaving_check_and_copy_each_get_their_own_verdict(check_launches, monkeypatch,
                                                                            bad_first):
    a_checked, b_checked = threading.Event(), threading.Event()
    real = transfer.check_launch

    def seam(*args, **kw):          # A's copies wait until B's check has run after A's
        words = real(*args, **kw)
        if threading.current_thread().name == "A":
            a_checked.set()
            assert b_checked.wait(10), "thread B never checked"
        else:
            b_checked.set()
        return words
    monkeypatch.setattr(transfer, "check_launch", seam)
    (src_a, dst_a), (src_b, dst_b) = _sides(1), _sides(3)
    si, di = make_indices("perm", 16, 16, seed=5)
    bad = di.clone()
    bad[3] = 16
    good_a = not bad_first
    lists = {"A": (si, di if good_a else bad), "B": (si, bad if good_a else di)}
    want = {"A": oracle(src_a, si, dst_a, di)[0], "B": oracle(src_b, si, dst_b, di)[0]}
    before = {"A": dst_a.logical().clone(), "B": dst_b.logical().clone()}
    outcome = {}

    def call(name, src, dst):
        if name == "B":
            assert a_checked.wait(10)
        try:
            copy_rows(src.map, *lists[name][:1], dst.map, lists[name][1])
            outcome[name] = None
        except KvtierError as e:
            outcome[name] = str(e)
        finally:
            if name == "B":
                b_checked.set()
    threads = [threading.Thread(target=call, name=n, args=(n, s, d)) for n, s, d in (("A", src_a, dst_a),
                                                                                         ("B", src_b, dst_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    bad_name, good_name = ("A", "B") if bad_first else ("B", "A")
    assert outcome[good_name] is None, f"a good call raised another thread's failure: {outcome[good_name]}"
    assert outcome[bad_name] is not None and "dst_indices=" in outcome[bad_name], outcome
    dsts = {"A": dst_a, "B": dst_b}
    assert_bytes_equal(dsts[good_name].logical(), want[good_name], "the good call's destination")
    assert_bytes_equal(dsts[bad_name].logical(), before[bad_name], "the bad call's destination")
    for side in (src_a, dst_a, src_b, dst_b):
        side.check_margins()


def test_a_failure_is_raised_by_the_thread_that_made_it_only(check_launches, monkeypatch):
    """A failure recorded for thread A (a device that had not run the check when A's call
    returned) is never raised by thread B's calls; A's next call raises it."""
    real_pending = transfer.faults.raise_pending
    src, dst = _sides(7)
    si, di = make_indices("perm", 16, 16, seed=8)
    bad = di.clone()
    bad[0] = 99
    with monkeypatch.context() as late:     # the check ran after A's call returned
        late.setattr(transfer.faults, "raise_pending", lambda this_call=False: None)
        copy_rows(src.map, si, dst.map, bad)
    errors = []

    def other():
        try:
            s2, d2 = _sides(9)
            copy_rows(s2.map, si, d2.map, di)
        except KvtierError as e:           # pragma: no cover - what this test refuses
            errors.append(str(e))
    t = threading.Thread(target=other)
    t.start()
    t.join(30)
    assert errors == [], errors
    assert transfer.faults.raise_pending is real_pending
    with pytest.raises(KvtierError, match="dst_indices=99: .*moved no bytes"):
        copy_rows(src.map, si, dst.map, di)


def test_threads_launching_at_once_each_move_their_own_bytes():
    """Threads that launch copies at the same time, with no seam ordering them: every
    copy moves its own rows (Triton's interpreter runs one launch at a time; two at once
    raise or run each other's programs)."""
    rounds, errors = 40, []
    cases = [_sides(20 + 2 * t) for t in range(3)]
    go = threading.Barrier(len(cases))

    def work(t):
        src, dst = cases[t]
        try:
            go.wait()
            for r in range(rounds):
                si, di = make_indices("perm", 16, 16, seed=100 * t + r)
                want = oracle(src, si, dst, di)[0]
                copy_rows(src.map, si, dst.map, di)
                assert_bytes_equal(dst.logical(), want, f"thread {t} round {r}")
        except BaseException as e:         # pragma: no cover - what this test refuses
            errors.append(f"thread {t}: {e!r}"[:300])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(cases))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert errors == [], errors
