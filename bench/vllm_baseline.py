"""vLLM's Triton swap kernel as a baseline, where its published source is at hand.

vLLM's CPU offloading (``vllm/v1/kv_offload/cpu/swap_blocks_triton.py``, vLLM 0.33)
loads pages host -> device with a Triton kernel over lists of (source address,
destination address, bytes) jobs, on 12 programs, for pages under 28 KiB and batches of
at least 16 jobs; device -> host and larger pages go through its C++
``cuMemcpyBatchAsync`` path. This baseline runs that kernel, unmodified, for ``load`` and
``load_layer``: the jobs are the transfer's contiguous runs (one per page and layer where
both sides hold a page contiguously), built once per point; the address arrays sit in
pinned host memory and vLLM's function moves them to the device on every call, as it does.

The source is not part of kvtier: `bench/scripts/fetch_baselines.sh` extracts that one
file from vLLM's wheel into ``.baselines/vllm/`` (git-ignored), which travels with the
working tree to an offline device (``KVTIER_VLLM_SWAP`` names another path). Where vLLM
itself is installed, its module is imported instead.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Optional, Tuple

import torch

import kvtier.platforms as platforms

from kvtier.bench.pools import RowCopy
from kvtier.kernels.reference import layer_rows

from .workload import Prepared, Unsupported, Workload
from kvtier import caches

MODULE = "vllm.v1.kv_offload.cpu.swap_blocks_triton"
SWAP_ENV = "KVTIER_VLLM_SWAP"
DEFAULT_PATH = Path(__file__).resolve().parent.parent / ".baselines" / "vllm" / "swap_blocks_triton.py"
OPS = ("load", "load_layer")      # vLLM runs the kernel host -> device only
MAX_CHUNK = 8192                  # vLLM's cap on the kernel's bytes per step


def applies(op: str) -> bool:
    return op in OPS


def source_path() -> Path:
    return Path(os.environ.get(SWAP_ENV) or DEFAULT_PATH)


@caches.lru("bench.vllm_baseline.load_swap", bound="1", key="-", value="vLLM's swap module, or None",
            stale="not happen: imported once")
def load_swap() -> Optional[types.ModuleType]:
    """vLLM's swap module (installed vLLM, else the extracted file), or None."""
    if platforms.detect_platform() not in platforms.CUDA_RUNTIME:
        return None
    try:
        return importlib.import_module(MODULE)
    except Exception:    # vLLM absent, or built for another torch
        pass
    path = source_path()
    if not path.is_file():
        return None
    try:
        return _load_file(path)
    except Exception:
        return None


def status(device: torch.device) -> str:
    """"runs", or why the baseline does not run here."""
    if not platforms.on_cuda_runtime(device):
        return "vLLM's swap kernel addresses pinned host memory from a CUDA device: CUDA only"
    if load_swap() is not None:
        return "runs"
    return (f"no vLLM swap source at {source_path()} (run bench/scripts/fetch_baselines.sh "
            f"where PyPI is reachable)")


def _load_file(path: Path) -> types.ModuleType:
    """Execute the extracted file with the two vLLM modules it imports stood in for:
    ``vllm.triton_utils`` (Triton itself) and ``vllm._custom_ops`` (its C++ path, which this
    baseline never takes). The stand-ins are removed from ``sys.modules`` afterwards."""
    import triton
    import triton.language as tl

    def cpp_path(*args, **kwargs):
        raise Unsupported("vLLM's C++ swap path is not part of this baseline")

    names = ("vllm", "vllm._custom_ops", "vllm.triton_utils")
    saved = {n: sys.modules.get(n) for n in names}
    root = types.ModuleType("vllm")
    root.__path__ = []
    ops = types.ModuleType("vllm._custom_ops")
    ops.swap_blocks_batch = cpp_path
    tu = types.ModuleType("vllm.triton_utils")
    tu.triton, tu.tl = triton, tl
    root._custom_ops, root.triton_utils = ops, tu
    try:
        sys.modules.update(zip(names, (root, ops, tu)))
        spec = importlib.util.spec_from_file_location("kvtier_bench_vllm_swap", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def jobs(t: RowCopy) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(source addresses, destination addresses, bytes) of the transfer's contiguous runs,
    int64 on the CPU: every row split where either side splits it (heads of ``page_head``),
    then consecutive pieces merged while both sides stay contiguous."""
    piece = min(t.src.chunk_bytes, t.dst.chunk_bytes)
    per_row = t.src.row_bytes // piece
    si, di = t.src_indices.long().cpu(), t.dst_indices.long().cpu()
    srcs, dsts = [], []
    for c in range(t.src.num_components):
        for l in range(t.num_layers):
            srcs.append(_piece_addresses(layer_rows(t.src, c, t.src_layer + l), si, piece, per_row))
            dsts.append(_piece_addresses(layer_rows(t.dst, c, t.dst_layer + l), di, piece, per_row))
    s, d = torch.cat(srcs), torch.cat(dsts)
    brk = (s[1:] != s[:-1] + piece) | (d[1:] != d[:-1] + piece)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), brk.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([s.numel()])])
    return s[starts].contiguous(), d[starts].contiguous(), ((ends - starts) * piece).contiguous()


def _piece_addresses(view: torch.Tensor, idx: torch.Tensor, piece: int, per_row: int) -> torch.Tensor:
    """Start address of each ``piece``-byte piece of rows ``idx`` of a layer view
    ``(pages, P, n_chunks, chunk_bytes)``, row by row."""
    _, P, _, chunk = view.shape
    ps, ts, cs, _ = view.stride()
    row = view.data_ptr() + (idx // P) * ps + (idx % P) * ts
    k = torch.arange(per_row) * piece
    return (row[:, None] + (k // chunk) * cs + k % chunk).flatten()


def prepare(w: Workload, op: str, swap=None) -> Prepared:
    swap = swap or load_swap()
    if not applies(op):
        raise Unsupported(f"vLLM runs its Triton swap kernel host -> device only, not for {op}")
    if swap is None or not platforms.on_cuda_runtime(w.device):
        raise Unsupported(status(w.device))
    src, dst, sizes = jobs(w.copy(op))
    if bool((sizes % 8).any()):
        raise Unsupported("vLLM's kernel copies whole 8-byte words")
    min_n = getattr(swap, "MIN_N", 16)
    if sizes.numel() < min_n:
        raise Unsupported(f"{sizes.numel()} jobs: vLLM takes its C++ path below {min_n}")
    chunk = min(1 << (int(sizes.max()) - 1).bit_length(), MAX_CHUNK)
    src, dst, sizes = (x.pin_memory() for x in (src, dst, sizes))
    fn = swap.swap_blocks_batch
    programs = min(getattr(swap, "NUM_SMS", 12), sizes.numel())
    return Prepared(lambda: fn(src, dst, sizes, bytes_per_chunk=chunk), programs=programs)
