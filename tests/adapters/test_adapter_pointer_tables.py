"""What kvtier notices about an engine's pointer table, and what it trusts (docs/adapters.md,
"What kvtier trusts about pointer tables").

An all-layer call reads a table once (a device sync) and keeps the row map built from it
for the table tensor at its current version (torch's version counter). A write through torch
bumps the counter: the next call builds the map again from the new addresses. A write that
bypasses the counter (a numpy view here; DLPack aliases, ``.data``, raw pointer writes
and other libraries' kernels alike) is not noticed: the map and its checks stay as they
were, and which addresses a copy then reads depends on the call. Every table here points
at valid buffers (the alternative addresses are other guarded buffers of the same shape),
so a wrong guess shows up as wrong bytes, never as a crash.
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


@pytest.fixture
def reads(monkeypatch):
    """The tables kvtier reads (each read builds a row map: `RowMap.from_table`)."""
    seen = []
    build = RowMap.from_table.__func__

    def spy(cls, table, **kw):
        seen.append(table.tolist())
        return build(cls, table, **kw)
    monkeypatch.setattr(RowMap, "from_table", classmethod(spy))
    return seen


def _first_call(w, reads, tables=None):
    """A backup from tables of the device layers: every table is read, and a second call
    with the same tables reads none."""
    tables = tables or {c: table(w.dev[c]) for c in w.comps}
    si, di = torch.tensor([3, 0, 7]), torch.tensor([5, 1, 2])
    _backup(w, tables, si, di)
    _model(w, w.dev, si, di)
    w.mem.check()
    assert all(_addresses(t) in reads for t in tables.values())
    reads.clear()
    _backup(w, tables, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert reads == [], "an unchanged table was read again"
    return tables


def _addresses(t):
    return t.view(torch.int64).tolist()


SECOND = torch.tensor([9, 4]), torch.tensor([11, 6])


@pytest.mark.parametrize("mla", [False, True], ids=["k-v-stacked", "mla"])
def test_a_table_written_through_torch_is_read_again(mla, reads):
    """K and V tables (one launch, the tables stacked) and an MLA table: an in-place torch
    write bumps the version, so the next call reads the table again."""
    w, alt = _world(mla)
    tables = _first_call(w, reads)
    for c, t in tables.items():
        version = t._version
        t.copy_(table(alt[c]))
        assert t._version > version
    _backup(w, tables, *SECOND)
    assert sorted(reads) == sorted(_addresses(t) for t in tables.values()), "the written tables were not read again"
    _model(w, alt, *SECOND)
    w.mem.assert_changes("host")
    w.mem.check()


def test_a_new_table_tensor_is_mapped_anew(reads):
    w, alt = _world(mla=False)
    _first_call(w, reads)
    _backup(w, {c: table(alt[c]) for c in w.comps}, *SECOND)
    _model(w, alt, *SECOND)
    w.mem.check()


def _write_outside_torch(tables, alt):
    for c, t in tables.items():
        version = t._version
        t.numpy()[:] = table(alt[c]).numpy()
        assert t._version == version, "a numpy write now bumps the version: update docs/adapters.md"


@pytest.mark.parametrize("mla,copied_from", [(False, "old"), (True, "new")], ids=["k-v-stacked", "mla"])
def test_a_table_written_outside_torch_is_not_noticed(mla, copied_from, reads):
    """After a numpy write the kept map is used as it is: the table is not read again, so
    its checks (no null address, the alignment the kernel assumes) are not made again.
    Which addresses the copy reads depends on the call: K and V tables were concatenated
    into one table when they were first stacked (the old addresses); an MLA table is read
    in place (the new ones). Hence the rule: write tables through torch, or pass a new
    tensor."""
    w, alt = _world(mla)
    tables = _first_call(w, reads)
    _write_outside_torch(tables, alt)
    _backup(w, tables, *SECOND)
    assert reads == [], "a table written outside torch was read again: update docs/adapters.md"
    _model(w, w.dev if copied_from == "old" else alt, *SECOND)
    w.mem.check()


def test_a_row_map_from_a_table_reads_it_live_but_checks_it_once():
    """`RowMap.from_table` (the kernels' own form) has no version check at all: a map is
    built once, its checks are made then, and each copy reads the table as it is (the
    same device here). Build a new map after changing a table."""
    w, alt = _world(mla=True)
    src_table = table(w.dev["kv"])
    src = RowMap.from_table(src_table, row_bytes=w.item, num_rows=w.dev_rows)
    dst = RowMap.from_layers(w.host_layer_views("kv"))
    si, di = torch.tensor([3, 0, 7]), torch.tensor([5, 1, 2])
    copy_rows(src, si, dst, di)
    _model(w, w.dev, si, di)
    src_table.copy_(table(alt["kv"]))             # through torch: the map still reads it live
    copy_rows(src, SECOND[0], dst, SECOND[1])
    _model(w, alt, *SECOND)
    w.mem.check()


@pytest.mark.parametrize("mla,copied_from", [(False, "old"), (True, "new")], ids=["k-v-stacked", "mla"])
def test_an_inference_mode_table_is_not_read_again_even_after_a_torch_write(mla, copied_from, reads):
    """A table made in inference mode has no version counter: it is kept by address, shape
    and dtype, and no write to it is noticed. Pass a new table instead."""
    w, alt = _world(mla)
    with torch.inference_mode():
        made = {c: table(w.dev[c]) for c in w.comps}
    tables = _first_call(w, reads, made)
    with torch.inference_mode():
        for c, t in tables.items():
            t.copy_(table(alt[c]))
    _backup(w, tables, *SECOND)
    assert reads == [], "a write to an inference-mode table was noticed: update docs/adapters.md"
    _model(w, w.dev if copied_from == "old" else alt, *SECOND)
    w.mem.check()


@pytest.mark.parametrize("mla", [False, True], ids=["k-v-stacked", "mla"])
def test_while_a_graph_is_captured_the_map_made_before_is_used(mla, reads, monkeypatch):
    """Reading a table syncs, which a graph capture forbids: during a capture the map made
    for the table before it is used (kept by address), and the bytes are right."""
    import kvtier.platforms as platforms
    w, _ = _world(mla)
    tables = _first_call(w, reads)
    monkeypatch.setattr(platforms, "capturing", lambda: True)
    _backup(w, tables, *SECOND)
    assert reads == [], "a table was read during a capture"
    _model(w, w.dev, *SECOND)
    w.mem.assert_changes("host")
    w.mem.check()
