"""Page-major device layers through SGLang's calls: HND ``(pages, H, P, D)`` layers
(SGLANG_USE_HND_KVCACHE) and a ROCm-style vectorized 5-D layer. SGLang's kernels address
row ``i`` at ``data_ptr + i * item_size`` whatever the shape; whole pages then move
byte-exact, so a backup followed by a load restores every device byte, and indices that
are not whole pages are refused."""
import pytest
import torch

from test_adapter_model import needs_cpu_kernel
import kvtier.adapters as adapters
from kvtier.kernels import KvtierError

P, H, D, PAGES, HOST_PAGES = 4, 2, 8, 6, 5
ITEM = H * D * 2        # bf16 bytes of one token's row


def layer(shape_kind, gen):
    data = torch.randint(-30000, 30000, (PAGES * P * H * D,), generator=gen, dtype=torch.int16)
    if shape_kind == "hnd":
        return data.view(torch.bfloat16).view(PAGES, H, P, D)
    return data.view(torch.bfloat16).view(PAGES, H, D // 4, P, 4)     # vectorized: 4-element groups


POISON = 0x5A5A


def bytes_of(t):
    return t.contiguous().view(torch.uint8).view(-1)


@needs_cpu_kernel
@pytest.mark.parametrize("shape_kind", ["hnd", "vectorized"])
def test_whole_pages_round_trip_byte_exact(shape_kind):
    """Backup moves exactly the chosen device pages' bytes into the chosen host pages and
    touches no other host byte (poisoned, with a poisoned margin after the buffer); the
    load back restores every device byte."""
    gen = torch.Generator().manual_seed(7)
    dev_k, dev_v = layer(shape_kind, gen), layer(shape_kind, gen)
    margin = 64
    host_raw = [torch.full((HOST_PAGES * P * H * D + margin,), POISON, dtype=torch.int16) for _ in "kv"]
    host_k, host_v = (r[:HOST_PAGES * P * H * D].view(torch.bfloat16).view(HOST_PAGES * P, H, D)
                      for r in host_raw)                                   # SGLang's layer_first host layer
    dev_pages, host_pages = [4, 1], [0, 3]
    slots = lambda pages: torch.tensor([p * P + i for p in pages for i in range(P)])  # noqa: E731
    before_k, before_v = dev_k.clone(), dev_v.clone()
    adapters.transfer_kv_per_layer(dev_k, host_k, dev_v, host_v, slots(dev_pages), slots(host_pages), ITEM)
    page_bytes = P * ITEM
    for dev, raw in ((dev_k, host_raw[0]), (dev_v, host_raw[1])):
        want = torch.full_like(raw, POISON).view(torch.uint8)
        for d, h in zip(dev_pages, host_pages):
            want[h * page_bytes:(h + 1) * page_bytes] = bytes_of(dev[d])
        assert torch.equal(raw.view(torch.uint8), want)        # chosen pages moved, nothing else
    for t in (dev_k, dev_v):
        t.view(torch.int16)[[4, 1]] = 0                     # clear the pages, then load them back
    adapters.transfer_kv_per_layer(host_k, dev_k, host_v, dev_v, slots(host_pages), slots(dev_pages), ITEM)
    assert torch.equal(bytes_of(dev_k), bytes_of(before_k)) and torch.equal(bytes_of(dev_v), bytes_of(before_v))


@needs_cpu_kernel
def test_page_major_layers_take_whole_pages_only():
    gen = torch.Generator().manual_seed(8)
    dev_k, dev_v = layer("hnd", gen), layer("hnd", gen)
    host_k = torch.full((HOST_PAGES * P, H, D), POISON, dtype=torch.int16).view(torch.bfloat16)
    host_v = host_k.clone()
    before = host_k.clone()
    with pytest.raises(KvtierError, match=r"src_indices=5: not a whole page"):
        adapters.transfer_kv_per_layer(dev_k, host_k, dev_v, host_v, torch.tensor([4, 5, 6, 7, 8, 5, 6, 7]),
                                       torch.arange(8), ITEM)
    assert torch.equal(host_k.view(torch.int16), before.view(torch.int16))
