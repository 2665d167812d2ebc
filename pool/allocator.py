"""Thread-safe page allocator for host pools: hands out page-aligned slot indices."""
from __future__ import annotations

import threading
from collections import deque
from typing import Optional

import torch

from kvtier.kernels.errors import fail
from kvtier.kernels.validate import check_page_aligned

from .spec import check_positive


class PageAllocator:
    """``size`` token slots in pages of ``page_size``. `alloc` returns slot indices of
    whole pages (int64, CPU); `free` takes them back, rejecting double frees and slots
    this allocator never handed out. All methods hold one lock."""

    def __init__(self, size: int, page_size: int):
        check_positive(size=size, page_size=page_size)
        if size % page_size:
            raise fail("size", size, f"must be a multiple of page_size={page_size}")
        self.size, self.page_size = size, page_size
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self._free = deque(range(self.size // self.page_size))
            self._used = torch.zeros(self.size // self.page_size, dtype=torch.bool)

    def available_size(self) -> int:
        with self._lock:
            return len(self._free) * self.page_size

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Slots for ``need_size`` tokens (a multiple of page_size), or None if too few are free."""
        if not isinstance(need_size, int) or need_size < 0 or need_size % self.page_size:
            raise fail("need_size", need_size, f"must be a non-negative multiple of page_size={self.page_size}")
        n = need_size // self.page_size
        with self._lock:
            if n > len(self._free):
                return None
            pages = torch.tensor([self._free.popleft() for _ in range(n)], dtype=torch.int64)
            self._used[pages] = True
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free(self, indices: torch.Tensor) -> int:
        """Return whole pages of slots; returns the number of slots freed."""
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
            raise fail("indices", type(indices).__name__, "must be a 1-D int32/int64 tensor")
        indices = indices.cpu()
        check_page_aligned("indices", indices, self.page_size)
        pages = indices[::self.page_size] // self.page_size
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= self._used.numel()):
            raise fail("indices", indices.tolist()[:8], f"not slots of this allocator (size {self.size})")
        if pages.unique().numel() != pages.numel():
            raise fail("indices", indices.tolist()[:8], "frees a page twice")
        with self._lock:
            used = self._used[pages]
            if not bool(used.all()):
                bad = int(pages[~used][0]) * self.page_size
                raise fail("indices", bad, "slot is not allocated (double free, or never handed out)")
            self._used[pages] = False
            self._free.extend(pages.tolist())
        return indices.numel()
