"""kvtier.autotune: per-device configuration search and its persistent results.

`select_config` is the hot-path lookup the pools call for every transfer.
"""
from __future__ import annotations

from kvtier.kernels.config import CopyConfig, default_config


def select_config(op: str, platform: str, *, row_bytes: int, page_size: int, num_rows: int,
                  num_layers: int, crosses_link: bool, device_name: str = "") -> CopyConfig:
    """The configuration to use for one transfer (placeholder until tuning lands: the
    shipped default for the platform)."""
    return default_config(platform, crosses_link=crosses_link)
