"""Adapter calls found by their arguments (`kvtier.adapters.maps.run_keyed`): a call whose
buffers, scalars and tables were seen runs the kept lane and builds no map; anything that
changes what the maps would be (other memory, other strides, a rewritten table, a scalar
that is not an exact int) takes the full path, and every call moves exactly its bytes."""
from __future__ import annotations

import pytest
import torch

from kvtier import adapters
from kvtier.adapters import maps as adapter_maps
from kvtier.kernels import KvtierError
from test_adapter_model import needs_cpu_kernel, table

N, ROW = 16, (2, 8)                      # slots, row shape (bf16): 32-byte rows
ITEM = 2 * 8 * 2


@pytest.fixture
def full_paths(monkeypatch):
    """Counts the calls that took the full path (built or looked up their maps)."""
    seen = []
    real = adapter_maps.run_jobs

    def spy(*args, **kw):
        seen.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(adapter_maps, "run_jobs", spy)
    adapter_maps._LANES.clear()
    return seen


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _expect_per_layer(src_k, dst_k, src_v, dst_v, si, di, before_k, before_v):
    """Rows di of dst hold rows si of src; every other row is as it was."""
    for src, dst, before in ((src_k, dst_k, before_k), (src_v, dst_v, before_v)):
        want = before.clone()
        want[di] = src[si]
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))


def test_a_repeated_call_on_new_views_builds_no_map_and_moves_the_right_bytes(full_paths):
    host = _rand(2, 3, N, *ROW, seed=1)          # (K/V, layers, slots, row): SGLang's layer_first
    dev = [[torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(3)] for _ in range(2)]
    si, di = torch.tensor([3, 0, 9, 15]), torch.tensor([7, 1, 2, 12])
    for step in range(6):
        layer = step % 3
        host[:, layer] = _rand(2, N, *ROW, seed=10 + step)      # new bytes every call
        before = [d[layer].clone() for d in dev]
        adapters.transfer_kv_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer],
                                       si, di, ITEM)
        _expect_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer], si, di, *before)
    assert len(full_paths) == 3, "one full path per layer; the repeats reuse it"


def test_other_memory_or_other_strides_take_the_full_path(full_paths):
    a, b = _rand(N, *ROW, seed=2), _rand(N, *ROW, seed=3)
    da, db = torch.zeros(N, *ROW, dtype=torch.bfloat16), torch.zeros(N, *ROW, dtype=torch.bfloat16)
    idx = torch.tensor([4, 5])
    adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, ITEM)
    a2 = a.clone()                                  # same shape, other memory
    zeros = torch.zeros_like(da)
    adapters.transfer_kv_per_layer(a2, zeros, b, db, idx, idx, ITEM)
    assert len(full_paths) == 2
    assert torch.equal(zeros[idx].view(torch.int16), a2[idx].view(torch.int16))
    # The same first byte and shape with other strides is another layout: the full path
    # refuses it (the call addresses rows by byte offsets).
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


@pytest.mark.parametrize("brk", [_moved, _grown, _freed], ids=["set_", "resize_", "storage-freed"])
def test_a_kept_lane_never_writes_where_a_layer_tensor_used_to_be(full_paths, brk):
    """A lane found by its tensors' addresses (`run_keyed`'s ``by_address``) watches no
    storage: a device layer whose storage changed in place no longer matches the key, so
    the call takes the full path, which moves exactly its bytes into the tensor's memory as
    it is now or refuses it; no byte lands in the memory the layer had."""
    host = _rand(2, N, *ROW, seed=30)
    dk, dv = _rand(N, *ROW, seed=31), _rand(N, *ROW, seed=32)      # poison: every row must be accounted for
    si, di = torch.tensor([3, 0, 9]), torch.tensor([7, 1, 2])
    adapters.transfer_kv_per_layer(host[0], dk, host[1], dv, si, di, ITEM)
    old = dk.untyped_storage()        # the memory the lane's maps were built on (resize_ moves it)
    old_bytes = bytes(old)
    brk(dk)
    readable = dk.untyped_storage().nbytes() >= dk.numel() * dk.element_size()
    before = (dk.clone() if readable else None, dv.clone())
    try:
        adapters.transfer_kv_per_layer(host[0], dk, host[1], dv, si, di, ITEM)
    except KvtierError as e:
        assert "dst_k=" in str(e) and len(full_paths) == 1, e     # refused while its maps were built
        assert torch.equal(dv.view(torch.int16), before[1].view(torch.int16)), "bytes moved by a refused call"
        assert not readable or torch.equal(dk.view(torch.int16), before[0].view(torch.int16)), \
            "bytes moved by a refused call"
    else:
        assert readable, "a call into a tensor without memory went ahead"
        _expect_per_layer(host[0], dk, host[1], dv, si, di, *before)
        assert len(full_paths) == 2, "the kept lane served a tensor whose memory changed"
    if brk is _moved:                               # set_ leaves the old storage to us
        assert bytes(old) == old_bytes, "a byte landed where the layer used to be"


