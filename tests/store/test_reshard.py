"""Pages written by ranks of one TP size and read by ranks of another (1, 2, 4, 8, either
dividing the other, replicated heads included), any host layout on either side, MHA
(split by KV head group), MHA with an indexer, MLA: byte-exact against the model's pages,
nothing outside the pages read written; each rank writes only its own objects; a missing
head-group object is a miss for exactly the readers that need it; any difference of
identity is a miss."""
from __future__ import annotations

import os
import uuid

import pytest

from reshard_support import Model, held_heads, ranks
from redis_support import redis_cluster_url, redis_url  # noqa: F401  (fixtures: the shared servers)
from store_support import LAYOUTS, slots
from kvtier.errors import KvtierError
from kvtier.store.file import object_name
from kvtier.store.tier import StoreTier

TPS = (1, 2, 4, 8)
N = 3                                   # model pages stored
WRITE_PAGES, READ_PAGES = [4, 1, 2], [0, 5, 3]     # host pages they are written from and read into


@pytest.fixture
def url(tmp_path):
    return f"file://{tmp_path}/store"


def _keys(n=N):
    tag = uuid.uuid4().hex[:12]         # the Redis servers are shared by every test
    return [f"page{i}-{tag}" for i in range(n)]


def _write(model, size, layout, url, keys, **kw):
    writers = ranks(model, size, layout, url, pages=6, **kw)
    for r, (hc, tier) in enumerate(writers):
        model.fill(hc, r, size, WRITE_PAGES)
        assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N
    return writers


def _read_all(model, size, layout, url, keys, **kw):
    readers = ranks(model, size, layout, url, pages=6, **kw)
    for r, (hc, tier) in enumerate(readers):
        assert tier.prefetch(keys, slots(READ_PAGES)) == N, f"rank {r} of {size}"
        model.check(hc, r, size, READ_PAGES)
    return readers


@pytest.mark.parametrize("reader", TPS)
@pytest.mark.parametrize("writer", TPS)
@pytest.mark.parametrize("heads", [8, 2, 16])
def test_every_tp_pair_reads_the_same_objects(url, writer, reader, heads):
    model, keys = Model("mha", heads, N), _keys()
    _write(model, writer, "page_first", url, keys)
    _read_all(model, reader, "layer_first", url, keys)


@pytest.mark.parametrize("read_layout", LAYOUTS)
@pytest.mark.parametrize("write_layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mha_v_indexer", "mla", "mla_split_indexer"])
def test_layouts_and_kinds_across_tp(url, kind, write_layout, read_layout):
    model, keys = Model(kind, 8, N, seed=hash((kind, write_layout, read_layout)) % 1000), _keys()
    _write(model, 8, write_layout, url, keys)
    _read_all(model, 2, read_layout, url, keys)
    _read_all(model, 1, write_layout, url, keys)


@pytest.mark.parametrize("store", ["redis", "redis_cluster"])
@pytest.mark.parametrize("kind", ["mha", "mha_v_indexer", "mla"])
@pytest.mark.parametrize("writer,reader", [(8, 2), (2, 8), (4, 1)])
def test_across_tp_on_redis(request, store, kind, writer, reader):
    url = request.getfixturevalue(f"{store}_url")
    model, keys = Model(kind, 8, N), _keys()
    _write(model, writer, "page_first", url, keys)
    _read_all(model, reader, "page_head", url, keys)


def _objects(url):
    """{file name: bytes} of every object of a file store."""
    root = url[len("file://"):]
    return {f"{d}/{f}": os.path.getsize(os.path.join(root, d, f))
            for d in os.listdir(root) if len(d) == 2 for f in os.listdir(os.path.join(root, d))}


@pytest.mark.parametrize("kind", ["mha", "mha_v_indexer", "mla"])
@pytest.mark.parametrize("size,heads", [(2, 8), (4, 8), (8, 2), (1, 16)])
def test_each_rank_writes_only_its_own_objects(tmp_path, kind, size, heads):
    """Each rank's backup writes exactly the objects it is first to hold, of their
    size; together the ranks write each of a page's objects once."""
    model, keys = Model(kind, heads, N), _keys()
    seen = {}
    for r in range(size):
        store = f"file://{tmp_path}/s{r}"
        (hc, tier), = ranks(model, size, "page_first", store, pages=6)[r:r + 1]
        model.fill(hc, r, size, WRITE_PAGES)
        assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N
        mine = _objects(store) if os.path.isdir(store[len("file://"):]) else {}
        want = {}
        for p in keys:
            for k, o, fmt in zip(tier.written_keys(p), *((tier.write.canonical.objects, tier.write.formats)
                                                        if tier.write else ((), ()))):
                want[object_name(k)] = fmt.header_size(k) + o.payload_bytes
                assert k not in seen, f"{k} written by ranks {seen[k]} and {r}"
                seen[k] = r
        assert mine == want, f"rank {r} of {size}"
        tier.close()
    if kind.startswith("mha"):
        groups = min(heads, 8)
        per_page = groups + (kind == "mha_v_indexer")
    else:
        per_page = 1
    assert len(seen) == N * per_page
    payload = {k.rsplit(":", 1)[1] for k in seen}
    assert ("all" in payload) == (kind != "mha")


