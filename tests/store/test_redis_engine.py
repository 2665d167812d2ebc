"""The Redis engines on a live node and a live 3+3 cluster: the engine contract, page-sized
objects through scatter/gather buffers, pipelines longer than one window, slots, the
damage helpers the page layer's tests use, and the raw redis-benchmark figures."""
from __future__ import annotations

import logging
import random
import threading
import time
import uuid

import numpy as np
import pytest
import torch

from engine_conformance import EngineConformance
from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store import redis_ops
from kvtier.store.redis import SPREAD_BYTES, RedisClusterEngine, RedisEngine, key_slot
from redis_support import call, flip_byte, raw_get, swap, truncate
from redis_support import redis_cluster_url, redis_url  # noqa: F401  (fixtures: the shared servers)

STORES = ["node", "cluster"]


@pytest.fixture(params=STORES)
def url(request, redis_url, redis_cluster_url):     
    return redis_url if request.param == "node" else redis_cluster_url


@pytest.fixture
def engine(url):
    e = open_store(url)
    yield e
    e.close()


def fresh_keys(n: int, tag: str = "") -> list:
    prefix = f"kvtier-test/{uuid.uuid4().hex}/{tag}"
    return [f"{prefix}{i}" for i in range(n)]


class TestRedisNodeContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, redis_url):                
        return lambda: open_store(redis_url)


class TestRedisClusterContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, redis_cluster_url):        
        return lambda: open_store(redis_cluster_url)


def test_schemes_pick_the_engines(redis_url, redis_cluster_url):  
    for url, cls in ((redis_url, RedisEngine), (redis_url.replace("redis://", "valkey://"), RedisEngine),
                     (redis_cluster_url, RedisClusterEngine),
                     (redis_cluster_url.replace("redis+cluster://", "valkey+cluster://"), RedisClusterEngine)):
        e = open_store(url)
        try:
            assert type(e) is cls
            (k,) = fresh_keys(1)
            assert e.put_from([k], [[b"abc"]]) == [Status.HIT]
            got = bytearray(3)
            assert e.get_into([k], [[got]]) == [Status.HIT] and got == b"abc"
        finally:
            e.close()


class Arena:
    """Host memory laid out as a layer-first pool: [layers, 2 (K, V), pages, row bytes].
    A page's object is its 2 * layers rows, gathered in (layer, K/V) order: 64 pieces a
    page, none adjacent to the next, as a layer_first host pool hands them over."""

    def __init__(self, pages: int, page_bytes: int, layers: int = 32, fill: int = -1):
        self.layers, self.rows = layers, page_bytes // (2 * layers)
        shape = (layers, 2, pages, self.rows)
        if fill < 0:
            self.t = torch.randint(0, 256, shape, dtype=torch.uint8)
        else:
            self.t = torch.full(shape, fill, dtype=torch.uint8)

    def pieces(self, page: int) -> list:
        return [memoryview(self.t[l, c, page].numpy()) for l in range(self.layers) for c in (0, 1)]

    def page(self, page: int) -> torch.Tensor:
        return self.t[:, :, page].clone()


