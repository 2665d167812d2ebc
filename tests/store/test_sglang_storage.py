"""kvtier.store.sglang.KvtierStorage against SGLang 0.5.23 itself (installed by
.ci/sglang.sh): SGLang's own host pools (every layout --hicache-mem-layout can ask for
that SGLang builds on a CPU; MHA, asymmetric MHA, MLA), built through SGLang's own
backend factory (the ``dynamic`` backend, the issue's extra config), on the file store
and on Redis. Every read lands in a poisoned pool and every page is compared with a
plain indexing of SGLang's buffers: the pages read hold the pages written, every other
byte still holds the poison. At the end SGLang's own cache controllers (the
HybridCacheController a server of a plain model runs, and HiCacheController) drive the
backend through their backup and prefetch threads. Skips with one line where SGLang is
not importable."""
from __future__ import annotations

import logging
import os
import random
import threading
import time
import types

import pytest
import torch

from sglang_storage_support import load

mods, why = load()
if mods is None:
    pytest.skip(why, allow_module_level=True)

from sglang_storage_support import (CASES, KIND_LAYOUTS, P, POISON, all_pages, backend, build, head_pages,  # noqa: E402
                                    create, host_pool, page, poison, slots, snapshot, storage_config,
                                    token_rows)
from redis_support import flip_byte, redis_cluster_url, redis_url  # noqa: E402,F401  (fixtures: shared servers)
from kvtier.errors import KvtierError  # noqa: E402
from kvtier.store.file import object_name  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402


def _keys(n):
    return [os.urandom(32).hex() for _ in range(n)]       # SGLang's page keys: sha256 hex


@pytest.fixture(params=["file", "redis"])
def url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/store"
    return request.getfixturevalue("redis_url")


@pytest.fixture
def file_url(tmp_path):
    return f"file://{tmp_path}/store"


def _assert_only(pool, dst, want):
    """Host pages ``dst`` hold ``want``; every other page holds the poison."""
    pages = all_pages(pool)
    for q, got in enumerate(pages):
        if q in dst:
            assert got == want[dst.index(q)], f"page {q} differs from the page written"
        else:
            assert got == bytes([POISON]) * len(got), f"page {q} was written"


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind,layout", CASES, ids=["-".join(c) for c in CASES])
def test_round_trip(url, kind, layout):
    pool = host_pool(kind, layout, seed=CASES.index((kind, layout)))
    be = backend(url, pool)
    src, dst = [5, 1, 2, 9], [3, 7, 8, 20]
    keys = _keys(4)
    want = [page(pool, p) for p in src]
    assert be.batch_set_v1(keys, slots(src)) == [True] * 4
    assert be.batch_exists(keys) == 4
    poison(pool)
    assert be.batch_get_v1(keys, slots(dst)) == [True] * 4
    _assert_only(pool, dst, want)
    assert be.counters()["hits"] == 4 and be.counters()["stored"] == 4
    be.close()


def test_pool_is_adopted_in_place(file_url):
    """kvtier's host pool is SGLang's memory (no copy of the pool), and a
    page_first_direct page moves whole, in place, where a rank's rows are one object
    (MLA; MHA at TP 8, one head group per rank)."""
    for kind, layout in CASES:
        pool = host_pool(kind, layout)
        be = backend(file_url, pool, tp=(0, 8))
        theirs = [t.data_ptr() for t in (pool.kv_buffer if isinstance(pool.kv_buffer, tuple) else [pool.kv_buffer])]
        assert [buf.data_ptr() for _, _, buf in be.host.groups] == theirs, (kind, layout)
        if layout == "page_first_direct":
            from kvtier.store.canonical import modes
            assert set(modes(be.tier.canonical).values()) == {"whole"}, kind


@pytest.mark.parametrize("layout", ["page_first_direct", "page_head"])
def test_128_pages_a_call(file_url, layout):
    """SGLang's largest call (STORAGE_BATCH_SIZE pages), scattered host pages."""
    assert mods["hicache_storage"].STORAGE_BATCH_SIZE == 128
    pool = host_pool("mha", layout, device_tokens=256)     # 129 host pages
    pages = pool.size // P
    be = backend(file_url, pool)
    rng = random.Random(1)
    src, dst = rng.sample(range(pages), 128), rng.sample(range(pages), 128)
    keys = _keys(128)
    want = [page(pool, p) for p in src]
    assert be.batch_set_v1(keys, slots(src)) == [True] * 128
    assert be.batch_exists(keys) == 128
    poison(pool)
    assert be.batch_get_v1(keys, slots(dst)) == [True] * 128
    _assert_only(pool, dst, want)


def test_leading_run(file_url):
    """batch_exists counts the leading run of stored keys; batch_get_v1 reports the
    leading run of pages read, and the missing page's host page is left alone."""
    pool = host_pool("mha", "page_first")
    be = backend(file_url, pool)
    keys = _keys(5)
    src = [0, 1, 2, 3, 4]
    want = [page(pool, p) for p in src]
    stored = [0, 1, 3, 4]
    assert be.batch_set_v1([keys[i] for i in stored], slots(stored)) == [True] * 4
    assert be.batch_exists(keys) == 2
    assert be.batch_exists(keys[3:]) == 2
    assert be.batch_exists(keys[2:3]) == 0
    assert be.batch_exists([]) == 0
    poison(pool)
    dst = [10, 11, 12, 13, 14]
    assert be.batch_get_v1(keys, slots(dst)) == [True, True, False, False, False]
    pages = all_pages(pool)
    assert pages[10] == want[0] and pages[11] == want[1]
    for q, got in enumerate(pages):
        if q not in (10, 11, 13, 14):       # 13, 14: after the first miss, unused by SGLang
            assert got == bytes([POISON]) * len(got), f"page {q} was written"
    assert be.counters()["misses"] == 1


