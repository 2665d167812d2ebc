"""The two ``sgl_kernel.kvcacheio`` names SGLang imports beside the transfer calls of
`kvtier.adapters.sglang`, on kvtier:

- ``get_device_accessible_ptr(tensor, device_index)``: the address a device kernel uses
  for a tensor. SGLang puts it in the host pools' pointer tables (``k_data_ptrs``); on
  ROCm, where registered host memory may carry a device address of its own, SGLang
  refuses to build those tables without it. The tables are read by kvtier's kernel once
  SGLang is routed through kvtier, so the answer is the address kvtier's kernel uses
  (`kvtier.platforms.host_device_address`).
- ``transfer_embedding_ranges_direct(src, dst, src_starts, dst_starts, lengths)``: runs
  of rows (slices along dim 0) ``dst[d:d+n] = src[s:s+n]``, one run per list entry, as
  SGLang's embedding cache and MiniMax NVFP4 host pool issue them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from kvtier.errors import fail
from kvtier.platforms import detect_platform, get, host_device_address

from .sglang import transfer_kv_direct

__all__ = ["get_device_accessible_ptr", "transfer_embedding_ranges_direct"]


def get_device_accessible_ptr(tensor: torch.Tensor, device_index: Optional[int] = None) -> int:
    """The address at which a kernel on this machine's accelerator reaches ``tensor``'s
    first byte: a device tensor's own address; a host tensor's address as the platform
    maps it (pinned or registered memory). Unreachable host memory is an error."""
    if not isinstance(tensor, torch.Tensor):
        raise fail("tensor", type(tensor).__name__, "must be a torch.Tensor")
    if device_index is not None and (not isinstance(device_index, int) or isinstance(device_index, bool)
                                     or device_index < 0):
        raise fail("device_index", device_index, "must be a non-negative int")
    platform = detect_platform()
    addr = host_device_address(tensor, platform)
    if addr is None:
        raise fail("tensor", f"host tensor at {tensor.data_ptr():#x}", get(platform).unreachable)
    return addr


def _runs(arg: str, v) -> list:
    if isinstance(v, torch.Tensor):
        v = v.tolist()  # SGLang passes host lists; a tensor is read once here
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise fail(arg, type(v).__name__, "must be a list of ints")
    return list(v)


def transfer_embedding_ranges_direct(src: torch.Tensor, dst: torch.Tensor, src_starts: Sequence[int],
                                     dst_starts: Sequence[int], lengths: Sequence[int],
                                     *, config=None, check: Optional[bool] = None) -> None:
    """For each run ``j``: ``dst[dst_starts[j] + i] = src[src_starts[j] + i]`` for
    ``i < lengths[j]``, a row being one slice along dim 0 of ``src`` / ``dst``."""
    s, d, n = (_runs(a, v) for a, v in (("src_starts", src_starts), ("dst_starts", dst_starts),
                                          ("lengths", lengths)))
    if not len(s) == len(d) == len(n):
        raise fail("lengths", len(n), f"src_starts has {len(s)} runs, dst_starts {len(d)}; counts must match")
    if any(x < 0 for x in n):
        raise fail("lengths", min(n), "must be >= 0")
    if not sum(n):
        return
    # Row ids of every run, built on the host (the runs are host lists) and moved once.
    starts = torch.tensor([s, d], dtype=torch.int64)
    counts = torch.tensor(n, dtype=torch.int64)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    src_rows, dst_rows = torch.repeat_interleave(starts, counts, dim=1) + offsets
    transfer_kv_direct([src], [dst], src_rows, dst_rows, page_size=1, config=config, check=check)
