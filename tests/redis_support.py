"""Redis servers for the store tests, and ways to damage what they hold.

Servers run on 127.0.0.1 only, started by .ci/redis.sh (pidfiles under a temporary
directory) and stopped by pid. The shared node and cluster come from
KVTIER_TEST_REDIS_URL / KVTIER_TEST_REDIS_CLUSTER_URL when set (.ci/redis.sh start), else
the session starts its own. Tests that kill or stop servers use `Servers` of their own
(the ``redis_servers`` fixture), on other ports. Without redis-server a test skips with
one line, and fails instead in CI (CI or KVTIER_CI set).

The TLS servers come from KVTIER_TEST_REDIS_TLS_URL, ..._TLS_AUTH_URL, ..._TLS_CLUSTER_URL
and ..._TLS_DIR (their certificates), which `.ci/redis.sh start` sets where redis-server
has TLS; unset, a TLS test skips with one line (fails in CI). `Servers.tls_node` and
`Servers.tls_cluster` start TLS servers of a test's own, with certificates of their own
(`Servers.tls_dir`).

The damage helpers (`flip_byte`, `truncate`, `swap`) change a stored object behind the
engine's back, through RESP on the node that holds the key, for the page layer's
corruption tests."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest

from kvtier.store import redis_tls, resp
from kvtier.store.redis_url import parse

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "redis.sh"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false") or os.environ.get("KVTIER_CI") == "1"


def need_redis() -> None:
    """Skip (fail in CI) where redis-server cannot be had."""
    if shutil.which("redis-server") and shutil.which("redis-cli"):
        return
    why = "redis-server is not installed; the Redis store tests need it (bash .ci/redis.sh install)"
    if in_ci():
        pytest.fail(why)
    pytest.skip(why)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_ports(count: int) -> int:
    """A first port of ``count`` free ones (their cluster bus ports, +10000, free too)."""
    for _ in range(100):
        base = random.randrange(27000, 29000 - count)
        if all(_port_free(p) and _port_free(p + 10000) for p in range(base, base + count)):
            return base
    raise RuntimeError("no free ports in 27000-29000")


class Servers:
    """Redis servers of one test (or session) under one directory; `stop` ends them."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="kvtier-redis-")

    def _script(self, *args: str) -> None:
        done = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f".ci/redis.sh {' '.join(args)} failed: {done.stderr.strip()}")

    def node(self, *options: str) -> int:
        """Start one node (``options``: more redis-server arguments); its port."""
        port = free_ports(1)
        self._script("node", self.dir, str(port), *options)
        return port

    def cluster(self, masters: int = 3, replicas: int = 1) -> List[int]:
        """Start a cluster, ready; its nodes' ports."""
        n = masters * (1 + replicas)
        base = free_ports(n)
        self._script("cluster", self.dir, str(base), str(masters), str(replicas))
        return list(range(base, base + n))

    def tls_node(self, *options: str) -> int:
        """A node on TLS only (its certificates: `tls_dir`); its port."""
        port = free_ports(1)
        self._script("tls-node", self.dir, str(port), *options)
        return port

    def tls_cluster(self, masters: int = 3, replicas: int = 0) -> List[int]:
        """A cluster on TLS only, its bus and replication too; its nodes' ports."""
        n = masters * (1 + replicas)
        base = free_ports(n)
        self._script("tls-cluster", self.dir, str(base), str(masters), str(replicas))
        return list(range(base, base + n))

    @property
    def tls_dir(self) -> str:
        """The certificates of this directory's TLS servers (.ci/redis.sh certs)."""
        return os.path.join(self.dir, "tls")

    def pid(self, port: int) -> int:
        return int(Path(self.dir, str(port), "redis.pid").read_text())

    def signal(self, port: int, sig: int) -> None:
        os.kill(self.pid(port), sig)

    def kill(self, port: int) -> None:
        pid = self.pid(port)
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):                    # gone (a child of no one here: poll /proc)
            if not Path(f"/proc/{pid}").exists() or "Z" in _state(pid):
                return
            time.sleep(0.01)

    def stop(self) -> None:
        self._script("stop", self.dir)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "gone"


def call(port: int, *args, timeout: float = 2.0, asking: bool = False, tls: Optional[ssl.SSLContext] = None):
    """One command to the node on ``port`` (after ASKING: into a slot it imports; over TLS
    with ``tls``, a context as `tls_context` makes); its reply."""
    deadline = time.monotonic() + timeout
    conn = resp.Connection("127.0.0.1", port, deadline, tls)
    try:
        if asking:
            conn.call(deadline, "ASKING")
        return conn.call(deadline, *args)
    finally:
        conn.close()


def tls_context(tls_dir: str) -> ssl.SSLContext:
    """A client context trusting the CA of ``tls_dir``, with its client certificate."""
    ctx = ssl.create_default_context(cafile=os.path.join(tls_dir, "ca.crt"))
    ctx.load_cert_chain(os.path.join(tls_dir, "client.crt"), os.path.join(tls_dir, "client.key"))
    return ctx


