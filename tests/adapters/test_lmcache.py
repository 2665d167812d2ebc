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
from kvtier.adapters import maps as adapter_maps
from kvtier.adapters import registry
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

    def args(self, slot_mapping, to_lmcache) -> list:
        """LMCache's positional arguments: seven (CUDA), or eleven with LMCache-Ascend's format
        and hidden sizes."""
        args = [self.kv, self.ptrs, slot_mapping, self.kv.device, self.pbs, to_lmcache, self.use_mla]
        if self.format is not None:
            args += [self.format, self.k_dims, self.v_dims, 0]
        return args

    def call(self, slot_mapping, to_lmcache, **kw):
        multi_layer_kv_transfer(*self.args(slot_mapping, to_lmcache), **kw)

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


@needs_cpu_kernel
def test_index_lists_on_int32_and_kvcacheformat_members():
    """int32 slots and the format as an enum member (LMCache-Ascend passes ``.value``)."""
    e = Engine("separate", False, 16, seed=3)
    sm = slots(e.n_blocks, 16, seed=3)
    e.model(sm, False)
    args = e.args(sm.to(torch.int32), False)
    args[7] = KVCacheFormat.SEPARATE_KV
    multi_layer_kv_transfer(*args)
    e.mem.check()


class Direction:
    """Newer LMCache's TransferDirection, by member name."""

    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("name", ["D2H", "H2D"])
def test_transfer_direction_members(name):
    e = Engine("contiguous", name == "D2H", 1, seed=4)
    sm = slots(e.n_blocks, 1, seed=4)
    e.model(sm, name == "D2H")
    e.call(sm, Direction(name))
    e.mem.check()


def _set(i, v):
    def mutate(args):
        args[i] = v(args) if callable(v) else v
    return mutate


def _slot(i, v):
    def mutate(args):
        args[2] = args[2].clone()
        args[2][i] = v
    return mutate


BAD = [
    # (form, mutation of the positional arguments, the argument the error names)
    ("cuda", _slot(5, 128), "slot_mapping"),                       # page_buffer_size is 128
    ("contiguous", _slot(-1, 1000), "slot_mapping"),
    ("cuda", _set(1, lambda a: a[1][:-1]), "key_value_ptrs.shape"),
    ("separate", _set(1, lambda a: a[1][:L]), "key_value_ptrs.shape"),
    ("cuda", _set(6, True), "key_value.shape"),                    # [2, ...] is no MLA object
    ("mla", _set(6, False), "key_value.shape"),
    ("cuda", _set(2, lambda a: a[2][:-1]), "slot_mapping"),
    ("cuda", _set(2, lambda a: a[2].float()), "slot_mapping.dtype"),
    ("cuda", _set(3, torch.device("meta")), "paged_memory_device"),
    ("cuda", _set(5, 1), "direction"),
    ("cuda", _set(6, 1), "use_mla"),
    ("cuda", _set(4, 0), "page_buffer_size"),
    ("mla_kv", _set(8, 5), "k_hidden_dims"),
    ("mla_kv", _set(6, False), "use_mla"),
    ("separate", _set(7, 4), "kvcache_format_raw"),
    ("separate", _set(7, 5), "kvcache_format_raw"),                # DSA_C8_KV
    ("contiguous", _set(1, lambda a: [a[1][0], a[1][1][:2]]), r"key_value_ptrs\[1\]\.shape"),
    ("contiguous", _set(1, lambda a: a[1][:1]), "key_value_ptrs"),
    ("contiguous", _set(4, 256), r"key_value_ptrs\[0\]"),         # more slots than the tensors hold
    ("contiguous", _set(1, lambda a: [a[1][0].transpose(1, 2), a[1][1]]), r"key_value_ptrs\[0\]"),
]


@pytest.mark.parametrize("to_lmcache", [True, False], ids=["paged_to_lmcache", "lmcache_to_paged"])
@pytest.mark.parametrize("form,mutate,arg", BAD)
def test_bad_input_names_the_argument_and_moves_nothing(form, mutate, arg, to_lmcache):
    e = Engine(form, to_lmcache, 16, seed=5)
    args = e.args(slots(e.n_blocks, 16, seed=5), to_lmcache)
    mutate(args)
    with pytest.raises(KvtierError, match=rf"^{arg}(?!\w)") as info:
        multi_layer_kv_transfer(*args)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, ValueError)
    e.mem.check()                                   # no byte moved


