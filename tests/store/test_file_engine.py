"""The file engine: the engine contract (`engine_conformance`), and what is its own:
URLs, the directory it makes, torn writes, dead writers' temporary files, the raw figure."""
from __future__ import annotations

import os

import pytest

from engine_conformance import EngineConformance
from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store.file import FileEngine, object_name


class TestFileEngineContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, tmp_path):
        return lambda: open_store(f"file://{tmp_path}/store")


@pytest.mark.parametrize("url", ["file://relative/dir", "file:relative", "file:///dir?x=1", "file:///dir#frag", "file:///", "file:///a/..",
                                 "file://otherhost/dir", "file:///dir?threads", "file:///dir?threads=0",
                                 "file:///dir?threads=65", "file:///dir?threads=2x", "file:///dir?threads=-1",
                                 "file:///dir?threads=2&threads=3"])
def test_malformed_urls_name_the_url(url):
    with pytest.raises(KvtierError, match="url="):
        open_store(url)


def test_unwritable_directory_names_the_url(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    url = f"file://{blocker}/store"
    with pytest.raises(KvtierError, match="url=.*a-file/store.*cannot be written"):
        open_store(url)


def test_localhost_and_percent_encoded_paths(tmp_path):
    e = open_store(f"file://localhost{tmp_path}/with%20space")
    assert e.root == f"{tmp_path}/with space" and os.path.isdir(e.root)
    assert e.put_from(["k"], [[b"abc"]]) == [Status.HIT]


def test_object_names_are_safe_and_fanned_out(tmp_path):
    e = FileEngine(f"file://{tmp_path}")
    for key in ["..", "/etc/passwd", "a" * 5000, "ключ", "\x00"]:
        name = object_name(key)
        a, leaf = name.split("/")
        assert len(a) == 2 and len(leaf) == 32 and leaf.startswith(a)
        assert all(c in "0123456789abcdef" for c in leaf)
    e.put_from(["x"], [[b"1"]])
    assert os.path.isfile(os.path.join(str(tmp_path), object_name("x")))


def test_live_writers_temporary_files_are_kept(tmp_path):
    import socket
    e = FileEngine(f"file://{tmp_path}")
    live = os.path.join(e.tmp, f"{socket.gethostname()}.{os.getppid()}.1.0")    # a running process
    other_host = os.path.join(e.tmp, "elsewhere.1.1.0")
    dead = os.path.join(e.tmp, f"{socket.gethostname()}.{_dead_pid()}.1.0")
    for p in (live, other_host, dead):
        open(p, "wb").close()
    FileEngine(f"file://{tmp_path}")
    assert os.path.exists(live) and os.path.exists(other_host) and not os.path.exists(dead)


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_raw_throughput_leaves_nothing_behind(tmp_path):
    e = FileEngine(f"file://{tmp_path}")
    before = sorted(os.listdir(tmp_path))
    r = e.raw_throughput(65536, 8)
    assert r["get_gbps"] > 0 and r["set_gbps"] > 0 and "plain file" in r["how"]
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(KvtierError, match="value_bytes"):
        e.raw_throughput(0, 8)
    with pytest.raises(KvtierError, match="count"):
        e.raw_throughput(10, True)


def test_raw_calls_leave_nothing_behind(tmp_path):
    from kvtier.store.engine import RawCalls
    e = FileEngine(f"file://{tmp_path}")
    before = sorted(os.listdir(tmp_path))
    for raw, how in ((e.raw_calls(4096, 4), "plain writes"), (RawCalls(e, 4096, 4), "put_from")):
        raw.set()                   # plain files; the engine's own calls (the default)
        raw.get()
        assert [bytes(t) for t in raw.targets] == [bytes(s) for s in raw.sources] and how in raw.how
        raw.close()
    assert sorted(os.listdir(tmp_path)) == before
    objects = [f for d in os.listdir(tmp_path) if len(d) == 2 for f in os.listdir(tmp_path / d)]
    assert objects == [] and os.listdir(tmp_path / "tmp") == []


def test_a_failing_write_is_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    e = FileEngine(f"file://{tmp_path}")
    import errno

    def full(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwritev", full)
    assert e.put_from(["a", "b"], [[b"1"], [b"2"]]) == [Status.ERROR, Status.ERROR]
    assert os.listdir(e.tmp) == []
    assert e.stats["put.error"] == 2


def test_threads_option_and_default(tmp_path):
    from kvtier.store.file import default_threads
    assert open_store(f"file://{tmp_path}/a").threads == default_threads() == max(1, min(4, os.cpu_count()))
    assert open_store(f"file://{tmp_path}/b?threads=5").threads == 5


@pytest.mark.parametrize("threads", [1, 3])
def test_a_call_is_spread_over_its_threads(tmp_path, threads):
    """Each key goes to one of ``threads`` threads (the calling one among them), every
    status lands at its key's position, and `close` ends the engine's threads."""
    import threading
    others = set(threading.enumerate())     # other engines' threads, some perhaps still ending
    e = open_store(f"file://{tmp_path}?threads={threads}")
    keys = [f"k{i}" for i in range(10)]
    values = [os.urandom(1000 + i) for i in range(10)]
    on = {}
    real = e._write

    def write(path, views):
        on.setdefault(threading.current_thread().name, 0)
        on[threading.current_thread().name] += 1
        return real(path, views)

    e._write = write
    assert e.put_from(keys[:9], [[v] for v in values[:9]]) == [Status.HIT] * 9
    me = threading.current_thread().name
    assert sum(on.values()) == 9 and on[me] == len(range(0, 9, threads))    # the caller's share
    assert all(n.startswith("kvtier-file") for n in on if n != me) and (len(on) > 1) == (threads > 1)
    targets = [bytearray(len(v)) for v in values]
    assert e.get_into(keys, [[t] for t in targets]) == [Status.HIT] * 9 + [Status.MISS]
    assert [bytes(t) for t in targets[:9]] == values[:9] and targets[9] == bytearray(len(values[9]))
    workers = [t for t in threading.enumerate() if t.name.startswith("kvtier-file") and t not in others]
    # at most a thread per other share; fewer where the pool handed a share to a thread
    # that had ended its first one already (a busy machine)
    assert (0 < len(workers) <= threads - 1) if threads > 1 else not workers
    e.close()
    assert not any(t.is_alive() for t in workers)
    assert e.put_from(["x"], [[b"1"]]) == [Status.ERROR]
    assert e.get_into(keys, [[t] for t in targets]) == [Status.ERROR] * 10
    assert e._pool is None          # a call after close makes no threads


@pytest.mark.parametrize("files,size,shares", [(4, 256 << 10, 1), (8, 256 << 10, 1), (9, 256 << 10, 2),
                                             (16, 256 << 10, 2), (12, 1 << 20, 3), (40, 1000, 1),
                                             (160, 32 << 10, 1), (40, 64 << 10, 1), (24, 128 << 10, 1),
                                             (12, 512 << 10, 3)])
def test_a_read_spreads_over_a_thread_per_read_spread_bytes(tmp_path, monkeypatch, files, size, shares):
    """A read takes another thread only for each `READ_SPREAD_BYTES` of its values (a
    few pages are read on the calling thread), and none where its values average under
    `READ_SPREAD_VALUE` (5 MiB of 32 KiB files, 3 MiB of 128 KiB ones); a write of as
    many files spreads over them all."""
    import threading
    from kvtier.store import file as file_module
    assert file_module.READ_SPREAD_BYTES == 2 << 20 and file_module.READ_SPREAD_VALUE == 256 << 10
    dealt = []
    real_deal = file_module._deal
    monkeypatch.setattr(file_module, "_deal", lambda count, threads: dealt.append(threads) or real_deal(count, threads))
    e = open_store(f"file://{tmp_path}?threads=3")
    keys = [f"k{i}" for i in range(files)]
    values = [os.urandom(size) for _ in range(files)]
    readers = set()
    real_read = e._read
    e._read = lambda path, views: readers.add(threading.get_ident()) or real_read(path, views)
    try:
        assert e.put_from(keys, [[v] for v in values]) == [Status.HIT] * files
        assert dealt == [3]                 # every write call: over all three threads
        targets = [bytearray(size) for _ in values]
        assert e.get_into(keys, [[t] for t in targets]) == [Status.HIT] * files
        assert [bytes(t) for t in targets] == values
        assert dealt == [3] + ([shares] if shares > 1 else [])
        if shares == 1:
            assert readers == {threading.get_ident()}       # the calling thread alone
    finally:
        e.close()


def test_a_fault_in_one_thread_is_that_keys_status(tmp_path, monkeypatch):
    """A store fault on one key (any thread) is that key's status; an exception that
    is not a store fault ends the call as ERROR for every key, after every thread
    has stopped touching the buffers."""
    import errno
    import time
    e = open_store(f"file://{tmp_path}?threads=2")
    real = e._write

    def write(path, views):
        if path.endswith(object_name("bad")):
            raise OSError(errno.EIO, "I/O error")
        return real(path, views)

    e._write = write
    keys = ["a", "bad", "c", "d"]
    assert e.put_from(keys, [[b"1"]] * 4) == [Status.HIT, Status.ERROR, Status.HIT, Status.HIT]
    done = []

    def boom(path, views):
        if path.endswith(object_name("c")):       # the calling thread's share: a, c
            raise ZeroDivisionError("bug")
        if path.endswith(object_name("d")):       # the other thread's: bad, d (still writing)
            time.sleep(0.3)
        r = real(path, views)
        done.append(path)
        return r

    e._write = boom
    assert e.put_from(keys, [[b"2"]] * 4) == [Status.ERROR] * 4
    assert any(p.endswith(object_name("d")) for p in done)     # returned only once it was done
    assert e.stats["put.error"] == 5


def test_close_during_a_call_leaves_no_write_after_it_returns(tmp_path):
    """`close` while a call's threads are writing: the call returns only once none of
    them touches its buffers (a share already running finishes; its keys HIT where
    written, ERROR where not), and no thread is made after the close."""
    import threading
    import time
    e = open_store(f"file://{tmp_path}?threads=2")
    real = e._write
    began, ended = threading.Event(), []

    def slow(path, views):
        began.set()
        time.sleep(0.1)
        r = real(path, views)
        ended.append(time.monotonic())
        return r

    e._write = slow
    out, returned = [], []

    def call():
        out.extend(e.put_from([f"k{i}" for i in range(8)], [[b"x"]] * 8))
        returned.append(time.monotonic())

    t = threading.Thread(target=call)
    t.start()
    assert began.wait(10)
    e.close()
    t.join(10)
    assert returned and all(w <= returned[0] for w in ended)
    assert len(out) == 8 and out.count(Status.HIT) == len(ended)      # the rest ERROR
    assert e._pool is None and e.put_from(["a", "b"], [[b"1"], [b"2"]]) == [Status.ERROR] * 2


def _ranged_engine(tmp_path, monkeypatch, threads):
    """An engine whose reads of few, large values go by ranges of 16 KiB
    (`RANGE_BYTES`), each range's (thread, offset, bytes) recorded."""
    import threading
    from kvtier.store import file as file_module
    monkeypatch.setattr(file_module, "RANGE_BYTES", 16 << 10)
    e = open_store(f"file://{tmp_path}/store?threads={threads}")
    reads = []
    real = e._read_range

    def read_range(fd, offset, views):
        reads.append((threading.get_ident(), offset, sum(v.nbytes for v in views)))
        return real(fd, offset, views)

    e._read_range = read_range
    return e, reads


def _split(buf, *sizes):
    """``buf`` as views of ``sizes`` and the rest (a header and payload pieces)."""
    out, a = [], 0
    for n in sizes:
        out.append(memoryview(buf)[a:a + n])
        a += n
    return out + [memoryview(buf)[a:]]


def test_few_large_values_are_read_in_ranges_on_several_threads(tmp_path, monkeypatch):
    """Fewer keys than threads, of values of at least twice `RANGE_BYTES`: each value
    is read in ranges cut at 4 KiB offsets, dealt to the threads, that cover it exactly
    once, into buffers of any split; landed once per key, when all of it is in."""
    import threading
    e, reads = _ranged_engine(tmp_path, monkeypatch, threads=3)
    values = {"a": os.urandom(100_003), "b": os.urandom(70_001)}
    assert e.put_from(list(values), [[v] for v in values.values()]) == [Status.HIT] * 2
    targets = [bytearray(b"\xa5" * len(v)) for v in values.values()]
    heard = []
    statuses = e.get_into(list(values), [_split(targets[0], 136, 7, 40_000), _split(targets[1], 96)],
                          lambda i: heard.append(i))
    assert statuses == [Status.HIT] * 2 and sorted(heard) == [0, 1]
    assert [bytes(t) for t in targets] == list(values.values())
    assert len({t for t, _, _ in reads}) > 1 and threading.get_ident() in {t for t, _, _ in reads}
    # a values' ranges: threads // keys = 1 each here (3 threads, 2 keys): one range each
    assert sorted((o, n) for _, o, n in reads) == [(0, 70_001), (0, 100_003)]
    reads.clear()
    (target,) = [bytearray(len(values["a"]))]
    assert e.get_into(["a"], [_split(target, 136, 20_000)]) == [Status.HIT]
    assert bytes(target) == values["a"]
    spans = sorted((o, n) for _, o, n in reads)
    assert len(spans) == 3 and all(o % 4096 == 0 for o, _ in spans)
    assert [o for o, _ in spans] == [0] + [o + n for o, n in spans[:-1]] and sum(n for _, n in spans) == 100_003
    e.close()


@pytest.mark.parametrize("pieces", [1, 3, 1500])      # 1500: more buffers than one preadv takes
def test_a_whole_read_needs_no_fstat_and_a_cut_read_is_resumed(tmp_path, monkeypatch, pieces):
    """A file read whole takes no ``fstat`` where its buffers fit one ``preadv`` (the
    byte asked for past them tells a longer file); a read the kernel cuts short is
    resumed and reads whole, with its length checked; files a byte shorter or longer
    are CORRUPT either way."""
    from kvtier.store import file as file_module
    e = open_store(f"file://{tmp_path}?threads=1")
    data = os.urandom(30_000)
    assert e.put_from(["k", "short", "long"], [[data], [data[:-1]], [data + b"x"]]) == [Status.HIT] * 3
    fstats, cuts = [], []
    real_fstat, real_preadv = os.fstat, os.preadv
    monkeypatch.setattr(file_module.os, "fstat", lambda fd: fstats.append(fd) or real_fstat(fd))

    def read(keys):
        out = []
        for k in keys:
            target = bytearray(b"\x5a" * len(data))
            step = -(-len(data) // pieces)
            views = [memoryview(target)[a:a + step] for a in range(0, len(data), step)]
            out.append((e.get_into([k], [views])[0], bytes(target)))
        return out

    assert read(["k"]) == [(Status.HIT, data)]
    assert read(["long"])[0][0] == Status.CORRUPT
    assert (fstats == []) == (pieces < file_module._IOV_MAX)
    assert read(["short"])[0][0] == Status.CORRUPT         # a short read: checked the careful way

    def cut(fd, views, offset):                 # the first read of a call stops 100 bytes in
        if not cuts:
            cuts.append(offset)
            return real_preadv(fd, [views[0][:100]], offset)
        return real_preadv(fd, views, offset)
    monkeypatch.setattr(file_module.os, "preadv", cut)
    fstats.clear()
    assert read(["k"]) == [(Status.HIT, data)] and cuts == [0] and len(fstats) == 1
    for k in ("short", "long"):
        cuts.clear()
        assert read([k])[0][0] == Status.CORRUPT
    e.close()


def test_a_ranged_read_s_misses_faults_and_short_files(tmp_path, monkeypatch):
    """In a ranged read, a missing key is MISS (its buffers untouched), a file of
    another length CORRUPT (nothing read), a range's I/O error that key's ERROR, a file
    cut short after its length was checked CORRUPT; the other keys read whole."""
    import errno
    from kvtier.store import file as file_module
    e, reads = _ranged_engine(tmp_path, monkeypatch, threads=4)
    a, d = os.urandom(40_000), os.urandom(50_000)
    assert e.put_from(["a", "d"], [[a], [d[:-1]]]) == [Status.HIT] * 2
    targets = [bytearray(b"\x5a" * n) for n in (40_000, 40_000, 50_000)]
    heard = []
    assert e.get_into(["a", "c", "d"], [[t] for t in targets], heard.append) == [
        Status.HIT, Status.MISS, Status.CORRUPT]
    assert bytes(targets[0]) == a and targets[1] == bytearray(b"\x5a" * 40_000)
    assert targets[2] == bytearray(b"\x5a" * 50_000) and heard == [0]
    assert {o for _, o, _ in reads} == {0}          # only a's range: no byte read of c or d
    real_preadv = os.preadv

    def failing(fd, views, offset):
        if offset >= 32 << 10:
            raise OSError(errno.EIO, "I/O error")
        return real_preadv(fd, views, offset)

    assert e.put_from(["big"], [[os.urandom(64 << 10)]]) == [Status.HIT]
    monkeypatch.setattr(file_module.os, "preadv", failing)
    out = bytearray(64 << 10)
    assert e.get_into(["big", "a"], [[out], [bytearray(40_000)]]) == [Status.ERROR, Status.HIT]
    monkeypatch.setattr(file_module.os, "preadv", real_preadv)
    path = os.path.join(e.root, object_name("big"))
    real_range = e._read_range

    def cut_first(fd, offset, views):
        os.truncate(path, 8 << 10)                   # another process cuts the file short
        return real_range(fd, offset, views)

    e._read_range = cut_first
    heard.clear()
    assert e.get_into(["big"], [[out]], heard.append) == [Status.CORRUPT] and heard == []
    e.close()
