"""Engine adapters: drop-in calls with the argument conventions engines already use.

- SGLang's ``sgl_kernel.kvcacheio`` transfers (`kvtier.adapters.sglang`): per layer
  and all layers, the layer-first/page-first and page-head variants, MLA variants, and
  the direct (lists of tensors) variants.
- SGLang's Ascend ``sgl_kernel_npu.kvcacheio.transfer_kv_dim_exchange``
  (`kvtier.adapters.sglang_npu`).

A host pool swaps its io backend by importing these names from here instead of from
sgl_kernel / sgl_kernel_npu (docs/adapters.md). Every call validates its arguments before
any byte moves and raises `KvtierError` (a ValueError) naming the bad argument.
"""
from . import sglang, sglang_npu
from .sglang_npu import *  # noqa: F401,F403  (names listed in sglang_npu.__all__)
from .sglang import *  # noqa: F401,F403  (names listed in sglang.__all__)

# One list of names, kept by the modules that define them.
__all__ = sglang.__all__ + sglang_npu.__all__
