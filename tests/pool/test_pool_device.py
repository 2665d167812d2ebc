"""Device pools: storage forms, adoption, gather/scatter, CPU copies and the
prefill-decode layout check, bit-exact against plain torch indexing."""
import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.pool import CpuCopy, IndexerSpec, MHADevicePool, MLADevicePool, TransferLayout
from pool_support import KINDS, DeviceCase, assert_same, dev_rows, moved_dev_rows, pages_to_slots, put_dev_rows


def test_allocated_pools_describe_their_memory():
    stacked = MHADevicePool(16, 4, 3, 2, 8, dtype=torch.float16, storage="stacked")
    assert [n for n, _ in stacked.groups] == [("k", "v")]          # one launch for K and V
    assert stacked.tables == {} and not stacked.groups[0][1].is_table
    assert stacked.buffers["k"].shape == (3, 4, 4, 2, 8)
    layers = MHADevicePool(16, 4, 3, 2, 8, v_head_dim=4, dtype=torch.float16,
                           indexer=IndexerSpec(num_layers=2, index_head_dim=16))
    assert [n for n, _ in layers.groups] == [("k",), ("v",), ("index_k",), ("index_scale",)]
    assert set(layers.tables) == {"k", "v", "index_k", "index_scale"}
    assert layers.tables["k"].tolist() == [t.data_ptr() for t in layers.buffers["k"]]
    assert layers.components["index_scale"].num_layers == 2
    mla = MLADevicePool(16, 4, 2, 12, 4, split=True, storage="stacked", start_layer=5)
    assert list(mla.components) == ["latent", "rope"] and (mla.start_layer, mla.end_layer) == (5, 7)
    with pytest.raises(KvtierError, match="storage='rows'"):
        MHADevicePool(16, 4, 3, 2, 8, storage="rows")
    with pytest.raises(KvtierError, match="size=10"):
        MHADevicePool(10, 4, 3, 2, 8)
    with pytest.raises(KvtierError, match="head_num=0"):
        MHADevicePool(16, 4, 3, 0, 8)


@pytest.mark.parametrize("pages", [False, True])
@pytest.mark.parametrize("storage", ["layers", "stacked"])
@pytest.mark.parametrize("kind", KINDS)
def test_gather_then_scatter(kind, storage, pages):
    P = 4
    dev = DeviceCase(kind, storage, P, size=24)
    page_ids = torch.tensor([4, 1, 5])
    slots = pages_to_slots(page_ids, P) if pages else torch.tensor([9, 2, 17, 3, 23])
    idx = page_ids if pages else slots
    original = dev.snapshot()
    got = dev.pool.gather(idx, pages=pages)
    assert_same(dev.model, original, "device after gather")
    for name, layers in dev.model.items():
        want = torch.stack([dev_rows(t, slots) for t in layers])
        assert got[name].shape[:2 + pages] == ((len(layers), 3, P) if pages else (len(layers), 5))
        assert torch.equal(got[name].view(torch.uint8).reshape(len(layers), slots.numel(), -1), want), name

    # Scatter into other slots (fresh tensors, not gather's views) and back to the same ones.
    dst_pages = torch.tensor([0, 3, 2])
    dst_slots = pages_to_slots(dst_pages, P) if pages else torch.tensor([0, 5, 11, 12, 20])
    dev.pool.scatter(dst_pages if pages else dst_slots, {n: t.clone() for n, t in got.items()}, pages=pages)
    assert_same(dev.model, moved_dev_rows(original, original, slots, dst_slots), "device after scatter")
    dev.check_margins()


