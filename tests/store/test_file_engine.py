"""The file engine: the engine contract (`engine_conformance`), and what is its own:
URLs, the directory it makes, torn writes, dead writers' temporary files, the raw figure."""
from __future__ import annotations

import os

import pytest

from engine_conformance import EngineConformance
from kvtier.kernels.errors import KvtierError
from kvtier.store import Status, open_store
from kvtier.store.file import FileEngine, object_name


class TestFileEngineContract(EngineConformance):
    @pytest.fixture
    def open_engine(self, tmp_path):
        return lambda: open_store(f"file://{tmp_path}/store")


@pytest.mark.parametrize("url", ["file://relative/dir", "file:relative", "file:///dir?x=1", "file:///dir#frag", "file:///", "file:///a/..",
                                 "file://otherhost/dir"])
def test_malformed_urls_name_the_url(url):
    with pytest.raises(KvtierError, match="url="):
        open_store(url)


def test_unwritable_directory_names_the_url(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    url = f"file://{blocker}/store"
    with pytest.raises(KvtierError, match="url=.*a-file/store.*cannot be written"):
        open_store(url)


def test_localhost_and_percent_encoded_paths(tmp_path):
    e = open_store(f"file://localhost{tmp_path}/with%20space")
    assert e.root == f"{tmp_path}/with space" and os.path.isdir(e.root)
    assert e.put_from(["k"], [[b"abc"]]) == [Status.HIT]


def test_object_names_are_safe_and_fanned_out(tmp_path):
    e = FileEngine(f"file://{tmp_path}")
    for key in ["..", "/etc/passwd", "a" * 5000, "ключ", "\x00"]:
        name = object_name(key)
        a, leaf = name.split("/")
        assert len(a) == 2 and len(leaf) == 32 and leaf.startswith(a)
        assert all(c in "0123456789abcdef" for c in leaf)
    e.put_from(["x"], [[b"1"]])
    assert os.path.isfile(os.path.join(str(tmp_path), object_name("x")))


def test_live_writers_temporary_files_are_kept(tmp_path):
    import socket
    e = FileEngine(f"file://{tmp_path}")
    live = os.path.join(e.tmp, f"{socket.gethostname()}.{os.getppid()}.1.0")    # a running process
    other_host = os.path.join(e.tmp, "elsewhere.1.1.0")
    dead = os.path.join(e.tmp, f"{socket.gethostname()}.{_dead_pid()}.1.0")
    for p in (live, other_host, dead):
        open(p, "wb").close()
    FileEngine(f"file://{tmp_path}")
    assert os.path.exists(live) and os.path.exists(other_host) and not os.path.exists(dead)


def _dead_pid() -> int:
    import subprocess
    import sys
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_raw_throughput_leaves_nothing_behind(tmp_path):
    e = FileEngine(f"file://{tmp_path}")
    before = sorted(os.listdir(tmp_path))
    r = e.raw_throughput(65536, 8)
    assert r["get_gbps"] > 0 and r["set_gbps"] > 0 and "plain file" in r["how"]
    assert sorted(os.listdir(tmp_path)) == before
    with pytest.raises(KvtierError, match="value_bytes"):
        e.raw_throughput(0, 8)
    with pytest.raises(KvtierError, match="count"):
        e.raw_throughput(10, True)


def test_a_failing_write_is_error_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    e = FileEngine(f"file://{tmp_path}")
    import errno

    def full(fd, bufs, off):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwritev", full)
    assert e.put_from(["a", "b"], [[b"1"], [b"2"]]) == [Status.ERROR, Status.ERROR]
    assert os.listdir(e.tmp) == []
    assert e.stats["put.error"] == 2
