"""Redis store URLs and construction: malformed URLs, unreachable stores, credentials,
databases; importing the engine imports no client library."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from kvtier.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store.redis_url import parse, redacted
from redis_support import free_ports
from redis_support import redis_servers, redis_url  # noqa: F401  (fixtures: servers of the test's own, the shared node)

BAD = [
    ("redis://", "no host"),
    ("redis://:6379", "no host"),
    ("redis://host:0", "port"),
    ("redis://host:65536", "port"),
    ("redis://host:abc", "port"),
    ("redis://host:", "empty port"),
    ("redis://host:6379?bogus=1", "unknown option 'bogus'"),
    ("redis://host:6379?connections=0", "connections"),
    ("redis://host:6379?connections=two", "connections"),
    ("redis://host:6379?connections", "connections"),
    ("redis://host:6379/db1", "database"),
    ("redis://host:6379#x", "fragment"),
    ("redis://a:1,b:2", "several hosts"),
    ("redis://secret@host:1", "credentials"),
    ("redis://[::1:6379", "IPv6"),
    ("redis+cluster://a:1,:2", "no host"),
    ("redis+cluster://a:1/2", "database"),
    ("valkey+cluster://a:1,b:x", "port"),
]


@pytest.mark.parametrize("url,why", BAD)
def test_bad_urls_raise_naming_the_url(url, why):
    with pytest.raises(KvtierError, match=why) as e:
        open_store(url)
    assert repr(url) in str(e.value) or url in str(e.value)


def test_parse():
    p = parse("redis://127.0.0.1", cluster=False)
    assert p.addrs == [("127.0.0.1", 6379)] and p.db == 0 and p.password is None and p.connections == 4
    p = parse("redis://us%40er:p%3Ass@[::1]:7000/3?connections=5", cluster=False)
    assert p.addrs == [("::1", 7000)] and p.username == "us@er" and p.password == "p:ss"
    assert p.db == 3 and p.connections == 5
    p = parse("redis+cluster://:pw@a:1,b,[::1]:3", cluster=True)
    assert p.addrs == [("a", 1), ("b", 6379), ("::1", 3)] and p.username is None and p.password == "pw"


def test_passwords_never_shown():
    assert redacted("redis://user:hunter2@h:1/0") == "redis://user:***@h:1/0"
    assert redacted("redis://h:1") == "redis://h:1"
    with pytest.raises(KvtierError) as e:
        open_store("redis://user:hunter2@h:1?nope=1")
    assert "hunter2" not in str(e.value) and "user:***@h:1" in str(e.value)


def test_bad_timeout():
    with pytest.raises(KvtierError, match="timeout_ms"):
        open_store("redis://127.0.0.1:1", timeout_ms=0)


def test_refused_at_construction_names_the_url():
    port = free_ports(2)
    for url in (f"redis://127.0.0.1:{port}", f"redis+cluster://127.0.0.1:{port},127.0.0.1:{port + 1}"):
        t = time.monotonic()
        with pytest.raises(KvtierError, match="cannot reach the store") as e:
            open_store(url, timeout_ms=500)
        assert url in str(e.value)
        assert time.monotonic() - t < 1.0


def test_silent_server_at_construction_times_out():
    """A listener that accepts and never answers: construction fails naming the URL
    within about the timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        port = s.getsockname()[1]
        for url in (f"redis://127.0.0.1:{port}", f"redis+cluster://127.0.0.1:{port}"):
            t = time.monotonic()
            with pytest.raises(KvtierError, match="cannot reach the store.*in time"):
                open_store(url, timeout_ms=300)
            assert time.monotonic() - t < 2 * 0.3 + 0.2


def test_cluster_url_on_a_plain_node(redis_url):      
    host_port = redis_url.split("//")[1]
    with pytest.raises(KvtierError, match="cluster support disabled"):
        open_store(f"redis+cluster://{host_port}")


def test_credentials_and_database(redis_servers):     
    port = redis_servers.node("--requirepass", "s3cret")
    base = f"127.0.0.1:{port}"
    with pytest.raises(KvtierError, match="cannot reach the store.*AUTH") as e:
        open_store(f"redis://:wrong@{base}")
    assert "wrong" not in str(e.value)
    with pytest.raises(KvtierError, match="cannot reach the store"):
        open_store(f"redis://{base}")
    db2, db0 = open_store(f"redis://:s3cret@{base}/2"), open_store(f"redis://default:s3cret@{base}")
    try:
        assert db2.put_from(["k"], [[b"in db 2"]]) == [Status.HIT]
        got = bytearray(7)
        assert db2.get_into(["k"], [[got]]) == [Status.HIT] and got == b"in db 2"
        assert db0.exists(["k"]) == [Status.MISS]
        assert "s3cret" not in db2.url and "s3cret" not in repr(db2)
        raw = db2.raw_throughput(1 << 20, 50)
        assert raw["get_gbps"] > 0 and "s3cret" not in raw["how"] and "--dbnum 2" in raw["how"]
    finally:
        db2.close()
        db0.close()


def test_import_loads_no_client_library():
    code = ("import sys, kvtier, kvtier.store, kvtier.store.redis; "
            "bad = [m for m in ('redis', 'valkey', 'glide', 'glide_sync', 'hiredis', 'libvalkey') "
            "if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
