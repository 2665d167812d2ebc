"""Library-level refusals of the autotune and output-path code: a cache directory that
cannot be written, a platform whose device is absent, a bad KVTIER_MAX_PROGRAMS each raise
one `KvtierError` naming the variable, argument or path, before anything is timed or
written; what was on disk stays as it was. `kvtier.writable` tries paths rather than
reading permission bits (root passes every ``os.access``)."""
import json
import os
from pathlib import Path

import pytest
import torch

from kvtier.bench.pools import Pools
from kvtier.autotune import cache
from kvtier.autotune.key import DeviceId, TuneKey, device_identity, platform_device
from kvtier.autotune.search import tune
from kvtier.autotune.space import MAX_PROGRAMS_ENV, default_max_programs, max_programs_from_env
from kvtier.autotune.shape import PoolShape, pool_bytes
from kvtier.errors import KvtierError
from kvtier.writable import writable_dir, writable_file

DEV = DeviceId("cpu", "test-cpu", "x86_64", 4)
KEY = TuneKey.of("backup", row_bytes=16, page_size=2, num_rows=4, num_layers=2, crosses_link=True)
ENTRY = {"config": {"num_programs": 1}, "gbps": 1.0}
SHAPE = PoolShape.mha(2, 1, 8, torch.float16, page_size=2)
linux_only = pytest.mark.skipif(not Path("/sys/kernel").is_dir() or not Path("/proc/self").is_dir(),
                                reason="needs Linux's /proc and /sys")


@pytest.fixture
def afile(tmp_path):
    f = tmp_path / "afile"
    f.write_text("kept")
    return f


def _raises(fn, *start):
    with pytest.raises(KvtierError) as e:
        fn()
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and all(s in msg for s in start), msg
    return msg


@pytest.mark.parametrize("where, start", [
    ("file", "KVTIER_CACHE_DIR='{f}': exists and is not a directory"),
    ("under", "KVTIER_CACHE_DIR='{f}/sub': cannot be created (Not a directory)"),
    pytest.param("/proc/kvtier", "KVTIER_CACHE_DIR='/proc/kvtier': cannot be created", marks=linux_only),
    pytest.param("/sys/kernel", "KVTIER_CACHE_DIR='/sys/kernel': cannot be written", marks=linux_only),
])
def test_store_into_an_unwritable_cache_dir_names_it(where, start, afile, monkeypatch):
    d = {"file": str(afile), "under": str(afile / "sub")}.get(where, where)
    monkeypatch.setenv(cache.CACHE_ENV, d)
    _raises(lambda: cache.store(DEV, {KEY: ENTRY}), start.format(f=afile))
    _raises(cache.writable_cache_dir, start.format(f=afile))
    assert afile.read_text() == "kept"


def test_the_cache_dir_is_named_by_the_variable_that_chose_it(afile, monkeypatch):
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(afile))
    _raises(cache.writable_cache_dir, f"XDG_CACHE_HOME/kvtier='{afile}/kvtier': cannot be created")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(afile))
    _raises(cache.writable_cache_dir, f"HOME/.cache/kvtier='{afile}/.cache/kvtier'")


def test_store_to_an_unwritable_path(afile, tmp_path):
    _raises(lambda: cache.store(DEV, {KEY: ENTRY}, path=afile / "c.json"), f"directory of path='{afile}'")
    taken = tmp_path / "taken.json"
    taken.mkdir()                                      # a directory where the file goes
    _raises(lambda: cache.store(DEV, {KEY: ENTRY}, path=taken), f"path='{taken}': cannot be written")
    assert taken.is_dir() and list(taken.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "taken.json", "taken.json.lock"]


def test_store_still_writes_where_it_can(tmp_cache):
    path = cache.store(DEV, {KEY: ENTRY})
    assert json.loads(path.read_text())["entries"][KEY.to_str()]["gbps"] == 1.0
    assert not [p for p in tmp_cache.iterdir() if p.name.startswith(".kvtier-probe")]


class Timer:
    """Counts what the tuner would time; runs nothing."""
    calls = 0

    def __call__(self, fn, config=None):
        Timer.calls += 1
        return 1e-3


def test_tune_refuses_an_unwritable_cache_before_timing(afile, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(afile))
    Timer.calls = 0
    _raises(lambda: tune(SHAPE, pools=Pools, ops=("backup",), sizes=(4,), platform="cpu", timer=Timer(), target=None),
            f"KVTIER_CACHE_DIR='{afile}'")
    assert Timer.calls == 0
    tune(SHAPE, pools=Pools, ops=("backup",), sizes=(4,), platform="cpu", timer=Timer(), target=None, max_programs=1,
         write=False, verify=False)                    # without writing, the cache is not needed
    assert Timer.calls > 0


