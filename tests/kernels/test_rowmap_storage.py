"""A map keeps the tensors it was built on alive, and every launch checks on the host that
the tensors its layers rest on still have the storage the map was built on: after
``resize_`` (to a larger size: new memory), ``set_`` or a freed storage, the call raises
`KvtierError` naming the tensor and moves no byte; layers the call does not touch are not
its concern; a map built again works."""
from __future__ import annotations

import re

import pytest
import torch

from copy_rows_support import kernel_really_runs  # noqa: F401  (autouse: the kernel runs)
from helpers import Guarded
from kvtier.kernels import KvtierError, RowMap, copy_rows
from kvtier.pool import HostPool, MHADevicePool

ROWS, ROW, DT = 8, (2, 4), torch.float16
IDX = torch.tensor([5, 0, 3])


def _layers(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(ROWS, *ROW, generator=g).to(DT) for _ in range(n)]


def _grow(t):
    t.resize_(1 << 16)          # beyond its storage: torch moves it to new memory


def _set_other(t):
    t.set_(torch.zeros(ROWS, *ROW, dtype=DT))


def _free(t):
    t.untyped_storage().resize_(0)


BREAKS = pytest.mark.parametrize("brk", [_grow, _set_other, _free], ids=["resize_", "set_", "storage-freed"])


def _expect_refused(match, *args, **kw):
    with pytest.raises(KvtierError, match=re.escape(match)):
        copy_rows(*args, **kw)


@BREAKS
def test_a_table_side_whose_layer_moved_is_named_and_nothing_moves(brk):
    src = _layers(2, seed=1)
    dst = Guarded((2, ROWS, *ROW), DT, fill="poison")
    m, d = RowMap.from_layers(src), RowMap.from_stacked(dst.t)
    copy_rows(m, IDX, d, IDX)
    assert torch.equal(dst.t[:, IDX], torch.stack(src)[:, IDX])
    before = dst.snapshot()
    brk(src[1])
    _expect_refused("layers[1]", m, IDX, d, IDX)
    assert torch.equal(dst.snapshot(), before), "bytes moved although a source layer had moved"
    dst.check()
    # Layer 0 alone does not rest on the moved tensor: that copy is still good.
    copy_rows(m, IDX, d, torch.tensor([1, 2, 4]), num_layers=1)
    assert torch.equal(dst.t[0, [1, 2, 4]], src[0][IDX])
    # A map built again from the tensors as they are now works.
    src[1] = torch.randn(ROWS, *ROW).to(DT)
    m2 = RowMap.from_layers(src)
    copy_rows(m2, IDX, d, IDX)
    assert torch.equal(dst.t[1, IDX], src[1][IDX])
    dst.check()


@BREAKS
def test_a_stacked_destination_that_moved_is_named_and_the_source_is_untouched(brk):
    src = Guarded((2, ROWS, *ROW), DT)
    buf = torch.zeros(2, ROWS, *ROW, dtype=DT)
    s, d = RowMap.from_stacked(src.t), RowMap.from_stacked(buf)
    copy_rows(s, IDX, d, IDX)
    before = src.snapshot()
    brk(buf)
    _expect_refused("component 0 buffer", s, IDX, d, IDX)
    assert torch.equal(src.snapshot(), before)
    src.check()