@pytest.mark.parametrize("chunk_size", [4, 3, 100])
@pytest.mark.parametrize("storage", ["layers", "stacked"])
@pytest.mark.parametrize("kind", ["mha_v_indexer", "mla"])
def test_cpu_copy_round_trip(kind, storage, chunk_size):
    dev = DeviceCase(kind, storage, 4, size=24)
    idx = torch.tensor([3, 17, 4, 5, 22, 0, 9, 10])
    original = dev.snapshot()
    copy = dev.pool.get_cpu_copy(idx, chunk_size=chunk_size)
    assert isinstance(copy, CpuCopy) and len(copy.chunks) == -(-8 // chunk_size)
    assert all(t.device.type == "cpu" for c in copy.chunks for t in c)
    for names, _ in dev.pool.groups:   # poison the rows, then restore them
        for name in names:
            for t in dev.model[name]:
                put_dev_rows(t, idx, torch.full_like(dev_rows(t, idx), 0xA5))
    dev.pool.load_cpu_copy(copy, idx)
    assert_same(dev.model, original, "device after load_cpu_copy")
    # Loading into other slots moves exactly those rows.
    other = torch.tensor([1, 2, 6, 7, 8, 11, 12, 13])
    dev.pool.load_cpu_copy(copy, other)
    assert_same(dev.model, moved_dev_rows(original, original, idx, other), "device after load into other slots")
    dev.check_margins()


def test_bad_gather_scatter_and_cpu_copy_input_moves_nothing():
    dev = DeviceCase("mha_v_indexer", "layers", 4, size=24)
    before = dev.snapshot()
    data = dev.pool.gather(torch.tensor([1, 2]))
    copy = dev.pool.get_cpu_copy(torch.tensor([1, 2, 3]), chunk_size=2)
    bad = [
        (lambda: dev.pool.gather(torch.tensor([24])), "indices=24"),
        (lambda: dev.pool.gather(torch.tensor([6]), pages=True), "indices=6"),
        (lambda: dev.pool.scatter(torch.tensor([1, 2, 3]), data), r"data\['k'\]"),
        (lambda: dev.pool.scatter(torch.tensor([1, 2]), {"k": data["k"]}), "data"),
        (lambda: dev.pool.scatter(torch.tensor([1, -2]), data), "indices=-2"),
        (lambda: dev.pool.load_cpu_copy(copy, torch.tensor([1, 2])), "indices"),
        (lambda: dev.pool.load_cpu_copy(copy, torch.tensor([1, 2, 99])), "indices=99"),
        (lambda: dev.pool.load_cpu_copy("copy", torch.tensor([1, 2, 3])), "copy"),
        (lambda: dev.pool.get_cpu_copy(torch.tensor([1]), chunk_size=0), "chunk_size=0"),
    ]
    for call, match in bad:
        with pytest.raises(KvtierError, match=match):
            call()
        assert_same(dev.model, before, f"device after {match}")


def test_check_transfer_layout():
    pool = MHADevicePool(16, 4, 3, 2, 8, dtype=torch.float16)
    local = pool.transfer_layout(attn_tp_size=2)
    assert local == TransferLayout(item_bytes=(128, 128), num_layers=3, attn_tp_size=2, num_regions=6)
    assert pool.transfer_layout(by_page=False).item_bytes == (32, 32)
    pool.check_transfer_layout(local, attn_tp_size=2)
    pool.check_transfer_layout(local.to_dict(), attn_tp_size=2)       # as received from a peer
    peers = {
        "item_bytes": MHADevicePool(16, 4, 3, 2, 16, dtype=torch.float16).transfer_layout(attn_tp_size=2),
        "num_layers": MHADevicePool(16, 4, 4, 2, 8, dtype=torch.float16).transfer_layout(attn_tp_size=2),
        "attn_tp_size": local.__class__(**{**local.to_dict(), "attn_tp_size": 4}),
        "num_regions": MHADevicePool(16, 4, 3, 2, 8, dtype=torch.float16,
                                     indexer=IndexerSpec(1, 16)).transfer_layout(attn_tp_size=2),
    }
    for field, remote in peers.items():
        if field == "num_regions":   # the indexer also adds item sizes; check the count alone
            remote = {**local.to_dict(), "num_regions": remote.num_regions}
        with pytest.raises(KvtierError, match=f"remote.{field}"):
            pool.check_transfer_layout(remote, attn_tp_size=2)
    with pytest.raises(KvtierError, match="lacks 'num_regions'"):
        pool.check_transfer_layout({"item_bytes": (128, 128), "num_layers": 3, "attn_tp_size": 2}, attn_tp_size=2)


def test_gather_into_out_is_checked_again_when_out_changes():
    """gather(out=) checks ``out`` once while the same tensors come back; another dict of
    the right shapes that is no gather result is refused, and the kept one still works."""
    pool = MHADevicePool(16, 4, 2, 2, 8, dtype=torch.float16, storage="layers")
    for t in pool.buffers["k"] + pool.buffers["v"]:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    idx = torch.tensor([1, 3])
    out = pool.gather(idx, pages=True)
    again = pool.gather(torch.tensor([2, 0]), pages=True, out=out)
    assert again is out
    stranger = {n: torch.empty_like(t) for n, t in out.items()}
    with pytest.raises(KvtierError, match=r"out\['k'\]"):
        pool.gather(idx, pages=True, out=stranger)
    pool.gather(idx, pages=True, out=out)
    want = pool.gather(idx, pages=True)
    assert all(torch.equal(out[n].view(torch.uint8), want[n].view(torch.uint8)) for n in out)


def test_gather_results_and_scatter_inputs_are_not_kept_alive():
    """A gather's new result buffers (and a scatter's input) are the caller's: once the
    caller drops them, kvtier holds no reference (no map or bound copy kept for them)."""
    import gc
    import weakref
    pool = MHADevicePool(16, 4, 2, 2, 8, dtype=torch.float16, storage="layers")
    refs = []
    for i in range(3):
        out = pool.gather(torch.tensor([i, 3 - i]), pages=True)
        pool.scatter(torch.tensor([3 - i, i]), out, pages=True)
        refs += [weakref.ref(t) for t in out.values()]
        refs += [weakref.ref(t._base) for t in out.values() if t._base is not None]
        del out
    gc.collect()
    assert all(r() is None for r in refs), "kvtier keeps gather results alive"


@pytest.mark.parametrize("pages", [False, True])
def test_new_gather_buffers_reuse_their_layout_and_are_right(monkeypatch, pages):
    """A gather into new buffers of a shape seen before builds no map: its copies are bound
    to the shape's layout and each call hands over its new buffers. Every result is the
    pool's rows, bit for bit."""
    from kvtier.kernels import RowMap
    pool = MHADevicePool(32, 4, 2, 2, 8, dtype=torch.float16, storage="layers")
    for t in pool.buffers["k"] + pool.buffers["v"]:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    P = pool.page_size

    def want(idx):
        slots = (idx[:, None] * P + torch.arange(P)).reshape(-1) if pages else idx
        return {n: torch.stack([t.view(-1, 2, 8)[slots] for t in pool.buffers[n]]) for n in ("k", "v")}

    first = torch.tensor([1, 6, 3])
    pool.gather(first, pages=pages)
    built = []
    real = RowMap.from_stacked.__func__
    monkeypatch.setattr(RowMap, "from_stacked", classmethod(lambda cls, *a, **k: built.append(1) or real(cls, *a, **k)))
    for idx in (torch.tensor([0, 2, 5]), torch.tensor([7, 4, 1])):
        got = pool.gather(idx, pages=pages)
        for n, w in want(idx).items():
            g = got[n].reshape(w.shape)
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), n
    assert built == [], "a map was built for a shape whose layout is kept"


