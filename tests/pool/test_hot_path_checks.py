"""The hot path checks indices without waiting for the device.

- Default-path calls of the pools and adapters never read device-resident indices on
  the host and never synchronize (`hot_path_support.DeviceResident` makes every such read
  raise), while their value checks still run (a check kernel is launched).
- Bad device-resident indices change no destination byte, and raise `KvtierError` naming
  the argument and the value: in the same call where the check has already run, else at
  the next call on the same pool or adapter, or at the pool's `synchronize()`; good calls
  afterwards work.
- ``KVTIER_CHECK=0`` turns the value checks off for code that cannot pass ``check=False``.
"""
from __future__ import annotations

import pytest
import torch

from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from hot_path_support import HostRead, device_work_only, on_device
from pool_support import DeviceCase, HostCase
import kvtier.adapters as adapters
from kvtier.kernels import KvtierError, faults, synchronize
from kvtier.kernels.index_check import CHECK_ENV

P = 4
SIZE = 32            # device slots (8 pages)
HOST = 48            # host slots


def pools(layout="page_first_direct", storage="layers", strategy="kernel", kind="mha", **kw):
    dev = DeviceCase(kind, storage, P, layers=2, size=SIZE, gen=torch.Generator().manual_seed(3))
    host = HostCase(dev.pool, layout, strategy, size_tokens=HOST, **kw)
    return dev, host


def slots(*pages):
    return torch.tensor([p * P + i for p in pages for i in range(P)], dtype=torch.int64)


def snapshot(dev, host):
    return dev.snapshot(), host.snapshot()


def same(a, b) -> bool:
    (da, ha), (db, hb) = a, b
    bits = lambda t: t.view(torch.uint8)  # noqa: E731  (random bytes may hold NaNs)
    return all(torch.equal(bits(x), bits(y)) for n in da for x, y in zip(da[n], db[n])) and \
        all(torch.equal(bits(ha[n]), bits(hb[n])) for n in ha)