@pytest.mark.parametrize("item_size", [True, float(ITEM), -ITEM])
def test_a_scalar_equal_to_a_seen_int_is_still_checked(full_paths, item_size):
    a, b = _rand(N, *ROW, seed=4), _rand(N, *ROW, seed=5)
    da, db = torch.zeros(N, *ROW, dtype=torch.bfloat16), torch.zeros(N, *ROW, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2])
    adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, ITEM)
    if item_size is True:                            # True == 1: a lane for item_size=1 first
        flat = [t.view(-1).view(torch.uint8) for t in (a, da, b, db)]
        adapters.transfer_kv_per_layer(*flat, idx, idx, 1)
    snap = (da.clone(), db.clone())
    with pytest.raises(KvtierError, match="item_size"):
        adapters.transfer_kv_per_layer(a, da, b, db, idx, idx, item_size)
    assert torch.equal(da, snap[0]) and torch.equal(db, snap[1])


@needs_cpu_kernel
def test_a_table_rewritten_through_torch_is_read_again(full_paths):
    src = [_rand(N, *ROW, seed=20 + l) for l in range(2)]
    other = [_rand(N, *ROW, seed=30 + l) for l in range(2)]
    dst = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    src_k, src_v, dst_k, dst_v = table(src), table(src), table(dst), table(dst)
    idx_s, idx_d = torch.tensor([6, 1]), torch.tensor([0, 9])
    adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx_s, idx_d, ITEM, 2)
    adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx_s, idx_d, ITEM, 2)
    assert len(full_paths) == 1, "unchanged tables: the second call reuses the first's lane"
    src_k.copy_(table(other))                        # the engine points K at other buffers
    adapters.transfer_kv_all_layer(src_k, dst_k, src_v, dst_v, idx_s, idx_d, ITEM, 2)
    assert len(full_paths) == 2
    # K and V tables name the same destination: the later component (V, from src) wins
    # where both write, so check K alone through a second destination.
    dst2 = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    adapters.transfer_kv_all_layer(src_k, table(dst2), src_v, table(dst), idx_s, idx_d, ITEM, 2)
    for l in range(2):
        assert torch.equal(dst2[l][idx_d].view(torch.int16), other[l][idx_s].view(torch.int16))
        assert torch.equal(dst[l][idx_d].view(torch.int16), src[l][idx_s].view(torch.int16))


@needs_cpu_kernel
def test_an_inference_table_is_never_kept(full_paths):
    src = [_rand(N, *ROW, seed=40 + l) for l in range(2)]
    dst = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    with torch.inference_mode():
        t_src, t_dst = table(src), table(dst)
    idx = torch.tensor([2, 3])
    for _ in range(2):
        adapters.transfer_kv_all_layer(t_src, t_dst, t_src, t_dst, idx, idx, ITEM, 2)
    assert len(full_paths) == 2
    assert not adapter_maps._LANES
    for l in range(2):
        assert torch.equal(dst[l][idx].view(torch.int16), src[l][idx].view(torch.int16))


# ------------------------------------------------------------------ the last call's index lists
@pytest.fixture
def checks(monkeypatch):
    """Counts index-check launches (the real check still runs)."""
    from kvtier.kernels import index_check_kernel as mod
    real, seen = mod._check_indices_kernel, []

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return real[grid]
    monkeypatch.setattr(mod, "_check_indices_kernel", Spy())
    adapter_maps._LAST = None
    return seen