@pytest.mark.parametrize("platform", [
    "rocm", "npu", "tpu",
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present"))],
    ids=lambda p: f"platform={p}")     # not the bare name: conftest skips items named like a device mark
def test_a_platform_without_its_device_is_named(platform, tmp_cache):
    why = "must be one of" if platform == "tpu" else f"no {platform} device here"
    _raises(lambda: platform_device(platform), f"platform={platform!r}: {why}")
    _raises(lambda: platform_device(platform, "--platform"), f"--platform={platform!r}")
    _raises(lambda: device_identity(platform), f"platform={platform!r}")
    Timer.calls = 0
    _raises(lambda: tune(SHAPE, pools=Pools, ops=("backup",), sizes=(4,), platform=platform, timer=Timer(), target=None),
            f"platform={platform!r}")
    assert Timer.calls == 0 and list(tmp_cache.iterdir()) == []
    assert platform_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("value", ["many", "0", "-3", "2.5"])
def test_a_bad_max_programs_variable_is_named(value, monkeypatch):
    monkeypatch.setenv(MAX_PROGRAMS_ENV, value)
    _raises(max_programs_from_env, f"{MAX_PROGRAMS_ENV}={value!r}: must be a positive int")
    _raises(lambda: default_max_programs(DEV, True), MAX_PROGRAMS_ENV)


def test_max_programs_variable_unset_empty_and_good(monkeypatch):
    monkeypatch.delenv(MAX_PROGRAMS_ENV, raising=False)
    assert max_programs_from_env() is None
    monkeypatch.setenv(MAX_PROGRAMS_ENV, "")
    assert max_programs_from_env() is None
    monkeypatch.setenv(MAX_PROGRAMS_ENV, "7")
    assert max_programs_from_env() == 7 and default_max_programs(DEV, True) == 7


def test_pool_bytes_is_what_pools_allocate():
    from kvtier.bench.pools import Pools
    p = Pools(SHAPE, 3, "cpu")                         # 3 tokens: 2 pages of 2, twice over
    got = sum(t.numel() * t.element_size() for layers in p.device_layers for t in layers)
    assert pool_bytes(SHAPE, 3) == got == 2 * 2 * (2 * 2 * 2) * 16
    assert pool_bytes(SHAPE, 3, layers=5, spare=1) == 5 * 2 * 4 * 16


# ---------------------------------------------------------------- kvtier.writable
def test_writable_file_leaves_what_it_tried_as_it_was(tmp_path, afile):
    before = afile.stat()
    assert writable_file(afile, "--json") == afile
    assert afile.read_text() == "kept" and afile.stat().st_mtime_ns == before.st_mtime_ns
    new = tmp_path / "new.json"
    assert writable_file(str(new), "--json") == new and not new.exists()
    assert writable_dir(tmp_path / "a" / "b", "--out").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "afile"]
    assert list((tmp_path / "a" / "b").iterdir()) == []


@pytest.mark.parametrize("path, fn, why", [
    ("", writable_file, "empty path"), ("", writable_dir, "empty path"),
    ("{tmp}", writable_file, "is a directory"),
    ("{f}/x.json", writable_file, "directory '{f}' is not a directory"),
    ("{tmp}/no/x.json", writable_file, "directory '{tmp}/no' does not exist"),
    ("{f}", writable_dir, "exists and is not a directory"),
    ("{f}/d", writable_dir, "cannot be created (Not a directory)"),
    pytest.param("/proc/kvtier.json", writable_file, "cannot be written", marks=linux_only),
    pytest.param("/proc/version", writable_file, "cannot be written", marks=linux_only),
    pytest.param("/sys/kernel/x.json", writable_file, "cannot be written (Permission denied)", marks=linux_only),
    pytest.param("/sys/kernel", writable_dir, "cannot be written (Permission denied)", marks=linux_only),
    pytest.param("/proc/kvtier/d", writable_dir, "cannot be created", marks=linux_only),
])
def test_unwritable_paths_are_named(path, fn, why, tmp_path, afile):
    path = path.format(tmp=tmp_path, f=afile)
    _raises(lambda: fn(path, "--out"), f"--out={path!r}: {why.format(tmp=tmp_path, f=afile)}")
    assert afile.read_text() == "kept"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_for_a_user(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _raises(lambda: writable_dir(ro, "--out"), "cannot be written")
        _raises(lambda: writable_file(ro / "x.json", "--json"), "cannot be written")
    finally:
        ro.chmod(0o755)
