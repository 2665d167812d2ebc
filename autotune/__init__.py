"""kvtier.autotune: per-device configuration search and its persistent results.

- `select_config`: the hot-path lookup pools call for every transfer (a dictionary hit;
  tuned result for this device, nearest size bucket, or the shipped default).
- `tune`: measure the candidate configurations of a pool shape and record the winners
  (what `kvtier autotune` runs).

Modules: key (what a result is keyed by), space (candidates), prune (spill pruning via
the codegen report), timing (device timers), shape (the pool shape a run stands for), search (the
tuning loop), cache (the JSON file per device), select (the lookup), report (tables).
The search modules import torch-heavy code only when `tune` is used.
"""
from __future__ import annotations

from .select import config_for, select_config, resolve, invalidate
from .key import TuneKey, DeviceId, rows_bucket

__all__ = ["config_for", "select_config", "resolve", "invalidate", "tune", "PoolShape", "TuneKey", "DeviceId",
           "rows_bucket"]


def __getattr__(name):
    # The search and the shape pull in torch-heavy code; load them on first use.
    if name == "tune":
        from .search import tune
        return tune
    if name == "PoolShape":
        from .shape import PoolShape
        return PoolShape
    raise AttributeError(name)