# ---------------------------------------------------------------------- across pools
@pytest.mark.parametrize("kind", sorted(KIND_LAYOUTS))
def test_written_from_one_layout_read_into_another(file_url, kind):
    writer = host_pool(kind, "page_first", seed=3)
    keys = _keys(3)
    src = [2, 6, 7]
    want = [page(writer, p) for p in src]
    assert backend(file_url, writer).batch_set_v1(keys, slots(src)) == [True] * 3
    for layout in KIND_LAYOUTS[kind]:
        reader = host_pool(kind, layout, seed=4)
        poison(reader)
        dst = [1, 0, 11]
        assert backend(file_url, reader).batch_get_v1(keys, slots(dst)) == [True] * 3, layout
        _assert_only(reader, dst, want)


@pytest.mark.parametrize("writer,reader", [(2, 4), (2, 1), (4, 2), (1, 4)])
@pytest.mark.parametrize("layouts", [("page_first", "layer_first"), ("page_head", "page_first_direct")])
def test_heterogeneous_tp_mha(file_url, writer, reader, layouts):
    """A 4-KV-head model: the ranks of one TP size write through SGLang's own host pools,
    the ranks of another read every head they hold, byte-exact; each rank writes only
    its own head groups."""
    heads, keys, src, dst = 4, _keys(3), [1, 2, 3], [7, 8, 9]
    want = {}                       # (model page, head): bytes
    for r in range(writer):
        pool = host_pool("mha", layouts[0], seed=10 + r, heads=heads // writer)
        be = backend(file_url, pool, tp=(r, writer), kv_heads=heads)
        assert be.batch_set_v1(keys, slots(src)) == [True] * 3
        assert len(be.tier.written_keys(keys[0])) == min(heads // writer, 4)
        for q, p in enumerate(src):
            for h, b in enumerate(head_pages(pool, p, heads // writer)):
                want[q, r * (heads // writer) + h] = b
    for r in range(reader):
        pool = host_pool("mha", layouts[1], seed=50 + r, heads=heads // reader)
        poison(pool)
        be = backend(file_url, pool, tp=(r, reader), kv_heads=heads)
        assert be.batch_exists(keys) == 3
        assert be.batch_get_v1(keys, slots(dst)) == [True] * 3
        for q, p in enumerate(dst):
            got = head_pages(pool, p, heads // reader)
            assert got == [want[q, r * (heads // reader) + h] for h in range(heads // reader)], (r, q)
        others = [b for p, b in enumerate(all_pages(pool)) if p not in dst]
        assert all(b == bytes([POISON]) * len(b) for b in others)


def _layer_heads(pool, page_no, heads, first):
    """{(model layer, head): bytes of K and V} of host page ``page_no`` of a stage's MHA
    pool whose first layer is model layer ``first`` and whose rows hold ``heads`` heads
    (head numbers local to the rank)."""
    r = token_rows(pool)[0][:, :, page_no * P:(page_no + 1) * P]       # (2, layers, P, row)
    r = r.unflatten(-1, (heads, -1))
    return {(first + l, h): r[:, l, :, h].contiguous().numpy().tobytes()
            for l in range(r.shape[1]) for h in range(heads)}


@pytest.mark.parametrize("layer_split", [[0, 2, 3, 4, 6], 1])
def test_pipeline_stages_of_another_split(file_url, layer_split):
    """A 6-layer, 4-KV-head model: stages (0-2, 3-5) at TP 2 write through SGLang's own
    host pools (start_layer, end_layer); stages (0-1, 2-3, 4-5) at TP 1, and one stage
    at TP 4, read every layer and head they hold, byte-exact, with the fleet's
    ``layer_split``; without it they miss."""
    heads, keys, src, dst = 4, _keys(3), [1, 2, 3], [7, 8, 9]
    want = {}                       # (model page, layer, model head): bytes
    for first in (0, 3):
        for r in range(2):
            pool = build("mha", "page_first", seed=10 + first + r, heads=2, stage=(first, 3))[1]
            be = backend(file_url, pool, tp=(r, 2), pp=(first // 3, 2), kv_heads=heads, num_layers=6,
                         layer_split=layer_split)
            assert be.batch_set_v1(keys, slots(src)) == [True] * 3
            for q, p in enumerate(src):
                for (layer, h), b in _layer_heads(pool, p, 2, first).items():
                    want[q, layer, 2 * r + h] = b
    for tp, stages in ((1, [(0, 2), (2, 2), (4, 2)]), (4, [(0, 6)])):
        for i, stage in enumerate(stages):
            for r in range(tp):
                pool = build("mha", "page_head", seed=50 + r, heads=heads // tp, stage=stage)[1]
                poison(pool)
                pp = (i, len(stages))
                if stage == (2, 2):        # no writer's object is of its range L2-4 alone
                    alone = backend(file_url, pool, tp=(r, tp), pp=pp, kv_heads=heads, num_layers=6)
                    assert alone.batch_exists(keys) == 0
                be = backend(file_url, pool, tp=(r, tp), pp=pp, kv_heads=heads, num_layers=6,
                             layer_split=layer_split)
                assert be.batch_exists(keys) == 3
                assert be.batch_get_v1(keys, slots(dst)) == [True] * 3
                for q, p in enumerate(dst):
                    got = _layer_heads(pool, p, heads // tp, stage[0])
                    assert got == {(l, h): want[q, l, r * (heads // tp) + h] for l, h in got}, (tp, stage, r, q)
                others = [b for p, b in enumerate(all_pages(pool)) if p not in dst]
                assert all(b == bytes([POISON]) * len(b) for b in others)


def test_layer_split_in_the_extra_config(file_url):
    for bad in (0, "0,3,6", [0, 3.0, 6], [], True):
        with pytest.raises(KvtierError, match="layer_split"):
            create(storage_config(file_url, layer_split=bad), host_pool("mha", "page_first"), register=False)
    cfg = storage_config(file_url, layer_split=[0, 2, 3])
    with pytest.raises(KvtierError, match="num_layers"):
        create(cfg, host_pool("mha", "page_first"))
    with pytest.raises(KvtierError, match="layer_split=.*boundaries 0 and 3"):
        create(storage_config(file_url, layer_split=[0, 2, 4, 6], num_layers=6), host_pool("mha", "page_first"))


def test_mla_written_by_rank_0_read_by_every_rank(file_url):
    keys, src, dst = _keys(3), [1, 2, 3], [7, 8, 9]
    mla0 = host_pool("mla", "page_first", seed=1)
    want = [page(mla0, p) for p in src]
    be0 = backend(file_url, mla0, tp=(0, 4))
    assert be0.batch_set_v1(keys, slots(src)) == [True] * 3
    mla3 = host_pool("mla", "layer_first", seed=2)
    poison(mla3)
    be3 = backend(file_url, mla3, tp=(3, 4))
    assert be3.store_keys(keys[0]) == be0.store_keys(keys[0]) and be3.tier.written_keys(keys[0]) == []
    assert be3.batch_get_v1(keys, slots(dst)) == [True] * 3
    _assert_only(mla3, dst, want)
    assert backend(file_url, mla3, tp=(0, 1)).batch_exists(keys) == 3      # any TP size


def test_servers_differing_only_in_kv_cache_dtype_share_nothing(file_url, caplog):
    """fp8 e4m3 and e5m2 pages are both uint8 in SGLang's host pool: told apart by the
    extra config's kv_cache_dtype (without it, one WARNING says so)."""
    keys = _keys(2)
    e4m3 = host_pool("mha", "page_first", dtype=torch.float8_e4m3fn)
    assert backend(file_url, e4m3, kv_cache_dtype="fp8_e4m3").batch_set_v1(keys, slots([0, 1])) == [True] * 2
    e5m2 = host_pool("mha", "page_first", dtype=torch.float8_e5m2)
    poison(e5m2)
    be = backend(file_url, e5m2, kv_cache_dtype="fp8_e5m2")
    assert be.batch_exists(keys) == 0 and be.batch_get_v1(keys, slots([0, 1])) == [False, False]
    assert all(p == bytes([POISON]) * len(p) for p in all_pages(e5m2))
    assert backend(file_url, host_pool("mha", "page_first", dtype=torch.float8_e4m3fn),
                   kv_cache_dtype="fp8_e4m3").batch_exists(keys) == 2
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        backend(file_url, host_pool("mha", "page_first", dtype=torch.float8_e4m3fn))
    assert any("kv_cache_dtype" in r.getMessage() for r in caplog.records)


def test_identity_options_from_the_extra_config(file_url):
    keys = _keys(2)
    pool = host_pool("mha", "page_first")
    assert backend(file_url, pool, revision="abc").batch_set_v1(keys, slots([0, 1])) == [True] * 2
    assert backend(file_url, host_pool("mha", "page_first"), revision="abc").batch_exists(keys) == 2
    for other in ({"revision": "abd"}, {}, {"revision": "abc", "kv_scales": "per-token"},
                  {"revision": "abc", "kv_heads": 4, "tp": (0, 2)}):
        assert backend(file_url, host_pool("mha", "page_first"), **other).batch_exists(keys) == 0, other
    for key, bad in (("revision", ""), ("kv_heads", 0), ("kv_heads", "8"), ("num_layers", True), ("kv_scales", 3)):
        with pytest.raises(KvtierError, match=f"extra_config\\['{key}'\\]"):
            backend(file_url, host_pool("mha", "page_first"), **{key: bad})


def test_dtypes_and_models_apart(file_url):
    """A bf16 and an fp8 (or fp16) server of one model, or two models, share nothing."""
    keys = _keys(2)
    bf16 = host_pool("mha", "page_first", dtype=torch.bfloat16)
    assert backend(file_url, bf16).batch_set_v1(keys, slots([0, 1])) == [True] * 2
    for dtype in (torch.float8_e4m3fn, torch.float16):       # fp8: SGLang stores it as uint8
        other = host_pool("mha", "page_first", dtype=dtype)
        poison(other)
        be = backend(file_url, other)
        assert be.batch_exists(keys) == 0, dtype
        assert be.batch_get_v1(keys, slots([0, 1])) == [False, False]
        assert all(p == bytes([POISON]) * len(p) for p in all_pages(other))
    assert backend(file_url, host_pool("mha", "page_first"), model_name="other/model").batch_exists(keys) == 0
    assert backend(file_url, host_pool("mha", "page_first"), model="other/model").batch_exists(keys) == 0
    # The "model" key stands in for SGLang's model name: the same namespace.
    assert backend(file_url, host_pool("mha", "page_first"), model_name="x", model="test-org/test-model"
                   ).batch_exists(keys) == 2
    assert backend(file_url, host_pool("mha", "page_head")).batch_exists(keys) == 2


# ---------------------------------------------------------------------- faults
def _damage(url, be, key, how):
    stored = be.store_keys(key)[0]
    if url.startswith("file://"):
        path = os.path.join(be.engine.root, object_name(stored))
        if how == "flip":
            with open(path, "r+b") as f:
                f.seek(-3, os.SEEK_END)
                b = f.read(1)
                f.seek(-3, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x10]))
        else:
            os.truncate(path, os.path.getsize(path) - 1)
    else:
        from redis_support import raw_get, truncate
        if how == "flip":
            flip_byte(url, stored, len(raw_get(url, stored)) - 3)
        else:
            truncate(url, stored, len(raw_get(url, stored)) - 1)


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_page_is_a_miss(url, how, caplog):
    pool = host_pool("mla", "page_first_direct")
    be = backend(url, pool)
    keys = _keys(3)
    want = [page(pool, p) for p in (0, 1, 2)]
    assert be.batch_set_v1(keys, slots([0, 1, 2])) == [True] * 3
    _damage(url, be, keys[1], how)
    poison(pool)
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert be.batch_get_v1(keys, slots([5, 6, 7])) == [True, False, False]
        assert be.batch_get_v1(keys, slots([5, 6, 7])) == [True, False, False]
    assert all_pages(pool)[5] == want[0]
    assert be.batch_exists(keys) == 3           # present, yet never used: it reads as a miss
    assert be.counters()["corrupt"] == 2
    warned = [r.getMessage() for r in caplog.records if r.name == "kvtier"
              and ("CORRUPT" in r.getMessage() or "failed verification" in r.getMessage())]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    # The next backup of the page (here: from host page 5) replaces the damaged object.
    assert be.batch_set_v1(keys[1:2], slots([5])) == [True]
    assert be.batch_get_v1(keys[:2], slots([8, 9])) == [True, True]
    assert all_pages(pool)[9] == want[0]


def test_store_faults_never_raise(file_url):
    pool = host_pool("mha", "page_first")
    be = backend(file_url, pool)
    keys = _keys(2)
    assert be.batch_set_v1(keys, slots([0, 1])) == [True, True]
    before = snapshot(pool)
    be.engine._get_into = lambda *a: (_ for _ in ()).throw(OSError("disk on fire"))
    assert be.batch_get_v1(keys, slots([4, 5])) == [False, False]
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))
    be.close()
    assert be.batch_exists(keys) == 0
    assert be.batch_set_v1(keys, slots([0, 1])) == [False, False]
    assert be.batch_get_v1(keys, slots([4, 5])) == [False, False]


def test_bad_call_arguments_move_nothing(file_url):
    pool = host_pool("mha", "page_first")
    be = backend(file_url, pool)
    keys = _keys(2)
    before = snapshot(pool)
    bad = [(keys, slots([0])),                          # one page for two keys
           (keys, slots([0, 1]) + 1),                   # not whole pages
           (keys, slots([0, pool.size // P])),          # past the pool
           (keys, slots([0, 1]).float()),               # not an index tensor
           ("k", slots([0])), ([keys[0], 7], slots([0, 1]))]
    for k, idx in bad:
        for call in (be.batch_get_v1, be.batch_set_v1):
            with pytest.raises(KvtierError):
                call(k, idx)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))
    assert be.batch_exists(keys) == 0


def test_three_threads_at_once(url):
    """The controller's backup, prefetch and prefetch-I/O threads on one instance."""
    pool = host_pool("mha", "page_first_direct", device_tokens=128)     # 65 pages
    be = backend(url, pool)
    read_keys = _keys(8)
    want = [page(pool, p) for p in range(8)]
    assert be.batch_set_v1(read_keys, slots(range(8))) == [True] * 8
    written, errors = [], []
    rounds = 12

    def backup():
        for _ in range(rounds):
            ks = _keys(8)
            assert be.batch_set_v1(ks, slots(range(8, 16))) == [True] * 8
            written.append(ks)

    def prefetch():
        for _ in range(rounds):
            assert be.batch_get_v1(read_keys, slots(range(16, 24))) == [True] * 8

    def exists():
        for _ in range(rounds * 4):
            assert be.batch_exists(read_keys) == 8

    def run(fn):
        try:
            fn()
        except BaseException as e:      # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f,)) for f in (backup, prefetch, exists)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    pages = all_pages(pool)
    assert pages[16:24] == want
    bk = [page(pool, p) for p in range(8, 16)]
    poison(pool)
    for ks in written:
        assert be.batch_get_v1(ks, slots(range(30, 38))) == [True] * 8
        assert all_pages(pool)[30:38] == bk


# ---------------------------------------------------------------------- construction
def _config_case(tmp_path, case):
    url = f"file://{tmp_path}/store"
    cfgs = {
        "no url": (storage_config(None), "extra_config['url']"),
        "bad scheme": (storage_config("ftp://127.0.0.1/x"), "ftp://127.0.0.1/x"),
        "no scheme": (storage_config("/tmp/store"), "/tmp/store"),
        "unreachable": (storage_config("redis://127.0.0.1:1"), "redis://127.0.0.1:1"),
        "file under a file": (storage_config(f"file://{tmp_path}/f/store"), f"file://{tmp_path}/f/store"),
        "zero timeout": (storage_config(url, timeout_ms=0), "timeout_ms"),
        "str timeout": (storage_config(url, timeout_ms="1000"), "timeout_ms"),
        "bool timeout": (storage_config(url, timeout_ms=True), "timeout_ms"),
        "unknown key": (storage_config(url, timeout=5), "'timeout'"),
        "interface_v1": (storage_config(url, interface_v1=2), "interface_v1"),
        "no model": (storage_config(url, model_name=None), "storage_config.model_name"),
        "empty model": (storage_config(url, model=""), "extra_config['model']"),
        "model not str": (storage_config(url, model=7), "extra_config['model']"),
    }
    return cfgs[case]


@pytest.mark.parametrize("case", ["no url", "bad scheme", "no scheme", "unreachable", "file under a file",
                                  "zero timeout", "str timeout", "bool timeout", "unknown key", "interface_v1",
                                  "no model", "empty model", "model not str"])
def test_bad_config_fails_at_construction(tmp_path, case):
    (tmp_path / "f").write_text("a file, not a directory")
    cfg, named = _config_case(tmp_path, case)
    start = time.monotonic()
    with pytest.raises(KvtierError) as e:
        create(cfg, host_pool("mha", "page_first"), register=False)
    assert named in str(e.value), str(e.value)
    assert time.monotonic() - start < 5


def test_refused_parallelism_at_construction(file_url):
    hs = mods["hicache_storage"]
    base = storage_config(file_url, mla=True, tp=(0, 2))
    dcp = hs.HiCacheStorageConfig(**{**vars(base), "dcp_size": 2, "dcp_rank": 0, "logical_page_size": 2 * P})
    cp = hs.HiCacheStorageConfig(**{**vars(base), "attn_cp_size": 2, "attn_cp_rank": 1})
    for cfg, named in ((dcp, "dcp_size"), (cp, "attn_cp_size")):
        with pytest.raises(KvtierError, match=named):
            create(cfg, host_pool("mla", "page_first"), register=False)


def test_tp_lcm_size_changes_nothing(file_url):
    """SGLang's heterogeneous-TP head split (``tp_lcm_size``, page_head) is accepted: the
    objects are split by head group whatever it says."""
    hs = mods["hicache_storage"]
    keys = _keys(2)
    pool = host_pool("mha", "page_head")
    base = storage_config(file_url, tp=(0, 1))
    split = hs.HiCacheStorageConfig(**{**vars(base), "tp_lcm_size": 4, "should_split_heads": True})
    be = create(split, pool)
    assert be.batch_set_v1(keys, slots([0, 1])) == [True] * 2
    assert backend(file_url, host_pool("mha", "page_first")).batch_exists(keys) == 2


def test_sglang_refuses_dcp_for_third_party_backends():
    """SGLang's own attach refuses L3 with decode context parallelism for any backend
    but its file and Mooncake ones, before the backend is built."""
    import sglang.srt.managers.cache_controller as cc
    from sglang.srt.runtime_context import get_parallel
    ctl = object.__new__(cc.HiCacheController)
    ctl.enable_storage, ctl.host_memory_mode = False, "cache"
    with get_parallel().override(attn_dcp_size=2):
        with pytest.raises(NotImplementedError, match="file or Mooncake"):
            ctl.attach_storage_backend("dynamic", storage_backend_extra_config={})


def test_bad_pool_at_registration(file_url):
    m = mods
    be = create(storage_config(file_url), host_pool("mha", "page_first"), register=False)
    with pytest.raises(KvtierError, match="register_mem_pool_host"):
        be.batch_exists(_keys(1))
    for kind, layout, named in (("mha", "page_unified", "page_unified"),
                                ("mla", "page_first", "is_mla_model")):
        bad = build_unified(kind) if layout == "page_unified" else host_pool(kind, layout)
        with pytest.raises(KvtierError, match=named):
            be.register_mem_pool_host(bad)
    with pytest.raises(KvtierError, match="SimpleNamespace"):
        be.register_mem_pool_host(types.SimpleNamespace(layout="page_first", kv_buffer=torch.zeros(4)))
    mla_be = create(storage_config(file_url, mla=True), host_pool("mla", "page_first"), register=False)
    with pytest.raises(KvtierError, match="page_unified"):
        mla_be.register_mem_pool_host(build_unified("mla"))
    # Still unregistered after refusals; then a good pool, and SGLang's v2 side pools.
    with pytest.raises(KvtierError, match="register_mem_pool_host"):
        be.batch_get_v1(_keys(1), slots([0]))
    pool = host_pool("mha", "page_first")
    be.register_mem_pool_host(pool)
    be.register_mem_host_pool_v2(pool, m["hicache_storage"].PoolName.KV)
    for name in ("mamba", "indexer", "draft"):
        with pytest.raises(KvtierError, match=name):
            be.register_mem_host_pool_v2(host_pool("mha", "page_first"), m["hicache_storage"].PoolName(name))
    assert be.batch_exists(_keys(1)) == 0


def build_unified(kind):
    """SGLang's page_unified host pool (built on a CPU, but no --hicache-mem-layout choice)."""
    m = mods
    mp = m["memory_pool"]
    common = dict(pin_memory=False, device="cpu", device_capacity_tokens=64, start_layer=0, end_layer=3)
    if kind == "mla":
        dev = mp.MLATokenToKVPool(64, P, torch.bfloat16, 16, 8, 3, "cpu", False)
        return m["mla"].MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P,
                                             "page_unified", target_layer_num=3, **common)
    dev = mp.MHATokenToKVPool(64, P, torch.bfloat16, 2, 8, 3, "cpu", False)
    return m["mha"].MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, P,
                                         "page_unified", **common)


# ---------------------------------------------------------------------- legacy calls
@pytest.mark.parametrize("kind,layout", [("mha", "page_head"), ("mha", "layer_first"), ("mla", "page_first")])
def test_legacy_calls(file_url, kind, layout):
    """get/set/batch_get/batch_set/exists with SGLang's flat pages; the objects are the
    v1 calls' objects."""
    pool = host_pool(kind, layout)
    be = backend(file_url, pool, interface_v1=0)
    keys = _keys(11)                           # more than one round of staging pages
    src = list(range(11))
    want = [page(pool, p) for p in src]
    assert be.set(keys[0], pool.get_data_page(0)) is True
    assert be.exists(keys[0]) and not be.exists(keys[1])
    assert be.batch_set(keys[1:], [pool.get_data_page(p * P) for p in src[1:]]) is True
    assert be.batch_exists(keys) == 11
    poison(pool)
    target = pool.get_dummy_flat_data_page()
    assert be.get(keys[3], target) is target
    pool.set_from_flat_data_page(20 * P, target)
    assert page(pool, 20) == want[3]
    # Legacy objects read by the v1 call, and the other way round.
    assert be.batch_get_v1(keys[:2], slots([21, 22])) == [True, True]
    assert all_pages(pool)[21:23] == want[:2]
    other = _keys(1)
    assert be.batch_set_v1(other, slots([21])) == [True]
    targets = [pool.get_dummy_flat_data_page() for _ in range(12)]
    got = be.batch_get(keys + other, targets)
    assert all(g is t for g, t in zip(got, targets))
    for j, t in enumerate(targets):
        pool.set_from_flat_data_page(24 * P, t)
        assert page(pool, 24) == (want + [want[0]])[j]
    # The leading run: None from the first miss on.
    missing = _keys(1)
    got = be.batch_get([keys[0], missing[0], keys[1]], [pool.get_dummy_flat_data_page() for _ in range(3)])
    assert got[0] is not None and got[1:] == [None, None]
    assert be.get(missing[0], pool.get_dummy_flat_data_page()) is None
    with pytest.raises(KvtierError, match="target_locations"):
        be.get(keys[0], torch.zeros(3))


def test_legacy_calls_refused_for_asymmetric_pool(file_url):
    pool = host_pool("mha_asym", "page_first")
    be = backend(file_url, pool)
    with pytest.raises(KvtierError, match="Asymmetric"):
        be.set(_keys(1)[0], torch.zeros(4))


def test_stats_and_clear(file_url, caplog):
    pool = host_pool("mha", "page_first")
    be = backend(file_url, pool)
    keys = _keys(3)
    be.batch_set_v1(keys, slots([0, 1, 2]))
    be.batch_get_v1(keys + _keys(1), slots([4, 5, 6, 7]))
    m = be.get_stats()
    from sglang.srt.observability.metrics_collector import StorageMetrics
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [3] and m.prefetch_pgs == [4]
    assert len(m.prefetch_bandwidth) == 1 and m.prefetch_bandwidth[0] > 0
    assert m.kvtier["hits"] == 3 and m.kvtier["misses"] == 1 and m.kvtier["stored"] == 3
    again = be.get_stats()
    assert again.prefetch_pgs == [] and again.backup_pgs == []
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        assert be.clear() is False
        assert be.clear() is False
    assert len([r for r in caplog.records if "clear()" in r.getMessage()]) == 1
    assert be.batch_exists(keys) == 3


# ---------------------------------------------------------------------- SGLang's controller
class _Controller:
    """SGLang's cache controller over a device pool and its host pool, storage attached
    through the ``dynamic`` backend as SGLang attaches it (its backup, prefetch,
    prefetch-I/O and prefetch-sync threads running). ``hybrid``: the
    HybridCacheController over the one-entry HostPoolGroup that SGLang's
    build_kv_only_stack gives a server of a plain MHA/MLA model; else the base
    HiCacheController (the decode offload manager's)."""

    def __init__(self, dev, host, extra, tp=(0, 1), hybrid=True, pp=(0, 1)):
        from sglang.srt.runtime_context import get_parallel
        self.host, self.hybrid = host, hybrid
        self._scope = get_parallel().override(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1],
                                               attn_dcp_size=1, attn_dcp_rank=0)
        self._scope.__enter__()
        allocator = types.SimpleNamespace(get_kvcache=lambda: dev)
        args = dict(io_backend="direct", storage_backend="dynamic", model_name="test-org/test-model",
                    storage_backend_extra_config=dict(extra))
        try:
            if hybrid:
                from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
                from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
                from sglang.srt.mem_cache.pool_host.group import HostPoolGroup
                group = HostPoolGroup([build_pool_entry(
                    name=mods["hicache_storage"].PoolName.KV, host_pool=host, device_pool=dev,
                    layer_mapping={i: i for i in range(dev.layer_num)}, transfer_layer_id_max=dev.layer_num,
                    is_anchor=True)])
                self.ctl = HybridCacheController(allocator, group, P, None, threading.Event(),
                                                 transfer_layer_id_max=dev.layer_num, **args)
                self.pages = group
            else:
                import sglang.srt.managers.cache_controller as cc
                self.ctl = cc.HiCacheController(allocator, host, P, None, threading.Event(), **args)
                self.pages = host
        except BaseException:
            self._scope.__exit__(None, None, None)
            raise

    def backup(self, pages, tokens=None):
        tokens = tokens or [random.randrange(1 << 20) for _ in range(len(pages) * P)]
        self.ctl.write_storage(slots(pages), tokens, hash_value=get_storage_hash_str(tokens, None, page_size=P))
        op = self.ctl.ack_backup_queue.get(timeout=30)
        return tokens, op.completed_tokens

    def prefetch(self, tokens):
        """The storage hit query, then (as the scheduler does on a hit) host pages and the
        transfer; the acknowledged tokens and the host pages read into."""
        if self.hybrid:
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
            self.ctl.prefetch(CacheRequestHandle("req", 0), tokens)
        else:
            self.ctl.prefetch("req", tokens)
        op = self.ctl.prefetch_hit_queue.get(timeout=30)
        if not op.storage_hit_count:
            return 0, []
        op.host_indices = self.pages.alloc(op.storage_hit_count)
        self.ctl.prefetch_buffer.put(op)
        done = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=30)
            if ack.completed_tokens is not None:
                done = ack.completed_tokens
            if ack.completed_req:
                return done, (op.host_indices[::P] // P).tolist()

    def close(self):
        try:
            self.ctl.detach_storage_backend()
        finally:
            self._scope.__exit__(None, None, None)


@pytest.fixture
def controllers():
    made = []
    yield lambda *a, **k: made.append(_Controller(*a, **k)) or made[-1]
    for c in reversed(made):
        c.close()


CONTROLLER_CASES = [("hybrid", "mha", "page_first", 1), ("hybrid", "mha", "layer_first", 0),
                    ("hybrid", "mla", "page_first_direct", 1), ("hicache", "mha", "page_head", 1),
                    ("hicache", "mla", "layer_first", 0)]


@pytest.mark.parametrize("controller,kind,layout,v1", CONTROLLER_CASES, ids=["-".join(map(str, c))
                                                                            for c in CONTROLLER_CASES])
def test_controller_backup_and_prefetch(file_url, controllers, controller, kind, layout, v1):
    dev, host = build(kind, layout, seed=11)
    extra = storage_config(file_url, interface_v1=v1).extra_config
    c = controllers(dev, host, extra, hybrid=controller == "hybrid")
    be = c.ctl.storage_backend
    assert type(be).__name__ == "KvtierStorage"
    assert (c.ctl.page_get_func.__name__ == "_page_get_zero_copy") == bool(v1)     # v1 calls, else legacy
    src = [int(s) // P for s in host.alloc(4 * P)[::P]]
    want = [page(host, p) for p in src]
    tokens, done = c.backup(src)
    assert done == 4 * P
    # A prefetch of the same tokens and one more page: the 4 stored pages land in new host pages.
    got, pages = c.prefetch(tokens + [1, 2, 3, 4])
    assert got == 4 * P and len(pages) == 4 and not set(pages) & set(src)
    assert [page(host, p) for p in pages] == want
    # A damaged second page: SGLang keeps the first page only.
    _damage(file_url, be, get_storage_hash_str(tokens, None, page_size=P)[1], "flip")
    got, pages = c.prefetch(tokens)
    assert got == P and page(host, pages[0]) == want[0]
    assert be.counters()["corrupt"] == 1


@pytest.mark.parametrize("controller", ["hybrid", "hicache"])
def test_controller_mla_writer_and_readers(file_url, controllers, controller):
    """MLA: SGLang's controller backs pages up from the storage writer (TP rank 0) only;
    every rank's prefetch reads that one copy."""
    extra = storage_config(file_url, mla=True).extra_config
    hybrid = controller == "hybrid"
    dev1, host1 = build("mla", "page_first", seed=1)
    rank1 = controllers(dev1, host1, extra, tp=(1, 2), hybrid=hybrid)
    assert rank1.ctl.backup_skip
    tokens, done = rank1.backup([1, 2])
    assert rank1.ctl.storage_backend.counters().get("stored", 0) == 0
    assert rank1.prefetch(tokens) == (0, [])
    dev0, host0 = build("mla", "layer_first", seed=2)
    rank0 = controllers(dev0, host0, extra, tp=(0, 2), hybrid=hybrid)
    want = [page(host0, p) for p in (1, 2)]
    tokens, done = rank0.backup([1, 2])
    assert done == 2 * P
    poison(host1)
    got, pages = rank1.prefetch(tokens)
    assert got == 2 * P and [page(host1, p) for p in pages] == want


@pytest.mark.parametrize("controller", ["hybrid", "hicache"])
def test_controller_heterogeneous_tp(file_url, controllers, controller):
    """A 4-KV-head model: two TP-2 ranks back pages up through SGLang's controllers and
    host pools; four TP-4 ranks' controllers prefetch them, each its own head."""
    extra = storage_config(file_url, kv_heads=4).extra_config
    hybrid = controller == "hybrid"
    tokens, want = None, {}
    for r in range(2):
        dev, host = build("mha", "page_first", seed=20 + r, heads=2)
        c = controllers(dev, host, extra, tp=(r, 2), hybrid=hybrid)
        src = [int(s) // P for s in host.alloc(3 * P)[::P]]
        tokens, done = c.backup(src, tokens)
        assert done == 3 * P
        for q, p in enumerate(src):
            for h, b in enumerate(head_pages(host, p, 2)):
                want[q, 2 * r + h] = b
    for r in range(4):
        dev, host = build("mha", "layer_first", seed=60 + r, heads=1)
        poison(host)
        c = controllers(dev, host, extra, tp=(r, 4), hybrid=hybrid)
        got, pages = c.prefetch(tokens)
        assert got == 3 * P, f"rank {r} of 4"
        assert [head_pages(host, p, 1)[0] for p in pages] == [want[q, r] for q in range(3)]


@pytest.mark.parametrize("controller", ["hybrid", "hicache"])
def test_controller_survives_a_closed_store(file_url, controllers, controller):
    dev, host = build("mha", "page_first")
    c = controllers(dev, host, storage_config(file_url).extra_config, hybrid=controller == "hybrid")
    c.ctl.storage_backend.close()
    tokens, done = c.backup([1, 2])
    assert done == 0
    assert c.prefetch(tokens) == (0, [])
    assert c.ctl.backup_thread.is_alive() and c.ctl.prefetch_thread.is_alive()


@pytest.mark.parametrize("kind,layout", [("mha", "page_head"), ("mla", "layer_first")])
def test_round_trip_on_a_redis_cluster(request, kind, layout):
    url = request.getfixturevalue("redis_cluster_url")
    pool = host_pool(kind, layout, seed=5)
    be = backend(url, pool)
    keys = _keys(6)                            # spread over the cluster's slots
    src, dst = [0, 3, 4, 8, 9, 10], [20, 21, 22, 23, 1, 2]
    want = [page(pool, p) for p in src]
    assert be.batch_set_v1(keys, slots(src)) == [True] * 6
    assert be.batch_exists(keys) == 6
    poison(pool)
    assert be.batch_get_v1(keys, slots(dst)) == [True] * 6
    _assert_only(pool, dst, want)
    be.close()


def test_bench_script_one_small_round(tmp_path, capsys):
    """bench/scripts/sglang_storage.py: one small round prints a line per layout, page
    size and backend (and checks the pages it read)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "sglang_storage.py"
    spec = importlib.util.spec_from_file_location("sglang_storage_bench", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.run(str(tmp_path), 1, 1)
    assert [(r[0], r[1], r[2]) for r in rows] == [(lay, kib, name) for kib in (256, 1024)
                                                   for lay in script.LAYOUTS for name in ("kvtier", "sglang-file")]
    assert all(r[3] > 0 and r[4] > 0 for r in rows)
    assert len(capsys.readouterr().out.splitlines()) == len(rows)


@pytest.mark.parametrize("controller", ["hybrid", "hicache"])
def test_controller_pipeline_stages_of_another_split(file_url, controllers, controller):
    """A 6-layer, 4-KV-head model: SGLang's controllers of stages 0-2 and 3-5 (TP 2) back
    pages up with the fleet's layer split; the controllers of stages 0-1, 2-3 and 4-5
    (TP 1) prefetch them, every layer and head they hold."""
    extra = storage_config(file_url, kv_heads=4, num_layers=6, layer_split=[0, 2, 3, 4, 6]).extra_config
    hybrid = controller == "hybrid"
    tokens, want = None, {}
    for i, first in enumerate((0, 3)):
        for r in range(2):
            dev, host = build("mha", "page_first", seed=30 + first + r, heads=2, stage=(first, 3))
            c = controllers(dev, host, extra, tp=(r, 2), pp=(i, 2), hybrid=hybrid)
            src = [int(s) // P for s in host.alloc(3 * P)[::P]]
            tokens, done = c.backup(src, tokens)
            assert done == 3 * P, (first, r)
            for q, p in enumerate(src):
                for (layer, h), b in _layer_heads(host, p, 2, first).items():
                    want[q, layer, 2 * r + h] = b
    for i, stage in enumerate(((0, 2), (2, 2), (4, 2))):
        dev, host = build("mha", "layer_first", seed=70 + i, heads=4, stage=stage)
        poison(host)
        c = controllers(dev, host, extra, pp=(i, 3), hybrid=hybrid)
        got, pages = c.prefetch(tokens)
        assert got == 3 * P, f"stage {stage}"
        for q, p in enumerate(pages):
            held = _layer_heads(host, p, 4, stage[0])
            assert held == {(l, h): want[q, l, h] for l, h in held}, (stage, q)
