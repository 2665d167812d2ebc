"""Every pool and adapter copy launches here: the configuration that
`kvtier.autotune.config_for` picks for the operation, device and transfer size (or the
caller's), one bound row copy (`kvtier.kernels.copy_rows.BoundCopy`) on indices the
caller has already validated, and one DEBUG line on the ``kvtier`` logger saying what ran
(op, scope, strategy, config, rows, bytes). `run_bound` is the one place every launch
passes; callers that keep a bound copy across calls (`bind_launch`) call it directly."""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Optional

import torch

from kvtier.autotune import config_for
from kvtier.autotune.select import _GENERATION  # generation(), read inline on the hot path
from kvtier.kernels import CopyConfig, RowMap
from kvtier.kernels.copy_rows import BoundCopy, bind
from kvtier.kernels.storage_watch import check_storage
from kvtier.kernels.ops import Op
from kvtier.kernels.validate import compute_device

log = logging.getLogger("kvtier")
_DEBUG = logging.DEBUG
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
           verdict: Optional[torch.Tensor] = None, skip_negative: bool = False, keep: bool = True) -> None:
    """``copy_rows`` on validated indices (no device sync), with the tuned configuration.
    ``strategy`` names the pool strategy the copy is part of (the dma path's gather);
    ``verdict`` is the word the caller's device-side index check wrote (the copy moves
    nothing unless it is 0); ``skip_negative`` skips pairs holding a negative index;
    ``keep=False``: a map that will not come again (its bound copy is not kept)."""
    if si.numel() == 0 or num_layers == 0:
        return
    bound = bind_launch(op, src, dst, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers,
                        n_rows=si.numel(), by_page=by_page, config=config, skip_negative=skip_negative,
                        keep=keep)
    run_bound(op, bound, si, di, verdict, strategy)


def lookup_state() -> tuple:
    """What every `lookup` answer depends on besides its arguments (the forced
    configuration, the tuned results' generation): part of the key of anything that keeps
    an answer."""
    return (_FORCED.get(), _GENERATION[0])


def bind_launch(op: Op, src: RowMap, dst: RowMap, *, src_layer: int = 0, dst_layer: int = 0,
                num_layers: int, n_rows: int, by_page: bool = False, config: Optional[CopyConfig] = None,
                skip_negative: bool = False, keep: bool = True) -> BoundCopy:
    """The `BoundCopy` a `launch` with these arguments (about ``n_rows`` indices) makes,
    for a caller that keeps it and runs it with `run_bound`."""
    if config is None:
        config = lookup(op, src, dst, n_rows, num_layers)
    return bind(src, dst, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers, by_page=by_page,
                config=config, device=compute_device(src, dst), n_rows=n_rows, skip_negative=skip_negative,
                keep=keep)


def run_bound(op: Op, bound: BoundCopy, si: torch.Tensor, di: torch.Tensor,
              verdict: Optional[torch.Tensor] = None, strategy: Optional[str] = None,
              watched: bool = False, dst_buffer: Optional[torch.Tensor] = None,
              src_buffer: Optional[torch.Tensor] = None) -> None:
    """`launch` for a kept `BoundCopy` (only the indices and the verdict are new);
    ``watched``: its tensors' storage was checked by the caller (`check_storage`);
    ``dst_buffer`` / ``src_buffer``: the buffer of a copy bound to a destination / source
    layout."""
    if log.isEnabledFor(_DEBUG):
        src = bound.origin[0]
        log_launch(op, strategy or bound.config.strategy, bound.config, si.numel(),
                   si.numel() * src.row_bytes * bound.num_layers * src.num_components)
    bound(si, di, verdict, watched, dst_buffer, src_buffer)


def run_all(op: Op, bounds, si: torch.Tensor, di: torch.Tensor, verdict: Optional[torch.Tensor] = None,
            dst_buffers=None, src_buffers=None) -> None:
    """`run_bound` for the launches of one call: every tensor they rest on is checked
    first (`check_storage`), so a moved tensor is named before the first byte moves;
    ``dst_buffers`` / ``src_buffers``: one buffer per copy bound to a destination / source
    layout."""
    for bound in bounds:
        check_storage(bound.watch)
    if dst_buffers is not None:
        for bound, buf in zip(bounds, dst_buffers):
            run_bound(op, bound, si, di, verdict, None, True, buf)
    elif src_buffers is not None:
        for bound, buf in zip(bounds, src_buffers):
            run_bound(op, bound, si, di, verdict, None, True, None, buf)
    else:
        for bound in bounds:
            run_bound(op, bound, si, di, verdict, None, True)      # watched above


def log_launch(op: Op, strategy: str, config: CopyConfig, rows: int, nbytes: int) -> None:
    log.debug("launch op=%s scope=%s strategy=%s config=%s rows=%d bytes=%d", op.name, op.scope,
              strategy, config.to_dict(), rows, nbytes)
