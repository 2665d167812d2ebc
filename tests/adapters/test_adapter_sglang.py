"""kvtier.adapters.sglang against a byte-level model of SGLang's kvcacheio calls.

Each test builds an SGLang-style device pool (one tensor per layer, target then draft
layers, separate allocations) and host pool (K and V in one allocation, in the layout the
call names), runs the kvtier adapter, applies the documented semantics to the model
(test_adapter_model) and compares every byte of every buffer.
"""
from __future__ import annotations

import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier import adapters
from test_adapter_model import (Memory, head_copy, kernel_copy, lf, needs_cpu_kernel, pf, ph,
                               row_addr, slice_bytes, table)

INDEX_DTYPES = [torch.int32, torch.int64]


class World:
    """Device and host pools of one test. ``load``: host random, device poisoned, else
    the reverse. ``mla``: one component of 656-byte fp8 rows (as uint8), else K and V."""

    HOST_SHAPES = {
        "lf": lambda L, N, P, row: (L, N, *row),
        "pf": lambda L, N, P, row: (N, L, *row),
        "ph": lambda L, N, P, row: (N // P, row[0], P, L, row[1]),
        "pfd": lambda L, N, P, row: (N // P, L, P, *row),
    }

    def __init__(self, layout="lf", *, load=True, mla=False, layers=3, draft=0, dev_rows=16,
                 host_rows=24, page=4, seed=0):
        self.mem = Memory(seed)
        self.layout, self.page, self.target, self.layers = layout, page, layers, layers + draft
        self.dtype = torch.uint8 if mla else torch.float16
        self.row = (1, 656) if mla else (2, 4)
        self.comps = ["kv"] if mla else ["k", "v"]
        self.item = self.row[0] * self.row[1] * self.dtype.itemsize
        dev_fill, host_fill = ("poison", "random") if load else ("random", "poison")
        # Target and draft layers: separate allocations, as SGLang's device pools have.
        self.dev = {c: [self.mem.buffer(f"dev_{c}{l}", (dev_rows, *self.row), self.dtype, dev_fill)
                        for l in range(self.layers)] for c in self.comps}
        shape = self.HOST_SHAPES[layout](self.layers, host_rows, page, self.row)
        both = self.mem.buffer("host", (len(self.comps), *shape), self.dtype, host_fill)
        self.host = {c: both[i] for i, c in enumerate(self.comps)}
        self.layout_dim = self.item * self.layers
        self.dev_rows, self.host_rows = dev_rows, host_rows

    def pick(self, n, count, dtype, seed=1):
        g = torch.Generator().manual_seed(seed)
        return torch.randperm(n, generator=g)[:count].to(dtype)

    def pages(self, n, count, dtype, seed=1):
        p = self.page
        first = torch.randperm(n // p, generator=torch.Generator().manual_seed(seed))[:count]
        return (first[:, None] * p + torch.arange(p)).flatten().to(dtype)

    def tables(self, c):
        return table(self.dev[c])

    def host_layer_views(self, c):
        return [self.host[c][l] for l in range(self.layers)]

    def packed_tables(self, c):
        """Device pointer tables of target and draft layers, built apart and concatenated,
        as SGLang packs them."""
        return torch.cat([table(self.dev[c][:self.target]), table(self.dev[c][self.target:])])

    def host_row(self, c, l, row):
        """Address of a row of one layer of a layer_first or page_first host."""
        if self.layout == "lf":
            return lf(_a(self.host[c][l]), row, self.item)
        return pf(_a(self.host[c]), l, row, self.item, self.layout_dim)

    def model_load_layer(self, si, di, host_layer, dev_layer):
        """The model of a one-layer load: rows si of a host layer to rows di of a device layer."""
        kernel_copy(self.mem, [(lambda l, s, c=c: self.host_row(c, l, s),
                                lambda l, d, c=c: lf(_a(self.dev[c][dev_layer]), d, self.item)) for c in self.comps],
                    si, di, [host_layer], self.item)

    def model_backup_all_layers(self, si, di):
        """The model of an all-layer backup: rows si of every device layer to rows di of the host."""
        kernel_copy(self.mem, [(lambda l, s, c=c: lf(_a(self.dev[c][l]), s, self.item),
                                lambda l, d, c=c: self.host_row(c, l, d)) for c in self.comps],
                    si, di, range(self.layers), self.item)


def _a(t):
    return t.data_ptr()


# ------------------------------------------------------------------ per layer, lf / pf -> lf
# SGLang's one-layer load of each host layout (K and V, or MLA's one component):
# a layer_first host passes that layer's tensor, a page_first one its tensor and layer_id.
PER_LAYER_LOADS = {
    ("lf", False): lambda w, si, di, hl, dl: adapters.transfer_kv_per_layer(
        w.host["k"][hl], w.dev["k"][dl], w.host["v"][hl], w.dev["v"][dl], si, di, w.item),
    ("lf", True): lambda w, si, di, hl, dl: adapters.transfer_kv_per_layer_mla(
        w.host["kv"][hl], w.dev["kv"][dl], si, di, w.item),
    ("pf", False): lambda w, si, di, hl, dl: adapters.transfer_kv_per_layer_pf_lf(
        w.host["k"], w.dev["k"][dl], w.host["v"], w.dev["v"][dl], si, di, hl, w.item, w.layout_dim),
    ("pf", True): lambda w, si, di, hl, dl: adapters.transfer_kv_per_layer_mla_pf_lf(
        w.host["kv"], w.dev["kv"][dl], si, di, hl, w.item, w.layout_dim),
}


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("host_layout,dl,rows,seed", [pytest.param("lf", 1, 7, 2, id="lf_lf"),
                                                      pytest.param("pf", 0, 6, 3, id="pf_lf")])
def test_per_layer_load(host_layout, dl, rows, seed, dtype, mla):
    """Rows of host layer 2 -> device layer dl, through the call for the host layout."""
    w = World(host_layout, mla=mla)
    hl = 2
    si, di = w.pick(w.host_rows, rows, dtype), w.pick(w.dev_rows, rows, dtype, seed=seed)
    PER_LAYER_LOADS[host_layout, mla](w, si, di, hl, dl)
    w.model_load_layer(si, di, hl, dl)
    w.mem.assert_changes(*(f"dev_{c}{dl}" for c in w.comps))
    w.mem.check()


def test_per_layer_skips_pairs_with_a_negative_index():
    w = World("lf")
    si = torch.tensor([3, -1, 5, 7, 0], dtype=torch.int32)
    di = torch.tensor([1, 2, -4, 9, 11], dtype=torch.int32)
    src, dst = w.host["k"][0], w.dev["k"][0]
    adapters.transfer_kv_per_layer(src, dst, w.host["v"][0], w.dev["v"][0], si, di, w.item)
    kernel_copy(w.mem, [(lambda l, s, t=t: lf(_a(t[0]), s, w.item), lambda l, d, t=t: lf(_a(t[1]), d, w.item))
                        for t in ((src, dst), (w.host["v"][0], w.dev["v"][0]))], si, di, [0], w.item)
    w.mem.check()


# ------------------------------------------------------------------ per layer, ph -> lf
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_per_layer_ph_lf(dtype):
    w = World("ph")
    layer_id, heads = 1, w.row[0]
    si, di = w.pick(w.host_rows, 9, dtype), w.pick(w.dev_rows, 9, dtype, seed=4)
    dst = {c: w.dev[c][2] for c in w.comps}
    adapters.transfer_kv_per_layer_ph_lf(w.host["k"], dst["k"], w.host["v"], dst["v"], si, di,
                                       layer_id, w.item, w.layout_dim, w.page, heads)
    head_copy(w.mem, [(lambda l, s, h, c=c: ph(_a(w.host[c]), l, s, w.item, w.layout_dim, h, heads, w.page),
                       lambda l, d, h, c=c: lf(_a(dst[c]), d, w.item) + w.item // heads * h)
                      for c in w.comps], si, di, [layer_id], w.item, heads)
    w.mem.assert_changes("dev_k2", "dev_v2")
    w.mem.check()


# ------------------------------------------------------------------ all layers from pointer tables
# SGLang's all-layer backup from packed device tables (K and V, or MLA) to each host
# layout: a layer_first host given as per-layer tables, a page_first one as its tensor.
ALL_LAYER_BACKUPS = {
    ("lf", False): lambda w, src, si, di: adapters.transfer_kv_all_layer(
        src["k"], table(w.host_layer_views("k")), src["v"], table(w.host_layer_views("v")), si, di, w.item,
        w.layers),
    ("lf", True): lambda w, src, si, di: adapters.transfer_kv_all_layer_mla(
        src["kv"], table(w.host_layer_views("kv")), si, di, w.item, w.layers),
    ("pf", False): lambda w, src, si, di: adapters.transfer_kv_all_layer_lf_pf(
        src["k"], w.host["k"], src["v"], w.host["v"], si, di, w.item, w.layout_dim, w.layers),
    ("pf", True): lambda w, src, si, di: adapters.transfer_kv_all_layer_mla_lf_pf(
        src["kv"], w.host["kv"], si, di, w.item, w.layout_dim, w.layers),
}


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mla", [False, True])
@pytest.mark.parametrize("host_layout,rows,seed", [pytest.param("lf", 5, 5, id="tables"),
                                                   pytest.param("pf", 6, 6, id="lf_pf")])
def test_all_layer_from_packed_draft_tables(host_layout, rows, seed, dtype, mla):
    """Packed target + draft device tables -> host."""
    w = World(host_layout, load=False, mla=mla, layers=2, draft=1)
    si, di = w.pick(w.dev_rows, rows, dtype), w.pick(w.host_rows, rows, dtype, seed=seed)
    ALL_LAYER_BACKUPS[host_layout, mla](w, {c: w.packed_tables(c) for c in w.comps}, si, di)
    w.model_backup_all_layers(si, di)
    w.mem.assert_changes("host")
    w.mem.check()


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_all_layer_lf_ph(dtype):
    w = World("ph", load=False)
    heads = w.row[0]
    si, di = w.pick(w.dev_rows, 6, dtype), w.pick(w.host_rows, 6, dtype, seed=7)
    adapters.transfer_kv_all_layer_lf_ph(w.tables("k"), w.host["k"], w.tables("v"), w.host["v"], si, di,
                                       w.item, w.layout_dim, w.layers, w.page, heads)
    head_copy(w.mem, [(lambda l, s, h, c=c: lf(_a(w.dev[c][l]), s, w.item) + w.item // heads * h,
                       lambda l, d, h, c=c: ph(_a(w.host[c]), l, d, w.item, w.layout_dim, h, heads, w.page))
                      for c in w.comps], si, di, range(w.layers), w.item, heads)
    w.mem.assert_changes("host")
    w.mem.check()


def test_all_layer_accepts_lists_of_layer_tensors():
    """kvtier extension: per-layer tensors instead of tables (then rows are range-checked)."""
    w = World("pf", load=False)
    si, di = w.pick(w.dev_rows, 4, torch.int64), w.pick(w.host_rows, 4, torch.int64, seed=8)
    adapters.transfer_kv_all_layer_lf_pf(w.dev["k"], w.host["k"], w.dev["v"], w.host["v"], si, di,
                                       w.item, w.layout_dim, w.layers)
    w.model_backup_all_layers(si, di)
    w.mem.check()
    with pytest.raises(KvtierError, match="src_indices"):
        adapters.transfer_kv_all_layer_lf_pf(w.dev["k"], w.host["k"], w.dev["v"], w.host["v"],
                                           torch.tensor([w.dev_rows]), torch.tensor([0]),
                                           w.item, w.layout_dim, w.layers)
    w.mem.check()


# ------------------------------------------------------------------ direct variants
@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("host_layout", ["lf", "pf"])
def test_direct_lists(dtype, host_layout):
    """transfer_kv_direct, backup: device K layers + V layers -> host per-layer views
    (page_first views are strided: each row still moves whole)."""
    w = World(host_layout, load=False, layers=2, draft=1)
    si, di = w.pick(w.dev_rows, 8, dtype), w.pick(w.host_rows, 8, dtype, seed=9)
    views = {c: [w.host[c][l] if host_layout == "lf" else w.host[c][:, l] for l in range(w.layers)]
             for c in w.comps}
    src = w.dev["k"] + w.dev["v"]
    dst = views["k"] + views["v"]
    adapters.transfer_kv_direct(src, dst, si, di, w.page)
    for s_t, d_t in zip(src, dst):
        for s, d in zip(si.tolist(), di.tolist()):
            w.mem.copy(row_addr(d_t, d), row_addr(s_t, s), slice_bytes(s_t))
    w.mem.assert_changes("host")
    w.mem.check()


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mla", [False, True])
def test_per_layer_direct_pf_lf(dtype, mla):
    w = World("pfd", mla=mla)
    layer_id, dl, p = 1, 2, w.page
    si, di = w.pages(w.host_rows, 3, dtype), w.pages(w.dev_rows, 3, dtype, seed=10)
    dst = [w.dev[c][dl] for c in w.comps]
    adapters.transfer_kv_per_layer_direct_pf_lf([w.host[c] for c in w.comps], dst, si, di, layer_id, p)
    for i in range(0, si.numel(), p):
        s_page, d0 = int(si[i]) // p, int(di[i])
        for c, d_t in zip(w.comps, dst):
            w.mem.copy(row_addr(d_t, d0), w.host[c][s_page, layer_id].data_ptr(), p * slice_bytes(d_t))
    w.mem.assert_changes(*(f"dev_{c}{dl}" for c in w.comps))
    w.mem.check()


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
@pytest.mark.parametrize("mla", [False, True])
def test_all_layer_direct_lf_pf_with_draft_layers(dtype, mla):
    w = World("pfd", load=False, mla=mla, layers=2, draft=1)
    p = w.page
    si, di = w.pages(w.dev_rows, 2, dtype), w.pages(w.host_rows, 2, dtype, seed=11)
    src = [t for c in w.comps for t in w.dev[c]]
    adapters.transfer_kv_all_layer_direct_lf_pf(src, [w.host[c] for c in w.comps], si, di, p)
    for i in range(0, si.numel(), p):
        s0, d_page = int(si[i]), int(di[i]) // p
        for c in w.comps:
            for l, s_t in enumerate(w.dev[c]):
                w.mem.copy(w.host[c][d_page, l].data_ptr(), row_addr(s_t, s0), p * slice_bytes(s_t))
    w.mem.assert_changes("host")
    w.mem.check()


# ------------------------------------------------------------------ empty index lists
def _calls(w: World, si, di):
    """One call of every function, in the world's pools (layouts permitting)."""
    k, v, item, L = w.host["k"], w.host["v"], w.item, w.layers
    return {
        "per_layer": lambda: adapters.transfer_kv_per_layer(k[0], w.dev["k"][0], v[0], w.dev["v"][0], si, di, item),
        "all_layer": lambda: adapters.transfer_kv_all_layer(w.tables("k"), table(w.host_layer_views("k")),
                                                          w.tables("v"), table(w.host_layer_views("v")),
                                                          si, di, item, L),
        "direct": lambda: adapters.transfer_kv_direct(w.dev["k"], w.host_layer_views("k"), si, di, w.page),
        "mla": lambda: adapters.transfer_kv_per_layer_mla(k[1], w.dev["k"][1], si, di, item),
    }


@pytest.mark.parametrize("dtype", INDEX_DTYPES)
def test_empty_index_lists_move_nothing(dtype):
    w = World("lf")
    empty = torch.empty(0, dtype=dtype)
    for name, call in _calls(w, empty, empty).items():
        call()
    w.mem.check()


def test_empty_index_lists_in_every_layout():
    empty = torch.empty(0, dtype=torch.int64)
    w = World("pf")
    adapters.transfer_kv_per_layer_pf_lf(w.host["k"], w.dev["k"][0], w.host["v"], w.dev["v"][0],
                                       empty, empty, 0, w.item, w.layout_dim)
    adapters.transfer_kv_all_layer_lf_pf(w.tables("k"), w.host["k"], w.tables("v"), w.host["v"],
                                       empty, empty, w.item, w.layout_dim, w.layers)
    w.mem.check()
    w = World("ph")
    adapters.transfer_kv_per_layer_ph_lf(w.host["k"], w.dev["k"][0], w.host["v"], w.dev["v"][0],
                                       empty, empty, 0, w.item, w.layout_dim, w.page, w.row[0])
    w.mem.check()
    w = World("pfd")
    adapters.transfer_kv_per_layer_direct_pf_lf([w.host["k"], w.host["v"]], [w.dev["k"][0], w.dev["v"][0]],
                                              empty, empty, 0, w.page)
    adapters.transfer_kv_all_layer_direct_lf_pf(w.dev["k"] + w.dev["v"], [w.host["k"], w.host["v"]],
                                              empty, empty, w.page)
    w.mem.check()


# ------------------------------------------------------------------ bad inputs
def _bad_cases():
    """(name, layout, call(w, si, di), message fragment naming the argument)."""
    def per_layer(**kw):
        def call(w, si, di):
            a = dict(src_k=w.host["k"][0], dst_k=w.dev["k"][0], src_v=w.host["v"][0],
                     dst_v=w.dev["v"][0], src_indices=si, dst_indices=di, item_size=w.item)
            a.update({k: (v(w) if callable(v) else v) for k, v in kw.items()})
            adapters.transfer_kv_per_layer(**a)
        return call

    def all_layer(**kw):
        def call(w, si, di):
            a = dict(src_k_layers=w.tables("k"), dst_k=w.host["k"], src_v_layers=w.tables("v"),
                     dst_v=w.host["v"], src_indices=si, dst_indices=di, item_size=w.item,
                     dst_layout_dim=w.layout_dim, num_layers=w.layers)
            a.update({k: (v(w) if callable(v) else v) for k, v in kw.items()})
            adapters.transfer_kv_all_layer_lf_pf(**a)
        return call

    return [
        ("length mismatch", "lf", per_layer(dst_indices=torch.tensor([1, 2])), "dst_indices"),
        ("float indices", "lf", per_layer(src_indices=torch.tensor([1.0, 2.0, 3.0])), "src_indices.dtype"),
        ("2-D indices", "lf", per_layer(src_indices=torch.zeros(3, 1, dtype=torch.int64)), "src_indices.shape"),
        ("index out of range", "lf", per_layer(dst_indices=torch.tensor([0, 1, 16])), "dst_indices"),
        ("item_size in elements", "lf", per_layer(item_size=lambda w: w.item // 2), "item_size"),
        ("item_size zero", "lf", per_layer(item_size=0), "item_size"),
        ("non-contiguous layer", "lf", per_layer(dst_k=lambda w: w.dev["k"][0][::2]), "dst_k"),
        ("sparse layer", "lf", per_layer(src_v=lambda w: torch.zeros(16, 4).to_sparse()), "src_v.layout"),
        ("meta layer", "lf", per_layer(dst_v=lambda w: torch.empty_like(w.dev["v"][0], device="meta")),
         "dst_v.device"),
        ("sparse pf host", "pf", lambda w, si, di: adapters.transfer_kv_per_layer_pf_lf(
            w.host["k"].to_sparse(), w.dev["k"][0], w.host["v"], w.dev["v"][0], si, di, 0, w.item,
            w.layout_dim), "src_k.layout"),
        ("layer_id out of range", "pf", lambda w, si, di: adapters.transfer_kv_per_layer_pf_lf(
            w.host["k"], w.dev["k"][0], w.host["v"], w.dev["v"][0], si, di, w.layers, w.item,
            w.layout_dim), "layer_id"),
        ("layout_dim not whole rows", "pf", lambda w, si, di: adapters.transfer_kv_per_layer_pf_lf(
            w.host["k"], w.dev["k"][0], w.host["v"], w.dev["v"][0], si, di, 0, w.item,
            w.layout_dim + 8), "layout_dim"),
        ("head_num not dividing", "ph", lambda w, si, di: adapters.transfer_kv_per_layer_ph_lf(
            w.host["k"], w.dev["k"][0], w.host["v"], w.dev["v"][0], si, di, 0, w.item,
            w.layout_dim, w.page, 3), "head_num"),
        ("ph negative index", "ph", lambda w, si, di: adapters.transfer_kv_per_layer_ph_lf(
            w.host["k"], w.dev["k"][0], w.host["v"], w.dev["v"][0], torch.tensor([0, -1, 2]), di,
            0, w.item, w.layout_dim, w.page, w.row[0]), "src_indices"),
        ("num_layers vs table", "pf", all_layer(num_layers=lambda w: w.layers - 1), "src_k_layers.size(0)"),
        ("float table", "pf", all_layer(src_v_layers=lambda w: w.tables("v").double()), "src_v_layers"),
        ("null address", "pf", all_layer(src_k_layers=lambda w: torch.zeros(w.layers, dtype=torch.uint64)),
         "src_k_layers"),
        ("pf host index out of range", "pf", all_layer(dst_indices=torch.tensor([0, 1, 24])), "dst_indices"),
        ("direct lists differ", "lf", lambda w, si, di: adapters.transfer_kv_direct(
            w.dev["k"], w.host_layer_views("k")[:2], si, di, 1), "len(dst_layers)"),
        ("direct partial page", "lf", lambda w, si, di: adapters.transfer_kv_direct(
            w.dev["k"], w.host_layer_views("k"), si, di, 2), "page_size"),
        ("direct pf unaligned page", "pfd", lambda w, si, di: adapters.transfer_kv_per_layer_direct_pf_lf(
            [w.host["k"], w.host["v"]], [w.dev["k"][0], w.dev["v"][0]], torch.arange(1, 5), torch.arange(4),
            0, w.page), "src_indices"),
        ("direct pf three buffers", "pfd", lambda w, si, di: adapters.transfer_kv_per_layer_direct_pf_lf(
            [w.host["k"]] * 3, [w.dev["k"][0]] * 3, si, di, 0, 1), "src_ptrs"),
        ("direct lf_pf odd list", "pfd", lambda w, si, di: adapters.transfer_kv_all_layer_direct_lf_pf(
            w.dev["k"] + w.dev["v"][:2], [w.host["k"], w.host["v"]], torch.arange(4), torch.arange(4),
            w.page), "src_ptrs"),
    ]


@pytest.mark.parametrize("name,layout,call,arg", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_raises_and_moves_nothing(name, layout, call, arg):
    w = World(layout, load=layout in ("lf", "ph"))
    si, di = torch.tensor([4, 0, 9]), torch.tensor([1, 5, 2])
    with pytest.raises(KvtierError) as e:
        call(w, si, di)
    assert arg in str(e.value), str(e.value)
    w.mem.check()