@pytest.mark.parametrize("page_bytes", [64 << 10, 256 << 10, 1 << 20])
def test_page_objects_round_trip_between_pages(engine, page_bytes):
    """Pages written from one arena read back byte-exact into other pages of another; a
    MISS and a CORRUPT in the same batch leave their pages as they were, and no byte
    outside the pages read changes. The batch is longer than one pipeline window."""
    n = max(4, (24 << 20) // page_bytes // 2)
    src = Arena(n, page_bytes)
    dst = Arena(n + 3, page_bytes, fill=0x5A)
    keys = fresh_keys(n)
    assert engine.put_from(keys, [src.pieces(p) for p in range(n)]) == [Status.HIT] * n
    before = dst.t.clone()
    missing = fresh_keys(1, "missing")[0]
    short = fresh_keys(1, "short")[0]
    assert engine.put_from([short], [[b"x" * (page_bytes - 1)]]) == [Status.HIT]
    order = list(range(n))
    random.Random(page_bytes).shuffle(order)
    # key i -> destination page order[i] + 3; pages 0..2 get the miss, the corrupt, nothing
    read_keys = [missing, short] + [keys[i] for i in range(n)]
    targets = [dst.pieces(0), dst.pieces(1)] + [dst.pieces(order[i] + 3) for i in range(n)]
    out = engine.get_into(read_keys, targets)
    assert out == [Status.MISS, Status.CORRUPT] + [Status.HIT] * n
    for i in range(n):
        assert torch.equal(dst.page(order[i] + 3), src.page(i)), f"page {i}"
    assert torch.equal(dst.t[:, :, :3], before[:, :, :3])       # miss and corrupt: untouched
    assert engine.exists(read_keys) == [Status.MISS] + [Status.HIT] * (n + 1)


def test_many_small_objects_with_misses(engine):
    """More keys than one window holds, every third one absent: statuses stay in order."""
    n = 3 * redis_ops.WINDOW_KEYS + 17
    keys = fresh_keys(n)
    rng = np.random.default_rng(5)
    values = [rng.integers(0, 256, 100 + i % 50, dtype=np.uint8).tobytes() for i in range(n)]
    written = [i for i in range(n) if i % 3]
    assert engine.put_from([keys[i] for i in written], [[values[i]] for i in written]) == [Status.HIT] * len(written)
    targets = [bytearray(b"\xee" * len(v)) for v in values]
    out = engine.get_into(keys, [[t] for t in targets])
    for i in range(n):
        if i % 3:
            assert out[i] is Status.HIT and targets[i] == values[i], i
        else:
            assert out[i] is Status.MISS and targets[i] == b"\xee" * len(values[i]), i
    assert engine.exists(keys) == [Status.HIT if i % 3 else Status.MISS for i in range(n)]
    assert engine.delete(keys) == [Status.HIT] * n
    assert engine.exists(keys) == [Status.MISS] * n


@pytest.mark.parametrize("connections", [1, 3])
def test_connections_option(url, connections):
    e = open_store(f"{url}?connections={connections}")
    try:
        keys = fresh_keys(10)
        values = [np.random.default_rng(i).integers(0, 256, 70_000, dtype=np.uint8) for i in range(10)]
        assert e.put_from(keys, [[v] for v in values]) == [Status.HIT] * 10
        got = [np.zeros_like(v) for v in values]
        assert e.get_into(keys, [[g] for g in got]) == [Status.HIT] * 10
        assert all(np.array_equal(g, v) for g, v in zip(got, values))
    finally:
        e.close()


@pytest.mark.parametrize("connections", [1, 4, 9])
def test_a_call_uses_its_connections_in_all(redis_url, redis_cluster_url, connections):
    """``connections`` is the call's, shared by the nodes it reaches in proportion to
    their keys (at least one each, never more than their keys): one node takes them
    all, a 3-master cluster about a third each (values enough for each connection to
    carry `SPREAD_BYTES`)."""
    value = b"v" * (SPREAD_BYTES * 9 // 60 + 1)
    for url, masters in ((redis_url, 1), (redis_cluster_url, 3)):
        e = open_store(f"{url}?connections={connections}")
        used, real = [], e._task
        e._task = lambda op, node, idxs, *rest: (used.append((node, len(idxs))), real(op, node, idxs, *rest))
        try:
            keys = fresh_keys(60)
            assert e.put_from(keys, [[value]] * 60) == [Status.HIT] * 60
            per_node = {}
            for node, n in used:
                per_node.setdefault(node, []).append(n)
            assert len(per_node) == masters and sum(sum(v) for v in per_node.values()) == 60
            keys_of = {node: sum(v) for node, v in per_node.items()}
            for node, stripes in per_node.items():
                assert len(stripes) == max(1, round(connections * keys_of[node] / 60)), (node, stripes)
            assert len(used) <= connections + masters - 1
            assert e.delete(keys) == [Status.HIT] * 60
        finally:
            e.close()


@pytest.mark.parametrize("pages,stripes", [(1, 1), (4, 1), (8, 1), (9, 2), (16, 2), (40, 4), (128, 4)])
def test_a_small_call_runs_on_one_connection_on_the_calling_thread(redis_url, pages, stripes):
    """A node's keys spread over another connection only for each `SPREAD_BYTES` of their
    values: a call of a few pages (or of keys alone) is one connection, on the calling
    thread, and the engine makes no thread for it."""
    e = open_store(f"{redis_url}?connections=4")
    used, real = [], e._task
    e._task = lambda op, node, idxs, *rest: (used.append(threading.get_ident()), real(op, node, idxs, *rest))
    try:
        keys = fresh_keys(pages)
        value = bytearray(256 << 10)
        assert e.put_from(keys, [[value]] * pages) == [Status.HIT] * pages
        assert len(used) == stripes
        assert e.get_into(keys, [[bytearray(256 << 10)] for _ in keys]) == [Status.HIT] * pages
        assert e.exists(keys) == [Status.HIT] * pages and e.delete(keys) == [Status.HIT] * pages
        assert len(used) == 2 * stripes + 2             # keys alone: one connection
        assert threading.get_ident() in used[:stripes] and (e._pool is None) == (stripes == 1)
    finally:
        e.close()


@pytest.mark.parametrize("pages", [1, 4, 9])
def test_get_ahead_sends_each_connection_s_first_window_at_once(url, pages, monkeypatch):
    """`get_ahead` groups a call's keys as the call does (by node, then over its
    connections: one per `SPREAD_BYTES` of a node's values, so nine values of 256 KiB
    take two) and sends each connection's first pipeline window of GETs there and then
    (`redis_ops.WINDOW_BYTES`: two such values): those values read even when removed
    before `into`, which sends the rest (read as misses once removed)."""
    e = open_store(f"{url}?connections=4")
    size = 256 << 10
    tag = uuid.uuid4().hex
    calls = [fresh_keys(pages, f"{{{tag}}}/")]                      # one slot: one node
    if e.cluster:
        calls.append(fresh_keys(pages))                             # any slots: several masters
    sent, real = [], redis_ops.send_gets

    def spy(conn, items, deadline):           # the keys of the window it sends
        lo, hi = next(redis_ops._windows(items))
        sent.append([it.key.decode() for it in items[lo:hi]])
        real(conn, items, deadline)
    monkeypatch.setattr(redis_ops, "send_gets", spy)
    gen = np.random.default_rng(pages)
    try:
        for keys in calls:
            values = [gen.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in keys]
            assert e.put_from(keys, [[v] for v in values]) == [Status.HIT] * pages
            sent.clear()
            pending = e.get_ahead(keys, [size] * pages)
            assert e.delete(keys) == [Status.HIT] * pages
            by_node: dict = {}
            for k in keys:
                by_node.setdefault(e._master_of(k.encode()), []).append(k)
            stripes = 2 if pages == 9 and len(by_node) == 1 else 1
            want = [ks[s::stripes][:2] for ks in by_node.values() for s in range(stripes)]
            assert sorted(sent) == sorted(want)
            early = {k for ks in sent for k in ks}
            targets = [bytearray(size) for _ in keys]
            assert pending.into([[t] for t in targets]) == [Status.HIT if k in early else Status.MISS for k in keys]
            for k, t, v in zip(keys, targets, values):
                assert bytes(t) == (v if k in early else bytes(size))
    finally:
        e.close()


def test_a_broken_connection_after_get_ahead_is_a_status(redis_url, caplog):
    """The connection `get_ahead` sent on, broken before `into`: ERROR for its keys,
    one WARNING, and the engine's next calls read on a new connection."""
    e = open_store(redis_url)
    keys = fresh_keys(2)
    value = bytes(range(256)) * 40
    try:
        assert e.put_from(keys, [[value]] * 2) == [Status.HIT] * 2
        pending = e.get_ahead(keys, [len(value)] * 2)
        pending._ahead.tasks[0][2]._sock.close()    # what a reset does to the stream
        caplog.set_level(logging.WARNING, logger="kvtier")
        assert pending.into([[bytearray(len(value))] for _ in keys]) == [Status.ERROR] * 2
        assert len([r for r in caplog.records if "ERROR" in r.getMessage()]) == 1
        for _ in range(2):
            targets = [bytearray(len(value)) for _ in keys]
            assert e.get_ahead(keys, [len(value)] * 2).into([[t] for t in targets]) == [Status.HIT] * 2
            assert targets == [bytearray(value)] * 2
    finally:
        e.delete(keys)
        e.close()


def test_key_slot_matches_the_cluster(redis_cluster_url):    
    port = int(redis_cluster_url.split("//")[1].split(",")[0].split(":")[1])
    rng = random.Random(3)
    keys = ["foo", "", "{}", "{", "}", "foo{}{bar}", "foo{{bar}}zap", "foo{bar}{zap}", "{user1000}.following",
            "a{b}c", "ключ{鍵}", "x" * 1000]
    keys += ["".join(rng.choice("ab{}c/:é") for _ in range(rng.randrange(1, 12))) for _ in range(200)]
    for k in keys:
        assert key_slot(k.encode()) == call(port, "CLUSTER", "KEYSLOT", k), k


def test_cluster_spreads_keys_over_every_master(redis_cluster_url):   
    e = open_store(redis_cluster_url)
    try:
        masters = {e._slots[key_slot(k.encode())] for k in fresh_keys(64)}
        assert len(masters) == 3
    finally:
        e.close()


def test_node_url_on_a_cluster_node_warns_and_errs(redis_cluster_url, caplog): 
    """A cluster node opened as redis://: keys of other nodes' slots are ERROR, with a
    WARNING saying to use redis+cluster://."""
    host_port = redis_cluster_url.split("//")[1].split(",")[0]
    e = open_store(f"redis://{host_port}")
    try:
        with caplog.at_level("WARNING", logger="kvtier"):
            out = e.exists(fresh_keys(30))
        assert Status.ERROR in out and set(out) <= {Status.MISS, Status.ERROR}
        assert any("redis+cluster://" in r.getMessage() for r in caplog.records)
    finally:
        e.close()


# ---------------------------------------------------------------------- damage helpers
def test_damage_helpers(engine, url):
    """flip_byte changes one byte in place (the engine still reads a HIT: content is the
    page layer's to check); truncate makes the object CORRUPT; swap exchanges objects."""
    a, b = fresh_keys(2)
    va, vb = bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)), b"\x07" * 4096
    engine.put_from([a, b], [[va], [vb]])
    old = flip_byte(url, a, 1234)
    assert old == va[1234]
    got = bytearray(4096)
    assert engine.get_into([a], [[got]]) == [Status.HIT]
    assert [i for i in range(4096) if got[i] != va[i]] == [1234] and got[1234] == va[1234] ^ 0xFF
    swap(url, a, b)
    assert raw_get(url, a) == vb and raw_get(url, b) == bytes(got)
    truncate(url, b, 4000)
    assert engine.get_into([b], [[bytearray(4096)]]) == [Status.CORRUPT]
    assert raw_get(url, b) == bytes(got[:4000])


