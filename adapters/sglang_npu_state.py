"""sgl_kernel_npu's Mamba/SSM state calls (``sgl_kernel_npu.kvcacheio``), on kvtier, as
SGLang's NPU Mamba host pool imports them.

Layouts (sgl_kernel_npu's): device state layer first ``(layers, slots, *state)``; host
state page first ``(slots, layers, 1, *state)``; one slot's state of one layer is a row.
Each call is the dim exchange of `kvtier.adapters.sglang_npu.transfer_kv_dim_exchange`
with one-slot pages: the state dims are viewed as one row (they must be dense, so no copy
is ever made behind the caller's back).

- ``transfer_mamba_state(device_buf, host_buf, device_indices, host_indices, direction)``:
  every layer of the listed slots, H2D or D2H;
- ``transfer_state_per_layer_direct_pf_lf(src, dst, src_indices, dst_indices, layer_id)``:
  host layer ``layer_id`` into one device layer ``dst`` ``(slots, *state)``;
- ``transfer_state_all_layer_direct_lf_pf(device_states, host_states, device_indices,
  host_indices)``: every layer of each listed device component into its host component.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from kvtier.errors import KvtierError, fail

from .sglang_npu import TransferDirection, TransferFlag, transfer_kv_dim_exchange

__all__ = ["transfer_mamba_state", "transfer_state_per_layer_direct_pf_lf",
           "transfer_state_all_layer_direct_lf_pf"]


def _as_rows(arg: str, t, lead: int, what: str, outer) -> torch.Tensor:
    """``t`` (``what``: its dims, ``lead`` of them before the state) viewed as ``(*outer, 1,
    1, E)``, its state dims one row of E elements, without a copy."""
    if not isinstance(t, torch.Tensor) or t.dim() <= lead or (lead == 3 and t.shape[2] != 1):
        raise fail(arg, tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__, f"must be {what}")
    try:
        return t.view(*outer(t), 1, 1, math.prod(t.shape[lead:]))
    except RuntimeError:
        raise fail(arg, (tuple(t.shape), t.stride()), "its state dims must be dense") from None


def _device(arg: str, t) -> torch.Tensor:
    """Device state ``(L, S, *state)`` as ``(L, S, 1, 1, E)``."""
    return _as_rows(arg, t, 2, "(layers, slots, *state)", lambda t: t.shape[:2])


def _host(arg: str, t) -> torch.Tensor:
    """Host state ``(S, L, 1, *state)`` as ``(S, L, 1, 1, E)``."""
    return _as_rows(arg, t, 3, "(slots, layers, 1, *state)", lambda t: t.shape[:2])


def _exchange(names, device, host, device_indices, host_indices, direction, flags, config, check,
              layer_start=0, layer_num=-1) -> None:
    """One dim exchange; errors name the caller's arguments, not the exchange's."""
    try:
        transfer_kv_dim_exchange(device_indices, host_indices, device, host, None, None,
                                 layer_start=layer_start, layer_num=layer_num, page_size=1,
                                 direction=direction, flags=flags, config=config, check=check)
    except KvtierError as e:
        msg = str(e)
        for ours, theirs in zip(("device_k", "host_k", "device_indices", "host_indices"), names):
            msg = msg.replace(ours, theirs)
        raise KvtierError(msg) from None


def transfer_mamba_state(device_buf: torch.Tensor, host_buf: torch.Tensor, device_indices: torch.Tensor,
                         host_indices: torch.Tensor, direction=TransferDirection.H2D,
                         *, config=None, check: Optional[bool] = None) -> None:
    """Every layer of slots ``device_indices[i]`` <-> ``host_indices[i]``, in ``direction``."""
    _exchange(("device_buf", "host_buf", "device_indices", "host_indices"),
              _device("device_buf", device_buf), _host("host_buf", host_buf),
              device_indices, host_indices, direction, TransferFlag.FAST2D, config, check)


def transfer_state_per_layer_direct_pf_lf(src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor,
                                          dst_indices: torch.Tensor, layer_id: int,
                                          flags=TransferFlag.FAST2D, *, config=None,
                                          check: Optional[bool] = None) -> None:
    """``dst[dst_indices[i]] = src[src_indices[i], layer_id, 0]``: one host layer into one
    device layer ``(slots, *state)``."""
    host = _host("src", src)
    if not isinstance(layer_id, int) or isinstance(layer_id, bool) or not 0 <= layer_id < host.shape[1]:
        raise fail("layer_id", layer_id, f"outside the {host.shape[1]} layers src holds")
    device = _as_rows("dst", dst, 1, "one device layer (slots, *state)", lambda t: (1, t.shape[0]))
    _exchange(("dst", "src", "dst_indices", "src_indices"), device, host[:, layer_id:layer_id + 1],
              dst_indices, src_indices, TransferDirection.H2D, flags, config, check)


def transfer_state_all_layer_direct_lf_pf(device_states: Sequence[torch.Tensor],
                                          host_states: Sequence[torch.Tensor],
                                          device_indices: torch.Tensor, host_indices: torch.Tensor,
                                          flags=TransferFlag.FAST2D, *, config=None,
                                          check: Optional[bool] = None) -> None:
    """Every layer of each ``device_states[c]`` slot into ``host_states[c]`` (a backup)."""
    for arg, v in (("device_states", device_states), ("host_states", host_states)):
        if isinstance(v, torch.Tensor) or not isinstance(v, (list, tuple)) or not v:
            raise fail(arg, type(v).__name__, "must be a non-empty list of tensors")
    if len(device_states) != len(host_states):
        raise fail("host_states", len(host_states), f"device_states lists {len(device_states)}; counts must match")
    for c, (d, h) in enumerate(zip(device_states, host_states)):
        _exchange((f"device_states[{c}]", f"host_states[{c}]", "device_indices", "host_indices"),
                  _device(f"device_states[{c}]", d), _host(f"host_states[{c}]", h),
                  device_indices, host_indices, TransferDirection.D2H, flags, config, check)
