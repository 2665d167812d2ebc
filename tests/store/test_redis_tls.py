"""Redis over TLS (``rediss://``, ``rediss+cluster://``) on live TLS servers: round trips
through the engine and through `StoreTier`, bit-exact; a cluster across its slots and
through MOVED and ASK; a node that requires a client certificate; passwords and ACL
users; certificates that are not trusted or name another host (and verify=none); bad
option values and files; faults after construction as statuses.

The shared servers come from `.ci/redis.sh start` (KVTIER_TEST_REDIS_TLS_*): unset, these
tests skip with one line, and fail in CI. Tests that need a server of their own start it
(`tls_servers`: `Servers.tls_node`, certificates of its own)."""
from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
import threading
import time
import uuid
from urllib.parse import quote

import numpy as np
import pytest
import torch

from engine_conformance import EngineConformance
from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store import redis_ops, resp
from kvtier.store.redis import SLOTS, RedisClusterEngine, RedisEngine, key_slot
from kvtier.store.redis_url import parse
from kvtier.store.tier import StoreTier
from redis_support import call, masters_by_slot, raw_get, tls_context
from redis_support import (redis_servers, redis_tls_auth_url, redis_tls_cluster_url,  # noqa: F401  (fixtures)
                           redis_tls_dir, redis_tls_url)
from store_support import PAGE, assert_pages, host_case, poison, slots


def fresh_keys(n: int, tag: str = "") -> list:
    prefix = f"kvtier-tls/{uuid.uuid4().hex}/{tag}"
    return [f"{prefix}{i}" for i in range(n)]


def values(n: int, size: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size + i, dtype=np.uint8) for i in range(n)]


def port_of(url: str) -> int:
    return parse(url, cluster="+cluster" in url.split("://")[0]).addrs[0][1]


def with_options(url: str, **options) -> str:
    """``url`` with more query options (paths percent-encoded)."""
    extra = "&".join(f"{k}={quote(str(v), safe='/')}" for k, v in options.items())
    return f"{url}{'&' if '?' in url else '?'}{extra}"


def client_cert(tls_dir: str) -> dict:
    return {"cert": os.path.join(tls_dir, "client.crt"), "key": os.path.join(tls_dir, "client.key")}


@pytest.fixture
def tls_servers(redis_tls_dir, redis_servers):
    """Servers of the test's own, where the shared TLS servers run (redis-server has TLS)."""
    return redis_servers


def round_trip(e, n: int = 40, size: int = 70_000, seed: int = 1) -> None:
    """``n`` values (past one pipeline window) written whole and read back in three
    pieces each, bit-exact, beside a miss; then deleted."""
    keys, vals = fresh_keys(n), values(n, size, seed)
    assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * n
    got = [np.zeros_like(v) for v in vals]
    pieces = [[memoryview(g)[:1], memoryview(g)[1:4097], memoryview(g)[4097:]] for g in got]
    (missing,) = fresh_keys(1, "missing")
    assert e.get_into(keys + [missing], pieces + [[bytearray(10)]]) == [Status.HIT] * n + [Status.MISS]
    assert all(np.array_equal(g, v) for g, v in zip(got, vals))
    assert e.delete(keys) == [Status.HIT] * n


# ---------------------------------------------------------------------- round trips
class TestRedisTlsNodeContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, redis_tls_url):
        return lambda: open_store(redis_tls_url)


class TestRedisTlsClusterContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, redis_tls_cluster_url):
        return lambda: open_store(redis_tls_cluster_url)


