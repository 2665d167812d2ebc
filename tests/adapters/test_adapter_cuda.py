"""The engine adapters on a GPU, as SGLang's host pools call them: per-layer device
tensors, uint64 pointer tables on the device (to device layers and to pinned host
layers), pinned host buffers, indices on the device (or the CPU, for the direct and
Ascend calls). Expected bytes come from plain torch indexing on CPU copies."""
from __future__ import annotations

import pytest
import torch

from kvtier import adapters
from helpers import POISON, Guarded, assert_bytes_equal

pytestmark = pytest.mark.cuda
DEV = "cuda"


def dev_layers(n, rows, row, dtype=torch.float16, fill="random"):
    return [Guarded((rows, *row), dtype, device=DEV, fill=fill) for _ in range(n)]


def host(shape, dtype=torch.float16, fill="poison"):
    return Guarded(shape, dtype, pin=True, fill=fill)


def ptrs(tensors):
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=DEV)


def check(*guards):
    torch.cuda.synchronize()
    for g in guards:
        g.check()


def poisoned_like(t):
    """The CPU image of a destination before the call: every byte POISON."""
    w = torch.empty_like(t, device="cpu")
    w.view(torch.uint8).fill_(POISON)
    return w


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_backup_device_tables_to_pinned_page_first_with_draft(dtype):
    L, N, row = 3, 64, (4, 32)                      # 256-byte rows
    k, v = dev_layers(L, N, row), dev_layers(L, N, row)
    hk, hv = host((96, L, *row)), host((96, L, *row))
    si = torch.randperm(N)[:20].to(dtype).to(DEV)
    di = torch.randperm(96)[:20].to(dtype).to(DEV)
    tk = torch.cat([ptrs([g.t for g in k[:2]]), ptrs([k[2].t])])   # target + draft tables
    tv = torch.cat([ptrs([g.t for g in v[:2]]), ptrs([v[2].t])])
    adapters.transfer_kv_all_layer_lf_pf(tk, hk.t, tv, hv.t, si, di, 256, 256 * L, L)
    check(hk, hv, *k, *v)
    s, d = si.long().cpu(), di.long().cpu()
    for gs, hg in ((k, hk), (v, hv)):
        want = poisoned_like(hg.t)
        for l in range(L):
            want[d, l] = gs[l].t.cpu()[s]
        assert_bytes_equal(hg.t.cpu(), want, "host")


def test_load_pinned_layer_first_through_host_tables():
    """transfer_kv_all_layer_mla with the host side as a device table of pinned addresses."""
    L, N, row = 2, 32, (1, 656)                     # fp8 MLA rows as bytes
    hl = host((L, 48, *row), torch.uint8, fill="random")
    d = dev_layers(L, N, row, torch.uint8, fill="poison")
    si = torch.tensor([47, 0, 13, -1, 5], device=DEV)
    di = torch.tensor([1, 31, 2, 7, -3], device=DEV)   # the negative pairs are skipped
    adapters.transfer_kv_all_layer_mla(ptrs([hl.t[l] for l in range(L)]), ptrs([g.t for g in d]),
                                     si, di, 656, L)
    check(hl, *d)
    for l in range(L):
        want = poisoned_like(d[l].t)
        want[[1, 31, 2]] = hl.t[l][[47, 0, 13]]
        assert_bytes_equal(d[l].t.cpu(), want, f"layer {l}")


def test_load_one_layer_from_page_first():
    L, N, row = 3, 32, (2, 64)
    item = 2 * 64 * 2
    kv = host((2, 40, L, *row), fill="random")
    dk, dv = dev_layers(2, N, row, fill="poison")
    si = torch.tensor([3, 39, 17, 8], device=DEV)
    di = torch.tensor([0, 30, 9, 12], device=DEV)
    adapters.transfer_kv_per_layer_pf_lf(kv.t[0], dk.t, kv.t[1], dv.t, si, di, 2, item, item * L)
    check(kv, dk, dv)
    for c, g in enumerate((dk, dv)):
        want = poisoned_like(g.t)
        want[di.cpu()] = kv.t[c][si.cpu(), 2]
        assert_bytes_equal(g.t.cpu(), want, "pf -> lf")


