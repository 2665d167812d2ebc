"""Issue a `CopyPlan` between a host buffer and a device staging buffer on the current
stream, through the platform runtime's own copy calls (ctypes on the runtime library the
process already loaded for torch, found in /proc/self/maps; nothing is built):

- CUDA ``cudaMemcpy2DAsync``, ROCm ``hipMemcpy2DAsync``: one call per 2-D copy; but
  CUDA 12.8+ takes one ``cudaMemcpyBatchAsync`` for every row of the plan instead when
  the 2-D copies are short (under 4 rows on average: a per-layer load from page-major
  layouts, page_first backups), where it measured faster. The batch call refuses the
  legacy default stream; on it the batch goes to the per-thread default stream, which
  the legacy stream is ordered with both ways;
- Ascend ``aclrtMemcpy2dAsync`` (libascendcl), one call per 2-D copy. torch_npu may defer
  its own launches to a task-queue thread, which a direct call would overtake, so it is
  used only with ``TASK_QUEUE_ENABLE=0``; otherwise the copies go through torch;
- elsewhere (CPU, pageable host memory, no runtime found): torch copies, one per piece
  (torch moves only contiguous pieces across devices without a sync).

``KVTIER_DMA_COPY`` = ``batch`` | ``2d`` | ``torch`` narrows the choice (benchmarks,
or to step around a driver problem); the default ``auto`` takes the first that applies.
The 2-D calls take rows ``pitch`` bytes apart; a one-row copy gets ``pitch = width``, and a
copy whose pitch or height exceeds the runtime's limit is split into smaller ones.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Tuple

import torch

from kvtier.platforms import runtime_libs

from .dma_plan import CopyPlan

H2D, D2H = 1, 2     # the value of host-to-device / device-to-host in all three runtimes


@dataclass(frozen=True)
class Runtime:
    """A runtime's copy entry points (2-D copy; batch of 1-D copies where it has one)
    and their limits."""

    name: str
    copy_2d: Callable       # (dst, dpitch, src, spitch, width, height, kind, stream) -> int
    stream_of: Callable     # torch.device -> stream handle (int)
    max_pitch: int
    max_height: int
    error: Callable = str   # return code -> message
    batch: Optional[Callable] = None    # (dsts, srcs, sizes, count, stream) -> int; arrays of u64
    # The batch call refuses the legacy default stream (handle 0); this stream takes the
    # batch instead, and must be ordered with the legacy stream both ways.
    batch_default_stream: Optional[int] = None

    def issue(self, plan: CopyPlan, host: torch.Tensor, stage: torch.Tensor, to_host: bool) -> None:
        stream = self.stream_of(stage.device)
        h0, s0 = host.data_ptr(), stage.data_ptr()
        batch_stream = stream or self.batch_default_stream
        if self.batch is not None and batch_stream and self._batched(plan):
            return self._issue_batch(plan, h0, s0, to_host, batch_stream)
        kind = D2H if to_host else H2D
        for h, s, w, n in plan.rows():
            for hh, ss, m, (hp, sp) in self._pieces(plan, h, s, w, n):
                args = (h0 + hh, hp, s0 + ss, sp) if to_host else (s0 + ss, sp, h0 + hh, hp)
                rc = self.copy_2d(*args, w, m, kind, stream)
                if rc != 0:
                    raise RuntimeError(f"kvtier dma: {self.name} 2-D copy of {m} x {w} bytes failed: "
                                       f"{self.error(rc)} ({rc})")

    def _batched(self, plan: CopyPlan) -> bool:
        """Whether the batch call should move ``plan``: when asked to, or ("auto") when its
        2-D copies are short. On an H200 (CUDA 13, driver 580) a batch costs about 0.6 us
        per piece device->host and 4 us host->device, a 2-D call 4-7 us whatever its
        height, and the batch won wherever copies averaged under 4 rows
        (bench/scripts/dma_modes.py, README)."""
        mode = _mode()
        if mode != "auto":
            return mode == "batch"
        return int(plan.height.sum()) < BATCH_BELOW_MEAN_HEIGHT * len(plan)

    def _issue_batch(self, plan: CopyPlan, h0: int, s0: int, to_host: bool, stream) -> None:
        h, s, w = plan.pieces()
        h, s = h + h0, s + s0
        dst, src = (h, s) if to_host else (s, h)
        rc = self.batch(dst.data_ptr(), src.data_ptr(), w.data_ptr(), w.numel(), stream)
        if rc != 0:
            raise RuntimeError(f"kvtier dma: {self.name} batch of {w.numel()} copies failed: "
                               f"{self.error(rc)} ({rc})")

    def _pieces(self, plan: CopyPlan, h: int, s: int, w: int, n: int):
        """(host offset, staging offset, rows, (host pitch, staging pitch)) within the limits."""
        hp, sp = plan.host_pitch, plan.stage_pitch
        step = 1 if max(hp, sp) > self.max_pitch else self.max_height
        for i in range(0, n, step):
            m = min(step, n - i)
            yield h + i * hp, s + i * sp, m, ((hp, sp) if m > 1 else (w, w))


def issue(plan: CopyPlan, host: torch.Tensor, stage: torch.Tensor, to_host: bool) -> None:
    """Move the plan's bytes: staging -> host (``to_host``) or host -> staging."""
    if len(plan) == 0:
        return
    rt = runtime_for(stage.device, host)
    if rt is not None:
        rt.issue(plan, host, stage, to_host)
    else:
        torch_copies(plan, host, stage, to_host)


