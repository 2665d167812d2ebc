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
    ``before_get(i)`` runs at the start of the i-th get call (on its thread).
    ``fills_as_sent``: whether it passes `put_from`'s ``fill`` to the file engine (which
    calls it as it writes each value) or, as Mooncake, calls it for every key first;
    ``reports``: whether it passes `get_into`'s ``landed`` on or, as Mooncake, reports
    nothing."""

    scheme = "recording"

    def __init__(self, url, fills_as_sent=False, reports=True):
        super().__init__("recording://" + url)
        self.inner = open_store(url)
        self.fills_as_sent, self.reports = fills_as_sent, reports
        self.gets, self.puts = [], []
        self.buffer_counts = []     # per call: how many buffers each key's value was in
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
            self.buffer_counts.append([len(t) for t in targets])
            if self.before_get is not None:
                self.before_get(len(self.gets) - 1)
            return self.inner.get_into(keys, targets, landed if self.reports else None)
        finally:
            self._leave()

    def _put_from(self, keys, sources, fill):
        self._enter()
        try:
            self.puts.append(list(keys))
            self.buffer_counts.append([len(s) for s in sources])
            return self.inner.put_from(keys, sources, fill)
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
    return StoreTier(host, engine, model="m", tp=(0, 8), batch_pages=batch_pages)    # one object per page


def _batches(tier, keys, *spans):
    """The store keys of ``keys[a:b]`` for each span: the engine calls expected."""
    return [[tier.keys(k)[0] for k in keys[a:b]] for a, b in spans]


def _flip_last_byte(engine, key):
    """Corrupt the stored object of ``key`` (its payload's last byte)."""
    with open(engine.inner._path(key), "r+b") as f:
        f.seek(-1, 2)
        b = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([b[0] ^ 1]))


def _stored(engine, layout="page_first", pages=12, n=9):
    host = host_case("mha", layout, pages=pages).host
    tier = _tier(host, engine)
    keys = _keys(n)
    want = [canonical(host, p * PAGE) for p in range(n)]
    assert tier.backup(keys, slots(range(n))) == [True] * n
    assert engine.puts == _batches(tier, keys, (0, 3), (3, 6), (6, 9))
    return host, tier, keys, want


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_each_batch_is_checksummed_while_the_next_one_is_read(tmp_path, layout):
    """With an engine that reports no page landed (Mooncake), the prefetch's second
    engine call starts before the first batch is verified: the second get call waits
    for the first batch's checksum, which only runs at the same time if the tier
    overlaps them (run one after the other, the wait times out)."""
    engine = Recording(f"file://{tmp_path}/store", reports=False)
    host, tier, keys, want = _stored(engine, layout)
    checked = threading.Event()
    seen_in_flight = []

    class Signalling(Checksum):
        def matches(self, algorithm, pieces, stored):
            checked.set()
            return super().matches(algorithm, pieces, stored)

    tier.read.formats[0].checksum = Signalling()
    engine.gets.clear()
    engine.before_get = lambda i: i == 1 and seen_in_flight.append(checked.wait(WAIT))
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert seen_in_flight == [True]
    assert engine.gets == _batches(tier, keys, (0, 3), (3, 6), (6, 9))
    assert engine.most_running == 1            # one engine call per tier call at a time
    assert [canonical(host, p * PAGE) for p in range(9)] == want


def test_backup_seals_the_next_batch_while_one_is_written(engine):
    """With an engine that takes a batch's sources all at once (Mooncake), the next
    batch is sealed while one is written."""
    host = host_case("mha", "page_first", pages=12).host
    tier = _tier(host, engine)
    keys = _keys(9)
    sealed_while_writing = []
    first_put_running = threading.Event()
    release = threading.Event()
    real_put, real_seal = engine._put_from, tier.read.formats[0].seal_into

    def put(ks, sources, fill):
        if engine.puts:
            return real_put(ks, sources, fill)
        first_put_running.set()
        try:
            release.wait(WAIT)
            return real_put(ks, sources, fill)
        finally:
            first_put_running.clear()

    def seal(header, pieces, algorithm=None):
        key = tier.keys(keys[3])[0]
        # (the first put may not have started yet on a busy machine: wait for it; a tier
        # that sealed only after the first put returned finds it cleared and waits in vain)
        if key.encode() in bytes(header) and first_put_running.wait(WAIT):
            sealed_while_writing.append(key)
            release.set()
        return real_seal(header, pieces, algorithm)

    engine._put_from, tier.read.formats[0].seal_into = put, seal
    want = [canonical(host, p * PAGE) for p in range(9)]
    assert tier.backup(keys, slots(range(9))) == [True] * 9
    assert sealed_while_writing == [tier.keys(keys[3])[0]]
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want


