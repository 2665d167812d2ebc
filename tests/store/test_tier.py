"""StoreTier on the file engine: round trips for every kind and host layout compared
with the host pool's own pages, reads across layouts, every kind of damage reading as a
miss under the leading-run rule, bad arguments, faults that never raise, threads."""
from __future__ import annotations

import logging
import os
import random
import threading

import pytest
import torch

from redis_support import redis_url  # noqa: F401  (fixture: the shared node)
from store_support import KINDS, LAYOUTS, PAGE, POISON, assert_pages, canonical, host_case, poison, slots
from kvtier.errors import KvtierError
from kvtier.store import Engine, Status, open_store
from kvtier.store.file import object_name
from kvtier.store.page import Geometry, PageFormat
from kvtier.store.tier import StoreTier


@pytest.fixture
def url(tmp_path):
    return f"file://{tmp_path}/store"


def _tier(host, url, **kw):
    kw.setdefault("model", "test-model")
    kw.setdefault("tp", (0, 1))
    return StoreTier(host, url, **kw)


def _keys(n, tag="k"):
    return [f"{tag}{random.getrandbits(64):016x}" for _ in range(n)]


def _path(tier, page_key):
    return os.path.join(tier.engine.root, object_name(tier.keys(page_key)[0]))


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip(kind, layout, url):
    hc = host_case(kind, layout)
    host = hc.host
    piece_min = 0 if layout == "layer_first" else None      # layer_first in place, per layer
    tier = _tier(host, url, **({"layer_piece_min": piece_min} if piece_min is not None else {}))
    src = [5, 1, 2, 9]
    keys = _keys(len(src))
    originals = [host.get_page(p * PAGE).clone() for p in src]
    assert tier.backup(keys, slots(src)) == [True] * 4
    assert tier.exists(keys) == 4
    poison(host)
    dst = [3, 7, 8, 0]
    assert tier.prefetch(keys, slots(dst)) == 4
    assert_pages(host, dst, originals)
    assert tier.stats["hits"] == 4 and tier.stats["stored"] == 4
    hc.check_margins()


def test_layer_first_staged_round_trip(url):
    """layer_first with small per-layer pieces takes the staged path."""
    host = host_case("mha_v_indexer", "layer_first").host
    tier = _tier(host, url)
    assert tier.canonical.staged
    keys = _keys(3)
    originals = [host.get_page(p * PAGE).clone() for p in (0, 1, 2)]
    tier.backup(keys, slots([0, 1, 2]))
    poison(host)
    assert tier.prefetch(keys, slots([4, 6, 5])) == 3
    assert_pages(host, [4, 6, 5], originals)


