"""The file store's capacity (``max_bytes``): its values, eviction of the least recently
used objects under it (one engine, its threads, another engine on the same directory),
objects larger than it, the counters; writers killed mid-write and readers mid-read;
keys that look like paths."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading

import pytest

from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store import file as file_module
from kvtier.store.file import FANOUT, FileEngine, object_name, parse_bytes


def _disk(root) -> dict:
    """name -> size of every object file on disk (the 256 object directories)."""
    out = {}
    for d in FANOUT:
        for entry in os.scandir(os.path.join(root, d)):
            out[entry.name] = entry.stat().st_size
    return out


def _disk_bytes(root) -> int:
    return sum(_disk(root).values())


def _value(key: str, n: int) -> bytes:
    return random.Random(key).randbytes(n)


def _put(e, key: str, n: int) -> bytes:
    v = _value(key, n)
    assert e.put_from([key], [[v]]) == [Status.HIT]
    return v


def _read(e, keys, sizes):
    targets = [bytearray(n) for n in sizes]
    return e.get_into(list(keys), [[t] for t in targets]), [bytes(t) for t in targets]


def _write_while_reading(write, read_once, timeout: float = 300) -> None:
    """``write()`` on one thread while another calls ``read_once()`` again and again
    until the write returns (both start together); raises the first exception of either."""
    errors, done, go = [], threading.Event(), threading.Barrier(2)

    def writer():
        try:
            go.wait()
            write()
        except BaseException as ex:
            errors.append(ex)
        finally:
            done.set()

    def reader():
        try:
            go.wait()
            while not done.is_set():
                read_once()
        except BaseException as ex:
            errors.append(ex)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------- max_bytes values
@pytest.mark.parametrize("text,n", [("4096", 4096), ("1", 1), ("64MiB", 64 << 20), ("10GB", 10 * 10**9),
                                    ("2kib", 2048), ("3KB", 3000), ("1TiB", 1 << 40), ("5B", 5)])
def test_max_bytes_in_the_url_and_as_a_keyword(tmp_path, text, n):
    assert parse_bytes(text) == n
    assert open_store(f"file://{tmp_path}/a?max_bytes={text}").max_bytes == n
    assert open_store(f"file://{tmp_path}/b?threads=2&max_bytes={text}").max_bytes == n
    assert FileEngine(f"file://{tmp_path}/c", max_bytes=text).max_bytes == n
    assert open_store(f"file://{tmp_path}/d", max_bytes=n).max_bytes == n


def test_no_max_bytes_is_unbounded(tmp_path):
    e = open_store(f"file://{tmp_path}")
    assert e.max_bytes is None and e.stored_bytes is None
    for i in range(20):
        _put(e, f"k{i}", 1000)
    assert _disk_bytes(tmp_path) == 20_000 and e.stats["evictions"] == 0


@pytest.mark.parametrize("text", ["0", "-1", "", "x", "10XB", "1.5GB", "0MiB", "MiB", "12 34", "0x10", "1e6"])
def test_a_bad_max_bytes_in_the_url_names_it(tmp_path, text):
    with pytest.raises(KvtierError, match=f"max_bytes must be .*not {re.escape(repr(text))}") as info:
        open_store(f"file://{tmp_path}?max_bytes={text}")
    assert str(info.value).startswith("url=")
    assert not os.path.exists(tmp_path / "tmp")         # refused before the directory is made


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "abc", "-3MiB", [1], b"10"])
def test_a_bad_max_bytes_keyword_names_it(tmp_path, value):
    with pytest.raises(KvtierError, match=f"^max_bytes={re.escape(repr(value))}: must be a positive byte count"):
        FileEngine(f"file://{tmp_path}", max_bytes=value)


def test_max_bytes_given_twice_is_refused(tmp_path):
    with pytest.raises(KvtierError, match="url=.*gives max_bytes more than once"):
        open_store(f"file://{tmp_path}?max_bytes=10&max_bytes=20")
    with pytest.raises(KvtierError, match="^max_bytes=20: is given twice"):
        open_store(f"file://{tmp_path}?max_bytes=10", max_bytes=20)


# ---------------------------------------------------------------------- eviction
def test_the_least_recently_used_objects_are_evicted(tmp_path):
    """Ten objects fill the store; three of the oldest are read; five more evict the
    five least recently used (the unread old ones). After every put the objects' bytes
    on disk are within max_bytes; evicted keys miss, survivors read byte-exact."""
    e = open_store(f"file://{tmp_path}?max_bytes=10000&threads=1")
    values = {}
    for i in range(10):
        values[f"k{i}"] = _put(e, f"k{i}", 1000)
        assert _disk_bytes(tmp_path) == 1000 * (i + 1) == e.stored_bytes
    assert e.stats["evictions"] == 0
    statuses, got = _read(e, ["k0", "k1", "k2"], [1000] * 3)     # now the most recently used
    assert statuses == [Status.HIT] * 3 and got == [values[k] for k in ("k0", "k1", "k2")]
    for i in range(10, 15):
        values[f"k{i}"] = _put(e, f"k{i}", 1000)
        assert _disk_bytes(tmp_path) <= 10000 and e.stored_bytes == _disk_bytes(tmp_path)
    gone = ["k3", "k4", "k5", "k6", "k7"]
    kept = [k for k in values if k not in gone]
    assert e.stats["evictions"] == 5 and e.stats["evicted_bytes"] == 5000
    assert set(_disk(tmp_path)) == {object_name(k).split("/")[1] for k in kept}
    statuses, got = _read(e, gone + kept, [1000] * 15)
    assert statuses == [Status.MISS] * 5 + [Status.HIT] * 10
    assert got[5:] == [values[k] for k in kept]
    assert e.exists(gone) == [Status.MISS] * 5 and os.listdir(e.tmp) == []


def test_objects_of_many_sizes_stay_within_the_bound(tmp_path):
    rng = random.Random(7)
    e = open_store(f"file://{tmp_path}?max_bytes=50000&threads=2")
    values = {}
    for r in range(40):                     # batches of several keys, some replaced
        keys = [f"k{rng.randrange(60)}" for _ in range(rng.randrange(1, 5))]
        keys = list(dict.fromkeys(keys))
        vs = [_value(f"{k}.{r}", rng.randrange(1, 9000)) for k in keys]
        assert e.put_from(keys, [[v] for v in vs]) == [Status.HIT] * len(keys)
        values.update(zip(keys, vs))
        assert _disk_bytes(tmp_path) <= 50000 and e.stored_bytes == _disk_bytes(tmp_path)
    assert e.stats["evictions"] > 0 and e.stats["evicted_bytes"] > 0
    keys = sorted(values)
    statuses, got = _read(e, keys, [len(values[k]) for k in keys])
    assert Status.HIT in statuses
    for k, s, g in zip(keys, statuses, got):
        assert s in (Status.HIT, Status.MISS)
        if s == Status.HIT:
            assert g == values[k]


def test_a_replaced_object_counts_once(tmp_path):
    e = open_store(f"file://{tmp_path}?max_bytes=3000")
    _put(e, "a", 1000)
    _put(e, "b", 1000)
    for n in (1500, 900, 2000):
        v = _put(e, "b", n)
        assert e.stored_bytes == 1000 + n == _disk_bytes(tmp_path)
    assert e.stats["evictions"] == 0 and _read(e, ["b"], [2000]) == ([Status.HIT], [v])


def test_an_object_larger_than_max_bytes_is_refused_and_counted(tmp_path):
    e = open_store(f"file://{tmp_path}?max_bytes=4096")
    small = _put(e, "small", 100)
    big = _value("big", 4097)
    assert e.put_from(["big", "fits"], [[big[:2000], big[2000:]], [big[:3000]]]) == [Status.ERROR, Status.HIT]
    assert e.stats["put.too_large"] == 1 and e.stats["put.error"] == 1
    assert e.exists(["big", "small"]) == [Status.MISS, Status.HIT] and e.stats["evictions"] == 0
    filled = []
    assert e.put_from(["big"], [[big]], fill=filled.append) == [Status.ERROR] and filled == []
    whole = _put(e, "whole", 4096)          # exactly max_bytes: everything else goes
    assert e.stats["put.too_large"] == 2 and e.stats["evictions"] == 2
    assert _disk_bytes(tmp_path) == 4096
    assert _read(e, ["whole", "small"], [4096, 100]) == ([Status.HIT, Status.MISS], [whole, bytes(100)])
    assert small != bytes(100)


def test_opening_knows_the_objects_on_disk_oldest_first(tmp_path):
    """An engine opening a directory counts the objects there, orders them by their
    files' times, and evicts the oldest at once where they pass its max_bytes."""
    e = open_store(f"file://{tmp_path}")
    for i in range(8):
        _put(e, f"k{i}", 1000)
        t = 1_700_000_000 + (8 - i) * 100         # k7 the oldest, k0 the newest
        os.utime(os.path.join(tmp_path, object_name(f"k{i}")), (t, t))
    assert open_store(f"file://{tmp_path}?max_bytes=1MiB").stored_bytes == 8000
    small = open_store(f"file://{tmp_path}?max_bytes=5000")
    assert small.stored_bytes == 5000 == _disk_bytes(tmp_path)
    assert small.stats["evictions"] == 3 and small.stats["evicted_bytes"] == 3000
    assert small.exists([f"k{i}" for i in range(8)]) == [Status.HIT] * 5 + [Status.MISS] * 3


