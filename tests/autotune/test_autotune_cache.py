"""The cache file: location, round trip, bad files ignored with a warning, version
changes, atomic replacement, and concurrent writers keeping each other's entries."""
import json
import logging
import os
import re
import subprocess
import sys
import threading

import pytest

from autotune_support import logs_warning

from kvtier.autotune import cache
from kvtier.autotune.cache import CACHE_ENV, FORMAT_VERSION, cache_dir, cache_path, load, store
from kvtier.autotune.key import DeviceId, TuneKey
from kvtier.config import CopyConfig
from kvtier.errors import KvtierError

DEV = DeviceId("cuda", "NVIDIA H200", "sm_90", 132)
CFG = CopyConfig(num_programs=8, rows=4, block_bytes=2048, num_warps=8, strategy="kernel")


def key(n=4096, op="backup"):
    return TuneKey.of(op, row_bytes=1024, page_size=16, num_rows=n, num_layers=32, crosses_link=True)


def test_cache_dir_env_xdg_home(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == tmp_path / "x" / "kvtier"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert cache_dir() == tmp_path / "h" / ".cache" / "kvtier"


def test_round_trip(tmp_cache):
    path = store(DEV, {key(): {"config": CFG.to_dict(), "gbps": 51.5}})
    assert path == cache_path(DEV) and path.parent == tmp_cache
    assert load(DEV) == {key(): CFG}
    doc = json.loads(path.read_text())
    assert doc["version"] == FORMAT_VERSION and doc["device"]["name"] == "NVIDIA H200"
    e = doc["entries"][key().to_str()]
    assert e["gbps"] == 51.5 and e["triton"] and e["kvtier"] and e["tuned_at"]
    assert [p.name for p in tmp_cache.iterdir() if p.suffix == ".tmp"] == []   # no temp file left


def test_store_merges_and_replaces_same_key(tmp_cache):
    other = CopyConfig(num_programs=2)
    store(DEV, {key(256): {"config": CFG.to_dict()}})
    store(DEV, {key(4096): {"config": CFG.to_dict()}})
    store(DEV, {key(256): {"config": other.to_dict()}})
    assert load(DEV) == {key(256): other, key(4096): CFG}


def test_missing_file_is_empty_without_warning(tmp_cache, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert load(DEV) == {}
    assert not caplog.records


@pytest.mark.parametrize("text,why", [
    ("{not json", "corrupt JSON"),
    ("[1, 2]", "not an autotune cache"),
    (json.dumps({"version": FORMAT_VERSION + 1, "device": DEV.to_dict(), "entries": {}}), "format version"),
    (json.dumps({"version": FORMAT_VERSION, "device": dict(DEV.to_dict(), name="NVIDIA H100"),
                 "entries": {}}), "written for"),
    (json.dumps({"version": FORMAT_VERSION, "device": "NVIDIA H200", "entries": {}}), "device field"),
    (json.dumps({"version": FORMAT_VERSION, "device": None, "entries": {}}), "device field"),
    (json.dumps({"version": FORMAT_VERSION, "device": [1, 2], "entries": {}}), "device field"),
    (b"\xff\xfe\x00 not utf-8", "unreadable"),
    ("[" * 100000 + "]" * 100000, "corrupt JSON"),
])
def test_bad_file_is_ignored_with_a_warning_and_replaced_on_write(tmp_cache, text, why, caplog):
    path = cache_path(DEV)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    with logs_warning(caplog, why):
        assert load(DEV) == {}
    store(DEV, {key(): {"config": CFG.to_dict()}})
    assert load(DEV) == {key(): CFG}
    assert json.loads(path.read_text())["version"] == FORMAT_VERSION


def test_version_change_drops_the_old_entries(tmp_cache, monkeypatch, caplog):
    store(DEV, {key(256): {"config": CFG.to_dict()}})
    doc = json.loads(cache_path(DEV).read_text())
    doc["entries"][key(256).to_str()]["triton"] = "0.0.1"          # measured under another Triton
    cache_path(DEV).write_text(json.dumps(doc))
    with logs_warning(caplog, "other Triton/kvtier versions"):
        assert load(DEV) == {}
    store(DEV, {key(4096): {"config": CFG.to_dict()}})            # rewriting drops the stale entry
    assert list(json.loads(cache_path(DEV).read_text())["entries"]) == [key(4096).to_str()]


def test_malformed_entries_are_skipped_with_a_warning(tmp_cache, caplog):
    store(DEV, {key(256): {"config": CFG.to_dict()}, key(512): {"config": CFG.to_dict()}})
    doc = json.loads(cache_path(DEV).read_text())
    doc["entries"][key(512).to_str()]["config"]["rows"] = 3          # not a power of two
    doc["entries"]["garbage"] = {"config": CFG.to_dict()}
    missing = CFG.to_dict()
    del missing["num_warps"]                                           # not silently the default
    doc["entries"][key(1024).to_str()] = dict(doc["entries"][key(256).to_str()], config=missing)
    truthy = dict(CFG.to_dict(), rows=True)                            # a bool is no count
    doc["entries"][key(2048).to_str()] = dict(doc["entries"][key(256).to_str()], config=truthy)
    cache_path(DEV).write_text(json.dumps(doc))
    with logs_warning(caplog, "4 malformed entries"):
        assert load(DEV) == {key(256): CFG}


def test_unreadable_file_warns(tmp_cache, caplog):
    cache_path(DEV).mkdir(parents=True)          # a directory where the file should be
    with logs_warning(caplog, "unreadable"):
        assert load(DEV) == {}


def test_a_failed_write_leaves_the_old_file_whole(tmp_cache, monkeypatch):
    store(DEV, {key(256): {"config": CFG.to_dict()}})
    before = cache_path(DEV).read_text()

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(cache.json, "dump", boom)
    with pytest.raises(KvtierError, match=re.escape(f"path='{cache_path(DEV)}': cannot be written (disk full)")):
        store(DEV, {key(512): {"config": CFG.to_dict()}})
    assert cache_path(DEV).read_text() == before
    assert [p.name for p in tmp_cache.iterdir() if p.suffix == ".tmp"] == []


def test_two_threads_keep_each_others_entries(tmp_cache):
    def writer(op):
        for n in range(12):
            store(DEV, {key(1 << n, op): {"config": CFG.to_dict()}})

    threads = [threading.Thread(target=writer, args=(op,)) for op in ("backup", "load", "gather")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(load(DEV)) == 36


_WRITER = """
import sys
from kvtier.autotune.cache import store
from kvtier.autotune.key import DeviceId, TuneKey
from kvtier.config import CopyConfig
dev = DeviceId("cuda", "NVIDIA H200", "sm_90", 132)
op = sys.argv[1]
for n in range(25):
    store(dev, {TuneKey.of(op, row_bytes=1024, page_size=16, num_rows=1 << n, num_layers=32,
                           crosses_link=True): {"config": CopyConfig(num_programs=1 + n).to_dict()}})
"""


def test_two_processes_keep_each_others_entries(tmp_cache):
    env = dict(os.environ, **{CACHE_ENV: str(tmp_cache)})
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, op], env=env) for op in ("backup", "load")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    got = load(DEV)
    assert len(got) == 50
    assert got[key(1 << 7, "load")].num_programs == 8


def test_a_damaged_file_never_stops_a_transfer(tmp_cache, caplog):
    """Whatever the damage, the lookup the pools make answers the platform default."""
    from kvtier.autotune import select
    from kvtier.kernels import default_config
    cache_path(DEV).write_text(json.dumps({"version": FORMAT_VERSION, "device": "x", "entries": {}}))
    select.invalidate()
    with logs_warning(caplog, "device field"):
        cfg = select.select_config("backup", "cuda", row_bytes=1024, page_size=16, num_rows=4096,
                                   num_layers=32, crosses_link=True, device_name=DEV.name)
    assert cfg == default_config("cuda")


@pytest.mark.parametrize("text", ["", "{\"version\": 1, \"dev", "[1, 2]", "\"entries\"",
                                  json.dumps({"version": 1, "device": {}, "entries": []}),
                                  json.dumps({"version": 1, "entries": {"backup": 5}})],
                         ids=["empty", "truncated", "list", "string", "entries-list", "entries-wrong-type"])
def test_a_damaged_file_warns_once_naming_it_and_pool_calls_use_the_defaults(tmp_cache, caplog, text):
    """The pools' lookups read this device's file once: a damaged one gives one WARNING
    that names the file, however many calls follow, and every call runs (the defaults)."""
    import torch
    from kvtier.autotune import select
    from kvtier.autotune.key import device_identity
    from kvtier.pool import HostPool, MHADevicePool
    path = cache_path(device_identity("cpu"))
    path.write_text(text)
    select.invalidate()
    dev = MHADevicePool(32, 4, 2, 1, 8, dtype=torch.float16, device="cpu")
    host = HostPool(dev, layout="layer_first", size_tokens=32)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for layer in range(2):
            host.load_to_device_per_layer(dev, torch.arange(8), torch.arange(8, 16), layer)
        host.backup_from_device_all_layer(dev, torch.arange(8), torch.arange(8))
    said = [r.getMessage() for r in caplog.records if r.name == "kvtier" and r.levelno >= logging.WARNING]
    assert len([m for m in said if str(path) in m]) == 1, said
    select.invalidate()
