"""Bad input to copy_rows (and its reference): a KvtierError that names the argument and
the bad value, raised before any byte moves.

Each case starts from a valid copy (random source, poisoned destination, guarded
buffers), breaks one argument, and checks the exception text, that no byte of either
buffer (or their margins) changed, and that no kernel was launched.
"""
from __future__ import annotations

import importlib
import re

import pytest
import torch

from copy_rows_support import Side, run_and_check
from helpers import Guarded
from kvtier.kernels import KvtierError, RowMap, copy_rows_reference

copy_rows_module = importlib.import_module("kvtier.kernels.launcher")
from kvtier.kernels import copy_rows  # noqa: E402
real_kernel = copy_rows_module._kernel

L, N, P = 2, 16, 4
i64 = lambda *v: torch.tensor(v, dtype=torch.int64)


@pytest.fixture
def sides():
    src = Side("table", L=L, N=N, P=P, row=(2, 4), seed=1)
    dst = Side("page_first_direct", L=L, N=N, P=P, row=(2, 4), fill="poison", seed=2)
    return src, dst


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """A failed check must stop the copy before the kernel or the fallback runs."""
    def boom(*a, **k):
        raise AssertionError("a kernel ran although the arguments were bad")
    monkeypatch.setattr(copy_rows_module, "_kernel", boom)      # every launch asks for the kernel
    monkeypatch.setattr(copy_rows_module, "reference_copy", boom)


VALUE_REASONS = ("index out of range", "negative index", "not a whole page")


def expect_error(fn, src, dst, si, di, match, src_map=None, dst_map=None, monkeypatch=None, **kw):
    """``fn`` raises KvtierError whose message contains ``match``; nothing changed. A bad
    value is found by the copy launch's own check (given ``monkeypatch``, the kernel may
    run for it: it must move nothing); a bad shape before any launch."""
    if monkeypatch is not None and fn is copy_rows and any(r in match for r in VALUE_REASONS):
        monkeypatch.setattr(copy_rows_module, "_kernel", real_kernel)
    before = src.raw() + dst.raw()
    with pytest.raises(KvtierError, match=re.escape(match)):
        fn(src.map if src_map is None else src_map, si, dst.map if dst_map is None else dst_map, di, **kw)
    after = src.raw() + dst.raw()
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "bytes moved before the error"
    src.check_margins()
    dst.check_margins()


FNS = pytest.mark.parametrize("fn", [copy_rows, copy_rows_reference], ids=["kernel", "reference"])

GOOD = i64(0, 1, 2, 3)

# (id, src_indices, dst_indices, message fragment that names argument and value)
INDEX_CASES = [
    ("list", [0, 1, 2, 3], GOOD, "src_indices='list'"),
    ("numpy", GOOD.numpy(), GOOD, "src_indices='ndarray'"),
    ("float", GOOD.float(), GOOD, "src_indices.dtype=torch.float32"),
    ("int16", GOOD, GOOD.to(torch.int16), "dst_indices.dtype=torch.int16"),
    ("bool", GOOD, GOOD.bool(), "dst_indices.dtype=torch.bool"),
    ("meta-device", GOOD.to("meta"), GOOD, "src_indices.device='meta'"),
    ("dst-meta-device", GOOD, GOOD.to("meta"), "dst_indices.device='meta'"),
    ("2-D", GOOD.view(2, 2), GOOD, "src_indices.shape=(2, 2)"),
    ("0-D", GOOD, torch.tensor(3), "dst_indices.shape=()"),
    ("counts", GOOD, i64(0, 1, 2), "dst_indices='3 indices': src_indices has 4"),
    ("src-out-of-range", i64(0, 1, N, 3), GOOD, f"src_indices={N}: index out of range for {N} rows"),
    ("dst-out-of-range", GOOD, i64(0, 100, 2, 3), "dst_indices=100: index out of range"),
    ("src-negative", i64(0, -1, 2, 3), GOOD, "src_indices=-1: negative index"),
    ("dst-negative", GOOD, i64(-7, 1, 2, 3).int(), "dst_indices=-7: negative index"),
]


