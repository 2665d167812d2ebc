"""The dma strategy on the hot path (issue 12's rules for HostPool(strategy="dma")):
default-path calls never read device-resident indices on the host or synchronize, and
bad device-resident indices change no host or device byte, also when the device has not
run the check when the call returns and the bulk copies to the host run regardless
(the verdict as a device holds it, unknown to the host: the staging fill of pool/dma.py).
"""
from __future__ import annotations

import pytest
import torch

from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from hot_path_support import device_work_only, on_device
from pool_support import DeviceCase, HostCase
from pool_support import small_dma_chunks  # noqa: F401  (autouse fixture: dma chunks of two pages)
from kvtier.kernels import KvtierError, faults
from kvtier.pool import dma

P, SIZE, HOST = 4, 32, 48



def pools(layout):
    dev = DeviceCase("mha", "layers", P, layers=2, size=SIZE, gen=torch.Generator().manual_seed(3))
    return dev, HostCase(dev.pool, layout, "dma", size_tokens=HOST)


def slots(*pages):
    return torch.tensor([p * P + i for p in pages for i in range(P)], dtype=torch.int64)


def state(dev, host):
    bits = lambda t: t.view(torch.uint8).clone()  # noqa: E731  (random bytes may hold NaNs)
    return [bits(t) for ts in dev.model.values() for t in ts] + [bits(b) for b in host.host.buffers.values()]


CALLS = {
    "backup": lambda d, h, hi, di: h.host.backup_from_device_all_layer(d.pool, hi, di),
    "load": lambda d, h, hi, di: h.host.load_to_device_all_layer(d.pool, hi, di),
    "load_layer": lambda d, h, hi, di: h.host.load_to_device_per_layer(d.pool, hi, di, 1),
}


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("call", list(CALLS))
def test_dma_calls_do_not_read_device_indices(layout, call):
    dev, host = pools(layout)
    hi, di = host.host.alloc(6 * P), on_device(slots(5, 2, 7, 0, 1, 6))
    with device_work_only() as (copies, checks):
        CALLS[call](dev, host, hi, di)
    assert checks.launches == 1 and copies.launches >= 2        # one launch per chunk (several chunks)


BAD = {  # device slots, value named
    "negative": (torch.tensor([-4, -3, -2, -1, 4, 5, 6, 7]), -4),
    "out of range": (slots(2, 8), 32),
    "not whole pages": (torch.tensor([8, 9, 10, 11, 13, 14, 15, 16]), 13),
}


@pytest.mark.parametrize("verdict", ["device", "host"])
@pytest.mark.parametrize("when", ["next call", "synchronize"])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("case", list(BAD))
def test_bad_device_indices_change_nothing_when_reported_late(monkeypatch, case, call, when, verdict):
    """The device has not run the check when the call returns (the failure record is read
    later).
    With ``verdict="device"`` the copies do not know the verdict either, as on a GPU."""
    # Whole pages are a rule of page-major layouts only.
    dev, host = pools("layer_first" if call == "backup" and case != "not whole pages" else "page_first_direct")
    di, value = BAD[case]
    # Plain tensors: host reads of device indices are the other tests' concern, and
    # triton-ascend's interpreter copies every kernel argument with .cpu().
    good_hi, good_di = slots(0, 1), slots(2, 3)
    CALLS["backup"](dev, host, good_hi, good_di)      # the host holds real rows; the ring exists
    dma.stream_staging(torch.device("cpu")).buffer.fill_(0xA5)  # stale staging bytes would show
    with monkeypatch.context() as late:
        late.setattr(faults, "raise_pending", lambda this_call=False: None)
        if verdict == "device":
            late.setattr(dma, "verdict_now", lambda v: None if v is not None else 0)
        before = state(dev, host)
        CALLS[call](dev, host, slots(0, 1), di.clone())
        assert all(torch.equal(a, b) for a, b in zip(before, state(dev, host))), "bad indices moved bytes"
    with pytest.raises(KvtierError, match=rf"device_indices={value}: .*moved no bytes"):
        if when == "next call":
            CALLS[call](dev, host, good_hi, good_di)
        else:
            host.host.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, state(dev, host)))
    CALLS[call](dev, host, good_hi, good_di)           # a good call afterwards works
    dev.check_margins()
    host.check_margins()