def test_an_engine_miss_ends_the_prefetch_before_the_next_batch_is_read(engine):
    host, tier, keys, want = _stored(engine)
    engine.inner.delete([tier.keys(keys[4])[0]])
    engine.gets.clear()
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 4
    assert engine.gets == _batches(tier, keys, (0, 3), (3, 6))           # the third batch is never asked for
    assert [canonical(host, p * PAGE) for p in range(4)] == want[:4]
    for q in range(6, 12):          # staged: nothing of the batch never read reaches the host
        assert bool((host.get_page(q * PAGE) == POISON).all()), q
    assert tier.stats["misses"] == 1 and tier.stats["skipped"] == 4
    assert engine.running == 0 and len(tier.canonical._free) >= 1


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_page_that_fails_verification_ends_the_call_with_nothing_running(engine, layout):
    """A corrupt page is found while the next batch is being read: the call waits for
    that read, returns the leading run, and leaves no engine call running; with a staged
    layout neither the corrupt page nor any page never read reaches the host pages."""
    host, tier, keys, want = _stored(engine, layout)
    _flip_last_byte(engine, tier.keys(keys[1])[0])
    engine.gets.clear()
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 1
    assert engine.running == 0
    assert engine.gets[0] == _batches(tier, keys, (0, 3))[0] and len(engine.gets) <= 2    # at most the next batch read
    assert canonical(host, 0) == want[0]
    if layout == "page_first":      # staged: neither the corrupt page nor any page never read
        for q in [1] + list(range(3 * len(engine.gets), 12)):
            assert bool((host.get_page(q * PAGE) == POISON).all()), q
    assert tier.stats["corrupt"] == 1 and tier.stats["skipped"] == 7
    assert tier.prefetch(keys[2:], slots(range(2, 9))) == 7      # later pages intact
    assert [canonical(host, p * PAGE) for p in range(2, 9)] == want[2:]


@pytest.mark.parametrize("op", ["backup", "prefetch"])
def test_a_failure_between_batches_leaves_nothing_running_and_every_staging_back(tmp_path, op, caplog):
    """Preparing the second batch fails on the calling thread (backup: its payload
    pieces; prefetch, with an engine that reports no page landed, as Mooncake: its
    staging copy, which runs there): the call ends with what was moved before it."""
    engine = Recording(f"file://{tmp_path}/store", reports=False)
    host, tier, keys, _ = _stored(engine)
    plan = tier.canonical
    taken = []
    real_take, real_give = plan.take_staging, plan.give_staging
    plan.take_staging = lambda n: taken.append(real_take(n)) or taken[-1]
    plan.give_staging = lambda s: (taken.remove(s), real_give(s))
    calls = [0]
    where = plan.pieces if op == "backup" else plan.from_staging
    fail_at = 4 if op == "backup" else 2        # the second batch's first page, its second copy

    def fails(*a):
        calls[0] += 1
        if calls[0] == fail_at:
            raise MemoryError("no memory")
        return where(*a)

    if op == "backup":
        plan.pieces = fails
    else:
        plan.from_staging = fails
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
    engine.inner.delete([tier.keys(keys[7])[0]])
    assert tier.prefetch(keys, slots(range(9))) == 7
    assert tier.stats["hits"] == 7 and tier.stats["misses"] == 1 and tier.stats["skipped"] == 1
    assert tier.exists(keys) == 7
    assert Status.HIT in engine.exists([tier.keys(keys[0])[0]])


@pytest.mark.parametrize("batch_pages", [9, 3])
@pytest.mark.parametrize("reports", [True, False])
def test_pages_are_verified_and_placed_as_they_land(tmp_path, reports, batch_pages):
    """Each page the engine reports landed is verified inside the engine call, while
    the CPU's cache holds it, and its staged components are placed in its host page
    there too; a verification that raises inside the call is done again after it. An
    engine that reports nothing has its pages verified and placed after each call, on
    the calling thread (beside the next batch's engine call, `_run`)."""
    engine = Recording(f"file://{tmp_path}/store", reports=reports)
    host, tier, keys, want = _stored(engine)
    tier.batch_pages = batch_pages
    caller = threading.get_ident()
    inside, placed_inside, threads = [], [], set()
    real_verify, real_place = tier.read.formats[0].verify, tier.canonical.from_staging
    raised = []

    def verify(key, header, pieces):
        inside.append(engine.running > 0)
        threads.add(threading.get_ident())
        if engine.running and not raised:   # the first verification inside the call fails
            raised.append(key)
            raise RuntimeError("verification interrupted")
        return real_verify(key, header, pieces)

    def place(staging, host_pages, first_slot=0, obj=None):
        placed_inside.extend([engine.running > 0] * len(host_pages))
        return real_place(staging, host_pages, first_slot, obj)

    tier.read.formats[0].verify, tier.canonical.from_staging = verify, place
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want
    if reports:
        assert inside.count(True) == 9 and inside.count(False) == 1     # page 0 again, after
        assert placed_inside.count(True) == 8 and placed_inside.count(False) == 1
    else:
        assert inside == [False] * 9 and placed_inside == [False] * 9
        assert threads == {caller}
    assert tier.stats["corrupt"] == 0


