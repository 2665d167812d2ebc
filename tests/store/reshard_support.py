"""A model's KV pages as ranks of any TP size hold them (no tests here): the whole
model's rows per layer drawn at random, each rank's host pool filled with the heads it
holds, and a check that a rank's host pages hold exactly the heads they should."""
from __future__ import annotations

import torch

from pool_support import D, DV, DTYPE, DeviceCase, HostCase, host_layer_view
from store_support import PAGE, POISON
from kvtier.store.tier import StoreTier

HEAD_SPLIT = ("k", "v")


def held_heads(heads: int, rank: int, size: int):
    """The first head and the number of heads rank ``rank`` of ``size`` holds."""
    if size <= heads:
        return rank * (heads // size), heads // size
    return rank // (size // heads), 1


class Model:
    """The whole model's rows of ``pages`` pages: for each component and layer a
    ``(pages, P, *row bytes)`` uint8 tensor (head-split components: ``(pages, P, heads,
    head bytes)``), in the shape `host_layer_view` gives a host layer."""

    def __init__(self, kind: str, heads: int, pages: int, layers: int = 3, seed: int = 0, dtype=DTYPE):
        self.kind, self.heads, self.pages, self.layers, self.dtype = kind, heads, pages, layers, dtype
        gen = torch.Generator().manual_seed(seed)
        self.rows = {}
        host = self.rank_host(0, 1, "page_first_direct", pages).host      # the whole model's shapes
        for name, buf in host.buffers.items():
            L = buf.shape[1]
            shape = host_layer_view(buf, "page_first_direct", 0, PAGE).shape
            self.rows[name] = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(L)]

    def rank_host(self, rank: int, size: int, layout: str, pages: int, stage=None) -> HostCase:
        """A poisoned host pool as rank ``rank`` of TP ``size`` holds it; ``stage``:
        the layers (first, count) of a pipeline stage's pool (default: all)."""
        _, local = held_heads(self.heads, rank, size)
        over = {}
        if self.kind.startswith("mha"):
            over = {"k": ((local, D), self.dtype),
                    "v": ((local, DV if self.kind == "mha_v_indexer" else D), self.dtype)}
        layers = self.layers if stage is None else stage[1]
        dev = DeviceCase(self.kind, "layers", PAGE, layers=layers, size=4 * PAGE, **over)
        return HostCase(dev.pool, layout, "auto", size_tokens=pages * PAGE)

    def _want(self, name, layer, rank, size):
        rows = self.rows[name][layer]
        if name in HEAD_SPLIT:
            first, n = held_heads(self.heads, rank, size)
            rows = rows[:, :, first:first + n]
        return rows

    def fill(self, hc: HostCase, rank: int, size: int, host_pages, stage=None) -> None:
        """Model pages 0, 1, ... into host pages ``host_pages`` of rank ``rank`` (of
        the pipeline stage whose pool holds layers ``stage``: (first, count))."""
        for name, buf in hc.host.buffers.items():
            for layer, model_layer in self._layers(name, stage):
                v = host_layer_view(buf, hc.layout, layer, PAGE)
                want = self._want(name, model_layer, rank, size)
                for mp, hp in enumerate(host_pages):
                    v[hp] = want[mp].reshape(v[hp].shape)

    def check(self, hc: HostCase, rank: int, size: int, host_pages, model_pages=None, stage=None) -> None:
        """Host pages ``host_pages`` hold model pages ``model_pages`` (default 0, 1, ...),
        byte for byte; every other host page is still poison; the margins are intact."""
        model_pages = list(range(len(host_pages))) if model_pages is None else list(model_pages)
        for name, buf in hc.host.buffers.items():
            for layer, model_layer in self._layers(name, stage):
                v = host_layer_view(buf, hc.layout, layer, PAGE)
                want = self._want(name, model_layer, rank, size)
                for hp, mp in zip(host_pages, model_pages):
                    assert torch.equal(v[hp], want[mp].reshape(v[hp].shape)), \
                        f"{name} layer {layer}: host page {hp} != model page {mp}"
                others = [p for p in range(v.shape[0]) if p not in set(host_pages)]
                assert bool((v[others] == POISON).all()), f"{name} layer {layer}: a page outside {host_pages} was written"
        hc.check_margins()

    def _layers(self, name, stage):
        """(host layer, model layer) of each layer a pool of ``stage`` holds."""
        first, count = (0, len(self.rows[name])) if stage is None else stage
        return [(j, first + j) for j in range(count)]


def ranks(model: Model, size: int, layout: str, url: str, pages: int, stage=None, **kw):
    """Each rank of TP ``size`` (of the pipeline stage holding layers ``stage``:
    (first, count)): (its host case, its tier)."""
    out = []
    for r in range(size):
        hc = model.rank_host(r, size, layout, pages, stage)
        kw.setdefault("heads", model.heads)
        if stage is not None:
            kw.setdefault("layers", (stage[0], model.layers))
        out.append((hc, StoreTier(hc.host, url, model="org/model", tp=(r, size), **kw)))
    return out
