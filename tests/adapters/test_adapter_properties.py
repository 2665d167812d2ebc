"""Property tests (hypothesis) of the engine adapters with random valid and invalid arguments.

For every SGLang ``kvcacheio`` call kvtier provides (per layer lf/pf/ph, all layers from
pointer tables to tables, pf and ph, the MLA forms, the direct forms) and for the Ascend
``transfer_kv_dim_exchange``, each example builds the pools of test_adapter_sglang /
test_adapter_ascend (every buffer between sentinel margins), draws valid indices (with
pairs holding a negative index where the call skips them) and, most of the time, breaks
one argument: index lists of the wrong type, dtype, shape or length, out of range,
negative or not whole pages, and each call's own arguments (item sizes, layout dims,
layer ids and counts, head and page counts, pointer tables, buffers, block quotas,
direction and flags, layer ranges).

- A valid call moves exactly the bytes the byte model of the engine's call
  (test_adapter_model) says, and no other byte of any buffer.
- An invalid call raises `KvtierError` whose message names the argument (and its value
  where the call passes one on), and moves no byte; the valid call on the same buffers
  afterwards still matches the model.

Inputs that once failed (an unchecked ``config=``, meta and sparse indices, errors naming
kvtier's internal arguments) keep a test of their own at the end.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, event, given, settings
from hypothesis import strategies as st

from kvtier import adapters
from kvtier.kernels import KvtierError
from test_adapter_ascend import Pools, model as npu_model
from test_adapter_model import head_copy, lf, needs_cpu_kernel, ph, row_addr, slice_bytes, table
from test_adapter_sglang import World

# No shrinking: under the interpreter it takes minutes; a failing example is printed whole.
PROFILE = settings(phases=[Phase.generate], max_examples=12, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.filter_too_much])
JUNK = [None, True, 2.5, "4"]          # never a count, size or layer number


class Call:
    """One adapter call: the function, its keyword arguments, the buffers (``mem``), the
    model of its valid form, and what a broken form must raise (``expect``: None for a
    valid call, else message fragments one of which the error must contain)."""

    def __init__(self, fn, kw, mem, model, idx_names=("src_indices", "dst_indices")):
        self.kind = None     # the KINDS entry it was drawn for
        self.fn, self.kw, self.mem, self.model = fn, kw, mem, model
        self.good = dict(kw)
        self.idx_names = idx_names
        self.expect, self.what = None, "valid"

    def __repr__(self):
        def short(v):
            if isinstance(v, (list, tuple)):
                return [short(x) for x in v]
            if isinstance(v, torch.Tensor) and not (v.dim() == 1 and v.numel() < 40):
                return f"<{tuple(v.shape)} {v.dtype}>"
            return v
        shown = {k: short(v) for k, v in self.kw.items()}
        return f"Call({self.fn.__name__}, {self.what}, {shown}, expect={self.expect})"

    def run(self, kw=None):
        self.fn(**(self.kw if kw is None else kw))


# ------------------------------------------------------------------ valid indices
def rows(draw, n_src, n_dst, dtype, negatives=False, max_k=6, step=1):
    """Random rows (sources may repeat, destinations distinct), a multiple of ``step`` of
    them; ``negatives``: some pairs hold a negative index (the call skips them)."""
    k = step * draw(st.integers(0, min(max_k, n_dst) // step))
    si = draw(st.lists(st.integers(0, n_src - 1), min_size=k, max_size=k))
    di = draw(st.lists(st.integers(0, n_dst - 1), min_size=k, max_size=k, unique=True))
    if negatives and k:
        for pos in draw(st.lists(st.integers(0, k - 1), max_size=2, unique=True)):
            lst = si if draw(st.booleans()) else di
            lst[pos] = draw(st.sampled_from([-1, -2, -(2**31)]))
    return torch.tensor(si, dtype=dtype), torch.tensor(di, dtype=dtype)


def pages(draw, n_src, n_dst, page, dtype, max_pages=3):
    """Whole pages: runs of ``page`` slots from a page boundary, in random page order."""
    k = draw(st.integers(0, min(max_pages, n_src // page, n_dst // page)))
    sp = draw(st.lists(st.integers(0, n_src // page - 1), min_size=k, max_size=k))
    dp = draw(st.lists(st.integers(0, n_dst // page - 1), min_size=k, max_size=k, unique=True))
    run = torch.arange(page)
    expand = lambda p: (torch.tensor(p, dtype=torch.int64)[:, None] * page + run).flatten().to(dtype)
    return expand(sp), expand(dp)


# ------------------------------------------------------------------ the calls and their models
# Each builder returns a Call with valid arguments, and its own breaks: {argument: [(bad
# value or function of the call, message fragments or None for "the argument name")]}.
def per_layer(draw, mla, layout):
    """lf -> lf (transfer_kv_per_layer[_mla]) and pf -> lf (..._pf_lf)."""
    w = World(layout, mla=mla)
    hl, dl = draw(st.integers(0, w.layers - 1)), draw(st.integers(0, w.layers - 1))
    si, di = rows(draw, w.host_rows, w.dev_rows, draw(st.sampled_from([torch.int32, torch.int64])),
                  negatives=True)
    comp = {c: (w.host[c] if layout == "pf" else w.host[c][hl], w.dev[c][dl]) for c in w.comps}
    if mla:
        kw = dict(src=comp["kv"][0], dst=comp["kv"][1])
    else:
        kw = dict(src_k=comp["k"][0], dst_k=comp["k"][1], src_v=comp["v"][0], dst_v=comp["v"][1])
    kw.update(src_indices=si, dst_indices=di, item_size=w.item)
    if layout == "pf":
        kw.update(layer_id=hl, src_layout_dim=w.layout_dim)
        fn = adapters.transfer_kv_per_layer_mla_pf_lf if mla else adapters.transfer_kv_per_layer_pf_lf
    else:
        fn = adapters.transfer_kv_per_layer_mla if mla else adapters.transfer_kv_per_layer
    call = Call(fn, kw, w.mem, lambda c: w.model_load_layer(c["src_indices"], c["dst_indices"], hl, dl))
    first_dst = "dst" if mla else "dst_k"
    breaks = {"item_size": [(v, None) for v in [0, -w.item] + JUNK] + [(w.item // 2, ["item_size"])],
              "block_quota": [(v, None) for v in (0, -1, True, 1.5)],
              first_dst: [(lambda c: c.kw[first_dst][::2], None), (None, None), (lambda c: [c.kw[first_dst]], None)]}
    if layout == "pf":
        breaks["layer_id"] = [(v, None) for v in [-1, w.layers, w.layers + 7] + JUNK]
        breaks["src_layout_dim"] = [(v, ["layout_dim"]) for v in [0, -w.layout_dim, w.layout_dim + 8,
                                                                    w.layout_dim + w.item] + JUNK]
    return call, breaks, (w.host_rows, w.dev_rows)


def per_layer_ph(draw, mla):
    w = World("ph")
    heads, dl = w.row[0], draw(st.integers(0, w.layers - 1))
    layer_id = draw(st.integers(0, w.layers - 1))
    si, di = rows(draw, w.host_rows, w.dev_rows, draw(st.sampled_from([torch.int32, torch.int64])))
    dst = {c: w.dev[c][dl] for c in w.comps}
    kw = dict(src_k=w.host["k"], dst_k=dst["k"], src_v=w.host["v"], dst_v=dst["v"], src_indices=si,
              dst_indices=di, layer_id=layer_id, item_size=w.item, src_layout_dim=w.layout_dim,
              page_size=w.page, head_num=heads)

    def model(c):
        head_copy(w.mem, [(lambda l, s, h, c=c: ph(w.host[c].data_ptr(), l, s, w.item, w.layout_dim, h, heads, w.page),
                           lambda l, d, h, c=c: lf(dst[c].data_ptr(), d, w.item) + w.item // heads * h)
                          for c in w.comps], c["src_indices"], c["dst_indices"], [layer_id], w.item, heads)

    call = Call(adapters.transfer_kv_per_layer_ph_lf, kw, w.mem, model)
    breaks = {"layer_id": [(v, None) for v in [-1, w.layers] + JUNK],
              "head_num": [(v, None) for v in [0, 3, -2] + JUNK],
              "page_size": [(v, None) for v in [0, -4] + JUNK],
              "item_size": [(v, None) for v in [0, 7] + JUNK],
              "src_layout_dim": [(v, ["layout_dim"]) for v in [0, w.layout_dim + 8] + JUNK],
              "block_quota": [(0, None), (True, None)]}
    return call, breaks, (w.host_rows, w.dev_rows)


def all_layer(draw, mla, layout):
    """Every layer from packed target + draft device tables: to tables (transfer_kv_all_layer
    [_mla]), a pf host (..._lf_pf) or a ph host (..._lf_ph, K and V only)."""
    w = World(layout, load=False, mla=mla, layers=2, draft=1)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    si, di = rows(draw, w.dev_rows, w.host_rows, dtype, negatives=layout != "ph")
    srcs = {c: w.packed_tables(c) for c in w.comps}
    dsts = {c: table(w.host_layer_views(c)) if layout == "lf" else w.host[c] for c in w.comps}
    if mla:
        kw = dict(src_layers=srcs["kv"], **{"dst_layers" if layout == "lf" else "dst": dsts["kv"]})
    else:
        kw = dict(src_k_layers=srcs["k"], src_v_layers=srcs["v"],
                  **{(f"dst_{c}_layers" if layout == "lf" else f"dst_{c}"): dsts[c] for c in w.comps})
    kw.update(src_indices=si, dst_indices=di, item_size=w.item, num_layers=w.layers)
    name = "transfer_kv_all_layer" + ("_mla" if mla else "") + {"lf": "", "pf": "_lf_pf", "ph": "_lf_ph"}[layout]
    if layout != "lf":
        kw["dst_layout_dim"] = w.layout_dim
    heads = w.row[0]
    if layout == "ph":
        kw.update(page_size=w.page, head_num=heads)

        def model(c):
            head_copy(w.mem, [(lambda l, s, h, c=c: lf(w.dev[c][l].data_ptr(), s, w.item) + w.item // heads * h,
                               lambda l, d, h, c=c: ph(w.host[c].data_ptr(), l, d, w.item, w.layout_dim, h, heads,
                                                       w.page))
                              for c in w.comps], c["src_indices"], c["dst_indices"], range(w.layers), w.item, heads)
    else:
        def model(c):
            w.model_backup_all_layers(c["src_indices"], c["dst_indices"])
    call = Call(getattr(adapters, name), kw, w.mem, model)
    first_src = "src_layers" if mla else "src_k_layers"
    last_src = "src_layers" if mla else "src_v_layers"    # the same table for MLA
    breaks = {"num_layers": [(v, None) for v in [0, -1] + JUNK] + [(w.layers - 1, ["num_layers="]),
                                                                     (w.layers + 1, ["num_layers="])],
              "item_size": [(v, None) for v in [0, -8] + JUNK],
              first_src: [(lambda c: c.kw[first_src].double(), None),
                          (lambda c: torch.zeros(w.layers, dtype=torch.uint64), None),
                          (lambda c: torch.full((w.layers,), -64, dtype=torch.int64), None),
                          (lambda c: c.kw[first_src].view(1, -1), None),
                          (lambda c: c.kw[first_src].int(), None),
                          (None, None), ([1, 2, 3], None)],
              "block_quota": [(0, None), (-3, None), (True, None)]}
    breaks.setdefault(last_src, []).append((lambda c: c.kw[last_src][:-1], ["num_layers="]))
    if layout != "lf":
        breaks["dst_layout_dim"] = [(v, ["layout_dim"]) for v in [0, w.layout_dim + 8] + JUNK]
    if layout == "ph":
        breaks["head_num"] = [(v, None) for v in [0, 3] + JUNK]
        breaks["page_size"] = [(v, None) for v in [0, -4] + JUNK]
    # Table sides have no size: indices into them are checked for sign only.
    sized = (None, w.host_rows if layout != "lf" else None)
    return call, breaks, sized


def direct(draw, mla):
    """transfer_kv_direct: device K then V layers (target + draft) -> host per-layer views."""
    w = World("lf", load=False, layers=2, draft=1)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    si, di = rows(draw, w.dev_rows, w.host_rows, dtype, max_k=2 * w.page, step=w.page)
    src = [t for c in w.comps for t in w.dev[c]]
    dst = [v for c in w.comps for v in w.host_layer_views(c)]

    def model(c):
        for s_t, d_t in zip(src, dst):
            for s, d in zip(c["src_indices"].tolist(), c["dst_indices"].tolist()):
                w.mem.copy(row_addr(d_t, d), row_addr(s_t, s), slice_bytes(s_t))

    kw = dict(src_layers=src, dst_layers=dst, src_indices=si, dst_indices=di, page_size=w.page)
    call = Call(adapters.transfer_kv_direct, kw, w.mem, model)
    breaks = {"page_size": [(v, None) for v in [0, -4] + JUNK] + [(w.page * 2 + 1, ["page_size"])],
              "dst_layers": [(lambda c: c.kw["dst_layers"][:-1], ["len(dst_layers)"]), ([], None), (None, None),
                             (lambda c: [v[:, :1] for v in c.kw["dst_layers"]], ["dst_layers"]),
                             (lambda c: [None] + c.kw["dst_layers"][1:], None)],
              "src_layers": [(lambda c: c.kw["src_layers"][0], None), ((), None),
                             (lambda c: [t[:, :, ::2] for t in c.kw["src_layers"]], None)]}
    return call, breaks, (w.dev_rows, w.host_rows)


def direct_pages(draw, mla, load):
    """Whole pages: page_first_direct host -> per-layer device tensors from ``layer_id``
    (transfer_kv_per_layer_direct_pf_lf), or every device layer -> host
    (transfer_kv_all_layer_direct_lf_pf)."""
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    if load:
        w = World("pfd", mla=mla)
        p, dl, layer_id = w.page, draw(st.integers(0, w.layers - 1)), draw(st.integers(0, w.layers - 1))
        si, di = pages(draw, w.host_rows, w.dev_rows, p, dtype)
        dst = [w.dev[c][dl] for c in w.comps]

        def model(c):
            for i in range(0, c["src_indices"].numel(), p):
                s_page, d0 = int(c["src_indices"][i]) // p, int(c["dst_indices"][i])
                for comp, d_t in zip(w.comps, dst):
                    w.mem.copy(row_addr(d_t, d0), w.host[comp][s_page, layer_id].data_ptr(), p * slice_bytes(d_t))

        kw = dict(src_ptrs=[w.host[c] for c in w.comps], dst_ptrs=dst, src_indices=si, dst_indices=di,
                  layer_id=layer_id, page_size=p)
        fn, n = adapters.transfer_kv_per_layer_direct_pf_lf, (w.host_rows, w.dev_rows)
        breaks = {"layer_id": [(v, None) for v in [-1, w.layers, None, 2.5, "0", True]],
                  "src_ptrs": [(lambda c: c.kw["src_ptrs"] * 3, None), ([], None), (None, None),
                               (lambda c: [t[:, :, :2] for t in c.kw["src_ptrs"]], ["src_ptrs[0]"])],
                  "dst_ptrs": [([], None), (None, ["len(dst_ptrs)='NoneType'"])] + ([] if mla else [
                      (lambda c: c.kw["dst_ptrs"] + c.kw["dst_ptrs"][:1], None)])}
    else:
        w = World("pfd", load=False, mla=mla, layers=2, draft=1)
        p = w.page
        si, di = pages(draw, w.dev_rows, w.host_rows, p, dtype)

        def model(c):
            for i in range(0, c["src_indices"].numel(), p):
                s0, d_page = int(c["src_indices"][i]), int(c["dst_indices"][i]) // p
                for comp in w.comps:
                    for layer, s_t in enumerate(w.dev[comp]):
                        w.mem.copy(w.host[comp][d_page, layer].data_ptr(), row_addr(s_t, s0), p * slice_bytes(s_t))

        kw = dict(src_ptrs=[t for c in w.comps for t in w.dev[c]], dst_ptrs=[w.host[c] for c in w.comps],
                  src_indices=si, dst_indices=di, page_size=p)
        fn, n = adapters.transfer_kv_all_layer_direct_lf_pf, (w.dev_rows, w.host_rows)
        breaks = {"src_ptrs": [([], None), (None, ["len(src_ptrs)='NoneType'"])] + ([] if mla else [
                      (lambda c: c.kw["src_ptrs"][:-1], None)]),
                  "dst_ptrs": [(lambda c: c.kw["dst_ptrs"] * 3, None), ((), None),
                               (lambda c: [t[:, :, :2] for t in c.kw["dst_ptrs"]], ["dst_ptrs[0]"]),
                               (lambda c: [t[:, :1] for t in c.kw["dst_ptrs"]], ["dst_ptrs"])]}
    breaks["page_size"] = [(v, None) for v in [0, -4] + JUNK] + [(2 * w.page, ["page_size"])]
    return Call(fn, kw, w.mem, model), breaks, n


def dim_exchange(draw, mla):
    """transfer_kv_dim_exchange, both directions, with or without V and the indexer, over a
    random layer range of each layer space."""
    direction = draw(st.sampled_from([adapters.TransferDirection.H2D, adapters.TransferDirection.D2H, 1, 2]))
    h2d = getattr(direction, "value", direction) == 1
    p = Pools(adapters.TransferDirection.H2D if h2d else adapters.TransferDirection.D2H)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    hi, di = pages(draw, p.host_pages * p.page, p.dev_pages * p.page, p.page, dtype)
    with_v, with_indexer = not mla, draw(st.booleans())
    start = draw(st.integers(0, 3))
    num = draw(st.sampled_from(([-1] if start == 0 else []) + list(range(1, 4 - start + 1))))
    kw = dict(device_indices=di, host_indices=hi, device_k=p.device_k, host_k=p.host_k,
              device_v=p.device_v if with_v else None, host_v=p.host_v if with_v else None,
              layer_start=start, layer_num=num, page_size=p.page, direction=direction)
    if with_indexer:
        kw.update(device_index_k=p.device_index_k, host_index_k=p.host_index_k,
                  device_index_k_scale=p.device_scale, host_index_k_scale=p.host_scale,
                  index_k_layer_start=draw(st.sampled_from([None, 0, 1])))
        kw["index_k_layer_num"] = draw(st.sampled_from([None, -1, 1, 2] if not kw["index_k_layer_start"] else [1]))
    d = adapters.TransferDirection.H2D if h2d else adapters.TransferDirection.D2H

    def model(c):
        layers = range(4) if num < 0 else range(start, start + num)
        comps = [(p.device_k, p.host_k)] + ([(p.device_v, p.host_v)] if with_v else [])
        npu_model(p.mem, d, c["device_indices"], c["host_indices"], p.page, comps, layers)
        if with_indexer:
            s = c["index_k_layer_start"] or 0
            n = c["index_k_layer_num"]
            ilayers = range(s, s + (2 if n is None or n < 0 else n))
            npu_model(p.mem, d, c["device_indices"], c["host_indices"], p.page,
                      [(p.device_index_k, p.host_index_k), (p.device_scale.unsqueeze(-1), p.host_scale)], ilayers)

    call = Call(adapters.transfer_kv_dim_exchange, kw, p.mem, model,
                idx_names=("device_indices", "host_indices"))
    breaks = {"direction": [(v, None) for v in (0, 3, None, "H2D", True)],
              "flags": [(v, None) for v in (0, 1, None, True, 2.5)],
              "page_size": [(v, None) for v in [0, -4, 2, 8] + JUNK],
              "layer_start": [(v, None) for v in [-1, 4, 9] + JUNK],
              "layer_num": [(v, None) for v in [0] + JUNK] + [(5, ["layer_"])],
              "host_k": [(lambda c: c.kw["host_k"][:, :3], None), (lambda c: c.kw["host_k"][0], None),
                         (lambda c: c.kw["host_k"].view(torch.int16), None), (None, None)],
              "device_k": [(lambda c: c.kw["device_k"][0], None), (lambda c: c.kw["device_k"].float(), None)]}
    if with_v:
        breaks["host_v"] = [(None, None), (torch.empty(0), None),
                            (lambda c: c.kw["host_v"].reshape(*c.kw["host_v"].shape[:3], 1, 8), None)]
    else:
        breaks["device_v"] = [(lambda c: p.device_v, ["host_v"])]
    if with_indexer:
        breaks["index_k_layer_start"] = [(v, None) for v in [-1, 2, 5] + JUNK[1:]]
        breaks["host_index_k"] = [(None, None), (lambda c: c.kw["host_index_k"].float(), None)]
    return call, breaks, (p.dev_pages * p.page, p.host_pages * p.page)


# kind -> (builder, has an MLA form)
KINDS = {
    "per_layer": (lambda draw, mla: per_layer(draw, mla, "lf"), True),
    "per_layer_pf_lf": (lambda draw, mla: per_layer(draw, mla, "pf"), True),
    "per_layer_ph_lf": (per_layer_ph, False),
    "all_layer": (lambda draw, mla: all_layer(draw, mla, "lf"), True),
    "all_layer_lf_pf": (lambda draw, mla: all_layer(draw, mla, "pf"), True),
    "all_layer_lf_ph": (lambda draw, mla: all_layer(draw, mla, "ph"), False),
    "direct": (direct, False),
    "per_layer_direct_pf_lf": (lambda draw, mla: direct_pages(draw, mla, True), True),
    "all_layer_direct_lf_pf": (lambda draw, mla: direct_pages(draw, mla, False), True),
    "dim_exchange": (dim_exchange, True),
}
TABLE_KINDS = {"all_layer", "all_layer_lf_pf", "all_layer_lf_ph"}
PAGE_KINDS = {"per_layer_direct_pf_lf", "all_layer_direct_lf_pf", "dim_exchange"}


# ------------------------------------------------------------------ breaking one argument
def break_argument(draw, call, breaks):
    """One of the call's own arguments replaced by a bad value."""
    arg = draw(st.sampled_from(sorted(breaks)))
    value, fragments = draw(st.sampled_from(breaks[arg]))
    value = value(call) if callable(value) else value
    if arg == "block_quota" or arg == "page_size" and isinstance(value, int) and value > 0:
        # With no index, a positive page size divides the count (valid); a call that moves
        # nothing is not asked to check its block_quota here.
        assume(call.kw[call.idx_names[0]].numel() > 0)
    call.kw[arg] = value
    if fragments is None:   # the argument, with its value where it is one to print
        scalar = value is None or isinstance(value, (int, float, str))
        fragments = [f"{arg}={value!r}", f"{arg}={type(value).__name__!r}"] if scalar else [arg]
    call.expect = fragments
    call.what = f"{arg}={value!r}" if not isinstance(value, (torch.Tensor, list, tuple)) else f"{arg}: other"


