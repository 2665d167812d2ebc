"""The engine contract (`kvtier.store.engine`), as tests any engine must pass.

Use: subclass `EngineConformance` in a test module (its name starts with ``Test``) and
give it one fixture, ``open_engine``: a callable that returns a new, connected `Engine`
on the store under test (each call a new engine on the same store; the tests close the
engines they open). Skip inside the fixture where the store cannot be had::

    from engine_conformance import EngineConformance

    class TestFileEngine(EngineConformance):
        @pytest.fixture
        def open_engine(self, tmp_path):
            return lambda: FileEngine(f"file://{tmp_path}")

The module lives in tests/store/ (no __init__.py), so test modules there import it as
``engine_conformance``; a module elsewhere puts this directory on sys.path first.

Every test writes under keys of its own (a random prefix), so a store shared between
tests, or left with objects of an earlier run, does not change an outcome. The tests
need no server control: faults of a server (killed, hung) are each engine's own tests.

What is checked: a status per key of the right kind; scatter reads and gather writes
whose pieces differ in number and size between the write and the read; a read into a
target of another length is CORRUPT (and the other keys of the batch are unaffected);
a missing key is MISS and its target untouched; ``landed`` for each whole value, once,
inside the call; `get_ahead` ended by ``into`` reads as ``get_into``, by ``cancel``
reads nothing and leaves the engine whole; puts replace; delete; keys of any
characters kept apart; bad arguments raise `KvtierError` before any byte moves; several
threads at once; the counters; calls after `close` return ERROR; `raw_calls` (the
bench's raw latency) moves its values and raises once they are gone.
"""
from __future__ import annotations

import threading
import uuid

import pytest

from kvtier.errors import KvtierError
from kvtier.store.engine import Engine, Status


def _random(n: int, seed: int) -> bytearray:
    """``n`` random bytes (a fixed seed per call site: reproducible, never all alike)."""
    import random
    return bytearray(random.Random(seed).randbytes(n))


def _split(data, cuts):
    """``data`` as memoryviews cut at the offsets ``cuts``."""
    mv = memoryview(data)
    edges = [0, *cuts, len(data)]
    return [mv[a:b] for a, b in zip(edges, edges[1:])]