def test_a_page_placed_as_it_landed_after_a_corrupt_one_is_outside_the_run(tmp_path):
    """Pages land and are placed in any order; a corrupt page ends the leading run,
    and the pages after it, placed or not, are not reported read."""
    engine = Recording(f"file://{tmp_path}/store")
    host, tier, keys, want = _stored(engine)
    tier.batch_pages = 9
    _flip_last_byte(engine, tier.keys(keys[4])[0])
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 4
    assert [canonical(host, p * PAGE) for p in range(4)] == want[:4]
    assert bool((host.get_page(4 * PAGE) == POISON).all())          # the corrupt page is not placed
    assert tier.stats["corrupt"] == 1 and tier.stats["skipped"] == 4


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_backup_stages_and_seals_each_page_as_the_engine_sends_it(tmp_path, layout):
    """With an engine that sends values one by one (`Engine.fills_as_sent`), each page
    is staged and sealed inside the engine call just before its bytes are written:
    every object written holds a sealed header, and reads back byte-exact."""
    engine = Recording(f"file://{tmp_path}/store", fills_as_sent=True)
    host = host_case("mha", layout, pages=12).host
    tier = _tier(host, engine)
    keys = _keys(9)
    sealed_inside, written_sealed = [], []
    real_seal, real_write = tier.read.formats[0].seal_into, engine.inner._write

    def seal_into(header, pieces, algorithm=None):
        sealed_inside.append(engine.running > 0)
        return real_seal(header, pieces, algorithm)

    def write(path, views):
        written_sealed.append(bytes(views[0][10:12]) != b"\0\0")     # the algorithm: 0 until sealed
        return real_write(path, views)

    tier.read.formats[0].seal_into, engine.inner._write = seal_into, write
    tier.read.formats[0].seal = lambda *a, **k: pytest.fail("sealed ahead of the engine call")
    want = [canonical(host, p * PAGE) for p in range(9)]
    assert tier.backup(keys, slots(range(9))) == [True] * 9
    assert sealed_inside == [True] * 9 and written_sealed == [True] * 9
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want


@pytest.mark.parametrize("fills_as_sent", [True, False])
def test_a_page_that_cannot_be_staged_is_not_stored(tmp_path, caplog, fills_as_sent):
    """A page whose staging copy fails (inside the engine call, or before it for an
    engine that takes a batch at once) is not sent (reported not stored, an older
    object under its key kept); the others are stored."""
    engine = Recording(f"file://{tmp_path}/store", fills_as_sent=fills_as_sent)
    host = host_case("mha", "page_first", pages=12).host
    tier = _tier(host, engine)
    keys = _keys(9)
    assert tier.backup(keys[4:5], slots([4])) == [True]
    before = open(engine.inner._path(tier.keys(keys[4])[0]), "rb").read()
    real = tier.canonical.to_staging

    def to_staging(host_pages, staging, first_slot=0):
        if list(host_pages) == [4]:
            raise MemoryError("no memory")
        return real(host_pages, staging, first_slot)

    tier.canonical.to_staging = to_staging
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.backup(keys, slots(range(9))) == [True] * 4 + [False] + [True] * 4
    assert "could not be sealed (MemoryError" in caplog.text
    assert open(engine.inner._path(tier.keys(keys[4])[0]), "rb").read() == before
    assert tier.stats["store_failed"] == 1 and engine.running == 0


