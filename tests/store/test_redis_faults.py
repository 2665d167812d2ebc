"""Faults of Redis servers become statuses, within the timeout, never exceptions: a node
that hangs (SIGSTOP) or dies (SIGKILL), a cluster master that hangs while the other
shards serve on, a master killed mid-loop (acknowledged writes survive, service resumes
after the failover), a replica that stops acknowledging, and a server that breaks the
protocol. Each test runs servers of its own (`redis_servers`)."""
from __future__ import annotations

import logging
import signal
import socket
import threading
import time
import uuid

import numpy as np
import pytest

from kvtier.store import Status, open_store
from kvtier.store.redis import key_slot
from redis_support import call, masters_by_slot
from redis_support import redis_servers, redis_url  # noqa: F401  (fixtures: servers of the test's own, the shared node)

T = 0.5     # the engines' timeout here, seconds


def fresh_keys(n: int) -> list:
    prefix = f"kvtier-fault/{uuid.uuid4().hex}/"
    return [f"{prefix}{i}" for i in range(n)]


def values(n: int, size: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def timed(fn, *args):
    t = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t


def warnings_of(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "kvtier" and r.levelno == logging.WARNING]


def test_node_hung_then_killed_then_back(redis_servers, caplog):   
    port = redis_servers.node()
    e = open_store(f"redis://127.0.0.1:{port}", timeout_ms=int(T * 1000))
    keys, vals = fresh_keys(6), values(6, 50_000, 1)
    assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * 6
    targets = [[bytearray(50_000)] for _ in keys]
    calls = [("get", lambda: e.get_into(keys, targets)), ("put", lambda: e.put_from(keys, [[v] for v in vals])),
             ("get_ahead", lambda: e.get_ahead(keys, [50_000] * 6).into(targets)),
             ("exists", lambda: e.exists(keys)), ("delete", lambda: e.delete(keys))]
    caplog.set_level(logging.WARNING, logger="kvtier")

    redis_servers.signal(port, signal.SIGSTOP)
    try:
        for name, fn in calls * 2:
            out, took = timed(fn)
            assert out == [Status.TIMEOUT] * 6, name
            assert took < 2 * T, (name, took)
    finally:
        redis_servers.signal(port, signal.SIGCONT)
    assert e.stats["get.timeout"] == 24 and e.stats["put.timeout"] == 12
    time.sleep(T)                                    # past the hold on the node
    got = [[bytearray(50_000)] for _ in keys]
    assert e.get_into(keys, got) == [Status.HIT] * 6
    assert [bytes(g[0]) for g in got] == vals

    redis_servers.kill(port)
    for name, fn in calls * 2:
        out, took = timed(fn)
        assert out == [Status.ERROR] * 6, name
        assert took < T, (name, took)
    assert e.stats["get.error"] == 24

    # Each failure mode was one WARNING, however often it happened.
    said = warnings_of(caplog)
    assert len(said) == len(set(said)), said
    assert any("TIMEOUT" in w for w in said) and any("ERROR" in w for w in said)

    # The node comes back (empty: nothing is persisted): the engine reconnects.
    redis_servers._script("node", redis_servers.dir, str(port))
    assert e.exists(keys) == [Status.MISS] * 6
    assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * 6
    e.close()


def test_cluster_master_hung_other_shards_serve(redis_servers):   
    ports = redis_servers.cluster(3, 0)
    e = open_store(f"redis+cluster://127.0.0.1:{ports[0]}", timeout_ms=int(T * 1000))
    shards = masters_by_slot(ports[0])
    victim = shards[1][2]
    owner = lambda k: next(m for lo, hi, m, _ in shards if lo <= key_slot(k.encode()) <= hi)   # noqa: E731
    keys, vals = fresh_keys(60), values(60, 20_000, 2)
    assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * 60
    on_victim = [owner(k) == victim for k in keys]
    assert 0 < sum(on_victim) < 60

    redis_servers.signal(victim, signal.SIGSTOP)
    try:
        for _ in range(2):                           # the second call finds the node held
            got = [[bytearray(20_000)] for _ in keys]
            out, took = timed(e.get_into, keys, got)
            assert took < 2 * T
            for i, k in enumerate(keys):
                if on_victim[i]:
                    assert out[i] is Status.TIMEOUT
                else:
                    assert out[i] is Status.HIT and bytes(got[i][0]) == vals[i]
            out, took = timed(e.put_from, keys, [[v] for v in vals])
            assert took < 2 * T
            assert out == [Status.TIMEOUT if v else Status.HIT for v in on_victim]
            out, took = timed(e.exists, keys)
            assert took < 2 * T
            assert out == [Status.TIMEOUT if v else Status.HIT for v in on_victim]
    finally:
        redis_servers.signal(victim, signal.SIGCONT)

    deadline = time.monotonic() + 10
    while e.exists(keys) != [Status.HIT] * 60:
        assert time.monotonic() < deadline, "the node's keys did not come back"
        time.sleep(0.1)
    e.close()


def test_cluster_master_killed_mid_loop(redis_servers, capsys):   
    """Writes acknowledged before a master's SIGKILL survive it (each waited for the
    replica); reads of its shard resume within 5 s of the replica's promotion; no call
    takes more than twice the timeout; once the shard has no replica, writes go on; a
    replica that stops acknowledging turns its shard's writes into TIMEOUT."""
    ports = redis_servers.cluster(3, 1)
    timeout = 1.0
    e = open_store(f"redis+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", timeout_ms=1000)
    shards = masters_by_slot(ports[0])
    victim, (promoted,) = shards[0][2], shards[0][3]
    on_victim = lambda k: shards[0][0] <= key_slot(k.encode()) <= shards[0][1]   # noqa: E731

    acked = {}                  # key -> value, for every write acknowledged
    longest = 0.0
    t_kill = t_promoted = t_resumed = None
    rng = np.random.default_rng(3)
    start = time.monotonic()
    for step in range(10_000):
        assert time.monotonic() - start < 40, "no resumption after the failover"
        if step == 5:
            redis_servers.kill(victim)
            t_kill = time.monotonic()
        keys = fresh_keys(12)
        vals = [rng.integers(0, 256, 16_384, dtype=np.uint8).tobytes() for _ in keys]
        out, took = timed(e.put_from, keys, [[v] for v in vals])
        longest = max(longest, took)
        acked.update((k, v) for k, v, s in zip(keys, vals, out) if s is Status.HIT)
        # read back this step's writes and the last acknowledged ones of the victim's shard
        old = [k for k in list(acked)[-200:] if on_victim(k)][-12:]
        rk = keys + old
        got = [[bytearray(16_384)] for _ in rk]
        out, took = timed(e.get_into, rk, got)
        longest = max(longest, took)
        for k, s, g in zip(rk, out, got):
            if s is Status.HIT:
                assert bytes(g[0]) == acked[k]
        if t_kill is None:
            assert set(out) == {Status.HIT}
            continue
        if t_promoted is None and call(promoted, "ROLE")[0] == b"master":
            t_promoted = time.monotonic()
        if t_resumed is None and any(on_victim(k) and s is Status.HIT for k, s in zip(rk, out)):
            t_resumed = time.monotonic()
        if t_resumed and time.monotonic() - t_resumed > 0.5:
            break
    t_promoted = t_promoted or t_resumed
    with capsys.disabled():
        print(f"\n  failover: promoted {t_promoted - t_kill:.2f} s after the kill, reads of the shard "
              f"resumed {t_resumed - t_kill:.2f} s after it; longest call {longest:.2f} s")
    assert t_resumed - t_promoted <= 5.0
    assert longest <= 2 * timeout

    # Every acknowledged write survived, byte for byte.
    keys = list(acked)
    got = [[bytearray(16_384)] for _ in keys]
    assert e.get_into(keys, got) == [Status.HIT] * len(keys)
    assert all(bytes(g[0]) == acked[k] for k, g in zip(keys, got))
    assert sum(on_victim(k) for k in keys) > 0

    # The promoted master has no replica: its writes go on without waiting.
    keys = [k for k in fresh_keys(40) if on_victim(k)]
    assert e.put_from(keys, [[b"x" * 100] for _ in keys]) == [Status.HIT] * len(keys)

    # A replica that stops acknowledging: its master's writes are not confirmed.
    lo, hi, master, (replica,) = shards[1]
    keys = [k for k in fresh_keys(40) if lo <= key_slot(k.encode()) <= hi]
    redis_servers.signal(replica, signal.SIGSTOP)
    try:
        out, took = timed(e.put_from, keys, [[b"y" * 100] for _ in keys])
        assert out == [Status.TIMEOUT] * len(keys)
        assert took <= 2 * timeout
    finally:
        redis_servers.signal(replica, signal.SIGCONT)
    e.close()


def _role_calls(port: int) -> int:
    stats = call(port, "INFO", "commandstats").decode()
    line = next((l for l in stats.splitlines() if l.startswith("cmdstat_role:")), "")
    return int(line.split("calls=")[1].split(",")[0]) if line else 0


def _replicas_of(port: int) -> int:
    role = call(port, "ROLE")
    return len(role[2]) if role[0] == b"master" else -1


def test_writes_go_by_a_recent_role_and_see_replicas_come_and_go(redis_servers):
    """A write asks its node's ROLE at most once per `ROLE_EVERY` (in its pipeline): a
    replica that attaches is waited for from the first write after that; a replica that
    stops acknowledging makes its writes TIMEOUT, and once it is gone the next writes are
    HIT again without waiting (an unanswered WAIT makes the next write ask again)."""
    from kvtier.store.redis import ROLE_EVERY
    master = redis_servers.node()
    e = open_store(f"redis://127.0.0.1:{master}", timeout_ms=int(T * 1000))
    try:
        before = _role_calls(master)
        for _ in range(20):
            assert e.put_from(fresh_keys(2), [[b"v"]] * 2) == [Status.HIT] * 2
        assert 1 <= _role_calls(master) - before <= 3         # not one a call
        assert e.get_into(fresh_keys(1), [[bytearray(1)]]) == [Status.MISS]     # reads ask none

        replica = redis_servers.node("--replicaof", "127.0.0.1", str(master))
        deadline = time.monotonic() + 10
        while _replicas_of(master) < 1 or call(replica, "ROLE")[3] != b"connected":
            assert time.monotonic() < deadline, "the replica did not connect"
            time.sleep(0.05)
        time.sleep(ROLE_EVERY * 1.5)
        redis_servers.signal(replica, signal.SIGSTOP)       # listed, but it acknowledges nothing
        try:
            out, took = timed(e.put_from, fresh_keys(3), [[b"w"]] * 3)
            assert out == [Status.TIMEOUT] * 3 and took <= 2 * T
        finally:
            redis_servers.signal(replica, signal.SIGCONT)
        # it acknowledges again, once it has caught up (a loaded machine may take a few
        # timeouts to run the resumed replica): writes are HIT again, not TIMEOUT for good
        deadline = time.monotonic() + 10
        while (out := e.put_from(fresh_keys(3), [[b"x"]] * 3)) != [Status.HIT] * 3:
            assert set(out) <= {Status.HIT, Status.TIMEOUT} and time.monotonic() < deadline, out

        redis_servers.kill(replica)
        deadline = time.monotonic() + 10
        while _replicas_of(master) != 0:
            assert time.monotonic() < deadline, "the master still lists its replica"
            time.sleep(0.05)
        outs = [e.put_from(fresh_keys(2), [[b"y"]] * 2) for _ in range(3)]
        assert outs[-1] == [Status.HIT] * 2 and set(outs[0]) <= {Status.HIT, Status.TIMEOUT}, outs
    finally:
        e.close()


# ---------------------------------------------------------------------- a broken server
class FakeServer:
    """A TCP server that answers PING (so an engine opens) and then misbehaves on any
    other command as ``reply`` says: bytes to send (then keep the connection open), or
    None to close the connection."""

    def __init__(self, reply):
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._client, args=(c,), daemon=True).start()

    def _client(self, c):
        try:
            while True:
                data = c.recv(65536)
                if not data:
                    return
                if b"PING" in data:
                    c.sendall(b"+PONG\r\n")
                elif self.reply is None:
                    c.close()
                    return
                else:
                    c.sendall(self.reply)
        except OSError:
            return

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("reply,status", [
    (b"$100\r\n" + b"x" * 10, Status.TIMEOUT),         # a value cut off, then silence
    (b"", Status.TIMEOUT),                               # silence
    (b"%3\r\n", Status.ERROR),                           # not RESP2
    (b"$abc\r\n", Status.ERROR),                         # a bad length
    (b"+" + b"y" * 70_000, Status.ERROR),                # a line without end
    (None, Status.ERROR),                                # the connection closed
])
def test_broken_server_gives_statuses_in_time(reply, status):
    server = FakeServer(reply)
    try:
        e = open_store(f"redis://127.0.0.1:{server.port}", timeout_ms=int(T * 1000))
        for fn in (lambda: e.get_into(["a", "b"], [[bytearray(100)], [bytearray(100)]]),
                   lambda: e.get_ahead(["a", "b"], [100, 100]).into([[bytearray(100)], [bytearray(100)]]),
                   lambda: e.exists(["a", "b"])):
            out, took = timed(fn)
            assert out == [status] * 2
            assert took < 2 * T
        e.close()
    finally:
        server.close()


