"""SGLang's own pool classes (sglang==0.5.23, installed by .ci/sglang.sh) moving KV through
kvtier after `kvtier.adapters.sglang_install.install()`, on CPU.

SGLang's device pools (MHATokenToKVPool, MLATokenToKVPool, the NPU MHA pool for
kernel_ascend) and host pools (MHATokenToKVPoolHost, MLATokenToKVPoolHost) are built for
every host layout and io backend they accept on a CPU; random device KV is backed up
into a poisoned host pool and loaded back layer by layer into other device pages. A torch
reference reads both sides as (component, layer, token, row) and checks every byte that
should move did and every other byte is unchanged. The page-buffer calls (get/set flat
pages, page metadata) are checked on the host buffer. A last test reproduces the CUDA
state of SGLang's JIT checks and shows install() routes those transfers to kvtier.
Skips with one reason where the package is not importable.
"""
from __future__ import annotations

import ctypes
import types

import pytest
import torch

from sglang_package_support import load

mods, why = load()
if mods is None:
    pytest.skip(why, allow_module_level=True)

from kvtier.adapters import sglang_install  # noqa: E402
from kvtier.platforms import synchronize  # noqa: E402

P, LAYERS, DEV_TOKENS, HEADS, HEAD_DIM, MLA_DIM = 4, 3, 64, 2, 8, 24
POISON = -7.0
DTYPE = torch.float16

CASES = [  # (pool, layout, io backend): what SGLang 0.5.23's pools accept, CPU-constructible
    ("mha", "layer_first", "kernel"), ("mha", "layer_first", "direct"),
    ("mha", "page_first", "kernel"), ("mha", "page_first_direct", "direct"),
    ("mha", "page_head", "kernel"), ("mha_npu", "page_first_direct", "kernel_ascend"),
    ("mla", "layer_first", "kernel"), ("mla", "layer_first", "direct"),
    ("mla", "page_first", "kernel"), ("mla", "page_first_direct", "direct"),
]


@pytest.fixture
def routed():
    sglang_install.install()
    yield
    sglang_install.uninstall()