@pytest.mark.parametrize("fills_as_sent", [False, True])
@pytest.mark.parametrize("layout", ["page_first", "page_head", "page_first_direct"])
def test_a_page_staged_whole_moves_as_one_buffer(tmp_path, layout, fills_as_sent):
    """A page staged whole reaches the engine as one buffer, its header just before its
    payload in the staging slot; a key whose header does not fit the slot's room, and
    pages in place, as the header then the payload pieces. All read back byte-exact."""
    engine = Recording(f"file://{tmp_path}/store", fills_as_sent=fills_as_sent)
    host = host_case("mha", layout, pages=12).host
    tier = _tier(host, engine, batch_pages=9)
    keys = _keys(8) + ["long-" + "x" * 600]
    staged = layout != "page_first_direct"
    want = [canonical(host, p * PAGE) for p in range(9)]
    assert tier.backup(keys, slots(range(9))) == [True] * 9
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want
    staging = tier.canonical.take_staging(1)
    separate = 1 + len(tier.canonical.pieces(0, staging, 0))     # a header, then the payload pieces
    assert engine.buffer_counts == [[1] * 8 + [separate] if staged else [separate] * 9] * 2
    for k in keys:
        with open(engine.inner._path(tier.keys(k)[0]), "rb") as f:
            obj = f.read()
        assert tier.read.formats[0].verify(tier.keys(k)[0], obj[:-tier.canonical.payload_bytes],
                                  [memoryview(obj)[-tier.canonical.payload_bytes:]]) is None


def test_a_call_stages_at_most_staging_bytes_of_page_data(engine, monkeypatch):
    """Batches hold as many pages as `STAGING_BYTES` of page data: the header room
    beside each staged page does not cost a page of the batch."""
    import kvtier.store.tier as tier_module
    host = host_case("mha", "page_first", pages=12).host
    monkeypatch.setattr(tier_module, "STAGING_BYTES", 4 * host.page_bytes)
    tier = StoreTier(host, engine, model="m", batch_pages=128)
    assert tier.canonical.objects[0].header_room > 0 and tier.batch_pages == 4
    monkeypatch.setattr(tier_module, "STAGING_BYTES", 4 * host.page_bytes - 1)
    assert StoreTier(host, engine, model="m", batch_pages=128).batch_pages == 3


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_pages_read_in_ranges_on_several_threads(tmp_path, monkeypatch, layout):
    """Calls of one large page each (the file engine reads such a page in byte ranges on
    several threads, `kvtier.store.file.RANGE_BYTES`): every page read, verified and
    placed, byte-exact; a corrupt one ends the run."""
    from kvtier.store import file as file_module
    monkeypatch.setattr(file_module, "RANGE_BYTES", 256)        # pages of 768 B: two ranges each
    monkeypatch.setattr(file_module, "RANGE_ALIGN", 64)
    engine = Recording(f"file://{tmp_path}/store?threads=2")
    host, tier, keys, want = _stored(engine, layout)
    tier.batch_pages = 1
    ranges = []
    real = engine.inner._read_range
    engine.inner._read_range = lambda fd, offset, views: ranges.append(offset) or real(fd, offset, views)
    poison(host)
    assert tier.prefetch(keys, slots(range(9))) == 9
    assert [canonical(host, p * PAGE) for p in range(9)] == want
    assert len(ranges) == 18 and ranges.count(0) == 9          # two ranges a page
    _flip_last_byte(engine, tier.keys(keys[5])[0])
    assert tier.prefetch(keys, slots(range(9))) == 5 and tier.stats["corrupt"] == 1


def test_landings_wake_the_placer_once_enough_pages_are_ready_or_the_call_ends():
    """`_Landings` (a call of one batch placing beside its engine call): a page is
    ready once all its objects landed, in any order; `take` waits for ``least`` ready
    pages, hands each ready page over once, and returns what there is, with the call's
    end, as soon as `end` is called, even with pages still short of objects."""
    from kvtier.store.tier import _Landings
    landings = _Landings(4, 2, 2)
    got = []
    taker = threading.Thread(target=lambda: got.append(landings.take()))
    landings.landed(1)
    landings.landed(0)              # page 0 ready: one page, fewer than two
    taker.start()
    taker.join(0.1)
    assert taker.is_alive() and got == []
    landings.landed(5)              # page 2's first object: not ready
    landings.landed(3)
    landings.landed(2)              # page 1 ready: two pages
    taker.join(WAIT)
    assert got == [([0, 1], False)]
    landings.landed(7)
    landings.landed(6)              # page 3 ready (one page); page 2 still short
    taker = threading.Thread(target=lambda: got.append(landings.take()))
    taker.start()
    taker.join(0.1)
    assert taker.is_alive()
    landings.end()
    taker.join(WAIT)
    assert got[1] == ([3], True) and landings.take() == ([], True)
