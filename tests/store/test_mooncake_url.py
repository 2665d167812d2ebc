"""The Mooncake engine's URL, its construction checks and its deadline workers: nothing
here needs Mooncake's client or a store."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from kvtier.errors import KvtierError
from kvtier.store import open_store
from kvtier.store import mooncake as mc
from kvtier.store import mooncake_client
from kvtier.store.deadline import DeadlineWorkers, Outcome


# ---------------------------------------------------------------------- URLs
def test_defaults():
    u = mc.parse_url("mooncake://10.0.0.5:50051")
    assert (u.host, u.port, u.master) == ("10.0.0.5", 50051, "10.0.0.5:50051")
    assert (u.metadata, u.protocol, u.device) == ("P2PHANDSHAKE", "tcp", "")
    assert (u.segment, u.buffer, u.staging) == (0, 16 << 20, 64 << 20)
    assert (u.transfer, u.replicas, u.local) == ("staged", 1, "")


def test_every_option():
    u = mc.parse_url("MOONCAKE://master.example:7/?metadata=http://meta:8080/metadata&protocol=rdma"
                     "&device=mlx5_0,mlx5_1&segment=4GiB&buffer=0&staging=8m&transfer=direct"
                     "&replicas=2&local=10.1.2.3")
    assert (u.host, u.port) == ("master.example", 7)
    assert u.metadata == "http://meta:8080/metadata"
    assert (u.protocol, u.device) == ("rdma", "mlx5_0,mlx5_1")
    assert (u.segment, u.buffer, u.staging) == (4 << 30, 0, 8 << 20)
    assert (u.transfer, u.replicas, u.local) == ("direct", 2, "10.1.2.3")


@pytest.mark.parametrize("text,value", [("123", 123), ("1k", 1024), ("2M", 2 << 20), ("3g", 3 << 30),
                                        ("1T", 1 << 40), ("5MB", 5 << 20), ("5MiB", 5 << 20)])
def test_sizes(text, value):
    assert mc.parse_url(f"mooncake://h:1?segment={text}").segment == value


def test_ipv6_master_and_p2p_spelled_out():
    u = mc.parse_url("mooncake://[::1]:50051?metadata=P2PHANDSHAKE")
    assert (u.host, u.master, u.metadata) == ("::1", "[::1]:50051", "P2PHANDSHAKE")


@pytest.mark.parametrize("url,why", [
    ("mooncake://", "HOST:PORT"),
    ("mooncake://host", "HOST:PORT"),
    ("mooncake://host:0", "HOST:PORT"),
    ("mooncake://host:99999", "port"),
    ("mooncake://host:port", "port"),
    ("mooncake://user:pw@host:1", "user"),
    ("mooncake://host:1/path", "no path"),
    ("mooncake://host:1#frag", "no path or fragment"),
    ("mooncake://host:1?colour=blue", "unknown option 'colour'"),
    ("mooncake://host:1?segment=1G&segment=2G", "twice"),
    ("mooncake://host:1?segment", "option=value"),
    ("mooncake://host:1?segment=lots", "segment='lots'"),
    ("mooncake://host:1?segment=-1", "segment='-1'"),
    ("mooncake://host:1?staging=4k", "at least"),
    ("mooncake://host:1?protocol=udp", "protocol='udp'"),
    ("mooncake://host:1?transfer=zero", "transfer='zero'"),
    ("mooncake://host:1?replicas=0", "replicas='0'"),
    ("mooncake://host:1?replicas=two", "replicas='two'"),
    ("mooncake://host:1?metadata=ftp://x", "metadata='ftp://x'"),
    ("mooncake://host:1?local=a b", "local="),
    ("mooncake://host:1?device=$(x)", "device="),
    ("redis://host:1", "mooncake://"),
])
def test_bad_urls_name_the_url(url, why):
    with pytest.raises(KvtierError) as e:
        mc.parse_url(url)
    assert f"url={url!r}" in str(e.value) and why in str(e.value)


def test_open_store_checks_the_url_before_the_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)      # no client: the URL is still judged
    with pytest.raises(KvtierError, match="unknown option"):
        open_store("mooncake://127.0.0.1:1?colour=blue")


def test_missing_client_names_the_url(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(KvtierError, match=r"url='mooncake://127.0.0.1:1'.*needs Mooncake's client"):
        open_store("mooncake://127.0.0.1:1")


def test_importing_the_engine_imports_no_client():
    code = "import sys, kvtier.store.mooncake; print('mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- unreachable masters
@pytest.fixture
def fake_client(monkeypatch):
    """The engine's construction up to setup, without Mooncake: the master probe."""
    class NoSetup:
        def MooncakeDistributedStore(self):
            raise AssertionError("the probe should have failed first")
    monkeypatch.setattr(mooncake_client, "import_client", lambda url: NoSetup())


