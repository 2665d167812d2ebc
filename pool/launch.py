"""The configuration of every pool and adapter copy: the one `kvtier.autotune.config_for`
picks for the operation, device and transfer size (or the caller's, or the one `forced`
imposes), the bound row copy for it (`bind_launch`), and one DEBUG line on the
``kvtier`` logger per launch saying what ran (op, scope, strategy, config, rows, bytes).
Launches themselves go through `kvtier.kernels.copy_rows.run`, which checks the index
lists; `launch` is a one-copy call for lists that come once."""
from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Optional

import torch

from kvtier.autotune.select import config_for
from kvtier.autotune.select import _GENERATION  # generation(), read inline on the hot path
from kvtier.kernels import CopyConfig, RowMap, faults
from kvtier.kernels.copy_rows import BY_VERDICT, BoundCopy, bind, run
from kvtier.kernels.index_check import Checks
from kvtier.kernels.ops import Op
from kvtier.kernels.validate import compute_device

log = logging.getLogger("kvtier")
DEBUG = _DEBUG = logging.DEBUG
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
           verdict: Optional[torch.Tensor] = None, checks: Optional[Checks] = None,
           skip_negative: bool = False, whole: tuple = (1, 1)) -> None:
    """One copy between two maps at validated index lists (no device sync), with the tuned
    configuration, logged. ``strategy`` names the pool strategy the copy is part of (the
    dma path's staging copies); ``verdict``: the words a check launch of the same call
    wrote (the copy moves nothing unless word 0 is 0); ``checks``: the lists' checks,
    made by this launch (`kvtier.kernels.copy_rows.run`); neither: unchecked (lists
    kvtier made itself); ``skip_negative`` skips pairs holding a negative index."""
    if si.numel() == 0 or num_layers == 0:
        return
    bound = bind_launch(op, src, dst, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers,
                        n_rows=si.numel(), by_page=by_page, config=config, skip_negative=skip_negative, whole=whole)
    if log.isEnabledFor(_DEBUG):
        log_launch(op, strategy or bound.config.strategy, bound.config, si.numel(), si.numel() * bound.op_bytes)
    sides = bound.sides(src, dst)
    if verdict is not None:
        faults.raise_pending()
        if bound.runner == "kernel":
            bound(si, di, sides, BY_VERDICT, verdict)
        else:
            bound.reference(si, di, src, dst)
        return
    run((bound,), (sides,), si, di, checks, bound.device, ((src, dst),))


def lookup_state() -> tuple:
    """What every `lookup` answer depends on besides its arguments (the forced
    configuration, the tuned results' generation): part of the key of anything that keeps
    an answer."""
    return (_FORCED.get(), _GENERATION[0])


def bind_launch(op: Op, src: RowMap, dst: RowMap, *, src_layer: int = 0, dst_layer: int = 0,
                num_layers: int, n_rows: int, by_page: bool = False, config: Optional[CopyConfig] = None,
                skip_negative: bool = False, whole: tuple = (1, 1), tables: tuple = (False, False)) -> BoundCopy:
    """The `BoundCopy` for copying about ``n_rows`` rows between maps of ``src``'s and
    ``dst``'s layouts with the configuration `lookup` picks (or ``config``)."""
    if config is None:
        config = lookup(op, src, dst, n_rows, num_layers)
    return bind(src, dst, src_layer=src_layer, dst_layer=dst_layer, num_layers=num_layers, by_page=by_page,
                config=config, device=compute_device(src, dst), n_rows=n_rows, skip_negative=skip_negative,
                whole=whole, tables=tables)


def log_launch(op: Op, strategy: str, config: CopyConfig, rows: int, nbytes: int) -> None:
    log.debug("launch op=%s scope=%s strategy=%s config=%s rows=%d bytes=%d", op.name, op.scope,
              strategy, config.to_dict(), rows, nbytes)
