"""Builders and plain-torch models shared by the pool tests (no tests here).

Device pools are adopted from guarded tensors filled with random bytes; host pools get
guarded, poisoned buffers through their factory. The models index the original tensors
with plain torch expressions, independent of the row maps under test.
"""
from __future__ import annotations

import pytest
import torch

from helpers import Guarded
from kvtier.pool import HostPool, MHADevicePool, MLADevicePool

H, D, DV = 2, 8, 4            # heads, head_dim, v_head_dim of the MHA variant
RANK, ROPE = 12, 4            # MLA latent and rope widths
IDX_D, IDX_S = 16, 2          # indexer row bytes (uint8) and fp32 scales
DTYPE = torch.float16
KINDS = ("mha", "mha_v_indexer", "mla", "mla_split_indexer")


def rows_of(kind):
    """{name: (row_shape, dtype, layers_fn)}; layers_fn maps the model's layers to the component's."""
    full = lambda L: L
    fewer = lambda L: max(L - 1, 1)
    if kind == "mha":
        return {"k": ((H, D), DTYPE, full), "v": ((H, D), DTYPE, full)}
    if kind == "mha_v_indexer":
        return {"k": ((H, D), DTYPE, full), "v": ((H, DV), DTYPE, full),
                "index_k": ((IDX_D,), torch.uint8, fewer), "index_scale": ((IDX_S,), torch.float32, fewer)}
    if kind == "mla":
        return {"kv": ((1, RANK + ROPE), DTYPE, full)}
    if kind == "dsa":       # MLA with the indexer on every layer (DeepSeek V3.2)
        return {"kv": ((1, RANK + ROPE), DTYPE, full),
                "index_k": ((IDX_D,), torch.uint8, full), "index_scale": ((IDX_S,), torch.float32, full)}
    if kind == "mla_split_indexer":
        return {"latent": ((1, RANK), DTYPE, full), "rope": ((1, ROPE), DTYPE, full),
                "index_k": ((IDX_D,), torch.uint8, fewer), "index_scale": ((IDX_S,), torch.float32, fewer)}
    raise ValueError(kind)


class DeviceCase:
    """A device pool over guarded random tensors, and ``model[name][l]``: the original
    ``(N, *row)`` tensor of each layer."""

    def __init__(self, kind, storage, page_size, layers=3, size=32, start_layer=0, gen=None, **over):
        self.kind, self.storage, self.page_size = kind, storage, page_size
        spec = rows_of(kind)
        for name, (row, dtype) in over.items():
            spec[name] = (row, dtype, spec[name][2])
        self.guards, self.model = [], {}
        pages = size // page_size
        buffers = {}
        if storage == "layers":
            for name, (row, dtype, lf) in spec.items():
                ts = [self._guard((size, *row), dtype, gen) for _ in range(lf(layers))]
                buffers[name] = ts
                self.model[name] = ts
        else:
            # Components with equal rows share one (C, L, pages, P, *row) allocation.
            buckets = {}
            for name, (row, dtype, lf) in spec.items():
                buckets.setdefault((row, dtype, lf(layers)), []).append(name)
            for (row, dtype, L), names in buckets.items():
                t = self._guard((len(names), L, pages, page_size, *row), dtype, gen)
                for i, name in enumerate(names):
                    buffers[name] = t[i]
                    self.model[name] = [t[i][l].reshape(size, *row) for l in range(L)]
        self.pool = _adopt(kind, storage, buffers, page_size, start_layer)
        self.size = size

    def _guard(self, shape, dtype, gen):
        g = Guarded(shape, dtype, gen=gen)
        self.guards.append(g)
        return g.t

    def snapshot(self):
        return {n: [t.clone() for t in ts] for n, ts in self.model.items()}

    def check_margins(self):
        for g in self.guards:
            g.check()


def _adopt(kind, storage, b, page_size, start_layer):
    idx = {n: b[n] for n in ("index_k", "index_scale") if n in b} or None
    paged = storage == "stacked"
    if kind.startswith("mha"):
        make = MHADevicePool.from_layers if storage == "layers" else MHADevicePool.from_stacked
        return make(b["k"], b["v"], page_size, start_layer=start_layer, paged_dims=paged, indexer_buffers=idx)
    make = MLADevicePool.from_layers if storage == "layers" else MLADevicePool.from_stacked
    if "kv" in b:
        return make(b["kv"], page_size, start_layer=start_layer, paged_dims=paged, indexer_buffers=idx)
    rope = {"rope_layers" if storage == "layers" else "rope": b["rope"]}
    return make(b["latent"], page_size, start_layer=start_layer, paged_dims=paged, indexer_buffers=idx, **rope)


