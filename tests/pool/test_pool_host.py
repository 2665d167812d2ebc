"""HostPool backup/load: every pool kind x storage form x host layout x strategy,
bit-exact against plain torch indexing of the original tensors."""
import random

import pytest
import torch

from kvtier.kernels import KvtierError, LAYOUTS
from kvtier import platforms as plat
from kvtier.pool import HostPool, MHADevicePool
from pool_support import (KINDS, DeviceCase, HostCase, assert_same, backup_then_load_all, expected_backup,
                          moved_dev_rows, pages_to_slots)

STRATEGIES = ("kernel", "dma")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("storage", ["layers", "stacked"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_backup_then_load_restores(kind, storage, layout, strategy, page_size):
    gen = torch.Generator().manual_seed(hash((kind, storage, layout, strategy, page_size)) % 2**31)
    dev = DeviceCase(kind, storage, page_size, size=12 * page_size, gen=gen)
    hc = HostCase(dev.pool, layout, strategy)
    host = hc.host
    # Fragmented host slots (two runs) and shuffled, disjoint device pages.
    hslots = host.alloc(6 * page_size)
    keep = torch.cat([hslots[:page_size], hslots[3 * page_size:5 * page_size]])
    pages = torch.randperm(12, generator=gen)
    didx, didx2, didx3 = (pages_to_slots(pages[i:i + 3], page_size) for i in (0, 3, 6))
    # Back up, then load all layers into other device pages: exactly the backed-up rows land there.
    original, before, want = backup_then_load_all(hc, dev, keep, didx, didx2)

    # Per-layer loads in a random order into a third set of pages.
    layer_ids = list(range(dev.pool.num_layers))
    random.Random(page_size).shuffle(layer_ids)
    for i, layer in enumerate(layer_ids):
        host.load_to_device_per_layer(dev.pool, keep, didx3, layer)
        want = moved_dev_rows(want, original, didx, didx3, layers=set(layer_ids[:i + 1]))
        assert_same(dev.model, want, f"device after loading layer {layer}")
    assert_same(host.buffers, expected_backup(hc, dev, before, keep, didx), "host after loads")
    dev.check_margins()
    hc.check_margins()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_draft_layers_packed_after_target(layout, strategy):
    P = 4
    gen = torch.Generator().manual_seed(7)
    target = DeviceCase("mha_v_indexer", "layers", P, layers=3, gen=gen)
    draft = DeviceCase("mha_v_indexer", "stacked", P, layers=2, gen=gen)
    hc = HostCase([target.pool, draft.pool], layout, strategy)
    host = hc.host
    hidx, didx = pages_to_slots([5, 1], P), pages_to_slots([2, 6], P)
    before = hc.snapshot()
    host.backup_from_device_all_layer(target.pool, hidx, didx)   # moves the draft too
    want = expected_backup(hc, target, before, hidx, didx)
    offsets = {n: len(target.model[n]) for n in target.model}
    want = expected_backup(hc, draft, want, hidx, didx, offsets)
    assert_same(host.buffers, want, "host after packed backup")

    t0, d0 = target.snapshot(), draft.snapshot()
    didx2 = pages_to_slots([0, 7], P)
    host.load_to_device_per_layer(draft.pool, hidx, didx2, 1)    # draft layer 1 only
    assert_same(draft.model, moved_dev_rows(d0, d0, didx, didx2, layers={1}), "draft after layer load")
    assert_same(target.model, t0, "target untouched by a draft layer load")
    host.load_to_device_all_layer(target.pool, hidx, didx2)
    assert_same(target.model, moved_dev_rows(t0, t0, didx, didx2), "target after load_all")
    assert_same(draft.model, moved_dev_rows(d0, d0, didx, didx2), "draft after load_all")
    for c in (target, draft, hc):
        c.check_margins()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pipeline_stage_takes_model_layer_ids(strategy):
    P = 4
    dev = DeviceCase("mla_split_indexer", "stacked", P, layers=3, start_layer=4)
    hc = HostCase(dev.pool, "page_first_direct", strategy)
    hidx, didx, didx2 = (pages_to_slots([p], P) for p in (2, 3, 5))
    hc.host.backup_from_device_all_layer(dev.pool, hidx, didx)
    original = dev.snapshot()
    hc.host.load_to_device_per_layer(dev.pool, hidx, didx2, 6)   # model layer 6 = local 2
    # local layer 2 has no indexer rows (the indexer holds 2 layers).
    assert_same(dev.model, moved_dev_rows(original, original, didx, didx2, layers={2}), "stage load")
    for bad in (3, 7, -1):
        with pytest.raises(KvtierError, match=f"layer_id={bad}"):
            hc.host.load_to_device_per_layer(dev.pool, hidx, didx2, bad)
    assert_same(dev.model, moved_dev_rows(original, original, didx, didx2, layers={2}), "unchanged")


# ---------------------------------------------------------------------------- bad input
def _setup(layout="page_first_direct", P=4, kind="mha"):
    dev = DeviceCase(kind, "layers", P)
    hc = HostCase(dev.pool, layout, "kernel")
    return dev, hc


def _bad_calls(dev, hc, P):
    h = hc.host
    ok_h, ok_d = pages_to_slots([1], P), pages_to_slots([2], P)
    return {
        "device index from another pool's range": (
            lambda: h.backup_from_device_all_layer(dev.pool, ok_h, ok_d + dev.size), "device_indices"),
        "host index beyond the host pool": (
            lambda: h.backup_from_device_all_layer(dev.pool, ok_h + h.size, ok_d), "host_indices"),
        "count mismatch": (
            lambda: h.backup_from_device_all_layer(dev.pool, ok_h, ok_d[:-1]), "device_indices"),
        "misaligned host page": (
            lambda: h.backup_from_device_all_layer(dev.pool, ok_h + 1, ok_d), "host_indices"),
        "misaligned device page": (
            lambda: h.backup_from_device_all_layer(dev.pool, ok_h, ok_d + 1), "device_indices"),
        "float indices": (
            lambda: h.backup_from_device_all_layer(dev.pool, ok_h.float(), ok_d), "host_indices.dtype"),
        "not a pool": (
            lambda: h.backup_from_device_all_layer("pool", ok_h, ok_d), "device_pool"),
        "load: device index out of range": (
            lambda: h.load_to_device_all_layer(dev.pool, ok_h, ok_d + dev.size), "device_indices"),
        "load: layer outside the stage": (
            lambda: h.load_to_device_per_layer(dev.pool, ok_h, ok_d, dev.pool.num_layers), "layer_id"),
        "load: misaligned host page": (
            lambda: h.load_to_device_per_layer(dev.pool, ok_h + 2, ok_d, 0), "host_indices"),
    }


BAD_CALLS = [
    "device index from another pool's range", "host index beyond the host pool", "count mismatch",
    "misaligned host page", "misaligned device page", "float indices", "not a pool",
    "load: device index out of range", "load: layer outside the stage", "load: misaligned host page"]


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_input_raises_before_any_byte_moves(name):
    P = 4
    dev, hc = _setup(P=P)
    call, arg = _bad_calls(dev, hc, P)[name]
    hbefore, dbefore = hc.snapshot(), dev.snapshot()
    with pytest.raises(KvtierError, match=arg.replace(".", r"\.")):
        call()
    assert_same(hc.host.buffers, hbefore, f"host after {name}")
    assert_same(dev.model, dbefore, f"device after {name}")


@pytest.mark.parametrize("field,over,layers", [
    ("head_num", {"k": ((3, 8), torch.float16), "v": ((3, 8), torch.float16)}, 3),
    ("head_dim", {"k": ((2, 16), torch.float16), "v": ((2, 16), torch.float16)}, 3),
    ("dtype", {"k": ((2, 8), torch.bfloat16), "v": ((2, 8), torch.bfloat16)}, 3),
    ("layer_num", {}, 4),
])
def test_mismatched_device_pool_rejected(field, over, layers):
    P = 4
    dev, hc = _setup(P=P)
    other = DeviceCase("mha", "layers", P, layers=layers, **over)
    hbefore, dbefore = hc.snapshot(), other.snapshot()
    with pytest.raises(KvtierError, match=f"device_pool.k.{field}"):
        hc.host.backup_from_device_all_layer(other.pool, pages_to_slots([0], P), pages_to_slots([0], P))
    with pytest.raises(KvtierError, match=f"device_pool.k.{field}"):
        hc.host.load_to_device_all_layer(other.pool, pages_to_slots([0], P), pages_to_slots([0], P))
    assert_same(hc.host.buffers, hbefore, "host")
    assert_same(other.model, dbefore, "device")


def test_equal_pool_stands_in_for_the_target():
    """A pool re-created with the target's rows (e.g. after an engine resumes) works."""
    P = 4
    dev, hc = _setup(P=P, layout="layer_first")
    again = DeviceCase("mha", "stacked", P)
    hidx, didx = pages_to_slots([3], P), pages_to_slots([1], P)
    before = hc.snapshot()
    hc.host.backup_from_device_all_layer(again.pool, hidx, didx)
    assert_same(hc.host.buffers, expected_backup(hc, again, before, hidx, didx), "host")


def test_sizing_pinning_and_construction_errors():
    dev = MHADevicePool(16, 4, 2, 2, 8, dtype=torch.float16)
    per_token = 2 * 2 * (2 * 8 * 2)                      # K+V, 2 layers, 32-byte rows
    h = HostPool(dev, size_gb=per_token * 21 / 1e9)      # 21 tokens -> 5 pages
    assert h.size == 20 and h.available_size() == 20 and h.bytes_per_token == per_token
    assert not h.pin_memory                              # no accelerator: plain memory
    assert h.buffers["k"].shape == (2, 20, 2, 8)
    with pytest.raises(KvtierError, match="size_tokens"):
        HostPool(dev, size_tokens=2)
    with pytest.raises(KvtierError, match="size_tokens"):
        HostPool(dev)
    with pytest.raises(KvtierError, match="layout='bad'"):
        HostPool(dev, size_tokens=16, layout="bad")
    with pytest.raises(KvtierError, match="strategy"):
        HostPool(dev, size_tokens=16, strategy="fast")
    draft = MHADevicePool(16, 4, 1, 4, 8, dtype=torch.float16)
    with pytest.raises(KvtierError, match=r"device_pools\[1\].k.head_num"):
        HostPool([dev, draft], size_tokens=16)


def accelerator_round_trip(device, layout, strategy, register=False):
    """Backup, load of all layers, then per-layer loads in reverse order, on an accelerator."""
    P = 16
    dev = MHADevicePool(256, P, 4, 8, 128, dtype=torch.bfloat16, device=device)
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    host = HostPool(dev, layout=layout, size_tokens=512, strategy=strategy, register=register)
    assert host.pin_memory and host.buffers["k"].is_pinned()
    hidx = host.alloc(64)
    didx, didx2, didx3 = (pages_to_slots(p, P).to(device) for p in ([3, 1, 9, 4], [0, 2, 5, 6], [7, 8, 10, 11]))
    want = dev.gather(didx)
    host.backup_from_device_all_layer(dev, hidx, didx)
    host.load_to_device_all_layer(dev, hidx, didx2)
    for layer in reversed(range(4)):
        host.load_to_device_per_layer(dev, hidx, didx3, layer)
    plat.synchronize(torch.device(device))
    for d in (didx2, didx3):
        got = dev.gather(d)
        assert all(torch.equal(got[n], want[n]) for n in want)
    return host


@pytest.mark.cuda
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_round_trip(layout, strategy):
    accelerator_round_trip("cuda", layout, strategy)


@pytest.mark.npu
@pytest.mark.parametrize("strategy,register", [("dma", False), ("kernel", True), ("auto", True),
                                               ("auto", False)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_npu_round_trip(layout, strategy, register):
    """Ascend: dma through plain pinned memory; the kernel through registered host memory."""
    host = accelerator_round_trip("npu", layout, strategy, register)
    assert host.registered == register


def test_register_is_a_no_op_off_ascend():
    dev = MHADevicePool(16, 4, 2, 4, 8, dtype=torch.float16)
    assert HostPool(dev, size_tokens=16, register=True).registered is False
