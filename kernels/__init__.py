"""kvtier.kernels: the row-copy kernel family and the descriptors it reads.

Importing this package imports neither Triton nor torch_npu nor a GPU runtime: the
kernel module (and with it Triton) loads on the first launch of `copy_rows`, so a program can
still choose Triton's interpreter (TRITON_INTERPRET=1) after importing kvtier. Where
Triton cannot run, copies fall back to the torch reference with one warning.
"""
# platforms first: it keeps `import torch` from auto-loading torch_npu (see kvtier.platforms).
import kvtier.platforms  # noqa: F401
from kvtier.config import CopyConfig, Space
from .launcher import synchronize
from .transfer import Copy, Transfer, copy_rows
from kvtier.errors import KvtierError
from .reference import copy_rows_reference
from .layouts import NAMES as LAYOUTS, HostLayout, host_layout
from .ops import OPS, Op
from .rowmap import RowMap

__all__ = [
    "RowMap", "LAYOUTS", "HostLayout", "host_layout", "OPS", "Op", "CopyConfig", "Space", "default_config",
    "copy_rows", "copy_rows_reference", "synchronize", "KvtierError", "Transfer", "Copy",
]


def __getattr__(name):
    # The shipped defaults live in each platform's record; kvtier.platforms imports this
    # package's config module, so the name is looked up when first asked for.
    if name == "default_config":
        from kvtier.platforms import default_config
        return default_config
    raise AttributeError(f"module 'kvtier.kernels' has no attribute {name!r}")