# ---------------------------------------------------------------- maps kept across calls
@needs_cpu_kernel
@pytest.mark.parametrize("how", ["torch", "numpy", "inference copy_"])
def test_a_table_rewritten_in_place_is_read_as_it_is_then(monkeypatch, how):
    """No table is read on the host, none is kept: after the engine re-points its layers
    in place (by any means), the next call moves K and V to and from where they point now."""
    e = Engine("cuda", True, 16, seed=6)
    if how == "inference copy_":
        with torch.inference_mode():
            e.ptrs = e.ptrs.clone()
    owner = type("EngineOwner", (), {})()       # the engine's object that holds its buffers
    registry.register(owner, [e.kv, e.ptrs, e.layers])
    sm = slots(e.n_blocks, 16, seed=6)
    e.model(sm, True)
    e.call(sm, True)
    e.mem.check()
    built = []
    real = adapter_maps.EngineCall.__init__
    monkeypatch.setattr(adapter_maps.EngineCall, "__init__", lambda *a, **k: built.append(1) or real(*a, **k))
    alt = [e.mem.buffer(f"alt{l}", tuple(e.layers[l].shape), torch.float16, "random") for l in range(L)]
    table = torch.tensor([t.data_ptr() for t in alt], dtype=torch.int64)
    if how == "numpy":
        e.ptrs.numpy()[:] = table.numpy()
    elif how == "torch":
        e.ptrs.copy_(table)
    else:
        with torch.inference_mode():
            e.ptrs.copy_(table)
    e.layers = alt
    e.model(sm, True)
    e.call(sm, True)
    e.mem.check()
    assert built == [], "a registered table rewritten in place: the kept call runs"


def test_memory_object_maps_are_built_once_for_registered_buffers(monkeypatch):
    built = []
    real = lmcache._lmcache_maps
    monkeypatch.setattr(lmcache, "_lmcache_maps", lambda *a: built.append(1) or real(*a))
    e = Engine("contiguous", True, 16, seed=7)
    sm = slots(e.n_blocks, 16, seed=7)
    e.call(sm, True)
    e.call(sm, True)
    assert len(built) == 2, "buffers no registration holds: built for each call, kept nowhere"
    owner = type("EngineOwner", (), {})()
    registry.register(owner, [e.kv, e.ptrs, e.layers])
    e.call(sm, True)
    e.call(sm, True)
    assert len(built) == 3


@needs_cpu_kernel
def test_an_inference_mode_table():
    """Inference tensors keep no version count; the table still moves the right bytes."""
    e = Engine("cuda", True, 16, seed=9)
    with torch.inference_mode():
        e.ptrs = e.ptrs.clone()
    sm = slots(e.n_blocks, 16, seed=9)
    e.model(sm, True)
    e.call(sm, True)
    e.mem.check()


# ---------------------------------------------------------------- round trip by torch indexing
def round_trip(dev: str, use_mla: bool, host: bool, nb: int, bs: int, layers: int, tokens: int,
               heads: int) -> None:
    """vLLM-shaped layers, an int64 pointer table and the slot mapping on ``dev``, the memory
    object pinned (a GPU) or on ``dev``: store, then retrieve into fresh poisoned layers;
    expected bytes by plain torch indexing."""
    hidden = 576 if use_mla else heads * 128
    shape = (nb, bs, hidden) if use_mla else (2, nb, bs, heads, 128)
    paged = [Guarded(shape, torch.bfloat16, device=dev) for _ in range(layers)]
    planes, pbs = (1 if use_mla else 2), nb * bs
    kv_shape = (planes, layers, tokens, hidden)
    kv = Guarded(kv_shape, torch.bfloat16, pin=True, fill="poison") if host else \
        Guarded(kv_shape, torch.bfloat16, device=dev, fill="poison")
    sm = slots(nb, bs, tokens, seed=8, skip_prefix=17).to(dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)

    def table_of(gs):
        return torch.tensor([g.t.data_ptr() for g in gs], dtype=torch.int64, device=dev)

    def rows(t):
        return t.cpu().reshape(planes, pbs, hidden)

    multi_layer_kv_transfer(kv.t, table_of(paged), sm, torch.device(dev), pbs, True, use_mla)
    sync()
    s = sm.cpu()
    keep = s >= 0
    want = torch.empty(kv_shape, dtype=torch.bfloat16)
    want.view(torch.uint8).fill_(POISON)
    for l, g in enumerate(paged):
        want[:, l, keep] = rows(g.t)[:, s[keep]]
    assert_bytes_equal(kv.t.cpu(), want, "key_value after the store")
    back = [Guarded(shape, torch.bfloat16, device=dev, fill="poison") for _ in range(layers)]
    multi_layer_kv_transfer(kv.t, table_of(back), sm, torch.device(dev), pbs, False, use_mla)
    sync()
    for g, b in zip(paged, back):
        exp = torch.empty(planes, pbs, hidden, dtype=torch.bfloat16)
        exp.view(torch.uint8).fill_(POISON)
        exp[:, s[keep]] = rows(g.t)[:, s[keep]]
        assert_bytes_equal(rows(b.t), exp, "paged layer after the retrieve")
    for g in paged + back + [kv]:
        g.check()


@needs_cpu_kernel
@pytest.mark.parametrize("use_mla", [False, True])
def test_round_trip_against_torch_indexing(use_mla):
    round_trip("cpu", use_mla, False, nb=8, bs=4, layers=2, tokens=24, heads=1)


@pytest.mark.cuda
@pytest.mark.parametrize("host", [True, False], ids=["pinned_key_value", "device_key_value"])
@pytest.mark.parametrize("use_mla", [False, True])
def test_cuda_round_trip_against_torch_indexing(use_mla, host):
    round_trip("cuda", use_mla, host, nb=32, bs=16, layers=4, tokens=200, heads=8)
