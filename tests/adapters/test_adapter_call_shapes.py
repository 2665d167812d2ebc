"""Adapter calls on registered buffer sets (`kvtier.adapters.registry`): a call on buffers
an engine registered is prepared once (its `EngineCall`) and later calls of that kind, on
those buffers with the same geometry, only launch; buffers no registration holds take the
slow path (an `EngineCall` per call, kept nowhere). Anything that changes what the maps
would be (other strides, other alignment, a scalar that is not an exact int, a tensor whose
storage moved, shrank or was freed in place) is prepared again or refused; a table
rewritten by any means is read as it is; every call checks its index lists."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvtier import adapters
from kvtier.adapters import maps as adapter_maps
from kvtier.adapters import registry
from kvtier.kernels import KvtierError
from test_adapter_model import needs_cpu_kernel, table

N, ROW = 16, (2, 8)                      # slots, row shape (bf16): 32-byte rows
ITEM = 2 * 8 * 2


@pytest.fixture
def full_paths(monkeypatch):
    """Counts the calls that took the full path (built their maps: an `EngineCall`)."""
    seen = []
    real = adapter_maps.EngineCall.__init__

    def spy(self, *args, **kw):
        seen.append(1)
        return real(self, *args, **kw)
    monkeypatch.setattr(adapter_maps.EngineCall, "__init__", spy)
    return seen


class Owner:
    """Stands in for an engine's pool object: the owner of a registered buffer set."""


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _expect_per_layer(src_k, dst_k, src_v, dst_v, si, di, before_k, before_v):
    """Rows di of dst hold rows si of src; every other row is as it was."""
    for src, dst, before in ((src_k, dst_k, before_k), (src_v, dst_v, before_v)):
        want = before.clone()
        want[di] = src[si]
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


def test_registered_buffers_are_prepared_once_per_call_and_new_memory_takes_the_slow_path(full_paths):
    host = _rand(2, 3, N, *ROW, seed=1)          # (K/V, layers, slots, row): SGLang's layer_first
    dev = [[torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    owner = Owner()
    registry.register(owner, [host, dev])
    si, di = torch.tensor([3, 0, 9, 15]), torch.tensor([7, 1, 2, 12])
    for step in range(6):
        layer = step % 3
        host[:, layer] = _rand(2, N, *ROW, seed=10 + step)      # new bytes every call
        before = [d[layer].clone() for d in dev]
        adapters.transfer_kv_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer],
                                       si, di, ITEM)
        _expect_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer], si, di, *before)
    assert len(full_paths) == 3, "one full path per layer's views; every later call launches the kept one"
    a, b = _rand(N, *ROW, seed=2), _rand(N, *ROW, seed=3)       # memory no registration holds
    da, db = torch.zeros(N, *ROW, dtype=torch.bfloat16), torch.zeros(N, *ROW, dtype=torch.bfloat16)
    for _ in range(2):
        adapters.transfer_kv_per_layer(a, da, b, db, si, di, ITEM)
    _expect_per_layer(a, da, b, db, si, di, torch.zeros_like(da), torch.zeros_like(db))
    assert len(full_paths) == 5, "unregistered buffers: every call builds its own, keeps nothing"
    registry.unregister(owner)
    adapters.transfer_kv_per_layer(host[0][0], dev[0][0], host[1][0], dev[1][0], si, di, ITEM)
    assert len(full_paths) == 6, "an unregistered set's calls are prepared again"


def test_other_strides_or_alignment_take_the_full_path(full_paths):
    a, b = _rand(N, *ROW, seed=2), _rand(N, *ROW, seed=3)
    da, db = torch.zeros(N, *ROW, dtype=torch.bfloat16), torch.zeros(N, *ROW, dtype=torch.bfloat16)
    odd = torch.zeros(N * ITEM + 8, dtype=torch.uint8)[8:].view(torch.bfloat16).view(N, *ROW)     # 8-byte aligned
    owner = Owner()
    registry.register(owner, [a, b, da, db, odd])
    idx = torch.tensor([4, 5])
    adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, ITEM)
    adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, ITEM)
    adapters.transfer_kv_per_layer(a, odd, b, db, idx, idx, ITEM)
    assert len(full_paths) == 2
    # the same first bytes, views of another shape: prepared again, never the kept call
    half = N // 2
    with pytest.raises(KvtierError, match=f"dst_indices={half}"):
        adapters.transfer_kv_per_layer(a[:half], odd[:half], b[:half], db[:half], idx, idx + 4, ITEM)
    assert len(full_paths) == 3
    assert torch.equal(odd[idx].view(torch.int16), a[idx].view(torch.int16))
    square = torch.zeros(N, N, dtype=torch.bfloat16)
    adapters.transfer_kv_per_layer(square, da, b, db, idx, idx, 2 * N)
    with pytest.raises(KvtierError, match="src_k=.*must be contiguous"):
        adapters.transfer_kv_per_layer(square.t(), da, b, db, idx, idx, 2 * N)


