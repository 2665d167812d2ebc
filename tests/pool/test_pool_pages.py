"""HostPool page access: get_page/set_page and get_page_buffer_meta on every layout."""
import pytest
import torch

from kvtier.kernels import KvtierError, LAYOUTS
from pool_support import DeviceCase, HostCase, assert_same, host_rows, pages_to_slots, put_host_rows


def _filled_host(kind, layout, P=4):
    dev = DeviceCase(kind, "stacked", P, size=16, layers=2)
    hc = HostCase(dev.pool, layout, "kernel", size_tokens=24)
    g = torch.Generator().manual_seed(3)
    for _, _, buf in hc.host.groups:   # random bytes everywhere, not poison
        b = buf.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))
    return dev, hc


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha_v_indexer", "mla_split_indexer"])
def test_get_page_then_set_page_copies_exactly_one_page(kind, layout):
    P = 4
    dev, hc = _filled_host(kind, layout, P)
    host = hc.host
    flat = host.get_page(8)
    assert flat.dtype == torch.uint8 and flat.shape == (host.page_bytes,)
    before = hc.snapshot()
    host.set_page(16, flat)
    src, dst = pages_to_slots([2], P), pages_to_slots([4], P)
    want = {n: b.clone() for n, b in before.items()}
    for name, c in host.components.items():
        for l in range(c.num_layers):
            put_host_rows(want[name], layout, l, P, dst, host_rows(before[name], layout, l, P, src))
    assert_same(host.buffers, want, "host after set_page")
    assert torch.equal(host.get_page(16), flat)
    for bad, match in [(lambda: host.get_page(5), "index=5"), (lambda: host.get_page(24), "index=24"),
                       (lambda: host.set_page(4, flat[:-1]), "data"),
                       (lambda: host.set_page(4, flat.view(torch.int8)), "data")]:
        with pytest.raises(KvtierError, match=match):
            bad()
    assert_same(host.buffers, want, "host after bad calls")
    hc.check_margins()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_buffer_meta_covers_each_page_exactly(layout):
    P = 4
    dev, hc = _filled_host("mha_v_indexer", layout, P)
    host = hc.host
    idx = pages_to_slots([3, 0], P)
    ptrs, sizes = host.get_page_buffer_meta(idx)
    # Read the regions back through their addresses: page by page they are get_page's bytes.
    storages = [(buf.untyped_storage(), buf) for _, _, buf in host.groups]
    pieces = []
    for ptr, size in zip(ptrs, sizes):
        st = next(s for s, _ in storages if s.data_ptr() <= ptr < s.data_ptr() + s.nbytes())
        raw = torch.empty(0, dtype=torch.uint8).set_(st)
        pieces.append(raw[ptr - st.data_ptr():ptr - st.data_ptr() + size])
    assert sum(sizes) == 2 * host.page_bytes
    assert torch.equal(torch.cat(pieces), torch.cat([host.get_page(12), host.get_page(0)]))
    regions_per_page = len(ptrs) // 2
    # Page-major layouts: one region per component group member; layer_first: one per layer.
    groups = sum(len(names) for names, _, _ in host.groups)
    if layout == "layer_first":
        assert regions_per_page == sum(c.num_layers for c in host.components.values())
    else:
        assert regions_per_page == groups
    with pytest.raises(KvtierError, match="indices"):
        host.get_page_buffer_meta(torch.tensor([1, 2, 3, 4]))
