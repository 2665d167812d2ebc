"""Every pool and adapter copy launches here: the configuration that
`kvtier.autotune.config_for` picks for the operation, device and transfer size (or the
caller's), one `copy_rows` on indices the caller has already validated, and one DEBUG
line on the ``kvtier`` logger saying what ran (op, scope, strategy, config, rows, bytes)."""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Optional

import torch

from kvtier.autotune import config_for
from kvtier.kernels import CopyConfig, RowMap
from kvtier.kernels.copy_rows import copy_validated
from kvtier.kernels.ops import Op
from kvtier.kernels.validate import compute_device

log = logging.getLogger("kvtier")
_FORCED: ContextVar[Optional[CopyConfig]] = ContextVar("kvtier_forced_config", default=None)


class forced:
    """``with forced(config):`` every lookup inside the block answers ``config``, so the
    autotuner and the benchmark time the pools' own calls under the configuration they
    measure (a context variable: other threads and tasks keep their lookups)."""

    def __init__(self, config: CopyConfig):
        self.config = config

    def __enter__(self) -> CopyConfig:
        self._token = _FORCED.set(self.config)
        return self.config

    def __exit__(self, *exc) -> None:
        _FORCED.reset(self._token)


def lookup(op: Op, src: RowMap, dst: RowMap, n_rows: int, num_layers: int) -> CopyConfig:
    """The configuration for moving ``n_rows`` rows of ``num_layers`` layers from src to dst
    (the forced one inside `forced`)."""
    config = _FORCED.get()
    if config is not None:
        return config
    return config_for(op, compute_device(src, dst), row_bytes=src.row_bytes, page_size=src.page_size,
                      num_rows=n_rows, num_layers=num_layers)


def launch(op: Op, src: RowMap, si: torch.Tensor, dst: RowMap, di: torch.Tensor, *,
           src_layer: int = 0, dst_layer: int = 0, num_layers: int, by_page: bool = False,
           config: Optional[CopyConfig] = None, strategy: Optional[str] = None,
           verdict: Optional[torch.Tensor] = None, skip_negative: bool = False) -> None:
    """``copy_rows`` on validated indices (no device sync), with the tuned configuration.
    ``strategy`` names the pool strategy the copy is part of (the dma path's gather);
    ``verdict`` is the word the caller's device-side index check wrote (the copy moves
    nothing unless it is 0); ``skip_negative`` skips pairs holding a negative index."""
    if config is None:
        config = lookup(op, src, dst, si.numel(), num_layers)
    if log.isEnabledFor(logging.DEBUG):
        log_launch(op, strategy or config.strategy, config, si.numel(),
                   si.numel() * src.row_bytes * num_layers * src.num_components)
    copy_validated(src, si, dst, di, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers,
                   by_page=by_page, config=config, device=compute_device(src, dst), verdict=verdict,
                   skip_negative=skip_negative)


def log_launch(op: Op, strategy: str, config: CopyConfig, rows: int, nbytes: int) -> None:
    log.debug("launch op=%s scope=%s strategy=%s config=%s rows=%d bytes=%d", op.name, op.scope,
              strategy, config.to_dict(), rows, nbytes)