def _moved(t):
    t.set_(torch.zeros_like(t))                     # the same shape in other memory


def _grown(t):
    t.resize_(4 * N, *ROW)                          # beyond its storage: new memory, a new shape


def _freed(t):
    t.untyped_storage().resize_(0)


def _shrunk(t):
    t.untyped_storage().resize_(t.numel() * t.element_size() // 4)    # the same shape, a quarter of the bytes


@pytest.mark.parametrize("brk", [_moved, _grown, _freed, _shrunk], ids=["set_", "resize_", "freed", "shrunk"])
def test_a_kept_shape_never_writes_where_a_tensor_used_to_be_or_past_its_storage(full_paths, brk):
    """A kept call shape reads every address off the call's tensors: a device layer whose
    storage changed in place is written where its memory is now, or refused (freed or
    shrunk: its storage no longer holds its elements); no byte lands in the memory the
    layer had."""
    host = _rand(2, N, *ROW, seed=30)
    dk, dv = _rand(N, *ROW, seed=31), _rand(N, *ROW, seed=32)      # poison: every row must be accounted for
    owner = Owner()
    registry.register(owner, [host, dk, dv])
    si, di = torch.tensor([3, 0, 9]), torch.tensor([7, 1, 2])
    adapters.transfer_kv_per_layer(host[0], dk, host[1], dv, si, di, ITEM)
    adapters.transfer_kv_per_layer(host[0], dk, host[1], dv, si, di, ITEM)     # the kept call
    assert len(full_paths) == 1
    old = dk.untyped_storage()        # the memory the first call wrote (set_ and resize_ leave it)
    old_bytes = bytes(old)
    brk(dk)
    readable = dk.untyped_storage().nbytes() >= dk.numel() * dk.element_size()
    before = (dk.clone() if readable else None, dv.clone())
    try:
        adapters.transfer_kv_per_layer(host[0], dk, host[1], dv, si, di, ITEM)
    except KvtierError as e:
        assert not readable and "dst_k=" in str(e), e
        assert torch.equal(dv.view(torch.int16), before[1].view(torch.int16)), "bytes moved by a refused call"
    else:
        assert readable, "a call into a tensor without its memory went ahead"
        _expect_per_layer(host[0], dk, host[1], dv, si, di, *before)
    if brk is _moved:
        assert bytes(old) == old_bytes, "a byte landed where the layer used to be"


@pytest.mark.parametrize("item_size", [True, float(ITEM), -ITEM])
def test_a_scalar_equal_to_a_seen_int_is_still_checked(full_paths, item_size):
    a, b = _rand(N, *ROW, seed=4), _rand(N, *ROW, seed=5)
    da, db = torch.zeros(N, *ROW, dtype=torch.bfloat16), torch.zeros(N, *ROW, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2])
    adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, ITEM)
    if item_size is True:                            # True == 1: a shape for item_size=1 first
        flat = [t.view(-1).view(torch.uint8) for t in (a, da, b, db)]
        adapters.transfer_kv_per_layer(*flat, idx, idx, 1)
    snap = (da.clone(), db.clone())
    with pytest.raises(KvtierError, match="item_size"):
        adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, item_size)
    assert torch.equal(da, snap[0]) and torch.equal(db, snap[1])