def test_a_missing_group_is_a_miss_for_the_readers_that_need_it(url):
    model, keys = Model("mha", 8, N), _keys()
    writers = _write(model, 8, "page_first", url, keys)
    gone = writers[3][1].written_keys(keys[1])       # group 3 of page 1
    assert len(gone) == 1 and gone[0].endswith(":h3of8")
    writers[3][1].engine.delete(gone)
    for size in TPS:
        for r, (hc, tier) in enumerate(ranks(model, size, "page_head", url, pages=6)):
            first, n = held_heads(8, r, size)
            needs = first <= 3 < first + n
            got = tier.prefetch(keys, slots(READ_PAGES))
            assert got == (1 if needs else N), f"rank {r} of {size}"
            assert tier.exists(keys) == got
            if not needs:
                model.check(hc, r, size, READ_PAGES)


@pytest.mark.parametrize("change", ["revision", "scales", "dtype", "heads", "layers", "model", "page"])
def test_any_difference_of_identity_is_a_miss(url, change):
    import torch
    model, keys = Model("mha", 8, N), _keys()
    _write(model, 2, "page_first", url, keys, revision="r1")
    same = ranks(model, 4, "page_first", url, pages=6, revision="r1")
    assert all(t.exists(keys) == N for _, t in same)
    kw = {"revision": "r1"}
    other = model
    if change == "revision":
        kw["revision"] = "r2"
    elif change == "scales":
        kw["scales"] = "per-token"
    elif change == "dtype":
        other = Model("mha", 8, N, dtype=torch.bfloat16)
    elif change == "layers":
        kw["layers"] = (0, 4)
    elif change == "model":
        kw["revision"] = None
    hc = other.rank_host(0, 4, "page_first", 6)
    if change == "heads":
        kw["heads"] = 16    # the same rows at TP 4 of a 16-head model: another row shape
        tier = StoreTier(hc.host, url, model="org/model", tp=(0, 8), **kw)
    elif change == "page":
        from pool_support import DeviceCase, HostCase
        dev = DeviceCase("mha", "layers", 2, layers=3, size=8, k=((2, 8), torch.float16), v=((2, 8), torch.float16))
        tier = StoreTier(HostCase(dev.pool, "page_first", "auto", size_tokens=24).host, url,
                         model="org/model", tp=(0, 4), heads=8, **kw)
    else:
        tier = StoreTier(hc.host, url, model="org/model", tp=(0, 4), heads=8, **kw)
    assert tier.exists(keys) == 0
    assert tier.namespace != same[0][1].namespace


def test_heads_that_do_not_fit_the_tp_size_are_refused(url):
    model = Model("mha", 8, N)
    hc = model.rank_host(0, 2, "page_first", 6)       # 4 heads per rank
    with pytest.raises(KvtierError, match="heads=6"):
        StoreTier(hc.host, url, model="m", tp=(0, 2), heads=6)
    with pytest.raises(KvtierError, match="heads=8"):
        StoreTier(hc.host, url, model="m", tp=(0, 4), heads=8)       # TP 4 holds 2 heads, not 4
    with pytest.raises(KvtierError, match="tp="):
        StoreTier(model.rank_host(0, 16, "page_first", 6).host, url, model="m", tp=(0, 16), heads=16)
    with pytest.raises(KvtierError, match="layers="):
        StoreTier(hc.host, url, model="m", tp=(0, 2), layers=(2, 3))
    with pytest.raises(KvtierError, match="revision="):
        StoreTier(hc.host, url, model="m", tp=(0, 2), revision="")


def test_pipeline_stages_read_the_layers_they_own(url):
    """Two stages of a 6-layer model (layers 0-2 and 3-5, 3 layers each) at different TP
    sizes: each stage's readers read its own layers' objects, never the other stage's."""
    keys = _keys()
    stages = {first: Model("mha", 8, N, seed=first) for first in (0, 3)}
    for first, model in stages.items():
        _write(model, 4, "page_first", url, keys, layers=(first, 6))
    for first, model in stages.items():
        readers = _read_all(model, 2, "layer_first", url, keys, layers=(first, 6))
        assert all(k.endswith(f":L{first}-{first + 3}:h{g}of8") for g, k in enumerate(readers[0][1].keys(keys[0])))
    hc = stages[0].rank_host(0, 2, "page_first", 6)
    alone = StoreTier(hc.host, url, model="org/model", tp=(0, 2), heads=8)     # a 3-layer model: another identity
    assert alone.exists(keys) == 0
