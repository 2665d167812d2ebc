"""The dma strategy's chunked, overlapped path (pool/dma.py): bit-exact round trips with
forced small chunks (many chunks through a ring of staging slots), poisoned and guarded
host and device buffers, one staging ring reused across calls of different sizes, plans
kept by host index values, and a backup whose device-side verdict is bad changing no
host byte. GPU cases carry the ``cuda`` marker."""
import random

import pytest
import torch

from helpers import POISON
from kvtier.bounded import Bounded
from kvtier.kernels import KvtierError, LAYOUTS, RowMap
from kvtier.kernels.layouts import host_layout
from kvtier.kernels.ops import BACKUP
from kvtier.pool import HostPool, MHADevicePool, dma
from kvtier.pool.dma_copies import chunks_of, runs, runs_of, split_runs
from pool_support import DeviceCase, HostCase, assert_same, backup_then_load_all, expected_backup, pages_to_slots


@pytest.fixture
def chunks(monkeypatch):
    """``chunks(chunk_bytes, slots)`` sets the dma configuration for the test; the test
    starts with no staging ring."""
    monkeypatch.setattr(dma, "_STREAM_STAGING", Bounded(16))
    old = dma.configure(None)
    yield lambda chunk_bytes, slots=2: dma.configure(dma.DmaConfig(chunk_bytes=chunk_bytes, slots=slots))
    dma.configure(old)


# chunk_bytes: 1 (one unit per chunk: every run split), a few units through three slots,
# the default (one chunk). K, V and the indexer rows move as separate groups.
CHUNKINGS = [(1, 2, l, p) for l in LAYOUTS for p in (1, 4) if p == 1 or host_layout(l).paged] + \
    [(700, 3, l, p) for l in LAYOUTS for p in (1, 4)] + [(None, 2, "page_first", 4)]


@pytest.mark.parametrize("chunk_bytes,slots,layout,page_size", CHUNKINGS,
                         ids=lambda v: str(v))
def test_round_trip_through_chunks(chunks, layout, page_size, chunk_bytes, slots):
    kind = "mha_v_indexer"
    if chunk_bytes is not None:
        chunks(chunk_bytes, slots)
    gen = torch.Generator().manual_seed(hash((kind, layout, page_size, chunk_bytes)) % 2**31)
    dev = DeviceCase(kind, "stacked", page_size, size=12 * page_size, gen=gen)
    hc = HostCase(dev.pool, layout, "dma")
    host = hc.host
    hslots = host.alloc(8 * page_size)
    keep = torch.cat([hslots[5 * page_size:], hslots[:3 * page_size]])      # two runs, out of order
    pages = torch.randperm(12, generator=gen)
    didx, didx2 = pages_to_slots(pages[:6], page_size), pages_to_slots(pages[6:], page_size)
    _, _, want = backup_then_load_all(hc, dev, keep, didx, didx2)

    for layer in random.Random(3).sample(range(dev.pool.num_layers), dev.pool.num_layers):
        for t in dev.model.values():
            if layer < len(t):
                t[layer].view(torch.uint8).reshape(t[layer].shape[0], -1)[didx2] = POISON
        host.load_to_device_per_layer(dev.pool, keep, didx2, layer)
    assert_same(dev.model, want, "device after per-layer loads")
    hc.check_margins()
    dev.check_margins()


