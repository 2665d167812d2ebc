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

from kvtier.errors import as_arg, fail
from kvtier.kernels import RowMap, faults
from kvtier.kernels.validate import is_int

from .gather import gather as _gather, scatter as _scatter
from .tuning import FixedConfig
from .spec import Component, check_bool, check_positive
from kvtier import caches

Buffers = Dict[str, Union[torch.Tensor, Sequence[torch.Tensor]]]


caches.declare("pool.device.DevicePool.gathers", key="op, page mode, page indices, slot count",
               value="GroupCopies (a prepared Transfer over buffer templates; no buffer held)", bound="16 per pool",
               rule="a call's buffers that do not fit the templates; the tuning epoch (the Transfer resolves again)",
               stale="not happen: every call's buffers are checked and their addresses read per call")
caches.declare("pool.device.DevicePool.gather_specs", key="page mode, slot count",
               value="group buffer shapes and dtypes", bound="64 per pool", stale="-")


class DevicePool:
    """Rows of several components over ``size`` token slots, ``page_size`` per page.

    Build one with a subclass (`MHADevicePool`, `MLADevicePool`), which allocates, or
    adopt an engine's tensors with their ``from_layers`` / ``from_stacked``
    classmethods; the engine keeps ownership of that memory.
    """

    # The configuration every gather and scatter launches with (None: the tuned one).
    config = FixedConfig()

    def __init__(self, buffers: Buffers, page_size: int, *, start_layer: int = 0,
                 paged_dims: bool = False, _args: Optional[Dict[str, str]] = None):
        # _args: the caller's argument name per component (from_layers: "k_layers"), so
        # that an error names what the caller passed.
        check_positive(page_size=page_size)
        if not is_int(start_layer) or start_layer < 0:
            raise fail("start_layer", start_layer, "must be a non-negative int")
        check_bool("paged_dims", paged_dims)
        if not isinstance(buffers, dict) or not buffers:
            raise fail("buffers", buffers if isinstance(buffers, dict) else type(buffers).__name__,
                       "must be a non-empty dict {component name: tensor or list of per-layer tensors}")
        args = {n: (_args or {}).get(n, f"buffers[{n!r}]") for n in buffers}
        for name, b in buffers.items():
            if not isinstance(name, str):
                raise fail("buffers", name, "component names must be str")
            if not isinstance(b, (torch.Tensor, list, tuple)):
                raise fail(args[name], type(b).__name__,
                           "must be a stacked tensor or a list of per-layer tensors")
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
                m = as_arg(args[name], RowMap.from_stacked, b, page_size, paged_dims)
            else:
                m = as_arg(args[name], RowMap.from_layers, list(b), page_size, paged_dims)
            first = b[0]
            self.maps[name] = m
            self.components[name] = Component(name, m.num_layers, tuple(first.shape[tok_dims:]), first.dtype)
        first = next(iter(self.maps.values()))
        for name, m in self.maps.items():
            if (m.num_rows, m.device) != (first.num_rows, first.device):
                raise fail(args[name], (m.num_rows, str(m.device)),
                           f"differs from the first component's {(first.num_rows, str(first.device))} "
                           "(token slots, device)")
            if m.num_layers > first.num_layers:   # per-layer calls reach layers < num_layers only
                raise fail(args[name], f"{m.num_layers} layers",
                           f"more than the first component's {first.num_layers}")
        self.size = first.num_rows
        self.device = first.device
        # Where copies touching this pool run, so where their indices must live (an
        # attribute, not a property: every call reads it).
        self.index_device = first.device
        self.num_layers = first.num_layers
        self.groups: List[Tuple[Tuple[str, ...], RowMap]] = group_maps(self.components, self.maps)
        # Whether every group stores a page as one contiguous run (page indices then
        # address the pool directly: pool/gather.py).
        self.page_runs = self.page_size > 1 and all(m.page_contiguous for _, m in self.groups)
        # Index value checks of gather/scatter/CPU copies: None follows KVTIER_CHECK (on).
        self.check: Optional[bool] = None
        self.gathers = caches.bounded("pool.device.DevicePool.gathers", 16)
        self.gather_specs = caches.bounded("pool.device.DevicePool.gather_specs", 64)
        self._component_names = list(self.components)

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
        this thread's calls found."""
        faults.synchronize(self.device)

    # ------------------------------------------------------------------ operations
    def gather(self, indices: torch.Tensor, *, pages: bool = False,
               out: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """All layers' rows at slot (or, with ``pages=True``, page) ``indices``: per
        component one contiguous ``(L, n, *row)`` tensor (``(L, n, P, *row)`` for pages).
        ``out``: what an earlier gather of the same size returned, filled again instead
        of new buffers (no allocation, and its maps and launch plans are kept)."""
        return _gather(self, indices, pages=pages, out=out)

    def scatter(self, indices: torch.Tensor, data: Dict[str, torch.Tensor], *, pages: bool = False) -> None:
        """The reverse of `gather`: write ``data`` back at ``indices``."""
        _scatter(self, indices, data, pages=pages)

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
    def _adopt(cls, buffers: Buffers, page_size: int, start_layer: int, paged_dims: bool,
               args: Optional[Dict[str, str]] = None):
        pool = cls.__new__(cls)
        DevicePool.__init__(pool, buffers, page_size, start_layer=start_layer, paged_dims=paged_dims,
                            _args=args)
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
    if not isinstance(storage, str) or storage not in ("layers", "stacked"):
        raise fail("storage", storage, "must be 'layers' or 'stacked'")
    check_positive(size=size, page_size=page_size)
    if size % page_size:
        raise fail("size", size, f"must be a multiple of page_size={page_size}")
    if factory is not None and not callable(factory):
        raise fail("factory", factory, "must be a callable (shape, dtype) -> tensor, or None")
    user_factory = factory or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device))

    def factory(shape, dtype):
        t = user_factory(shape, dtype)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise fail("factory", got, f"must return a {tuple(shape)} {dtype} tensor")
        return t
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
