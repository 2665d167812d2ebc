"""SGLang's sgl_kernel transfer functions as a baseline, when sgl_kernel is importable.

Covers what those functions address directly: the layer_first host layout with token
indices, for backup (all layers), load (one layer) and load (all layers); K/V pools
(two components) through the MHA functions and single-component pools through the
MLA ones. The launch uses sgl_kernel's default block quota (its programs per launch).
"""
from __future__ import annotations

import importlib
import inspect

import torch

import kvtier.platforms as platforms

from kvtier.kernels.ops import Op

from .workload import Prepared, Unsupported, Workload
from kvtier import caches

BLOCK_QUOTA = 2   # sgl_kernel's default: at most this many blocks per launch
# Why the baseline is absent where sgl_kernel does not import (docs/benchmarks.md):
ABSENT = ("sgl_kernel is not importable here; its published wheel (sgl-kernel 0.3.21: 536 MB, the "
          "sm_90 kvcacheio library alone 361 MB) exceeds what reaches an offline device, and it is "
          "built against torch 2.9.1 only")


@caches.lru("bench.sgl_baseline.load_kvcacheio", bound="1", key="-", value="sgl_kernel's kvcacheio module, or None",
            stale="not happen: imported once")
def load_kvcacheio():
    """sgl_kernel's kvcacheio module if it imports and has the API this baseline calls
    (item_size in bytes, no io_backend argument), else None."""
    try:
        mod = importlib.import_module("sgl_kernel.kvcacheio")
    except Exception:   # missing, or built for another torch / CUDA
        return None
    fn = getattr(mod, "transfer_kv_all_layer", None)
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    return mod if "item_size" in params and "io_backend" not in params else None


def _pointers(tensors, device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64, device=device)


def prepare(w: Workload, op: str, kvio=None) -> Prepared:
    kvio = kvio or load_kvcacheio()
    if kvio is None:
        raise Unsupported("sgl_kernel is not importable (or has another API)")
    s = w.shape
    if not Op.parse(op).crosses_link:
        raise Unsupported(f"no sgl_kernel function for {op}")
    if not platforms.on_cuda_runtime(w.device):
        raise Unsupported("sgl_kernel runs on CUDA/ROCm devices only")
    if s.layout != "layer_first":
        raise Unsupported("this baseline drives sgl_kernel's layer_first functions only")
    if s.components > 2:
        raise Unsupported(f"no sgl_kernel function for {op} with {s.components} components")
    L, R = s.layers, s.row_bytes
    dev = w.device_layers
    host = [[w.host[c, l] for l in range(L)] for c in range(s.components)]
    hi, di = w.host_slots.long(), w.device_slots.long()
    if op == "load_layer":      # the last layer's tensors
        name, src, dst, si, ti, sizes = "per_layer", [h[L - 1] for h in host], [d[L - 1] for d in dev], hi, di, (R,)
    else:                       # pointer tables, device -> host for a backup
        src, dst, si, ti = (dev, host, di, hi) if op == "backup" else (host, dev, hi, di)
        name, sizes = "all_layer", (R, L)
        src, dst = [_pointers(x, w.device) for x in src], [_pointers(x, w.device) for x in dst]
    fn = getattr(kvio, f"transfer_kv_{name}" + ("_mla" if s.components == 1 else ""))
    tensors = [x for pair in zip(src, dst) for x in pair]       # (src_k, dst_k, src_v, dst_v)
    return Prepared(lambda: fn(*tensors, si, ti, *sizes, block_quota=BLOCK_QUOTA), programs=BLOCK_QUOTA)
