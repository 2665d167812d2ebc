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
from .compat_ascend import (TransferDirection, TransferFlag, transfer_kv_dim_exchange,
                            transfer_kv_per_layer_dim_exchange)
from .compat_sglang import (transfer_kv_all_layer, transfer_kv_all_layer_direct_lf_pf,
                            transfer_kv_all_layer_lf_pf, transfer_kv_all_layer_lf_ph,
                            transfer_kv_all_layer_mla, transfer_kv_all_layer_mla_lf_pf,
                            transfer_kv_direct, transfer_kv_per_layer,
                            transfer_kv_per_layer_direct_pf_lf, transfer_kv_per_layer_mla,
                            transfer_kv_per_layer_mla_pf_lf, transfer_kv_per_layer_pf_lf,
                            transfer_kv_per_layer_ph_lf)

__all__ = [
    "transfer_kv_per_layer", "transfer_kv_per_layer_pf_lf", "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer", "transfer_kv_all_layer_lf_pf", "transfer_kv_all_layer_lf_ph",
    "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct", "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_all_layer_direct_lf_pf",
    "TransferDirection", "TransferFlag", "transfer_kv_dim_exchange",
    "transfer_kv_per_layer_dim_exchange",
]