def torch_copies(plan: CopyPlan, host: torch.Tensor, stage: torch.Tensor, to_host: bool) -> None:
    """The plan as contiguous torch copies, one per piece (any devices, any memory)."""
    hb, sb = _bytes(host), _bytes(stage)
    for hh, ss, w in zip(*(t.tolist() for t in plan.pieces())):
        dst, src = (hb[hh:hh + w], sb[ss:ss + w]) if to_host else (sb[ss:ss + w], hb[hh:hh + w])
        dst.copy_(src, non_blocking=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("kvtier dma: buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def describe(platform: str) -> str:
    """How dma copies move on ``platform`` here (for `kvtier info`)."""
    mode = os.environ.get("KVTIER_DMA_COPY", "auto")
    if mode == "torch":
        return "torch copies (KVTIER_DMA_COPY=torch)"
    rt, why = _selection({"cuda": "cuda", "rocm": "cuda", "npu": "npu"}.get(platform, "cpu"))
    if rt is None:
        return "torch copies" + (f" ({why})" if why else "")
    batch = " + batch for short copies" if rt.batch is not None and mode != "2d" else ""
    return f"{rt.name} 2-D copies{batch} (KVTIER_DMA_COPY={mode})"


def _mode() -> str:
    mode = os.environ.get("KVTIER_DMA_COPY", "auto")
    if mode not in MODES:
        raise ValueError(f"KVTIER_DMA_COPY={mode!r}: must be one of {MODES}")
    return mode


MODES = ("auto", "batch", "2d", "torch")
BATCH_BELOW_MEAN_HEIGHT = 4


def runtime_for(device: torch.device, host: torch.Tensor) -> Optional[Runtime]:
    """The runtime that moves host <-> ``device`` bytes, or None (then torch copies)."""
    if _mode() == "torch" or device.type == "cpu" or not host.is_pinned():
        return None
    return _selection(device.type)[0]


def _selection(device_type: str) -> Tuple[Optional[Runtime], str]:
    """The runtime for a torch device type, or None and why torch copies move the bytes
    ("" where there is no accelerator runtime to use)."""
    if device_type == "cuda":
        rt = _cuda_runtime()
    elif device_type == "npu":
        if os.environ.get("TASK_QUEUE_ENABLE", "1") != "0":
            return None, "set TASK_QUEUE_ENABLE=0 for aclrtMemcpy2dAsync"
        rt = _acl_runtime()
    else:
        return None, ""
    return rt, "" if rt is not None else "the runtime library was not found"


_ARGS = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]


@lru_cache(maxsize=None)
def _cuda_runtime() -> Optional[Runtime]:
    hip = bool(getattr(torch.version, "hip", None))
    lib, fn, err = (("libamdhip64.so", "hipMemcpy2DAsync", "hipGetErrorString") if hip else
                    ("libcudart.so", "cudaMemcpy2DAsync", "cudaGetErrorString"))
    torch.cuda.init()
    copy_2d = runtime_libs.function(lib, fn, _ARGS)
    get_error = runtime_libs.function(lib, err, [ctypes.c_int], ctypes.c_char_p)
    if copy_2d is None or get_error is None:
        return None
    return Runtime("hip" if hip else "cuda", copy_2d,
                   lambda d: torch.cuda.current_stream(d).cuda_stream,
                   max_pitch=(1 << 31) - 1, max_height=(1 << 31) - 1,
                   error=lambda rc: get_error(rc).decode(), batch=None if hip else _cuda_batch(),
                   batch_default_stream=CUDA_STREAM_PER_THREAD)


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes: source access order, two location hints (ignored for pinned
    and device memory), flags."""
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int),
                ("src_loc_id", ctypes.c_int), ("dst_loc_type", ctypes.c_int),
                ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


SRC_ACCESS_ORDER_STREAM = 1
# cudaStreamPerThread: a blocking stream, so the legacy default stream (torch's default)
# and it wait for each other's earlier work; a batch issued there keeps stream order.
CUDA_STREAM_PER_THREAD = 0x2


def _cuda_batch() -> Optional[Callable]:
    """cudaMemcpyBatchAsync as ``(dsts, srcs, sizes, count, stream) -> rc``, or None before
    CUDA 12.8. CUDA 12.8-12.9 take a ``failIdx`` argument before the stream; 13 does not."""
    version = ctypes.c_int()
    get_version = runtime_libs.function("libcudart.so", "cudaRuntimeGetVersion", [ctypes.POINTER(ctypes.c_int)])
    if get_version is None or get_version(ctypes.byref(version)) != 0 or version.value < 12080:
        return None
    fail_idx = version.value < 13000
    P = ctypes.c_void_p
    args = [P, P, P, ctypes.c_size_t, P, P, ctypes.c_size_t] + ([P] if fail_idx else []) + [P]
    f = runtime_libs.function("libcudart.so", "cudaMemcpyBatchAsync", args)
    if f is None:
        return None
    attrs = _MemcpyAttributes(src_access_order=SRC_ACCESS_ORDER_STREAM)
    attr_idx = (ctypes.c_size_t * 1)(0)
    failed = ctypes.c_size_t()
    extra = (ctypes.addressof(failed),) if fail_idx else ()

    def batch(dsts, srcs, sizes, count, stream):
        return f(dsts, srcs, sizes, count, ctypes.addressof(attrs), ctypes.addressof(attr_idx), 1,
                 *extra, stream)
    return batch


@lru_cache(maxsize=None)
def _acl_runtime() -> Optional[Runtime]:
    copy_2d = runtime_libs.function("libascendcl.so", "aclrtMemcpy2dAsync", _ARGS)
    if copy_2d is None:
        return None
    # aclrtMemcpy2dAsync takes at most 5 * 1024 * 1024 rows per call (CANN documentation).
    return Runtime("acl", copy_2d, lambda d: torch.npu.current_stream(d).npu_stream,
                   max_pitch=(1 << 63) - 1, max_height=5 * 1024 * 1024)
