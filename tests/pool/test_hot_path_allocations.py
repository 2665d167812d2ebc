"""Hot-path calls allocate nothing once a call of their shape has run (their routes,
launch plans and verdict are kept; their index lists are used as they come):
HostPool backup and all-layer and per-layer loads on every host layout and both device
storage forms, a `dma` layer loop after its first layer, `gather(out=)`, a scatter of a
gather's result, and the SGLang adapter's calls. A gather into new buffers allocates its
result and nothing else. Kernels really run; what Triton's interpreter allocates while
one runs is the device's work and not counted (`hot_path_support.allocations`)."""
from __future__ import annotations

import pytest
import torch

from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from hot_path_support import allocations, device_work_only, on_device
from pool_support import DeviceCase, HostCase
import kvtier.adapters as adapters

P, SIZE, HOST, LAYERS = 4, 32, 48, 2
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def slots(*pages):
    return torch.tensor([p * P + i for p in pages for i in range(P)], dtype=torch.int64)


def pools(storage="layers", layout="page_first_direct", strategy="kernel"):
    dev = DeviceCase("mha", storage, P, layers=LAYERS, size=SIZE, gen=torch.Generator().manual_seed(5))
    return dev, HostCase(dev.pool, layout, strategy, size_tokens=HOST)


def test_the_recorder_sees_an_allocation_and_not_a_view():
    t = torch.arange(8)
    with allocations() as made:
        t.view(2, 4)
        t[::2]
        t.add_(1)
        torch.index_select(t, 0, t[:2])
    assert made == ["aten.index_select.default"]


@pytest.mark.parametrize("storage", ["layers", "stacked"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pool_calls_allocate_nothing(storage, layout):
    dev, host = pools(storage, layout)
    hp, dp = host.host, dev.pool
    hi = [hp.alloc(2 * P) for _ in range(2)]
    di = [on_device(slots(5, 2)), on_device(slots(1, 6))]

    def calls(h, d):
        hp.backup_from_device_all_layer(dp, h, d)
        hp.load_to_device_all_layer(dp, h, d)
        for layer in range(LAYERS):
            hp.load_to_device_per_layer(dp, h, d, layer)
    calls(hi[0], di[0])                       # the first call of each shape plans it
    with device_work_only() as (copies, checks), allocations() as made:
        calls(hi[1], di[1])                   # new lists, as an engine's next batch brings
    assert made == [] and copies.launches >= 2 + LAYERS and checks.launches >= 3


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_a_dma_layer_loop_allocates_only_for_its_first_layer(layout):
    """A layer loop's host indices are planned once (their runs and chunk plans are kept);
    the loop's later layers allocate nothing."""
    dev, host = pools(layout=layout, strategy="dma")
    hp, dp = host.host, dev.pool
    for h, d in ((hp.alloc(2 * P), slots(5, 2)), (hp.alloc(2 * P), slots(1, 6))):
        with device_work_only():
            hp.load_to_device_per_layer(dp, h, d, 0)
            with allocations() as made:
                hp.load_to_device_per_layer(dp, h, d, 1)
        assert made == [], made


def test_gathers_and_scatters_allocate_only_a_new_result():
    dev, _ = pools()
    dp = dev.pool
    out_pages, out_slots = dp.gather(slots(0, 1)[::P] // P, pages=True), dp.gather(slots(0, 1))
    dp.gather(torch.tensor([4, 1]), pages=True, out=out_pages)        # the first call into each binds it
    dp.gather(slots(2, 0), out=out_slots)
    result = dp.gather(slots(3, 4))
    with device_work_only(), allocations() as made:
        dp.gather(on_device(torch.tensor([2, 5])), pages=True, out=out_pages)
        dp.gather(on_device(slots(6, 3)), out=out_slots)
        dp.scatter(on_device(slots(7, 0)), result)
    assert made == []
    with device_work_only(), allocations() as made:
        new = dp.gather(on_device(slots(2, 7)))
    assert made == ["aten.empty.memory_format"] * len(dp.groups) and set(new) == set(dp.components)


def test_sglang_adapter_calls_allocate_nothing():
    dev, _ = pools()
    k = [t.view(SIZE, -1) for t in dev.model["k"]]
    v = [t.view(SIZE, -1) for t in dev.model["v"]]
    item = k[0].shape[1] * k[0].element_size()
    host_k = torch.zeros(LAYERS, HOST, k[0].shape[1], dtype=k[0].dtype)
    host_v = torch.zeros_like(host_k)
    table = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    kt, vt, hk, hv = table(k), table(v), table(list(host_k)), table(list(host_v))

    def calls(si, di):
        adapters.transfer_kv_per_layer(host_k[1], k[1], host_v[1], v[1], si, di, item)
        adapters.transfer_kv_all_layer(kt, hk, vt, hv, di, si, item, LAYERS)
    calls(slots(1), slots(3))
    with device_work_only() as (copies, checks), allocations() as made:
        calls(on_device(slots(2)), on_device(slots(5)))
    assert made == [] and copies.launches == 2 and checks.launches == 2
