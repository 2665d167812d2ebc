"""NVIDIA CUDA and AMD ROCm (through torch.cuda): launch defaults, tuning space, timer,
the runtime's bulk copy calls, and codegen targets.

Pinned host memory is device-addressable (UVA), so a kernel reads and writes host rows
at their host addresses; the dma strategy copies through ``cudaMemcpy2DAsync`` /
``hipMemcpy2DAsync``, and on CUDA 12.8+ one ``cudaMemcpyBatchAsync`` for short copies.
"""
from __future__ import annotations

import ctypes
from dataclasses import replace
from typing import Callable, Optional

import torch

from kvtier.config import CopyConfig, Space

from . import runtime_libs
from .record import Platform
from .runtime_libs import ARGS_2D, Runtime
from kvtier import caches

# Defaults, measured on an H200 (results/2026-11-29_h200/defaults, 1 KiB rows, 8192 random
# tokens x 8 layers x K,V): 4 programs of 64-row tiles move 50.9 GB/s device->host and
# 49.6 GB/s host->device against a 55.2 GB/s pinned copy; 4-row tiles reach only 10-26
# GB/s (too few bytes in flight across PCIe). On the device, 2112 programs (16 per SM) of
# 16-row tiles gather at 1166 GB/s. ROCm takes the CUDA values (not yet measured on AMD).
# Pipelining (stages) and tiles sized in bytes (tile_bytes) are set from the sm_90 code
# generation (`kvtier codegen`: cp.async, 16-byte accesses, no spills), not yet measured:
# across the link three 64 KiB tiles per program are in flight (two ahead, 128 KiB of
# shared memory), whatever the row size; on the device two 16 KiB tiles, so that four
# programs of 16 warps still fit an SM.
LINK = CopyConfig(num_programs=4, rows=64, block_bytes=1024, num_warps=8, stages=3, tile_bytes=65536)
DEVICE = CopyConfig(num_programs=2112, rows=16, block_bytes=1024, num_warps=16, stages=2, tile_bytes=16384)
# A tile is held in registers: up to 64 rows x 1 KiB (the link default) per program;
# stages - 1 tiles wait in shared memory (at most 160 KiB of sm_90's 227).
_ROWS, _BLOCKS = (1, 2, 4, 8, 16, 32, 64), (256, 512, 1024, 2048, 4096)
_QUICK_ROWS, _QUICK_BLOCKS = (1, 4, 16, 64), (512, 2048)
_STAGES, _TILE_BYTES = (1, 2, 3, 4), (0, 16384, 65536)
_QUICK_STAGES, _QUICK_TILE_BYTES = (1, 3), (0, 65536)
_STAGE_LIMIT = 160 << 10


def _max_programs(units: int, crosses_link: bool) -> int:
    """A link is saturated by a few programs: an eighth of the SMs (at least 2); a
    device-local copy may put 16 programs on every SM (the shipped device default)."""
    units = units or LINK.num_programs
    return max(2, units // 8) if crosses_link else 16 * units


def cuda_timer(warmup: int = 0, repeats: int = 0):
    """Median of triton.testing.do_bench (CUDA events, L2 flushed between runs); it sizes
    its runs from time budgets, not call counts."""
    def timer(fn, **_):
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    return timer


# ------------------------------------------------------------------ bulk copies (dma)
@caches.lru("platforms.cuda._runtime", bound="2", key="HIP or CUDA", value="the runtime's bulk copy calls (ctypes)",
            stale="not happen: a loaded library stays")
def _runtime(hip: bool) -> Optional[Runtime]:
    lib, fn, err = (("libamdhip64.so", "hipMemcpy2DAsync", "hipGetErrorString") if hip else
                    ("libcudart.so", "cudaMemcpy2DAsync", "cudaGetErrorString"))
    torch.cuda.init()
    copy_2d = runtime_libs.function(lib, fn, ARGS_2D)
    get_error = runtime_libs.function(lib, err, [ctypes.c_int], ctypes.c_char_p)
    if copy_2d is None or get_error is None:
        return None
    return Runtime("hip" if hip else "cuda", copy_2d,
                   lambda d: torch.cuda.current_stream(d).cuda_stream,
                   max_pitch=(1 << 31) - 1, max_height=(1 << 31) - 1,
                   error=lambda rc: get_error(rc).decode(), batch=None if hip else _batch(),
                   batch_default_stream=CUDA_STREAM_PER_THREAD)


def _dma_runtime(hip: bool):
    def select():
        rt = _runtime(hip)
        return rt, "" if rt is not None else "the runtime library was not found"
    return select


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


def _batch() -> Optional[Callable]:
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


# ------------------------------------------------------------------ records
def _record(name: str, warp: int, arch_of: Callable) -> Platform:
    return Platform(
        name=name, device_type="cuda", link_config=LINK, device_config=DEVICE,
        space=Space(_ROWS, _BLOCKS, (1, 2, 4, 8, 16), 64 << 10, warp, _STAGES, _TILE_BYTES, _STAGE_LIMIT),
        quick_space=Space(_QUICK_ROWS, _QUICK_BLOCKS, (4, 8, 16), 64 << 10, warp, _QUICK_STAGES,
                          _QUICK_TILE_BYTES, _STAGE_LIMIT),
        max_programs=_max_programs, timer=cuda_timer, warp_threads=warp,
        dma_runtime=_dma_runtime(hip=name == "rocm"),
        codegen_target=lambda arch: arch.replace("_", "").split(":")[0] or None,    # "sm_90" -> "sm90"; "gfx942"
        properties=lambda device, p: {"arch": arch_of(p), "compute_units": p.multi_processor_count})


CUDA = _record("cuda", 32, lambda p: f"sm_{p.major}{p.minor}")
# gfx942 has no cp.async: a pipelined loop holds the tiles ahead in registers, and the
# link default's three 64 KiB tiles spill (kvtier codegen --target gfx942); one stage.
ROCM = replace(_record("rocm", 64, lambda p: getattr(p, "gcnArchName", "")),
               link_config=replace(LINK, stages=1), device_config=replace(DEVICE, stages=1))
