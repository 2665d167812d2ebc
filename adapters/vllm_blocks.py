"""vLLM's block ids as kvtier row indices, checked on the host before anything moves.

vLLM's CPU offloading moves GPU blocks to CPU chunks and back. A CPU chunk holds
``factor`` GPU-sized sub-blocks (vLLM's ``blocks_per_chunk``, formerly
``block_size_factor``). A transfer names GPU block ids and CPU chunk ids
(``GPULoadStoreSpec`` / ``CPULoadStoreSpec``: a ``block_ids`` array each), ordered by
KV cache group. The GPU spec says how many GPU blocks each group takes
(``group_sizes``) and the logical index of each group's first block
(``block_indices``): a group's first sub-block sits at ``block_index % factor`` inside
its first chunk, so a group of ``s`` blocks spans ``ceil((s + skip) / factor)`` chunks.

kvtier addresses a GPU block as row ``b`` of a page-size-1 map and sub-block ``j`` of
chunk ``c`` as row ``c * factor + j`` of a map with ``page_size = factor``. This module
turns a spec pair into those two row lists, one slice per group.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from kvtier.errors import fail


def block_ids(arg: str, spec) -> np.ndarray:
    """The spec's ``block_ids`` as a 1-D integer array (no copy where it is one)."""
    ids = getattr(spec, "block_ids", None)
    if ids is None:
        raise fail(arg, type(spec).__name__, "must be a vLLM block-ids spec (an object with block_ids)")
    ids = np.asarray(ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise fail(f"{arg}.block_ids", f"{ids.dtype}{list(ids.shape)}", "must be a 1-D array of integers")
    return ids


def group_layout(arg: str, spec, n_gpu: int, num_groups: int, factor: int,
                 load: bool) -> Tuple[List[int], List[int]]:
    """(sizes, skips) per KV cache group from the GPU spec. Without ``group_sizes`` (older
    vLLM specs) the blocks form one group; without ``block_indices`` a load skips the
    sub-blocks that make the count come out to whole chunks at the end (``-n % factor``),
    as vLLM's earlier handler did, and a store skips none."""
    sizes = getattr(spec, "group_sizes", None)
    sizes = [n_gpu] if sizes is None else [_count(f"{arg}.group_sizes", s) for s in sizes]
    if len(sizes) != num_groups:
        raise fail(f"{arg}.group_sizes", list(sizes), f"must name {num_groups} KV cache group(s)")
    if sum(sizes) != n_gpu:
        raise fail(f"{arg}.group_sizes", list(sizes), f"must add up to its {n_gpu} block ids")
    starts = getattr(spec, "block_indices", None)
    if starts is None:
        skips = [(-s) % factor if load else 0 for s in sizes]
    else:
        if len(starts) != num_groups:
            raise fail(f"{arg}.block_indices", list(starts), f"must name {num_groups} KV cache group(s)")
        skips = [_count(f"{arg}.block_indices", b) % factor for b in starts]
    return sizes, skips


def fill_rows(gpu_arg: str, gpu_ids: np.ndarray, cpu_arg: str, cpu_ids: np.ndarray,
              sizes: Sequence[int], skips: Sequence[int], factor: int, gpu_limits: Sequence[int],
              cpu_limit: int, out_gpu: np.ndarray, out_cpu: np.ndarray) -> List[Tuple[int, int]]:
    """Write each group's GPU rows and CPU sub-block rows into ``out_gpu`` / ``out_cpu``
    (host arrays of at least ``sum(sizes)``); return each group's ``(start, end)`` in them.
    Every id is checked first (against ``gpu_limits[g]`` blocks and ``cpu_limit`` chunks),
    so a bad spec raises before the outputs are touched; what is checked is a copy of the
    ids, from which the rows are made (the spec's arrays are not read again)."""
    gpu_ids, cpu_ids = np.array(gpu_ids, copy=True), np.array(cpu_ids, copy=True)
    chunks = [-(-(s + k) // factor) if s else 0 for s, k in zip(sizes, skips)]
    if sum(chunks) != cpu_ids.size:
        raise fail(f"{cpu_arg}.block_ids", f"{cpu_ids.size} ids",
                   f"the GPU side's groups {list(sizes)} (first sub-block {list(skips)}) "
                   f"span {sum(chunks)} chunk(s) of {factor} block(s)")
    _in_range(cpu_arg, cpu_ids, cpu_limit, "chunks")
    spans, g0, c0 = [], 0, 0
    for s, lim in zip(sizes, gpu_limits):
        _in_range(gpu_arg, gpu_ids[g0:g0 + s], lim, "blocks")
        g0 += s
    g0 = 0
    for s, k, c in zip(sizes, skips, chunks):
        out_gpu[g0:g0 + s] = gpu_ids[g0:g0 + s]
        q = np.arange(k, k + s)
        out_cpu[g0:g0 + s] = cpu_ids[c0 + q // factor].astype(np.int64) * factor + q % factor
        spans.append((g0, g0 + s))
        g0, c0 = g0 + s, c0 + c
    return spans


def _in_range(arg: str, ids: np.ndarray, limit: int, what: str) -> None:
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise fail(f"{arg}.block_ids", lo, "negative block id")
    if hi >= limit:
        raise fail(f"{arg}.block_ids", hi, f"out of range for {limit} {what}")


def _count(arg: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
        raise fail(arg, v, "must hold non-negative integers")
    return int(v)


def refs_or_all(refs: Optional[Sequence[Sequence]], page_bytes: Sequence[int]) -> List[List[Tuple[int, int]]]:
    """vLLM's per-group layer references as ``[(tensor_idx, page_size_bytes), ...]`` per
    group; without them, one group holding every tensor at its full page."""
    if refs is None:
        return [[(i, p) for i, p in enumerate(page_bytes)]]
    if isinstance(refs, (str, bytes)) or not len(refs):
        raise fail("layer_refs_per_group", refs, "must be a non-empty list of per-group reference lists")
    out = []
    for g, group in enumerate(refs):
        items = []
        for r, ref in enumerate(group):
            arg = f"layer_refs_per_group[{g}][{r}]"
            t, p = getattr(ref, "tensor_idx", None), getattr(ref, "page_size_bytes", None)
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < len(page_bytes):
                raise fail(f"{arg}.tensor_idx", t, f"must index the {len(page_bytes)} tensors")
            if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 0 < p <= page_bytes[t]:
                raise fail(f"{arg}.page_size_bytes", p, f"must be in 1..{page_bytes[t]} (tensor {t}'s page)")
            items.append((int(t), int(p)))
        out.append(items)
    return out