def test_split_runs_covers_every_unit_once():
    rnd = random.Random(5)
    for _ in range(50):
        units = torch.tensor(rnd.sample(range(64), rnd.randint(1, 40)))
        for cap in (1, 2, 3, 7, 64):
            parts = split_runs(runs(units), cap)
            assert len(parts) == -(-units.numel() // cap)
            got = []
            for c, (hu, su, k) in enumerate(parts):
                assert int(su.min()) >= 0 and int((su + k).max()) <= cap
                pos = torch.cat([torch.arange(s, s + n) for s, n in zip(su.tolist(), k.tolist())])
                assert torch.equal(pos, torch.arange(pos.numel())), "chunk positions out of order"
                got += torch.cat([torch.arange(h, h + n) for h, n in zip(hu.tolist(), k.tolist())]).tolist()
            assert got == units.tolist()


def _ring_pool(layout="layer_first", page_size=4):
    gen = torch.Generator().manual_seed(11)
    dev = DeviceCase("mha", "stacked", page_size, size=16 * page_size, gen=gen)
    return dev, HostCase(dev.pool, layout, "dma", size_tokens=16 * page_size)


def test_one_ring_serves_calls_of_any_size(chunks):
    """After the first call the staging ring is not reallocated, whatever the call's size
    (smaller or larger, more or fewer chunks), and its slot maps are the same objects."""
    chunks(3 * 2 * 3 * 32 * 4)          # 3 pages of 2 components x 3 layers x 32-byte rows
    dev, hc = _ring_pool()
    host = hc.host
    gen = torch.Generator().manual_seed(12)
    original = dev.snapshot()
    ln, ptr, rings = None, None, None
    for n_pages in (2, 9, 1, 16, 5):
        hidx = pages_to_slots(torch.randperm(16, generator=gen)[:n_pages], 4)
        didx = pages_to_slots(torch.randperm(16, generator=gen)[:n_pages], 4)
        before = hc.snapshot()
        host.backup_from_device_all_layer(dev.pool, hidx, didx)
        assert_same(host.buffers, expected_backup(hc, dev, before, hidx, didx), f"{n_pages} pages")
        ln = dma.stream_staging(torch.device("cpu"))
        if ptr is None:
            ptr, rings = ln.buffer.data_ptr(), {k: [s.map for s in v] for k, v in ln.slots.items()}
        assert ln.buffer.data_ptr() == ptr, "the staging ring was reallocated"
        assert all([s.map for s in ln.slots.get(k)] == m for k, m in rings.items())
    assert_same(dev.model, original, "device after backups")
    hc.check_margins()


def test_ring_grows_only_for_larger_slots(chunks):
    chunks(64)
    dev, hc = _ring_pool(page_size=1)
    host = hc.host
    idx = torch.arange(8)
    host.backup_from_device_all_layer(dev.pool, idx, idx)
    ln = dma.stream_staging(torch.device("cpu"))
    small = ln.buffer.numel()
    host.backup_from_device_all_layer(dev.pool, idx + 8, idx)
    assert ln.buffer.numel() == small
    chunks(4096)
    host.backup_from_device_all_layer(dev.pool, idx, idx)
    assert ln.buffer.numel() > small


def test_runs_and_plans_are_kept_by_value():
    """Equal host indices (a new tensor with the same values) find the same runs and chunk
    plans; indices changed in place do not find their old runs."""
    a = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    r = runs_of(a, 4)
    assert runs_of(a.clone(), 4) is r
    a[0:4] = torch.tensor([12, 13, 14, 15])
    r2 = runs_of(a, 4)
    assert r2 is not r and r2[0].tolist() == [3, 0] and r2[2].tolist() == [1, 1]
    host = torch.empty(2, 4, 16, 8)
    stage = torch.empty(2, 4, 4, 8)
    from kvtier.pool.dma_copies import shape_2d
    shape = shape_2d(host, stage, 2)
    c = chunks_of(r2, shape, 2)
    assert chunks_of(tuple(t.clone() for t in r2), shape, 2) is c
    assert chunks_of(r, shape, 2) is not c


def test_per_layer_loads_reuse_one_plan(chunks, monkeypatch):
    """HiCache's per-layer loads pass the same host indices for every layer (and the backup
    before them the same values): the runs are worked out once for all of them."""
    chunks(256)
    dev, hc = _ring_pool()
    host, calls = hc.host, []
    import kvtier.pool.dma_copies as plan_mod
    real = plan_mod.runs
    monkeypatch.setattr(plan_mod, "runs", lambda units: calls.append(units.numel()) or real(units))
    hidx, didx = pages_to_slots([3, 4, 9, 13], 4), pages_to_slots([0, 5, 6, 2], 4)
    host.backup_from_device_all_layer(dev.pool, hidx, didx)
    assert len(calls) == 1
    for layer in range(dev.pool.num_layers):
        host.load_to_device_per_layer(dev.pool, hidx.clone(), didx, layer)
    assert len(calls) == 1, "per-layer loads planned their runs again"
    host.load_to_device_all_layer(dev.pool, pages_to_slots([3, 4, 8, 13], 4), didx)
    assert len(calls) == 2


# ------------------------------------------------------------------ bad device-side indices
def _direct_backup(host, dev_pool, hidx, didx, verdict):
    """The dma backup of the pool's first host group, as HostPool's transfer issues it
    (`dma.DmaMove`), with the given verdict."""
    pair = host._pairs(0, dev_pool)[0]
    lay = host_layout(host.layout)
    mv = dma.DmaMove(BACKUP, pair.dev_map, pair.host_buf, host.layout, host.page_size, 0, pair.host_layer,
                     pair.num_layers, lay.paged and host.page_size > 1, None, host.size)
    mv(didx, None, mv.host_side(hidx, False), verdict)
    return mv


def _words(code: int) -> torch.Tensor:
    """A call's verdict as its check launch writes them: the code, then its negation."""
    return torch.tensor([code, int(code == 0)], dtype=torch.int32)


@pytest.mark.parametrize("fill", ["kernel", "copies"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_device_verdict_changes_no_host_byte(chunks, monkeypatch, layout, fill):
    """The verdict as a device holds it (unknown to the host): a bad one makes the backup
    move nothing into the host rows, though its bulk copies still run. The staging ring
    is poisoned first, so stale staging bytes reaching the host would show."""
    chunks(300)
    monkeypatch.setattr(dma, "verdict_now", lambda v: None if v is not None else 0)
    if fill == "copies":     # kernels cannot read the host buffer (Ascend, plain pinned memory)
        monkeypatch.setattr(RowMap, "reachable_by", lambda self, platform: False)
    dev, hc = _ring_pool(layout)
    host = hc.host
    hidx, didx = pages_to_slots([7, 2, 3, 12], 4), pages_to_slots([1, 9, 4, 0], 4)
    good = _words(0)
    before = hc.snapshot()
    mv = _direct_backup(host, dev.pool, hidx, didx, good)
    want = expected_backup(hc, dev, before, hidx, didx)
    assert_same(host.buffers, want, "host after a good backup")

    dma.stream_staging(torch.device("cpu")).buffer.fill_(POISON)
    bad = _words(2)
    wild = torch.full_like(didx, 10 ** 9)            # the gather must not read these
    _direct_backup(host, dev.pool, pages_to_slots([5, 6, 7, 8], 4), wild, bad)
    assert_same(host.buffers, want, "host after a backup with a bad verdict")
    assert mv.num_layers == dev.pool.num_layers
    hc.check_margins()
    dev.check_margins()


def test_without_the_fill_a_bad_verdict_writes_stale_bytes(chunks, monkeypatch):
    """The control: with the fill switched off, the same call writes the poisoned staging
    bytes into the host rows (so the test above can fail)."""
    chunks(300)
    monkeypatch.setattr(dma, "verdict_now", lambda v: None if v is not None else 0)
    monkeypatch.setattr(dma._DmaCall, "_fill_mode", lambda self: None)
    dev, hc = _ring_pool()
    host = hc.host
    _direct_backup(host, dev.pool, pages_to_slots([1], 4), pages_to_slots([2], 4), _words(0))
    dma.stream_staging(torch.device("cpu")).buffer.fill_(POISON)
    before = hc.snapshot()
    _direct_backup(host, dev.pool, pages_to_slots([5, 6], 4), pages_to_slots([1, 2], 4), _words(1))
    changed = [n for n in before if not torch.equal(before[n], host.buffers[n])]
    assert changed, "the bulk copies wrote nothing: the fill test proves nothing"


@pytest.mark.parametrize("bad", ["out-of-range", "negative", "not-a-page"])
def test_pool_dma_backup_with_bad_device_indices_changes_nothing(chunks, bad):
    chunks(200)
    dev, hc = _ring_pool("page_first_direct")
    host = hc.host
    hidx = pages_to_slots([1, 2], 4)
    didx = pages_to_slots([3, 4], 4)
    didx[{"out-of-range": 5, "negative": 0, "not-a-page": 4}[bad]] = {"out-of-range": 64, "negative": -1,
                                                                    "not-a-page": 2}[bad]
    before, dev_before = hc.snapshot(), dev.snapshot()
    with pytest.raises(KvtierError, match="device_indices"):
        host.backup_from_device_all_layer(dev.pool, hidx, didx)
        host.synchronize()
    assert_same(host.buffers, before, "host after a refused backup")
    assert_same(dev.model, dev_before, "device after a refused backup")
    host.backup_from_device_all_layer(dev.pool, hidx, pages_to_slots([3, 4], 4))    # a good call after it
    assert_same(host.buffers, expected_backup(hc, dev, before, hidx, pages_to_slots([3, 4], 4)), "good call")


def test_dma_config_is_checked(chunks):
    with pytest.raises(KvtierError, match="chunk_bytes"):
        dma.DmaConfig(chunk_bytes=0)
    with pytest.raises(KvtierError, match="slots"):
        dma.DmaConfig(slots=True)
    with pytest.raises(KvtierError, match="cfg"):
        dma.configure({"chunk_bytes": 4})


# ------------------------------------------------------------------ on a GPU
def _cuda_pools(layout, page_size=16, layers=4):
    dev = MHADevicePool(64 * page_size, page_size, layers, 2, 64, dtype=torch.bfloat16, device="cuda")
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, dtype=torch.int16, device="cuda"))
    host = HostPool(dev, layout=layout, size_tokens=64 * page_size, strategy="dma")
    for b in host.buffers.values():
        b.view(torch.uint8).fill_(POISON)
    return dev, host


@pytest.mark.cuda
@pytest.mark.parametrize("side_stream", [False, True])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_cuda_overlapped_round_trip_in_stream_order(chunks, layout, side_stream):
    """Many chunks through two slots on the caller's stream (default or a side stream):
    the gather waits for a late writer, the copies for the gather, the next call for the
    copies; the per-layer loads land bit for bit."""
    chunks(64 << 10)
    P = 16
    dev, host = _cuda_pools(layout, P)
    gen = torch.Generator().manual_seed(1)
    hidx = host.alloc(40 * P)
    didx = pages_to_slots(torch.randperm(64, generator=gen)[:40], P).cuda()
    didx2 = pages_to_slots(torch.randperm(64, generator=gen)[:40], P).cuda()
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)
        for t in dev.buffers["k"] + dev.buffers["v"]:
            t.view(-1, 2, 64)[didx] += 1                         # late writer: the backup must see it
        want = {n: [t.view(-1, 2, 64)[didx].clone() for t in dev.buffers[n]] for n in ("k", "v")}
        host.backup_from_device_all_layer(dev, hidx, didx)
        for layer in range(4):
            host.load_to_device_per_layer(dev, hidx, didx2, layer)
    stream.synchronize()
    host.synchronize()
    for n in ("k", "v"):
        for l, t in enumerate(dev.buffers[n]):
            assert torch.equal(t.view(-1, 2, 64)[didx2].view(torch.int16), want[n][l].view(torch.int16))


@pytest.mark.cuda
def test_cuda_bad_device_indices_change_no_host_byte(chunks):
    chunks(64 << 10)
    dev, host = _cuda_pools("layer_first")
    hidx = host.alloc(64)
    good = torch.arange(64, 128, device="cuda")
    host.backup_from_device_all_layer(dev, hidx, good)
    torch.cuda.synchronize()
    before = {n: b.clone() for n, b in host.buffers.items()}
    bad = good.clone()
    bad[17] = 10 ** 6
    with pytest.raises(KvtierError, match="device_indices"):
        host.backup_from_device_all_layer(dev, hidx, bad)
        host.synchronize()
    for n, b in host.buffers.items():
        assert torch.equal(b.view(torch.uint8), before[n].view(torch.uint8)), n