def test_two_engines_on_one_directory(tmp_path):
    """Another engine's objects are learned when read; one it removed is a miss (and
    forgotten); an eviction of an object already gone is not counted."""
    url = f"file://{tmp_path}?max_bytes=5000"
    a, b = open_store(url), open_store(url)
    va = [_put(a, f"a{i}", 1000) for i in range(3)]
    assert b.stored_bytes == 0              # opened before a wrote
    vb = _put(b, "b0", 1000)
    assert _read(a, ["b0"], [1000]) == ([Status.HIT], [vb]) and a.stored_bytes == 4000
    assert b.delete(["a0"]) == [Status.HIT]
    assert _read(a, ["a0"], [1000])[0] == [Status.MISS] and a.stored_bytes == 3000
    assert b.delete(["a1"]) == [Status.HIT]          # a still counts it
    _put(a, "a3", 1000)
    _put(a, "a4", 1000)
    assert a.stats["evictions"] == 0 and a.stored_bytes == 5000 and _disk_bytes(tmp_path) == 4000
    _put(a, "a5", 1500)                 # a1, the oldest, goes (already gone), then a2
    assert a.stats["evictions"] == 1 and a.stats["evicted_bytes"] == 1000
    assert _disk_bytes(tmp_path) == 4500 == a.stored_bytes
    assert _read(b, ["a2", "b0"], [1000, 1000]) == ([Status.MISS, Status.HIT], [bytes(1000), vb])
    assert va


