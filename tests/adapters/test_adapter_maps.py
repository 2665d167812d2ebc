"""The adapters' shared pieces: RowMap.from_table (raw address tables), one launch for
components that can share it, the launch configuration, and the no-kernel guard."""
from __future__ import annotations

import pytest
import torch

from kvtier.kernels import KvtierError, RowMap, copy_rows
from kvtier import adapters
from kvtier.adapters import maps as adapter_maps
from test_adapter_model import Memory, kernel_copy, lf, needs_cpu_kernel, table


# ------------------------------------------------------------------ RowMap.from_table
@pytest.mark.parametrize("table_dtype", [torch.uint64, torch.int64])
def test_from_table_copies_like_the_model(table_dtype):
    mem = Memory(1)
    src = [mem.buffer(f"s{l}", (10, 3, 4)) for l in range(3)]
    dst = mem.buffer("dst", (3, 12, 3, 4), fill="poison")
    item = 24
    m = RowMap.from_table(table(src).to(table_dtype), row_bytes=item, num_rows=10, owners=src)
    assert (m.num_layers, m.num_rows, m.row_bytes, m.token_stride, m.is_table) == (3, 10, 24, 24, True)
    si, di = torch.tensor([9, 0, 4]), torch.tensor([11, 3, 0])
    copy_rows(m, si, RowMap.from_stacked(dst), di)
    kernel_copy(mem, [(lambda l, s: lf(src[l].data_ptr(), s, item),
                       lambda l, d: lf(dst[l].data_ptr(), d, item))], si, di, range(3), item)
    mem.assert_changes("dst")
    mem.check()


def test_from_table_alignment_comes_from_the_addresses():
    buf = torch.zeros(64, dtype=torch.uint8)
    m = RowMap.from_table(torch.tensor([buf.data_ptr() + 2], dtype=torch.uint64), row_bytes=16,
                          num_rows=2, owners=[buf[2:]])
    assert m.align == 2
    assert RowMap.from_table(table([buf]), row_bytes=16, num_rows=2).align == 16


@pytest.mark.parametrize("bad,arg", [
    (lambda b: table([b]).double(), "table"),
    (lambda b: table([b, b]).view(1, 2), "table"),
    (lambda b: torch.empty(0, dtype=torch.uint64), "table"),
    (lambda b: torch.tensor([0], dtype=torch.uint64), "table"),
    ([1, 2], "table"),
])
def test_from_table_rejects_what_is_not_an_address_table(bad, arg):
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(KvtierError, match=arg):
        RowMap.from_table(bad(buf) if callable(bad) else bad, row_bytes=16, num_rows=2)


def test_from_table_checks_rows_against_owners():
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(KvtierError, match="owners"):
        RowMap.from_table(table([buf]), row_bytes=16, num_rows=2, owners=[buf, buf])
    with pytest.raises(KvtierError, match="layers"):
        RowMap.from_table(table([buf]), row_bytes=16, num_rows=5, owners=[buf])


# ------------------------------------------------------------------ launches and configuration
@pytest.fixture
def launches(monkeypatch):
    """Records (row_bytes, num_components, config) of every copy_rows the adapters run."""
    import importlib
    core = importlib.import_module("kvtier.kernels.launcher")
    seen = []
    real = core.CopyLaunch.__call__

    def spy(bound, *args, **kw):
        src = bound.layouts[0]
        seen.append((src.row_bytes, src.num_components, bound.config))
        return real(bound, *args, **kw)

    monkeypatch.setattr(core.CopyLaunch, "__call__", spy)
    return seen


@needs_cpu_kernel
def test_k_and_v_tables_share_one_launch(launches):
    mem = Memory(2)
    dev = {c: [mem.buffer(f"{c}{l}", (8, 2, 4)) for l in range(2)] for c in "kv"}
    host = mem.buffer("host", (2, 8, 2, 2, 4), fill="poison")
    si, di = torch.tensor([1, 6]), torch.tensor([7, 0])
    adapters.transfer_kv_all_layer_lf_pf(table(dev["k"]), host[0], table(dev["v"]), host[1], si, di,
                                       16, 32, 2, block_quota=3)
    assert [(r, c) for r, c, _ in launches] == [(16, 2)]
    assert launches[0][2].num_programs == 3
    kernel_copy(mem, [(lambda l, s, c=c: lf(dev[c][l].data_ptr(), s, 16),
                       lambda l, d, i=i: host[i].data_ptr() + d * 32 + l * 16) for i, c in enumerate("kv")],
                si, di, range(2), 16)
    mem.check()


