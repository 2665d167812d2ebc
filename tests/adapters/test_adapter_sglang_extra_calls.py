"""The kvcacheio names SGLang imports beside the transfer calls (get_device_accessible_ptr,
transfer_embedding_ranges_direct), sgl_kernel_npu's Mamba state calls, and
sglang_install without SGLang: torch references, poisoned destinations, every byte checked."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

from kvtier.adapters import sglang_install
from kvtier.adapters.sglang_npu import TransferDirection
from kvtier.adapters.sglang_npu_state import (transfer_mamba_state, transfer_state_all_layer_direct_lf_pf,
                                              transfer_state_per_layer_direct_pf_lf)
from kvtier.adapters.sglang_ranges import get_device_accessible_ptr, transfer_embedding_ranges_direct
from kvtier.kernels import KvtierError


def rand(shape, dtype=torch.float16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def bits(t):
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ embedding ranges
def test_embedding_ranges_move_each_run_and_nothing_else():
    src = rand((20, 6))
    buf = torch.full((34, 6), -3.0, dtype=torch.float16)   # 2-row margins either side
    dst = buf[2:32]
    want = buf.clone()
    runs = ([2, 10, 19], [25, 0, 9], [3, 4, 1])
    for s, d, n in zip(*runs):
        want[2 + d:2 + d + n] = src[s:s + n]
    transfer_embedding_ranges_direct(src, dst, *runs)
    assert torch.equal(bits(buf), bits(want))


def test_embedding_ranges_empty_and_bad_input():
    src, dst = rand((4, 2)), torch.zeros(4, 2, dtype=torch.float16)
    transfer_embedding_ranges_direct(src, dst, [1], [0], [0])
    assert not dst.any()
    with pytest.raises(KvtierError, match="lengths"):
        transfer_embedding_ranges_direct(src, dst, [0, 1], [0], [1])
    with pytest.raises(RuntimeError, match="lengths"):
        transfer_embedding_ranges_direct(src, dst, [0], [0], [-1])
    with pytest.raises(KvtierError, match="src_starts"):
        transfer_embedding_ranges_direct(src, dst, "0", [0], [1])
    with pytest.raises(KvtierError):
        transfer_embedding_ranges_direct(src, dst, [3], [0], [2])   # past src's 4 rows
    assert not dst.any()


def test_device_accessible_ptr_on_this_machine():
    t = torch.zeros(8)
    assert get_device_accessible_ptr(t, 0) == t.data_ptr()   # CPU: kernels read host addresses
    with pytest.raises(KvtierError, match="device_index"):
        get_device_accessible_ptr(t, -1)
    with pytest.raises(KvtierError, match="tensor"):
        get_device_accessible_ptr([1, 2], 0)


# ------------------------------------------------------------------ Mamba state
L, S, H = 3, 10, 12


def mamba(state=(2, 4), dtype=torch.float32, seed=0):
    """(device (L, S, *state) random, host (H, L, 1, *state) poisoned)."""
    return rand((L, S, *state), dtype, seed), torch.full((H, L, 1, *state), -5.0, dtype=dtype)


@pytest.mark.parametrize("state", [(2, 4), (3,), (2, 2, 2)])
def test_mamba_state_backup_then_load(state):
    dev, host = mamba(state)
    di, hi = torch.tensor([1, 7, 4]), torch.tensor([0, 11, 5])
    want_host = host.clone()
    want_host[hi, :, 0] = dev[:, di].transpose(0, 1)
    transfer_mamba_state(dev, host, di, hi, TransferDirection.D2H)
    assert torch.equal(bits(host), bits(want_host))

    di2 = torch.tensor([9, 0, 2])
    want_dev = dev.clone()
    want_dev[:, di2] = want_host[hi, :, 0].transpose(0, 1)
    transfer_mamba_state(dev, host, di2, hi, direction=TransferDirection.H2D)
    assert torch.equal(bits(dev), bits(want_dev))
    assert torch.equal(bits(host), bits(want_host))


def test_state_per_layer_pf_lf_moves_one_layer():
    dev, host = mamba()
    host.copy_(rand(host.shape, host.dtype, seed=4))
    before = dev.clone()
    si, di = torch.tensor([3, 8]), torch.tensor([6, 2])
    transfer_state_per_layer_direct_pf_lf(host, dev[1], si, di, 1)
    want = before.clone()
    want[1, di] = host[si, 1, 0]
    assert torch.equal(bits(dev), bits(want))
    with pytest.raises(KvtierError, match="layer_id"):
        transfer_state_per_layer_direct_pf_lf(host, dev[1], si, di, 3)


def test_state_all_layer_lf_pf_every_component():
    (d1, h1), (d2, h2) = mamba((2, 4), seed=1), mamba((5,), torch.float16, seed=2)
    di, hi = torch.tensor([0, 9]), torch.tensor([7, 3])
    w1, w2 = h1.clone(), h2.clone()
    w1[hi, :, 0] = d1[:, di].transpose(0, 1)
    w2[hi, :, 0] = d2[:, di].transpose(0, 1)
    transfer_state_all_layer_direct_lf_pf([d1, d2], [h1, h2], di, hi)
    assert torch.equal(bits(h1), bits(w1)) and torch.equal(bits(h2), bits(w2))


def test_mamba_state_bad_input_named():
    dev, host = mamba()
    di, hi = torch.tensor([1]), torch.tensor([2])
    with pytest.raises(KvtierError, match="device_buf"):
        transfer_mamba_state(dev.transpose(2, 3), host, di, hi)   # state dims not dense
    with pytest.raises(KvtierError, match="host_buf"):
        transfer_mamba_state(dev, host[:, :, 0], di, hi)
    with pytest.raises(KvtierError, match="host_states"):
        transfer_state_all_layer_direct_lf_pf([dev], [host, host], di, hi)
    assert (host == -5.0).all()


# ------------------------------------------------------------------ install without SGLang
def test_install_provides_kvcacheio_modules_and_uninstall_restores():
    had = {m: sys.modules.get(m) for m in ("sgl_kernel", "sgl_kernel.kvcacheio",
                                           "sgl_kernel_npu", "sgl_kernel_npu.kvcacheio")}
    routed = sglang_install.install()
    try:
        assert sglang_install.install() == routed            # idempotent
        io = importlib.import_module("sgl_kernel.kvcacheio")
        npu = importlib.import_module("sgl_kernel_npu.kvcacheio")
        for name, fn in sglang_install.KVCACHEIO.items():
            assert getattr(io, name) is fn
        assert npu.transfer_mamba_state is transfer_mamba_state
        assert io.get_device_accessible_ptr is get_device_accessible_ptr
        if had["sgl_kernel"] is None:
            with pytest.raises(ImportError):
                from sgl_kernel import assign_req_to_token_pool_cpu  # noqa: F401
    finally:
        sglang_install.uninstall()
    assert {m: sys.modules.get(m) for m in had} == had
    assert sglang_install.installed() == {}