class EngineConformance:
    """The contract's tests; a subclass supplies the ``open_engine`` fixture."""

    @pytest.fixture
    def engine(self, open_engine):
        e = open_engine()
        assert isinstance(e, Engine)
        yield e
        e.close()

    @pytest.fixture
    def keys(self):
        """A function ``keys(n)``: n fresh keys unique to this test."""
        prefix = f"kvtier-conformance/{uuid.uuid4().hex}/"
        return lambda n: [f"{prefix}{i}" for i in range(n)]

    # ------------------------------------------------------------------ round trips
    def test_put_get_exists_round_trip(self, engine, keys):
        ks = keys(3)
        values = [_random(n, i) for i, n in enumerate((1, 4097, 300_001))]
        assert engine.exists(ks) == [Status.MISS] * 3
        # Written in one piece, read back in three (and the reverse for the last).
        assert engine.put_from(ks, [[v] for v in values]) == [Status.HIT] * 3
        assert engine.exists(ks) == [Status.HIT] * 3
        targets = [bytearray(len(v)) for v in values]
        pieces = [[memoryview(targets[0])], _split(targets[1], [1, 4000]), _split(targets[2], [7, 65536, 65537])]
        out = engine.get_into(ks, pieces)
        assert out == [Status.HIT] * 3
        assert all(isinstance(s, Status) for s in out)
        assert targets == values

    def test_gather_write_scatter_read(self, engine, keys):
        (k,) = keys(1)
        data = _random(1 << 20, 7)
        assert engine.put_from([k], [_split(data, [100, 65536, 500_000])]) == [Status.HIT]
        got = bytearray(len(data))
        assert engine.get_into([k], [_split(got, [1, 2, 3, 1 << 19])]) == [Status.HIT]
        assert got == data

    def test_many_pieces(self, engine, keys):
        """More pieces than one system call takes (IOV_MAX is 1024 on Linux)."""
        (k,) = keys(1)
        data = _random(3000 * 16, 8)
        assert engine.put_from([k], [_split(data, range(16, len(data), 16))]) == [Status.HIT]
        got = bytearray(len(data))
        assert engine.get_into([k], [_split(got, range(16, len(data), 16))]) == [Status.HIT]
        assert got == data

    def test_sources_of_other_buffer_types(self, engine, keys):
        """bytes, bytearray, memoryview of another format, numpy and torch arrays."""
        np = pytest.importorskip("numpy")
        import torch
        ks = keys(3)
        arr = np.frombuffer(_random(4096, 9), dtype=np.float32).copy()
        ten = torch.from_numpy(np.frombuffer(_random(2048, 10), dtype=np.int16).copy())
        raw = bytes(_random(999, 11))
        assert engine.put_from(ks, [[arr], [ten.numpy()], [raw]]) == [Status.HIT] * 3
        got = [np.zeros(1024, np.float32), torch.zeros(1024, dtype=torch.int16), bytearray(999)]
        assert engine.get_into(ks, [[got[0]], [got[1].numpy()], [got[2]]]) == [Status.HIT] * 3
        assert got[0].tobytes() == arr.tobytes()
        assert got[1].numpy().tobytes() == ten.numpy().tobytes()
        assert bytes(got[2]) == raw

    def test_duplicate_key_in_one_read(self, engine, keys):
        (k,) = keys(1)
        data = _random(5000, 12)
        engine.put_from([k], [[data]])
        a, b = bytearray(5000), bytearray(5000)
        assert engine.get_into([k, k], [[a], [b]]) == [Status.HIT, Status.HIT]
        assert a == data and b == data

    # ------------------------------------------------------------------ misses and lengths
    def test_missing_key_is_miss_and_target_untouched(self, engine, keys):
        present, absent = keys(2)
        data = _random(1000, 13)
        engine.put_from([present], [[data]])
        poison = bytearray(b"\xa5" * 1000)
        t_present, t_absent = bytearray(poison), bytearray(poison)
        assert engine.get_into([absent, present], [[t_absent], [t_present]]) == [Status.MISS, Status.HIT]
        assert t_absent == poison
        assert t_present == data

    @pytest.mark.parametrize("delta", [-1, 1, -999])
    def test_wrong_length_is_corrupt(self, engine, keys, delta):
        """A target of another total length than the object: CORRUPT, whatever the split;
        the batch's other keys are read as usual."""
        bad, good = keys(2)
        engine.put_from([bad, good], [[_random(1000, 14)], [_random(500, 15)]])
        target = bytearray(1000 + delta)
        got = bytearray(500)
        out = engine.get_into([bad, good], [_split(target, [len(target) // 2]), [got]])
        assert out == [Status.CORRUPT, Status.HIT]
        assert got == _random(500, 15)
        assert engine.stats["get.corrupt"] >= 1

    def test_put_replaces(self, engine, keys):
        (k,) = keys(1)
        engine.put_from([k], [[_random(3000, 16)]])
        new = _random(1200, 17)
        assert engine.put_from([k], [[new]]) == [Status.HIT]
        got = bytearray(1200)
        assert engine.get_into([k], [[got]]) == [Status.HIT]
        assert got == new
        assert engine.get_into([k], [[bytearray(3000)]]) == [Status.CORRUPT]   # the old length is gone

    def test_delete(self, engine, keys):
        a, b = keys(2)
        engine.put_from([a], [[_random(100, 18)]])
        assert engine.delete([a, b]) == [Status.HIT, Status.HIT]      # removed, and absent
        assert engine.exists([a, b]) == [Status.MISS, Status.MISS]
        assert engine.get_into([a], [[bytearray(100)]]) == [Status.MISS]

    def test_keys_of_any_characters_are_kept_apart(self, engine, keys):
        base = keys(1)[0]
        odd = ["a/b", "a_b", "a%2Fb", "A/B", "..", ".", " ", "ключ/鍵", "x" * 600, "x" * 601,
               "{tag}:1", "line\nbreak", "nul\x00byte", "slash/"]
        ks = [base + s for s in odd]
        values = [_random(64 + i, 100 + i) for i in range(len(ks))]
        assert engine.put_from(ks, [[v] for v in values]) == [Status.HIT] * len(ks)
        targets = [bytearray(len(v)) for v in values]
        assert engine.get_into(ks, [[t] for t in targets]) == [Status.HIT] * len(ks)
        assert targets == values

    def test_empty_batches(self, engine):
        assert engine.exists([]) == []
        assert engine.get_into([], []) == []
        assert engine.put_from([], []) == []
        assert engine.delete([]) == []

    # ------------------------------------------------------------------ landed values
    def test_landed_reports_each_whole_value_once_before_the_call_returns(self, engine, keys):
        """``landed(i)`` is called at most once per key, only for a HIT, only once its
        value is whole in its buffers (seen from inside the call), and never after the
        call returns. An engine that cannot tell values apart reports none
        (``reports_landed = False`` on the test class)."""
        ks = keys(5)
        values = [_random(n, 70 + i) for i, n in enumerate((5000, 70_000, 1, 300_001))]
        engine.put_from([ks[0], ks[1], ks[3], ks[4]], [[v] for v in values])
        targets = [bytearray(5000), bytearray(70_000), bytearray(9), bytearray(3), bytearray(300_001)]
        want = [values[0], values[1], None, None, values[3]]
        seen, whole, lock = [], [], threading.Lock()

        def landed(i):
            with lock:
                seen.append(i)
                whole.append(bytes(targets[i]) == want[i])

        out = engine.get_into(ks, [[memoryview(t)] for t in targets], landed)
        assert out == [Status.HIT, Status.HIT, Status.MISS, Status.CORRUPT, Status.HIT]
        done = list(seen)
        if getattr(self, "reports_landed", True):
            assert sorted(done) == [0, 1, 4] and all(whole)
        else:
            assert done == []
        assert engine.get_into(ks[:1], [[bytearray(5000)]]) == [Status.HIT]   # no landed given
        assert seen == done                                                  # none came late

    def test_fill_finishes_each_source_before_it_is_read(self, engine, keys):
        """``fill(i)`` is called once per key, before any byte of its source is read:
        what it writes into the source is what the store keeps. Where it returns False,
        the key is ERROR and nothing is stored under it (an older object stays)."""
        ks = keys(4)
        old = _random(300, 80)
        assert engine.put_from([ks[2]], [[old]]) == [Status.HIT]
        values = [_random(n, 81 + i) for i, n in enumerate((4096, 70_000, 300, 200_001))]
        blank = [bytearray(len(v)) for v in values]
        called, lock = [], threading.Lock()

        def fill(i):
            with lock:
                called.append((i, bytes(blank[i]) == bytes(len(blank[i]))))
            if i == 2:
                return False
            blank[i][:] = values[i]
            return True

        out = engine.put_from(ks, [[memoryview(b)] for b in blank], fill)
        assert out == [Status.HIT, Status.HIT, Status.ERROR, Status.HIT]
        assert sorted(called) == [(i, True) for i in range(4)]       # once each, before it was filled
        targets = [bytearray(len(v)) for v in values]
        targets[2] = bytearray(300)
        assert engine.get_into(ks, [[memoryview(t)] for t in targets]) == [Status.HIT] * 4
        assert [bytes(t) for i, t in enumerate(targets) if i != 2] == [v for i, v in enumerate(values) if i != 2]
        assert bytes(targets[2]) == old                                # not replaced
        ks2 = [ks[0] + "-never-put"]
        assert engine.put_from(ks2, [[b"only"]], lambda i: False) == [Status.ERROR]
        assert engine.exists(ks2) == [Status.MISS]

    # ------------------------------------------------------------------ get_ahead
    def test_get_ahead_then_into_reads_as_get_into(self, engine, keys):
        """A `get_ahead` ended by `into` is a `get_into`: the same statuses (HIT, MISS,
        CORRUPT for a value of another length), bytes, ``landed`` and counters."""
        ks = keys(4)
        values = [_random(n, 90 + i) for i, n in enumerate((5000, 70_000, 300_001))]
        assert engine.put_from([ks[0], ks[1], ks[3]], [[v] for v in values]) == [Status.HIT] * 3
        lengths = [5000, 70_000, 64, 300_000]       # the last: one byte short of its value
        before = dict(engine.stats)
        pending = engine.get_ahead(ks, lengths)
        targets = [bytearray(b"\x5a" * n) for n in lengths]
        seen = []
        out = pending.into([_split(t, [len(t) // 3]) for t in targets], seen.append)
        assert out == [Status.HIT, Status.HIT, Status.MISS, Status.CORRUPT]
        assert bytes(targets[0]) == values[0] and bytes(targets[1]) == values[1]
        assert bytes(targets[2]) == b"\x5a" * 64                   # a miss leaves its target
        if getattr(self, "reports_landed", True):
            assert sorted(seen) == [0, 1]
        counted = {k: v - before.get(k, 0) for k, v in engine.stats.items() if k.startswith("get.")}
        assert {k: v for k, v in counted.items() if v} == {"get.hit": 2, "get.miss": 1, "get.corrupt": 1}
        pending.cancel()                                            # after into: nothing
        with pytest.raises(KvtierError, match="into"):
            pending.into([[t] for t in targets])

    def test_a_cancelled_get_ahead_reads_nothing_and_leaves_the_engine_whole(self, engine, keys):
        """`cancel` drops the call: nothing counted, and the engine's next calls read the
        right values (no reply of the cancelled call is taken for theirs)."""
        ks = keys(3)
        values = [_random(n, 95 + i) for i, n in enumerate((4096, 200_000, 17))]
        assert engine.put_from(ks, [[v] for v in values]) == [Status.HIT] * 3
        before = dict(engine.stats)
        for _ in range(3):
            engine.get_ahead(ks, [len(v) for v in values]).cancel()
        assert {k: v for k, v in engine.stats.items() if k.startswith("get.")} == \
            {k: v for k, v in before.items() if k.startswith("get.")}
        for order in (ks[::-1], ks):
            targets = [bytearray(len(values[ks.index(k)])) for k in order]
            assert engine.get_into(order, [[t] for t in targets]) == [Status.HIT] * 3
            assert [bytes(t) for t in targets] == [values[ks.index(k)] for k in order]
            pending = engine.get_ahead(order, [len(t) for t in targets])
            targets = [bytearray(len(t)) for t in targets]
            assert pending.into([[t] for t in targets]) == [Status.HIT] * 3
            assert [bytes(t) for t in targets] == [values[ks.index(k)] for k in order]

    def test_get_ahead_bad_arguments_raise_before_anything_moves(self, engine, keys):
        """Bad keys or lengths raise at `get_ahead`; targets of other lengths than it was
        given raise at `into`, naming the target, with no byte written, and end the call."""
        k, other = keys(2)
        value = _random(1000, 99)
        assert engine.put_from([k], [[value]]) == [Status.HIT]
        with pytest.raises(KvtierError, match="keys"):
            engine.get_ahead(k, [1000])
        with pytest.raises(KvtierError, match="nbytes"):
            engine.get_ahead([k, other], [1000])
        for bad in (0, -1, True, 1.5, "1000"):
            with pytest.raises(KvtierError, match=r"nbytes\[1\]"):
                engine.get_ahead([other, k], [1000, bad])
        assert engine.get_ahead([], []).into([]) == []
        pending = engine.get_ahead([other, k], [4, 1000])
        targets = [bytearray(b"\x33" * 4), bytearray(b"\x33" * 999)]
        with pytest.raises(KvtierError, match=r"targets\[1\]"):
            pending.into([[t] for t in targets])
        assert targets == [bytearray(b"\x33" * 4), bytearray(b"\x33" * 999)]
        with pytest.raises(KvtierError, match="into"):
            pending.into([[bytearray(4)], [bytearray(1000)]])      # ended by the refusal
        with pytest.raises(KvtierError, match=r"targets\[0\]\[0\]"):
            engine.get_ahead([k], [1000]).into([[b"read-only"]])
        target = bytearray(1000)
        assert engine.get_into([k], [[target]]) == [Status.HIT] and bytes(target) == value

    # ------------------------------------------------------------------ bad arguments
    def test_bad_arguments_raise_before_anything_moves(self, engine, keys):
        k, other = keys(2)
        with pytest.raises(KvtierError, match="keys"):
            engine.exists(k)                              # a str, not a list
        with pytest.raises(KvtierError, match=r"keys\[1\]"):
            engine.exists([k, ""])
        with pytest.raises(KvtierError, match=r"keys\[0\]"):
            engine.put_from([b"bytes-key"], [[b"x"]])
        with pytest.raises(KvtierError, match="sources"):
            engine.put_from([k, other], [[b"x"]])         # one source for two keys
        with pytest.raises(KvtierError, match=r"sources\[0\]"):
            engine.put_from([k], [[]])
        with pytest.raises(KvtierError, match=r"sources\[0\]\[1\]"):
            engine.put_from([k], [[b"x", 12]])
        with pytest.raises(KvtierError, match=r"targets\[0\]\[0\]"):
            engine.get_into([k], [[b"read-only"]])
        np = pytest.importorskip("numpy")
        strided = np.zeros(64, np.uint8)[::2]
        with pytest.raises(KvtierError, match=r"targets\[0\]\[0\]"):
            engine.get_into([k], [[strided]])
        with pytest.raises(KvtierError, match="targets"):
            engine.get_into([k], [bytearray(4)])          # buffers, not a list of buffers
        # byte memoryviews pass as they are only where they are fit to
        with pytest.raises(KvtierError, match=r"targets\[0\]\[1\]=.*read-only"):
            engine.get_into([k], [[memoryview(bytearray(2)), memoryview(b"ro")]])
        with pytest.raises(KvtierError, match=r"targets\[0\]\[0\]=.*non-contiguous"):
            engine.get_into([k], [[memoryview(bytearray(64))[::2]]])
        # A put refused for its second key moved nothing for its first.
        with pytest.raises(KvtierError):
            engine.put_from([k, other], [[b"first"], [object()]])
        assert engine.exists([k, other]) == [Status.MISS, Status.MISS]

    # ------------------------------------------------------------------ threads
    def test_threads_at_once(self, engine, keys):
        """Writers and readers on one engine at once (HiCache's backup and prefetch
        threads): every read is a HIT of the object its key was last written with."""
        n_threads, per = 4, 24
        ks = keys(n_threads * per)
        values = {k: _random(2048 + 64 * (i % 7), 1000 + i) for i, k in enumerate(ks)}
        errors = []
        start = threading.Barrier(n_threads)

        def work(t):
            try:
                mine = ks[t * per:(t + 1) * per]
                start.wait()
                for i in range(0, per, 4):
                    batch = mine[i:i + 4]
                    assert engine.put_from(batch, [[values[k]] for k in batch]) == [Status.HIT] * len(batch)
                    got = [bytearray(len(values[k])) for k in batch]
                    assert engine.get_into(batch, [[g] for g in got]) == [Status.HIT] * len(batch)
                    assert all(g == values[k] for g, k in zip(got, batch))
                    assert engine.exists(batch) == [Status.HIT] * len(batch)
            except BaseException as e:      # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not any(th.is_alive() for th in threads), "a thread did not finish"
        assert not errors, errors[0]

    def test_same_key_written_and_read_at_once(self, engine, keys):
        """A reader racing a writer of one key sees one whole object or the other
        (never a mix): each value is one repeated byte."""
        (k,) = keys(1)
        size = 256 * 1024
        values = [bytes([b]) * size for b in (1, 2)]
        engine.put_from([k], [[values[0]]])
        stop = threading.Event()
        errors = []

        def writer():
            i = 0
            while not stop.is_set():
                engine.put_from([k], [[values[i % 2]]])
                i += 1

        th = threading.Thread(target=writer)
        th.start()
        try:
            for _ in range(50):
                got = bytearray(size)
                s = engine.get_into([k], [_split(got, [size // 3])])
                if s == [Status.HIT] and got not in values:
                    errors.append(sorted(set(got)))
        finally:
            stop.set()
            th.join(timeout=60)
        assert not errors, f"a read saw a mix of two writes: bytes {errors[0]}"

    # ------------------------------------------------------------------ counters, close
    def test_stats_count_each_outcome(self, engine, keys):
        a, b = keys(2)
        before = dict(engine.stats)
        engine.put_from([a], [[b"abc"]])
        engine.get_into([a, b], [[bytearray(3)], [bytearray(3)]])
        engine.exists([a, b])
        grew = lambda name: engine.stats[name] - before.get(name, 0)   # noqa: E731
        assert grew("put.hit") == 1
        assert grew("get.hit") == 1 and grew("get.miss") == 1
        assert grew("exists.hit") == 1 and grew("exists.miss") == 1

    def test_closed_engine_returns_error(self, open_engine, keys):
        e = open_engine()
        (k,) = keys(1)
        e.close()
        assert e.exists([k]) == [Status.ERROR]
        assert e.get_into([k], [[bytearray(4)]]) == [Status.ERROR]
        assert e.put_from([k], [[b"abcd"]]) == [Status.ERROR]
        e.close()           # twice is fine

    def test_repr_names_the_url(self, engine):
        assert engine.url in repr(engine)


    # ------------------------------------------------------------------ raw calls
    def test_raw_calls_move_their_values(self, engine):
        raw = engine.raw_calls(5000, 3)
        try:
            assert raw.how
            for _ in range(2):                  # each set writes new keys, get reads them back
                raw.set()
                for t in raw.targets:
                    t[:] = bytes(len(t))
                raw.get()
                assert [bytes(t) for t in raw.targets] == [bytes(s) for s in raw.sources]
                assert len(set(bytes(s) for s in raw.sources)) == 3       # a buffer per value
            raw.clear()
            with pytest.raises(RuntimeError):   # its keys are gone
                raw.get()
        finally:
            raw.close()
        for bad, arg in (((0, 3), "value_bytes"), ((10, True), "count")):
            with pytest.raises(KvtierError, match=arg):
                engine.raw_calls(*bad)