# The calls that skip a pair holding a negative index (SGLang's row kernels).
SKIPS_NEGATIVES = {"per_layer", "per_layer_pf_lf", "all_layer", "all_layer_lf_pf"}


def break_indices(draw, call, sized):
    """An index list of the wrong form or length, or one index (page) out of range,
    negative or off a page boundary. ``sized``: rows of each side, None for a table."""
    which = draw(st.integers(0, 1))
    arg, idx = call.idx_names[which], call.kw[call.idx_names[which]]
    page = call.kw["page_size"] if call.kind in PAGE_KINDS else 1
    how = draw(st.sampled_from(["list", "float", "2-D", "none", "length", "range", "negative", "unaligned"]))
    if how in ("range", "negative", "unaligned") and idx.numel() == 0:
        how = "length"
    if (how == "range" and sized[which] is None or how == "negative" and call.kind in SKIPS_NEGATIVES
            or how == "unaligned" and page == 1):
        how = "float"
    if how == "list":
        value, expect = idx.tolist(), [f"{arg}='list'"]
    elif how == "float":
        value, expect = idx.double(), [f"{arg}.dtype=torch.float64"]
    elif how == "2-D":
        value, expect = idx.view(1, -1), [f"{arg}.shape=(1, {idx.numel()})"]
    elif how == "none":
        value, expect = None, [f"{arg}='NoneType'"]
    elif how == "length":
        value = torch.cat([idx, torch.zeros(page, dtype=idx.dtype)])
        expect = list(call.idx_names)
    else:
        pos = draw(st.integers(0, idx.numel() // page - 1)) * page
        if how == "range":
            first = (sized[which] // page + draw(st.integers(0, 3))) * page
        elif how == "negative":
            first = -page * draw(st.integers(1, 3))
        else:
            first = int(idx[pos]) + draw(st.integers(1, page - 1))
        value = idx.clone()
        value[pos:pos + page] = first + torch.arange(page, dtype=idx.dtype)
        expect = [f"{arg}={first}"]
    call.kw[arg] = value
    call.expect, call.what = expect, f"{arg}: {how}"


@st.composite
def calls(draw, kind):
    build, has_mla = KINDS[kind]
    mla = has_mla and draw(st.booleans())
    call, breaks, sized = build(draw, mla)
    call.kind = kind
    how = draw(st.sampled_from(["valid", "argument", "argument", "indices"]))
    if how == "argument":
        break_argument(draw, call, breaks)
    elif how == "indices":
        break_indices(draw, call, sized)
    return call


@needs_cpu_kernel
@pytest.mark.parametrize("kind", sorted(KINDS))
@PROFILE
@given(data=st.data())
def test_random_valid_and_invalid_calls(kind, data):
    call = data.draw(calls(kind))
    event("valid" if call.expect is None else "refused")
    if call.expect is not None:
        with pytest.raises(KvtierError) as err:
            call.run()
        msg = str(err.value)
        assert any(f in msg for f in call.expect), f"{call.what}: {msg!r} names none of {call.expect}"
        call.mem.check()                      # nothing moved, margins intact
    # The valid call (after a refused one: on the same buffers) moves what the model says.
    call.run(call.good)
    call.model(call.good)
    call.mem.check()


# ------------------------------------------------------------------ known failures
def _per_layer_call(w, **kw):
    a = dict(src_k=w.host["k"][0], dst_k=w.dev["k"][0], src_v=w.host["v"][0], dst_v=w.dev["v"][0],
             src_indices=torch.tensor([4, 0, 9]), dst_indices=torch.tensor([1, 5, 2]), item_size=w.item)
    adapters.transfer_kv_per_layer(**{**a, **kw})


@pytest.mark.parametrize("config", ["fast", {"num_programs": 2}], ids=["str", "dict"])
def test_config_that_is_no_copy_config(config):
    w = World("lf")
    with pytest.raises(KvtierError, match="config="):
        _per_layer_call(w, config=config)
    w.mem.check()


@pytest.mark.parametrize("form", ["meta", "sparse"])
def test_meta_or_sparse_indices(form):
    w = World("lf")
    si = torch.tensor([4, 0, 9])
    with pytest.raises(KvtierError, match="src_indices"):
        _per_layer_call(w, src_indices=si.to("meta") if form == "meta" else si.to_sparse())
    w.mem.check()


def _lf_pf_direct_one_host_layer(w):
    adapters.transfer_kv_all_layer_direct_lf_pf(w.dev["k"] + w.dev["v"], [w.host[c][:, :1] for c in w.comps],
                                                torch.arange(4), torch.arange(4), w.page)


def _direct_other_rows(w):
    adapters.transfer_kv_direct(w.dev["k"], [v[:, :1] for v in w.host_layer_views("k")],
                                torch.arange(4), torch.arange(4), w.page)


def _pf_lf_direct_bool_layer(w):
    adapters.transfer_kv_per_layer_direct_pf_lf([w.host["k"], w.host["v"]], [w.dev["k"][0], w.dev["v"][0]],
                                                torch.arange(4), torch.arange(4), True, w.page)


@pytest.mark.parametrize("layout,call,arg", [
    ("pfd", _lf_pf_direct_one_host_layer, "dst_ptrs"),
    ("lf", _direct_other_rows, "dst_layers"),
    ("pfd", _pf_lf_direct_bool_layer, "layer_id=True"),
], ids=["lf_pf-host-with-fewer-layers", "direct-rows-differ", "pf_lf-bool-layer-id"])
def test_error_names_the_callers_argument(layout, call, arg):
    w = World(layout, load=layout == "pfd" and call is _pf_lf_direct_bool_layer)
    with pytest.raises(KvtierError, match=arg):
        call(w)
    w.mem.check()