@needs_cpu_kernel
@pytest.mark.parametrize("how", ["torch", "numpy", "inference copy_"])
def test_a_rewritten_table_is_read_as_it_is_then(full_paths, how):
    """Every launch reads the engine's table as it is: rewritten through torch, through a
    numpy view (no version bump) or, made in inference mode, with ``copy_``, the next call
    copies K from the buffers the table names now, and V too (one rule for every table)."""
    src = [_rand(N, *ROW, seed=20 + l) for l in range(2)]
    other = [_rand(N, *ROW, seed=30 + l) for l in range(2)]
    dst = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    dst2 = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    if how == "inference copy_":
        with torch.inference_mode():
            src_k, src_v, dst_k, dst_v = table(src), table(src), table(dst), table(dst2)
    else:
        src_k, src_v, dst_k, dst_v = table(src), table(src), table(dst), table(dst2)
    owner = Owner()
    registry.register(owner, [src_k, src_v, dst_k, dst_v])
    idx_s, idx_d = torch.tensor([6, 1]), torch.tensor([0, 9])
    adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx_s, idx_d, ITEM, 2)
    new_k, new_v = table(other), table(other)
    if how == "numpy":
        src_k.numpy()[:] = new_k.numpy()
        src_v.numpy()[:] = new_v.numpy()
    elif how == "torch":
        src_k.copy_(new_k)
        src_v.copy_(new_v)
    else:
        with torch.inference_mode():
            src_k.copy_(new_k)
            src_v.copy_(new_v)
    adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx_s, idx_d, ITEM, 2)
    assert len(full_paths) == 1, "registered tables: the second call launches the kept call"
    for l in range(2):
        assert torch.equal(dst[l][idx_d].view(torch.int16), other[l][idx_s].view(torch.int16)), "K: old buffers"
        assert torch.equal(dst2[l][idx_d].view(torch.int16), other[l][idx_s].view(torch.int16)), "V: old buffers"


@needs_cpu_kernel
def test_a_table_entry_zeroed_through_numpy_is_refused_before_any_byte_moves(full_paths):
    src = [_rand(N, *ROW, seed=40 + l) for l in range(2)]
    dst = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    src_k, src_v, dst_k, dst_v = table(src), table(src), table(dst), table(dst)
    idx = torch.tensor([2, 3])
    adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx, idx, ITEM, 2)
    for t in dst:
        t.zero_()
    src_v.numpy()[1] = 0
    with pytest.raises(KvtierError, match=r"src_k_layers\+src_v_layers='0x0': source table entry 3"):
        adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx, idx, ITEM, 2)
    assert all(not t.any() for t in dst), "bytes moved although a table entry was null"
    src_v.numpy()[1] = src[1].data_ptr() + 2            # not 16-byte aligned
    with pytest.raises(KvtierError, match="source table entry 3 is not a live buffer's address"):
        adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx, idx, ITEM, 2)
    assert all(not t.any() for t in dst)


# ------------------------------------------------------------------ every call checks its lists
@pytest.fixture
def checks(monkeypatch):
    """Counts the index checks that ran (inline in a copy launch, or a check launch)."""
    import importlib
    core = importlib.import_module("kvtier.kernels.launcher")
    seen, real = [], core.CopyLaunch.__call__

    def spy(bound, si, di, sides, mode, *a, **kw):
        if mode == core.INLINE:
            seen.append(1)
        return real(bound, si, di, sides, mode, *a, **kw)
    monkeypatch.setattr(core.CopyLaunch, "__call__", spy)
    return seen


def _layers(n_layers, seed):
    host = _rand(2, n_layers, N, *ROW, seed=seed)
    dev = [[torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(n_layers)] for _ in range(2)]
    return host, dev


def _load(host, dev, layer, si, di):
    adapters.transfer_kv_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer], si, di, ITEM)


@needs_cpu_kernel
def test_a_layer_loop_checks_its_lists_at_every_layer_and_moves_every_layer(checks):
    host, dev = _layers(4, seed=50)
    si, di = torch.tensor([3, 0, 9]), torch.tensor([7, 1, 2])
    for layer in range(4):
        before = [d[layer].clone() for d in dev]
        _load(host, dev, layer, si, di)
        _expect_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer], si, di, *before)
    assert len(checks) == 4


def _rewrite(di, value):
    di[1] = value                                   # through torch: a new version


def _rebind(di, value):
    di.data = torch.tensor([int(di[0]), value])     # ``t.data = other`` keeps the version counter


def _numpy(di, value):
    di.numpy()[1] = value                           # no version bump, the same first byte


def _dlpack(di, value):
    torch.from_dlpack(di.__dlpack__()).numpy()[1] = value


