"""What kvtier worked out about one index tensor, kept while that tensor is unchanged.

An engine passes the same index tensors to several calls in a row: HiCache loads a batch
layer by layer with the same host and device indices, once per layer. What a call works
out from an index tensor (its values passed a range check, its page-start view, its copy
on the device) is the same for every one of those calls, so it is kept here and reused
while the tensor is the same Python object with the same version counter. Torch bumps a
tensor's version on every in-place write to it or to any view of it (including
``resize_`` and ``set_``), so a rewritten index list is worked out afresh.

Nothing is kept or reused while a graph is being captured (`kvtier.platforms.capturing`):
a replayed graph reads the index tensors as they are at replay, so its checks and page
views must be captured, not taken from earlier calls.

What is trusted: memory written without torch (a raw kernel of the engine's own writing
into an index tensor in place, a numpy view of a CPU tensor) does not bump the version;
such a tensor must not be passed again as if unchanged (pass a new tensor, or write it
through torch). Inference tensors carry no version counter: nothing is kept for them.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch

import kvtier.platforms as platforms

_MEMO: Dict[int, Tuple[weakref.ref, int, dict]] = {}


def facts(t: torch.Tensor) -> Optional[dict]:
    """The dict of facts kept for ``t`` at its current version (empty when ``t`` is new to
    kvtier or was written since; the same dict object for as long as ``t`` is unchanged);
    callers store and read their own keys in it. None for an inference tensor, and while a
    graph is being captured. Only calls that expect a list again ask (a per-layer loop's);
    an all-layer call's or a gather's list comes once, and keeping it would cost more than
    it saves."""
    if platforms.capturing():
        return None
    try:
        version = t._version
    except RuntimeError:            # an inference tensor: no version counter, nothing kept
        return None
    key = id(t)
    entry = _MEMO.get(key)
    if entry is not None and entry[0]() is t:
        if entry[1] == version:
            return entry[2]
    found = {}
    _MEMO[key] = (weakref.ref(t, _forget(key)), version, found)
    return found


def _forget(key: int):
    def drop(ref) -> None:
        entry = _MEMO.get(key)
        if entry is not None and entry[0] is ref:
            del _MEMO[key]
    return drop


def page_starts(idx: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page numbers of whole-page slot indices (every ``page_size``-th slot, divided by
    it), as a contiguous tensor: kept, so a per-layer loop computes it once."""
    f = facts(idx)
    key = ("pages", page_size)
    out = f.get(key) if f is not None else None
    if out is None:
        out = (idx[::page_size] // page_size).contiguous()
        if f is not None:
            f[key] = out
    return out


def on_device(idx: torch.Tensor, device: torch.device, keep: bool = True) -> torch.Tensor:
    """``idx`` on ``device`` without waiting: an index list from the host is staged through
    page-locked memory (torch's caching host allocator keeps the block until the copy has
    read it), so the copy is asynchronous. Kept per index tensor and stream while the
    tensor is unchanged: a per-layer loop copies its list once. ``keep=False``: a list that
    comes once (an all-layer call's) is copied and nothing is kept."""
    if idx.device == device:
        return idx
    known = facts(idx) if keep else None
    key = ("on", device, platforms.stream_key(device))
    staged = known.get(key) if known is not None else None
    if staged is None:
        staged = idx if device.type == "cpu" or idx.is_pinned() else idx.pin_memory()
        staged = staged.to(device, non_blocking=True)
        if known is not None:
            known[key] = staged
    return staged
