"""Device KV pools: the memory an engine's attention kernels read, described once as
row maps so that every transfer is one kernel launch per group of components.

Two storage forms serve every operation:
- "layers": one tensor per layer per component (CUDA style); the maps carry int64
  tables of per-layer base addresses (`pool.tables`).
- "stacked": one ``(L, ...)`` tensor per component (Ascend style), addressed by base and
  strides; no table is built. Components with equal rows allocated in one tensor (K and
  V in ``(2, L, ...)``) share one map and one launch.

A pool may hold a pipeline stage's slice of the model: public methods take model layer
ids ``start_layer .. end_layer - 1``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from kvtier.kernels import RowMap
from kvtier.kernels.errors import fail
from kvtier.kernels.index_check import IndexGuard

from .spec import Component, check_positive

Buffers = Dict[str, Union[torch.Tensor, Sequence[torch.Tensor]]]


class DevicePool:
    """Rows of several components over ``size`` token slots, ``page_size`` per page.

    Build one with a subclass (`MHADevicePool`, `MLADevicePool`), which allocates, or
    adopt an engine's tensors with their ``from_layers`` / ``from_stacked``
    classmethods; the engine keeps ownership of that memory.
    """

    def __init__(self, buffers: Buffers, page_size: int, *, start_layer: int = 0,
                 paged_dims: bool = False):
        check_positive(page_size=page_size)
        if not isinstance(start_layer, int) or start_layer < 0:
            raise fail("start_layer", start_layer, "must be a non-negative int")
        if not buffers:
            raise fail("buffers", buffers, "a pool needs at least one component")
        stacked = {isinstance(b, torch.Tensor) for b in buffers.values()}
        if len(stacked) != 1:
            raise fail("buffers", sorted(buffers), "mixes per-layer lists and stacked tensors")
        self.storage = "stacked" if stacked.pop() else "layers"
        self.page_size = page_size
        self.start_layer = start_layer
        self.buffers = dict(buffers)
        self.maps: Dict[str, RowMap] = {}
        self.components: Dict[str, Component] = {}
        tok_dims = 2 if paged_dims else 1
        for name, b in buffers.items():
            if self.storage == "stacked":
                m = RowMap.from_stacked(b, page_size, paged_dims)
                first = b[0]
            else:
                m = RowMap.from_layers(list(b), page_size, paged_dims)
                first = b[0]
            self.maps[name] = m
            self.components[name] = Component(name, m.num_layers, tuple(first.shape[tok_dims:]), first.dtype)
        first = next(iter(self.maps.values()))
        for name, m in self.maps.items():
            if (m.num_rows, m.device) != (first.num_rows, first.device):
                raise fail(f"buffers[{name!r}]", (m.num_rows, str(m.device)),
                           f"differs from the first component's {(first.num_rows, str(first.device))} "
                           "(token slots, device)")
        self.size = first.num_rows
        self.device = first.device
        self.num_layers = first.num_layers
        self.groups: List[Tuple[Tuple[str, ...], RowMap]] = group_maps(self.components, self.maps)
        # Index value checks of gather/scatter/CPU copies: None follows KVTIER_CHECK (on).
        self.check: Optional[bool] = None
        self.guard = IndexGuard()

    # ------------------------------------------------------------------ description
    @property
    def end_layer(self) -> int:
        return self.start_layer + self.num_layers

    @property
    def tables(self) -> Dict[str, torch.Tensor]:
        """int64 per-layer base addresses per component ("layers" storage; empty when stacked)."""
        return {n: m.table for n, m in self.maps.items() if m.is_table}

    def spec(self) -> List[Component]:
        return list(self.components.values())

    def __repr__(self) -> str:
        comps = ", ".join(f"{c.name}{list(c.row_shape)}x{c.num_layers}L" for c in self.spec())
        return (f"{type(self).__name__}({self.storage}, size={self.size}, page_size={self.page_size}, "
                f"layers {self.start_layer}..{self.end_layer - 1}, {comps}, {self.device})")

    # ------------------------------------------------------------------ checks
    def local_layer(self, layer_id: int, arg: str = "layer_id") -> int:
        """The pool's own index of model layer ``layer_id`` (pipeline stages)."""
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) \
                or not self.start_layer <= layer_id < self.end_layer:
            raise fail(arg, layer_id, f"outside this pool's layers {self.start_layer}..{self.end_layer - 1}")
        return layer_id - self.start_layer

    def synchronize(self) -> None:
        """Wait for the device and raise the first index failure a device-side check of
        this pool's gathers, scatters or CPU copies found."""
        self.guard.synchronize(self.device)

    @property
    def index_device(self) -> torch.device:
        """Where copies touching this pool run, so where their indices must live."""
        return self.device

    # ------------------------------------------------------------------ operations
    def gather(self, indices: torch.Tensor, *, pages: bool = False) -> Dict[str, torch.Tensor]:
        """All layers' rows at slot (or, with ``pages=True``, page) ``indices``: per
        component one contiguous ``(L, n, *row)`` tensor (``(L, n, P, *row)`` for pages)."""
        from .gather import gather
        return gather(self, indices, pages=pages)

    def scatter(self, indices: torch.Tensor, data: Dict[str, torch.Tensor], *, pages: bool = False) -> None:
        """The reverse of `gather`: write ``data`` back at ``indices``."""
        from .gather import scatter
        scatter(self, indices, data, pages=pages)

    def get_cpu_copy(self, indices: torch.Tensor, chunk_size: int = 8192):
        """All components of all layers at ``indices`` on the CPU, in chunks (see `CpuCopy`)."""
        from .cpu_copy import get_cpu_copy
        return get_cpu_copy(self, indices, chunk_size)

    def load_cpu_copy(self, copy, indices: torch.Tensor) -> None:
        """Write a `get_cpu_copy` result back at ``indices``."""
        from .cpu_copy import load_cpu_copy
        load_cpu_copy(self, copy, indices)

    def transfer_layout(self, *, attn_tp_size: int = 1, by_page: bool = True):
        """This side's layout for a prefill-decode transfer (see `TransferLayout`)."""
        from .transfer_layout import transfer_layout
        return transfer_layout(self, attn_tp_size=attn_tp_size, by_page=by_page)

    def check_transfer_layout(self, remote, *, attn_tp_size: int = 1, by_page: bool = True) -> None:
        """Raise `KvtierError` if the receiving side's layout differs from this one's."""
        from .transfer_layout import check_transfer_layout
        check_transfer_layout(self, remote, attn_tp_size=attn_tp_size, by_page=by_page)

    # ------------------------------------------------------------------ adoption
    @classmethod
    def _adopt(cls, buffers: Buffers, page_size: int, start_layer: int, paged_dims: bool):
        pool = cls.__new__(cls)
        DevicePool.__init__(pool, buffers, page_size, start_layer=start_layer, paged_dims=paged_dims)
        return pool


