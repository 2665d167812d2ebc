"""kvtier.adapters.sglang_npu against a byte-level model of sgl_kernel_npu's
transfer_kv_dim_exchange: device (L, pages, P, H, D) <-> host (pages, L, P, H, D), whole
pages, a layer range per layer space, optional V and DSA indexer (index_k, fp32 scales).
"""
from __future__ import annotations

from enum import Enum

import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.adapters import (TransferDirection, transfer_kv_dim_exchange,
                                   transfer_kv_per_layer_dim_exchange)
from test_adapter_model import Memory

H2D, D2H = TransferDirection.H2D, TransferDirection.D2H
INDEX_DTYPES = [torch.int32, torch.int64]


class Pools:
    """Ascend-style pools: K and V in one device allocation (2, L, pages, P, H, D) and one
    host allocation (2, pages, L, P, H, D); indexer caches with their own layer count."""

    def __init__(self, direction, *, layers=4, dev_pages=6, host_pages=8, page=4, heads=2,
                 head_dim=4, indexer_layers=2, seed=0):
        self.mem = Memory(seed)
        self.page = page
        dev_fill, host_fill = ("poison", "random") if direction == H2D else ("random", "poison")
        dev = self.mem.buffer("device_kv", (2, layers, dev_pages, page, heads, head_dim), torch.float16, dev_fill)
        host = self.mem.buffer("host_kv", (2, host_pages, layers, page, heads, head_dim), torch.float16, host_fill)
        self.device_k, self.device_v, self.host_k, self.host_v = dev[0], dev[1], host[0], host[1]
        li = indexer_layers
        self.device_index_k = self.mem.buffer("device_index_k", (li, dev_pages, page, 1, 8), torch.uint8, dev_fill)
        self.host_index_k = self.mem.buffer("host_index_k", (host_pages, li, page, 1, 8), torch.uint8, host_fill)
        # The device scale cache is 4-D; sgl_kernel_npu pads it to 5-D.
        self.device_scale = self.mem.buffer("device_scale", (li, dev_pages, page, 1), torch.float32, dev_fill)
        self.host_scale = self.mem.buffer("host_scale", (host_pages, li, page, 1, 1), torch.float32, host_fill)
        self.dev_pages, self.host_pages = dev_pages, host_pages

    def pages(self, n_pages, count, dtype, seed):
        first = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))[:count]
        return (first[:, None] * self.page + torch.arange(self.page)).flatten().to(dtype)


def model(mem: Memory, direction, device_indices, host_indices, page, comps, layers) -> None:
    """sgl_kernel_npu's copy: page pair (device_indices[i*P] // P, host_indices[i*P] // P);
    for each layer, the device page's slot and the host page's slot (P * row bytes each)."""
    for i in range(0, device_indices.numel(), page):
        dp, hp = int(device_indices[i]) // page, int(host_indices[i]) // page
        for device, host in comps:
            slot = device[0, 0].numel() * device.element_size()
            for layer in layers:
                d, h = device[layer, dp].data_ptr(), host[hp, layer].data_ptr()
                if direction == H2D:
                    mem.copy(d, h, slot)
                else:
                    mem.copy(h, d, slot)


@pytest.mark.parametrize("direction", [H2D, D2H])
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_kv_all_layers(direction, dtype):
    p = Pools(direction)
    di, hi = p.pages(p.dev_pages, 3, dtype, 1), p.pages(p.host_pages, 3, dtype, 2)
    transfer_kv_dim_exchange(di, hi, p.device_k, p.host_k, p.device_v, p.host_v, page_size=p.page,
                             direction=direction)
    model(p.mem, direction, di, hi, p.page, [(p.device_k, p.host_k), (p.device_v, p.host_v)], range(4))
    p.mem.assert_changes("device_kv" if direction == H2D else "host_kv")
    p.mem.check()


@pytest.mark.parametrize("direction", [H2D, D2H])
def test_k_only_when_v_is_empty(direction):
    p = Pools(direction)
    di, hi = p.pages(p.dev_pages, 2, torch.int64, 3), p.pages(p.host_pages, 2, torch.int64, 4)
    transfer_kv_dim_exchange(di, hi, p.device_k, p.host_k, torch.empty(0), torch.empty(0),
                             page_size=p.page, direction=direction)
    model(p.mem, direction, di, hi, p.page, [(p.device_k, p.host_k)], range(4))
    p.mem.check()


@pytest.mark.parametrize("direction", [H2D, D2H])
def test_layer_range_and_indexer_with_its_own_layers(direction):
    p = Pools(direction)
    di, hi = p.pages(p.dev_pages, 3, torch.int32, 5), p.pages(p.host_pages, 3, torch.int32, 6)
    transfer_kv_dim_exchange(di, hi, p.device_k, p.host_k, p.device_v, p.host_v,
                             device_index_k=p.device_index_k, host_index_k=p.host_index_k,
                             device_index_k_scale=p.device_scale, host_index_k_scale=p.host_scale,
                             layer_start=1, layer_num=2, index_k_layer_start=1, index_k_layer_num=1,
                             page_size=p.page, direction=direction)
    model(p.mem, direction, di, hi, p.page, [(p.device_k, p.host_k), (p.device_v, p.host_v)], [1, 2])
    model(p.mem, direction, di, hi, p.page, [(p.device_index_k, p.host_index_k),
                                             (p.device_scale.unsqueeze(-1), p.host_scale)], [1])
    p.mem.check()


