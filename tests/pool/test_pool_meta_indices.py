"""Meta tensors as index lists: every pool entry point refuses one with a `KvtierError`
naming the argument (a meta tensor has a shape and no values), before any byte moves."""
import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.pool import HostPool, MHADevicePool

F16 = torch.float16
META = torch.arange(8, device="meta")
GOOD = torch.arange(8)


def _pools():
    dev = MHADevicePool(32, 4, 2, 2, 8, dtype=F16, device="cpu")
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    host = HostPool(dev, layout="layer_first", size_tokens=32, pin_memory=False)
    for b in host.buffers.values():
        b.copy_(torch.randn_like(b))
    return dev, host


CALLS = [
    ("host_indices", "backup", lambda d, h, m, g: h.backup_from_device_all_layer(d, m, g)),
    ("device_indices", "backup", lambda d, h, m, g: h.backup_from_device_all_layer(d, g, m)),
    ("host_indices", "load", lambda d, h, m, g: h.load_to_device_all_layer(d, m, g)),
    ("device_indices", "load", lambda d, h, m, g: h.load_to_device_all_layer(d, g, m)),
    ("host_indices", "load_layer", lambda d, h, m, g: h.load_to_device_per_layer(d, m, g, 1)),
    ("device_indices", "load_layer", lambda d, h, m, g: h.load_to_device_per_layer(d, g, m, 1)),
    ("host_indices", "plan", lambda d, h, m, g: h.plan(d, m, g)),
    ("device_indices", "plan", lambda d, h, m, g: h.plan(d, g, m)),
    ("indices", "gather", lambda d, h, m, g: d.gather(m)),
    ("indices", "gather(out=)", lambda d, h, m, g: d.gather(m, out=d.gather(g))),
    ("indices", "scatter", lambda d, h, m, g: d.scatter(m, d.gather(g))),
    ("indices", "gather pages", lambda d, h, m, g: d.gather(m[:2], pages=True)),
]


@pytest.mark.parametrize("arg,name,call", CALLS, ids=[f"{n}-{a}" for a, n, _ in CALLS])
def test_a_meta_index_list_is_named_and_nothing_moves(arg, name, call):
    dev, host = _pools()
    before = [t.clone() for t in dev.buffers["k"] + dev.buffers["v"]] + [b.clone() for b in host.buffers.values()]
    with pytest.raises(KvtierError, match=f"{arg}.device='meta'"):
        call(dev, host, META, GOOD)
    after = dev.buffers["k"] + dev.buffers["v"] + list(host.buffers.values())
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "bytes moved for a meta index list"
    host.load_to_device_all_layer(dev, GOOD, GOOD + 8)        # a good call afterwards works
    dev.synchronize()


def test_a_meta_or_sparse_list_given_to_free_is_named_and_frees_nothing():
    dev, host = _pools()
    held = host.alloc(8)
    for bad, why in ((torch.arange(8, device="meta"), "indices.device='meta'"),
                     (torch.arange(8).to_sparse(), "indices.layout=torch.sparse_coo")):
        with pytest.raises(KvtierError, match=why):
            host.free(bad)
        assert host.available_size() == host.size - 8, "pages freed by a refused call"
    assert host.free(held) == 8


def test_meta_page_bytes_given_to_set_page_are_named_and_nothing_is_written():
    dev, host = _pools()
    before = [b.clone() for b in host.buffers.values()]
    with pytest.raises(KvtierError, match="data.device='meta'"):
        host.set_page(0, torch.zeros(host.page_bytes, dtype=torch.uint8, device="meta"))
    assert all(torch.equal(a, b) for a, b in zip(before, host.buffers.values()))


def test_set_page_takes_strided_bytes_whole():
    """A strided view of the page's bytes writes the whole page (its parts are views of one
    contiguous copy, so no part can fail after another was written)."""
    dev, host = _pools()
    want = torch.randint(0, 256, (2 * host.page_bytes,), dtype=torch.uint8)
    host.set_page(4, want[::2])
    assert torch.equal(host.get_page(4), want[::2])
