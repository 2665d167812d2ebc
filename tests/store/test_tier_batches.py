"""StoreTier calls of several batches: one batch's engine call runs while the tier
checksums and converts the batch before it; an engine miss ends a prefetch before
anything after it is read; whatever ends a call, no engine call of it is still running
and every staging buffer comes back."""
from __future__ import annotations

import logging
import threading

import pytest

from store_support import PAGE, POISON, canonical, host_case, poison, slots
from kvtier.store import Engine, Status, open_store
from kvtier.store.page import Checksum
from kvtier.store.tier import StoreTier

WAIT = 20.0     # seconds a test waits for the other side before it reports a hang


class Recording(Engine):
    """A file engine that records each get/put call's keys and how many run at once;
    ``before_get(i)`` runs at the start of the i-th get call (on its thread)."""

    scheme = "recording"

    def __init__(self, url):
        super().__init__("recording://" + url)
        self.inner = open_store(url)
        self.gets, self.puts = [], []
        self.running = self.most_running = 0
        self.before_get = None
        self._lock = threading.Lock()

    def _enter(self):
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)

    def _leave(self):
        with self._lock:
            self.running -= 1

    def _exists(self, keys):
        return self.inner.exists(keys)

    def _get_into(self, keys, targets, landed):
        self._enter()
        try:
            self.gets.append(list(keys))
            if self.before_get is not None:
                self.before_get(len(self.gets) - 1)
            return self.inner.get_into(keys, targets, landed)
        finally:
            self._leave()

    def _put_from(self, keys, sources):
        self._enter()
        try:
            self.puts.append(list(keys))
            return self.inner.put_from(keys, sources)
        finally:
            self._leave()

    def _delete(self, keys):
        return self.inner.delete(keys)


@pytest.fixture
def engine(tmp_path):
    return Recording(f"file://{tmp_path}/store")


def _keys(n):
    return [f"page-{i:04d}" for i in range(n)]


def _tier(host, engine, batch_pages=3):
    return StoreTier(host, engine, model="m", tp=(0, 1), batch_pages=batch_pages)


def _batches(tier, keys, *spans):
    """The store keys of ``keys[a:b]`` for each span: the engine calls expected."""
    return [[tier.key(k) for k in keys[a:b]] for a, b in spans]


def _stored(engine, layout="page_first", pages=12, n=9):
    host = host_case("mha", layout, pages=pages).host
    tier = _tier(host, engine)
    keys = _keys(n)
    want = [canonical(host, p * PAGE) for p in range(n)]
    assert tier.backup(keys, slots(range(n))) == [True] * n
    assert engine.puts == _batches(tier, keys, (0, 3), (3, 6), (6, 9))
    return host, tier, keys, want


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_each_batch_is_checksummed_while_the_next_one_is_read(engine, layout):
    """The prefetch's second engine call starts before the first batch is verified: the
    second get call waits for the first batch's checksum, which only runs at the same
    time if the tier overlaps them (run one after the other, the wait times out)."""
    host, tier, keys, want = _stored(engine, layout)
    checked = threading.Event()
    seen_in_flight = []

    class Signalling(Checksum):
        def matches(self, algorithm, pieces, stored):
            checked.set()
            return super().matches(algorithm, pieces, stored)

    tier.format.checksum = Signalling()
    engine.gets.clear()
    engine.before_get = lambda i: i == 1 and seen_in_flight.append(checked.wait(WAIT))
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert seen_in_flight == [True]
    assert engine.gets == _batches(tier, keys, (0, 3), (3, 6), (6, 9))
    assert engine.most_running == 1            # one engine call per tier call at a time
    assert [canonical(host, p * PAGE) for p in range(9)] == want


def test_backup_seals_the_next_batch_while_one_is_written(engine):
    host = host_case("mha", "page_first", pages=12).host
    tier = _tier(host, engine)
    keys = _keys(9)
    sealed_while_writing = []
    first_put_running = threading.Event()
    release = threading.Event()
    real_put, real_seal = engine._put_from, tier.format.seal

    def put(ks, sources):
        if engine.puts:
            return real_put(ks, sources)
        first_put_running.set()
        try:
            release.wait(WAIT)
            return real_put(ks, sources)
        finally:
            first_put_running.clear()

    def seal(key, pieces, algorithm=None):
        if key == tier.key(keys[3]) and first_put_running.is_set():
            sealed_while_writing.append(key)
            release.set()
        return real_seal(key, pieces, algorithm)

    engine._put_from, tier.format.seal = put, seal
    want = [canonical(host, p * PAGE) for p in range(9)]
    assert tier.backup(keys, slots(range(9))) == [True] * 9
    assert sealed_while_writing == [tier.key(keys[3])]
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want


