"""Engine adapters: drop-in calls with the argument conventions engines already use.

- SGLang's ``sgl_kernel.kvcacheio`` transfers (`kvtier.adapters.sglang`): per layer
  and all layers, the layer-first/page-first and page-head variants, MLA variants, and
  the direct (lists of tensors) variants.
- SGLang's Ascend ``sgl_kernel_npu.kvcacheio.transfer_kv_dim_exchange``
  (`kvtier.adapters.sglang_npu`).

- ``kvtier.adapters.sglang_install.install()``: SGLang's HiCache transfers routed through
  kvtier (docs/engines/sglang.md).
- ``kvtier.adapters.vllm``: vLLM's CPU offloading worker and handler (docs/engines/vllm.md).
- ``kvtier.adapters.lmcache``: LMCache's multi-layer KV transfer (docs/engines/lmcache.md).

These three are imported where used (vLLM's and SGLang's own modules are imported only
when asked for). Every call validates its arguments before any byte moves and raises
`KvtierError` (a ValueError and a RuntimeError) naming the bad argument.
"""
from . import sglang, sglang_npu
from .sglang_npu import *  # noqa: F401,F403  (names listed in sglang_npu.__all__)
from .sglang import *  # noqa: F401,F403  (names listed in sglang.__all__)

# One list of names, kept by the modules that define them.
__all__ = sglang.__all__ + sglang_npu.__all__