def test_threads_of_one_engine_putting_and_reading_hold_the_bound(tmp_path):
    """Two threads (one writing batches over the engine's three threads, one reading)
    on a full store: no exception, every hit byte-exact, the bound held at the end."""
    e = open_store(f"file://{tmp_path}?max_bytes=60000&threads=3")
    keys = [f"k{i}" for i in range(400)]
    size = {k: 500 + (i * 37) % 1500 for i, k in enumerate(keys)}
    rng, hits = random.Random(1), [0]

    def write():
        for a in range(0, len(keys), 8):
            ks = keys[a:a + 8]
            assert e.put_from(ks, [[_value(k, size[k])] for k in ks]) == [Status.HIT] * len(ks)

    def read_once():
        ks = [rng.choice(keys) for _ in range(6)]
        statuses, got = _read(e, ks, [size[k] for k in ks])
        for k, s, g in zip(ks, statuses, got):
            assert s in (Status.HIT, Status.MISS), s
            if s == Status.HIT:
                hits[0] += 1
                assert g == _value(k, size[k]), k

    _write_while_reading(write, read_once, 120)
    assert _disk_bytes(tmp_path) <= 60000 and e.stored_bytes == _disk_bytes(tmp_path)
    assert e.stats["evictions"] > 100 and hits[0] > 0
    assert os.listdir(e.tmp) == []
    last = keys[-8:]                        # the last call's: the most recently written
    statuses, got = _read(e, last, [size[k] for k in last])
    assert statuses == [Status.HIT] * 8 and got == [_value(k, size[k]) for k in last]