@pytest.mark.parametrize("connections", [1, 4])
def test_node_and_cluster_round_trips(redis_tls_url, redis_tls_cluster_url, connections):
    for url, cls in ((redis_tls_url, RedisEngine), (redis_tls_cluster_url, RedisClusterEngine)):
        e = open_store(with_options(url, connections=connections))
        try:
            assert type(e) is cls
            round_trip(e, seed=connections)
            # pages of 1 MiB, in 64 pieces each (a layer-first host pool's rows)
            n, size = 12, 1 << 20
            src = torch.randint(0, 256, (n, 64, size // 64), dtype=torch.uint8)
            dst = torch.zeros_like(src)
            keys = fresh_keys(n)
            assert e.put_from(keys, [[memoryview(src[p, r].numpy()) for r in range(64)] for p in range(n)]) \
                == [Status.HIT] * n
            assert e.get_into(keys, [[memoryview(dst[p, r].numpy()) for r in range(64)] for p in range(n)]) \
                == [Status.HIT] * n
            assert torch.equal(src, dst)
        finally:
            e.close()


def test_valkeys_schemes_and_localhost(redis_tls_url, redis_tls_cluster_url):
    """valkeys:// is rediss://; the certificate names localhost too (its DNS name) as
    well as 127.0.0.1 (its IP address), and either passes the host check."""
    for url in (redis_tls_url.replace("rediss://", "valkeys://"),
                redis_tls_cluster_url.replace("rediss+cluster://", "valkeys+cluster://"),
                redis_tls_url.replace("127.0.0.1", "localhost")):
        e = open_store(url)
        try:
            round_trip(e, n=3)
        finally:
            e.close()


@pytest.mark.parametrize("kind", ["mha", "mla_split_indexer"])
def test_store_tier_round_trip(redis_tls_url, redis_tls_cluster_url, kind):
    """Pages through StoreTier on a TLS node and a TLS cluster, back into other pages
    byte for byte; the pages not read stay poison."""
    for url in (redis_tls_url, redis_tls_cluster_url):
        hc = host_case(kind, "page_first")
        host = hc.host
        tier = StoreTier(host, url, model=f"tls-test-{uuid.uuid4().hex}", tp=(0, 1))
        try:
            src, dst = [5, 1, 2, 9], [3, 7, 8, 0]
            keys = [f"p{uuid.uuid4().hex}" for _ in src]
            originals = [host.get_page(p * PAGE).clone() for p in src]
            assert tier.backup(keys, slots(src)) == [True] * 4
            assert tier.exists(keys) == 4
            poison(host)
            assert tier.prefetch(keys, slots(dst)) == 4
            assert_pages(host, dst, originals)
            hc.check_margins()
        finally:
            tier.close()


def test_cluster_spans_its_masters_over_tls(redis_tls_cluster_url, redis_tls_dir):
    """Keys of every master's slots round-trip; the nodes the engine learned from the
    slot map (announced TLS ports) are the masters, and a stale map is put right by
    MOVED to those nodes, over TLS."""
    e = open_store(redis_tls_cluster_url)
    try:
        ranges = masters_by_slot(port_of(redis_tls_cluster_url), tls=tls_context(redis_tls_dir))
        keys = fresh_keys(300)
        owners = {m for lo, hi, m, _ in ranges for k in keys if lo <= key_slot(k.encode()) <= hi}
        assert len(owners) == 3
        assert sorted(n.port for n in e._masters) == sorted(owners)
        vals = values(300, 3000, 7)
        assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * 300
        e._slots = [e._masters[0]] * SLOTS          # a map gone stale: every slot on one master
        e._stale, e._refreshed_at = False, time.monotonic()
        got = [np.zeros_like(v) for v in vals]
        assert e.get_into(keys, [[g] for g in got]) == [Status.HIT] * 300
        assert all(np.array_equal(g, v) for g, v in zip(got, vals))
        assert e.stats["cluster.moved"] > 0
        assert bytes(raw_get(redis_tls_cluster_url, keys[0])) == vals[0].tobytes()
        assert e.delete(keys) == [Status.HIT] * 300
    finally:
        e.close()


def test_cluster_follows_ask_over_tls(tls_servers):
    """A slot migrating between masters of a TLS cluster: a moved key is found through
    ASK on the importing node, then through MOVED once the slot is its."""
    ports = tls_servers.tls_cluster(3, 0)
    ctx = tls_context(tls_servers.tls_dir)
    url = f"rediss+cluster://127.0.0.1:{ports[0]}?ca={quote(tls_servers.tls_dir)}/ca.crt"
    e = open_store(url)
    try:
        tag = uuid.uuid4().hex
        k1, k2 = f"{{{tag}}}/1", f"{{{tag}}}/2"
        slot = key_slot(k1.encode())
        src = next(m for lo, hi, m, _ in masters_by_slot(ports[0], tls=ctx) if lo <= slot <= hi)
        dst = next(p for p in ports if p != src)
        src_id, dst_id = (call(p, "CLUSTER", "MYID", tls=ctx).decode() for p in (src, dst))
        v1, v2 = values(2, 30_000, 4)
        assert e.put_from([k1, k2], [[v1], [v2]]) == [Status.HIT] * 2
        assert call(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id, tls=ctx) == "OK"
        assert call(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id, tls=ctx) == "OK"
        assert call(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", k1, tls=ctx) == "OK"
        got = [np.zeros_like(v1), np.zeros_like(v2)]
        assert e.get_into([k1, k2], [[g] for g in got]) == [Status.HIT] * 2
        assert np.array_equal(got[0], v1) and np.array_equal(got[1], v2)
        assert e.stats["cluster.ask"] >= 1
        assert call(src, "MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", k2, tls=ctx) == "OK"
        for p in ports:
            assert call(p, "CLUSTER", "SETSLOT", slot, "NODE", dst_id, tls=ctx) == "OK"
        assert e.exists([k1, k2]) == [Status.HIT] * 2
        assert e.stats["cluster.moved"] >= 1
    finally:
        e.close()


def test_replicated_cluster_over_tls_keeps_acknowledged_writes_through_a_failover(tls_servers):
    """A 3-master + 3-replica cluster with TLS on its bus and its replication: every write
    the engine acknowledged (each waited for a replica, over TLS) reads back byte for byte
    from the replica promoted after its master's SIGKILL; the promoted master, left
    without a replica, takes writes again."""
    ports = tls_servers.tls_cluster(3, 1)
    ctx = tls_context(tls_servers.tls_dir)
    url = f"rediss+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}?ca={quote(tls_servers.tls_dir)}/ca.crt"
    e = open_store(url, timeout_ms=1000)
    try:
        lo, hi, victim, (promoted,) = masters_by_slot(ports[0], tls=ctx)[0]
        keys = fresh_keys(120)
        vals = values(len(keys), 20_000, 6)
        assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * len(keys)
        on_victim = [lo <= key_slot(k.encode()) <= hi for k in keys]
        assert any(on_victim)
        assert call(promoted, "ROLE", tls=ctx)[0] == b"slave"
        tls_servers.kill(victim)
        deadline = time.monotonic() + 20
        while True:
            got = [[np.zeros_like(v)] for v in vals]
            out = e.get_into(keys, got)
            assert all(s is Status.HIT for s, mine in zip(out, on_victim) if not mine)
            if out == [Status.HIT] * len(keys):
                break
            assert time.monotonic() < deadline, "the victim's shard did not come back over TLS"
            time.sleep(0.2)
        assert all(np.array_equal(g[0], v) for g, v in zip(got, vals))
        assert call(promoted, "ROLE", tls=ctx)[0] == b"master"
        more = [k for k in fresh_keys(40) if lo <= key_slot(k.encode()) <= hi]
        assert e.put_from(more, [[b"x" * 100] for _ in more]) == [Status.HIT] * len(more)
    finally:
        e.close()


def test_raw_throughput_over_tls(redis_tls_url):
    e = open_store(redis_tls_url)
    try:
        raw = e.raw_throughput(1 << 20, 50)
        assert raw["get_gbps"] > 0 and raw["set_gbps"] > 0 and "--tls --cacert" in raw["how"]
    finally:
        e.close()


# ---------------------------------------------------------------------- who is who
def test_client_certificate_required(redis_tls_auth_url, redis_tls_dir, tmp_path):
    """Without a client certificate the node refuses at construction, naming the URL
    and why; with one (key in its own file, or in the certificate's) it serves."""
    t = time.monotonic()
    with pytest.raises(KvtierError, match="cannot reach the store.*requires a client certificate.*cert= and key=") as e:
        open_store(redis_tls_auth_url)
    assert redis_tls_auth_url in str(e.value) and f"127.0.0.1:{port_of(redis_tls_auth_url)}" in str(e.value)
    assert time.monotonic() - t < 1.0
    both = tmp_path / "client.pem"
    cert = client_cert(redis_tls_dir)
    both.write_bytes(open(cert["cert"], "rb").read() + open(cert["key"], "rb").read())
    for url in (with_options(redis_tls_auth_url, **cert), with_options(redis_tls_auth_url, cert=both)):
        eng = open_store(url)
        try:
            round_trip(eng, n=5)
        finally:
            eng.close()


def test_untrusted_certificate_and_verify_none(redis_tls_url, redis_tls_cluster_url, redis_tls_dir):
    """A server certificate no given CA signed (another CA's file, or none: the system's
    CAs) fails at construction within the timeout, naming the URL, the node and
    OpenSSL's reason; verify=none connects to the same servers."""
    other = os.path.join(redis_tls_dir, "other-ca.crt")
    for url in (redis_tls_url, redis_tls_cluster_url):
        bare = url.split("?")[0]
        for bad in (with_options(bare, ca=other), bare):
            t = time.monotonic()
            with pytest.raises(KvtierError, match="TLS handshake with 127.0.0.1:[0-9]+ failed: "
                                                  "certificate verify failed") as e:
                open_store(bad, timeout_ms=1000)
            assert bad in str(e.value)
            assert time.monotonic() - t < 1.0
        eng = open_store(with_options(bare, verify="none"))
        try:
            round_trip(eng, n=5)
        finally:
            eng.close()


def test_certificate_for_another_host(tls_servers):
    """A certificate the CA signed for another name only: the host check fails it for
    127.0.0.1; verify=none connects."""
    d = tls_servers.tls_dir
    port = tls_servers.tls_node("--tls-cert-file", f"{d}/wrong-host.crt", "--tls-key-file", f"{d}/wrong-host.key")
    with pytest.raises(KvtierError, match="certificate verify failed: IP address mismatch"):
        open_store(f"rediss://127.0.0.1:{port}?ca={quote(d)}/ca.crt")
    with pytest.raises(KvtierError, match="certificate verify failed: Hostname mismatch"):
        open_store(f"rediss://localhost:{port}?ca={quote(d)}/ca.crt")
    e = open_store(f"rediss://127.0.0.1:{port}?verify=none")
    try:
        round_trip(e, n=3)
    finally:
        e.close()


def test_passwords_and_acl_users(tls_servers):
    """A TLS node with a password and an ACL user: a wrong password or user is refused at
    construction, naming AUTH (the password never shown); the right ones serve, in the
    database named."""
    port = tls_servers.tls_node("--requirepass", "s3cret", "--user", "alice", "on", ">wonder", "~*", "+@all")
    ca = f"ca={quote(tls_servers.tls_dir)}/ca.crt"
    base = f"127.0.0.1:{port}"
    for bad in (f"rediss://:wrong@{base}?{ca}", f"rediss://alice:wrong@{base}?{ca}",
                f"rediss://nobody:wonder@{base}?{ca}"):
        with pytest.raises(KvtierError, match="cannot reach the store.*refused AUTH: WRONGPASS") as e:
            open_store(bad)
        assert "wrong" not in str(e.value) and "wonder" not in str(e.value)
    with pytest.raises(KvtierError, match="cannot reach the store.*NOAUTH"):
        open_store(f"rediss://{base}?{ca}")
    for good in (f"rediss://:s3cret@{base}/2?{ca}", f"rediss://alice:wonder@{base}/2?{ca}"):
        e = open_store(good)
        try:
            round_trip(e, n=3)
            assert "s3cret" not in e.url and "wonder" not in e.url
        finally:
            e.close()


# ---------------------------------------------------------------------- bad options
def test_parse_tls_options():
    p = parse("rediss://u:pw@127.0.0.1:7000/2?ca=/c%20a.crt&cert=/c.crt&key=/c.key&connections=2", cluster=False)
    assert p.tls and p.verify and (p.ca, p.cert, p.key) == ("/c a.crt", "/c.crt", "/c.key")
    assert p.addrs == [("127.0.0.1", 7000)] and p.username == "u" and p.db == 2 and p.connections == 2
    p = parse("rediss+cluster://a:1,b:2?verify=none", cluster=True)
    assert p.tls and not p.verify and p.ca is None and p.addrs == [("a", 1), ("b", 2)]
    assert parse("valkeys://h", cluster=False).tls and not parse("redis://h", cluster=False).tls
    assert parse("rediss://h?verify=required", cluster=False).verify


BAD = [
    ("redis://h:1?ca=/x", "'ca' is a TLS option"),
    ("redis+cluster://h:1?verify=none", "'verify' is a TLS option"),
    ("rediss://h:1?verify=maybe", "verify='maybe' must be one of"),
    ("rediss://h:1?verify=", "verify='' must be one of"),
    ("rediss://h:1?ca=", "ca= names no file"),
    ("rediss://h:1?key=/x", "key= goes with cert="),
    ("rediss://h:1?ca=/a&ca=/b", "'ca' is given twice"),
    ("rediss://h:1?bogus=1", r"unknown option 'bogus'; known: \['connections', 'ca', 'cert', 'key', 'verify'\]"),
    ("rediss://h:1?ca=/nonexistent/ca.crt", "option ca='/nonexistent/ca.crt': cannot be read"),
    ("rediss://h:1?ca=/", "option ca='/': cannot be read"),
    ("rediss://h:1?cert=/nonexistent.crt", "option cert='/nonexistent.crt': cannot be read"),
    ("rediss://h:1?verify=none&ca=/nonexistent", "option ca='/nonexistent': cannot be read"),
]


@pytest.mark.parametrize("url,why", BAD)
def test_bad_options_raise_before_connecting(url, why):
    """Named in the error with the URL; the host (h) is never looked up."""
    t = time.monotonic()
    with pytest.raises(KvtierError, match=why) as e:
        open_store(url)
    assert url in str(e.value)
    assert time.monotonic() - t < 0.5


def test_unusable_files(tmp_path, redis_tls_dir):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    unreadable = tmp_path / "locked.pem"
    unreadable.write_text("x")
    unreadable.chmod(0)
    d = redis_tls_dir
    cases = [
        ({"ca": junk}, f"option ca='{junk}': not a PEM file of CA certificates"),
        ({"cert": f"{d}/client.crt"}, "not a PEM certificate with its key .a key in another file: key=."),
        ({"cert": f"{d}/client.crt", "key": f"{d}/server.key"}, "not a PEM certificate and its key .*mismatch"),
        ({"cert": f"{d}/client.crt", "key": junk}, "not a PEM certificate and its key"),
        ({"cert": f"{d}/client.crt", "key": tmp_path / "none.key"}, "option key=.*none.key': cannot be read"),
    ]
    if os.geteuid() != 0:                       # root reads any file
        cases.append(({"ca": unreadable}, "cannot be read .Permission denied."))
    for options, why in cases:
        with pytest.raises(KvtierError, match=why):
            open_store(with_options("rediss://127.0.0.1:1", **options))


def test_encrypted_key_is_refused(tmp_path, redis_tls_dir):
    """A key under a passphrase: refused at construction, never a prompt."""
    import subprocess
    key = tmp_path / "enc.key"
    subprocess.run(["openssl", "ec", "-in", f"{redis_tls_dir}/client.key", "-out", str(key), "-aes256",
                    "-passout", "pass:xyz"], check=True, capture_output=True)
    with pytest.raises(KvtierError, match="the key is encrypted"):
        open_store(with_options("rediss://127.0.0.1:1", cert=f"{redis_tls_dir}/client.crt", key=key))


def test_plain_and_tls_ports_mixed_up(redis_tls_url, redis_servers):
    """rediss:// on a plain port, redis:// on a TLS port: refused at construction, in time."""
    plain = redis_servers.node()
    t = time.monotonic()
    with pytest.raises(KvtierError, match="TLS handshake with 127.0.0.1:[0-9]+: no answer in time"):
        open_store(f"rediss://127.0.0.1:{plain}?verify=none", timeout_ms=300)
    assert time.monotonic() - t < 1.0
    with pytest.raises(KvtierError, match="cannot reach the store"):
        open_store(f"redis://127.0.0.1:{port_of(redis_tls_url)}", timeout_ms=300)


# ---------------------------------------------------------------------- faults
def test_faults_after_construction_are_statuses(tls_servers, caplog):
    """A TLS node that hangs (SIGSTOP) gives TIMEOUT within the timeout, one that dies
    ERROR; a handshake that fails on a new connection is ERROR with one WARNING naming
    the reason. None raises."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    port = tls_servers.tls_node()
    url = f"rediss://127.0.0.1:{port}?ca={quote(tls_servers.tls_dir)}/ca.crt&connections=1"
    e = open_store(url, timeout_ms=500)
    try:
        keys, vals = fresh_keys(3), values(3, 20_000, 9)
        assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * 3

        # A new connection whose handshake fails: the node's pool emptied, its context
        # swapped for one that trusts another CA.
        node = e._server
        real = node._tls
        with node._lock:
            idle, node._idle = node._idle, []
        for c in idle:
            c.close()
        node._tls = ssl.create_default_context(cafile=os.path.join(tls_servers.tls_dir, "other-ca.crt"))
        for _ in range(2):
            assert e.exists(keys) == [Status.ERROR] * 3
        warned = [r.getMessage() for r in caplog.records if "certificate verify failed" in r.getMessage()]
        assert len(warned) == 1 and f"127.0.0.1:{port}" in warned[0]
        node._tls = real
        assert e.exists(keys) == [Status.HIT] * 3

        tls_servers.signal(port, signal.SIGSTOP)
        try:
            t = time.monotonic()
            assert e.get_into(keys, [[bytearray(v.nbytes)] for v in vals]) == [Status.TIMEOUT] * 3
            assert time.monotonic() - t < 2 * 0.5
        finally:
            tls_servers.signal(port, signal.SIGCONT)
        time.sleep(0.6)                                 # past the hold after a timeout
        got = [np.zeros_like(v) for v in vals]
        assert e.get_into(keys, [[g] for g in got]) == [Status.HIT] * 3
        assert all(np.array_equal(g, v) for g, v in zip(got, vals))

        tls_servers.kill(port)
        assert e.put_from(keys, [[v] for v in vals]) == [Status.ERROR] * 3
        assert e.exists(keys) == [Status.ERROR] * 3
    finally:
        e.close()


def test_bytes_held_in_the_ssl_object_are_read_without_a_wait(redis_tls_dir):
    """Two replies in one TLS record, the first read alone: the second is decrypted and
    held inside the SSL object, where poll does not see it. After another send (whose
    reply never comes) it is read at once, not waited for until the deadline."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(f"{redis_tls_dir}/server.crt", f"{redis_tls_dir}/server.key")
    done = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def serve():
            raw, _ = listener.accept()
            with server_ctx.wrap_socket(raw, server_side=True) as s:
                s.recv(100)
                s.sendall(b"+A\r\n+B\r\n")      # one record
                done.wait(5)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        client_ctx = ssl.create_default_context(cafile=f"{redis_tls_dir}/ca.crt")
        deadline = time.monotonic() + 1.0
        conn = resp.Connection("127.0.0.1", listener.getsockname()[1], deadline, client_ctx)
        try:
            conn.send([resp.command("PING")], deadline)
            assert conn.read_line(deadline, 4) == b"+A"         # asks for 4 bytes: the rest stays in SSL
            conn.send([resp.command("PING")], deadline)         # no reply will come
            t = time.monotonic()
            assert conn.read_line(deadline) == b"+B"
            assert time.monotonic() - t < 0.2
        finally:
            conn.close()
            done.set()
            thread.join(5)


def test_small_replies_after_large_ones_in_one_pipeline(redis_tls_url):
    """Windows of large values followed by many small ones, on one TLS connection: all
    within the timeout, bit-exact."""
    e = open_store(with_options(redis_tls_url, connections=1), timeout_ms=2000)
    try:
        n_small = 3 * redis_ops.WINDOW_KEYS
        keys = fresh_keys(8 + n_small)
        vals = values(8, 300_000, 3) + values(n_small, 5, 4)
        assert e.put_from(keys, [[v] for v in vals]) == [Status.HIT] * len(keys)
        for _ in range(3):
            got = [np.zeros_like(v) for v in vals]
            t = time.monotonic()
            assert e.get_into(keys, [[g] for g in got]) == [Status.HIT] * len(keys)
            assert time.monotonic() - t < 1.0
            assert all(np.array_equal(g, v) for g, v in zip(got, vals))
            assert e.exists(keys) == [Status.HIT] * len(keys)
        assert e.delete(keys) == [Status.HIT] * len(keys)
    finally:
        e.close()


def test_idle_tls_connections_are_reused(redis_tls_url, monkeypatch):
    """A pooled TLS connection that only the server's own TLS messages reached (session
    tickets) is not taken for stale: calls after the first open no connection."""
    opened = []
    real = resp.Connection

    def counting(*args, **kw):
        opened.append(args[:2])
        return real(*args, **kw)

    e = open_store(with_options(redis_tls_url, connections=1))
    try:
        monkeypatch.setattr(resp, "Connection", counting)
        keys = fresh_keys(2)
        assert e.put_from(keys, [[b"a"], [b"b"]]) == [Status.HIT] * 2
        time.sleep(0.05)
        for _ in range(10):
            assert e.exists(keys) == [Status.HIT] * 2
        assert opened == []
        assert e.delete(keys) == [Status.HIT] * 2
    finally:
        e.close()
