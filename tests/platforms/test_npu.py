"""Hardware tests for Ascend NPUs (``pytest -m npu``, with torch_npu and CANN installed;
set KVTIER_TEST_NPU=1 so that the test setup may import torch_npu). Skipped elsewhere.

Each copy runs the compiled kernel on the NPU (device -> device gather, and backup/load
through host memory with the dma strategy or registered memory) and is compared bit for
bit with the torch reference, on poisoned, sentinel-guarded destinations.
"""
import pytest
import torch

from helpers import POISON, Guarded, assert_bytes_equal
from kvtier.kernels import CopyConfig, RowMap, copy_rows, copy_rows_reference
from kvtier import platforms as plat

pytestmark = pytest.mark.npu

L, N, P = 4, 64, 16


def npu_config():
    lim = plat.npu_launch_limits()
    return CopyConfig(num_programs=lim["grid"], rows=lim["min_rows"],
                      block_bytes=min(16384, lim["max_tile_bytes"] // lim["min_rows"]), num_warps=1)


def test_platform_reports_the_npu():
    assert plat.detect_platform() == "npu"
    props = plat.device_properties()
    assert props["num_vectorcore"] >= props["num_aicore"] >= 1, props
    assert plat.npu_launch_limits()["grid"] == props["num_vectorcore"]
    plat.synchronize()
    assert plat.current_stream() is not None
    assert plat.pinned_empty((4,), torch.uint8).is_pinned()


@pytest.mark.parametrize("dtype,row", [(torch.bfloat16, (8, 128)), (torch.float8_e4m3fn, (656,)),
                                       (torch.uint8, (132,))])
def test_device_gather_bit_exact(dtype, row):
    dev = plat.default_device()
    gen = torch.Generator().manual_seed(0)
    src = Guarded((L, N) + row, dtype, gen=gen, device=dev)
    dst = Guarded((L, N) + row, dtype, fill="poison", gen=gen, device=dev)
    want = Guarded((L, N) + row, dtype, fill="poison", gen=gen, device=dev)
    si = torch.randperm(N, generator=gen)[:20].to(dev)
    di = torch.randperm(N, generator=gen)[:20].to(dev)
    s_map = RowMap.from_stacked(src.t, page_size=P)
    copy_rows(s_map, si, RowMap.from_stacked(dst.t, page_size=P), di, config=npu_config())
    copy_rows_reference(s_map, si, RowMap.from_stacked(want.t, page_size=P), di)
    plat.synchronize(dev)
    assert_bytes_equal(dst.bytes().cpu(), want.bytes().cpu(), "gather")
    assert (dst.bytes().cpu() == POISON).sum() == (want.bytes().cpu() == POISON).sum()
    src.check()
    dst.check()


def test_pinned_host_memory_is_not_kernel_addressable():
    """Plain pinned memory is reachable by DMA only on Ascend: the kernel must not be given it."""
    host = plat.pinned_empty((L, N, 256), torch.uint8)
    assert plat.host_device_address(host, "npu") is None
