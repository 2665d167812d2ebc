"""A per-layer load and an all-layer backup can be captured in a CUDA graph and replayed:
no sync and no allocation inside the call once it has run on the capture stream (its
index-check slot, launch plans and configuration are made on the first call). Host
indices on the CPU are staged by a captured copy from pinned memory; pageable ones and
`dma` calls are refused while capturing. Needs an NVIDIA GPU (`cuda` marker)."""
import pytest
import torch

from kvtier.kernels import KvtierError
from kvtier.pool import HostPool, MHADevicePool

pytestmark = pytest.mark.cuda


def _pools(strategy="kernel"):
    dev = MHADevicePool(256, 16, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    host = HostPool(dev, layout="page_first_direct", size_tokens=512, strategy=strategy)
    return dev, host


def _capture(first, inside) -> torch.cuda.CUDAGraph:
    """``first()`` on a side stream (the first calls compile, plan and make the stream's
    check slot), then ``inside()`` captured in a graph on that stream."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        first()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        inside()
    return graph


def _same_rows(dev, a, b) -> bool:
    return all(torch.equal(t.view(-1, 2, 64)[a].view(torch.int16), t.view(-1, 2, 64)[b].view(torch.int16))
               for t in dev.buffers["k"] + dev.buffers["v"])


def _replay_moves_nothing_and_reports(graph, host, named: str):
    """A replay with a bad index list leaves every host byte as it was, and the pool's
    `synchronize()` raises `KvtierError` naming ``named``."""
    before = {n: b.clone() for n, b in host.buffers.items()}
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(KvtierError, match=named):
        host.synchronize()
    assert all(torch.equal(host.buffers[n].view(torch.uint8), before[n].view(torch.uint8)) for n in before)


def test_per_layer_load_and_backup_replay_from_a_graph():
    dev, host = _pools()
    dev_idx = torch.arange(32, 64, device="cuda")
    host_idx = host.alloc(32).cuda()          # device-resident host indices: nothing to stage
    new_idx = torch.arange(128, 160, device="cuda")

    def first():        # every call as captured, once (docs/pools.md, "CUDA graphs")
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        for layer in range(4):
            host.load_to_device_per_layer(dev, host_idx, new_idx, layer)

    def inside():
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        for layer in range(4):
            host.load_to_device_per_layer(dev, host_idx, new_idx, layer)
    graph = _capture(first, inside)
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.view(-1, 2, 64)[new_idx] = 0
    graph.replay()
    torch.cuda.synchronize()
    host.synchronize()
    assert _same_rows(dev, new_idx, dev_idx)


def test_a_replay_checks_the_indices_as_they_are_then():
    """Checks are captured, not reused from the calls before the capture: indices rewritten
    in place between replays are checked again; a bad list moves nothing and is reported."""
    dev, host = _pools()
    dev_idx = torch.arange(32, 64, device="cuda")
    host_idx = host.alloc(32).cuda()
    backup = lambda: host.backup_from_device_all_layer(dev, host_idx, dev_idx)  # noqa: E731
    graph = _capture(backup, backup)
    dev_idx[5] = 10 ** 6                       # out of range, written in place
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    _replay_moves_nothing_and_reports(graph, host, "device_indices=1000000")


def test_host_indices_in_pinned_cpu_memory_are_read_at_each_replay():
    """Pinned CPU host indices are staged by a copy the graph captures and checked on the
    device, so a replay reads and checks them as they are then; pageable ones are refused
    while capturing (a replay would read a staging block released after the capture)."""
    dev, host = _pools()
    dev_idx, other_idx = torch.arange(32, 64, device="cuda"), torch.arange(96, 128, device="cuda")
    host_idx, pageable = host.alloc(32).pin_memory(), host.alloc(32)

    def first():        # as captured: both lists checked on the device (that check compiled)
        host.backup_from_device_all_layer(dev, host_idx.cuda(), dev_idx)
        host.load_to_device_per_layer(dev, pageable, dev_idx, 0)

    def inside():
        with pytest.raises(KvtierError, match="host_indices='pageable cpu tensor'"):
            host.load_to_device_per_layer(dev, pageable, dev_idx, 1)
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    graph = _capture(first, inside)
    new_slots = host.alloc(32)
    host_idx.copy_(new_slots)                 # rewritten in place after the capture
    graph.replay()
    torch.cuda.synchronize()
    host.synchronize()
    host.load_to_device_all_layer(dev, new_slots.cuda(), other_idx)
    torch.cuda.synchronize()
    assert _same_rows(dev, other_idx, dev_idx)
    host_idx[3] = 10 ** 6                     # out of range, written in place
    _replay_moves_nothing_and_reports(graph, host, "host_indices=1000000")


def test_a_dma_call_is_refused_while_capturing():
    """Its copies are planned from the host indices' values on the host: refused before
    any of them is captured."""
    dev, host = _pools("dma")
    dev_idx, host_idx = torch.arange(32, 64, device="cuda"), host.alloc(32).cuda()

    def inside():
        with pytest.raises(KvtierError, match="strategy='dma': cannot be captured"):
            host.load_to_device_per_layer(dev, host_idx, dev_idx, 1)
    _capture(lambda: host.load_to_device_per_layer(dev, host_idx, dev_idx, 0), inside)
