"""The launch configuration of every pool and adapter transfer.

A prepared transfer (`kvtier.kernels.Transfer`) asks its owner once per size class which
configuration and strategy each of its copies takes (`resolver`): the one its owner
fixed (a pool's ``config``: what the autotuner and the benchmark time; an adapter call's
``config=``), else the one `kvtier.autotune.config_for` picks for the operation, device
and transfer size. The answer is kept in the transfer until the tuning epoch
(`kvtier.autotune.select.EPOCH`, bumped when new results are read or a pool's fixed
configuration changes) moves on.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Tuple

from kvtier.autotune.select import EPOCH, config_for
from kvtier.config import CopyConfig
from kvtier.kernels.ops import Op
from kvtier.kernels.rowmap import RowMap
from kvtier.kernels.transfer import Copy
from kvtier.kernels.validate import compute_device

__all__ = ["EPOCH", "tuned", "resolver", "new_epoch", "FixedConfig"]

Resolve = Callable[[Copy, int], Tuple[CopyConfig, str]]


def tuned(op: Op, copy: Copy, n: int) -> CopyConfig:
    """The tuned configuration (or the platform default) for ``n`` rows of ``copy``."""
    return tuned_for(op, copy.src, copy.dst, n, copy.num_layers)


def tuned_for(op: Op, src: RowMap, dst: RowMap, n: int, num_layers: int) -> CopyConfig:
    """The tuned configuration for ``n`` rows of ``src``'s geometry over ``num_layers``."""
    return config_for(op, compute_device(src, dst), row_bytes=src.row_bytes, page_size=src.page_size,
                      num_rows=n, num_layers=num_layers)


def resolver(op: Op, fixed: Callable[[], Optional[CopyConfig]] = lambda: None,
             strategy: Callable[[CopyConfig], str] = lambda config: "kernel",
             programs: Optional[int] = None) -> Resolve:
    """A transfer's ``resolve`` for operation ``op``: ``fixed()`` where it names a
    configuration, else the tuned one; ``strategy(config)`` says how the copy crosses
    (the pools' kernel or dma); ``programs`` caps the grid (SGLang's ``block_quota``)."""
    def resolve(copy: Copy, n: int) -> Tuple[CopyConfig, str]:
        config = fixed() or tuned(op, copy, n)
        if programs is not None:
            config = replace(config, num_programs=programs)
        return config, strategy(config)
    return resolve


def new_epoch() -> None:
    """Make every prepared transfer resolve its configurations again (a fixed
    configuration changed; the tuned results read stay)."""
    EPOCH[0] += 1


class FixedConfig:
    """A pool's fixed launch configuration, as a data descriptor: None (the tuned one), or
    the `CopyConfig` every transfer of the pool launches with (what the autotuner and the
    benchmark time the pool's own calls under). Setting another one moves the tuning
    epoch on, so the pool's prepared transfers resolve their steps again."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.attr = name, f"_{name}"

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.attr, None)

    def __set__(self, obj, config: Optional[CopyConfig]) -> None:
        if config is not None and not isinstance(config, CopyConfig):
            from kvtier.errors import fail
            raise fail(self.name, type(config).__name__, "must be a kvtier CopyConfig or None (the tuned one)")
        if config != getattr(obj, self.attr, None):
            setattr(obj, self.attr, config)
            new_epoch()