def _ctypes(di, value):
    import ctypes
    ctypes.c_int64.from_address(di.data_ptr() + 8).value = value     # a raw pointer write


def _triton(di, value):
    from triton_writer import triton_write
    triton_write(di, 1, value)                      # an engine's own kernel


@needs_cpu_kernel
@pytest.mark.parametrize("change", [_rewrite, _rebind, _numpy, _dlpack, _ctypes, _triton])
def test_lists_changed_by_any_means_are_checked_again(checks, change):
    host, dev = _layers(2, seed=51)
    si, di = torch.tensor([3, 0]), torch.tensor([7, 1])
    _load(host, dev, 0, si, di)
    change(di, N + 5)
    before = [d[1].clone() for d in dev]
    with pytest.raises(KvtierError, match=f"dst_indices={N + 5}"):
        _load(host, dev, 1, si, di)
    assert all(torch.equal(d[1], b) for d, b in zip(dev, before)), "bytes moved for a bad list"
    assert len(checks) == 2


@needs_cpu_kernel
def test_lists_passed_under_a_launch_probe_are_checked_after_it(checks):
    """The probe records the launches without running them: nothing it saw counts as checked."""
    from kvtier.bench.probe import LaunchProbe
    host, dev = _layers(2, seed=57)
    si, di = torch.tensor([3, 0]), torch.tensor([7, N])
    with LaunchProbe():
        _load(host, dev, 0, si, di)
    before = [d[1].clone() for d in dev]
    with pytest.raises(KvtierError, match=f"dst_indices={N}"):
        _load(host, dev, 1, si, di)
    assert all(torch.equal(d[1], b) for d, b in zip(dev, before)), "bytes moved for a bad list"


@needs_cpu_kernel
def test_the_same_lists_against_a_smaller_buffer_are_refused(checks):
    host, dev = _layers(1, seed=53)
    small = [torch.zeros(4, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    si, di = torch.tensor([3, 0]), torch.tensor([7, 1])
    _load(host, dev, 0, si, di)
    with pytest.raises(KvtierError, match="dst_indices=7"):
        adapters.transfer_kv_per_layer(host[0][0], small[0], host[1][0], small[1], si, di, ITEM)
    assert all(not t.any() for t in small)


@needs_cpu_kernel
def test_checks_turned_off_and_on_between_calls(checks, monkeypatch):
    host, dev = _layers(3, seed=55)
    si, di = torch.tensor([3, 0]), torch.tensor([7, 1])
    _load(host, dev, 0, si, di)
    monkeypatch.setenv("KVTIER_CHECK", "0")
    _load(host, dev, 1, si, di)
    monkeypatch.delenv("KVTIER_CHECK")
    di[0] = N                                       # out of range, checks on again
    with pytest.raises(KvtierError, match=f"dst_indices={N}"):
        _load(host, dev, 2, si, di)
    assert len(checks) == 2


def test_no_tensor_outlives_its_owner(full_paths):
    """The slow path keeps nothing, and a registration's prepared calls hold their buffers
    only as long as the owner lives: buffers the caller drops are freed."""
    refs = []
    for step in range(3):
        a, b = _rand(N, *ROW, seed=70 + step), _rand(N, *ROW, seed=80 + step)
        da, db = torch.zeros_like(a), torch.zeros_like(b)
        adapters.transfer_kv_per_layer(a, da, b, db, torch.tensor([1]), torch.tensor([2]), ITEM)
        refs += [weakref.ref(t) for t in (a, b, da, db)]
        del a, b, da, db
    gc.collect()
    assert all(r() is None for r in refs), "the slow path kept a caller's tensor"
    assert len(full_paths) == 3
    a, b = _rand(N, *ROW, seed=90), _rand(N, *ROW, seed=91)
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    owner = Owner()
    registry.register(owner, [a, b, da, db])
    for _ in range(2):
        adapters.transfer_kv_per_layer(a, da, b, db, torch.tensor([1]), torch.tensor([2]), ITEM)
    assert len(full_paths) == 4 and len(registry._CALLS) >= 1
    refs = [weakref.ref(t) for t in (a, b, da, db)]
    kept = len(registry._CALLS)
    del a, b, da, db, owner
    gc.collect()
    assert all(r() is None for r in refs), "a registration outlived its owner"
    assert len(registry._CALLS) == kept - 1
