"""Every pool transfer ends here: one `copy_rows` launch with the configuration that
`kvtier.autotune.select_config` picks for the device and transfer size."""
from __future__ import annotations

from functools import lru_cache

import torch

from kvtier.autotune import select_config
from kvtier.kernels import CopyConfig, RowMap, copy_rows
from kvtier.kernels.validate import compute_device


def platform_of(device: torch.device) -> str:
    if device.type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return device.type


@lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return ""


def config_for(op: str, device: torch.device, m: RowMap, n_rows: int, num_layers: int,
               crosses_link: bool) -> CopyConfig:
    """The hot-path lookup: ``select_config`` for one transfer of ``n_rows`` rows of ``m``."""
    return select_config(op, platform_of(device), row_bytes=m.row_bytes, page_size=m.page_size,
                         num_rows=n_rows, num_layers=num_layers, crosses_link=crosses_link,
                         device_name=_device_name(device))


def run_copy(op: str, src: RowMap, si: torch.Tensor, dst: RowMap, di: torch.Tensor, *,
             src_layer: int = 0, dst_layer: int = 0, num_layers: int, by_page: bool = False,
             config: CopyConfig = None) -> None:
    """``copy_rows`` on indices the pool has already validated (no device sync)."""
    if config is None:
        config = config_for(op, compute_device(src, dst), src, si.numel(), num_layers,
                            src.device.type != dst.device.type)
    copy_rows(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers,
              by_page=by_page, config=config, check=False)