def test_an_engine_miss_ends_the_prefetch_before_the_next_batch_is_read(engine):
    host, tier, keys, want = _stored(engine)
    engine.inner.delete([tier.key(keys[4])])
    engine.gets.clear()
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 4
    assert engine.gets == _batches(tier, keys, (0, 3), (3, 6))           # the third batch is never asked for
    assert [canonical(host, p * PAGE) for p in range(4)] == want[:4]
    for q in range(4, 12):                                 # staged: nothing after the run lands
        assert bool((host.get_page(q * PAGE) == POISON).all()), q
    assert tier.stats["misses"] == 1 and tier.stats["skipped"] == 4
    assert engine.running == 0 and len(tier.plan._free) >= 1


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_page_that_fails_verification_ends_the_call_with_nothing_running(engine, layout):
    """A corrupt page is found while the next batch is being read: the call waits for
    that read, returns the leading run, and leaves no engine call running; with a staged
    layout nothing after the run reaches the host pages."""
    host, tier, keys, want = _stored(engine, layout)
    path = engine.inner._path(tier.key(keys[1]))
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))
    engine.gets.clear()
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 1
    assert engine.running == 0
    assert engine.gets[0] == _batches(tier, keys, (0, 3))[0] and len(engine.gets) <= 2    # at most the next batch read
    assert canonical(host, 0) == want[0]
    if layout == "page_first":
        for q in range(1, 12):
            assert bool((host.get_page(q * PAGE) == POISON).all()), q
    assert tier.stats["corrupt"] == 1 and tier.stats["skipped"] == 7
    assert tier.prefetch(keys[2:], slots(range(2, 9))) == 7      # later pages intact
    assert [canonical(host, p * PAGE) for p in range(2, 9)] == want[2:]


@pytest.mark.parametrize("op", ["backup", "prefetch"])
def test_a_failure_between_batches_leaves_nothing_running_and_every_staging_back(engine, op, caplog):
    host, tier, keys, _ = _stored(engine)
    plan = tier.plan
    taken = []
    real_take, real_give = plan.take_staging, plan.give_staging
    plan.take_staging = lambda n: taken.append(real_take(n)) or taken[-1]
    plan.give_staging = lambda s: (taken.remove(s), real_give(s))
    calls = [0]
    where = plan.to_staging if op == "backup" else plan.from_staging

    def fails_second_time(*a):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("no memory")
        return where(*a)

    if op == "backup":
        plan.to_staging = fails_second_time
    else:
        plan.from_staging = fails_second_time
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        if op == "backup":
            assert tier.backup(keys, slots(range(9))) == [True] * 3 + [False] * 6
        else:
            assert tier.prefetch(keys, slots(range(9))) == 3
    assert f"{op} failed (MemoryError" in caplog.text
    assert engine.running == 0 and taken == []


def test_close_ends_the_worker_threads(engine):
    host, tier, keys, _ = _stored(engine)
    assert tier.prefetch(keys, slots(range(9))) == 9
    workers = list(tier._pool._threads)
    assert workers and all(t.is_alive() and t.name.startswith("kvtier-store") for t in workers)
    tier.close()
    assert not any(t.is_alive() for t in workers)
    assert tier.prefetch(keys, slots(range(9))) == 9        # a later call makes them again
    tier.close()
    again = _tier(host, engine)
    assert again.prefetch(keys[:3], slots(range(3))) == 3    # one batch: runs on the caller's thread
    assert again._pool is None


def test_status_counts_over_batches(engine):
    host, tier, keys, _ = _stored(engine)
    assert tier.stats["stored"] == 9
    engine.inner.delete([tier.key(keys[7])])
    assert tier.prefetch(keys, slots(range(9))) == 7
    assert tier.stats["hits"] == 7 and tier.stats["misses"] == 1 and tier.stats["skipped"] == 1
    assert tier.exists(keys) == 7
    assert Status.HIT in engine.exists([tier.key(keys[0])])


@pytest.mark.parametrize("reports", [True, False])
def test_a_one_batch_prefetch_verifies_pages_as_they_land(engine, reports):
    """With one batch (nothing to overlap), each page is verified inside the engine call
    right after it landed, while the CPU's cache holds it; an engine that reports
    nothing has its pages verified after the call, and a verification that raises
    inside the call is done again after it."""
    host, tier, keys, want = _stored(engine)
    tier.batch_pages = len(keys)
    if not reports:
        real = engine._get_into
        engine._get_into = lambda ks, ts, landed: real(ks, ts, lambda i: None)
    inside, real_verify = [], tier.format.verify
    raised = []

    def verify(key, header, pieces):
        inside.append(engine.running > 0)
        if engine.running and not raised:   # the first verification inside the call fails
            raised.append(key)
            raise RuntimeError("verification interrupted")
        return real_verify(key, header, pieces)

    tier.format.verify = verify
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want
    if reports:
        assert inside.count(True) == 9 and inside.count(False) == 1     # page 0 again, after
    else:
        assert inside == [False] * 9
    assert tier.stats["corrupt"] == 0


def test_a_prefetch_of_several_batches_verifies_on_the_calling_thread(engine):
    """Several batches: pages are verified by the calling thread (beside the next
    batch's engine call on the worker), not on the engine's thread."""
    host, tier, keys, want = _stored(engine)
    caller, on = threading.get_ident(), []
    real_verify = tier.format.verify

    def verify(key, header, pieces):
        on.append(threading.get_ident())
        return real_verify(key, header, pieces)

    tier.format.verify = verify
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want
    assert on == [caller] * 9
