"""Issue a `Copies2D` between a host buffer and a device staging buffer on the current
stream: through the platform runtime's own bulk copy calls where the platform has them
(`kvtier.platforms`: its record's ``dma_runtime``, e.g. cudaMemcpy2DAsync or one
cudaMemcpyBatchAsync, aclrtMemcpy2dAsync), else as torch copies, one per contiguous piece
(CPU, pageable host memory, no runtime found; torch moves only contiguous pieces across
devices without a sync). ``KVTIER_DMA_COPY`` (auto | batch | 2d | torch) narrows the choice.
"""
from __future__ import annotations

from typing import Optional

import torch

import kvtier.platforms as platforms
from kvtier.platforms.runtime_libs import Runtime, dma_mode

from .dma_copies import Copies2D
from kvtier.warn_once import warn_once



def issue(copies: Copies2D, host: torch.Tensor, stage: torch.Tensor, to_host: bool) -> None:
    """Move the copies' bytes: staging -> host (``to_host``) or host -> staging."""
    if len(copies) == 0:
        return
    rt = runtime_for(stage.device, host)
    if rt is not None:
        rt.issue(copies, host, stage, to_host)
    else:
        torch_copies(copies, host, stage, to_host)


def torch_copies(copies: Copies2D, host: torch.Tensor, stage: torch.Tensor, to_host: bool) -> None:
    """The copies as contiguous torch copies, one per piece (any devices, any memory)."""
    hb, sb = _bytes(host), _bytes(stage)
    for hh, ss, w in zip(*(t.tolist() for t in copies.pieces())):
        dst, src = (hb[hh:hh + w], sb[ss:ss + w]) if to_host else (sb[ss:ss + w], hb[hh:hh + w])
        dst.copy_(src, non_blocking=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("kvtier dma: buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def bytes_from(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The bytes of contiguous ``t`` from byte ``offset`` on, as a flat uint8 view (the copies
    made from a layer range's first byte are issued against it)."""
    return _bytes(t)[offset:]


def describe(platform: str) -> str:
    """How dma copies move on ``platform`` here (for `kvtier info`)."""
    mode = dma_mode()
    if mode == "torch":
        return "torch copies (KVTIER_DMA_COPY=torch)"
    rt, why = platforms.get(platform).dma_runtime()
    if rt is None:
        return "torch copies" + (f" ({why})" if why else "")
    batch = " + batch for short copies" if rt.batch is not None and mode != "2d" else ""
    return f"{rt.name} 2-D copies{batch} (KVTIER_DMA_COPY={mode})"


def runtime_for(device: torch.device, host: torch.Tensor) -> Optional[Runtime]:
    """The runtime that moves host <-> ``device`` bytes, or None (then torch copies, one per
    piece: 0.01-5 GB/s on an H200, so an accelerator falling back says so once, with why)."""
    if dma_mode() == "torch" or device.type == "cpu":
        return None
    if not host.is_pinned():
        _slow_path_once("pageable", "host memory is not pinned, so the device cannot copy it "
                        "asynchronously; pin the host buffer (HostPool pins by default)")
        return None
    rt, why = platforms.of(device).dma_runtime()
    if rt is None:
        _slow_path_once(why, why)
    return rt


def _slow_path_once(key: str, why: str) -> None:
    warn_once("dma." + key, "kvtier dma: bulk copies run as torch copies, one per contiguous piece (slow): %s", why)