def test_a_backup_thread_and_a_prefetch_thread_on_a_full_store(tmp_path):
    """HiCache's two threads on one `StoreTier` over a bounded file store that keeps
    about 40 of the few hundred pages written: every page prefetched is byte-exact."""
    from store_support import PAGE, canonical, host_case, slots
    from kvtier.store.tier import StoreTier
    host = host_case("mha", "page_first", pages=24).host
    probe = StoreTier(host, f"file://{tmp_path}/probe?max_bytes=1GiB", model="m", tp=(0, 8))    # one object per page
    probe.backup(["p"], slots([0]))
    page_bytes = probe.engine.stored_bytes
    probe.close()
    max_bytes = 40 * page_bytes + page_bytes // 2
    tier = StoreTier(host, f"file://{tmp_path}/store?max_bytes={max_bytes}", model="m", tp=(0, 8), batch_pages=4)
    want = [canonical(host, p * PAGE) for p in range(12)]
    keys = [f"page{i}" for i in range(300)]                # page i from host page i % 12
    written, read, rng = [0], [0], random.Random(3)

    def backups():
        for a in range(0, len(keys), 6):
            assert tier.backup(keys[a:a + 6], slots([i % 12 for i in range(a, a + 6)])) == [True] * 6
            written[0] = a + 6

    def prefetch_once():
        a = max(0, written[0] - rng.randrange(1, 60))
        ks = keys[a:a + 4]
        n = tier.prefetch(ks, slots(range(12, 12 + len(ks))))
        read[0] += n
        for j in range(n):
            assert canonical(host, (12 + j) * PAGE) == want[(a + j) % 12], ks[j]

    _write_while_reading(backups, prefetch_once)
    root = tier.engine.root
    assert _disk_bytes(root) <= max_bytes and tier.engine.stored_bytes == _disk_bytes(root)
    assert len(_disk(root)) == 40 and tier.engine.stats["evictions"] == 260
    assert tier.exists(keys[:1]) == 0
    n = tier.prefetch(keys[-6:], slots(range(12, 18)))      # the last backup's
    assert n == 6 and [canonical(host, q * PAGE) for q in range(12, 18)] == [want[i % 12] for i in range(294, 300)]
    assert read[0] > 0 and tier.stats["errors"] == 0 and tier.stats["corrupt"] == 0
    tier.close()


# ---------------------------------------------------------------------- crash safety
_KILLED_WRITER = r"""
import os, sys, time
from kvtier.store.file import FileEngine
real = os.pwritev

def stalls(fd, bufs, offset):       # writes 1 MiB of the object, says so, and waits to be killed
    n = real(fd, [memoryview(bufs[0])[:1 << 20]], offset)
    os.write(1, b"mid-write\n")       # one write: the two threads' lines do not mix
    time.sleep(120)
    return n

e = FileEngine(sys.argv[1])
os.pwritev = stalls
e.put_from(sys.argv[2:], [[bytes(range(256)) * (32 << 10)] for _ in sys.argv[2:]])   # 8 MiB each
"""