@FNS
@pytest.mark.parametrize("case", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_bad_indices(sides, fn, case, monkeypatch):
    _, si, di, match = case
    expect_error(fn, *sides, si, di, match, monkeypatch=monkeypatch)


SHAPE_ONLY = [c for c in INDEX_CASES if "range" not in c[0] and "negative" not in c[0]]


@pytest.mark.parametrize("case", SHAPE_ONLY, ids=[c[0] for c in SHAPE_ONLY])
def test_check_false_keeps_shape_checks(sides, case):
    """check=False skips only the value checks (range, alignment)."""
    _, si, di, match = case
    expect_error(copy_rows, *sides, si, di, match, check=False)


LAYER_CASES = [  # (id, kwargs, message fragment); both maps have L=2 layers
    ("src-past-end", dict(src_layer=2, num_layers=1), "src_layer=2: layers 2..2 are outside the map's 2 layers"),
    ("dst-past-end", dict(dst_layer=1, num_layers=2), "dst_layer=1: layers 1..2 are outside"),
    ("too-many", dict(num_layers=3), "src_layer=0: layers 0..2 are outside the map's 2 layers"),
    ("src-negative", dict(src_layer=-1, num_layers=1), "src_layer=-1"),
    ("dst-negative-default-count", dict(dst_layer=-1), "dst_layer=-1"),
    ("src-beyond-default-count", dict(src_layer=5), "src_layer=5: start layer 5 is outside"),
    ("dst-beyond-default-count", dict(dst_layer=3), "dst_layer=3: start layer 3 is outside"),
    ("negative-count", dict(num_layers=-1), "num_layers=-1: must be a non-negative int"),
    ("float-count", dict(num_layers=1.0), "num_layers=1.0"),
    ("float-start", dict(src_layer=1.0, num_layers=1), "src_layer=1.0"),
    # the default count from a start layer past the last would copy nothing, silently
    ("src-at-end-default-count", dict(src_layer=2), "src_layer=2: start layer 2 is outside the map's 2 layers"),
    ("dst-at-end-default-count", dict(dst_layer=2), "dst_layer=2: start layer 2 is outside"),
    ("bool-start", dict(src_layer=True, num_layers=1), "src_layer=True"),
    ("bool-count", dict(num_layers=True), "num_layers=True: must be a non-negative int"),
]


@FNS
@pytest.mark.parametrize("case", LAYER_CASES, ids=[c[0] for c in LAYER_CASES])
def test_bad_layer_range(sides, fn, case):
    _, kw, match = case
    expect_error(fn, *sides, GOOD, GOOD, match, **kw)


def test_layer_range_of_selected_map(sides):
    """A stage's slice (select_layers) bounds the layer range like any map."""
    src, dst = sides
    expect_error(copy_rows, src, dst, GOOD, GOOD, "src_layer=1: layers 1..1 are outside the map's 1 layers",
                 src_map=src.map.select_layers(1, 1), src_layer=1, num_layers=1)


@FNS
def test_row_sizes_differ(sides, fn):
    src, _ = sides
    dst = Side("page_first_direct", L=L, N=N, P=P, row=(1, 4), fill="poison", seed=3)
    expect_error(fn, src, dst, GOOD, GOOD, "dst.row_bytes=8: differs from src.row_bytes=16")


@FNS
def test_component_counts_differ(sides, fn):
    src, _ = sides
    dst = Side("page_first_direct", C=2, L=L, N=N, P=P, row=(2, 4), fill="poison", seed=3)
    expect_error(fn, src, dst, GOOD, GOOD, "dst.num_components=2: differs from src.num_components=1")


@FNS
@pytest.mark.parametrize("what", ["src", "dst"])
def test_not_a_rowmap(sides, fn, what):
    src, dst = sides
    kw = {f"{what}_map": torch.zeros(4)}
    expect_error(fn, src, dst, GOOD, GOOD, f"{what}='Tensor': must be a kvtier RowMap", **kw)


# (id, src_indices, dst_indices, fragment of the host check, of the device check); page
# size 4. The reference checks on the host and names the page; the kernel path checks the
# indices where they live (a check kernel) and names the first bad index.
PAGE_CASES = [
    ("src-not-at-boundary", i64(1, 2, 3, 4), GOOD, "src_indices=[1, 2, 3, 4]: page 0 is not 4 consecutive slots",
     "src_indices=1: not a whole page: runs of 4 consecutive slots from a page boundary (at position 0"),
    ("dst-gap", GOOD, i64(4, 5, 6, 8), "dst_indices=[4, 5, 6, 8]: page 0 is not 4 consecutive slots",
     "dst_indices=8: not a whole page: runs of 4 consecutive slots from a page boundary (at position 3"),
    ("dst-not-consecutive", i64(0, 1, 2, 3, 4, 5, 6, 7), i64(8, 9, 10, 11, 0, 1, 3, 2),
     "dst_indices=[0, 1, 3, 2]: page 1 is not 4 consecutive slots", "dst_indices=3: not a whole page"),
    ("partial-page", i64(0, 1, 2), i64(4, 5, 6), "len(src_indices)=3: page-granular copy needs a multiple of page_size=4",
     "len(src_indices)=3: page-granular copy needs a multiple of page_size=4"),
]


@FNS
@pytest.mark.parametrize("case", PAGE_CASES, ids=[c[0] for c in PAGE_CASES])
def test_by_page_misaligned(sides, fn, case, monkeypatch):
    _, si, di, on_host, on_device = case
    expect_error(fn, *sides, si, di, on_host if fn is copy_rows_reference else on_device, by_page=True,
                 monkeypatch=monkeypatch)


@FNS
def test_by_page_page_sizes_differ(sides, fn):
    src, _ = sides
    dst = Side("stacked", L=L, N=N, P=2, row=(2, 4), fill="poison", seed=3)
    expect_error(fn, src, dst, GOOD, GOOD, "by_page=True: page sizes differ (src 4, dst 2)", by_page=True)


def test_differently_split_rows_are_refused_before_any_byte_moves(monkeypatch):
    """Two page_head maps with different head splits (2 x 16 B vs 4 x 8 B) cannot share one
    chunk stride: the kernel path refuses the pair, naming both splits, before launching.
    The reference copies it (checked against the torch oracle)."""
    monkeypatch.setattr(copy_rows_module, "_kernel", real_kernel)
    src = Side("page_head", L=L, N=N, P=P, row=(2, 8), seed=4)
    dst = Side("page_head", L=L, N=N, P=P, row=(4, 4), fill="poison", seed=5)
    expect_error(copy_rows, src, dst, GOOD, GOOD, "as 2x16B")
    expect_error(copy_rows, src, dst, GOOD, GOOD, "chunked in 8-byte pieces")
    run_and_check(src, GOOD, dst, GOOD, fn=copy_rows_reference)


# ----------------------------------------------------------------------------- maps that overrun
OVERRUN_CASES = [  # from_strides over a 2 x 8 x 16-byte buffer, one field too large
    ("layer_stride", dict(layer_stride=8 * 16 + 16)),
    ("page_stride", dict(page_stride=32, page_size=1)),
    ("token_stride", dict(page_size=8, page_stride=128, token_stride=17)),
    ("num_rows", dict(num_rows=9)),
    ("num_layers", dict(num_layers=3)),
    ("offset", dict(offset=16)),
    ("row_bytes", dict(row_bytes=32)),
]


@pytest.mark.parametrize("case", OVERRUN_CASES, ids=[c[0] for c in OVERRUN_CASES])
def test_map_whose_strides_overrun_its_tensor(case):
    """The descriptor refuses strides that reach past the tensor's storage; the exact
    fit (the unmodified geometry) is accepted, so the check is not over-eager."""
    g = Guarded((2, 8, 16), torch.uint8)
    geometry = dict(num_layers=2, num_rows=8, page_size=1, row_bytes=16, token_stride=16,
                    page_stride=16, layer_stride=128)
    RowMap.from_strides(g.t, **geometry)                    # exact fit: fine
    before = g.snapshot()
    with pytest.raises(KvtierError, match=r"strides=\(\d+, \d+, \d+\): the map reaches byte \d+ of a 256-byte tensor"):
        RowMap.from_strides(g.t, **{**geometry, **case[1]})
    assert torch.equal(g.snapshot(), before)
    g.check()


def test_overrun_of_a_view_inside_a_larger_storage_is_caught():
    """A view's map may not reach past the view's storage either: a layer stride that
    leaves the underlying allocation is refused even when the view starts inside it."""
    g = Guarded((4, 8, 16), torch.uint8)
    view = g.t[2:]                                          # last two layers of the storage
    with pytest.raises(KvtierError, match=r"strides=\(256, 16, 16\)"):
        RowMap.from_strides(view, num_layers=2, num_rows=8, page_size=1, row_bytes=16,
                            token_stride=16, page_stride=16, layer_stride=256)


def test_per_layer_tensor_too_small_for_the_table_map():
    layers = [torch.zeros(8, 16, dtype=torch.uint8), torch.zeros(8, 16, dtype=torch.uint8)[:6]]
    with pytest.raises(KvtierError, match=re.escape("layers[1]=((6, 16), torch.uint8, 'cpu'): differs from layers[0]")):
        RowMap.from_layers(layers)


@pytest.mark.parametrize("config", [{"num_programs": 4}, "fast", 4])
def test_config_must_be_a_copy_config(sides, config):
    src, dst = sides
    expect_error(copy_rows, src, dst, GOOD, GOOD, f"config='{type(config).__name__}': must be a kvtier CopyConfig",
                 config=config)
