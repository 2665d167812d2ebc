"""The Mooncake engine on a running store (``.ci/mooncake.sh`` starts one and sets
KVTIER_TEST_MOONCAKE_URL): the engine contract in both transfer modes, page-sized
objects through scattered buffers, objects over existing ones, staging limits, a backup
and a prefetch thread at once, the raw figure."""
from __future__ import annotations

import random
import threading
import uuid

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from mooncake_support import store_url

try:                                    # the contract's tests, shared by every engine
    from engine_conformance import EngineConformance
except ImportError:                     # pragma: no cover - they come with the store core
    EngineConformance = None

MODES = ("staged", "direct")
POISON = 0xA5


def _url(base: str, **options) -> str:
    extra = "&".join(f"{k}={v}" for k, v in options.items())
    return f"{base}{'&' if '?' in base else '?'}{extra}" if extra else base


@pytest.fixture(scope="module")
def base_url():
    return store_url()


@pytest.fixture(params=MODES)
def engine(request, base_url):
    e = open_store(_url(base_url, transfer=request.param))
    yield e
    e.close()


def _keys(n):
    prefix = f"kvtier-test/{uuid.uuid4().hex}/"
    return [f"{prefix}{i}" for i in range(n)]


def _cut(view: memoryview, rng: random.Random, most: int = 5):
    """``view`` as up to ``most`` pieces at random offsets (a 64-byte header first, as a
    page object is split)."""
    n = len(view)
    cuts = sorted(rng.sample(range(65, n), min(most - 2, n - 66)))
    edges = [0, 64, *cuts, n]
    return [view[a:b] for a, b in zip(edges, edges[1:])]


class _Arena:
    """Targets as windows of one poisoned buffer, with poisoned gaps between them: a read
    that writes one byte outside its target shows in a gap."""

    def __init__(self, sizes, gap=4096):
        self.offsets, at = [], gap
        for s in sizes:
            self.offsets.append(at)
            at += s + gap
        self.buf = np.full(at, POISON, dtype=np.uint8)
        self.sizes = sizes

    def window(self, i) -> memoryview:
        o = self.offsets[i]
        return memoryview(self.buf)[o:o + self.sizes[i]]

    def outside_untouched(self) -> bool:
        mask = np.ones(len(self.buf), dtype=bool)
        for o, s in zip(self.offsets, self.sizes):
            mask[o:o + s] = False
        return bool((self.buf[mask] == POISON).all())


if EngineConformance is not None:
    class TestMooncakeEngineContract(EngineConformance):
        @property
        def reports_landed(self):   # a direct read lands every value at once
            return self.transfer == "staged"

        @pytest.fixture(params=MODES)
        def open_engine(self, request, base_url):
            self.transfer = request.param
            return lambda: open_store(_url(base_url, transfer=request.param))


# ---------------------------------------------------------------------- round trips
def test_page_objects_scattered_both_ways(engine):
    """Page-sized objects written from and read into pieces split differently, into
    poisoned windows of one buffer: every byte of each target is the object's, no byte
    outside a target changes."""
    rng = random.Random(1)
    # 2 MiB in 5 pieces moves piece by piece (zero-copy), the others through staging.
    sizes = [64 * 1024 + 64, 256 * 1024 + 64, 1024 * 1024 + 64, 2048 * 1024 + 64, 4097, 300_001]
    ks = _keys(len(sizes))
    values = [np.random.default_rng(i).integers(0, 256, s, dtype=np.uint8) for i, s in enumerate(sizes)]
    assert engine.put_from(ks, [_cut(memoryview(v), rng) for v in values]) == [Status.HIT] * len(ks)
    arena = _Arena(sizes)
    assert engine.get_into(ks, [_cut(arena.window(i), rng) for i in range(len(ks))]) == [Status.HIT] * len(ks)
    for i, v in enumerate(values):
        assert np.array_equal(np.frombuffer(arena.window(i), np.uint8), v)
    assert arena.outside_untouched()
    engine.delete(ks)


