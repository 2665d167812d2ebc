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
import torch

from reshard_support import Model, held_heads, ranks
from redis_support import redis_cluster_url, redis_url  # noqa: F401  (fixtures: the shared servers)
from pool_support import D, DTYPE, host_layer_view
from store_support import LAYOUTS, PAGE, poison, slots
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


@pytest.mark.parametrize("when", ["landing", "after", "unreported", "mixed"])
def test_a_page_s_objects_are_placed_as_each_lands(url, monkeypatch, when):
    """A reader of several objects per page places each object's heads in its host
    page as soon as that object is read and verified, inside the engine's call, where
    the object stages at least `PLACE_ON_LANDING_MIN` ("landing"); smaller objects, and
    those of an engine that reports nothing, after the call; each once. An object that
    fails verification ends the leading run at its page, whatever of that page was
    placed. "mixed": every other object placed as it lands, the rest after the call."""
    from kvtier.store import tier as tier_module
    if when == "landing":
        monkeypatch.setattr(tier_module, "PLACE_ON_LANDING_MIN", 1)
    reports, inside = when != "unreported", when == "landing"
    model, keys = Model("mha", 8, 4), _keys(4)
    writers = ranks(model, 4, "page_first", url, pages=6)
    for r, (hc, tier) in enumerate(writers):
        model.fill(hc, r, 4, [4, 1, 2, 0])
        assert tier.backup(keys, slots([4, 1, 2, 0])) == [True] * 4
    (hc, tier), = ranks(model, 1, "page_first", url, pages=6)
    m = tier.read.m
    assert m == 8          # one object per KV head group of the model
    if when == "mixed":
        tier.read.place_on_landing = [o % 2 == 0 for o in range(m)]

    def lands(o):
        return inside or (when == "mixed" and o % 2 == 0)
    engine, in_call, placed = tier.engine, [False], []
    real_get, real_place = engine._get_into, tier.canonical.from_staging

    def get_into(keys, targets, landed):
        in_call[0] = True
        try:
            return real_get(keys, targets, landed if reports else (lambda i: None))
        finally:
            in_call[0] = False

    def place(staging, host_pages, first_slot=0, obj=None):
        placed.extend((p, o, in_call[0]) for p in host_pages for o in (range(m) if obj is None else [obj]))
        return real_place(staging, host_pages, first_slot, obj)

    engine._get_into, tier.canonical.from_staging = get_into, place
    read_into = [0, 5, 3, 2]
    assert tier.prefetch(keys, slots(read_into)) == 4
    model.check(hc, 0, 1, read_into)
    assert sorted(placed) == sorted((p, o, lands(o)) for p in read_into for o in range(m))
    # a corrupt group-2 object of page 2: pages 0 and 1 read, page 2 and after not
    _corrupt_group_2_of_page_2(url, tier, keys)
    poison(hc.host)
    placed.clear()
    assert tier.prefetch(keys, slots(read_into)) == 2
    assert tier.stats["corrupt"] == 1
    _check_leading(model, hc)
    # every object placed as it lands that verified (the corrupt one not); the others
    # of the leading run only, after the call
    want = [(p, o, True) for p in read_into for o in range(m) if lands(o) and (p, o) != (3, 2)]
    want += [(p, o, False) for p in read_into[:2] for o in range(m) if not lands(o)]
    assert sorted(placed) == sorted(want)


def _corrupt_group_2_of_page_2(url, tier, keys):
    """Flip the last byte of the file of page 2's group-2 object (its checksum fails)."""
    path = os.path.join(url[len("file://"):], object_name(tier.keys(keys[2])[2]))
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def _check_leading(model, hc):
    """Host pages 0 and 5 hold model pages 0 and 1 (a read of [0, 5, 3, 2] whose third
    page is a miss: the pages after the run hold undefined bytes); margins intact."""
    for name, buf in hc.host.buffers.items():
        for layer in range(model.layers):
            v = host_layer_view(buf, hc.layout, layer, PAGE)
            for hp, mp in ((0, 0), (5, 1)):
                assert torch.equal(v[hp], model.rows[name][layer][mp].reshape(v[hp].shape))
    hc.check_margins()


def _reshard_reader(url, batch_pages=8):
    """Pages 0-3 written by the 4 ranks of TP 4 (page_first), and the TP 1 reader of
    them (8 head-group objects a page): (model, keys, reader's host case, its tier)."""
    model, keys = Model("mha", 8, 4), _keys(4)
    writers = ranks(model, 4, "page_first", url, pages=6)
    for r, (hc, tier) in enumerate(writers):
        model.fill(hc, r, 4, [4, 1, 2, 0])
        assert tier.backup(keys, slots([4, 1, 2, 0])) == [True] * 4
    (hc, tier), = ranks(model, 1, "page_first", url, pages=6, batch_pages=batch_pages)
    return model, keys, hc, tier