def test_load_one_layer_from_page_head():
    L, P, N, H, D = 3, 4, 32, 2, 64
    item = H * D * 2
    kv = host((2, 10, H, P, L, D), fill="random")
    dk, dv = dev_layers(2, N, (H, D), fill="poison")
    si = torch.tensor([3, 39, 17, 8], device=DEV)
    di = torch.tensor([0, 30, 9, 12], device=DEV)
    adapters.transfer_kv_per_layer_ph_lf(kv.t[0], dk.t, kv.t[1], dv.t, si, di, 1, item, item * L, P, H)
    check(kv, dk, dv)
    s = si.cpu()
    for c, g in enumerate((dk, dv)):
        want = poisoned_like(g.t)
        want[di.cpu()] = kv.t[c][s // P, :, s % P, 1]
        assert_bytes_equal(g.t.cpu(), want, "ph -> lf")


def test_backup_to_page_head():
    L, P, N, H, D = 2, 4, 16, 2, 32
    item = H * D * 2
    k, v = dev_layers(L, N, (H, D)), dev_layers(L, N, (H, D))
    kv = host((2, 6, H, P, L, D))
    si = torch.tensor([15, 2, 7], device=DEV)
    di = torch.tensor([23, 0, 9], device=DEV)
    adapters.transfer_kv_all_layer_lf_ph(ptrs([g.t for g in k]), kv.t[0], ptrs([g.t for g in v]), kv.t[1],
                                       si, di, item, item * L, L, P, H)
    check(kv, *k, *v)
    s, d = si.cpu(), di.cpu()
    want = poisoned_like(kv.t)
    for c, gs in enumerate((k, v)):
        for l in range(L):
            want[c][d // P, :, d % P, l] = gs[l].t.cpu()[s]
    assert_bytes_equal(kv.t.cpu(), want, "page head")


def test_direct_with_cpu_indices():
    L, P, N, row = 2, 4, 16, (2, 16)
    k, v = dev_layers(L, N, row), dev_layers(L, N, row)
    kv = host((2, 5, L, P, *row))
    si = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])     # on the CPU, as SGLang keeps them
    di = torch.tensor([4, 5, 6, 7, 16, 17, 18, 19])
    adapters.transfer_kv_all_layer_direct_lf_pf([g.t for g in k + v], [kv.t[0], kv.t[1]], si, di, P)
    check(kv)
    want = poisoned_like(kv.t)
    for c, gs in enumerate((k, v)):
        for l in range(L):
            want[c][di.view(-1, P)[:, 0] // P, l] = gs[l].t.cpu()[si].view(-1, P, *row)
    assert_bytes_equal(kv.t.cpu(), want, "direct")


@pytest.mark.parametrize("direction", [1, 2])
def test_ascend_dim_exchange_convention_on_cuda(direction):
    L, pages, P = 3, 6, 4
    dev = Guarded((2, L, pages, P, 2, 16), torch.float16, device=DEV,
                  fill="poison" if direction == 1 else "random")
    hst = Guarded((2, 8, L, P, 2, 16), torch.float16, pin=True,
                  fill="random" if direction == 1 else "poison")
    want_dev, want_hst = dev.t.cpu().clone(), hst.t.clone()
    di, hi = torch.arange(8, 16), torch.arange(24, 32)   # device pages 2, 3; host pages 6, 7
    adapters.transfer_kv_dim_exchange(di, hi, dev.t[0], hst.t[0], dev.t[1], hst.t[1], page_size=P,
                                    layer_start=1, layer_num=2, direction=direction)
    check(dev, hst)
    if direction == 1:
        want_dev[:, 1:3, 2:4] = want_hst[:, 6:8, 1:3].transpose(1, 2)
    else:
        want_hst[:, 6:8, 1:3] = want_dev[:, 1:3, 2:4].transpose(1, 2)
    assert_bytes_equal(dev.t.cpu(), want_dev, "device")
    assert_bytes_equal(hst.t.cpu(), want_hst, "host")
