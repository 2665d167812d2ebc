"""copy_rows under Triton's interpreter, bit for bit against plain torch.

Every buffer is a real tensor in one of the forms kvtier reads (per-layer tensors through
an address table, stacked multi-layer tensors, the four host layouts), carved out of a
`Guarded` allocation with sentinel margins. Sources hold random bytes, destinations the
poison pattern. The oracle is a torch expression over the ORIGINAL tensors (permute and
reshape each form to a logical ``(C, L, N, row_bytes)`` byte view), so it shares no code
with the kernel or the reference; after every copy the whole destination must equal the
oracle (rows that should change did, all other bytes did not), the source must be
unchanged and every margin intact.

The `Side` factory, the oracle and the index patterns live in copy_rows_support.py,
shared with the property-based, bad-input, min-piece, host-map and RowMap tests.
"""
from __future__ import annotations

import importlib
import itertools
import subprocess
import sys
import warnings

import pytest
import torch

import kvtier.warn_once
from copy_rows_support import HOST_FORMS, PATTERNS, Side, make_indices, run_and_check
from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse fixture: the kernel runs)
from helpers import POISON, Guarded, assert_bytes_equal
from kvtier.kernels import CopyConfig, KvtierError, RowMap, copy_rows_reference, default_config

copy_rows_module = importlib.import_module("kvtier.kernels.launcher")
from kvtier.kernels import copy_rows  # noqa: E402
REAL_REFERENCE = copy_rows_module.reference_copy

# ----------------------------------------------------------------------------- fixtures
@pytest.fixture
def launches(monkeypatch):
    """Records (src row_bytes, src page_size, num_components) of every kernel launch."""
    seen = []
    real = copy_rows_module.CopyLaunch.__call__

    def spy(bound, *args, **kw):
        src = bound.layouts[0]          # the source layout as launched
        seen.append((src.row_bytes, src.page_size, src.num_components))
        return real(bound, *args, **kw)
    monkeypatch.setattr(copy_rows_module.CopyLaunch, "__call__", spy)
    return seen