def test_cluster_follows_ask_and_moved_while_a_slot_migrates(redis_servers):   
    """A slot moved between masters under the engine: keys already moved are found
    through ASK (and new keys written there), then through MOVED once the slot is the
    other master's; the engine then reloads its slot map and goes there directly."""
    ports = redis_servers.cluster(3, 0)
    e = open_store(f"redis+cluster://127.0.0.1:{ports[0]}", timeout_ms=1000)
    tag = uuid.uuid4().hex
    k1, k2, k3 = (f"{{{tag}}}/{i}" for i in range(3))
    slot = key_slot(k1.encode())
    src = next(m for lo, hi, m, _ in masters_by_slot(ports[0]) if lo <= slot <= hi)
    dst = next(p for p in ports if p != src)
    src_id, dst_id = (call(p, "CLUSTER", "MYID").decode() for p in (src, dst))
    v1, v2, v3 = values(3, 30_000, 4)
    assert e.put_from([k1, k2], [[v1], [v2]]) == [Status.HIT] * 2

    assert call(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id) == "OK"
    assert call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id) == "OK"
    assert call(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", k1) == "OK"
    got = [[bytearray(30_000)], [bytearray(30_000)]]
    assert e.get_into([k1, k2], got) == [Status.HIT] * 2            # k1 via ASK, k2 where it was
    assert [bytes(g[0]) for g in got] == [v1, v2]
    asks = e.stats["cluster.ask"]
    got = [[bytearray(30_000)], [bytearray(30_000)]]                 # the GETs sent ahead, k1 answered ASK
    assert e.get_ahead([k1, k2], [30_000] * 2).into(got) == [Status.HIT] * 2
    assert [bytes(g[0]) for g in got] == [v1, v2] and e.stats["cluster.ask"] == asks + 1
    filled = []
    assert e.put_from([k3], [[v3]], filled.append) == [Status.HIT]  # a new key: ASK to the importer
    assert filled == [0]                                            # filled once, not again on the retry
    assert call(dst, "EXISTS", k3, asking=True) == 1 and call(src, "EXISTS", k3) != 1
    assert e.stats["cluster.ask"] >= 2

    assert call(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", k2) == "OK"
    for p in ports:
        assert call(p, "CLUSTER", "SETSLOT", slot, "NODE", dst_id) == "OK"
    got = [[bytearray(30_000)] for _ in range(3)]
    assert e.get_ahead([k1, k2, k3], [30_000] * 3).into(got) == [Status.HIT] * 3     # through MOVED
    assert [bytes(g[0]) for g in got] == [v1, v2, v3]
    moved = e.stats["cluster.moved"]
    assert moved >= 1
    time.sleep(0.15)                                                 # past the reload interval
    assert e.exists([k1, k2, k3]) == [Status.HIT] * 3
    assert e.exists([k1, k2, k3]) == [Status.HIT] * 3
    assert e.stats["cluster.moved"] == moved                         # the reloaded map is right
    e.close()


def test_an_exception_in_the_engine_is_error_and_drops_the_connection(redis_url, monkeypatch, caplog):
    """A failure of the engine's own code mid-pipeline (not the server's): ERROR for the
    keys, one WARNING, and the half-read connection is not used again."""
    from kvtier.store import redis_ops
    e = open_store(redis_url + "?connections=1")
    keys, vals = fresh_keys(4), values(4, 10_000, 5)
    assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * 4
    real = redis_ops.get_into

    def breaks(conn, items, out, deadline, errors):
        conn.read_line = lambda *a, **k: (_ for _ in ()).throw(ValueError("broken on purpose"))
        real(conn, items, out, deadline, errors)

    monkeypatch.setattr(redis_ops, "get_into", breaks)
    caplog.set_level(logging.WARNING, logger="kvtier")
    for _ in range(2):
        assert e.get_into(keys, [[bytearray(10_000)] for _ in keys]) == [Status.ERROR] * 4
    assert sum("broken on purpose" in m for m in warnings_of(caplog)) == 1
    monkeypatch.setattr(redis_ops, "get_into", real)
    got = [[bytearray(10_000)] for _ in keys]
    assert e.get_into(keys, got) == [Status.HIT] * 4
    assert [bytes(g[0]) for g in got] == vals
    e.close()