# ---------------------------------------------------------------------- raw figures
def _keys_on_masters(engine) -> int:
    masters = engine._masters if isinstance(engine, RedisClusterEngine) else [engine._server]
    total = 0
    for node in masters:
        conn = node.acquire(time.monotonic() + 5)
        total += conn.call(time.monotonic() + 5, "DBSIZE")
        node.release(conn)
    return total


def test_raw_throughput(engine):
    before = _keys_on_masters(engine)
    raw = engine.raw_throughput(1 << 20, 10)
    assert raw["get_gbps"] > 0 and raw["set_gbps"] > 0
    assert raw["get_rps"] * (1 << 20) / 1e9 == pytest.approx(raw["get_gbps"])
    assert raw["requests"] == 256                     # 256 MiB at least, whatever the count
    assert "redis-benchmark" in raw["how"] and "-d 1048576 -n 256" in raw["how"]
    assert ("--cluster" in raw["how"]) == isinstance(engine, RedisClusterEngine)
    assert "-t set -r 256" in raw["how"] and raw["set_one_key_gbps"] > 0      # SETs of new keys
    # redis-benchmark's keys are gone afterwards (its one GET key and the new keys it made,
    # in a cluster under the hash tag it gave each master)
    assert _keys_on_masters(engine) == before


def test_raw_calls_are_bare_and_leave_nothing_behind(engine):
    before = _keys_on_masters(engine)
    raw = engine.raw_calls(300 << 10, 4)
    try:
        raw.set()
        raw.get()
        assert [bytes(t) for t in raw.targets] == [bytes(s) for s in raw.sources]
        assert "bare pipelined SET / GET" in raw.how
        assert _keys_on_masters(engine) == before + 4
    finally:
        raw.close()
    assert _keys_on_masters(engine) == before
    assert engine.stats["put.hit"] == 0        # not through the engine's calls