@pytest.mark.parametrize("storage", ["layers", "stacked"])
@pytest.mark.parametrize("pages", [False, True])
def test_scatters_of_a_shape_seen_before_reuse_its_layout_and_are_right(monkeypatch, pages, storage):
    """A scatter of new data (a gather's result, or fresh tensors) of a shape seen before
    builds no map: its copies are bound to the shape's layout and each call hands over its
    buffers. Data not laid out as the layout assumes (here misaligned) takes maps of its
    own. Every scatter writes exactly its rows, bit for bit."""
    from kvtier.kernels import RowMap
    from kvtier.kernels.ops import SCATTER
    from kvtier.pool.gather import move_groups
    pool = MHADevicePool(32, 4, 2, 2, 8, dtype=torch.float16, storage=storage)
    P = pool.page_size
    layers = lambda: [t.view(-1, 2, 8) for t in (  # noqa: E731
        pool.buffers["k"] + pool.buffers["v"] if storage == "layers"
        else [pool.buffers[n][layer] for n in ("k", "v") for layer in range(2)])]
    for t in layers():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    slots_of = lambda idx: (idx[:, None] * P + torch.arange(P)).reshape(-1) if pages else idx  # noqa: E731

    def data(n):
        return {c: torch.randn(2, n * (P if pages else 1), 2, 8).to(torch.float16).view(
            2, *((n, P) if pages else (n,)), 2, 8) for c in ("k", "v")}

    def scattered(idx, d, scatter):
        before = [t.clone() for t in layers()]
        scatter(idx, d)
        s = slots_of(idx)
        for i, (t, b) in enumerate(zip(layers(), before)):
            want = b.clone()
            want[s] = d["k" if i < 2 else "v"][i % 2].reshape(-1, 2, 8)
            assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), i

    scattered(torch.tensor([1, 6, 3]), data(3), lambda i, d: pool.scatter(i, d, pages=pages))
    pool.gather(torch.tensor([0, 1, 2]), pages=pages)            # (a gather's own layout, made once)
    built = []
    real = RowMap.from_stacked.__func__
    monkeypatch.setattr(RowMap, "from_stacked", classmethod(lambda cls, *a, **k: built.append(1) or real(cls, *a, **k)))
    for idx in (torch.tensor([0, 2, 5]), torch.tensor([7, 4, 1])):
        scattered(idx, data(3), lambda i, d: pool.scatter(i, d, pages=pages))
        scattered(idx, pool.gather(torch.tensor([6, 3, 0]), pages=pages), lambda i, d: pool.scatter(i, d, pages=pages))
    assert built == [], "a map was built for a shape whose layout is kept"
    # The same bytes, 2 bytes past an aligned start: bound to maps of their own.
    d = data(3)
    odd = []
    for b in (torch.stack([d[n] for n in names]) for names, _ in pool.groups):
        raw = torch.empty(b.numel() * 2 + 64, dtype=torch.uint8)
        o = raw[2:2 + b.numel() * 2].view(torch.float16).view(b.shape)
        o.copy_(b)
        odd.append(o)
    idx = torch.tensor([5, 2, 7])
    scattered(idx, d, lambda i, _: move_groups(pool, i, odd, pages, SCATTER, into_pool=True))
    assert built, "misaligned data took the layout's copies"