# ------------------------------------------------------------------ no host reads
POOL_CALLS = {
    "backup": lambda d, h, hi, di: h.host.backup_from_device_all_layer(d.pool, hi, di),
    "load": lambda d, h, hi, di: h.host.load_to_device_all_layer(d.pool, hi, di),
    "load_layer": lambda d, h, hi, di: h.host.load_to_device_per_layer(d.pool, hi, di, 1),
    "gather": lambda d, h, hi, di: d.pool.gather(di),
    "gather_pages": lambda d, h, hi, di: d.pool.gather(di[::P] // P, pages=True),
    "scatter": lambda d, h, hi, di: d.pool.scatter(di, d.pool.gather(di)),
    "cpu_copy": lambda d, h, hi, di: d.pool.load_cpu_copy(d.pool.get_cpu_copy(di, chunk_size=4), di),
}


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("call", list(POOL_CALLS))
def test_pool_calls_check_indices_without_reading_them_on_the_host(layout, call):
    dev, host = pools(layout)
    hi, di = host.host.alloc(2 * P), on_device(slots(5, 2))
    with device_work_only() as (copies, checks):
        POOL_CALLS[call](dev, host, hi, di)
    assert checks.launches >= 1 and copies.launches >= 1


def test_host_indices_are_read_on_the_host_device_indices_are_not():
    """The guard itself: a device-resident tensor read on the host raises (the test of the
    tests), and HostPool's host indices (CPU memory in HiCache) may be read freely."""
    with pytest.raises(HostRead):
        int(on_device(torch.tensor([3])).max())
    dev, host = pools()
    with device_work_only():
        host.host.backup_from_device_all_layer(dev.pool, host.host.alloc(P), on_device(slots(1)))


def _sglang_calls(dev):
    k = [t.view(SIZE, -1) for t in dev.model["k"]]
    v = [t.view(SIZE, -1) for t in dev.model["v"]]
    item = k[0].shape[1] * k[0].element_size()
    host_k = torch.zeros(2, HOST, k[0].shape[1], dtype=k[0].dtype)
    host_v = torch.zeros_like(host_k)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    kt, vt = table(k), table(v)
    hk, hv = table(list(host_k)), table(list(host_v))
    pf_k, pf_v = host_k.transpose(0, 1).contiguous(), host_v.transpose(0, 1).contiguous()   # (N, L, row)
    return {
        "per_layer": lambda si, di: adapters.transfer_kv_per_layer(host_k[0], k[1], host_v[0], v[1], si, di, item),
        "all_layer": lambda si, di: adapters.transfer_kv_all_layer(kt, hk, vt, hv, si, di, item, 2),
        "per_layer_pf_lf": lambda si, di: adapters.transfer_kv_per_layer_pf_lf(
            pf_k, k[1], pf_v, v[1], si, di, 1, item, 2 * item),
        "all_layer_lf_pf": lambda si, di: adapters.transfer_kv_all_layer_lf_pf(
            kt, pf_k, vt, pf_v, si, di, item, 2 * item, 2),
    }


@pytest.mark.parametrize("call", ["per_layer", "all_layer", "per_layer_pf_lf", "all_layer_lf_pf"])
def test_sglang_adapter_calls_do_not_read_device_indices(call):
    dev, _ = pools()
    # Keep every call alive: the pointer tables hold raw addresses of the host buffers the
    # other calls capture, and a freed buffer would be written through them.
    calls = _sglang_calls(dev)
    fn = calls[call]
    si, di = slots(1), slots(3)
    fn(si, di)          # the first call reads the pointer tables once (cached per table)
    with device_work_only() as (copies, checks):
        fn(on_device(si), on_device(di))
    assert checks.launches == 1 and copies.launches >= 1


def test_ascend_dim_exchange_does_not_read_device_indices():
    """sgl_kernel_npu's call over stacked (L, pages, P, H, D) device and page_first_direct
    host buffers, device and host indices both on the device."""
    dev = torch.randn(2, 2, SIZE // P, P, 2, 8).to(torch.float16)         # (K/V, L, pages, P, H, D)
    host = torch.zeros(2, HOST // P, 2, P, 2, 8, dtype=torch.float16)      # (K/V, pages, L, P, H, D)
    di, hi = on_device(slots(3, 1)), on_device(slots(0, 5))
    with device_work_only() as (copies, checks):
        adapters.transfer_kv_dim_exchange(di, hi, dev[0], host[0], dev[1], host[1], page_size=P,
                                          direction=adapters.TransferDirection.D2H)
    assert checks.launches == 1 and copies.launches >= 1
    assert torch.equal(host[0, 5, :, 0].view(torch.int16), dev[0, :, 1, 0].view(torch.int16))


def test_negative_pairs_are_skipped_on_the_device():
    """SGLang's convention, kept without a sync: the kernel masks pairs with a negative index."""
    dev, _ = pools()
    k = [t.view(SIZE, -1) for t in dev.model["k"]]
    v = [t.view(SIZE, -1) for t in dev.model["v"]]
    dst_k, dst_v = torch.zeros_like(k[0]), torch.zeros_like(v[0])
    item = k[0].shape[1] * k[0].element_size()
    si, di = torch.tensor([1, -1, 3, 4]), torch.tensor([0, 5, -2, 7])
    with device_work_only():
        adapters.transfer_kv_per_layer(k[0], dst_k, v[0], dst_v, on_device(si), on_device(di), item)
    want_k, want_v = torch.zeros_like(dst_k), torch.zeros_like(dst_v)
    want_k[[0, 7]], want_v[[0, 7]] = k[0][[1, 4]], v[0][[1, 4]]
    bits = lambda t: t.view(torch.int16)  # noqa: E731  (random bytes may hold NaNs)
    assert torch.equal(bits(dst_k), bits(want_k)) and torch.equal(bits(dst_v), bits(want_v))


# ------------------------------------------------------------------ bad indices: nothing moves
BAD = {  # (host slots, device slots, argument named, value named)
    "device negative": (slots(0, 1), torch.tensor([-4, -3, -2, -1, 4, 5, 6, 7]), "device_indices", -4),
    "device out of range": (slots(0, 1), slots(2, 8), "device_indices", 32),
    "device not whole pages": (slots(0, 1), torch.tensor([8, 9, 10, 11, 13, 14, 15, 16]), "device_indices", 13),
    "host out of range": (slots(0, 12), slots(2, 3), "host_indices", 48),
}


class _Late:
    """Emulates a device that has not run the check yet when the call returns: the thread's
    failure record is not read until `arrives`."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(faults, "raise_pending", lambda this_call=False: None)

    def arrives(self):
        self.monkeypatch.undo()


@pytest.mark.parametrize("when", ["same call", "next call", "synchronize"])
@pytest.mark.parametrize("call", ["backup", "load", "load_layer"])
@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("kind", ["mha", "mha_v_indexer"], ids=["one launch", "several launches"])
def test_bad_device_indices_move_nothing_and_are_reported(kind, case, call, when, monkeypatch):
    """One launch checks inline; a call of several (K and V, an indexer of other rows)
    checks by a check launch whose verdict every launch reads: all of them move nothing."""
    dev, host = pools(kind=kind)
    hi, di, arg, value = BAD[case]
    di = on_device(di)
    before = snapshot(dev, host)
    late = _Late(monkeypatch) if when != "same call" else None
    if late is None:
        with pytest.raises(KvtierError, match=rf"{arg}={value}: "):
            POOL_CALLS[call](dev, host, hi, di)
    else:
        POOL_CALLS[call](dev, host, hi, di)         # enqueued; the check has not reported yet
    assert same(before, snapshot(dev, host)), "bytes moved although the indices were bad"
    if late is not None:
        late.arrives()
        good_hi, good_di = slots(0, 1), on_device(slots(2, 3))
        with pytest.raises(KvtierError, match=rf"{arg}={value}: .*moved no bytes"):
            if when == "next call":
                POOL_CALLS[call](dev, host, good_hi, good_di)
            else:
                host.host.synchronize()
        assert same(before, snapshot(dev, host)), "the call that reported the error moved bytes"
    dev.check_margins()
    host.check_margins()
    # A good call afterwards works.
    host.host.backup_from_device_all_layer(dev.pool, slots(0, 1), on_device(slots(2, 3)))
    host.host.synchronize()
    assert not same(before, snapshot(dev, host))


def test_mismatched_lengths_are_refused_at_once():
    dev, host = pools()
    before = snapshot(dev, host)
    with pytest.raises(KvtierError, match="device_indices='4 indices': host_indices has 8"):
        host.host.backup_from_device_all_layer(dev.pool, slots(0, 1), on_device(slots(2)))
    assert same(before, snapshot(dev, host))


def test_device_pool_gather_reports_bad_indices_later(monkeypatch):
    dev, _ = pools()
    late = _Late(monkeypatch)
    out = dev.pool.gather(on_device(torch.tensor([1, 99])))
    late.arrives()
    with pytest.raises(KvtierError, match="indices=99: index out of range for 32 rows"):
        dev.pool.synchronize()
    dev.pool.gather(on_device(torch.tensor([1, 2])))


def test_copy_rows_reports_at_the_next_call_and_at_synchronize(monkeypatch):
    dev, host = pools()
    m = dev.pool.maps["k"]
    hm = host.host.maps["k"]
    before = snapshot(dev, host)
    late = _Late(monkeypatch)
    from kvtier.kernels import copy_rows
    copy_rows(m, on_device(torch.tensor([0, 40])), hm, torch.tensor([0, 1]))
    assert same(before, snapshot(dev, host))
    late.arrives()
    with pytest.raises(KvtierError, match="src_indices=40: index out of range for 32 rows"):
        synchronize()
    synchronize()      # reported once


# ------------------------------------------------------------------ a layer loop's pair
def _layer_loop(dev, host, hi, di, layers=(0, 1)):
    for layer in layers:
        host.host.load_to_device_per_layer(dev.pool, hi, di, layer)


def test_every_layer_of_a_loop_checks_its_pair():
    """HiCache's layer loop passes one pair for every layer: every layer's launch checks
    it (nothing is kept about the lists between calls), inline in its one copy launch."""
    dev, host = pools()
    hi, di = slots(0, 1), on_device(slots(2, 3))
    with device_work_only() as (copies, checks):
        _layer_loop(dev, host, hi, di)
        assert checks.launches == 2 and copies.launches == 2
    host.host.check = False
    with device_work_only() as (copies, checks):
        _layer_loop(dev, host, hi, di)
    assert checks.launches == 0 and copies.launches == 2


@pytest.mark.parametrize("change", ["in place", "data rebound", "data reinterpreted", "numpy", "dlpack", "ctypes",
                                    "triton kernel"])
def test_a_layer_loops_pair_made_bad_is_refused_and_moves_nothing(change):
    """A pair the loop used, then made bad, is refused before a byte moves: written in
    place through torch, ``.data`` rebound to other memory or to the same bytes read as
    int32, or written where torch does not see it (a numpy view, a DLPack alias, a raw
    pointer write, an engine's own Triton kernel): the first byte and the length stay."""
    import ctypes
    dev, host = pools()
    hi, di = slots(0, 1), slots(2, 3)
    _layer_loop(dev, host, hi, di, layers=(0,))
    if change == "in place":
        di[5] = 33
        named = "device_indices=33"
    elif change == "data rebound":
        di.data = slots(2, 8)                       # the page just past the end: the margins
        named = "device_indices=32"
    elif change == "data reinterpreted":   # the host slots' int64 bytes as twice as many int32: not whole pages
        hi.data = hi.data.view(torch.int32)
        di.data = torch.cat([di.data, di.data])     # (counts still match)
        named = "host_indices=0"
    elif change == "numpy":
        version = di._version
        di.numpy()[5] = 40
        assert di._version == version
        named = "device_indices=40"
    elif change == "dlpack":
        alias = torch.from_dlpack(di.__dlpack__())
        with torch.no_grad():
            alias.data[6] = 41
        named = "device_indices=41"
    elif change == "ctypes":
        ctypes.c_int64.from_address(di.data_ptr() + 7 * 8).value = 42
        named = "device_indices=42"
    else:
        from triton_writer import triton_write
        triton_write(di, 4, 43)
        named = "device_indices=43"
    before = snapshot(dev, host)
    with pytest.raises(KvtierError, match=named):
        _layer_loop(dev, host, hi, di, layers=(1,))
    assert same(before, snapshot(dev, host)), "bytes moved although the pair was bad"
    dev.check_margins()
    host.check_margins()


def test_a_pair_recorded_under_a_launch_probe_is_checked_after_it():
    """`LaunchProbe` records the check kernel without running it: a bad pair passed inside
    it must not count as checked once the probe ends."""
    from kvtier.bench.probe import LaunchProbe
    dev, host = pools()
    hi, di = slots(0, 1), slots(2, 10)
    with LaunchProbe():
        _layer_loop(dev, host, hi, di, layers=(0,))
    before = snapshot(dev, host)
    with pytest.raises(KvtierError, match="device_indices=40"):
        _layer_loop(dev, host, hi, di, layers=(1,))
    assert same(before, snapshot(dev, host))


# ------------------------------------------------------------------ process-wide switch
def test_env_switch_turns_value_checks_off(monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "0")
    dev, host = pools()
    with device_work_only() as (copies, checks):
        host.host.load_to_device_per_layer(dev.pool, slots(0), on_device(slots(2)), 0)
        dev.pool.gather(on_device(slots(1)))
    assert checks.launches == 0 and copies.launches >= 2
    monkeypatch.setenv(CHECK_ENV, "1")
    with pytest.raises(KvtierError, match="device_indices=40"):
        host.host.load_to_device_per_layer(dev.pool, slots(0), on_device(slots(10)), 0)
    # check=False on the pool wins over the environment
    _, off = pools(check=False)
    with device_work_only() as (_, checks):
        off.host.backup_from_device_all_layer(dev.pool, slots(0), on_device(slots(2)))
    assert checks.launches == 0


def test_a_bool_is_no_layer_id():
    dev, host = pools()
    before = snapshot(dev, host)
    for bad in (True, None, 1.0):
        with pytest.raises(KvtierError, match=f"layer_id={bad!r}"):
            host.host.load_to_device_per_layer(dev.pool, slots(0), slots(2), bad)
    assert same(before, snapshot(dev, host))
    # a host pool passes an owner token through to its allocator
    mine = host.host.alloc(P, owner="req-1")
    with pytest.raises(KvtierError, match="owner"):
        host.host.free(mine, owner="req-2")
    assert host.host.free(mine, owner="req-1") == P


def test_gather_into_an_earlier_result():
    """gather(out=...) refills what an earlier gather returned: same bytes as a fresh
    gather, no new buffers; a dict that is not gather()'s views is refused."""
    dev, _ = pools()
    first = dev.pool.gather(slots(1, 2))
    again = dev.pool.gather(slots(5, 3), out=first)
    fresh = dev.pool.gather(slots(5, 3))
    assert again is first
    assert all(torch.equal(first[n].view(torch.uint8), fresh[n].view(torch.uint8)) for n in fresh)
    with pytest.raises(KvtierError, match=r"out\['k'\]"):
        dev.pool.gather(slots(5, 3), out={n: t.clone() for n, t in first.items()})
    with device_work_only() as (copies, checks):
        dev.pool.gather(on_device(slots(4, 0)), out=first)