def test_a_page_is_placed_beside_the_engine_call_as_its_last_object_lands(url, monkeypatch):
    """Where a call is one batch whose objects are all placed after landing and it
    stages at least `PLACE_BESIDE_MIN`, the thread that waits for its engine call places each page, in
    one copy with all its objects, once its last object has landed and verified (here
    each page as it is ready: `PLACE_BESIDE_RUN`), while the call still runs; each page
    once. A page with a corrupt object is not placed
    (and ends the leading run); a page after it may be, outside the run."""
    import threading
    import time
    from kvtier.store import tier as tier_module
    monkeypatch.setattr(tier_module, "PLACE_BESIDE_MIN", 0)
    monkeypatch.setattr(tier_module, "PLACE_BESIDE_RUN", 1)     # wake for every page
    model, keys, hc, tier = _reshard_reader(url)
    m = tier.read.m
    assert m == 8 and tier.read.places_beside
    engine, in_call, placed = tier.engine, [False], []
    real_get, real_place = engine._get_into, tier.canonical.from_staging

    def get_into(keys, targets, landed):
        def landed_then_wait(i):        # a page's last object: give the waiting thread time to place it
            landed(i)
            if i % m == m - 1 and i // m not in unplaced:
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and not any(e[0] == i // m for e in placed[mark[0]:]):
                    time.sleep(0.001)
        in_call[0] = True
        mark[0] = len(placed)
        try:
            return real_get(keys, targets, landed_then_wait)
        finally:
            in_call[0] = False

    def place(staging, host_pages, first_slot=0, obj=None):
        placed.extend((first_slot + k, p, obj, threading.current_thread() is threading.main_thread(), in_call[0])
                      for k, p in enumerate(host_pages))
        return real_place(staging, host_pages, first_slot, obj)

    mark, unplaced = [0], set()
    engine._get_into, tier.canonical.from_staging = get_into, place
    read_into = [0, 5, 3, 2]
    assert tier.prefetch(keys, slots(read_into)) == 4
    model.check(hc, 0, 1, read_into)
    hc.check_margins()
    # each page once, all its objects in one copy, on the calling thread, during the call
    assert sorted(e[1:] for e in placed) == [(p, None, True, True) for p in sorted(read_into)]
    # a corrupt group-2 object of page 2 (in the second batch where there are two)
    _corrupt_group_2_of_page_2(url, tier, keys)
    poison(hc.host)
    placed.clear()
    unplaced.add(2)                     # waited for in vain
    assert tier.prefetch(keys, slots(read_into)) == 2
    assert tier.stats["corrupt"] == 1
    _check_leading(model, hc)
    # page 2 (host page 3) not placed; page 3 (host page 2) is, though outside the run
    assert sorted(e[1:] for e in placed) == [(p, None, True, True) for p in (0, 2, 5)]


@pytest.mark.parametrize("batch_pages, least, beside", [(8, 0, True), (2, 0, False), (8, None, False)])
def test_only_a_call_of_one_large_enough_batch_places_beside(url, monkeypatch, batch_pages, least, beside):
    """Placing beside the engine call is for calls of one batch (a call of several
    places each batch beside the next one's call) of at least `PLACE_BESIDE_MIN`
    (None: the default, far above these pages); either way every page reads whole."""
    from kvtier.store import tier as tier_module
    if least is not None:
        monkeypatch.setattr(tier_module, "PLACE_BESIDE_MIN", least)
    made = []
    real = tier_module._Landings
    monkeypatch.setattr(tier_module, "_Landings", lambda *a: made.append(a) or real(*a))
    model, keys, hc, tier = _reshard_reader(url, batch_pages)
    read_into = [0, 5, 3, 2]
    assert tier.prefetch(keys, slots(read_into)) == 4
    model.check(hc, 0, 1, read_into)
    hc.check_margins()
    least_pages = -(-tier_module.PLACE_BESIDE_RUN // tier.canonical.slot_bytes)
    assert made == ([(4, 8, least_pages)] if beside else [])      # 4 pages of 8 objects


@pytest.mark.parametrize("change", ["revision", "scales", "dtype", "heads", "layers", "model", "page"])
def test_any_difference_of_identity_is_a_miss(url, change):
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


# Pipeline stages of different splits: a 6-layer model whose servers run stages
# (0, 3, 6), (0, 2, 4, 6) and (0, 6); the store's layer split refines all three.
SPLIT = (0, 2, 3, 4, 6)
STAGE_SPLITS = {"pp2": ((0, 3), (3, 3)), "pp3": ((0, 2), (2, 2), (4, 2)), "pp1": ((0, 6),)}


def _write_stages(model, stages, size, layout, url, keys, **kw):
    for stage in stages:
        for r, (hc, tier) in enumerate(ranks(model, size, layout, url, pages=6, stage=stage,
                                             layer_split=SPLIT, **kw)):
            model.fill(hc, r, size, WRITE_PAGES, stage)
            assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N, f"stage {stage} rank {r}"


def _read_stages(model, stages, size, layout, url, keys):
    for stage in stages:
        for r, (hc, tier) in enumerate(ranks(model, size, layout, url, pages=6, stage=stage, layer_split=SPLIT)):
            assert tier.prefetch(keys, slots(READ_PAGES)) == N, f"stage {stage} rank {r} of {size}"
            model.check(hc, r, size, READ_PAGES, stage=stage)


@pytest.mark.parametrize("reader", ["pp3", "pp1", "pp2"])
@pytest.mark.parametrize("writer", ["pp2", "pp3", "pp1"])
@pytest.mark.parametrize("kind", ["mha", "mla", "dsa"])
def test_stages_of_any_split_read_each_others_pages(url, kind, writer, reader):
    """Writers at TP 4 in one stage split, readers at TP 2 (and TP 1) in another, other
    host layouts: every stage reads exactly its layers, byte for byte."""
    model, keys = Model(kind, 8, N, layers=6, seed=len(writer) + 7 * len(reader)), _keys()
    _write_stages(model, STAGE_SPLITS[writer], 4, "page_first", url, keys)
    _read_stages(model, STAGE_SPLITS[reader], 2, "layer_first", url, keys)
    _read_stages(model, STAGE_SPLITS[reader], 1, "page_first_direct", url, keys)


@pytest.mark.parametrize("store", ["redis", "redis_cluster"])
def test_stages_of_any_split_on_redis(request, store):
    url = request.getfixturevalue(f"{store}_url")
    model, keys = Model("mha", 8, N, layers=6, seed=3), _keys()
    _write_stages(model, STAGE_SPLITS["pp2"], 8, "page_first", url, keys)
    _read_stages(model, STAGE_SPLITS["pp3"], 2, "page_head", url, keys)


def test_a_stage_writes_one_object_per_range_and_group_of_its_layers(tmp_path):
    """A stage of layers 0-2 at TP 4 (heads 2r, 2r + 1) writes, per page, one object
    per range of the split in its layers (0-2, 2-3) and group it holds, of those
    layers' bytes only; the stages together write each object once."""
    model, keys = Model("mha", 8, N, layers=6), _keys()
    seen = {}
    for stage in STAGE_SPLITS["pp2"]:
        for r, (hc, tier) in enumerate(ranks(model, 4, "page_first", f"file://{tmp_path}/s", pages=6,
                                             stage=stage, layer_split=SPLIT)):
            spans = ("L0-2", "L2-3") if stage[0] == 0 else ("L3-4", "L4-6")
            names = [":".join(k.split(":")[-2:]) for k in tier.written_keys(keys[0])]
            assert names == [f"{s}:h{g}of8" for s in spans for g in (2 * r, 2 * r + 1)]
            for o in tier.write.canonical.objects:
                a, b = map(int, o.name[1:].split(":")[0].split("-"))
                assert o.payload_bytes == 2 * (b - a) * PAGE * D * DTYPE.itemsize     # K and V of one head
            for k in keys:
                for key in tier.written_keys(k):
                    assert key not in seen
                    seen[key] = (stage, r)
    assert len(seen) == N * 4 * 8      # 4 ranges x 8 groups per page


def test_a_missing_range_is_a_miss_for_the_stages_that_hold_it(url):
    model, keys = Model("mha", 8, N, layers=6), _keys()
    _write_stages(model, STAGE_SPLITS["pp2"], 2, "page_first", url, keys)
    (_, tier), = ranks(model, 2, "page_first", url, pages=6, stage=(0, 3), layer_split=SPLIT)[:1]
    gone = [k for k in tier.written_keys(keys[1]) if ":L2-3:" in k]
    assert len(gone) == 4
    tier.engine.delete(gone[:1])        # group 0's layer 2 of page 1
    for name, stages in STAGE_SPLITS.items():
        for stage in stages:
            needs = stage[0] <= 2 < stage[0] + stage[1]
            for r, (hc, t) in enumerate(ranks(model, 2, "page_head", url, pages=6, stage=stage, layer_split=SPLIT)):
                needs_rank = needs and r == 0
                assert t.prefetch(keys, slots(READ_PAGES)) == (1 if needs_rank else N), (name, stage, r)
                assert t.exists(keys) == (1 if needs_rank else N)
                if not needs_rank:
                    model.check(hc, r, 2, READ_PAGES, stage=stage)


def test_a_split_that_cuts_components_of_other_layer_counts_is_refused(url):
    model = Model("mha_v_indexer", 8, N, layers=6)       # its indexer holds one layer fewer
    hc = model.rank_host(0, 2, "page_first", 6, stage=(0, 3))
    with pytest.raises(KvtierError, match=r"layer_split=.*one layer count.*\[2, 3\]"):
        StoreTier(hc.host, url, model="m", tp=(0, 2), heads=8, layers=(0, 6), layer_split=SPLIT)
    StoreTier(hc.host, url, model="m", tp=(0, 2), heads=8, layers=(0, 6), layer_split=(0, 3, 6)).close()


def test_the_pool_s_own_range_is_the_default_split(url):
    model, keys = Model("mha", 8, N, layers=6), _keys()
    for stage, split in (((0, 3), (0, 3, 6)), ((0, 6), (0, 6)), ((2, 2), (0, 2, 4, 6))):
        (_, plain), = ranks(model, 2, "page_first", url, pages=6, stage=stage)[:1]
        (_, cut), = ranks(model, 2, "page_first", url, pages=6, stage=stage, layer_split=split)[:1]
        assert plain.keys(keys[0]) == cut.keys(keys[0])


@pytest.mark.parametrize("split,why", [
    ((1, 3, 6), "from 0 to the model's 6"), ((0, 3, 5), "from 0 to the model's 6"),
    ((0, 3, 3, 6), "increasing"), ((0, 4, 6), "boundaries 0 and 3"), ([0, 2.0, 6], "ints"),
    ("0,3,6", "ints"), ((6,), "ints")])
def test_a_bad_layer_split_is_refused(url, split, why):
    model = Model("mha", 8, N, layers=6)
    hc = model.rank_host(0, 2, "page_first", 6, stage=(0, 3))
    with pytest.raises(KvtierError, match="layer_split=") as e:
        StoreTier(hc.host, url, model="m", tp=(0, 2), heads=8, layers=(0, 6), layer_split=split)
    assert why in str(e.value)


def test_a_layer_split_of_n_layers_per_object(url):
    """``layer_split=n``: ranges of n layers from layer 0, the last one short; stages
    whose boundaries are multiples of n (or the model's end) share pages."""
    model, keys = Model("mha", 8, N, layers=6, seed=5), _keys()
    for r, (hc, tier) in enumerate(ranks(model, 2, "page_first", url, pages=6, stage=(0, 4), layer_split=4)):
        model.fill(hc, r, 2, WRITE_PAGES, (0, 4))
        assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N
        assert {k.split(":")[-2] for k in tier.written_keys(keys[0])} == {"L0-4"}
    for r, (hc, tier) in enumerate(ranks(model, 2, "page_first", url, pages=6, stage=(4, 2), layer_split=4)):
        model.fill(hc, r, 2, WRITE_PAGES, (4, 2))
        assert tier.backup(keys, slots(WRITE_PAGES)) == [True] * N
    for r, (hc, tier) in enumerate(ranks(model, 4, "layer_first", url, pages=6, layer_split=4)):
        assert [k.split(":")[-2] for k in tier.keys(keys[0])] == ["L0-4", "L0-4", "L4-6", "L4-6"]   # 2 groups each
        assert tier.prefetch(keys, slots(READ_PAGES)) == N
        model.check(hc, r, 4, READ_PAGES)
    hc = model.rank_host(0, 2, "page_first", 6, stage=(0, 3))
    for bad in (0, -2, True):
        with pytest.raises(KvtierError, match="layer_split="):
            StoreTier(hc.host, url, model="m", tp=(0, 2), heads=8, layers=(0, 6), layer_split=bad)
    with pytest.raises(KvtierError, match="boundaries 0 and 3"):
        StoreTier(hc.host, url, model="m", tp=(0, 2), heads=8, layers=(0, 6), layer_split=2)