def test_separate_allocations_share_one_launch(launches):
    """K and V in separate allocations (SGLang's per-layer device tensors) are joined by
    the step between their bases, read off each call's tensors: one launch moves both."""
    mem = Memory(3)
    k, v = mem.buffer("k", (8, 16)), mem.buffer("v", (8, 16))
    dk, dv = mem.buffer("dk", (8, 16), fill="poison"), mem.buffer("dv", (8, 16), fill="poison")
    idx = torch.tensor([2, 5])
    adapters.transfer_kv_per_layer(k, dk, v, dv, idx, idx, 32)
    assert [(r, c) for r, c, _ in launches] == [(32, 2)]
    kernel_copy(mem, [(lambda l, s, a=a: lf(a.data_ptr(), s, 32), lambda l, d, b=b: lf(b.data_ptr(), d, 32))
                      for a, b in ((k, dk), (v, dv))], idx, idx, [0], 32)
    mem.check()


def test_a_bad_second_component_moves_no_byte_of_the_first():
    mem = Memory(4)
    k, v = mem.buffer("k", (8, 16)), mem.buffer("v", (8, 16))
    dk, dv = mem.buffer("dk", (8, 16), fill="poison"), mem.buffer("dv", (4, 16), fill="poison")
    with pytest.raises(KvtierError, match="dst_indices"):
        adapters.transfer_kv_per_layer(k, dk, v, dv, torch.tensor([1, 2]), torch.tensor([3, 6]), 32)
    mem.check()


def test_a_bare_table_needs_the_kernel(monkeypatch):
    """Where only the torch reference could run, raw addresses cannot be read: say so
    before any byte moves."""
    monkeypatch.setattr(adapter_maps, "triton_available", lambda: False)
    mem = Memory(5)
    dev = [mem.buffer("d0", (8, 16))]
    host = mem.buffer("host", (1, 8, 16), fill="poison")
    with pytest.raises(KvtierError, match="Triton"):
        adapters.transfer_kv_all_layer_mla(table(dev), table([host[0]]), torch.tensor([1]),
                                         torch.tensor([2]), 32, 1)
    mem.check()


@needs_cpu_kernel
def test_a_table_is_never_read_on_the_host_and_every_launch_reads_it_as_it_is(monkeypatch):
    """An engine's table is read by the kernels only (no host read, so no sync): a layer
    the engine re-points is copied from where it points at the next call."""
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(AssertionError("host read")))
    mem = Memory(6)
    a, b = mem.buffer("a", (8, 16)), mem.buffer("b", (8, 16))
    dst = mem.buffer("dst", (1, 8, 16), fill="poison")
    src, out = table([a]), table([dst[0]])
    for s, d in ((1, 2), (3, 4)):
        adapters.transfer_kv_all_layer_mla(src, out, torch.tensor([s]), torch.tensor([d]), 32, 1)
        mem.copy(dst[0].data_ptr() + d * 32, a.data_ptr() + s * 32, 32)
    src.numpy()[0] = b.data_ptr()             # the engine re-points a layer (no version bump)
    adapters.transfer_kv_all_layer_mla(src, out, torch.tensor([5]), torch.tensor([6]), 32, 1)
    mem.copy(dst[0].data_ptr() + 6 * 32, b.data_ptr() + 5 * 32, 32)
    mem.check()


def test_the_vllm_recipe_in_docs_adapters():
    """The vLLM handler in docs/adapters.md: per-tensor block views as the layers of two maps,
    (n, 2) sub-block pairs, one launch, both directions."""
    mem = Memory(7)
    page, factor = 48, 2
    gpu = [mem.buffer(f"g{i}", (6, page), torch.int8) for i in range(2)]
    cpu = [mem.buffer(f"c{i}", (4, page * factor), torch.int8, fill="poison") for i in range(2)]
    g = RowMap.from_layers(gpu)
    c = RowMap.from_layers([t.view(-1, page) for t in cpu])
    src_to_dst = torch.tensor([[5, 0], [1, 1], [2, 6]]).numpy()      # GPU block -> CPU sub-block
    pairs = torch.from_numpy(src_to_dst.T.copy())
    copy_rows(g, pairs[0], c, pairs[1])
    for gt, ct in zip(gpu, cpu):
        for s, d in src_to_dst.tolist():
            mem.copy(ct.data_ptr() + d * page, gt.data_ptr() + s * page, page)
    mem.assert_changes("c0", "c1")
    mem.check()


def test_adapter_errors_are_runtime_errors_too():
    """SGLang's and sgl_kernel_npu's ops reject bad input with RuntimeError (TORCH_CHECK);
    engine code catching that, or ValueError, catches kvtier's errors as well."""
    k = torch.zeros(8, 32, dtype=torch.uint8)
    for caught in (RuntimeError, ValueError, KvtierError):
        with pytest.raises(caught, match="item_size=0"):
            adapters.transfer_kv_per_layer(k, k.clone(), k, k.clone(), torch.tensor([1]), torch.tensor([2]), 0)
