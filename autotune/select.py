"""The hot-path lookup: which configuration one transfer uses.

Pools call `select_config` for every transfer, so after the first call for a given
transfer shape and size bucket it is one dictionary hit: the device's cache file is read
once per process, and every resolved answer is memoised. Resolution: the exact key, else
the nearest tuned bucket of the same operation, row size and page size (distance in
powers of two of rows and layers; the same link setting first), else the shipped default for the platform. Nothing
is tuned here.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from kvtier.config import CopyConfig
from kvtier.platforms import default_config
from kvtier.kernels.ops import Op

from . import cache
from .key import DeviceId, TuneKey, device_identity, rows_bucket
from kvtier import caches

# Answers by their arguments, dropped by `invalidate` (docs/design.md, "Caches").
_RESOLVED = caches.bounded("autotune.select._RESOLVED", 4096,
                           key="op, platform, device identity, row bytes, page size, rows bucket, layers, link",
                           value="configuration", rule="invalidate() (a new tuning result; bumps EPOCH)",
                           stale="use an older configuration (speed, never bytes)")
_BY_DEVICE = caches.bounded("autotune.select._BY_DEVICE", 4096, key="op, torch device, row bytes, page size, rows, "
                            "layers", value="config_for's answer", rule="invalidate()", stale="as _RESOLVED")
_TUNED = caches.bounded("autotune.select._TUNED", 64, key="device identity", value="the device's tuned results, "
                         "read once from its cache file", rule="invalidate()", stale="as _RESOLVED")
# The tuning epoch, bumped by `invalidate`: whoever keeps a looked-up configuration (a
# prepared transfer's steps) compares ``EPOCH[0]`` with the one it looked up under, and
# looks up again when it moved on.
EPOCH = [0]


class TunedResults:
    """The tuned results of one device, indexed for exact and nearest-bucket lookups."""

    def __init__(self, results: Dict[TuneKey, CopyConfig]):
        self.exact = dict(results)
        self.families: Dict[tuple, list] = {}
        for k, cfg in results.items():
            self.families.setdefault(_family(k), []).append((k, cfg))

    def lookup(self, key: TuneKey) -> Tuple[Optional[CopyConfig], str]:
        """(config, "exact" | "nearest") or (None, "default")."""
        cfg = self.exact.get(key)
        if cfg is not None:
            return cfg, "exact"
        near = self.families.get(_family(key))
        if not near:
            return None, "default"
        # Ties go to the larger bucket: a config tuned for more rows keeps the link busy.
        best = min(near, key=lambda kc: (_distance(kc[0], key), -kc[0].rows_bucket, -kc[0].num_layers))
        return best[1], "nearest"


def _family(k: TuneKey) -> tuple:
    return (k.op, k.row_bytes, k.page_size)


def _distance(a: TuneKey, b: TuneKey) -> float:
    # A result measured with the other link setting is used only when no other is there
    # (on CPU, pools see no link at all for the operations the tuner measured across one).
    return (abs(math.log2(a.rows_bucket) - math.log2(b.rows_bucket))
            + abs(math.log2(max(a.num_layers, 1)) - math.log2(max(b.num_layers, 1)))
            + (1000 if a.crosses_link != b.crosses_link else 0))


def config_for(op, device, *, row_bytes: int, page_size: int, num_rows: int,
               num_layers: int) -> CopyConfig:
    """The configuration for one transfer ``op`` (an `Op` or its name) on torch ``device``:
    the lookup every pool, adapter and benchmark launch goes through."""
    key = (op, device, row_bytes, page_size, rows_bucket(num_rows), num_layers)
    cfg = _BY_DEVICE.get(key)
    if cfg is None:
        op = Op.parse(op)
        platform, name = _identity(device)
        cfg = _BY_DEVICE.put(key, select_config(
            op.name, platform, row_bytes=row_bytes, page_size=page_size, num_rows=num_rows,
            num_layers=num_layers, crosses_link=op.crosses_link, device_name=name))
    return cfg


@caches.lru("autotune.select._identity", bound="devices present", key="torch device (with its index)",
            value="(platform, device name)", stale="not happen: a device's name does not change")
def _identity(device) -> Tuple[str, str]:
    from kvtier.platforms import device_name, platform_of
    return platform_of(device), device_name(device)


def select_config(op: str, platform: str, *, row_bytes: int, page_size: int, num_rows: int,
                  num_layers: int, crosses_link: bool, device_name: str = "") -> CopyConfig:
    """The configuration for one transfer: tuned for this device if `kvtier autotune` has
    measured it (exact key or nearest bucket), else `default_config(platform, crosses_link)`."""
    op = Op.parse(op).name
    q = (op, platform, device_name, row_bytes, page_size, rows_bucket(num_rows), num_layers, crosses_link)
    return _RESOLVED.get_or_make(q, lambda: resolve(op, platform, row_bytes=row_bytes, page_size=page_size,
                                                    num_rows=num_rows, num_layers=num_layers,
                                                    crosses_link=crosses_link, device_name=device_name)[0])


def resolve(op: str, platform: str, *, row_bytes: int, page_size: int, num_rows: int, num_layers: int,
            crosses_link: bool, device_name: str = "") -> Tuple[CopyConfig, str]:
    """(config, source) without memoisation; source is "exact", "nearest" or "default"."""
    key = TuneKey.of(Op.parse(op).name, row_bytes=row_bytes, page_size=page_size, num_rows=num_rows,
                     num_layers=num_layers, crosses_link=crosses_link)
    device = _device(platform, device_name)
    if device is not None:
        # (the device's results, read from its cache file once per process)
        cfg, source = _TUNED.get_or_make(device, lambda: TunedResults(cache.load(device))).lookup(key)
        if cfg is not None:
            return cfg, source
    return default_config(platform, crosses_link=crosses_link), "default"


def _device(platform: str, device_name: str) -> Optional[DeviceId]:
    try:
        here = device_identity(platform)
    except Exception:          # no such device here: only a named device can be looked up
        here = None
    if here is not None and device_name in ("", here.name):
        return here
    return DeviceId(platform, device_name, "") if device_name else None


def invalidate() -> None:
    """Forget what was read and resolved (after tuning, or when the cache dir changes)."""
    EPOCH[0] += 1
    _RESOLVED.clear()
    _BY_DEVICE.clear()
    _TUNED.clear()
