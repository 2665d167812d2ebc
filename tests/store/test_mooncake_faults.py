"""The Mooncake engine when its store fails: a master killed (SIGKILL) or hung (SIGSTOP),
a store node hung, a store with no memory. Each test starts a throwaway master (and
store node) on free 127.0.0.1 ports and stops it by pid. Every call returns a status
per key within twice the timeout, never raises, and a read the store answers late never
writes into the caller's buffer."""
from __future__ import annotations

import signal
import time
import uuid

import numpy as np
import pytest

from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from mooncake_support import ThrowawayStore

TIMEOUT_MS = 500
BOUND_S = 2 * TIMEOUT_MS / 1000
POISON = 0xA5


@pytest.fixture
def cluster(tmp_path):
    store = ThrowawayStore(str(tmp_path))
    yield store
    store.stop()


def _keys(n):
    prefix = f"kvtier-fault/{uuid.uuid4().hex}/"
    return [f"{prefix}{i}" for i in range(n)]


def _timed(call):
    t = time.monotonic()
    out = call()
    return out, time.monotonic() - t


def _written(engine, n=4, size=200_000):
    ks = _keys(n)
    values = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n)]
    assert engine.put_from(ks, [[memoryview(v)] for v in values]) == [Status.HIT] * n
    return ks, values


def _each_call(engine, ks, size):
    """Every engine call on ``ks`` once: (name, statuses, seconds, the read's target)."""
    target = np.full(size, POISON, np.uint8)
    fresh = np.random.default_rng(99).integers(0, 256, size, dtype=np.uint8)
    calls = [
        ("exists", lambda: engine.exists(ks)),
        ("get", lambda: engine.get_into(ks[:1], [[memoryview(target[:64]), memoryview(target[64:])]])),
        ("put", lambda: engine.put_from(_keys(1), [[memoryview(fresh)]])),
        ("delete", lambda: engine.delete(ks[1:2])),
    ]
    results = []
    for name, call in calls:
        out, took = _timed(call)
        results.append((name, out, took))
    return results, target


@pytest.mark.parametrize("transfer", ["staged", "direct"])
def test_killed_master(cluster, transfer):
    engine = open_store(f"{cluster.url}?transfer={transfer}", timeout_ms=TIMEOUT_MS)
    ks, _ = _written(engine)
    cluster.master.signal(signal.SIGKILL)
    cluster.master.proc.wait(5)
    results, target = _each_call(engine, ks, 200_000)
    for name, out, took in results:
        assert all(s in (Status.ERROR, Status.TIMEOUT) for s in out), (name, out)
        assert took <= BOUND_S, (name, took)
    assert (target == POISON).all()
    assert engine.stats["get.hit"] == 0
    engine.close()


def test_hung_master_then_resumed(cluster):
    """SIGSTOP: every call is TIMEOUT within the bound. After SIGCONT the master answers
    the calls it held, late: the staged read lands in its staging region, never in the
    caller's buffer; then the engine serves again."""
    engine = open_store(cluster.url, timeout_ms=TIMEOUT_MS)
    ks, values = _written(engine)
    cluster.master.signal(signal.SIGSTOP)
    results, target = _each_call(engine, ks, 200_000)
    for name, out, took in results:
        assert out == [Status.TIMEOUT] * len(out), (name, out)
        assert took <= BOUND_S, (name, took)
    assert engine.stats["get.unanswered_calls"] == 1
    cluster.master.signal(signal.SIGCONT)
    for _ in range(200):                        # the held calls return
        if engine._workers.in_flight == 0:
            break
        time.sleep(0.05)
    assert engine._workers.in_flight == 0
    assert (target == POISON).all()             # the late answer did not land here
    got = np.zeros(200_000, np.uint8)
    assert engine.get_into(ks[2:3], [[memoryview(got)]]) == [Status.HIT]
    assert np.array_equal(got, values[2])
    engine.close()


def test_hung_store_node(cluster):
    """SIGSTOP of the node holding the objects: the master answers, the transfer does
    not; reads and writes are TIMEOUT within the bound."""
    engine = open_store(cluster.url, timeout_ms=TIMEOUT_MS)
    ks, values = _written(engine)
    cluster.node.signal(signal.SIGSTOP)
    try:
        target = np.full(200_000, POISON, np.uint8)
        out, took = _timed(lambda: engine.get_into(ks[:1], [[memoryview(target)]]))
        assert out == [Status.TIMEOUT] and took <= BOUND_S
        fresh = np.ones(200_000, np.uint8)
        out, took = _timed(lambda: engine.put_from(_keys(1), [[memoryview(fresh)]]))
        assert out == [Status.TIMEOUT] and took <= BOUND_S
    finally:
        cluster.node.signal(signal.SIGCONT)
    for _ in range(200):
        if engine._workers.in_flight == 0:
            break
        time.sleep(0.05)
    assert (target == POISON).all()
    got = np.zeros(200_000, np.uint8)
    assert engine.get_into(ks[1:2], [[memoryview(got)]]) == [Status.HIT]
    assert np.array_equal(got, values[1])
    engine.close()


def test_construction_against_a_hung_master_fails_at_once(cluster):
    cluster.master.signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(KvtierError, match=rf"url='{cluster.url}'.*does not answer"):
            open_store(cluster.url, timeout_ms=TIMEOUT_MS)
        assert time.monotonic() - t <= 2 * 1.0     # the probe waits at least 1 s
    finally:
        cluster.master.signal(signal.SIGCONT)


def test_store_without_memory(tmp_path):
    """A master with no store node: construction fails naming the URL, unless the
    engine lends memory itself (segment=)."""
    bare = ThrowawayStore(str(tmp_path), store_node=False)
    try:
        with pytest.raises(KvtierError, match=rf"url='{bare.url}'.*could not be stored"):
            open_store(bare.url, timeout_ms=TIMEOUT_MS)
        engine = open_store(f"{bare.url}?segment=32M", timeout_ms=TIMEOUT_MS)
        ks, values = _written(engine, n=2)
        got = np.zeros(200_000, np.uint8)
        assert engine.get_into(ks[:1], [[memoryview(got)]]) == [Status.HIT]
        assert np.array_equal(got, values[0])
        engine.close()
    finally:
        bare.stop()