def test_raw_throughput_without_redis_benchmark(engine, monkeypatch):
    import shutil
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(KvtierError, match="redis-benchmark.*not on PATH"):
        engine.raw_throughput(4096, 10)
    with pytest.raises(KvtierError, match="value_bytes"):
        engine.raw_throughput(0, 10)


def test_client_comparison_script_runs(redis_url, monkeypatch, capsys):
    """bench/scripts/redis_clients.py: one small round prints a line per client beside
    redis-benchmark (the script checks every byte it reads back itself)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "redis_clients.py"
    spec = importlib.util.spec_from_file_location("redis_clients", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "TOTAL", 2 << 20)
    assert script.main([redis_url, "1", "65536"]) == 0
    out = capsys.readouterr().out
    for name in ("redis-benchmark", "kvtier RESP x1", "kvtier RESP x4"):
        assert name in out
    assert script.main([]) == 2


class _Wire:
    """A connection that records what is sent and answers from a list."""

    def __init__(self, replies):
        self.sent, self.replies = [], list(replies)

    def send(self, parts, deadline):
        self.sent += [bytes(p) for p in parts]

    def read_reply(self, deadline):
        return self.replies.pop(0)


def test_a_value_its_fill_refuses_sends_nothing_not_even_asking():
    """A put whose fill returns False sends no command for its key (no stray ASKING that
    would apply to the next key's SET) and reads no reply for it: ERROR; the others go."""
    wire = _Wire(["OK", "OK"])
    items = [redis_ops.Item(b"a", [memoryview(b"x")], 1, asking=True, fill=lambda i: False),
             redis_ops.Item(b"b", [memoryview(b"y")], 1, fill=lambda i: True),
             redis_ops.Item(b"c", [memoryview(b"z")], 1)]
    out = [None] * 3
    redis_ops.put_from(wire, items, out, float("inf"), redis_ops.ServerErrors())
    assert out == [Status.ERROR, Status.HIT, Status.HIT] and wire.replies == []
    sent = b"".join(wire.sent)
    assert b"ASKING" not in sent and b"\r\na\r\n" not in sent
    assert sent.count(b"SET") == 2 and b"\r\nb\r\n" in sent and b"\r\nc\r\n" in sent


def test_a_calls_items_share_its_one_callable_and_carry_their_index():
    """Each item of a get or put tells the call's one ``landed``/``fill`` its own key
    index (no callable made per key: one more tracked object per key), and the ops call
    it with that index."""
    from kvtier.store.redis import RedisEngine
    views = [[memoryview(bytearray(3))], [memoryview(bytearray(2)), memoryview(bytearray(1))]]
    landed, fill = [].append, (lambda i: i != 0)
    got = RedisEngine._get_items(["a", "b"], views, landed)
    put = RedisEngine._put_items(["a", "b"], views, fill)
    assert [(it.key, it.nbytes, it.index) for it in got] == [(b"a", 3, 0), (b"b", 3, 1)] == \
        [(it.key, it.nbytes, it.index) for it in put]
    assert all(it.landed is landed and it.fill is None for it in got)
    assert all(it.fill is fill and it.landed is None for it in put)
    wire = _Wire(["OK"])
    out = [None] * 2
    redis_ops.put_from(wire, put, out, float("inf"), redis_ops.ServerErrors())
    assert out == [Status.ERROR, Status.HIT]         # fill(0) said no: key a not sent
    assert b"\r\na\r\n" not in b"".join(wire.sent)
