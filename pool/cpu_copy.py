"""CPU copies of a device pool (KV offload while the engine sleeps): chunks of indices,
each gathered by one launch per component group into a contiguous device buffer and
moved across in one copy; loading reverses it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from kvtier.kernels.errors import fail
from kvtier.kernels.validate import check_index

from .gather import group_shape, gather_groups, scatter_groups, slots_of


@dataclass
class CpuCopy:
    """What `get_cpu_copy` returns: for each chunk of at most ``chunk_size`` indices, one
    CPU tensor ``(C, L, k, *row)`` per component group (``groups`` names them)."""

    groups: Tuple[Tuple[str, ...], ...]
    chunk_size: int
    num_indices: int
    chunks: List[List[torch.Tensor]]


def get_cpu_copy(pool, indices: torch.Tensor, chunk_size: int = 8192) -> CpuCopy:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise fail("chunk_size", chunk_size, "must be a positive int")
    slots, verdict = slots_of(pool, indices, pages=False)
    chunks = []
    for start in range(0, slots.numel(), chunk_size):
        bufs = gather_groups(pool, slots[start:start + chunk_size], False, verdict=verdict)
        chunks.append([b.to("cpu") for b in bufs])
    return CpuCopy(tuple(names for names, _ in pool.groups), chunk_size, slots.numel(), chunks)


def load_cpu_copy(pool, copy: CpuCopy, indices: torch.Tensor) -> None:
    check_index("indices", indices, pool.index_device)
    if not isinstance(copy, CpuCopy):
        raise fail("copy", type(copy).__name__, "must be what get_cpu_copy returned")
    groups = tuple(names for names, _ in pool.groups)
    if copy.groups != groups:
        raise fail("copy.groups", copy.groups, f"this pool's component groups are {groups}")
    if copy.num_indices != indices.numel():
        raise fail("indices", f"{indices.numel()} indices", f"the copy holds {copy.num_indices}")
    expect = -(-copy.num_indices // copy.chunk_size)
    if len(copy.chunks) != expect or any(len(c) != len(groups) for c in copy.chunks):
        raise fail("copy.chunks", len(copy.chunks), f"must be {expect} chunks of {len(groups)} tensors")
    for k, chunk in enumerate(copy.chunks):   # check every chunk before any byte moves
        n = min(copy.chunk_size, copy.num_indices - k * copy.chunk_size)
        for names, t in zip(groups, chunk):
            want = group_shape(pool, names, n, False)
            if tuple(t.shape) != want or t.dtype != pool.components[names[0]].dtype:
                raise fail(f"copy.chunks[{k}]", (tuple(t.shape), t.dtype), f"must be {want}")
    slots, verdict = slots_of(pool, indices, pages=False)
    for k, chunk in enumerate(copy.chunks):
        start = k * copy.chunk_size
        scatter_groups(pool, slots[start:start + copy.chunk_size],
                       [t.to(pool.device) for t in chunk], False, verdict=verdict)
