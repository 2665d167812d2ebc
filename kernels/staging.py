"""Host index lists on the device where the copy runs, found again by their values.

A host pool's host indices live in CPU memory (HiCache passes them so); a copy on an
accelerator reads them from device memory, so each call stages its list there: a
snapshot of the values in page-locked memory, copied to the device without waiting
(torch's caching host allocator keeps the snapshot until the copy has read it). The
last list staged on each device and stream is kept, and a call whose list holds the
same values (compared as bytes, whatever tensor holds them) reuses its device copy: a
layer loop stages its list once. The kept snapshot and copy are kvtier's own: no
later write to the caller's tensor can reach them, and what is kept is a pure function
of the values it is looked up by.

While a CUDA graph is captured, a list is staged inside the graph from the caller's
own page-locked tensor (each replay copies the values it holds then); a pageable one is
refused, naming the argument.
"""
from __future__ import annotations

import torch

import kvtier.platforms as platforms

from kvtier.errors import fail
from kvtier import caches

_LAST = caches.bounded(
    "kernels.staging._LAST", 64, key="device, stream; a hit only where the list's values equal the snapshot's",
    value="kvtier's own page-locked snapshot and its device copy", rule="another list on that stream",
    stale="not happen: compared by value on every call")


def stage(idx: torch.Tensor, device: torch.device, arg: str = "indices") -> torch.Tensor:
    """``idx`` (1-D, any strides) on ``device`` without waiting for it."""
    if idx.device == device:
        return idx
    if platforms.capturing():
        if not idx.is_pinned():
            raise fail(arg, f"pageable {idx.device} tensor", "cannot be staged on the device while a CUDA graph "
                       "is captured (a replay would read a staging block released after the capture): pass "
                       "it on the device, or in pinned memory, which each replay reads as it is then")
        return idx.to(device, non_blocking=True)
    key = (device, None if device.type == "cpu" else platforms.stream_key(device))
    last = _LAST.get(key)
    if last is not None and last[0].dtype == idx.dtype and last[0].shape == idx.shape and torch.equal(last[0], idx):
        return last[1]
    snapshot = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=device.type != "cpu")
    snapshot.copy_(idx)
    staged = snapshot.to(device, non_blocking=True)
    _LAST.put(key, (snapshot, staged))
    return staged
