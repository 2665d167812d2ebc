"""An engine's pointer tables, and what kvtier trusts about them (docs/adapters.md, "What
kvtier trusts about pointer tables").

kvtier never reads a table on the host (no sync) and keeps no copy of it: every launch
reads each table it is given as it is then, and checks every entry it uses (not null,
aligned as its accesses assume) before any byte moves. So a table rewritten by any means
(through torch, a numpy view, DLPack, an inference-mode ``copy_``, during a graph capture)
is copied from where it points at the next call, for K and V alike; a new table tensor of
the same layout runs the kept call shape. The alternative addresses are other guarded
buffers of the same shape, so a stale address would show as wrong bytes.
"""
from __future__ import annotations

import pytest
import torch

from kvtier import adapters
from kvtier.kernels import RowMap, copy_rows
from test_adapter_model import kernel_copy, lf, needs_cpu_kernel, table
from test_adapter_sglang import World

pytestmark = needs_cpu_kernel


def _world(mla: bool):
    """Device layers (random) as sources, host layer_first pools (poisoned) as destinations,
    and for each component a second set of device layers: the alternative addresses."""
    w = World("lf", load=False, mla=mla, layers=2)
    alt = {c: [w.mem.buffer(f"alt_{c}{l}", (w.dev_rows, *w.row), w.dtype) for l in range(w.layers)]
           for c in w.comps}
    w.dst_tables = {c: table(w.host_layer_views(c)) for c in w.comps}    # the same on every call
    return w, alt


def _backup(w: World, tables, si, di):
    """The all-layer table -> table backup of the world's components from ``tables``."""
    dst = w.dst_tables
    if len(w.comps) == 1:
        adapters.transfer_kv_all_layer_mla(tables["kv"], dst["kv"], si, di, w.item, w.layers)
    else:
        adapters.transfer_kv_all_layer(tables["k"], dst["k"], tables["v"], dst["v"], si, di, w.item, w.layers)


def _model(w: World, layers, si, di):
    """The engine's semantics: rows si of each layer in ``layers[c]`` to host rows di."""
    kernel_copy(w.mem, [(lambda l, s, c=c: lf(layers[c][l].data_ptr(), s, w.item),
                         lambda l, d, c=c: w.host_row(c, l, d)) for c in w.comps],
                si, di, range(w.layers), w.item)


def _first_call(w, tables=None):
    """A backup from tables of the device layers, then one of no rows."""
    tables = tables or {c: table(w.dev[c]) for c in w.comps}
    si, di = torch.tensor([3, 0, 7]), torch.tensor([5, 1, 2])
    _backup(w, tables, si, di)
    _model(w, w.dev, si, di)
    w.mem.check()
    _backup(w, tables, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    return tables


SECOND = torch.tensor([9, 4]), torch.tensor([11, 6])


def _torch(tables, alt):
    for c, t in tables.items():
        t.copy_(table(alt[c]))


def _numpy(tables, alt):
    for c, t in tables.items():
        version = t._version
        t.numpy()[:] = table(alt[c]).numpy()
        assert t._version == version        # a write torch does not see


def _dlpack(tables, alt):
    for c, t in tables.items():
        torch.from_dlpack(t.__dlpack__()).numpy()[:] = table(alt[c]).numpy()


def _new_tensor(tables, alt):
    for c in tables:
        tables[c] = table(alt[c])


@pytest.mark.parametrize("rewrite", [_torch, _numpy, _dlpack, _new_tensor], ids=["torch", "numpy", "dlpack", "new"])
@pytest.mark.parametrize("mla", [False, True], ids=["k-v", "mla"])
def test_a_rewritten_table_is_copied_from_where_it_points_now(mla, rewrite, monkeypatch):
    """K and V tables (one launch, both read as they are) and an MLA table; no table is
    ever read on the host."""
    w, alt = _world(mla)
    tables = _first_call(w)
    rewrite(tables, alt)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(AssertionError("host read")))
        _backup(w, tables, *SECOND)
    _model(w, alt, *SECOND)
    w.mem.assert_changes("host")
    w.mem.check()


@pytest.mark.parametrize("mla", [False, True], ids=["k-v", "mla"])
def test_an_inference_mode_table_rewritten_in_place_is_copied_from_where_it_points_now(mla):
    """One rule for every table: an inference-mode one has no version counter, and none is
    needed (K and V both follow an inference-mode ``copy_``)."""
    w, alt = _world(mla)
    with torch.inference_mode():
        made = {c: table(w.dev[c]) for c in w.comps}
    tables = _first_call(w, made)
    with torch.inference_mode():
        for c, t in tables.items():
            t.copy_(table(alt[c]))
    _backup(w, tables, *SECOND)
    _model(w, alt, *SECOND)
    w.mem.check()


def test_a_row_map_from_a_table_reads_it_live():
    """`RowMap.from_table` (the kernels' own form) reads the table once when the map is
    built (its checks), and each copy reads the table as it is (the same device here)."""
    w, alt = _world(mla=True)
    src_table = table(w.dev["kv"])
    src = RowMap.from_table(src_table, row_bytes=w.item, num_rows=w.dev_rows)
    dst = RowMap.from_layers(w.host_layer_views("kv"))
    si, di = torch.tensor([3, 0, 7]), torch.tensor([5, 1, 2])
    copy_rows(src, si, dst, di)
    _model(w, w.dev, si, di)
    src_table.numpy()[:] = table(alt["kv"]).numpy()
    copy_rows(src, SECOND[0], dst, SECOND[1])
    _model(w, alt, *SECOND)
    w.mem.check()


@pytest.mark.parametrize("mla", [False, True], ids=["k-v", "mla"])
def test_while_a_graph_is_captured_nothing_is_read_on_the_host(mla, monkeypatch):
    """A capture forbids syncs; kvtier makes none for tables at any time."""
    import kvtier.platforms as platforms
    w, alt = _world(mla)
    tables = _first_call(w)
    _torch(tables, alt)
    with monkeypatch.context() as m:
        m.setattr(platforms, "capturing", lambda: True)
        m.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(AssertionError("host read")))
        _backup(w, tables, *SECOND)
    _model(w, alt, *SECOND)
    w.mem.assert_changes("host")
    w.mem.check()