class HostCase:
    """A host pool whose buffers are guarded and poisoned."""

    def __init__(self, pools, layout, strategy, size_tokens=48, **kw):
        self.guards = []

        def factory(shape, dtype, pin):
            g = Guarded(shape, dtype, fill="poison")
            self.guards.append(g)
            return g.t

        self.host = HostPool(pools, layout=layout, size_tokens=size_tokens, strategy=strategy,
                             factory=factory, **kw)
        self.layout = layout

    def snapshot(self):
        return {n: b.clone() for n, b in self.host.buffers.items()}

    def check_margins(self):
        for g in self.guards:
            g.check()


def host_layer_view(buf, layout, layer, page_size):
    """A ``(pages, P, ...)`` byte view of one layer of one host component, written as plain
    indexing of the layout's dims (layer_first (L,N,*row), page_first (N,L,*row),
    page_first_direct (pages,L,P,*row), page_head (pages,H,P,L,D))."""
    b = buf.view(torch.uint8)
    if layout == "layer_first":
        return b[layer].unflatten(0, (-1, page_size))
    if layout == "page_first":
        return b[:, layer].unflatten(0, (-1, page_size))
    if layout == "page_first_direct":
        return b[:, layer]
    return b[:, :, :, layer, :].transpose(1, 2)


def host_rows(buf, layout, layer, page_size, idx):
    v = host_layer_view(buf, layout, layer, page_size)
    return v[idx // page_size, idx % page_size].reshape(idx.numel(), -1)


def dev_rows(t, idx):
    return t.view(torch.uint8).reshape(t.shape[0], -1)[idx]


def put_host_rows(buf, layout, layer, page_size, idx, rows):
    v = host_layer_view(buf, layout, layer, page_size)
    v[idx // page_size, idx % page_size] = rows.reshape(idx.numel(), *v.shape[2:])


def put_dev_rows(t, idx, rows):
    t.view(torch.uint8).reshape(t.shape[0], -1)[idx] = rows


def moved_dev_rows(before, src_model, idx_from, idx_to, layers=None):
    """The device model after a copy: a copy of ``before`` ({name: per-layer tensors}) with
    rows ``idx_from`` of ``src_model`` written at ``idx_to`` in every layer (or in ``layers``)."""
    want = {n: [t.clone() for t in ts] for n, ts in before.items()}
    for name, ts in want.items():
        for l, t in enumerate(ts):
            if layers is None or l in layers:
                put_dev_rows(t, idx_to, dev_rows(src_model[name][l], idx_from))
    return want


def pages_to_slots(pages, page_size):
    pages = torch.as_tensor(pages, dtype=torch.int64)
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def assert_same(got: dict, want: dict, what: str):
    for n in want:
        g, w = got[n], want[n]
        if isinstance(w, list):
            for l, (a, b) in enumerate(zip(g, w)):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{what}: {n} layer {l} differs"
        else:
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{what}: {n} differs"


def expected_backup(host_case, dev_case, before, hidx, didx, slot_offsets=None):
    """The host buffers after backing up device slots ``didx`` of ``dev_case`` into host
    slots ``hidx`` (``slot_offsets``: host layer offset per component, for drafts)."""
    want = {n: b.clone() for n, b in before.items()}
    P = host_case.host.page_size
    for name, layers in dev_case.model.items():
        off = (slot_offsets or {}).get(name, 0)
        for l, t in enumerate(layers):
            put_host_rows(want[name], host_case.layout, off + l, P, hidx, dev_rows(t, didx))
    return want


def backup_then_load_all(hc, dev, keep, didx, didx2):
    """Back device slots ``didx`` up into host slots ``keep``, then load every layer into
    device slots ``didx2``, each checked byte for byte on both sides. Returns (the device
    bytes before, the host bytes before, the device bytes expected now)."""
    host, original, before = hc.host, dev.snapshot(), hc.snapshot()
    host.backup_from_device_all_layer(dev.pool, keep, didx)
    assert_same(host.buffers, expected_backup(hc, dev, before, keep, didx), "host after backup")
    assert_same(dev.model, original, "device after backup")
    host.load_to_device_all_layer(dev.pool, keep, didx2)
    want = moved_dev_rows(original, original, didx, didx2)
    assert_same(dev.model, want, "device after load_all")
    return original, before, want


@pytest.fixture(autouse=True)
def small_dma_chunks(monkeypatch):
    """(autouse where a test module imports it) dma chunks of two pages of K and V over two
    layers of 32-byte rows in pages of 4, through a staging ring of the test's own: several
    chunks per call."""
    from kvtier.bounded import Bounded
    from kvtier.pool import dma
    monkeypatch.setattr(dma, "_STREAM_STAGING", Bounded(16))
    old = dma.configure(dma.DmaConfig(chunk_bytes=2 * 4 * 2 * 2 * 32))
    yield
    dma.configure(old)
