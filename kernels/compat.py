"""Engine adapters: drop-in calls with the argument conventions engines already use.

- SGLang's ``sgl_kernel.kvcacheio`` transfers (`kvtier.kernels.compat_sglang`): per layer
  and all layers, the layer-first/page-first and page-head variants, MLA variants, and
  the direct (lists of tensors) variants.
- SGLang's Ascend ``sgl_kernel_npu.kvcacheio.transfer_kv_dim_exchange``
  (`kvtier.kernels.compat_ascend`).

A host pool swaps its io backend by importing these names from here instead of from
sgl_kernel / sgl_kernel_npu (README, Engine adapters). Every call validates its arguments before
any byte moves and raises `KvtierError` (a ValueError) naming the bad argument.
"""
from . import compat_ascend, compat_sglang
from .compat_ascend import *  # noqa: F401,F403  (names listed in compat_ascend.__all__)
from .compat_sglang import *  # noqa: F401,F403  (names listed in compat_sglang.__all__)

# One list of names, kept by the modules that define them.
__all__ = compat_sglang.__all__ + compat_ascend.__all__
