"""``arange(n)`` without an allocation per call: the contiguous side's indices of a
gather or scatter, a page's slot offsets in an index check."""
from __future__ import annotations

import torch
from kvtier import caches

_IOTA = caches.table("kernels.iota._IOTA", key="dtype, device", value="arange grown by doubling (never written)",
                     bound="dtypes x devices; each under 2x the longest asked", stale="-")


def iota(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``arange(n)`` as a view of a kept tensor per (dtype, device), grown (doubling) when a
    longer one is asked for. Never written, and never freed (a kernel still in flight on
    another stream may read an earlier one), so the kept tensors sum to under 2x the longest."""
    kept = _IOTA.setdefault((dtype, device), [])
    if not kept or kept[-1].numel() < n:
        kept.append(torch.arange(max(n, 2 * kept[-1].numel() if kept else n), dtype=dtype, device=device))
    return kept[-1][:n]