def test_nothing_listening_fails_at_once(fake_client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]           # bound, not listening: refused
        t = time.monotonic()
        with pytest.raises(KvtierError, match=rf"url='mooncake://127.0.0.1:{port}'.*cannot be reached"):
            open_store(f"mooncake://127.0.0.1:{port}", timeout_ms=500)
        assert time.monotonic() - t < 1.0


def test_silent_master_fails_within_the_timeout(fake_client):
    """A hung master accepts connections (the kernel does) and answers nothing: refused
    before Mooncake's setup, which would block with the GIL held."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)                         # never accepted, never answered
        port = s.getsockname()[1]
        t = time.monotonic()
        with pytest.raises(KvtierError, match="does not answer"):
            open_store(f"mooncake://127.0.0.1:{port}", timeout_ms=300)
        assert time.monotonic() - t < 2 * 1.0     # the probe waits at least 1 s


def test_local_address():
    assert mooncake_client.local_address("127.0.0.1", 1) == "127.0.0.1"
    assert mooncake_client.local_address("localhost", 1) == "127.0.0.1"


# ---------------------------------------------------------------------- deadline workers
def test_workers_return_values_and_raise_errors():
    w = DeadlineWorkers("t")
    assert w.call(lambda: 42, 5) == (Outcome.DONE, 42)
    with pytest.raises(ZeroDivisionError):
        w.call(lambda: 1 / 0, 5)
    assert w.in_flight == 0
    w.close()


def test_late_call_goes_on_and_cleans_up_when_it_returns():
    w = DeadlineWorkers("t")
    release, cleaned = threading.Event(), threading.Event()
    kept = []

    class Buffer:
        def __del__(self):
            kept.append("freed")
    buf = Buffer()
    t = time.monotonic()
    outcome, value = w.call(lambda: release.wait(10), 0.1, on_late=cleaned.set, keep=buf)
    assert (outcome, value) == (Outcome.LATE, None) and time.monotonic() - t < 1.0
    del buf
    assert kept == [] and w.in_flight == 1      # the late call still holds its buffer
    release.set()
    assert cleaned.wait(5)
    for _ in range(100):
        if kept:
            break
        time.sleep(0.01)
    assert kept == ["freed"] and w.in_flight == 0
    assert w.call(lambda: "again", 5) == (Outcome.DONE, "again")   # the worker is reused
    w.close()


def test_all_workers_parked_answers_busy_at_once():
    w = DeadlineWorkers("t", max_workers=2)
    release = threading.Event()
    for _ in range(2):
        assert w.call(lambda: release.wait(10), 0.05)[0] is Outcome.LATE
    t = time.monotonic()
    assert w.call(lambda: 1, 5) == (Outcome.BUSY, None)
    assert time.monotonic() - t < 0.5
    release.set()
    for _ in range(200):
        if w.in_flight == 0:
            break
        time.sleep(0.01)
    assert w.call(lambda: 1, 5) == (Outcome.DONE, 1)
    w.close()
    assert w.call(lambda: 1, 5) == (Outcome.BUSY, None)    # closed
