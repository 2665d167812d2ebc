"""Mooncake clients for the Mooncake engine (`kvtier.store.mooncake`): one per process
and configuration, shared by the engines that use it, and registered staging memory.

A Mooncake client (``MooncakeDistributedStore``) is a transfer engine with its own
threads and ports, and its ``close`` holds the GIL for a second (it joins a thread that
polls the master once a second; for a minute where the master is hung). So a client is
made once per configuration and kept while its master answers: engines closed and
opened again (a serving engine's restarts, the tests) reuse it at no cost. A client
whose master is gone is closed when its last engine closes; one whose master is silent
is left open (closing it would block the process). Kept clients are closed at exit.
"""
from __future__ import annotations

import atexit
import ipaddress
import socket
import threading
from typing import Dict, List, Optional

from kvtier.errors import fail
from kvtier import caches


def import_client(url: str):
    """``mooncake.store``, or `KvtierError` naming the URL and what to install."""
    try:
        import mooncake.store as store_module
    except ImportError as e:
        hint = ("apt-get install libibverbs1" if "libibverbs" in str(e) else
                "pip install mooncake-transfer-engine (GPU hosts) or "
                "mooncake-transfer-engine-non-cuda (CPU hosts)")
        raise fail("url", url, f"needs Mooncake's client ({e}); {hint}") from None
    return store_module


def probe_master(host: str, port: int, timeout: float) -> str:
    """"answers", or why not. A live master closes the connection on a malformed frame
    at once; a hung one (SIGSTOP) accepts it and stays silent, where Mooncake's setup
    would block, holding the GIL, for a minute."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"\0" * 32)
            s.recv(64)
        return "answers"
    except socket.timeout:
        return "does not answer"
    except OSError as e:
        return f"cannot be reached ({e.strerror or e})"


def local_address(host: str, port: int) -> str:
    """The address other nodes reach this client at: loopback for a loopback master,
    else this host's address on the route to the master (no packet is sent)."""
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


class Client:
    """One Mooncake client, the memory registered with it (counted: engines sharing the
    client may register the same buffer) and its staging regions (kept as long as the
    client: memory registered with Mooncake must not be freed under it)."""

    def __init__(self, key: tuple, store):
        self.key = key
        self.store = store
        self.users = 0
        self._registered: Dict[int, List[int]] = {}     # start -> [size, count]
        self._staging: Dict[int, "Staging"] = {}
        self._lock = threading.Lock()

    def staging(self, size: int) -> "Staging":
        """The staging regions of ``size`` bytes, shared by the client's engines."""
        with self._lock:
            if size not in self._staging:
                self._staging[size] = Staging(self, size, MAX_STAGING_REGIONS)
            return self._staging[size]

    def register(self, start: int, size: int) -> int:
        with self._lock:
            entry = self._registered.get(start)
            if entry is not None and entry[0] >= size:
                entry[1] += 1
                return 0
            rc = self.store.register_buffer(start, size)
            if rc == 0:
                self._registered[start] = [size, 1 + (entry[1] if entry else 0)]
            return rc

    def unregister(self, start: int) -> None:
        with self._lock:
            entry = self._registered.get(start)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._registered[start]
                self.store.unregister_buffer(start)

    def covers(self, start: int, size: int) -> bool:
        with self._lock:
            return any(s <= start and start + size <= s + e[0] for s, e in self._registered.items())


# Staging regions of one size a client makes at most: enough for the calls of a few
# threads, and for calls abandoned on a hung store until they return.
MAX_STAGING_REGIONS = 8

_clients: Dict[tuple, Client] = caches.table(
    "store.mooncake_client._clients", kind="state", key="master, metadata server, protocol, local host",
    value="a shared Mooncake client and its users", bound="stores opened", rule="its last user closes it")
_left_open: List[Client] = caches.table(        # masters that stopped answering: never closed
    "store.mooncake_client._left_open", factory=list, kind="state", key="-", value="clients of masters that "
    "stopped answering (closing one would hang)", bound="hung masters", rule="never (the process ends)")
