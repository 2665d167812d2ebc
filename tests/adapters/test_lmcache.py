"""kvtier.adapters.lmcache against a byte model of LMCache's multi_layer_kv_transfer.

The model walks LMCache's offsets by plain address arithmetic, independent of kvtier's
row maps: token ``t`` of plane ``k`` in layer ``l`` of the memory object is at
``key_value + ((k * L + l) * T + t) * row``; its slot ``s`` is at ``ptrs[l] + (k * PBS + s)
* row`` (CUDA / MERGED_KV), ``ptrs[l] + s * row`` (MLA), ``ptrs[2l + k] + s * row``
(SEPARATE_KV), and for MLA_KV the K and V parts of the row (``k_hidden_dims`` then
``v_hidden_dims`` elements) at ``ptrs[2l] + s * kb`` and ``ptrs[2l + 1] + s * vb``;
negative slots are skipped. Every buffer sits between sentinel margins, destinations
start poisoned, and every byte of every buffer is compared after the call.
"""
from __future__ import annotations

import pytest
import torch

from kvtier.adapters import lmcache
from kvtier.adapters.lmcache import KVCacheFormat, multi_layer_kv_transfer
from kvtier.kernels import KvtierError, RowMap
from helpers import POISON, Guarded, assert_bytes_equal
from test_adapter_model import Memory, needs_cpu_kernel

L, T, H, D = 3, 20, 2, 8            # fp16: 32-byte rows
MERGED, SEPARATE, MLA_KV = 1, 2, 3


def slots(n_blocks: int, block: int, tokens: int = T, seed: int = 0, skip_prefix: int = 3) -> torch.Tensor:
    """A vLLM-style slot mapping: the tokens' blocks in random order, ``skip_prefix``
    leading tokens and a few others at -1 (tokens the engine already holds)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(n_blocks, generator=g)[:(tokens + block - 1) // block]
    s = (blocks[:, None] * block + torch.arange(block)).flatten()[:tokens].clone()
    s[:skip_prefix] = -1
    s[torch.randperm(tokens, generator=g)[:2]] = -1
    return s


class Engine:
    """A paged KV cache in one of the forms LMCache reads, plus its memory object."""

    def __init__(self, form: str, to_lmcache: bool, block: int, seed: int = 0):
        self.mem = Memory(seed)
        self.form, self.block = form, block
        self.n_blocks = 128 // block
        self.pbs = self.n_blocks * block
        paged_fill, kv_fill = ("random", "poison") if to_lmcache else ("poison", "random")
        nb, bs, buf = self.n_blocks, block, self.mem.buffer
        self.use_mla = form in ("mla", "mla_kv", "contiguous_mla")
        self.format = {"cuda": None, "mla": None, "merged": MERGED, "separate": SEPARATE,
                       "mla_kv": MLA_KV, "contiguous": SEPARATE, "contiguous_mla": MERGED}[form]
        self.k_dims, self.v_dims = (6, 2) if form == "mla_kv" else (0, 0)
        hidden = H * D if not self.use_mla else D
        self.kv = buf("key_value", (1 if self.use_mla else 2, L, T, hidden), torch.float16, kv_fill)
        self.row = hidden * 2
        if form in ("cuda", "merged"):
            self.layers = [buf(f"layer{l}", (2, nb, bs, H, D), torch.float16, paged_fill) for l in range(L)]
            self.ptrs = table(self.layers)
        elif form == "mla":
            self.layers = [buf(f"layer{l}", (nb, bs, D), torch.float16, paged_fill) for l in range(L)]
            self.ptrs = table(self.layers)
        elif form == "separate":
            self.layers = [buf(f"{c}{l}", (nb, bs, H, D), torch.float16, paged_fill) for l in range(L) for c in "kv"]
            self.ptrs = table(self.layers)               # [K0, V0, K1, V1, ...]
        elif form == "mla_kv":
            self.layers = [buf(f"{c}{l}", (nb, bs, 1, n), torch.float16, paged_fill)
                           for l in range(L) for c, n in (("k", 6), ("v", 2))]
            self.ptrs = table(self.layers)
        elif form == "contiguous":
            self.layers = [buf(c, (L, nb, bs, H, D), torch.float16, paged_fill) for c in "kv"]
            self.ptrs = self.layers                      # [K_all_layers, V_all_layers]
        else:
            self.layers = [buf("kv", (L, nb, bs, D), torch.float16, paged_fill)]
            self.ptrs = self.layers
        self.paged_names = [r[0] for r in self.mem.regions[1:]]

    def call(self, slot_mapping, to_lmcache, **kw):
        args = [self.kv, self.ptrs, slot_mapping, self.kv.device, self.pbs, to_lmcache, self.use_mla]
        if self.format is not None:
            args += [self.format, self.k_dims, self.v_dims]
        multi_layer_kv_transfer(*args, **kw)

    # ------------------------------------------------------------ LMCache's offsets
    def entry(self, l: int, e: int) -> int:
        """Base address of layer ``l``'s table entry ``e``."""
        if self.form == "contiguous":
            return self.layers[e][l].data_ptr()
        if self.form == "contiguous_mla":
            return self.layers[0][l].data_ptr()
        per_layer = 2 if self.form in ("separate", "mla_kv") else 1
        return int(self.ptrs[l * per_layer + e])

    def parts(self, l: int, s: int):
        """(plane, byte in the memory object's row, paged address, bytes) of slot ``s``."""
        row, pbs = self.row, self.pbs
        if self.form in ("cuda", "merged"):
            return [(k, 0, self.entry(l, 0) + (k * pbs + s) * row, row) for k in (0, 1)]
        if self.form in ("separate", "contiguous"):
            return [(k, 0, self.entry(l, k) + s * row, row) for k in (0, 1)]
        if self.form == "mla_kv":
            kb, vb = self.k_dims * 2, self.v_dims * 2
            return [(0, 0, self.entry(l, 0) + s * kb, kb), (0, kb, self.entry(l, 1) + s * vb, vb)]
        return [(0, 0, self.entry(l, 0) + s * row, row)]

    def model(self, slot_mapping, to_lmcache: bool) -> None:
        base, row = self.kv.data_ptr(), self.row
        for t, s in enumerate(slot_mapping.tolist()):
            if s < 0:
                continue
            for l in range(L):
                for k, col, paged, n in self.parts(l, s):
                    lmc = base + ((k * L + l) * T + t) * row + col
                    if to_lmcache:
                        self.mem.copy(lmc, paged, n)
                    else:
                        self.mem.copy(paged, lmc, n)


def table(tensors) -> torch.Tensor:
    """LMCache's kv_cache_pointers: int64 base addresses."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


TABLE_FORMS = ["cuda", "mla", "merged", "separate", "mla_kv"]
# Bare address tables are read by the Triton kernel only (interpreter on CPU tensors).
FORMS = [pytest.param(f, marks=needs_cpu_kernel) for f in TABLE_FORMS] + ["contiguous", "contiguous_mla"]


@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("to_lmcache", [True, False], ids=["paged_to_lmcache", "lmcache_to_paged"])
@pytest.mark.parametrize("form", FORMS)
def test_matches_the_byte_model(form, to_lmcache, block):
    e = Engine(form, to_lmcache, block, seed=block)
    sm = slots(e.n_blocks, block, seed=block)
    e.model(sm, to_lmcache)
    e.mem.assert_changes(*(["key_value"] if to_lmcache else e.paged_names))
    e.call(sm, to_lmcache)
    e.mem.check()
