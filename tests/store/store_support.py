"""Builders shared by the store tests (no tests here): host pools of every kind and
layout filled with random bytes, the canonical payload of a page written as plain
indexing of the host layout (independent of the row maps under test), and poison."""
from __future__ import annotations

import torch

from pool_support import DeviceCase, HostCase, host_layer_view, pages_to_slots  # noqa: F401
from kvtier.kernels.layouts import NAMES as LAYOUTS  # noqa: F401
from kvtier.store.page import Geometry

PAGE = 4
POISON = 0xA5
# Kinds: MHA (K, V), MHA with V of another width and an indexer of fewer layers,
# MLA whole rows, MLA latent + rope split with an indexer.
KINDS = ("mha", "mha_v_indexer", "mla", "mla_split_indexer")


def host_case(kind: str, layout: str, pages: int = 12, layers: int = 3, gen=None, **kw) -> HostCase:
    """A host pool of ``kind`` in ``layout`` holding ``pages`` pages of random bytes."""
    dev = DeviceCase(kind, "layers", PAGE, layers=layers, size=4 * PAGE)
    hc = HostCase(dev.pool, layout, "auto", size_tokens=pages * PAGE, **kw)
    fill_random(hc.host, gen or torch.Generator().manual_seed(hash((kind, layout)) % 2**31))
    return hc


def fill_random(host, gen) -> None:
    for b in host.buffers.values():
        flat = b.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def poison(host) -> None:
    for b in host.buffers.values():
        b.view(-1).view(torch.uint8).fill_(POISON)


def canonical(host, slot: int) -> bytes:
    """The canonical payload of the page starting at host slot ``slot``: components in
    the geometry's order, then layers, then the page's token rows."""
    P, page = host.page_size, slot // host.page_size
    out = []
    for c in Geometry.of(host).components:
        for layer in range(c.num_layers):
            rows = host_layer_view(host.buffers[c.name], host.layout, layer, P)[page]
            out.append(rows.reshape(-1).clone())
    return torch.cat(out).numpy().tobytes()


def slots(pages) -> torch.Tensor:
    return pages_to_slots(pages, PAGE)


def assert_pages(host, dst_pages, originals) -> None:
    """Pages ``dst_pages`` hold ``originals`` (get_page bytes); every other page is poison."""
    for q in range(host.size // PAGE):
        page = host.get_page(q * PAGE)
        if q in dst_pages:
            assert torch.equal(page, originals[dst_pages.index(q)]), f"page {q} differs"
        else:
            assert bool((page == POISON).all()), f"page {q} was written"