def test_indexer_defaults_to_all_its_layers():
    p = Pools(H2D)
    di, hi = p.pages(p.dev_pages, 2, torch.int64, 7), p.pages(p.host_pages, 2, torch.int64, 8)
    transfer_kv_dim_exchange(di, hi, p.device_k, p.host_k, p.device_v, p.host_v,
                             p.device_index_k, p.host_index_k, layer_start=3, layer_num=1,
                             page_size=p.page)
    model(p.mem, H2D, di, hi, p.page, [(p.device_k, p.host_k), (p.device_v, p.host_v)], [3])
    model(p.mem, H2D, di, hi, p.page, [(p.device_index_k, p.host_index_k)], range(2))
    p.mem.check()


@pytest.mark.parametrize("index_layer", [None, 0])
def test_per_layer_form(index_layer):
    p = Pools(D2H)
    di, hi = p.pages(p.dev_pages, 2, torch.int64, 9), p.pages(p.host_pages, 2, torch.int64, 10)
    transfer_kv_per_layer_dim_exchange(di, hi, p.device_k, p.host_k, p.device_v, p.host_v, 2,
                                       device_index_k=p.device_index_k, host_index_k=p.host_index_k,
                                       index_k_layer_id=index_layer, page_size=p.page, direction=D2H)
    model(p.mem, D2H, di, hi, p.page, [(p.device_k, p.host_k), (p.device_v, p.host_v)], [2])
    if index_layer is not None:
        model(p.mem, D2H, di, hi, p.page, [(p.device_index_k, p.host_index_k)], [index_layer])
    p.mem.check()


def test_target_and_draft_pools_into_one_host_pool():
    """SGLang's Ascend MTP path: each device pool against its slice of the host layers
    (a strided host view)."""
    mem = Memory(3)
    P, pages = 4, 5
    target = mem.buffer("target", (2, 3, pages, P, 2, 4), torch.float16)
    draft = mem.buffer("draft", (2, 1, pages, P, 2, 4), torch.float16)
    host = mem.buffer("host", (2, pages, 4, P, 2, 4), torch.float16, fill="poison")
    di = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    hi = torch.tensor([16, 17, 18, 19, 4, 5, 6, 7])
    for dev, start, n in ((target, 0, 3), (draft, 3, 1)):
        hk, hv = host[0][:, start:start + n], host[1][:, start:start + n]
        transfer_kv_dim_exchange(di, hi, dev[0], hk, dev[1], hv, page_size=P, direction=2)
        model(mem, D2H, di, hi, P, [(dev[0], hk), (dev[1], hv)], range(n))
    mem.assert_changes("host")
    mem.check()


def test_direction_from_another_enum_or_an_int():
    class Foreign(Enum):   # sgl_kernel_npu's enum has the same values
        H2D = 1
        D2H = 2

    for direction in (Foreign.H2D, 1):
        p = Pools(H2D)
        di, hi = p.pages(p.dev_pages, 1, torch.int64, 11), p.pages(p.host_pages, 1, torch.int64, 12)
        transfer_kv_dim_exchange(di, hi, p.device_k, p.host_k, p.device_v, p.host_v, page_size=p.page,
                                 direction=direction)
        model(p.mem, H2D, di, hi, p.page, [(p.device_k, p.host_k), (p.device_v, p.host_v)], range(4))
        p.mem.check()


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_empty_indices_move_nothing(dtype):
    p = Pools(H2D)
    e = torch.empty(0, dtype=dtype)
    transfer_kv_dim_exchange(e, e, p.device_k, p.host_k, p.device_v, p.host_v, p.device_index_k,
                             p.host_index_k, page_size=p.page)
    p.mem.check()


def _bad():
    def call(**kw):
        def run(p, di, hi):
            a = dict(device_indices=di, host_indices=hi, device_k=p.device_k, host_k=p.host_k,
                     device_v=p.device_v, host_v=p.host_v, page_size=p.page, direction=H2D)
            a.update({k: (v(p) if callable(v) else v) for k, v in kw.items()})
            transfer_kv_dim_exchange(**a)
        return run

    return [
        ("direction 3", call(direction=3), "direction"),
        ("flags 1", call(flags=1), "flags"),
        ("page size", call(page_size=2), "page_size"),
        ("layer count", call(host_k=lambda p: p.host_k[:, :3]), "host_k"),
        ("4-D device", call(device_k=lambda p: p.device_k[0]), "device_k"),
        ("dtype", call(host_v=lambda p: p.host_v.view(torch.int16)), "host_v.dtype"),
        ("heads", call(host_v=lambda p: p.host_v.reshape(*p.host_v.shape[:3], 1, 8)), "host_v"),
        ("layer range", call(layer_start=3, layer_num=2), "layer_start"),
        ("layer_num 0", call(layer_num=0), "layer_num"),
        ("indexer range", call(device_index_k=lambda p: p.device_index_k,
                               host_index_k=lambda p: p.host_index_k, index_k_layer_start=2), "index_k_layer_start"),
        ("half V", call(host_v=torch.empty(0)), "host_v"),
        ("half indexer", call(device_index_k=lambda p: p.device_index_k), "host_index_k"),
        ("partial page", call(device_indices=torch.arange(3), host_indices=torch.arange(3)), "device_indices"),
        ("unaligned page", call(host_indices=torch.arange(2, 6)), "host_indices"),
        ("host page out of range", call(host_indices=torch.arange(32, 36)), "host_indices"),
        ("length mismatch", call(host_indices=torch.arange(8)), "indices"),
    ]


@pytest.mark.parametrize("name,run,arg", _bad(), ids=[b[0] for b in _bad()])
def test_bad_input_raises_and_moves_nothing(name, run, arg):
    p = Pools(H2D)
    with pytest.raises(KvtierError) as e:
        run(p, torch.arange(4, 8), torch.arange(0, 4))
    assert arg in str(e.value), str(e.value)
    p.mem.check()
