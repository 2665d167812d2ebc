"""A byte-addressed torch model of the engine calls the adapters mimic, for their tests.

`Memory` holds every buffer of a test (random sources, poisoned destinations, all between
sentinel margins) and a copy of the bytes each should hold. The model functions below
apply an engine call's documented semantics to those expected bytes by plain address
arithmetic (the offset formulas of SGLang's transfer.cu and of sgl_kernel_npu's
dimension exchange), independent of kvtier's row maps; `Memory.check()` then compares
every byte of every buffer, so a byte that should change and did not, or one that
should not change and did, fails the test.
"""
from __future__ import annotations

import pytest
import torch

from helpers import Guarded, POISON, assert_bytes_equal
from kvtier.kernels.launcher import interpreter_active, triton_available

# A bare pointer table is read by the Triton kernel only (the torch reference cannot read
# raw addresses); CPU tensors run the kernel under TRITON_INTERPRET=1 alone.
needs_cpu_kernel = pytest.mark.skipif(not (triton_available() and interpreter_active()),
                                      reason="bare pointer tables need the Triton kernel on CPU tensors")


class Memory:
    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.regions = []   # [name, Guarded, address, expected bytes, initial bytes]

    def buffer(self, name: str, shape, dtype=torch.float16, fill: str = "random") -> torch.Tensor:
        g = Guarded(shape, dtype, fill=fill, gen=self.gen)
        self.regions.append([name, g, g.t.data_ptr(), g.snapshot(), g.snapshot()])
        return g.t

    def _at(self, addr: int, n: int):
        for name, g, base, want, _ in self.regions:
            if base <= addr and addr + n <= base + g.nbytes:
                return want, addr - base
        raise AssertionError(f"model reaches bytes [{addr:#x}, +{n}) outside every buffer")

    def copy(self, dst: int, src: int, n: int) -> None:
        """The model's only primitive: n bytes from address src to address dst."""
        s, so = self._at(src, n)
        d, do = self._at(dst, n)
        d[do:do + n] = s[so:so + n].clone()

    def check(self) -> None:
        for name, g, _, want, _ in self.regions:
            g.check()
            assert_bytes_equal(g.bytes(), want, name)

    def assert_changes(self, *names: str) -> None:
        """The modelled call changes each named buffer (so the test can fail)."""
        for name, _, _, want, initial in self.regions:
            if name in names:
                assert not torch.equal(want, initial), f"{name}: the model changes nothing"


def table(layers) -> torch.Tensor:
    """An engine-style pointer table: uint64 addresses of per-layer tensors."""
    return torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)


def addr_of(t: torch.Tensor) -> int:
    return t.data_ptr()


# ---------------------------------------------------------------- SGLang transfer.cu offsets
def lf(base: int, idx: int, item: int) -> int:
    """Layer first, one layer: rows packed."""
    return base + idx * item


def pf(base: int, layer: int, idx: int, item: int, page_dim: int) -> int:
    """Page first: a token's layers together, page_dim bytes per token."""
    return base + idx * page_dim + layer * item


def ph(base: int, layer: int, idx: int, item: int, page_dim: int, head: int, heads: int, page: int) -> int:
    """Page head (pages, heads, page_size, layers, head bytes)."""
    return (base + idx // page * page * page_dim + page_dim // heads * head * page
            + idx % page * page_dim // heads + layer * item // heads)


def kernel_copy(mem: Memory, comps, si, di, layers, item: int, skip_negative: bool = True) -> None:
    """SGLang's row kernel: for each pair j (skipping negatives), layer l and component,
    item bytes from src_off(l, s) to dst_off(l, d). ``comps``: [(src_off, dst_off)]."""
    for s, d in zip(si.tolist(), di.tolist()):
        if skip_negative and (s < 0 or d < 0):
            continue
        for layer in layers:
            for src_off, dst_off in comps:
                mem.copy(dst_off(layer, d), src_off(layer, s), item)


def head_copy(mem: Memory, comps, si, di, layers, item: int, heads: int) -> None:
    """SGLang's page-head kernel: the same per head, item / heads bytes at a time."""
    for s, d in zip(si.tolist(), di.tolist()):
        for layer in layers:
            for h in range(heads):
                for src_off, dst_off in comps:
                    mem.copy(dst_off(layer, d, h), src_off(layer, s, h), item // heads)


def row_addr(t: torch.Tensor, idx: int) -> int:
    """Address of slice ``idx`` along dim 0 (the direct calls' rows)."""
    return t.data_ptr() + idx * t.stride(0) * t.element_size()


def slice_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


# ---------------------------------------------------------------- self-tests of the model
def test_memory_rejects_bytes_outside_buffers():
    mem = Memory()
    t = mem.buffer("t", (4, 8))
    with pytest.raises(AssertionError, match="outside every buffer"):
        mem.copy(t.data_ptr() + 60, t.data_ptr(), 8)


def test_memory_check_sees_an_unmodelled_write():
    mem = Memory()
    t = mem.buffer("t", (4, 8), fill="poison")
    t.view(torch.uint8)[0, 3] = POISON ^ 1
    with pytest.raises(AssertionError, match="bytes differ"):
        mem.check()


def test_ph_offsets_match_the_page_head_tensor():
    # (pages=2, heads=3, page=4, layers=5, head_dim=2) fp16: the formula walks the tensor.
    t = torch.arange(2 * 3 * 4 * 5 * 2, dtype=torch.float16).view(2, 3, 4, 5, 2)
    item, page_dim = 3 * 2 * 2, 5 * 3 * 2 * 2
    for idx in (0, 5, 7):
        for layer in (0, 4):
            for h in range(3):
                a = ph(t.data_ptr(), layer, idx, item, page_dim, h, 3, 4)
                assert a == t[idx // 4, h, idx % 4, layer].data_ptr()
