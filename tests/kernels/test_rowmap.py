"""RowMap: the descriptor's fields, its address formula and its checks.

The central check reads memory by the address formula alone (base/table, page, token,
chunk strides; no kernel, no reference) and compares it with a plain torch
permute/reshape of the original tensors, for every form a map can be built from.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from copy_rows_support import FORMS, Side
from helpers import Guarded, assert_bytes_equal
from kvtier.kernels import KvtierError, RowMap
from kvtier.kernels.reference import layer_rows


def _owner_bytes(addr: int, owners) -> tuple:
    """(uint8 view of the whole storage holding ``addr``, offset of addr in it)."""
    for t in owners:
        st = t.untyped_storage()
        if st.data_ptr() <= addr < st.data_ptr() + st.nbytes():
            flat = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
            return flat, addr - st.data_ptr()
    raise AssertionError(f"address {addr:#x} is in none of the map's tensors")


def formula_rows(m: RowMap) -> torch.Tensor:
    """uint8 (C, L, N, row_bytes): every row read at the address the formula gives."""
    owners = [t for t, _ in m.segments]
    out = torch.empty(m.num_components, m.num_layers, m.num_rows, m.row_bytes, dtype=torch.uint8)
    for c in range(m.num_components):
        for l in range(m.num_layers):
            if m.is_table:
                base = int(m.table[c * m.num_layers + l])
            else:
                base = m.base + c * m.comp_stride + l * m.layer_stride
            for i in range(m.num_rows):
                for k in range(m.n_chunks):
                    a = (base + (i // m.page_size) * m.page_stride + (i % m.page_size) * m.token_stride
                         + k * m.chunk_stride)
                    flat, off = _owner_bytes(a, owners)
                    out[c, l, i, k * m.chunk_bytes:(k + 1) * m.chunk_bytes] = flat[off:off + m.chunk_bytes]
    return out


# ----------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("C", [1, 2])
@pytest.mark.parametrize("form", FORMS)
def test_formula_addresses_the_tensor_rows(form, C):
    s = Side(form, C=C, L=3, N=8, P=4, row=(2, 4), dtype=torch.float16, seed=1)
    want = s.logical()
    assert_bytes_equal(formula_rows(s.map), want, f"{form} by the formula")
    for c in range(C):
        for l in range(3):     # the reference's view of a layer is the same bytes
            assert_bytes_equal(layer_rows(s.map, c, l).reshape(8, -1), want[c, l], f"layer_rows {c},{l}")


FIELDS = {  # L=3, N=8, P=4, rows of 2 x 4 fp16 = 16 B (page_head: 2 chunks of 8 B)
    "table":             dict(token_stride=16, page_stride=64, layer_stride=0, n_chunks=1, align=16),
    "table_paged":       dict(token_stride=16, page_stride=64, layer_stride=0, n_chunks=1, align=16),
    "stacked":           dict(token_stride=16, page_stride=64, layer_stride=128, n_chunks=1, align=16),
    "stacked_paged":     dict(token_stride=16, page_stride=64, layer_stride=128, n_chunks=1, align=16),
    "layer_first":       dict(token_stride=16, page_stride=64, layer_stride=128, n_chunks=1, align=16),
    "page_first":        dict(token_stride=48, page_stride=192, layer_stride=16, n_chunks=1, align=16),
    "page_first_direct": dict(token_stride=16, page_stride=192, layer_stride=64, n_chunks=1, align=16),
    "page_head":         dict(token_stride=24, page_stride=192, layer_stride=8, n_chunks=2,
                              chunk_bytes=8, chunk_stride=96, align=8),
}


@pytest.mark.parametrize("form", FORMS)
def test_fields(form):
    m = Side(form, L=3, N=8, P=4, row=(2, 4), dtype=torch.float16).map
    common = dict(num_components=1, num_layers=3, num_rows=8, page_size=4, num_pages=2, row_bytes=16,
                  is_table=form.startswith("table"), device=torch.device("cpu"))
    for name, want in {**common, **FIELDS[form]}.items():
        assert getattr(m, name) == want, (name, getattr(m, name), want)
    if m.is_table:
        assert m.table.dtype == torch.int64 and m.table.shape == (3,) and m.base == 0
        assert m.table.tolist() == [t.data_ptr() for t, _ in m.segments]
    assert m.n_chunks * m.chunk_bytes == m.row_bytes


def test_describe():
    m = Side("page_head", C=2, L=3, N=8, P=4, row=(2, 4)).map
    text = m.describe()
    for part in ("stacked", "C=2", "L=3", "rows=8", "P=4", "row=16B", "2x8B", "align=8", "cpu"):
        assert part in text, (part, text)
    assert "table" in repr(Side("table", L=1, N=4).map)


@pytest.mark.parametrize("dtype,row,offset,align", [
    (torch.float16, (1, 3), 0, 2),          # 6-byte rows
    (torch.float32, (1, 1), 0, 4),
    (torch.float8_e4m3fn, (1, 656), 0, 16),
    (torch.uint8, (1, 16), 4, 4),           # base 4 bytes into the buffer
    (torch.uint8, (1, 16), 1, 1),
])
def test_align_divides_every_address_and_stride(dtype, row, offset, align):
    item = torch.empty(0, dtype=dtype).element_size()
    R = row[0] * row[1] * item
    g = Guarded((offset + 2 * 4 * R,), torch.uint8)
    m = RowMap.from_strides(g.t, num_layers=2, num_rows=4, page_size=1, row_bytes=R, token_stride=R,
                            page_stride=R, layer_stride=4 * R, offset=offset)
    assert m.align == align
    for v in (m.base, m.row_bytes, m.token_stride, m.page_stride, m.layer_stride):
        assert v % m.align == 0


# ----------------------------------------------------------------------------- derived maps
PAGE_CONTIGUOUS = {"table": True, "table_paged": True, "stacked": True, "stacked_paged": True,
                   "layer_first": True, "page_first": False, "page_first_direct": True,
                   "page_head": False}


@pytest.mark.parametrize("form", FORMS)
def test_as_pages(form):
    s = Side(form, C=2, L=2, N=8, P=4, row=(2, 4), seed=2)
    m = s.map
    assert m.page_contiguous == PAGE_CONTIGUOUS[form]
    if not m.page_contiguous:
        with pytest.raises(KvtierError, match="does not store a page contiguously"):
            m.as_pages()
        return
    p = m.as_pages()
    assert (p.num_rows, p.page_size, p.row_bytes, p.n_chunks) == (2, 1, 64, 1)
    # Page j is rows j*P .. j*P+P-1 back to back.
    assert_bytes_equal(formula_rows(p), s.logical().reshape(2, 2, 2, 64), "pages")


def test_page_contiguous_at_page_size_one():
    """Every layout stores a one-slot page contiguously, except split (chunked) rows."""
    assert Side("page_first", L=2, N=4, P=1).map.page_contiguous
    assert not Side("page_head", L=2, N=4, P=1, row=(2, 4)).map.page_contiguous


@pytest.mark.parametrize("form", ["table", "stacked_paged", "page_first", "page_head"])
def test_select_layers(form):
    s = Side(form, C=2, L=4, N=8, P=4, row=(2, 4), seed=3)
    sub = s.map.select_layers(1, 2)
    assert sub.num_layers == 2 and sub.num_components == 2
    assert_bytes_equal(formula_rows(sub), s.logical()[:, 1:3], "layers 1..2")
    assert_bytes_equal(formula_rows(s.map.select_layers(3, 1)), s.logical()[:, 3:], "layer 3")


@pytest.mark.parametrize("start,count", [(-1, 1), (0, 5), (3, 2), (1, -1)])
def test_select_layers_out_of_range(start, count):
    m = Side("table", L=4, N=4).map
    with pytest.raises(KvtierError, match=rf"layers=\({start}, {count}\): outside the map's 4 layers"):
        m.select_layers(start, count)


# ----------------------------------------------------------------------------- stack
def test_stack_components_of_one_tensor():
    kv = Guarded((2, 3, 8, 2, 4), torch.float16)
    maps = [RowMap.from_stacked(kv.t[c]) for c in range(2)]
    m = RowMap.stack(maps)
    assert m.num_components == 2 and m.comp_stride == 3 * 8 * 16 and m.base == maps[0].base
    assert_bytes_equal(formula_rows(m), kv.t.view(torch.uint8).reshape(2, 3, 8, 16), "K and V")
    assert RowMap.stack(maps[::-1]) is None             # V before K: no positive step
    assert RowMap.stack([maps[0]]) is maps[0]


def test_stack_tables():
    k = [Guarded((8, 2, 4), torch.float16).t for _ in range(3)]
    v = [Guarded((8, 2, 4), torch.float16).t for _ in range(3)]
    m = RowMap.stack([RowMap.from_layers(k), RowMap.from_layers(v)])
    assert m.num_components == 2 and m.is_table
    assert m.table.tolist() == [t.data_ptr() for t in k + v]
    want = torch.stack([torch.stack([t.view(torch.uint8).reshape(8, 16) for t in side]) for side in (k, v)])
    assert_bytes_equal(formula_rows(m), want, "tables")


def test_stack_takes_the_lower_alignment():
    k = Guarded((8, 2, 4), torch.float16).t
    v = Guarded((8 * 16 + 4,), torch.uint8).t[4:].view(torch.float16).view(8, 2, 4)   # 4-byte aligned
    mk, mv = RowMap.from_layers([k]), RowMap.from_layers([v])
    assert (mk.align, mv.align) == (16, 4)
    assert RowMap.stack([mk, mv]).align == 4


@pytest.mark.parametrize("why", ["separate-allocations", "row-size", "layers", "table-and-stacked",
                                 "page-size", "uneven-steps"])
def test_stack_refuses_what_cannot_share_a_launch(why):
    a = Guarded((3, 8, 16), torch.uint8).t
    one = RowMap.from_stacked(a)
    if why == "separate-allocations":
        other = RowMap.from_stacked(Guarded((3, 8, 16), torch.uint8).t)
    elif why == "row-size":
        other = RowMap.from_stacked(Guarded((3, 8, 8), torch.uint8).t)
    elif why == "layers":
        other = RowMap.from_stacked(Guarded((2, 8, 16), torch.uint8).t)
    elif why == "table-and-stacked":
        other = RowMap.from_layers(list(Guarded((3, 8, 16), torch.uint8).t))
    elif why == "page-size":
        other = RowMap.from_stacked(Guarded((3, 8, 16), torch.uint8).t, page_size=4)
    else:
        big = Guarded((4, 3, 8, 16), torch.uint8).t
        one, other = RowMap.from_stacked(big[0]), RowMap.from_stacked(big[1])
        assert RowMap.stack([one, other, RowMap.from_stacked(big[3])]) is None
        return
    assert RowMap.stack([one, other]) is None


# ----------------------------------------------------------------------------- lifetime
def test_map_keeps_its_tensors_alive():
    layers = [torch.randn(8, 4) for _ in range(2)]
    refs = [weakref.ref(t) for t in layers]
    want = torch.stack(layers).view(torch.uint8).reshape(1, 2, 8, 16).clone()
    m = RowMap.from_layers(layers)
    del layers
    gc.collect()
    assert all(r() is not None for r in refs)
    assert_bytes_equal(formula_rows(m), want, "rows after the caller dropped its tensors")
    stacked = RowMap.from_stacked(torch.randn(2, 8, 4))
    gc.collect()
    assert stacked.segments[0][0].shape == (2, 8, 4)


# ----------------------------------------------------------------------------- constructor checks
def _bad(fn, match):
    with pytest.raises(KvtierError, match=match):
        fn()


def test_constructor_errors_name_argument_and_value():
    t = torch.zeros(2, 8, 2, 4, dtype=torch.float16)
    _bad(lambda: RowMap.from_stacked(t.transpose(2, 3)), r"t=\(2, 8, 4, 2\): the row dims .* must be contiguous")
    _bad(lambda: RowMap.from_stacked(torch.zeros(8)), r"t=\(8,\): needs at least 3 dims")
    _bad(lambda: RowMap.from_stacked(torch.zeros(2, 0, 4)), r"t=\(2, 0, 4\): is empty")
    _bad(lambda: RowMap.from_stacked([1, 2]), r"t='list': must be a torch.Tensor")
    _bad(lambda: RowMap.from_stacked(t, page_size=3), r"num_rows=8: must be a multiple of page_size=3")
    _bad(lambda: RowMap.from_stacked(t.view(2, 2, 4, 2, 4), page_size=2, paged_dims=True),
         r"t=\(2, 2, 4, 2, 4\): dim 2 must be page_size=2")
    _bad(lambda: RowMap.from_layers([]), r"layers='list': must be a non-empty list")
    _bad(lambda: RowMap.from_layers(t), r"layers='Tensor'")
    _bad(lambda: RowMap.from_layers([t[0], t[1].float()]), r"layers\[1\]=.*torch.float32.*differs from layers\[0\]")
    _bad(lambda: RowMap.from_layers([t[0], t[1, :4]]), r"layers\[1\]=\(\(4, 2, 4\)")
    _bad(lambda: RowMap.from_host_layout(t, "head_first", 1), r"layout='head_first': must be one of")
    _bad(lambda: RowMap.from_host_layout(t[0], "page_first_direct", 2), r"t=\(8, 2, 4\): needs at least 4 dims")
    ph = torch.zeros(2, 2, 4, 3, 8, dtype=torch.float16)      # (pages, H, P, L, D)
    _bad(lambda: RowMap.from_host_layout(ph, "page_head", 8), r"t=\(2, 2, 4, 3, 8\): dim 2 must be page_size=8")
    _bad(lambda: RowMap.from_host_layout(ph.transpose(3, 4), "page_head", 4), r"contiguous D")
    g = torch.zeros(256, dtype=torch.uint8)
    geo = dict(num_layers=1, num_rows=4, page_size=1, row_bytes=16, token_stride=16, page_stride=16,
               layer_stride=64)
    _bad(lambda: RowMap.from_strides(g, **{**geo, "page_stride": -16}), r"page_stride=-16: negative strides")
    _bad(lambda: RowMap.from_strides(g, **{**geo, "n_chunks": 3}), r"n_chunks=3: must be >= 1 and divide row_bytes=16")
    _bad(lambda: RowMap.from_strides(g, **{**geo, "n_chunks": 2, "chunk_stride": 4}),
         r"chunk_stride=4: chunks of 8 B overlap")
    _bad(lambda: RowMap.from_strides(g, **{**geo, "num_rows": 0}), r"num_rows=0: must be positive")
    _bad(lambda: RowMap.from_strides("buf", **geo), r"buffer='str'")


def test_map_of_a_view_stays_inside_the_view():
    """A map over a slice of a tensor covers that slice; the formula reads it exactly."""
    t = Guarded((3, 16, 2, 4), torch.float16).t
    view = t[:, 4:12]
    m = RowMap.from_stacked(view, page_size=4)
    assert m.num_rows == 8 and m.base == view.data_ptr()
    assert_bytes_equal(formula_rows(m)[0], view.contiguous().view(torch.uint8).reshape(3, 8, 16), "slice")


def test_derived_state_is_explicit_and_never_shared_by_replace():
    """What a map caches lives in its `derived` record, typed, pure functions of the map,
    and a map made from it with dataclasses.replace starts with its own empty one."""
    import dataclasses
    t = torch.arange(2 * 8 * 4, dtype=torch.int32).view(2, 8, 4)
    m = RowMap.from_stacked(t, page_size=4)
    assert m.pages_as_rows() is m.pages_as_rows()
    other = dataclasses.replace(m, num_layers=1)
    assert other.derived is not m.derived and other.derived.pages is None
    assert {f.name for f in dataclasses.fields(m.derived)} == {"tables", "pages", "reachable", "views"}