_lock = threading.Lock()


def acquire(url: str, cfg, store_module, timeout: float) -> Client:
    """The client for ``cfg`` (a `MooncakeURL`), made if there is none; the master is
    probed first, and a master that cannot be reached or does not answer raises
    `KvtierError` naming the URL."""
    answer = probe_master(cfg.host, cfg.port, max(timeout, 1.0))
    if answer != "answers":
        raise fail("url", url, f"the Mooncake master at {cfg.master} {answer}")
    local = cfg.local or local_address(cfg.host, cfg.port)
    key = (cfg.master, cfg.metadata, cfg.protocol, cfg.device, cfg.segment, cfg.buffer, local)
    with _lock:
        client = _clients.get(key)
        if client is None:
            store = store_module.MooncakeDistributedStore()
            rc = store.setup(local, cfg.metadata, cfg.segment, cfg.buffer, cfg.protocol,
                             cfg.device, cfg.master)
            if rc != 0:
                raise fail("url", url, f"Mooncake's setup failed (code {rc}); its log on "
                           "stderr says why")
            client = _clients[key] = Client(key, store)
        client.users += 1
        return client


def release(client: Client, host: str, port: int, timeout: float) -> Optional[str]:
    """An engine is done with ``client``. The last one keeps it for reuse while the
    master answers, closes it where the master is gone, leaves it open where the master
    is silent; returns what happened when it is not kept."""
    with _lock:
        client.users -= 1
        if client.users > 0:
            return None
    answer = probe_master(host, port, timeout)
    if answer == "answers":
        return None
    with _lock:
        if client.users > 0:            # taken again meanwhile
            return None
        if _clients.get(client.key) is client:
            del _clients[client.key]
        if answer == "does not answer":
            _left_open.append(client)
            return "the master does not answer; its Mooncake client is left open"
    client.store.close()
    return None


def drop(client: Client) -> None:
    """An engine collected without closing lets go of ``client`` (it stays kept)."""
    with _lock:
        client.users -= 1


def close_idle(master: Optional[str] = None, timeout: float = 1.0) -> None:
    """Close the kept clients no engine uses (of one master ``host:port``, or all): at
    exit, and before a master is stopped on purpose (a client whose master has gone
    makes the process's exit wait, up to 20 s where it lends memory)."""
    with _lock:
        idle = [c for c in _clients.values() if c.users == 0 and master in (None, c.key[0])]
        for c in idle:
            del _clients[c.key]
    for c in idle:
        host, _, port = c.key[0].rpartition(":")
        if probe_master(host.strip("[]"), int(port), timeout) == "does not answer":
            _left_open.append(c)
        else:
            c.store.close()


atexit.register(close_idle)


class Region:
    """One registered staging buffer."""

    __slots__ = ("array", "view", "address", "size")

    def __init__(self, array):
        self.array = array
        self.view = memoryview(array)
        self.address = array.ctypes.data
        self.size = array.nbytes


class Staging:
    """Registered staging regions of ``size`` bytes, made on demand up to ``cap`` and
    kept. A region lent to a call that was abandoned comes back when Mooncake returns
    from it."""

    def __init__(self, client: Client, size: int, cap: int):
        self._client = client
        self.size = size
        self._cap = cap
        self._free: List[Region] = []
        self._all: List[Region] = []
        self._lock = threading.Lock()

    def take(self) -> Optional[Region]:
        import numpy as np
        with self._lock:
            if self._free:
                return self._free.pop()
            if len(self._all) >= self._cap:
                return None
            region = Region(np.empty(self.size, dtype=np.uint8))
            self._all.append(region)
        if self._client.register(region.address, region.size) != 0:
            with self._lock:
                self._all.remove(region)
            raise RuntimeError(f"Mooncake refused to register a {self.size}-byte staging buffer")
        return region

    def give(self, region: Region) -> None:
        with self._lock:
            self._free.append(region)
