"""The hot-path lookup: exact key, nearest bucket, shipped default, one read per process."""
import pytest

from autotune_support import logs_warning

from kvtier.autotune import cache, select, select_config, resolve
from kvtier.autotune.cache import cache_path, store
from kvtier.autotune.key import TuneKey, device_identity
from kvtier.kernels import CopyConfig, default_config

A = CopyConfig(num_programs=2, rows=16, block_bytes=1024, num_warps=1, strategy="dma")
B = CopyConfig(num_programs=1, rows=64, block_bytes=4096, num_warps=1, strategy="kernel")
C = CopyConfig(num_programs=2, rows=64, block_bytes=256, num_warps=2, strategy="kernel")


@pytest.fixture
def tuned(tmp_cache):
    """A cache for this machine's CPU holding backup results for 16 and 1024 rows of 2 layers
    and for 16 rows of 8 layers."""
    dev = device_identity("cpu")
    k = lambda n, layers=2: TuneKey.of("backup", row_bytes=256, page_size=4, num_rows=n, num_layers=layers,
                                       crosses_link=True)
    store(dev, {k(16): {"config": A.to_dict()}, k(1024): {"config": B.to_dict()},
                k(16, 8): {"config": C.to_dict()}})
    return dev


def ask(n, layers=2, op="backup", row_bytes=256, page_size=4, device_name="", platform="cpu", link=True):
    return resolve(op, platform, row_bytes=row_bytes, page_size=page_size, num_rows=n, num_layers=layers,
                   crosses_link=link, device_name=device_name)


def test_exact_key(tuned):
    assert ask(16) == (A, "exact")
    assert ask(9) == (A, "exact")          # 9 rows fall in the 16 bucket
    assert ask(1000) == (B, "exact")
    assert ask(16, layers=8) == (C, "exact")


def test_nearest_bucket(tuned):
    assert ask(32) == (A, "nearest")       # one power of two from 16, six from 1024
    assert ask(300) == (B, "nearest")      # 512 bucket
    assert ask(128) == (B, "nearest")      # three from either: the larger bucket wins the tie
    assert ask(16, layers=4) == (C, "nearest")   # one power of two of layers from 8, one from 2: 8 wins
    assert ask(16, layers=1) == (A, "nearest")
    # the other link setting: used when nothing else is tuned (CPU pools see no link)
    assert ask(16, link=False) == (A, "nearest")
    assert ask(1024, link=False) == (B, "nearest")


def test_default_when_nothing_of_the_family_is_tuned(tuned):
    want = default_config("cpu", crosses_link=True)
    assert ask(16, op="load") == (want, "default")
    assert ask(16, row_bytes=512) == (want, "default")
    assert ask(16, page_size=1) == (want, "default")
    assert ask(16, device_name="some other device") == (want, "default")
    # a platform with no device here cannot name one: the shipped default, no crash
    assert ask(16, platform="npu") == (default_config("npu", crosses_link=True), "default")


def test_the_same_link_setting_wins_over_a_closer_bucket(tuned):
    k = TuneKey.of("backup", row_bytes=256, page_size=4, num_rows=1 << 20, num_layers=2, crosses_link=False)
    store(tuned, {k: {"config": C.to_dict()}})
    select.invalidate()
    assert ask(16, link=False) == (C, "nearest")
    assert ask(1 << 20) == (B, "nearest")


def test_named_device_matches_its_file(tuned):
    assert ask(16, device_name=tuned.name) == (A, "exact")


def test_select_config_reads_the_file_once_and_memoises(tuned, monkeypatch):
    reads = []
    real = cache.load
    monkeypatch.setattr(cache, "load", lambda *a, **k: reads.append(1) or real(*a, **k))
    for _ in range(3):
        for n in (1, 9, 16, 32, 1000, 5000):
            cfg = select_config("backup", "cpu", row_bytes=256, page_size=4, num_rows=n, num_layers=2,
                                crosses_link=True)
            assert cfg == (A if n <= 32 else B)
    assert len(reads) == 1
    # memoised per bucket: the answer is a dictionary hit from now on
    assert len(select._RESOLVED) == 5


def test_invalidate_rereads(tuned):
    kw = dict(row_bytes=256, page_size=4, num_rows=16, num_layers=2, crosses_link=True)
    assert select_config("backup", "cpu", **kw) == A
    store(tuned, {TuneKey.of("backup", **kw): {"config": B.to_dict()}})
    assert select_config("backup", "cpu", **kw) == A     # no file I/O on the hot path
    select.invalidate()
    assert select_config("backup", "cpu", **kw) == B


def test_corrupt_cache_gives_defaults_with_a_warning(tuned, caplog):
    cache_path(tuned).write_text("{corrupt")
    select.invalidate()
    with logs_warning(caplog, "corrupt JSON"):
        cfg = select_config("backup", "cpu", row_bytes=256, page_size=4, num_rows=16, num_layers=2,
                            crosses_link=True)
    assert cfg == default_config("cpu", crosses_link=True)
