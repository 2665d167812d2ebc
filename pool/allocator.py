"""Thread-safe page allocator for host pools: hands out page-aligned slot indices."""
from __future__ import annotations

import threading
from collections import deque
from typing import Hashable, List, Optional

import torch

from kvtier.errors import fail
from kvtier.kernels.validate import check_index, check_page_aligned, is_int

from .spec import check_positive


class PageAllocator:
    """``size`` token slots in pages of ``page_size``. `alloc` returns slot indices of
    whole pages (int64, CPU); `free` takes them back. All methods hold one lock.

    What `free` checks, every check before any page changes hands (a refused call frees
    nothing):

    - ``indices`` is a 1-D int32/int64 tensor of whole pages: runs of ``page_size``
      consecutive slots starting at a page boundary;
    - every slot is a slot of this allocator (0 <= slot < size);
    - no page appears twice in the call;
    - every page is allocated now: a page that is free (freed before and not handed out
      again, or never handed out) is refused;
    - every page is held by the ``owner`` given: the token passed to `alloc` (compared
      with ``==``), or None for pages allocated without one.

    Indices alone cannot tell a stale free from a real one: after ``free(x)``, pages
    handed out again to another caller are allocated, and a second ``free(x)`` would free
    the new holder's pages. Pass an ``owner`` token (any hashable value other than None:
    a request id, an object) to both calls to catch that: the stale free names the page
    and is refused, because the page is held by a different owner. Pages allocated without
    an owner are freed without one (the original API, unchanged); a generation count is
    not kept, so two holders that use the same token cannot be told apart either.
    """

    def __init__(self, size: int, page_size: int):
        check_positive(size=size, page_size=page_size)
        if size % page_size:
            raise fail("size", size, f"must be a multiple of page_size={page_size}")
        self.size, self.page_size = size, page_size
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Every page free again (owners forgotten)."""
        with self._lock:
            self._free = deque(range(self.size // self.page_size))
            self._used = torch.zeros(self.size // self.page_size, dtype=torch.bool)
            self._owner: List[Optional[Hashable]] = [None] * (self.size // self.page_size)

    def available_size(self) -> int:
        with self._lock:
            return len(self._free) * self.page_size

    def alloc(self, need_size: int, owner: Optional[Hashable] = None) -> Optional[torch.Tensor]:
        """Slots for ``need_size`` tokens (a multiple of page_size), or None if too few are
        free. ``owner``: a token the matching `free` must pass (see the class docstring)."""
        if not is_int(need_size) or need_size < 0 or need_size % self.page_size:
            raise fail("need_size", need_size, f"must be a non-negative multiple of page_size={self.page_size}")
        _check_owner(owner)
        n = need_size // self.page_size
        with self._lock:
            if n > len(self._free):
                return None
            pages = torch.tensor([self._free.popleft() for _ in range(n)], dtype=torch.int64)
            self._used[pages] = True
            for p in pages.tolist():
                self._owner[p] = owner
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, indices: torch.Tensor, owner: Optional[Hashable] = None) -> int:
        """Return whole pages of slots; returns the number of slots freed. Raises
        `KvtierError` naming ``indices`` (or ``owner``) and the first bad slot, freeing
        nothing, for any failure listed in the class docstring."""
        check_index("indices", indices, indices.device if isinstance(indices, torch.Tensor) else None)
        _check_owner(owner)
        indices = indices.cpu()
        check_page_aligned("indices", indices, self.page_size)
        pages = indices[::self.page_size] // self.page_size
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self._used.numel()):
            bad = indices[(indices < 0) | (indices >= self.size)][0]
            raise fail("indices", int(bad), f"out of range: not slots of this allocator (size {self.size})")
        if pages.unique().numel() != pages.numel():
            seen, dup = set(), None
            for p in pages.tolist():
                if p in seen:
                    dup = p
                    break
                seen.add(p)
            raise fail("indices", dup * self.page_size, "frees a page twice in one call")
        with self._lock:
            used = self._used[pages]
            if not bool(used.all()):
                bad = int(pages[~used][0]) * self.page_size
                raise fail("indices", bad, "slot is not allocated (double free, or never handed out)")
            for p in pages.tolist():
                held = self._owner[p]
                if held is not owner and (held is None or owner is None or held != owner):
                    whom = "without an owner" if held is None else f"by owner {held!r}"
                    raise fail("owner", owner, f"the page at slot {p * self.page_size} was allocated "
                               f"{whom} (a stale free after the page was handed out again?)")
            self._used[pages] = False
            for p in pages.tolist():
                self._owner[p] = None
            self._free.extend(pages.tolist())
        return indices.numel()

    def owner_of(self, index: int) -> Optional[Hashable]:
        """The owner token of the allocated page holding slot ``index`` (None: no owner)."""
        if not is_int(index) or not 0 <= index < self.size:
            raise fail("index", index, f"not a slot of this allocator (size {self.size})")
        with self._lock:
            if not bool(self._used[index // self.page_size]):
                raise fail("index", index, "slot is not allocated")
            return self._owner[index // self.page_size]


def _check_owner(owner) -> None:
    try:
        hash(owner)
    except TypeError:
        raise fail("owner", type(owner).__name__, "must be hashable (a request id, an object)") from None