def build(pool: str, layout: str):
    """(device pool, host pool, device per-layer tensors per component)."""
    mp = mods["memory_pool"]
    if pool == "mla":
        dev = mp.MLATokenToKVPool(DEV_TOKENS, P, DTYPE, MLA_DIM - 8, 8, LAYERS, "cpu", False)
        host_cls, extra, comps = mods["mla"].MLATokenToKVPoolHost, {"target_layer_num": LAYERS}, [dev.kv_buffer]
    else:
        cls = mods["npu_pool"].NPUMHATokenToKVPool if pool == "mha_npu" else mp.MHATokenToKVPool
        dev = cls(DEV_TOKENS, P, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu", False)
        host_cls, extra, comps = mods["mha"].MHATokenToKVPoolHost, {}, [dev.k_buffer, dev.v_buffer]
    info = dev.get_device_pool_infos()[0].buffer_info
    host = host_cls(info, 2.0, 0, P, layout, pin_memory=False, device="cpu",
                    device_capacity_tokens=DEV_TOKENS, start_layer=0, end_layer=LAYERS, **extra)
    return dev, host, comps


def row_elems(comps) -> int:
    t = comps[0][0]
    return t[0].numel() if t.dim() == 3 else t[0, 0].numel()  # (N, *row) or NPU (pages, P, *row)


def host_tokens(kv: torch.Tensor, layout: str, ncomp: int, e: int) -> torch.Tensor:
    """The host buffer as (component, layer, token, row elements), by SGLang's layouts."""
    t = kv if ncomp == 2 else kv.unsqueeze(0)
    if layout == "layer_first":            # (C, L, N, *row)
        v = t
    elif layout in ("page_first", "page_first_direct"):  # (C, N, L, *row), (C, pages, L, P, *row)
        v = t.transpose(1, 2)
    elif layout == "page_head":            # (C, pages, H, P, L, D)
        v = t.permute(0, 4, 1, 3, 2, 5)
    return v.reshape(t.shape[0], LAYERS, -1, e)


def dev_tokens(comps, e: int) -> torch.Tensor:
    return torch.stack([torch.stack([b.reshape(-1, e) for b in layers]) for layers in comps])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def pages_of(first_pages) -> torch.Tensor:
    return (torch.as_tensor(first_pages)[:, None] * P + torch.arange(P)).flatten()


def fill(comps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layers in comps:
        for b in layers:
            b.copy_(torch.randn(b.shape, generator=g).to(DTYPE))


def round_trip(dev, host, comps, layout: str, io: str, seed: int = 0) -> None:
    """Backup of random device pages into a poisoned host, then every layer loaded back
    into other device pages; every byte of both sides checked against the reference."""
    e, ncomp = row_elems(comps), len(comps)
    fill(comps, seed)
    host.kv_buffer.fill_(POISON)
    g = torch.Generator().manual_seed(seed + 1)
    perm = torch.randperm(DEV_TOKENS // P - 1, generator=g) + 1   # device page 0 is SGLang's padding page
    dev_idx, dev_idx2 = pages_of(perm[:3]), pages_of(perm[3:6])
    host.alloc(2 * P)                                             # host pages not starting at 0
    host_idx = host.alloc(3 * P)
    before = dev_tokens(comps, e).clone()

    host.backup_from_device_all_layer(dev, host_idx, dev_idx, io)
    synchronize()
    ht = host_tokens(host.kv_buffer, layout, ncomp, e)
    assert torch.equal(bits(ht[:, :, host_idx]), bits(before[:, :, dev_idx])), "backup: moved bytes differ"
    rest = torch.ones(ht.shape[2], dtype=torch.bool)
    rest[host_idx] = False
    assert (ht[:, :, rest] == POISON).all(), "backup wrote host slots outside host_indices"
    assert torch.equal(bits(dev_tokens(comps, e)), bits(before)), "backup changed the device"

    for layer in range(LAYERS):
        host.load_to_device_per_layer(dev, host_idx, dev_idx2, layer, io)
    synchronize()
    want = before.clone()
    want[:, :, dev_idx2] = before[:, :, dev_idx]
    assert torch.equal(bits(dev_tokens(comps, e)), bits(want)), "load: device bytes differ from the reference"
    assert torch.equal(bits(host_tokens(host.kv_buffer, layout, ncomp, e)), bits(ht)), "load changed the host"


@pytest.mark.parametrize("pool,layout,io", CASES, ids=["-".join(c) for c in CASES])
def test_backup_and_per_layer_load(routed, pool, layout, io):
    dev, host, comps = build(pool, layout)
    round_trip(dev, host, comps, layout, io)


def _page_bytes_mask(kv: torch.Tensor, layout: str, ncomp: int, e: int, tokens) -> torch.Tensor:
    """Which bytes of ``kv`` hold ``tokens`` (every component and layer)."""
    offsets = torch.arange(kv.numel()).view(kv.shape)
    sel = host_tokens(offsets, layout, ncomp, e)[:, :, tokens].flatten()
    item = kv.element_size()
    mask = torch.zeros(kv.numel() * item, dtype=torch.bool)
    mask[(sel[:, None] * item + torch.arange(item)).flatten()] = True
    return mask


@pytest.mark.parametrize("pool,layout,io", [c for c in CASES if c[2] != "direct" or c[1] == "layer_first"],
                         ids=lambda v: v)
def test_page_buffers_and_metadata(routed, pool, layout, io):
    dev, host, comps = build(pool, layout)
    e, ncomp = row_elems(comps), len(comps)
    round_trip(dev, host, comps, layout, io, seed=3)
    kv = host.kv_buffer
    src = host.alloc(P)   # a fresh page gets a backed-up page's bytes through SGLang's flat page
    ht = host_tokens(kv, layout, ncomp, e).clone()
    used = int(torch.nonzero((ht[0, 0] != POISON).any(-1))[0])  # first backed-up token
    page = host.get_data_page(used, flat=True)
    assert page.numel() * page.element_size() == ncomp * LAYERS * P * e * kv.element_size()
    host.set_from_flat_data_page(int(src[0]), page)
    after = host_tokens(kv, layout, ncomp, e)
    want = ht.clone()
    want[:, :, src] = ht[:, :, used:used + P]
    assert torch.equal(bits(after), bits(want)), "set_from_flat_data_page: bytes differ from the reference"
    dummy = host.get_dummy_flat_data_page()
    assert dummy.numel() * dummy.element_size() == page.numel() * page.element_size()

    # Page metadata: the (address, bytes) ranges of the listed pages cover exactly their bytes.
    idx = torch.cat([torch.arange(used, used + P), src])
    meta = host.get_page_buffer_meta(idx)
    assert meta is not None
    ptrs, sizes = meta
    base, nbytes = kv.data_ptr(), kv.numel() * kv.element_size()
    covered = torch.zeros(nbytes, dtype=torch.bool)
    for ptr, size in zip(ptrs, sizes):
        assert base <= ptr and ptr + size <= base + nbytes, "metadata points outside the host buffer"
        covered[ptr - base:ptr - base + size] = True
    assert sum(sizes) == int(covered.sum()), "metadata ranges overlap"
    assert torch.equal(covered, _page_bytes_mask(kv, layout, ncomp, e, idx))
    # The bytes at those addresses are the page's bytes (read through the addresses).
    first = bytes((ctypes.c_char * sizes[0]).from_address(ptrs[0]))
    assert first == kv.view(torch.uint8).flatten()[ptrs[0] - base:ptrs[0] - base + sizes[0]].numpy().tobytes()


class _CudaCapabilities:
    """SGLang's current platform as it reads on CUDA: HiCache device kernels present."""

    def __init__(self, platform):
        self._platform = platform
        self.capabilities = types.SimpleNamespace(**{**vars(platform.capabilities), "hicache_device_kernels": True}) \
            if hasattr(platform.capabilities, "__dict__") else types.SimpleNamespace(hicache_device_kernels=True)

    def __getattr__(self, name):
        return getattr(self._platform, name)


@pytest.mark.parametrize("pool,layout", [("mha", "layer_first"), ("mha", "page_first"),
                                         ("mla", "layer_first"), ("mla", "page_first")])
def test_jit_paths_routed(monkeypatch, pool, layout):
    """With SGLang's JIT checks answering as on CUDA, SGLang takes its JIT kernels; after
    install() the same pools take kvtier's calls and move the right bytes."""
    module = mods["mla" if pool == "mla" else "mha"]
    jit_calls, kvtier_calls = [], []
    monkeypatch.setattr(module, "_is_cuda", True)
    monkeypatch.setattr(module, "current_platform", _CudaCapabilities(module.current_platform))
    for check in sglang_install.JIT_CHECKS:
        monkeypatch.setattr(module, check, lambda **kw: True)
    for name in [n for n in vars(module) if n.startswith("jit_transfer_hicache")]:
        monkeypatch.setattr(module, name, lambda *a, _n=name, **kw: jit_calls.append(_n))
    for name, fn in list(sglang_install.KVCACHEIO.items()):
        def spy(*a, _fn=fn, _n=name, **kw):
            kvtier_calls.append(_n)
            return _fn(*a, **kw)
        monkeypatch.setitem(sglang_install.BINDINGS, name, spy)

    dev, host, comps = build(pool, layout)         # not installed: SGLang's CUDA choice
    assert host.can_use_jit
    host.backup_from_device_all_layer(dev, host.alloc(P), torch.arange(P, 2 * P), "kernel")
    assert jit_calls, "the reproduced CUDA state did not take SGLang's JIT path"

    jit_calls.clear()
    sglang_install.install()
    try:
        dev, host, comps = build(pool, layout)
        assert not host.can_use_jit and not getattr(host, "can_use_write_back_jit", False)
        round_trip(dev, host, comps, layout, "kernel", seed=5)
    finally:
        sglang_install.uninstall()
    assert not jit_calls, f"JIT kernels called after install(): {jit_calls}"
    assert kvtier_calls, "no kvtier call was made"


def test_install_is_idempotent_and_uninstall_restores():
    mha = mods["mha"]
    before = {n: vars(mha).get(n, None) for n in ("transfer_kv_per_layer", "can_use_hicache_jit_kernel")}
    first = sglang_install.install()
    try:
        assert sglang_install.install() == first
        assert mods["mha"].MHATokenToKVPoolHost and first["sglang.srt.mem_cache.pool_host.mha"]
        import sgl_kernel.kvcacheio as io
        assert io.transfer_kv_per_layer is sglang_install.KVCACHEIO["transfer_kv_per_layer"]
        assert mha.can_use_hicache_jit_kernel(element_size=256) is False
    finally:
        sglang_install.uninstall()
    assert {n: vars(mha).get(n, None) for n in before} == before
    assert sglang_install.installed() == {}
