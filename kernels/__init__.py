"""kvtier.kernels: the row-copy kernel family and the descriptors it reads.

Importing this package never imports Triton, torch_npu or a GPU runtime; the kernel
module loads Triton on first use and falls back to the torch reference (with one
warning) where Triton cannot run.
"""
from .rowmap import RowMap, LAYOUTS
from .config import CopyConfig, default_config
from .copy_rows import copy_rows, KvtierError
from .reference import copy_rows_reference

__all__ = [
    "RowMap", "LAYOUTS", "CopyConfig", "default_config",
    "copy_rows", "copy_rows_reference", "KvtierError",
]
