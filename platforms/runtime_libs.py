"""The accelerator runtime libraries torch already loaded, reached through ctypes for the
few calls torch does not expose (2-D copies, host memory registration). Nothing is
built or loaded anew: a library is found among the ones this process has mapped.

`Runtime` is a runtime's bulk copy calls as the dma strategy issues them; each platform
module builds its own (`cuda`: cudaMemcpy2DAsync / cudaMemcpyBatchAsync / hipMemcpy2DAsync,
`ascend`: aclrtMemcpy2dAsync).

``KVTIER_DMA_COPY`` = ``batch`` | ``2d`` | ``torch`` narrows the choice (benchmarks, or
to step around a driver problem); the default ``auto`` takes the first that applies.
The 2-D calls take rows ``pitch`` bytes apart; a one-row copy gets ``pitch = width``, and a
copy whose pitch or height exceeds the runtime's limit is split into smaller ones."""
from __future__ import annotations

import ctypes
import os
from kvtier import caches
from dataclasses import dataclass
from typing import Callable, Optional


def loaded_library(fragment: str) -> Optional[str]:
    """Path of a shared library this process has mapped whose file name contains
    ``fragment`` (e.g. "libcudart.so", "libascendcl.so"), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(" ")[-1]
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        pass
    return None


@caches.lru("platforms.runtime_libs.library", bound="libraries asked for (a few names)", key="library name fragment",
            value="ctypes handle of the mapped library", stale="not happen: a mapped library stays")
def library(fragment: str) -> Optional[ctypes.CDLL]:
    """The mapped library as a ctypes handle (cached), or None where it is not loaded."""
    path = loaded_library(fragment)
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def function(fragment: str, name: str, argtypes, restype=ctypes.c_int):
    """``name`` from the mapped library, typed; None where the library or symbol is missing."""
    lib = library(fragment)
    f = getattr(lib, name, None) if lib is not None else None
    if f is not None:
        f.argtypes, f.restype = argtypes, restype
    return f


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

    def issue(self, copies, host, stage, to_host: bool) -> None:
        stream = self.stream_of(stage.device)
        h0, s0 = host.data_ptr(), stage.data_ptr()
        batch_stream = stream or self.batch_default_stream
        if self.batch is not None and batch_stream and self._batched(copies):
            # The three address arrays are kept with the copies (the call reads them before it returns).
            dst, src, w = copies.addresses(h0, s0, to_host)
            rc = self.batch(dst.data_ptr(), src.data_ptr(), w.data_ptr(), w.numel(), batch_stream)
            if rc != 0:
                raise RuntimeError(f"kvtier dma: {self.name} batch of {w.numel()} copies failed: "
                                   f"{self.error(rc)} ({rc})")
            return
        kind = D2H if to_host else H2D
        for h, s, w, n in copies.rows():
            for hh, ss, m, (hp, sp) in self._pieces(copies, h, s, w, n):
                args = (h0 + hh, hp, s0 + ss, sp) if to_host else (s0 + ss, sp, h0 + hh, hp)
                rc = self.copy_2d(*args, w, m, kind, stream)
                if rc != 0:
                    raise RuntimeError(f"kvtier dma: {self.name} 2-D copy of {m} x {w} bytes failed: "
                                       f"{self.error(rc)} ({rc})")

    def _batched(self, copies) -> bool:
        """Whether the batch call should move ``copies``: when asked to, or ("auto") when its
        2-D copies are short. On an H200 (CUDA 13, driver 580) a batch costs about 0.6 us
        per piece device->host and 4 us host->device, a 2-D call 4-7 us whatever its
        height, and the batch won wherever copies averaged under 4 rows
        (bench/scripts/dma_modes.py, docs/benchmarks.md)."""
        mode = dma_mode()
        return mode == "batch" if mode != "auto" else copies.mean_height < BATCH_BELOW_MEAN_HEIGHT

    def _pieces(self, copies, h: int, s: int, w: int, n: int):
        """(host offset, staging offset, rows, (host pitch, staging pitch)) within the limits."""
        hp, sp = copies.host_pitch, copies.stage_pitch
        step = 1 if max(hp, sp) > self.max_pitch else self.max_height
        for i in range(0, n, step):
            m = min(step, n - i)
            yield h + i * hp, s + i * sp, m, ((hp, sp) if m > 1 else (w, w))


def dma_mode() -> str:
    """KVTIER_DMA_COPY, checked."""
    mode = os.environ.get("KVTIER_DMA_COPY", "auto")
    if mode not in MODES:
        raise ValueError(f"KVTIER_DMA_COPY={mode!r}: must be one of {MODES}")
    return mode


MODES = ("auto", "batch", "2d", "torch")
BATCH_BELOW_MEAN_HEIGHT = 4
ARGS_2D = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
           ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]


