"""The storage watch: before a launch, every tensor a kept copy's maps were built on must
still have the storage it had then. A map holds addresses; after ``resize_``, ``set_``
to other memory or a freed storage those addresses point at memory the tensor no longer
owns, so the launch names the tensor (`KvtierError`) instead of writing there.

This runs on every pool and adapter call, for every tensor the call touches (an
all-layer call on per-layer buffers: two per layer), so it is one comparison of tuples
of ``data_ptr()``s. Where torch has its one-call comparison of many tensors' pointers
(CUDA builds: ``torch._C._tensors_data_ptrs_at_indices_equal``, what its CUDA graph
trees check static inputs with), a long watch uses that instead of a Python-level call
per tensor; the per-tensor comparison stays the judge of what changed.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvtier.errors import fail
from .rowmap import RowMap

_DATA_PTR = torch.Tensor.data_ptr
# (tensors: list, data_ptrs: list, indices: list) -> bool; absent from CPU builds.
_SAME_PTRS = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
# Below this many tensors one call per tensor costs less than the batched call's own
# argument conversion.
BATCH_FROM = 8


class Watch(NamedTuple):
    """The tensors a launch rests on, their data_ptr() when their maps were built, and
    their names for errors (from `RowMap.watch`; joined with +). ``lists``: the same as
    the lists the batched comparison takes, for a watch of at least `BATCH_FROM`
    tensors where torch has it, else None."""

    tensors: tuple
    ptrs: tuple
    names: tuple
    lists: Optional[tuple] = None

    def __add__(self, other: "Watch") -> "Watch":
        return make(self.tensors + other.tensors, self.ptrs + other.ptrs, self.names + other.names)


def make(tensors: tuple, ptrs: tuple, names: tuple) -> Watch:
    lists = None
    if _SAME_PTRS is not None and len(tensors) >= BATCH_FROM:
        lists = (list(tensors), list(ptrs), list(range(len(tensors))))
    return Watch(tensors, ptrs, names, lists)


def watch(m: RowMap, start: int, count: int) -> Watch:
    """`RowMap.watch` of layers start .. start+count-1, as a `Watch`."""
    picked = m.watch(start, count)
    return make(*(tuple(x) for x in zip(*picked))) if picked else Watch((), (), ())


def check_storage(watch: Watch) -> None:
    """Raise `KvtierError` naming the first watched tensor (`RowMap.watch`) whose storage
    is no longer the one its map was built on (resized, ``set_`` elsewhere, freed)."""
    lists = watch.lists
    if lists is not None:
        try:
            if _SAME_PTRS(*lists):
                return
        except (RuntimeError, TypeError):   # a tensor without storage: the loop below names it
            pass
    elif tuple(map(_DATA_PTR, watch.tensors)) == watch.ptrs:
        return
    for t, ptr, arg in zip(watch.tensors, watch.ptrs, watch.names):
        if t.data_ptr() != ptr:
            raise fail(arg, tuple(t.shape), "no longer has the storage its map was built on (the "
                       "tensor was resized, set_ to other memory or its storage freed): build the "
                       "map, pool or call's buffers again")