def test_wrong_lengths_are_corrupt_and_misses_untouched(engine):
    ks = _keys(4)
    value = np.random.default_rng(5).integers(0, 256, 100_000, dtype=np.uint8)
    engine.put_from(ks[:3], [[memoryview(value)]] * 3)
    sizes = [99_999, 100_001, 100_000, 100_000]       # short, long, right, and a missing key
    arena = _Arena(sizes)
    out = engine.get_into(ks, [[arena.window(i)] for i in range(4)])
    assert out == [Status.CORRUPT, Status.CORRUPT, Status.HIT, Status.MISS]
    assert np.array_equal(np.frombuffer(arena.window(2), np.uint8), value)
    assert (np.frombuffer(arena.window(3), np.uint8) == POISON).all()
    assert arena.outside_untouched()
    assert engine.stats["get.corrupt"] == 2 and engine.stats["get.miss"] == 1
    engine.delete(ks)


@pytest.mark.parametrize("new_size", [300_000, 123_457])
def test_pieces_over_an_existing_object_replace_it(engine, new_size):
    """Mooncake's put keeps an existing object: a write in pieces over one goes through
    the staging upsert, for the same and another length."""
    (k,) = _keys(1)
    rng = random.Random(2)
    old = np.random.default_rng(6).integers(0, 256, 300_000, dtype=np.uint8)
    new = np.random.default_rng(7).integers(0, 256, new_size, dtype=np.uint8)
    assert engine.put_from([k], [_cut(memoryview(old), rng)]) == [Status.HIT]
    assert engine.put_from([k], [_cut(memoryview(new), rng)]) == [Status.HIT]
    got = np.zeros(new_size, dtype=np.uint8)
    assert engine.get_into([k], [_cut(memoryview(got), rng)]) == [Status.HIT]
    assert np.array_equal(got, new)
    engine.delete([k])


def test_staging_regions_smaller_than_a_batch(base_url):
    """Reads through 1 MiB regions: objects in groups that each fit one, one larger
    object ERROR alone; a write of more pieces than one call moves is gathered there."""
    e = open_store(_url(base_url, staging="1M"))
    try:
        sizes = [300_000] * 7 + [(1 << 20) + 1]
        ks = _keys(len(sizes) + 1)
        values = [np.random.default_rng(10 + i).integers(0, 256, s, dtype=np.uint8) for i, s in enumerate(sizes)]
        out = e.put_from(ks[:-1], [[memoryview(v[:64]), memoryview(v[64:])] for v in values])
        assert out == [Status.HIT] * 8
        arena = _Arena(sizes)
        out = e.get_into(ks[:-1], [[arena.window(i)] for i in range(len(sizes))])
        assert out == [Status.HIT] * 7 + [Status.ERROR]
        for i in range(7):
            assert np.array_equal(np.frombuffer(arena.window(i), np.uint8), values[i])
        assert (np.frombuffer(arena.window(7), np.uint8) == POISON).all()
        assert arena.outside_untouched()
        many = np.random.default_rng(20).integers(0, 256, 700 * 100, dtype=np.uint8)
        pieces = [memoryview(many)[i:i + 100] for i in range(0, len(many), 100)]
        assert e.put_from(ks[-1:], [pieces]) == [Status.HIT]
        got = np.zeros(len(many), np.uint8)
        assert e.get_into(ks[-1:], [[memoryview(got)]]) == [Status.HIT]
        assert np.array_equal(got, many)
        e.delete(ks)
    finally:
        e.close()


def test_a_leased_object_is_not_rewritten(engine):
    """Mooncake rewrites a same-length object in place under its readers; the engine
    removes the old object first, and refuses (ERROR) while the object is leased."""
    (k,) = _keys(1)
    old = np.full(4096, 1, np.uint8)
    assert engine.put_from([k], [[memoryview(old)]]) == [Status.HIT]
    assert engine.put_from([k], [[memoryview(old)]]) == [Status.HIT]      # not read: replaced
    assert engine.get_into([k], [[memoryview(np.zeros(4096, np.uint8))]]) == [Status.HIT]
    assert engine.put_from([k], [[memoryview(np.full(4096, 2, np.uint8))]]) == [Status.ERROR]
    got = np.zeros(4096, np.uint8)
    assert engine.get_into([k], [[memoryview(got)]]) == [Status.HIT] and (got == 1).all()
    assert engine.delete([k]) == [Status.HIT]       # a delete removes it all the same
    assert engine.exists([k]) == [Status.MISS]


