"""Host maps as an Ascend kernel addresses them (kvtier.platforms.ascend): registered host
memory re-described as a table of device addresses.

On CPU the registration is recorded with the identity mapping (device address = host
address), so the translated table map can be run by the interpreter and compared bit for
bit with the plain-torch oracle; a shifted mapping checks the address arithmetic.
"""
import pytest
import torch

from copy_rows_support import HOST_FORMS, Side, make_indices, run_and_check
from kvtier.kernels import KvtierError, RowMap
from kvtier.platforms import ascend as host_maps
from kvtier import platforms as plat


@pytest.fixture(autouse=True)
def clean_registry():
    saved = dict(host_maps._registered)
    yield
    host_maps._registered.clear()
    host_maps._registered.update(saved)


def register_identity(side: Side) -> None:
    for g in side.guards:
        host_maps.register_host_memory(g.raw, g.raw.untyped_storage().data_ptr())


def as_kernel_sees(side: Side) -> Side:
    """The side with its map replaced by the translated (table) map."""
    side.map = host_maps.translate(side.map, torch.device("cpu"))
    return side


@pytest.mark.parametrize("C", [1, 2])
@pytest.mark.parametrize("form", HOST_FORMS)
@pytest.mark.parametrize("direction", ["backup", "load"])
def test_registered_host_maps_copy_through_device_addresses(form, C, direction):
    L, N, P = 3, 16, 4
    host = Side(form, L=L, N=N, P=P, C=C, row=(2, 8), fill="poison" if direction == "backup" else "random",
                seed=1)
    dev = Side("stacked", L=L, N=N, P=P, C=C, row=(2, 8),
               fill="random" if direction == "backup" else "poison", seed=2)
    register_identity(host)
    assert host_maps.npu_reachable(host.map)
    as_kernel_sees(host)
    assert host.map.is_table and host.map.table.numel() == C * L
    si, di = make_indices("perm", N, N, seed=3)
    src, dst = (dev, host) if direction == "backup" else (host, dev)
    run_and_check(src, si, dst, di)


def test_table_holds_the_registered_device_addresses():
    t = torch.empty((2, 3, 8, 16), dtype=torch.uint8)       # (C, L, N, row) layer_first
    m = RowMap.stack([RowMap.from_host_layout(t[c], "layer_first", 1) for c in range(2)])
    start = t.untyped_storage().data_ptr()
    host_maps.register_host_memory(t, 0x5000_0000)
    table = host_maps.translate(m, torch.device("cpu")).table.tolist()
    want = [0x5000_0000 + (t[c, l].data_ptr() - start) for c in range(2) for l in range(3)]
    assert table == want
    # Translated once per map and device (meta stands in for the NPU: no bytes needed).
    meta = torch.device("meta")
    first = m.kernel_view(host_maps.NPU, meta)
    assert first.device.type == "meta" and first is m.kernel_view(host_maps.NPU, meta)
    # A per-layer (table) host map translates the same.
    per_layer = RowMap.from_layers([t[0, l] for l in range(3)])
    assert host_maps.translate(per_layer, torch.device("cpu")).table.tolist() == want[:3]


def test_unregistered_memory_is_refused_naming_the_byte():
    t = torch.empty((2, 8, 16), dtype=torch.uint8)
    other = torch.empty((1, 8, 16), dtype=torch.uint8)
    m = RowMap.from_layers([t[0], t[1], other[0]])
    assert not host_maps.npu_reachable(m)
    with pytest.raises(KvtierError, match="not registered with the NPU.*register_npu_host"):
        host_maps.translate(m, torch.device("cpu"))
    host_maps.register_host_memory(t, 0x1000)       # two of three layers registered: still refused
    assert not host_maps.npu_reachable(m)
    with pytest.raises(KvtierError, match=f"host byte {other.data_ptr():#x}"):
        host_maps.translate(m, torch.device("cpu"))
    assert not m.reachable_by(host_maps.NPU)          # a no is not kept...
    host_maps.register_host_memory(other, 0x9000)   # registered later: the same map is reachable now
    assert host_maps.npu_reachable(m) and m.reachable_by(host_maps.NPU)


def test_device_maps_and_cpu_copies_are_left_alone():
    t = torch.empty((2, 8, 16), dtype=torch.uint8)
    m = RowMap.from_stacked(t)
    assert host_maps.device_addressed(m, torch.device("cpu")) is m


def test_register_npu_host_needs_host_memory_on_a_page_boundary_and_torch_npu():
    with pytest.raises(KvtierError, match="tensor"):
        host_maps.register_npu_host(torch.empty(4, device="meta"))
    buf = bytearray(3 * 4096)
    unaligned = torch.frombuffer(buf, dtype=torch.uint8, offset=1)
    if unaligned.untyped_storage().data_ptr() % 4096:
        with pytest.raises(KvtierError, match="4096-byte boundary"):
            host_maps.register_npu_host(unaligned)
    aligned = torch.empty(8192, dtype=torch.uint8)
    if aligned.untyped_storage().data_ptr() % 4096 == 0 and not plat.npu_available():
        with pytest.raises(plat.PlatformUnavailable):
            host_maps.register_npu_host(aligned)


def test_a_registration_dies_with_its_memory_and_a_reused_address_is_not_registered():
    """An engine registers host memory itself and tells kvtier the device address. Once
    that memory is freed and the same address is handed out again (here: a new tensor over
    the same bytes, as an allocator reusing the block gives), no lookup returns the old
    device address: the kernel path refuses the new tensor instead of writing through it."""
    block = bytearray(1 << 16)
    first = torch.frombuffer(block, dtype=torch.uint8)
    addr = first.data_ptr()
    host_maps.register_host_memory(first, 0x5000_0000)
    assert plat.host_device_address(first[64:], "npu") == 0x5000_0000 + 64
    del first                                   # freed: the storage goes, and its record
    again = torch.frombuffer(block, dtype=torch.uint8)
    assert again.data_ptr() == addr             # the same address, other memory
    assert host_maps.registered_device_address(addr) is None
    assert plat.host_device_address(again, "npu") is None
    m = RowMap.from_stacked(again.view(4, 16, 1024), 1)
    assert not host_maps.npu_reachable(m)
    with pytest.raises(KvtierError, match="not registered"):
        host_maps.translate(m, torch.device("cpu"))
    assert addr not in host_maps._registered


def test_a_registration_answers_only_while_its_storage_is_where_it_was():
    """A storage resized in place moves its bytes: the old registration no longer answers."""
    t = torch.empty(4096, dtype=torch.uint8)
    start = t.data_ptr()
    host_maps.register_host_memory(t, 0x6000_0000)
    assert host_maps.registered_device_address(start + 8) == 0x6000_0000 + 8
    t.untyped_storage().resize_(1 << 24)        # moved (a new allocation)
    if t.untyped_storage().data_ptr() != start:
        assert host_maps.registered_device_address(start + 8) is None
    assert host_maps.registered_device_address(t.data_ptr()) is None