@pytest.mark.parametrize("kind", KINDS)
def test_written_from_page_first_reads_into_every_layout(kind, url):
    writer = host_case(kind, "page_first").host
    wtier = _tier(writer, url)
    keys = _keys(3)
    src = [2, 6, 7]
    assert wtier.backup(keys, slots(src)) == [True] * 3
    want = [canonical(writer, p * PAGE) for p in src]
    for layout in ("page_head", "page_first_direct", "layer_first", "page_first"):
        hc = host_case(kind, layout, gen=torch.Generator().manual_seed(9))
        reader = hc.host
        poison(reader)
        rtier = _tier(reader, url, tp=(0, 1))
        assert rtier.namespace == wtier.namespace
        dst = [1, 0, 11]
        assert rtier.prefetch(keys, slots(dst)) == 3, layout
        for q, w in zip(dst, want):
            assert canonical(reader, q * PAGE) == w, (layout, q)
        for q in set(range(reader.size // PAGE)) - set(dst):
            assert bool((reader.get_page(q * PAGE) == POISON).all())
        hc.check_margins()


def test_namespaces_keep_geometries_and_ranks_apart(url):
    import pool_support
    base = host_case("mha", "page_first").host
    keys = _keys(2)
    _tier(base, url).backup(keys, slots([0, 1]))
    bf16 = pool_support.DeviceCase("mha", "layers", PAGE, layers=3, size=16,
                                   k=((2, 8), torch.bfloat16), v=((2, 4 * 2), torch.bfloat16))
    other = pool_support.HostCase(bf16.pool, "page_first", "auto", size_tokens=48).host
    assert _tier(other, url).exists(keys) == 0                  # another dtype
    assert _tier(base, url, tp=(1, 2)).exists(keys) == 0        # another rank
    assert _tier(base, url, model="other").exists(keys) == 0    # another model
    assert _tier(base, url).exists(keys) == 2
    # MLA: one copy for every rank.
    mla = host_case("mla", "page_first").host
    _tier(mla, url, tp=(0, 4)).backup(keys, slots([0, 1]))
    assert _tier(mla, url, tp=(3, 4)).exists(keys) == 2
    assert "tp" not in _tier(mla, url, tp=(3, 4)).namespace


# ---------------------------------------------------------------------- damage reads as a miss
def _stored(url, layout="page_first", kind="mha_v_indexer", n=4):
    host = host_case(kind, layout).host
    tier = _tier(host, url)
    keys = _keys(n)
    originals = [host.get_page(p * PAGE).clone() for p in range(n)]
    assert tier.backup(keys, slots(range(n))) == [True] * n
    poison(host)
    return host, tier, keys, originals


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def _damage_reads_as_miss(host, tier, keys, originals, caplog, counter, warning):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.prefetch(keys, slots([8, 9, 10, 11])) == 2      # the third page is damaged
        assert tier.prefetch(keys, slots([8, 9, 10, 11])) == 2
    assert tier.stats[counter] == 2
    assert tier.stats["hits"] == 4 and tier.stats["skipped"] == 2
    for q, o in zip((8, 9), originals):
        assert torch.equal(host.get_page(q * PAGE), o)
    found = [r.getMessage() for r in caplog.records if warning in r.getMessage()]
    assert len(found) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("where", ["payload", "payload end", "header key", "header checksum"])
def test_flipped_byte(url, caplog, layout, where):
    host, tier, keys, originals = _stored(url, layout)
    path = _path(tier, keys[2])
    hlen = tier.read.formats[0].header_size(tier.keys(keys[2])[0])
    size = os.path.getsize(path)
    offset = {"payload": hlen + 5, "payload end": size - 1, "header key": hlen - 20 - 1,
              "header checksum": 33}[where]
    _flip(path, offset)
    _damage_reads_as_miss(host, tier, keys, originals, caplog, "corrupt", "failed verification")


def test_truncated_object(url, caplog):
    host, tier, keys, originals = _stored(url)
    path = _path(tier, keys[2])
    os.truncate(path, os.path.getsize(path) - 1)
    _damage_reads_as_miss(host, tier, keys, originals, caplog, "corrupt", "get: CORRUPT")


def test_zeroed_tail_of_the_right_length(url, caplog):
    """What a power loss after the rename can leave: the right length, the wrong bytes."""
    host, tier, keys, originals = _stored(url, "page_first_direct")
    path = _path(tier, keys[2])
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    os.truncate(path, size)
    _damage_reads_as_miss(host, tier, keys, originals, caplog, "corrupt", "(checksum)")


def test_values_swapped_between_keys(url, caplog):
    host, tier, keys, originals = _stored(url)
    a, b = _path(tier, keys[2]), _path(tier, keys[3])
    os.replace(a, a + ".x")
    os.replace(b, a)
    os.replace(a + ".x", b)
    _damage_reads_as_miss(host, tier, keys, originals, caplog, "corrupt", "(key)")


def test_object_of_another_geometry(url, caplog):
    host, tier, keys, originals = _stored(url)
    other = PageFormat(Geometry.of(host_case("mha", "page_first").host))
    payload = bytearray(os.urandom(other.payload_bytes))
    k = tier.keys(keys[2])[0]
    assert tier.engine.put_from([k], [[other.seal(k, [memoryview(payload)]), payload]]) == [Status.HIT]
    _damage_reads_as_miss(host, tier, keys, originals, caplog, "corrupt", "get: CORRUPT")


def test_torn_write_reads_as_miss(url, tmp_path):
    """A writer killed mid-write (SIGKILL after half the bytes) leaves no object; a
    second page's earlier object survives its torn rewrite."""
    import subprocess
    import sys
    host, tier, keys, originals = _stored(url)
    os.unlink(_path(tier, keys[2]))
    script = f"""
import os, signal
import kvtier.store.file as f
real = os.pwritev
def half(fd, bufs, off):
    n = real(fd, [memoryview(bufs[0])[:max(1, len(bufs[0]) // 2)]], off)
    os.kill(os.getpid(), signal.SIGKILL)
f.os.pwritev = half
e = f.FileEngine({url!r})
e.put_from([{tier.keys(keys[2])[0]!r}], [[os.urandom(4096)]])
"""
    for key in (keys[2], keys[1]):
        proc = subprocess.run([sys.executable, "-c", script.replace(repr(tier.keys(keys[2])[0]), repr(tier.keys(key)[0]))],
                              capture_output=True, timeout=120)
        assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftover = os.listdir(os.path.join(tier.engine.root, "tmp"))
    assert len(leftover) == 1       # the last dead writer's (the second engine removed the first's)
    assert tier.prefetch(keys, slots([8, 9, 10, 11])) == 2      # keys[1] intact, keys[2] missing
    assert tier.stats["misses"] == 1
    for q, o in zip((8, 9), originals):
        assert torch.equal(host.get_page(q * PAGE), o)
    open_store(url).close()                                     # a new engine removes them
    assert os.listdir(os.path.join(tier.engine.root, "tmp")) == []


def test_leading_run_rule(url):
    host, tier, keys, originals = _stored(url, "page_first_direct")
    os.unlink(_path(tier, keys[1]))
    assert tier.exists(keys) == 1
    assert tier.prefetch(keys, slots([8, 9, 10, 11])) == 1
    assert tier.stats["misses"] == 1 and tier.stats["skipped"] == 2
    assert tier.exists(keys[2:]) == 2 and tier.exists([]) == 0
    assert tier.prefetch([], slots([])) == 0 and tier.backup([], slots([])) == []


def test_calls_longer_than_one_batch(url):
    host = host_case("mha", "page_first", pages=12).host
    tier = _tier(host, url, batch_pages=4)
    keys = _keys(10)
    originals = [host.get_page(p * PAGE).clone() for p in range(10)]
    assert tier.backup(keys, slots(range(10))) == [True] * 10
    os.unlink(_path(tier, keys[6]))
    poison(host)
    dst = [11, 10, 9, 8, 7, 6, 5, 4, 3, 2]
    assert tier.exists(keys) == 6
    assert tier.prefetch(keys, slots(dst)) == 6
    for q, o in zip(dst[:6], originals):
        assert torch.equal(host.get_page(q * PAGE), o)
    for q in (0, 1, *dst[8:]):      # batches after the miss are not read
        assert bool((host.get_page(q * PAGE) == POISON).all())
    assert tier.stats["skipped"] == 3


# ---------------------------------------------------------------------- faults never raise
class Faulty(Engine):
    """An engine whose every call fails the way ``mode`` says."""

    scheme = "faulty"

    def __init__(self, mode):
        super().__init__("faulty://x")
        self.mode = mode

    def _answer(self, keys):
        if self.mode == "raise":
            raise ConnectionResetError("reset by peer")
        return [Status.TIMEOUT] * len(keys)

    _exists = _answer

    def _get_into(self, keys, targets, landed):
        return self._answer(keys)

    def _put_from(self, keys, sources, fill):
        return self._answer(keys)


@pytest.mark.parametrize("mode,counter", [("raise", "errors"), ("timeout", "timeouts")])
def test_store_faults_are_misses(mode, counter):
    host = host_case("mha", "page_first").host
    tier = StoreTier(host, Faulty(mode), model="m")
    keys = _keys(3)
    assert tier.backup(keys, slots([0, 1, 2])) == [False] * 3
    assert tier.prefetch(keys, slots([3, 4, 5])) == 0
    assert tier.exists(keys) == 0
    assert tier.stats[counter] == 1 and tier.stats["store_failed"] == 3


def test_a_failure_inside_the_tier_never_reaches_the_caller(url, monkeypatch, caplog):
    host, tier, keys, _ = _stored(url)
    def broken(*a, **k):
        raise MemoryError("no staging memory")
    monkeypatch.setattr(tier.canonical, "take_staging", broken)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.backup(keys, slots([0, 1, 2, 3])) == [False] * 4
        assert tier.backup(keys, slots([0, 1, 2, 3])) == [False] * 4
        assert tier.prefetch(keys, slots([4, 5, 6, 7])) == 0
    assert sum("backup failed (MemoryError" in r.getMessage() for r in caplog.records) == 1
    assert sum("prefetch failed (MemoryError" in r.getMessage() for r in caplog.records) == 1


def test_unverifiable_pages_are_misses_with_one_warning(url, monkeypatch, caplog):
    host, tier, keys, _ = _stored(url)
    monkeypatch.setattr(tier.read.formats[0].checksum, "_xxhash", None)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert tier.prefetch(keys, slots([4, 5, 6, 7])) == 0
        assert tier.prefetch(keys, slots([4, 5, 6, 7])) == 0
    assert sum("algorithm is not installed" in r.getMessage() for r in caplog.records) == 1
    assert tier.stats["unverifiable"] == 2


# ---------------------------------------------------------------------- bad arguments
@pytest.fixture(params=["python", "numpy"])
def index_check(request, monkeypatch):
    """Index lists checked as Python ints (short lists) or by numpy (long ones): both
    accept and refuse the same lists."""
    import kvtier.store.tier as tier_module
    monkeypatch.setattr(tier_module, "SMALL_INDICES", 1 << 20 if request.param == "python" else 0)
    return request.param


def test_bad_arguments_raise_before_anything_moves(url, index_check):
    host = host_case("mha", "page_first").host
    tier = _tier(host, url)
    keys = _keys(2)
    before = {n: b.clone() for n, b in host.buffers.items()}
    good = slots([0, 1])
    cases = [
        (lambda: tier.backup("abc", good), "page_keys"),
        (lambda: tier.backup([keys[0], ""], good), r"page_keys\[1\]"),
        (lambda: tier.backup([keys[0], 7], good), r"page_keys\[1\]"),
        (lambda: tier.backup(keys, slots([0])), "host_indices"),
        (lambda: tier.backup(keys, good.float()), "host_indices"),
        (lambda: tier.backup(keys, good.view(2, -1)), "host_indices"),
        (lambda: tier.backup(keys, good + 1), "host_indices"),                 # not whole pages
        (lambda: tier.backup(keys, slots([0, 12])), "host_indices"),           # past the pool
        (lambda: tier.backup(keys, slots([0, 1]) - 2 * PAGE), "host_indices"),   # pages -2, -1
        (lambda: tier.backup(keys, slots([0, 1]) + (2**63 - 2 * PAGE)), "host_indices"),  # no wrap
        (lambda: tier.backup(keys, [0, 1, 2, 3, 4, 5, 6, 7]), "host_indices"),
        (lambda: tier.prefetch(keys, slots([3, 3])), "host_indices"),          # one page twice
        (lambda: tier.prefetch(keys, good.to("meta")), "host_indices"),
        (lambda: tier.exists(None), "page_keys"),
    ]
    for call, arg in cases:
        with pytest.raises(KvtierError, match=arg):
            call()
    assert tier.exists(keys) == 0
    for n, b in host.buffers.items():
        assert torch.equal(b.view(torch.uint8), before[n].view(torch.uint8))
    with pytest.raises(KvtierError, match="host"):
        StoreTier(object(), url, model="m")
    with pytest.raises(KvtierError, match="batch_pages"):
        StoreTier(host, url, model="m", batch_pages=0)
    with pytest.raises(KvtierError, match="model"):
        StoreTier(host, url, model="")
    with pytest.raises(KvtierError, match="url"):
        StoreTier(host, "nowhere://x", model="m")


@pytest.mark.parametrize("store", ["file", "redis"])
def test_a_prefetch_of_one_batch_asks_the_store_first(store, tmp_path, request):
    """A prefetch of one batch begins its engine call (`Engine.get_ahead`) before its
    index check where the engine sends requests ahead (Redis: the GETs are answered by
    then, so objects removed after that still read); the file engine sends none, and
    is asked nothing first. A call refused for its indices reads nothing, counts
    nothing and leaves the engine whole; a call of several batches asks no store first."""
    url = f"file://{tmp_path}/store" if store == "file" else request.getfixturevalue("redis_url")
    host = host_case("mha", "page_first_direct").host
    tier = _tier(host, url, batch_pages=2)
    keys = _keys(4)
    originals = [host.get_page(p * PAGE).clone() for p in range(4)]
    real, asked, remove = tier.engine.get_ahead, [], [False]

    def spy(object_keys, nbytes):
        pending = real(object_keys, nbytes)
        asked.append(len(object_keys))
        if remove[0]:
            tier.engine.delete(object_keys)         # after the store was asked
        return pending
    try:
        assert tier.engine.sends_ahead == (store == "redis")
        assert tier.backup(keys, slots(range(4))) == [True] * 4
        poison(host)
        tier.engine.get_ahead = spy
        assert tier.prefetch(keys, slots(range(4, 8))) == 4          # two batches
        assert asked == []
        assert_pages(host, [4, 5, 6, 7], originals)
        poison(host)
        gets = lambda: {k: v for k, v in tier.engine.stats.items() if k.startswith("get.")}
        before = gets()
        with pytest.raises(KvtierError, match="host_indices"):
            tier.prefetch(keys[:2], slots([5, 5]))
        first = [2 * tier.read.m] if store == "redis" else []         # a page's objects, two pages
        assert asked == first and gets() == before
        assert_pages(host, [], [])
        if store == "redis":
            remove[0] = True
            assert tier.prefetch(keys[:2], slots([5, 7])) == 2
            assert asked == first * 2
            assert_pages(host, [5, 7], originals[:2])
            tier.engine.get_ahead = real
            assert tier.prefetch(keys[:2], slots([8, 9])) == 0       # removed
            poison(host)
        assert tier.prefetch(keys[2:], slots([8, 9])) == 2           # the engine is whole
        assert_pages(host, [8, 9], originals[2:])
    finally:
        tier.close()


@pytest.mark.parametrize("form", ["int32", "strided"])
def test_host_indices_of_either_dtype_and_any_strides(url, form, index_check):
    hc = host_case("mha", "page_first")
    host = hc.host
    tier = _tier(host, url)
    keys = _keys(3)
    originals = [host.get_page(p * PAGE).clone() for p in (4, 0, 9)]
    idx = slots([4, 0, 9])
    idx = idx.int() if form == "int32" else torch.stack([idx, -idx], 1)[:, 0]
    assert form == "int32" or not idx.is_contiguous()
    assert tier.backup(keys, idx) == [True] * 3
    poison(host)
    dst = [2, 11, 5]
    idx = slots(dst)
    assert tier.prefetch(keys, idx.int() if form == "int32" else torch.stack([idx, idx], 1)[:, 1]) == 3
    assert_pages(host, dst, originals)
    hc.check_margins()


def test_indices_rewritten_after_their_check_change_no_page(url, monkeypatch):
    """An engine's own code rewrites the index list while a call runs (here: at once
    after its range check, to page -1, which Python's slicing would take as the pool's
    last page): the call moves the pages that were checked, and nothing else."""
    import kvtier.store.tier as tier_module
    hc = host_case("mha", "page_first_direct")
    host = hc.host
    tier = _tier(host, url)
    keys = _keys(2)
    originals = [host.get_page(p * PAGE).clone() for p in (0, 1)]
    assert tier.backup(keys, slots([0, 1])) == [True, True]
    real = tier_module.check_pages_in_range

    def then_rewritten(arg, idx, *a):
        real(arg, idx, *a)
        idx.copy_(slots([0, 1]) - 2 * PAGE)

    monkeypatch.setattr(tier_module, "check_pages_in_range", then_rewritten)
    poison(host)
    idx = slots([3, 4])
    assert tier.prefetch(keys, idx) == 2
    assert_pages(host, [3, 4], originals)
    hc.check_margins()


def test_indices_rewritten_after_the_short_check_change_no_page(url, monkeypatch):
    """A short index list is checked as a copy of Python ints, and that copy is what the
    call uses: the list rewritten right after (to page -1) changes no page moved."""
    hc = host_case("mha", "page_first_direct")
    host = hc.host
    tier = _tier(host, url)
    keys = _keys(2)
    originals = [host.get_page(p * PAGE).clone() for p in (0, 1)]
    assert tier.backup(keys, slots([0, 1])) == [True, True]
    idx = slots([3, 4])
    real = tier._whole_pages

    def then_rewritten(copy, n):
        pages = real(copy, n)
        idx.copy_(slots([0, 1]) - 2 * PAGE)
        return pages

    monkeypatch.setattr(tier, "_whole_pages", then_rewritten)
    poison(host)
    assert tier.prefetch(keys, idx) == 2
    assert_pages(host, [3, 4], originals)
    hc.check_margins()


# ---------------------------------------------------------------------- threads
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_a_backup_thread_and_a_prefetch_thread_at_once(url, layout):
    """HiCache's controller: one thread backs pages up while another prefetches pages
    stored earlier, on one tier; every prefetch reads every page whole and right."""
    host = host_case("mha_v_indexer", layout, pages=24).host
    tier = _tier(host, url, batch_pages=3)
    stored = _keys(4, "old")
    tier.backup(stored, slots([0, 1, 2, 3]))
    want = [canonical(host, p * PAGE) for p in range(4)]
    new = _keys(8, "new")
    new_want = [canonical(host, p * PAGE) for p in range(4, 12)]
    errors, rounds = [], 12
    go = threading.Barrier(2)

    def backups():
        try:
            go.wait()
            for r in range(rounds):
                assert tier.backup(new, slots(range(4, 12))) == [True] * 8
        except BaseException as e:
            errors.append(e)

    def prefetches():
        try:
            go.wait()
            for r in range(rounds):
                dst = [12 + (r % 3) * 4 + j for j in range(4)]
                assert tier.prefetch(stored, slots(dst)) == 4
                for q, w in zip(dst, want):
                    assert canonical(host, q * PAGE) == w
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=backups), threading.Thread(target=prefetches)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[0]
    poison(host)
    assert tier.prefetch(new, slots(range(12, 20))) == 8
    assert [canonical(host, q * PAGE) for q in range(12, 20)] == new_want


def test_imports_pull_in_no_client_library():
    import subprocess
    import sys
    code = ("import sys, kvtier, kvtier.store, kvtier.store.tier, kvtier.store.file, kvtier.store.canonical\n"
            "bad = [m for m in ('xxhash', 'redis', 'valkey', 'glide', 'mooncake', 'hiredis', 'crc32c')"
            " if m in sys.modules]\nassert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]


@pytest.mark.parametrize("layout", ["page_first", "page_head", "page_first_direct"])
def test_the_intended_path_warns_of_nothing(url, layout, caplog):
    """No fallback warning (the staged copy never goes through copy_rows' reference or
    interpreter) and no log line on a clean round trip."""
    import warnings
    host = host_case("mla_split_indexer", layout).host
    tier = _tier(host, url)
    keys = _keys(3)
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="kvtier"):
        warnings.simplefilter("error")
        assert tier.backup(keys, slots([0, 1, 2])) == [True] * 3
        assert tier.prefetch(keys, slots([3, 4, 5])) == 3
    assert caplog.records == []