def masters_by_slot(port: int, tls: Optional[ssl.SSLContext] = None) -> List[tuple]:
    """``(first slot, last slot, master port, [replica ports])`` per slot range, from
    CLUSTER NODES (CLUSTER SLOTS leaves out replicas until their offset is gossiped)."""
    nodes = [line.split() for line in call(port, "CLUSTER", "NODES", tls=tls).decode().splitlines()]
    port_of = {n[0]: int(n[1].split("@")[0].rsplit(":", 1)[1]) for n in nodes}
    out = []
    for n in nodes:
        if "master" in n[2]:
            replicas = [port_of[r[0]] for r in nodes if r[3] == n[0]]
            for rng in n[8:]:
                lo, _, hi = rng.partition("-")
                out.append((int(lo), int(hi or lo), port_of[n[0]], replicas))
    return sorted(out)


# ---------------------------------------------------------------------- shared servers
def _shared(env: str, start):
    url = os.environ.get(env)
    if url:
        yield url
        return
    need_redis()
    servers = Servers()
    try:
        yield start(servers)
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def redis_url():
    """A Redis node's URL (KVTIER_TEST_REDIS_URL, or one started for the session)."""
    yield from _shared("KVTIER_TEST_REDIS_URL", lambda s: f"redis://127.0.0.1:{s.node()}")


@pytest.fixture(scope="session")
def redis_cluster_url():
    """A 3-master + 3-replica cluster's URL (KVTIER_TEST_REDIS_CLUSTER_URL, or started)."""
    def start(s):
        ports = s.cluster(3, 1)
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports[:2])
    yield from _shared("KVTIER_TEST_REDIS_CLUSTER_URL", start)


def tls_env(name: str) -> str:
    """The TLS servers' variable KVTIER_TEST_REDIS_TLS_<name>; unset, the test skips
    (fails in CI)."""
    var = f"KVTIER_TEST_REDIS_TLS_{name}"
    value = os.environ.get(var)
    if value:
        return value
    why = f"{var} is not set; the Redis TLS tests need the TLS servers of .ci/redis.sh start"
    if in_ci():
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def redis_tls_url() -> str:
    """A TLS node's URL (client certificates optional; ``?ca=`` names its CA)."""
    return tls_env("URL")


@pytest.fixture
def redis_tls_auth_url() -> str:
    """A TLS node's URL that requires a client certificate (the URL names none)."""
    return tls_env("AUTH_URL")


@pytest.fixture
def redis_tls_cluster_url() -> str:
    """A 3-master TLS cluster's URL (``rediss+cluster://...?ca=``)."""
    return tls_env("CLUSTER_URL")


@pytest.fixture
def redis_tls_dir() -> str:
    """The TLS servers' certificates: ca.crt, client.crt, client.key, other-ca.crt, ..."""
    return tls_env("DIR")


@pytest.fixture
def redis_servers():
    """Servers of this test's own, to kill or stop; stopped by pid after it."""
    need_redis()
    servers = Servers()
    yield servers
    servers.stop()


# ---------------------------------------------------------------------- damage
def _on_key(url: str, key: str, *args):
    """``args`` (the key among them) sent to the node holding ``key``, following MOVED."""
    conf = parse(url, cluster="+cluster" in url.split("://")[0])
    tls = redis_tls.context(conf, url) if conf.tls else None
    host, port = conf.addrs[0]
    for _ in range(3):
        deadline = time.monotonic() + 2.0
        conn = resp.Connection(host, port, deadline, tls)
        try:
            if conf.password is not None:
                conn.call(deadline, "AUTH", *([conf.username] if conf.username else []), conf.password)
            if conf.db:
                conn.call(deadline, "SELECT", conf.db)
            reply = conn.call(deadline, *args)
        finally:
            conn.close()
        redirect = resp.parse_redirect(reply) if isinstance(reply, resp.ReplyError) else None
        if redirect is None:
            if isinstance(reply, resp.ReplyError):
                raise RuntimeError(f"{args[0]} {key!r}: {reply}")
            return reply
        host, port = redirect[2] or host, redirect[3]
    raise RuntimeError(f"{key!r}: redirected too often")


def raw_get(url: str, key: str) -> Optional[bytes]:
    return _on_key(url, key, "GET", key)


def raw_set(url: str, key: str, value: bytes) -> None:
    _on_key(url, key, "SET", key, value)


def flip_byte(url: str, key: str, offset: int) -> int:
    """Invert the byte at ``offset`` of the object under ``key`` in place (GETRANGE,
    SETRANGE: the object's length stays); the byte it held."""
    old = _on_key(url, key, "GETRANGE", key, offset, offset)
    if not old:
        raise KeyError(f"{key!r} holds no byte at {offset}")
    _on_key(url, key, "SETRANGE", key, offset, bytes([old[0] ^ 0xFF]))
    return old[0]


def truncate(url: str, key: str, length: int) -> None:
    """Keep the first ``length`` bytes of the object under ``key``."""
    raw_set(url, key, _on_key(url, key, "GETRANGE", key, 0, length - 1) if length else b"")


def swap(url: str, key_a: str, key_b: str) -> None:
    """Exchange the objects under two keys (in a cluster, wherever each lives)."""
    a, b = raw_get(url, key_a), raw_get(url, key_b)
    raw_set(url, key_a, b)
    raw_set(url, key_b, a)
