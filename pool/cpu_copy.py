"""CPU copies of a device pool (KV offload while the engine sleeps): chunks of indices,
each gathered by one launch per component group into a contiguous device buffer and
moved across in one copy; loading reverses it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from kvtier.kernels import faults
from kvtier.errors import fail
from kvtier.kernels.launcher import direct_launches
from kvtier.kernels.index_check import Checks, check_launch, checks_on
from kvtier.kernels.validate import check_index, is_int
from kvtier.kernels.ops import GATHER, SCATTER

from .gather import group_shape, move_groups


@dataclass
class CpuCopy:
    """What `get_cpu_copy` returns: for each chunk of at most ``chunk_size`` indices, one
    CPU tensor ``(C, L, k, *row)`` per component group (``groups`` names them)."""

    groups: Tuple[Tuple[str, ...], ...]
    chunk_size: int
    num_indices: int
    chunks: List[List[torch.Tensor]]


def get_cpu_copy(pool, indices: torch.Tensor, chunk_size: int = 8192) -> CpuCopy:
    if not is_int(chunk_size) or chunk_size <= 0:
        raise fail("chunk_size", chunk_size, "must be a positive int")
    check_index("indices", indices, pool.index_device)
    verdict = _checked(pool, indices)
    chunks = []
    for start in range(0, indices.numel(), chunk_size):
        part = indices[start:start + chunk_size]
        bufs = [torch.empty(*group_shape(pool, names, part.numel(), False), dtype=pool.components[names[0]].dtype,
                            device=pool.device) for names, _ in pool.groups]
        move_groups(pool, part, bufs, False, GATHER, verdict, into_pool=False)
        chunks.append([b.to("cpu") for b in bufs])
    return CpuCopy(tuple(names for names, _ in pool.groups), chunk_size, indices.numel(), chunks)


def _checked(pool, indices: torch.Tensor):
    """One check launch of the whole list before the first chunk moves (a bad list moves
    no chunk): its verdict, which every chunk's copies read; None with checks off.
    Where the check has run already (the CPU) its failure is raised here."""
    if not checks_on(pool.check) or not indices.numel():
        return None
    faults.raise_pending()
    checks = Checks(("indices", pool.size, 1), ("indices", pool.size, 1))
    words = check_launch(pool.device, checks, indices, indices, direct=direct_launches())
    if pool.device.type == "cpu":
        faults.raise_pending(this_call=True)
    return words


def load_cpu_copy(pool, copy: CpuCopy, indices: torch.Tensor) -> None:
    """Write ``copy`` back at ``indices``. Every chunk tensor is checked completely (a
    tensor, its shape, dtype, CPU device and contiguity) before the first byte moves; an
    error names ``copy.chunks[k][g]`` (chunk k, component group g) and the value."""
    check_index("indices", indices, pool.index_device)
    if not isinstance(copy, CpuCopy):
        raise fail("copy", type(copy).__name__, "must be what get_cpu_copy returned")
    groups = tuple(names for names, _ in pool.groups)
    if copy.groups != groups:
        raise fail("copy.groups", copy.groups, f"this pool's component groups are {groups}")
    if not is_int(copy.chunk_size) or copy.chunk_size <= 0:
        raise fail("copy.chunk_size", copy.chunk_size, "must be a positive int")
    if not is_int(copy.num_indices) or copy.num_indices < 0:
        raise fail("copy.num_indices", copy.num_indices, "must be a non-negative int")
    if copy.num_indices != indices.numel():
        raise fail("indices", f"{indices.numel()} indices", f"the copy holds {copy.num_indices}")
    expect = -(-copy.num_indices // copy.chunk_size)
    if not isinstance(copy.chunks, (list, tuple)) or len(copy.chunks) != expect:
        got = len(copy.chunks) if isinstance(copy.chunks, (list, tuple)) else type(copy.chunks).__name__
        raise fail("copy.chunks", got, f"must be a list of {expect} chunks of {len(groups)} tensors")
    cpu = torch.device("cpu")
    for k, chunk in enumerate(copy.chunks):   # check every chunk before any byte moves
        if not isinstance(chunk, (list, tuple)) or len(chunk) != len(groups):
            got = f"{len(chunk)} tensors" if isinstance(chunk, (list, tuple)) else type(chunk).__name__
            raise fail(f"copy.chunks[{k}]", got, f"must be a list of {len(groups)} tensors, one per "
                       f"component group {groups}")
        n = min(copy.chunk_size, copy.num_indices - k * copy.chunk_size)
        for g, (names, t) in enumerate(zip(groups, chunk)):
            arg = f"copy.chunks[{k}][{g}]"
            if not isinstance(t, torch.Tensor):
                raise fail(arg, type(t).__name__, "must be a torch.Tensor")
            want, dtype = group_shape(pool, names, n, False), pool.components[names[0]].dtype
            got = (tuple(t.shape), t.dtype, str(t.device))
            if tuple(t.shape) != want or t.dtype != dtype:
                raise fail(arg, got, f"must be {want} {dtype} for component group {names}")
            if t.device != cpu:
                raise fail(arg, got, "must be on the CPU, as get_cpu_copy returns it")
            if not t.is_contiguous():
                raise fail(arg, (*got, f"strides {t.stride()}"), "must be contiguous")
    verdict = _checked(pool, indices)
    for k, chunk in enumerate(copy.chunks):
        start = k * copy.chunk_size
        move_groups(pool, indices[start:start + copy.chunk_size], [t.to(pool.device) for t in chunk], False,
                    SCATTER, verdict, into_pool=True)
