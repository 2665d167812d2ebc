"""kvtier.kernels: the row-copy kernel family and the descriptors it reads.

Importing this package imports neither Triton nor torch_npu nor a GPU runtime: the
kernel module (and with it Triton) loads on the first launch of `copy_rows`, so a program can
still choose Triton's interpreter (TRITON_INTERPRET=1) after importing kvtier. Where
Triton cannot run, copies fall back to the torch reference with one warning.
"""
# platforms first: it keeps `import torch` from auto-loading torch_npu (see kvtier.platforms).
import kvtier.platforms  # noqa: F401
from .config import CopyConfig, default_config
from .copy_rows import copy_rows
from .errors import KvtierError
from .reference import copy_rows_reference
from .rowmap import LAYOUTS, RowMap

__all__ = [
    "RowMap", "LAYOUTS", "CopyConfig", "default_config",
    "copy_rows", "copy_rows_reference", "KvtierError",
]