def _layers(n_layers, seed):
    host = _rand(2, n_layers, N, *ROW, seed=seed)
    dev = [[torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(n_layers)] for _ in range(2)]
    return host, dev


def _load(host, dev, layer, si, di):
    adapters.transfer_kv_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer], si, di, ITEM)


@needs_cpu_kernel
def test_a_layer_loop_checks_its_lists_once_and_moves_every_layer(checks):
    host, dev = _layers(4, seed=50)
    si, di = torch.tensor([3, 0, 9]), torch.tensor([7, 1, 2])
    for layer in range(4):
        before = [d[layer].clone() for d in dev]
        _load(host, dev, layer, si, di)
        _expect_per_layer(host[0][layer], dev[0][layer], host[1][layer], dev[1][layer], si, di, *before)
    assert len(checks) == 1


def _rewrite(di, value):
    di[1] = value                                   # through torch: a new version


def _rebind(di, value):
    """``t.data = other`` keeps the version counter; the first byte tells the lists apart."""
    di.data = torch.tensor([int(di[0]), value])


@needs_cpu_kernel
@pytest.mark.parametrize("change", [_rewrite, _rebind], ids=["in place", "data rebound"])
def test_lists_changed_since_are_checked_again(checks, change):
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
    """The probe records the check without running it: nothing it saw counts as checked."""
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
def test_a_check_of_other_lists_in_between_is_not_mistaken_for_theirs(checks):
    """The verdict word holds the last check's verdict only: after another call's lists
    were checked on it, the first lists are checked again (and stay correct)."""
    host, dev = _layers(3, seed=52)
    si, di = torch.tensor([3, 0]), torch.tensor([7, 1])
    _load(host, dev, 0, si, di)
    _load(host, dev, 1, torch.tensor([5]), torch.tensor([6]))
    before = [d[2].clone() for d in dev]
    _load(host, dev, 2, si, di)
    _expect_per_layer(host[0][2], dev[0][2], host[1][2], dev[1][2], si, di, *before)
    assert len(checks) == 3


@needs_cpu_kernel
def test_the_same_lists_against_a_smaller_buffer_are_checked_again(checks):
    host, dev = _layers(1, seed=53)
    small = [torch.zeros(4, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    si, di = torch.tensor([3, 0]), torch.tensor([7, 1])
    _load(host, dev, 0, si, di)
    with pytest.raises(KvtierError, match="dst_indices=7"):
        adapters.transfer_kv_per_layer(host[0][0], small[0], host[1][0], small[1], si, di, ITEM)
    assert all(not t.any() for t in small)


@needs_cpu_kernel
def test_nothing_is_reused_while_a_graph_is_captured(checks, monkeypatch):
    import kvtier.platforms as platforms
    host, dev = _layers(3, seed=54)
    si, di = torch.tensor([3, 0]), torch.tensor([7, 1])
    _load(host, dev, 0, si, di)
    monkeypatch.setattr(platforms, "capturing", lambda: True)
    _load(host, dev, 1, si, di)
    _load(host, dev, 2, si, di)
    assert len(checks) == 3


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


@needs_cpu_kernel
def test_an_all_layer_calls_lists_are_not_remembered_but_a_layer_loops_are():
    from kvtier.kernels import index_memo
    src = [_rand(N, *ROW, seed=60 + l) for l in range(2)]
    dst = [torch.zeros(N, *ROW, dtype=torch.bfloat16) for _ in range(2)]
    si, di = torch.tensor([6, 1]), torch.tensor([0, 9])
    adapters.transfer_kv_all_layer(table(src), table(dst), table(src), table(dst), si, di, ITEM, 2)
    assert id(si) not in index_memo._MEMO and id(di) not in index_memo._MEMO
    for l in range(2):
        assert torch.equal(dst[l][di].view(torch.int16), src[l][si].view(torch.int16))
    host, dev = _layers(1, seed=61)
    _load(host, dev, 0, si, di)
    assert id(si) in index_memo._MEMO and id(di) in index_memo._MEMO
