"""Mooncake Store for the tests (no tests here): the store `.ci/mooncake.sh` started
(``KVTIER_TEST_MOONCAKE_URL``), and throwaway masters and store nodes a test starts on
127.0.0.1 itself (pidfile, stopped by pid) to kill or hang.

Where Mooncake's client or the store cannot be had, a test skips with one line; in CI
(CI=1 or KVTIER_CI=1) it fails instead."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

URL_ENV = "KVTIER_TEST_MOONCAKE_URL"


def in_ci() -> bool:
    return os.environ.get("CI") in ("1", "true") or os.environ.get("KVTIER_CI") == "1"


def unavailable(why: str):
    """Skip outside CI, fail in CI."""
    if in_ci():
        pytest.fail(f"Mooncake: {why}", pytrace=False)
    pytest.skip(f"Mooncake: {why}")


def need_client() -> None:
    try:
        import mooncake.store  # noqa: F401
    except Exception as e:      # ImportError, or OSError for a missing libibverbs
        unavailable(f"no client ({type(e).__name__}: {e}); bash .ci/mooncake.sh installs it")


def store_url() -> str:
    need_client()
    url = os.environ.get(URL_ENV)
    if not url:
        unavailable(f"{URL_ENV} is not set; bash .ci/mooncake.sh starts a store and sets it")
    return url


def _binary(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One process started with a pidfile and stopped by its pid."""

    def __init__(self, argv, run_dir, name):
        self.pidfile = os.path.join(run_dir, f"{name}.pid")
        self.log = os.path.join(run_dir, f"{name}.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        with open(self.pidfile, "w") as f:
            f.write(str(self.proc.pid))

    @property
    def pid(self) -> int:
        with open(self.pidfile) as f:
            return int(f.read())

    def signal(self, sig) -> None:
        """Send ``sig``; after SIGSTOP, return once every thread has stopped (a thread
        running on another core could otherwise answer one more request)."""
        os.kill(self.pid, sig)
        if sig != signal.SIGSTOP:
            return
        end = time.monotonic() + 5
        while time.monotonic() < end:
            states = []
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                try:
                    with open(f"/proc/{self.pid}/task/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            if states and all(st in "tT" for st in states):
                return
            time.sleep(0.005)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def tail(self) -> str:
        with open(self.log, "rb") as f:
            return f.read()[-2000:].decode(errors="replace")


class ThrowawayStore:
    """A Mooncake master on free 127.0.0.1 ports, and optionally one store node lending
    ``segment`` bytes; `url` reaches it."""

    def __init__(self, run_dir, store_node: bool = True, segment: str = "64MB"):
        need_client()
        self.port, self.metrics = _free_port(), _free_port()
        self.master = Server([_binary("mooncake_master"), "--rpc_address=127.0.0.1",
                              f"--rpc_port={self.port}", "--metrics_host=127.0.0.1",
                              f"--metrics_port={self.metrics}",
                              "--enable_http_metadata_server=false"], run_dir, "master")
        self.node = None
        try:
            if store_node:
                self.node = Server([_binary("mooncake_client"), "--host=127.0.0.1",
                                    f"--port={_free_port()}", f"--global_segment_size={segment}",
                                    f"--master_server_address=127.0.0.1:{self.port}",
                                    "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"],
                                   run_dir, "node")
            self._wait(store_node)
        except BaseException:
            self.stop()
            raise
        self.url = f"mooncake://127.0.0.1:{self.port}"

    def _wait(self, store_node: bool) -> None:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.metrics}/get_all_segments", timeout=1) as r:
                    if r.read().strip() or not store_node:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        unavailable("a throwaway master did not come up:\n" + self.master.tail())

    def stop(self) -> None:
        from kvtier.store.mooncake_client import close_idle
        close_idle(f"127.0.0.1:{self.port}", timeout=0.2)   # before its master goes
        for server in (self.node, self.master):
            if server is not None:
                server.stop()
