"""Pool points: the transfer as an engine makes it, through kvtier's pools.

The workload's device tensors are adopted by an MHA (K, V) or MLA (one row) device pool,
and a `HostPool` in the workload's layout is built over the workload's own host buffer,
so the pool moves exactly the bytes the other engines move. Backup and loads go through
HiCache's method names with the pool's strategy ("kernel" or "dma"); gather is the
device pool's `gather` (which returns a new buffer per call, as engines use it).
"""
from __future__ import annotations

import torch

from kvtier.kernels import RowMap

from .probe import LaunchProbe, NoKernel
from .workload import HEAD_BYTES, Prepared, Transfer, Unsupported, Workload


def row_shape(row_bytes: int):
    """(heads, head bytes): 128-byte heads where the row splits into them (page_head
    needs heads), else one head of the whole row (MLA's 576 and 656 B)."""
    return (row_bytes // HEAD_BYTES, HEAD_BYTES) if row_bytes % HEAD_BYTES == 0 else (1, row_bytes)


def device_pool(w: Workload):
    from kvtier.pool import MHADevicePool, MLADevicePool
    s = w.shape
    layers = [[t.view(s.tokens, *row_shape(s.row_bytes)) for t in comp] for comp in w.device_layers]
    if s.components == 2:
        return MHADevicePool.from_layers(layers[0], layers[1], s.page_size)
    return MLADevicePool.from_layers(layers[0], s.page_size)


def host_pool(w: Workload, dev_pool, strategy: str, check: bool = False):
    """A HostPool over the workload's host buffer (viewed in the pool's shape)."""
    from kvtier.pool import HostPool

    def adopt(shape, dtype, pin):
        if w.host.numel() != _numel(shape) or dtype != w.host.dtype:
            raise Unsupported(f"the pool wants a {shape} {dtype} host buffer")
        return w.host.view(shape)

    return HostPool(dev_pool, layout=w.shape.layout, size_tokens=w.shape.tokens, strategy=strategy,
                    check=check, factory=adopt)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def prepare(w: Workload, op: str, *, strategy: str = "kernel", check: bool = False) -> Prepared:
    dev = device_pool(w)
    s, L = w.shape, w.shape.layers
    hi, di = w.host_slots, w.device_slots
    if op == "gather":
        out = {}

        def fn():
            out.update(dev.gather(di))

        def written():
            names = list(out)
            dst = RowMap.stack([RowMap.from_stacked(out[n]) for n in names])
            t = w.transfer(op)
            return Transfer(t.src, t.src_indices, dst, torch.arange(s.tokens, device=w.device), 0, 0, L)

        return Prepared(fn, programs=_programs(fn), written=written)
    host = host_pool(w, dev, strategy, check)
    fn = {"backup": lambda: host.backup_from_device_all_layer(dev, hi, di),
          "load": lambda: host.load_to_device_all_layer(dev, hi, di),
          "load_layer": lambda: host.load_to_device_per_layer(dev, hi, di, L - 1)}[op]
    return Prepared(fn, programs=_programs(fn))


def _programs(fn):
    """Largest grid the call launches (a dry run: nothing is copied)."""
    try:
        with LaunchProbe() as probe:
            fn()
        return probe.programs()
    except NoKernel:
        return None