# ---------------------------------------------------------------------- threads
def test_backup_and_prefetch_threads_at_once(engine):
    """HiCache's controller: a backup thread writing pages while a prefetch thread reads
    pages written before, on one engine; every read byte-exact."""
    size, n = 64 * 1024 + 64, 48
    ks = _keys(2 * n)
    values = {k: np.random.default_rng(100 + i).integers(0, 256, size, dtype=np.uint8) for i, k in enumerate(ks)}
    first, second = ks[:n], ks[n:]
    assert engine.put_from(first, [[memoryview(values[k])] for k in first]) == [Status.HIT] * n
    errors = []

    def backup():
        try:
            for i in range(0, n, 8):
                batch = second[i:i + 8]
                out = engine.put_from(batch, [[memoryview(values[k][:64]), memoryview(values[k][64:])] for k in batch])
                assert out == [Status.HIT] * len(batch)
        except BaseException as e:
            errors.append(e)

    def prefetch():
        try:
            for _ in range(3):
                for i in range(0, n, 8):
                    batch = first[i:i + 8]
                    got = [np.zeros(size, np.uint8) for _ in batch]
                    out = engine.get_into(batch, [[memoryview(g[:64]), memoryview(g[64:])] for g in got])
                    assert out == [Status.HIT] * len(batch)
                    assert all(np.array_equal(g, values[k]) for g, k in zip(got, batch))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    got = [np.zeros(size, np.uint8) for _ in second]
    assert engine.get_into(second, [[memoryview(g)] for g in got]) == [Status.HIT] * n
    assert all(np.array_equal(g, values[k]) for g, k in zip(got, second))
    engine.delete(ks)


def test_engines_dropped_without_close(base_url):
    """Engines collected without close() (a tier never closed) give back what they
    registered; staging memory stays registered with the shared client, never freed
    under it, and later engines read as before."""
    import gc
    (k,) = _keys(1)
    value = np.random.default_rng(4).integers(0, 256, 300_000, dtype=np.uint8)
    for i in range(12):
        e = open_store(_url(base_url, staging=f"{1 + i % 3}M"))
        e.register_memory([np.zeros(1 << 16, np.uint8)])
        assert e.put_from([f"{k}{i}"], [[memoryview(value)]]) == [Status.HIT]
        got = np.zeros(300_000, np.uint8)
        assert e.get_into([f"{k}{i}"], [[memoryview(got)]]) == [Status.HIT]
        assert np.array_equal(got, value)
        del e
        gc.collect()
    e = open_store(base_url)
    assert e.delete([f"{k}{i}" for i in range(12)]) == [Status.HIT] * 12
    e.close()


# ---------------------------------------------------------------------- the raw figure
def test_raw_throughput(base_url):
    e = open_store(base_url)
    try:
        raw = e.raw_throughput(64 * 1024, 8)
        assert raw["get_gbps"] > 0 and raw["set_gbps"] > 0 and "batch_get_into" in raw["how"]
        for bad in ((0, 1), (1, 0), (1.5, 1), (True, 1)):
            with pytest.raises(KvtierError):
                e.raw_throughput(*bad)
    finally:
        e.close()


def test_registered_memory_reads_in_place(base_url):
    """transfer=direct reads straight into registered host memory (a host pool's buffer)."""
    e = open_store(_url(base_url, transfer="direct"))
    try:
        pool = np.full(1 << 20, POISON, dtype=np.uint8)
        e.register_memory([pool])
        e.register_memory([pool])                        # once is enough; twice is harmless
        (k,) = _keys(1)
        value = np.random.default_rng(3).integers(0, 256, 100_000, dtype=np.uint8)
        e.put_from([k], [[memoryview(value)]])
        assert e.get_into([k], [[memoryview(pool)[4096:104_096]]]) == [Status.HIT]
        assert np.array_equal(pool[4096:104_096], value)
        assert (pool[:4096] == POISON).all() and (pool[104_096:] == POISON).all()
        with pytest.raises(KvtierError, match=r"buffers\[0\]"):
            e.register_memory([object()])
        e.delete([k])
    finally:
        e.close()
