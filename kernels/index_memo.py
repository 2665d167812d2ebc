"""What kvtier worked out about one index tensor, kept while that tensor is unchanged.

An engine passes the same index tensors to several calls in a row: HiCache loads a batch
layer by layer with the same host and device indices, once per layer. What a call works
out from an index tensor (its values passed a range check, its page-start view, its copy
on the device) is the same for every one of those calls, so it is kept here and reused
while the tensor is the same Python object, unchanged: the same version counter, first
byte and length (`state`). Torch bumps a tensor's version on every in-place write to it
or to any view of it (including ``resize_`` and ``set_``), so a rewritten index list is
worked out afresh; rebinding ``t.data`` keeps the version but moves the first byte or
changes the length.

`LastPair` goes one step further for the per-layer loop: a caller keeps the last call's
two index tensors as checked, and a call that passes the same two again, unchanged,
reuses the whole outcome (shape checks, staging, the guard's verdict word) without
asking for anything per tensor.

Nothing is kept or reused while a graph is being captured (`kvtier.platforms.capturing`):
a replayed graph reads the index tensors as they are at replay, so its checks and page
views must be captured, not taken from earlier calls.

What is trusted: memory written without torch's version counter seeing it (a raw kernel
of the engine's own writing into an index tensor in place, a numpy view of a CPU tensor,
a write through ``t.data``) is not seen; such a tensor must not be passed again as if
unchanged (pass a new tensor, or write it through torch). Inference tensors carry no
version counter: nothing is kept for them.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional, Tuple

import torch

import kvtier.platforms as platforms

from .errors import fail

_MEMO: Dict[int, Tuple[weakref.ref, tuple, dict]] = {}
# Bumped by `forget_all`: every `LastPair` kept before it is void.
_EPOCH = 0


def state(t: torch.Tensor) -> Optional[tuple]:
    """What must stay the same for what was worked out about ``t`` to hold: its torch
    version, first byte and element count. None for an inference tensor (no version
    counter: nothing about it may be kept)."""
    try:
        return t._version, t.data_ptr(), t.numel()
    except RuntimeError:
        return None


def forget_all() -> None:
    """Void every `LastPair` kept so far (`kvtier.bench.probe.LaunchProbe` records checks
    that never ran; nothing learnt under it may be reused after it)."""
    global _EPOCH
    _EPOCH += 1


def facts(t: torch.Tensor) -> Optional[dict]:
    """The dict of facts kept for ``t`` at its current version (empty when ``t`` is new to
    kvtier or was written since; the same dict object for as long as ``t`` is unchanged);
    callers store and read their own keys in it. None for an inference tensor, and while a
    graph is being captured. Only calls that expect a list again ask (a per-layer loop's);
    an all-layer call's or a gather's list comes once, and keeping it would cost more than
    it saves."""
    if platforms.capturing():
        return None
    now = state(t)
    if now is None:                 # an inference tensor: no version counter, nothing kept
        return None
    key = id(t)
    entry = _MEMO.get(key)
    if entry is not None and entry[0]() is t:
        if entry[1] == now:
            return entry[2]
    found = {}
    _MEMO[key] = (weakref.ref(t, _forget(key)), now, found)
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


def on_device(idx: torch.Tensor, device: torch.device, keep: bool = True, arg: str = "indices") -> torch.Tensor:
    """``idx`` on ``device`` without waiting: an index list from the host is staged through
    page-locked memory (torch's caching host allocator keeps the block until the copy has
    read it), so the copy is asynchronous. Kept per index tensor and stream while the
    tensor is unchanged: a per-layer loop copies its list once. ``keep=False``: a list that
    comes once (an all-layer call's) is copied and nothing is kept.

    While a CUDA graph is captured, only a list in pinned memory is staged (the graph's
    copy reads it as it is at each replay); a pageable one is refused, naming ``arg``: it
    would be copied once into a staging block at capture, and a replay would read that
    block after its release."""
    if idx.device == device:
        return idx
    if platforms.capturing() and not idx.is_pinned():
        raise fail(arg, f"pageable {idx.device} tensor", "cannot be staged on the device while a CUDA graph "
                   "is captured (a replay would read a staging block released after the capture): pass "
                   "it on the device, or in pinned memory, which each replay reads as it is then")
    known = facts(idx) if keep else None
    key = ("on", device, platforms.stream_key(device))
    staged = known.get(key) if known is not None else None
    if staged is None:
        staged = idx if device.type == "cpu" or idx.is_pinned() else idx.pin_memory()
        staged = staged.to(device, non_blocking=True)
        if known is not None:
            known[key] = staged
    return staged


class LastPair:
    """The last call's two index tensors as a caller checked them (HiCache's per-layer
    loop passes one pair for every layer): the tensors and their `state`, what the check
    depended on besides them (the caller's ``owner``, compared by identity, e.g. the
    device pool a HostPool call moves, and its ``flags``, compared by value), the stream
    it ran on, the guard's verdict word and the ticket that asks the guard whether the
    word still holds it (`IndexGuard.check`), and what the caller made of the lists
    (``prepared``: its own field, e.g. the lists staged on the device). Made by
    `last_pair`; asked by `matches`."""

    __slots__ = ("a", "b", "a_state", "b_state", "owner", "flags", "stream", "ticket", "verdict", "prepared",
                 "epoch")

    def matches(self, a, b, owner, flags, stream, guard) -> bool:
        """Whether a call passing ``a`` and ``b`` for ``owner`` with ``flags`` on ``stream``
        (a `kvtier.platforms.stream_key`, None on a CPU) may reuse this outcome: the same
        two tensors, unchanged, the same owner, flags and stream, nothing being captured,
        and ``guard``'s word still holding their verdict (a failure found since is raised)."""
        if self.a is not a or self.b is not b or self.owner is not owner or self.epoch != _EPOCH \
                or self.flags != flags:
            return False
        # `state` of each, inline (the layer loop's hot path); neither is an inference tensor.
        sa, sb = self.a_state, self.b_state
        if (a._version != sa[0] or b._version != sb[0] or a.data_ptr() != sa[1] or b.data_ptr() != sb[1]
                or a.numel() != sa[2] or b.numel() != sb[2] or self.stream != stream or platforms.capturing()):
            return False
        return guard.holds(self.ticket)


def last_pair(a: torch.Tensor, b: torch.Tensor, owner, flags, stream, ticket: Optional[list],
              verdict: Optional[torch.Tensor], prepared=None) -> Optional[LastPair]:
    """A `LastPair` for a call that checked ``a`` and ``b`` (``ticket``: the list its
    `IndexGuard.check` filled, empty where no word was returned); None where nothing may
    be kept: an inference tensor, or a graph being captured."""
    sa, sb = state(a), state(b)
    if sa is None or sb is None or platforms.capturing():
        return None
    r = LastPair()
    r.a, r.b, r.a_state, r.b_state, r.owner, r.flags, r.stream = a, b, sa, sb, owner, flags, stream
    r.ticket, r.verdict, r.prepared, r.epoch = (ticket[0] if ticket else None), verdict, prepared, _EPOCH
    return r
