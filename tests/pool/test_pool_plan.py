"""Batch plans (`HostPool.plan`, `kvtier.pool.plan.TransferPlan`): a batch's lists copied
and checked once, then every call only launches. The plan moves the bytes the pool's own
calls move, for every host layout, storage form and strategy; a write to the caller's
lists after the plan was made (through torch or not) reaches nothing; a bad list is
refused when the plan is made, naming it, before any byte moves; the plan's launches
check nothing again."""
from __future__ import annotations

import pytest
import torch

from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from hot_path_support import device_work_only
from pool_support import DeviceCase, HostCase
from pool_support import small_dma_chunks  # noqa: F401  (autouse fixture: dma chunks of two pages)
from kvtier.kernels import KvtierError

P, SIZE, HOST = 4, 32, 48
LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]



def slots(*pages):
    return torch.tensor([p * P + i for p in pages for i in range(P)], dtype=torch.int64)


def cases(layout, storage, strategy, seed=3):
    dev = DeviceCase("mha", storage, P, layers=2, size=SIZE, gen=torch.Generator().manual_seed(seed))
    return dev, HostCase(dev.pool, layout, strategy, size_tokens=HOST)


def same(a, b):
    bits = lambda t: t.view(torch.uint8)  # noqa: E731
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def state(dev, host):
    return [t.clone() for ts in dev.model.values() for t in ts] + [b.clone() for b in host.host.buffers.values()]


@pytest.mark.parametrize("strategy", ["kernel", "dma"])
@pytest.mark.parametrize("storage", ["layers", "stacked"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_plan_moves_what_the_pools_calls_move(layout, storage, strategy):
    """Backup, then a layer loop and an all-layer load, by a plan and by the pool's own
    calls on a twin of the pools: the same bytes everywhere."""
    outs = []
    for planned in (True, False):
        dev, host = cases(layout, storage, strategy)
        hp, dp = host.host, dev.pool
        hi, di, back = slots(0, 2, 3), slots(5, 1, 6), slots(7, 4, 2)
        if planned:
            hp.plan(dp, hi, di).backup()
            plan = hp.plan(dp, hi, back)
            for layer in range(2):
                plan.load_layer(layer)
            hp.plan(dp, slots(0), slots(0)).load()
        else:
            hp.backup_from_device_all_layer(dp, hi, di)
            for layer in range(2):
                hp.load_to_device_per_layer(dp, hi, back, layer)
            hp.load_to_device_all_layer(dp, slots(0), slots(0))
        dev.check_margins()
        host.check_margins()
        outs.append(state(dev, host))
    assert same(*outs)


@pytest.mark.parametrize("how", ["torch", "numpy", "data"])
def test_the_callers_lists_written_after_the_plan_reach_nothing(how):
    dev, host = cases("page_first_direct", "layers", "kernel")
    hp, dp = host.host, dev.pool
    hi, di = slots(0, 1), slots(2, 3)
    hp.backup_from_device_all_layer(dp, hi, di)
    target = slots(6, 7)
    plan = hp.plan(dp, hi, target)
    if how == "torch":
        target[0] = 999
    elif how == "numpy":
        target.numpy()[:] = 31
    else:
        target.data = torch.full((2 * P,), 40)
    for layer in range(2):
        plan.load_layer(layer)
    for name, layers in dev.model.items():
        for t in layers:
            rows = t.reshape(SIZE, -1)
            assert torch.equal(rows[slots(6, 7)].view(torch.uint8), rows[di].view(torch.uint8)), name
    dev.check_margins()


@pytest.mark.parametrize("which,arg,limit", [("host", "host_indices", 48), ("device", "device_indices", 32)])
def test_a_bad_list_is_refused_when_the_plan_is_made(which, arg, limit):
    dev, host = cases("layer_first", "layers", "kernel")
    before = state(dev, host)
    hi, di = slots(0, 1), slots(2, 3)
    if which == "host":
        hi = slots(0, 12)
    else:
        di = slots(2, 8)
    with pytest.raises(KvtierError, match=rf"{arg}=\d+: index out of range for {limit} rows"):
        host.host.plan(dev.pool, hi, di)
    assert same(before, state(dev, host))


def test_shapes_are_refused_when_the_plan_is_made():
    dev, host = cases("layer_first", "layers", "kernel")
    with pytest.raises(KvtierError, match="device_indices='4 indices': host_indices has 8"):
        host.host.plan(dev.pool, slots(0, 1), slots(2))
    with pytest.raises(KvtierError, match="layer_id=5"):
        host.host.plan(dev.pool, slots(0), slots(1)).load_layer(5)


def test_a_plans_launches_check_nothing_again():
    dev, host = cases("page_first_direct", "layers", "kernel")
    plan = host.host.plan(dev.pool, slots(0, 1), slots(2, 3))
    with device_work_only() as (copies, checks):
        plan.backup()
        for layer in range(2):
            plan.load_layer(layer)
    assert copies.launches == 3 and checks.launches == 0


@pytest.mark.parametrize("bad", ["device_indices", "host_indices"])
@pytest.mark.parametrize("checked_by_launch", ["device list", "both lists"])
def test_a_bad_list_checked_by_the_plans_launch_gates_every_call(checked_by_launch, bad, monkeypatch):
    """Lists the plan checks by its check launch (device-resident ones on an accelerator;
    here CPU lists sent that way): the check writes the plan's words, and until the
    failure reaches the host (emulated: the thread's record is not read), every launch of
    the plan reads them and moves nothing; then the failure is raised at the next call
    or at `synchronize`, naming the list."""
    from kvtier.kernels import faults
    from kvtier.pool import plan as plan_module
    dev, host = cases("page_first_direct", "layers", "kernel")
    hi, di = slots(0, 1), slots(2, 3)
    if bad == "host_indices":
        hi, value = slots(0, 12), 48
    else:
        di, value = slots(2, 8), 32
    if bad == "host_indices" and checked_by_launch == "device list":
        pytest.skip("a host list checked on the host raises when the plan is made (test above)")
    by_launch = ("device_indices",) if checked_by_launch == "device list" else ("device_indices", "host_indices")
    monkeypatch.setattr(plan_module, "_checked_on_host", lambda name, idx: name not in by_launch)
    before = state(dev, host)
    with monkeypatch.context() as late:
        late.setattr(faults, "raise_pending", lambda this_call=False: None)
        plan = host.host.plan(dev.pool, hi, di)
        plan.backup()
        for layer in range(2):
            plan.load_layer(layer)
        plan.load()
    assert same(before, state(dev, host)), "a plan whose list is bad moved bytes"
    with pytest.raises(KvtierError, match=rf"{bad}={value}: index out of range"):
        host.host.synchronize()
    dev.check_margins()
    host.check_margins()


@pytest.mark.cuda
def test_on_a_gpu_a_bad_device_list_moves_nothing_and_is_reported():
    """Device-resident lists are checked by the plan's own check launch, without a sync:
    every launch of the plan then moves nothing, and the failure is raised at the next
    call or `synchronize`."""
    from kvtier.pool import HostPool, MHADevicePool
    dev = MHADevicePool(64, 4, 2, 2, 8, dtype=torch.float16, device="cuda")
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    host = HostPool(dev, layout="page_first_direct", size_tokens=64, strategy="kernel")
    hi, bad = host.alloc(8), torch.arange(60, 68, device="cuda")
    before = [t.clone() for t in host.buffers.values()]
    plan = host.plan(dev, hi, bad)
    plan.backup()
    with pytest.raises(KvtierError, match="device_indices=64"):
        host.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, host.buffers.values()))