def test_gather_out_mutated_in_place_is_checked_again():
    """The same ``out`` dict with one of its tensors replaced is checked again (and refused
    when the new tensor is no gather result); a new index count rebinds and stays exact."""
    pool = MHADevicePool(32, 4, 2, 2, 8, dtype=torch.float16, storage="layers")
    for t in pool.buffers["k"] + pool.buffers["v"]:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    out = pool.gather(torch.tensor([1, 3]), pages=True)
    pool.gather(torch.tensor([2, 0]), pages=True, out=out)
    saved = out["v"]
    out["v"] = torch.empty_like(saved)
    with pytest.raises(KvtierError, match=r"out\['v'\]"):
        pool.gather(torch.tensor([2, 0]), pages=True, out=out)
    out["v"] = saved
    for idx in (torch.tensor([5, 4]), torch.tensor([7, 6, 0]), torch.tensor([6, 1])):
        if idx.numel() != 2:
            with pytest.raises(KvtierError, match="out"):
                pool.gather(idx, pages=True, out=out)
            continue
        pool.gather(idx, pages=True, out=out)
        want = pool.gather(idx, pages=True)
        assert all(torch.equal(out[n].view(torch.uint8), want[n].view(torch.uint8)) for n in out)


@pytest.mark.parametrize("call", ["gather", "host per-layer load"])
def test_an_index_list_reshaped_in_place_is_checked_again(call):
    """A list's shape check is kept while the tensor is unchanged; ``resize_`` in place
    (a new version) is checked again and refused by name, with no byte moved."""
    from kvtier.pool import HostPool
    pool = MHADevicePool(32, 4, 2, 2, 8, dtype=torch.float16, storage="layers")
    host = HostPool(pool, layout="layer_first", size_tokens=32, pin_memory=False, strategy="kernel")
    idx = torch.tensor([4, 5, 6, 7])
    run = (lambda i: pool.gather(i)) if call == "gather" else \
        (lambda i: host.load_to_device_per_layer(pool, i, i, 0))
    run(idx)
    run(idx)
    before = [t.clone() for t in pool.buffers["k"] + pool.buffers["v"]]
    idx.resize_(2, 2)
    with pytest.raises(KvtierError, match=r"indices\.shape=\(2, 2\)"):
        run(idx)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(before, pool.buffers["k"] + pool.buffers["v"]))


def test_index_lists_do_not_keep_a_pool_alive():
    """What a list's facts keep about the pools it was checked for does not hold them."""
    import gc
    import weakref
    from kvtier.pool import HostPool
    idx = torch.tensor([0, 1, 2, 3])
    pool = MHADevicePool(16, 4, 2, 2, 8, dtype=torch.float16, storage="layers")
    host = HostPool(pool, layout="layer_first", size_tokens=16, pin_memory=False, strategy="kernel")
    pool.gather(idx)
    host.load_to_device_per_layer(pool, idx, idx, 0)
    refs = [weakref.ref(pool), weakref.ref(host)]
    del pool, host
    gc.collect()
    assert all(r() is None for r in refs), "an index list's facts keep a pool alive"