def test_a_resize_inside_the_storage_changes_no_address_and_is_not_refused():
    """Shrinking keeps the storage (and every address): the map's rows stay in memory the
    map's tensor still owns, so the copy goes on."""
    src = _layers(2, seed=3)
    dst = Guarded((2, ROWS, *ROW), DT, fill="poison")
    m, d = RowMap.from_layers(src), RowMap.from_stacked(dst.t)
    keep = [t.clone() for t in src]
    src[0].resize_(ROWS // 2, *ROW)
    copy_rows(m, IDX, d, IDX)
    assert torch.equal(dst.t[:, IDX], torch.stack(keep)[:, IDX])
    dst.check()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("v_head_dim", [4, 8], ids=["kv-one-launch", "k-then-v-launches"])
def test_pools_name_a_device_layer_that_moved_and_change_no_host_byte(layout, v_head_dim):
    """With V rows unlike K's, K and V move in two launches: the moved V layer is found
    before the K launch, so no byte of K moves either."""
    dp = MHADevicePool(16, 4, 2, 2, 4, v_head_dim=v_head_dim, dtype=DT, device="cpu", storage="layers")
    hp = HostPool(dp, layout=layout, size_tokens=16, pin_memory=False, strategy="kernel")
    for t in dp.buffers["k"] + dp.buffers["v"]:
        t.copy_(torch.randn(t.shape).to(DT))
    hi, di = torch.arange(4, 8), torch.arange(8, 12)
    hp.backup_from_device_all_layer(dp, hi, di)
    host = {n: b.view(torch.uint8).clone() for n, b in hp.buffers.items()}   # bytes: NaN != NaN
    _grow(dp.buffers["v"][1])
    with pytest.raises(KvtierError, match=re.escape("layers[")):
        hp.backup_from_device_all_layer(dp, hi, di)
    with pytest.raises(KvtierError, match="no longer has the storage"):
        hp.load_to_device_per_layer(dp, hi, di, 1)
    assert all(torch.equal(hp.buffers[n].view(torch.uint8), host[n]) for n in host), "host bytes moved"
    hp.load_to_device_per_layer(dp, hi, di, 0)       # layer 0 rests on tensors that did not move


@pytest.mark.parametrize("keep_bytes", [0, 16], ids=["freed", "shrunk"])
def test_a_map_is_not_built_on_a_tensor_its_storage_no_longer_holds(keep_bytes):
    """An engine releasing its KV memory frees (or shrinks) the storage in place and the
    tensor keeps its shape: a map built then is refused, naming the tensor, as is an
    index list in the same state (it would be read from memory nobody owns)."""
    layers = _layers(2, seed=4)
    layers[1].untyped_storage().resize_(keep_bytes)
    with pytest.raises(KvtierError, match=re.escape("layers[1]=(8, 2, 4): its elements need 128 bytes but its "
                                                    f"storage holds {keep_bytes}")):
        RowMap.from_layers(layers)
    stacked = torch.zeros(2, ROWS, *ROW, dtype=DT)
    stacked.untyped_storage().resize_(keep_bytes)
    with pytest.raises(KvtierError, match=re.escape("component 0 buffer=(2, 8, 2, 4)")):
        RowMap.from_stacked(stacked)
    idx = torch.tensor([1, 2, 3])
    idx.untyped_storage().resize_(keep_bytes)
    buf = Guarded((1, ROWS, *ROW), DT)
    d = RowMap.from_stacked(buf.t)
    before = buf.snapshot()
    with pytest.raises(KvtierError, match=re.escape("src_indices=(3,): its elements need 24 bytes")):
        copy_rows(d, idx, d, torch.tensor([0, 1, 2]))
    assert torch.equal(buf.snapshot(), before), "bytes moved by a refused copy"
    buf.check()


@pytest.mark.parametrize("change", ["shrunk", "regrown", "freed"])
@pytest.mark.parametrize("which", ["host buffer", "stacked device buffer"])
def test_a_pools_stacked_buffer_whose_storage_changed_in_place_is_named(which, change):
    """A stacked buffer (a host pool's, or a stacked device pool's) whose storage is
    shrunk, regrown or freed in place after the pool's maps were built: every call names
    it with a `KvtierError` before any byte moves (torch gives the storage new memory, or
    none, under the same shape), and no byte of the other side changes."""
    dp = MHADevicePool(16, 4, 2, 2, 4, dtype=DT, device="cpu", storage="stacked")
    hp = HostPool(dp, layout="page_first_direct", size_tokens=16, pin_memory=False, strategy="kernel")
    for t in (dp.buffers["k"], dp.buffers["v"]):
        t.copy_(torch.randn(t.shape).to(DT))
    hi, di = torch.arange(4, 8), torch.arange(8, 12)
    hp.backup_from_device_all_layer(dp, hi, di)
    out = dp.gather(torch.arange(0, 4))             # a gather's result, made before the change
    buf = hp.groups[0][2] if which == "host buffer" else dp.buffers["k"]
    other = ([t.view(torch.uint8).clone() for t in (dp.buffers["k"], dp.buffers["v"])] if which == "host buffer"
             else [b.view(torch.uint8).clone() for b in hp.buffers.values()])
    st = buf.untyped_storage()
    st.resize_({"shrunk": st.nbytes() // 2, "regrown": 2 * st.nbytes(), "freed": 0}[change])
    named = "component 0 buffer" if which == "host buffer" else "buffers\\['k'\\]|component 0 buffer"
    calls = [lambda: hp.backup_from_device_all_layer(dp, hi, di), lambda: hp.load_to_device_per_layer(dp, hi, di, 1)]
    if which != "host buffer":
        calls += [lambda: dp.gather(torch.arange(0, 4)), lambda: dp.gather(torch.arange(4, 8), out=out),
                  lambda: dp.scatter(torch.arange(0, 4), out)]
    for call in calls:
        with pytest.raises(KvtierError, match=f"({named}).*no longer has the storage"):
            call()
    after = ([t.view(torch.uint8) for t in (dp.buffers["k"], dp.buffers["v"])] if which == "host buffer"
             else [b.view(torch.uint8) for b in hp.buffers.values()])
    assert all(torch.equal(a, b) for a, b in zip(after, other)), "bytes moved for a buffer that changed"
