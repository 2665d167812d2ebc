"""A per-layer load and an all-layer backup can be captured in a CUDA graph and replayed:
no sync and no allocation inside the call once it has run on the capture stream (its
index-check slot, launch plans and configuration are made on the first call).
Needs an NVIDIA GPU (`cuda` marker)."""
import pytest
import torch

from kvtier.pool import HostPool, MHADevicePool

pytestmark = pytest.mark.cuda


def _pools():
    dev = MHADevicePool(256, 16, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    host = HostPool(dev, layout="page_first_direct", size_tokens=512, strategy="kernel")
    return dev, host


def test_per_layer_load_and_backup_replay_from_a_graph():
    dev, host = _pools()
    dev_idx = torch.arange(32, 64, device="cuda")
    host_idx = host.alloc(32).cuda()          # device-resident host indices: nothing to stage
    new_idx = torch.arange(128, 160, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):           # first calls: compile, plan, make the check slot
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        host.load_to_device_per_layer(dev, host_idx, new_idx, 1)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
        for layer in range(4):
            host.load_to_device_per_layer(dev, host_idx, new_idx, layer)
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.view(-1, 2, 64)[new_idx] = 0
    graph.replay()
    torch.cuda.synchronize()
    host.synchronize()
    for t in dev.buffers["k"] + dev.buffers["v"]:
        rows = t.view(-1, 2, 64)
        assert torch.equal(rows[new_idx].view(torch.int16), rows[dev_idx].view(torch.int16))


def test_a_replay_checks_the_indices_as_they_are_then():
    """Checks are captured, not reused from the calls before the capture: indices rewritten
    in place between replays are checked again; a bad list moves nothing and is reported."""
    dev, host = _pools()
    dev_idx = torch.arange(32, 64, device="cuda")
    host_idx = host.alloc(32).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        host.backup_from_device_all_layer(dev, host_idx, dev_idx)
    before = {n: b.clone() for n, b in host.buffers.items()}
    dev_idx[5] = 10 ** 6                       # out of range, written in place
    for t in dev.buffers["k"] + dev.buffers["v"]:
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(Exception, match="1000000"):
        host.synchronize()
    assert all(torch.equal(host.buffers[n].view(torch.uint8), before[n].view(torch.uint8)) for n in before)