def group_maps(components: Dict[str, Component], maps: Dict[str, RowMap]):
    """Components with equal rows and layer counts whose maps can share a launch (same
    allocation, or tables) become one multi-component map; the rest stay alone."""
    buckets: Dict[tuple, List[str]] = {}
    for c in components.values():
        buckets.setdefault((c.row_shape, c.dtype, c.num_layers), []).append(c.name)
    groups = []
    for names in buckets.values():
        stacked = RowMap.stack([maps[n] for n in names]) if len(names) > 1 else None
        if stacked is not None:
            groups.append((tuple(names), stacked))
        else:
            groups.extend(((n,), maps[n]) for n in names)
    return groups


def allocate(components: Sequence[Component], size: int, page_size: int, storage: str,
             device, factory=None) -> Buffers:
    """Zeroed buffers for ``components`` in ``storage`` form, ``(pages, P, *row)`` per
    layer; components with equal rows share one allocation so that they share a launch."""
    if storage not in ("layers", "stacked"):
        raise fail("storage", storage, "must be 'layers' or 'stacked'")
    check_positive(size=size)
    if size % page_size:
        raise fail("size", size, f"must be a multiple of page_size={page_size}")
    factory = factory or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))
    pages = size // page_size
    buffers: Buffers = {}
    buckets: Dict[tuple, List[Component]] = {}
    for c in components:
        buckets.setdefault((c.row_shape, c.dtype, c.num_layers), []).append(c)
    for (row, dtype, layers), comps in buckets.items():
        if storage == "stacked":
            t = factory((len(comps), layers, pages, page_size, *row), dtype)
            buffers.update({c.name: t[i] for i, c in enumerate(comps)})
        else:  # one allocation per layer, as CUDA engines keep them
            buffers.update({c.name: [factory((pages, page_size, *row), dtype) for _ in range(layers)]
                            for c in comps})
    return {c.name: buffers[c.name] for c in components}
