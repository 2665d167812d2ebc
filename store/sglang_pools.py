"""SGLang's HiCache host pools described to kvtier: a `kvtier.pool.HostPool` over the
pool's own ``kv_buffer``, no byte copied.

SGLang 0.5.23 keeps a host pool's pages in one of kvtier's host layouts, with the same
dimension order (``layer_first`` ``(L, N, *row)``, ``page_first`` ``(N, L, *row)``,
``page_first_direct`` ``(pages, L, P, *row)``, ``page_head`` ``(pages, H, P, L, D)``):

- `MHATokenToKVPoolHost`: K and V in one ``(2, ...)`` tensor, rows ``(H, D)``; every layout.
- `AsymmetricMHATokenToKVPoolHost` (``v_head_dim != head_dim``): K and V in two tensors
  (``kv_buffer`` is the pair); ``page_first`` and ``page_first_direct``.
- `MLATokenToKVPoolHost`: one tensor, rows ``(1, kv_cache_dim)``; ``layer_first``,
  ``page_first``, ``page_first_direct``.

So the pool is adopted as it is: a device pool of one page describes the rows (kvtier's
`MHADevicePool` / `MLADevicePool` adopting empty one-page tensors: components, row
shapes, dtype, layer count), and `HostPool` is built with a ``factory`` that hands it
SGLang's tensors instead of allocating. The host pool then has kvtier's row maps over
SGLang's memory, and the store tier's canonical conversion works on it unchanged: a page
object written here is the object kvtier's own `StoreTier` writes for a pool of the same
geometry, whatever either side's layout.

Anything else is refused by name: other pool classes (the MXFP8 pool, whose scales live
outside ``kv_buffer``; K-only, HiSparse, DeepSeek V4, Mamba, indexer pools),
``page_unified`` (K and V inside each layer, no ``--hicache-mem-layout`` choice),
``page_first_kv_split`` (Ascend), an allocator-only MLA pool (no ``kv_buffer``), a DCP
pool, and a buffer whose shape or dtype is not the one its layout implies.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from kvtier.errors import fail
from kvtier.kernels.layouts import host_layout

LAYOUTS = {
    "MHATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct", "page_head"),
    "AsymmetricMHATokenToKVPoolHost": ("page_first", "page_first_direct"),
    "MLATokenToKVPoolHost": ("layer_first", "page_first", "page_first_direct"),
}


def pool_kind(pool) -> str:
    """The SGLang class of ``pool`` kvtier adopts ("MHATokenToKVPoolHost", ...), or a
    `KvtierError` naming the class. Exact classes only: a subclass may keep bytes outside
    ``kv_buffer`` (the MXFP8 pool's scales)."""
    cls = type(pool)
    name = cls.__name__
    module = cls.__module__
    if name not in LAYOUTS or not module.startswith("sglang.srt.mem_cache."):
        supported = ", ".join(sorted(LAYOUTS))
        raise fail("mem_pool_host", f"{module}.{name}",
                   f"kvtier's HiCache backend stores pages of SGLang's {supported} only")
    return name


def check_pool(pool) -> Tuple[str, str]:
    """(kind, layout) of a pool kvtier can adopt; a `KvtierError` naming what is not."""
    kind = pool_kind(pool)
    layout = getattr(pool, "layout", None)
    if layout not in LAYOUTS[kind]:
        raise fail("mem_pool_host.layout", layout,
                   f"{kind} pages are stored from layouts {list(LAYOUTS[kind])}; "
                   "choose one with --hicache-mem-layout")
    if getattr(pool, "dcp_size", 1) != 1:
        raise fail("mem_pool_host.dcp_size", pool.dcp_size,
                   "decode context parallelism is not supported (SGLang refuses it for "
                   "third-party L3 backends)")
    if getattr(pool, "kv_buffer", None) is None:
        raise fail("mem_pool_host.kv_buffer", None,
                   "an allocator-only host pool holds no pages to store")
    for i, t in enumerate(buffers(pool, kind)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
            got = (tuple(t.shape), str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise fail(f"mem_pool_host.kv_buffer[{i}]", got, "must be a contiguous CPU tensor")
    return kind, layout


def buffers(pool, kind: str) -> List[torch.Tensor]:
    """The pool's tensors, one per kvtier host group: ``[kv_buffer]``, or ``[k, v]``
    for the asymmetric MHA pool."""
    kv = pool.kv_buffer
    if kind == "AsymmetricMHATokenToKVPoolHost":
        return list(kv) if isinstance(kv, (tuple, list)) else [kv]
    return [kv]


def describe(pool, kind: str):
    """A kvtier device pool of one page holding ``pool``'s components (rows, dtype,
    layers): the description `HostPool` reads, over tensors no copy ever touches."""
    from kvtier.pool import MHADevicePool, MLADevicePool

    P, L, dtype = pool.page_size, pool.layer_num, pool.dtype
    if kind == "MLATokenToKVPoolHost":
        row = pool.kv_buffer.shape[-1]           # kv_cache_dim, or a packed fp8 row's width
        return MLADevicePool.from_stacked(torch.empty((L, P, 1, row), dtype=dtype), P)
    H = pool.head_num
    k = torch.empty((L, P, H, pool.head_dim), dtype=dtype)
    v = torch.empty((L, P, H, pool.v_head_dim), dtype=dtype)
    return MHADevicePool.from_stacked(k, v, P)


def adopt(pool):
    """A `kvtier.pool.HostPool` over ``pool``'s own memory (module doc)."""
    from kvtier.pool import HostPool

    kind, layout = check_pool(pool)
    device_pool = describe(pool, kind)
    lay = host_layout(layout)
    # HostPool asks its factory for one (components, *layout shape) tensor per group of
    # components with equal rows, in component order: K and V together (MHA), K then V
    # (asymmetric MHA), the MLA row. Each is checked here, before HostPool is built.
    comps = list(device_pool.components.values())
    groups = [comps] if kind == "MHATokenToKVPoolHost" else [[c] for c in comps]
    given = buffers(pool, kind)
    if len(given) != len(groups):
        raise fail("mem_pool_host.kv_buffer", f"{len(given)} tensors", f"{kind} keeps {len(groups)}")
    tensors = []
    for i, (t, group) in enumerate(zip(given, groups)):
        c = group[0]
        want = lay.shape(layers=c.num_layers, slots=pool.size, page_size=pool.page_size, row_shape=c.row_shape)
        want = (len(group), *want) if len(group) > 1 else want
        if tuple(t.shape) != want or t.dtype != c.dtype:
            raise fail(f"mem_pool_host.kv_buffer[{i}]", (tuple(t.shape), str(t.dtype)),
                       f"a {layout} {kind} of {pool.size} slots, {c.num_layers} layers and rows "
                       f"{c.row_shape} is {want} {c.dtype}")
        tensors.append(t if len(group) > 1 else t.unsqueeze(0))
    handed = iter(tensors)
    host = HostPool(device_pool, layout=layout, size_tokens=pool.size, pin_memory=False,
                    factory=lambda shape, dtype, pin: next(handed))
    if host.size != pool.size or len(host.groups) != len(tensors):
        raise fail("mem_pool_host", f"{kind}, {pool.size} slots",
                   f"kvtier described {host.size} slots in {len(host.groups)} buffers")
    return host


def scratch(pool, pages: int):
    """A kvtier `HostPool` of ``pages`` pages with ``pool``'s geometry and layout, in
    memory of its own (the legacy calls' flat pages pass through it)."""
    from kvtier.pool import HostPool

    kind, layout = check_pool(pool)
    return HostPool(describe(pool, kind), layout=layout, size_tokens=pages * pool.page_size, pin_memory=False)