def test_public_import_is_the_function():
    """`from kvtier.kernels import copy_rows` gives the function, in a fresh interpreter
    and on a second import (a lazy package attribute must not be shadowed by the module)."""
    code = ("from kvtier.kernels import copy_rows as a\n"
            "from kvtier.kernels import copy_rows as b\n"
            "import kvtier.kernels as k\n"
            "assert callable(a) and callable(b) and callable(k.copy_rows), (a, b, k.copy_rows)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------------------------------- addressing modes
@pytest.mark.parametrize("paged", [False, True], ids=["P1", "P16-paged-dims"])
@pytest.mark.parametrize("src_mode,dst_mode", list(itertools.product(("table", "stacked"), repeat=2)))
def test_addressing_mode_pairs(src_mode, dst_mode, paged):
    P, suffix = (16, "_paged") if paged else (1, "")
    idx_dtype = torch.int32 if src_mode == dst_mode else torch.int64
    src = Side(src_mode + suffix, L=2, N=48, P=P, row=(2, 8), dtype=torch.bfloat16, seed=1)
    dst = Side(dst_mode + suffix, L=2, N=32, P=P, row=(2, 8), dtype=torch.bfloat16, fill="poison", seed=2)
    si, di = make_indices("perm", 48, 32, dtype=idx_dtype, seed=3)
    run_and_check(src, si, dst, di)


# ----------------------------------------------------------------------------- host layouts
@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", HOST_FORMS)
@pytest.mark.parametrize("direction", ["backup", "load"])
def test_host_layouts(layout, P, direction):
    """Backup (device -> host) and load (host -> device) for every host layout; the
    device side alternates between a per-layer table and a paged stacked buffer."""
    device_form = "table" if (HOST_FORMS.index(layout) + P) % 2 else "stacked_paged"
    N = 2 * P if P > 1 else 12
    dev = Side(device_form, L=3, N=N, P=P, row=(2, 4), dtype=torch.float16,
               fill="random" if direction == "backup" else "poison", seed=4)
    host = Side(layout, L=3, N=N, P=P, row=(2, 4), dtype=torch.float16,
                fill="poison" if direction == "backup" else "random", seed=5)
    si, di = make_indices("perm", N, N, seed=P)
    src, dst = (dev, host) if direction == "backup" else (host, dev)
    run_and_check(src, si, dst, di)


# ----------------------------------------------------------------------------- dtypes and rows
ROW_SPECS = [  # (id, dtype, (H, D))
    ("fp16-6B", torch.float16, (1, 3)),
    ("fp16-32B", torch.float16, (2, 8)),
    ("bf16-1152B", torch.bfloat16, (1, 576)),
    ("bf16-128B", torch.bfloat16, (4, 16)),
    ("fp32-4B", torch.float32, (1, 1)),
    ("fp32-40B", torch.float32, (2, 5)),
    ("e4m3-656B", torch.float8_e4m3fn, (1, 656)),
    ("e4m3-576B", torch.float8_e4m3fn, (2, 288)),
    ("e5m2-576B", torch.float8_e5m2, (1, 576)),
    ("u8-4B", torch.uint8, (1, 4)),
    ("u8-656B", torch.uint8, (2, 328)),
]
PAIRS = [("table", "page_head"), ("page_first", "stacked_paged"), ("stacked", "page_first_direct"),
         ("layer_first", "table_paged"), ("page_head", "table"), ("table_paged", "layer_first")]


@pytest.mark.parametrize("k,second", [(k, s) for k in range(len(ROW_SPECS)) for s in (0, 1)],
                         ids=[f"{r[0]}-{s}" for r in ROW_SPECS for s in "ab"])
def test_dtypes_and_row_sizes(k, second):
    """Each dtype/row size through two form pairs (rotating, so every pair sees several
    sizes). Random fp8 bytes include NaN patterns: the bytes must still match."""
    _, dtype, row = ROW_SPECS[k]
    src_form, dst_form = PAIRS[(2 * k + second) % len(PAIRS)]
    src = Side(src_form, L=2, N=8, P=4, row=row, dtype=dtype, seed=6)
    dst = Side(dst_form, L=2, N=12, P=4, row=row, dtype=dtype, fill="poison", seed=7)
    si, di = make_indices("perm", 8, 12, seed=8 + k)
    run_and_check(src, si, dst, di)


# ----------------------------------------------------------------------------- index patterns
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("pattern", PATTERNS)
def test_index_patterns(pattern, idx_dtype):
    backup = idx_dtype == torch.int64
    src = Side("table" if backup else "page_head", L=2, N=32, P=4, row=(2, 8), seed=9)
    dst = Side("page_first_direct" if backup else "stacked", L=2, N=32, P=4, row=(2, 8),
               fill="poison", seed=10)
    si, di = make_indices(pattern, 32, 32, P=4, dtype=idx_dtype, seed=11)
    run_and_check(src, si, dst, di)


def test_empty_indices_move_nothing():
    src = Side("stacked", L=2, N=8, seed=12)
    dst = Side("table", L=2, N=8, fill="poison", seed=13)
    before = dst.raw()
    e = torch.empty(0, dtype=torch.int32)
    copy_rows(src.map, e, dst.map, e)
    assert all(torch.equal(a, b) for a, b in zip(before, dst.raw()))
    dst.check_margins()


def test_non_contiguous_indices():
    """Strided index views (e.g. every other slot) address the same rows as their copies."""
    src = Side("table", L=2, N=32, seed=14)
    dst = Side("stacked", L=2, N=32, fill="poison", seed=15)
    si = torch.randperm(32, generator=torch.Generator().manual_seed(16))[::2]
    di = torch.arange(32)[1::2]
    assert not si.is_contiguous() and not di.is_contiguous()
    run_and_check(src, si, dst, di)


def test_mixed_index_dtypes():
    src = Side("table", L=2, N=16, seed=46)
    dst = Side("page_first", L=2, N=16, P=2, fill="poison", seed=47)
    si, di = make_indices("repeat_src", 16, 16, seed=48)
    run_and_check(src, si.int(), dst, di.long())


# ----------------------------------------------------------------------------- layers
LAYER_CASES = [  # (src L, dst L, src_layer, dst_layer, num_layers)
    (3, 3, 0, 0, None),
    (4, 3, 1, 0, None),       # source slice: default count is what both sides have
    (3, 5, 0, 2, None),       # draft layers after the target's in the host pool
    (4, 4, 1, 2, 2),
    (5, 2, 3, 1, 1),
    (3, 3, 2, 0, 1),
    (3, 3, 1, 1, 0),          # zero layers: nothing moves
]


@pytest.mark.parametrize("case", LAYER_CASES, ids=[str(c) for c in LAYER_CASES])
def test_layer_subsets_and_offsets(case):
    Ls, Ld, src_layer, dst_layer, nl = case
    k = LAYER_CASES.index(case)
    src_form, dst_form = PAIRS[k % len(PAIRS)]
    src = Side(src_form, L=Ls, N=8, P=2, row=(2, 4), seed=17)
    dst = Side(dst_form, L=Ld, N=8, P=2, row=(2, 4), fill="poison", seed=18)
    si, di = make_indices("perm", 8, 8, seed=19)
    run_and_check(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer, num_layers=nl)


@pytest.mark.parametrize("form", ["table", "page_first"])
def test_select_layers_equals_layer_offset(form):
    """A pipeline stage's map (select_layers) copies what the layer offset copies."""
    src = Side(form, L=4, N=8, seed=20)
    a = Side("stacked", L=2, N=8, fill="poison", seed=21)
    b = Side("stacked", L=2, N=8, fill="poison", seed=21)
    si, di = make_indices("perm", 8, 8, seed=22)
    copy_rows(src.map.select_layers(1, 2), si, a.map, di)
    run_and_check(src, si, b, di, src_layer=1)
    assert_bytes_equal(a.logical(), b.logical(), "select_layers vs src_layer")


# ----------------------------------------------------------------------------- components
COMPONENT_CASES = [  # K and V as one map: (src form, dst form)
    ("stacked", "layer_first"),              # (2, L, ...) device tensor -> (2, L, N, ...) host
    ("table", "page_first_direct"),          # two table maps stacked
    ("page_head", "table_paged"),
    ("stacked_paged", "page_first"),
]


@pytest.mark.parametrize("src_form,dst_form", COMPONENT_CASES)
def test_two_components_one_launch(src_form, dst_form, launches):
    src = Side(src_form, C=2, L=2, N=16, P=4, row=(2, 8), seed=23)
    dst = Side(dst_form, C=2, L=3, N=16, P=4, row=(2, 8), fill="poison", seed=24)
    si, di = make_indices("perm", 16, 16, seed=25)
    run_and_check(src, si, dst, di, dst_layer=1)
    assert len(launches) == 1 and launches[0][2] == 2, launches


# ----------------------------------------------------------------------------- whole pages
BY_PAGE_CASES = [  # (src form, dst form, P, whether both store pages contiguously)
    ("table_paged", "page_first_direct", 16, True),
    ("stacked", "layer_first", 64, True),
    ("table", "stacked_paged", 16, True),
    ("table", "page_head", 16, False),
    ("page_first", "stacked_paged", 16, False),
]


@pytest.mark.parametrize("case", BY_PAGE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-P{c[2]}")
def test_by_page(case, launches):
    """by_page=True moves whole pages as single rows where both sides store pages
    contiguously, and row by row otherwise; the bytes are the same either way."""
    src_form, dst_form, P, whole = case
    row = (2, 4)
    src = Side(src_form, C=2, L=2, N=3 * P, P=P, row=row, seed=26)
    dst = Side(dst_form, C=2, L=2, N=2 * P, P=P, row=row, fill="poison", seed=27)
    si, di = make_indices("runs", 3 * P, 2 * P, P=P, dtype=torch.int32, seed=28)
    run_and_check(src, si, dst, di, by_page=True)
    row_bytes = src.row_bytes * (P if whole else 1)
    assert launches == [(row_bytes, 1 if whole else P, 2)], launches


def test_page_runs_without_by_page(launches):
    """Page-aligned runs without by_page are copied as rows, correctly."""
    src = Side("table", L=2, N=32, P=16, row=(1, 8), seed=29)
    dst = Side("page_first_direct", L=2, N=32, P=16, row=(1, 8), fill="poison", seed=30)
    si, di = make_indices("runs", 32, 32, P=16, seed=31)
    run_and_check(src, si, dst, di)
    assert launches == [(16, 16, 1)]


# ----------------------------------------------------------------------------- configs
CONFIG_CASES = [  # (dtype, row, config): tails come from block_bytes below the row size
    (torch.uint8, (1, 120), CopyConfig(num_programs=1, rows=1, block_bytes=64)),     # 15 words: 8 + 4 + 2 + 1
    (torch.uint8, (1, 120), CopyConfig(num_programs=3, rows=4, block_bytes=16)),     # 2-word blocks + 1
    (torch.float16, (1, 3), CopyConfig(num_programs=2, rows=64, block_bytes=4)),     # 6 B: 2-byte words
    (torch.float8_e4m3fn, (1, 656), CopyConfig(num_programs=5, rows=4, block_bytes=256)),
    (torch.bfloat16, (1, 576), CopyConfig(num_programs=64, rows=1, block_bytes=512)),
    (torch.float32, (2, 5), CopyConfig(num_programs=7, rows=64, block_bytes=16)),   # 5 words: 2 + 2 + 1
    (torch.float16, (2, 8), CopyConfig(num_programs=1, rows=4, block_bytes=4096)),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: f"{c[2].num_programs}p-{c[2].rows}r-{c[2].block_bytes}B")
def test_configs(case):
    """Row tiles 1/4/64 (with a partial last tile), inner blocks narrower than the row
    (power-of-two tail pieces), one and several persistent programs."""
    dtype, row, cfg = case
    src = Side("table", L=3, N=26, row=row, dtype=dtype, seed=32)
    dst = Side("page_first", L=3, N=26, P=2, row=row, dtype=dtype, fill="poison", seed=33)
    si, di = make_indices("perm", 26, 26, seed=34)          # 13 rows: a partial last tile
    plan = copy_rows_module.tile_copy(src.map, dst.map, si.numel(), cfg)
    if cfg.block_bytes < src.row_bytes:
        assert plan["chunk_words"] % plan["block"], "case must exercise the tail pieces"
    run_and_check(src, si, dst, di, config=cfg)


@pytest.mark.parametrize("platform,crosses_link", [("cuda", True), ("cuda", False), ("rocm", False),
                                                   ("npu", True), ("cpu", True)])
def test_shipped_default_configs(platform, crosses_link):
    """Every platform's shipped configuration copies correctly (here, interpreted)."""
    src = Side("stacked_paged", L=2, N=16, P=4, row=(1, 656), dtype=torch.float8_e4m3fn, seed=43)
    dst = Side("page_head", L=2, N=16, P=4, row=(1, 656), dtype=torch.float8_e4m3fn, fill="poison", seed=44)
    si, di = make_indices("perm", 16, 16, seed=45)
    run_and_check(src, si, dst, di, config=default_config(platform, crosses_link=crosses_link))


# ----------------------------------------------------------------------------- alignment
@pytest.mark.parametrize("dtype,row,word", [
    (torch.float8_e4m3fn, (1, 656), 8), (torch.float16, (1, 3), 2), (torch.float32, (1, 1), 4),
    (torch.bfloat16, (1, 576), 8)])
@pytest.mark.parametrize("modes", [("table", "stacked"), ("stacked", "table")])
def test_word_is_widest_the_rows_allow(dtype, row, word, modes):
    src = Side(modes[0], L=1, N=4, row=row, dtype=dtype)
    dst = Side(modes[1], L=1, N=4, row=row, dtype=dtype)
    plan = copy_rows_module.tile_copy(src.map, dst.map, 4, CopyConfig())
    assert plan["word"] == word
    if src.row_bytes % 16 == 0:
        assert plan["word"] * plan["align"] == 16     # strides in 16-byte units


def test_unaligned_base_copies_bytes():
    """A map whose base sits at an odd byte address copies byte words, correctly."""
    L, N, R = 2, 8, 12
    g = Guarded((1 + L * N * R,), torch.uint8)
    m = RowMap.from_strides(g.t, num_layers=L, num_rows=N, page_size=1, row_bytes=R,
                            token_stride=R, page_stride=R, layer_stride=N * R, offset=1)
    assert m.align == 1
    dst = Side("table", L=L, N=N, row=(1, R), dtype=torch.uint8, fill="poison", seed=35)
    si, di = make_indices("perm", N, N, seed=36)
    before = g.snapshot()
    assert copy_rows_module.tile_copy(m, dst.map, si.numel(), CopyConfig())["word"] == 1
    copy_rows(m, si, dst.map, di)
    want = torch.full((1, L, N, R), POISON, dtype=torch.uint8)
    want[0, :, di] = g.t[1:].view(L, N, R)[:, si]
    assert_bytes_equal(dst.logical(), want, "rows from an odd base")
    assert torch.equal(g.snapshot(), before)
    g.check()
    dst.check_margins()


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("src_form,dst_form,pattern", [
    ("table", "page_head", "repeat_src"), ("page_first_direct", "table_paged", "runs"),
    ("stacked_paged", "page_first", "all"), ("page_head", "stacked", "perm")])
def test_kernel_equals_reference(src_form, dst_form, pattern):
    """copy_rows and copy_rows_reference leave identical destinations."""
    src = Side(src_form, C=2, L=3, N=16, P=4, row=(2, 6), dtype=torch.bfloat16, seed=37)
    a = Side(dst_form, C=2, L=3, N=16, P=4, row=(2, 6), dtype=torch.bfloat16, fill="poison", seed=38)
    b = Side(dst_form, C=2, L=3, N=16, P=4, row=(2, 6), dtype=torch.bfloat16, fill="poison", seed=38)
    si, di = make_indices(pattern, 16, 16, P=4, seed=39)
    kw = dict(src_layer=1, dst_layer=0, num_layers=2)
    run_and_check(src, si, a, di, **kw)
    run_and_check(src, si, b, di, fn=copy_rows_reference, **kw)
    assert all(torch.equal(x, y) for x, y in zip(a.raw(), b.raw()))


@pytest.mark.parametrize("by_page", [False, True])
def test_fallback_without_interpreter_warns_once_and_copies(monkeypatch, by_page):
    """Where Triton cannot run CPU tensors, copies run the reference: one warning, same bytes."""
    monkeypatch.setattr(copy_rows_module, "reference_copy", REAL_REFERENCE)
    monkeypatch.setattr(copy_rows_module, "interpreter_active", lambda: False)
    monkeypatch.setattr(kvtier.warn_once, "_warned", set())
    monkeypatch.setattr(copy_rows_module, "_RUNNERS", {})      # decided again without the interpreter

    def no_kernel(*a, **k):
        raise AssertionError("the kernel ran without the interpreter")
    monkeypatch.setattr(copy_rows_module, "_kernel", no_kernel)
    src = Side("table", L=2, N=16, P=4, seed=49)
    dsts = [Side("page_first_direct", L=2, N=16, P=4, fill="poison", seed=50 + k) for k in range(2)]
    si, di = make_indices("runs", 16, 16, P=4, seed=52)
    with pytest.warns(RuntimeWarning, match="interpreter"):
        run_and_check(src, si, dsts[0], di, by_page=by_page)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_and_check(src, si, dsts[1], di, by_page=by_page)


def test_check_false_copies_the_same():
    src = Side("table", L=2, N=16, seed=40)
    dst = Side("page_head", L=2, N=16, P=4, fill="poison", seed=41)
    si, di = make_indices("perm", 16, 16, seed=42)
    run_and_check(src, si, dst, di, check=False)


def test_poison_is_not_random_data():
    """Guard for the suite itself: poisoned destinations really hold the poison byte."""
    dst = Side("page_head", L=1, N=4, P=2, fill="poison")
    assert bool((dst.logical() == POISON).all())


@pytest.mark.parametrize("triton_version,numpy_refuses,ok", [
    ("3.6.0", True, False), ("3.6.0", False, True), ("3.7.0", True, True), ("3.9.1", True, True)])
def test_interpreter_check_names_the_incompatible_pair(monkeypatch, triton_version, numpy_refuses, ok):
    """Triton < 3.7's interpreter with numpy >= 2.4 fails deep inside the kernel; copy_rows
    says so up front, naming both versions."""
    import types
    import numpy as np
    fake_triton = types.SimpleNamespace(__version__=triton_version)
    monkeypatch.setattr(copy_rows_module, "_triton", lambda: fake_triton)
    monkeypatch.setattr(copy_rows_module, "_interpreter_problem", [])
    monkeypatch.setattr(np, "ones", lambda *a, **k: _OneElement(numpy_refuses))
    if ok:
        copy_rows_module.check_interpreter()
    else:
        with pytest.raises(KvtierError, match=r"Triton 3\.6\.0's interpreter .*numpy<2\.4"):
            copy_rows_module.check_interpreter()


class _OneElement:
    """A 1-element array as numpy treats int() of it: refused from numpy 2.4 on."""

    def __init__(self, refuse):
        self.refuse = refuse

    def __int__(self):
        if self.refuse:
            raise TypeError("only 0-dimensional arrays can be converted to Python scalars")
        return 1