@pytest.mark.parametrize("max_bytes", [None, 64 << 20])
def test_a_writer_killed_mid_write_leaves_no_hit(tmp_path, max_bytes):
    """A process killed (SIGKILL) in the middle of putting an 8 MiB object: a new key
    reads as a miss and a replaced one as its old object, byte-exact; the temporary
    file it left is no object (not counted) and the next engine opening removes it."""
    url = f"file://{tmp_path}" + (f"?max_bytes={max_bytes}" if max_bytes else "")
    e = open_store(url)
    old = _put(e, "replaced", 8 << 20)
    child_url = url + ("&" if "?" in url else "?") + "threads=2"      # one thread a key
    child = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, child_url, "new", "replaced"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert [child.stdout.readline().strip() for _ in range(2)] == ["mid-write"] * 2
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    left = os.listdir(e.tmp)
    assert len(left) == 2 and all(name.split(".")[-3] == str(child.pid) for name in left)
    assert [os.path.getsize(os.path.join(e.tmp, name)) for name in left] == [1 << 20] * 2
    assert _read(e, ["new", "replaced"], [8 << 20] * 2) == ([Status.MISS, Status.HIT], [bytes(8 << 20), old])
    assert e.exists(["new"]) == [Status.MISS]
    if max_bytes:
        assert e.stored_bytes == 8 << 20 == _disk_bytes(tmp_path)
    again = open_store(url)
    assert os.listdir(e.tmp) == []
    assert _read(again, ["new", "replaced"], [8 << 20] * 2) == ([Status.MISS, Status.HIT], [bytes(8 << 20), old])


def test_eviction_leaves_a_live_writers_temporary_file(tmp_path, monkeypatch):
    """While one put is writing its temporary file, other puts evict every object: the
    temporary file is not touched and the put lands whole; a live writer's file left in
    dir/tmp by another process is never removed by eviction either."""
    import socket
    e = open_store(f"file://{tmp_path}?max_bytes=10000&threads=1")
    other = os.path.join(e.tmp, f"{socket.gethostname()}.{os.getppid()}.1.0")
    with open(other, "wb") as f:
        f.write(b"x" * 50000)
    for i in range(5):
        _put(e, f"old{i}", 2000)
    real = file_module._pwritev_all
    slow = _value("slow", 6000)
    during = []

    def pwritev_all(fd, views):
        real(fd, views)
        if bytes(views[0][:16]) == slow[:16] and not during:
            during.append(os.listdir(e.tmp))
            for i in range(6):              # evicts every old object, and more
                _put(e, f"during{i}", 3000)
    monkeypatch.setattr(file_module, "_pwritev_all", pwritev_all)
    assert e.put_from(["slow"], [[slow]]) == [Status.HIT]
    assert len(during[0]) == 2
    assert _read(e, ["slow"], [6000]) == ([Status.HIT], [slow])
    assert e.exists([f"old{i}" for i in range(5)]) == [Status.MISS] * 5
    assert _disk_bytes(tmp_path) <= 10000 == e.max_bytes
    assert os.listdir(e.tmp) == [os.path.basename(other)] and os.path.getsize(other) == 50000


def test_an_object_evicted_mid_read_still_reads_whole(tmp_path, monkeypatch):
    """An object evicted (unlinked) after a reader opened it, before it read a byte,
    still reads whole and right (POSIX keeps an unlinked open file readable); it is
    gone afterwards and no longer counted."""
    e = open_store(f"file://{tmp_path}?max_bytes=10000&threads=1")
    victim = _put(e, "victim", 6000)
    real = file_module._read_whole
    evicted = []

    def read_whole(fd, views):
        if not evicted:
            evicted.append(_put(e, "newer", 6000))        # evicts the victim
            assert e.exists(["victim"]) == [Status.MISS]
        return real(fd, views)
    monkeypatch.setattr(file_module, "_read_whole", read_whole)
    assert _read(e, ["victim"], [6000]) == ([Status.HIT], [victim])
    assert e.stats["evictions"] == 1 and e.exists(["victim"]) == [Status.MISS]
    assert e.stored_bytes == 6000 == _disk_bytes(tmp_path)


# ---------------------------------------------------------------------- path-like keys
PATH_KEYS = ["../../etc/passwd", "/abs", "/", "a/../../b", "..", ".", "tmp", "tmp/x", "../tmp/x",
             "\x00", "a\x00b", "ab", "ab/cd", "C:\\Windows\\system32", "~root", "%2e%2e%2f",
             "\ud800", "k" * 100_000, "../" * 5000, "ключ/../..", "kvtier1:../../m:p64:../x"]


@pytest.mark.parametrize("max_bytes", [None, 1 << 20])
def test_keys_like_paths_stay_inside_the_store(tmp_path, max_bytes):
    """Keys that read as paths (relative, absolute, NUL, very long) each make one file,
    inside the store's directory, and round-trip as themselves."""
    root = tmp_path / "store"
    e = FileEngine(f"file://{root}", max_bytes=max_bytes)
    made_before = sorted(str(p) for p in tmp_path.rglob("*"))
    values = [_value(repr(k), 100 + i) for i, k in enumerate(PATH_KEYS)]
    assert e.put_from(PATH_KEYS, [[v] for v in values]) == [Status.HIT] * len(PATH_KEYS)
    made = sorted(set(str(p) for p in tmp_path.rglob("*")) - set(made_before))
    assert len(made) == len(PATH_KEYS) == len(set(object_name(k) for k in PATH_KEYS))
    for path in made:
        real = os.path.realpath(path)
        assert real.startswith(str(root) + os.sep) and os.path.isfile(real)
        d, leaf = os.path.relpath(real, root).split(os.sep)
        assert d in FANOUT and len(leaf) == 32 and leaf.startswith(d)
    assert e.exists(PATH_KEYS) == [Status.HIT] * len(PATH_KEYS)
    statuses, got = _read(e, PATH_KEYS, [len(v) for v in values])
    assert statuses == [Status.HIT] * len(PATH_KEYS) and got == values
    assert e.delete(PATH_KEYS) == [Status.HIT] * len(PATH_KEYS)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == made_before
    assert e.exists(PATH_KEYS) == [Status.MISS] * len(PATH_KEYS)


def test_a_namespace_like_a_path_stays_inside_the_store(tmp_path):
    """A model name and page keys that read as paths, through the tier's namespace."""
    from store_support import PAGE, canonical, host_case, slots
    from kvtier.store.tier import StoreTier
    host = host_case("mla", "page_first", pages=8).host
    root = tmp_path / "store"
    tier = StoreTier(host, f"file://{root}", model="../../../etc/passwd", tp=(0, 1))
    page_keys = ["../../x", "/abs", "a\x00b"]
    want = [canonical(host, p * PAGE) for p in range(3)]
    assert tier.backup(page_keys, slots([0, 1, 2])) == [True] * 3
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 3 and all(str(p.resolve()).startswith(str(root) + os.sep) for p in files)
    assert sorted(p.name for p in files) == sorted(object_name(tier.key(k)).split("/")[1] for k in page_keys)
    assert tier.prefetch(page_keys, slots([4, 5, 6])) == 3
    assert [canonical(host, q * PAGE) for q in (4, 5, 6)] == want
    tier.close()


def test_an_eviction_that_fails_is_the_puts_error_and_the_bound_holds(tmp_path, monkeypatch):
    """An object that cannot be removed stays counted: the put that needed the room is
    ERROR (not stored), a hit that would evict stays a hit, and the bound holds."""
    import errno
    e = open_store(f"file://{tmp_path}?max_bytes=3000&threads=1")
    _put(e, "a", 1000)
    _put(e, "b", 1000)
    b = FileEngine(f"file://{tmp_path}")
    vc = _put(b, "c", 1500)                 # not in e's view until e reads it
    real = os.unlink

    def refuse(path, *args, **kw):
        if path.endswith(object_name("a").split("/")[1]):
            raise OSError(errno.EACCES, "Permission denied")
        return real(path, *args, **kw)
    monkeypatch.setattr(os, "unlink", refuse)
    assert _read(e, ["c"], [1500]) == ([Status.HIT], [vc])      # 3500 known: a cannot go
    assert e.stored_bytes == 3500 and e.stats["evictions"] == 0
    assert e.put_from(["d"], [[b"d" * 1000]]) == [Status.ERROR]
    assert e.exists(["a", "d"]) == [Status.HIT, Status.MISS] and os.listdir(e.tmp) == []
    monkeypatch.setattr(os, "unlink", real)
    _put(e, "d", 1000)
    assert e.stats["evictions"] == 2 and _disk_bytes(tmp_path) <= 3000 == e.max_bytes
    assert e.exists(["a", "b", "c", "d"]) == [Status.MISS, Status.MISS, Status.HIT, Status.HIT]
